"""GPU check: the HF backend and OPD training steps on CUDA (absolute numbers), and the vLLM GPU tests where vllm imports.

Run from the repository root (``benchmarks/gpu_check.sh`` first provides pydantic where the machine lacks it):

    python3 benchmarks/gpu_check.py --out results/gpu_check.json

For each model pair (``demo``: the cpu-demo student and teacher; ``wide``: hidden 1024 × 8 layers for
both) it measures, on the GPU, in float32 with TF32 off:

* generation: ``HFBackend.generate`` of ``--prompts`` prompts × ``--samples`` samples, ``--new-tokens``
  new tokens each (temperature 1, seeded), as generated tokens per second;
* teacher scoring (log-probs and full distributions, as the demo's ``opd`` full estimator needs);
* the learner: ``opd_harness.trainers.learner.train_step`` with ``opd`` (full reverse KL) and AdamW on that batch,
  seconds per step (mean of ``--steps`` steps after one warm-up step) and peak allocated memory;
* log-probs of the batch scored by the student on the GPU against the same student on the CPU:
  the largest absolute difference must be at most ``--tolerance`` (1e-4).

Then, where ``import vllm`` works, it runs ``pytest -m gpu tests/test_vllm_backend.py`` (vLLM
against the HF backend) and records the outcome; elsewhere it records why it skipped them.

The Ray part (``"ray"`` in the JSON): a ``harness run --executor ray`` of ``--ray-steps`` async steps (opd, ``max_lag`` 1,
the smoke preset's models) on a local Ray whose learner, rollout and teacher actors share the one GPU through fractional
``trainer.layout.<role>.num_gpus`` (0.4, 0.3, 0.3): exit code, steps stored, each actor's GPU ids from the run's placement,
and per step ``sync_seconds``, ``sync_bytes`` and ``time_step_s``. Without CUDA (the dry mode) it only plans that run
(``harness run … --dry-run --json``) and says it has not run on a GPU; without Ray it says ``skipped: ray not installed``.

Without CUDA, or with ``--dry-run``, it runs the same code on the CPU at toy sizes with the demo
models only, says which GPU parts it skipped, and writes ``"mode": "dry"``: CI runs it so (see
``tests/test_gpu_check.py``). The JSON goes to ``--out`` (default ``$OUT/gpu_check.json`` when
``$OUT`` is set, else ``results/gpu_check.json``). Exit code 0: every check passed; 1: a check
failed (the JSON says which); 2: bad arguments.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from opd_harness.backends import Completion, SamplingParams  # noqa: E402
from opd_harness.backends.hf import HFBackend  # noqa: E402
from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model, count_parameters  # noqa: E402
from opd_harness.trajectory import TensorBatch  # noqa: E402
from opd_harness.trainers.learner import train_step  # noqa: E402
from opd_harness.trainers.objectives.opd import OPD_SPEC, OPDParams  # noqa: E402

# The cpu-demo preset's models (harness/presets/cpu-demo.yaml) and a wider pair for GPU-sized numbers.
MODEL_PAIRS: dict[str, tuple[TinyArch, TinyArch]] = {
    "demo": (TinyArch(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256), TinyArch(hidden=192, layers=3, heads=4, kv_heads=2, ffn=384)),
    "wide": (
        TinyArch(hidden=1024, layers=8, heads=16, kv_heads=8, ffn=4096),
        TinyArch(hidden=1024, layers=8, heads=16, kv_heads=8, ffn=4096),
    ),
}
DRY_SIZES = {"prompts": 4, "samples": 2, "new_tokens": 8, "steps": 1, "reference_rows": 4, "opd_steps": 2, "vocab_chunk": 5}
VLLM_TEST_TIMEOUT_S = 900
RAY_GPU_SHARES = {"learner": 0.4, "rollout": 0.3, "teacher": 0.3}  # one GPU shared by the three roles' actors
RAY_RUN_CAP_S = 420  # the Ray part's run (actor start-up included) is killed after this


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; argparse exits with code 2 on a bad one."""
    default_out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else ROOT / "results" / "gpu_check.json"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=default_out, help="where to write the JSON results")
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU at toy sizes even where CUDA is available")
    parser.add_argument("--models", nargs="*", choices=sorted(MODEL_PAIRS), default=["demo"],
                        help="float32 model pairs to measure (GPU against CPU log-probs); 'wide' adds a hidden-1024 pair")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=64, help="prompts per generation batch")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per sample")
    parser.add_argument("--steps", type=int, default=3, help="timed learner steps (after one warm-up step)")
    parser.add_argument("--reference-rows", type=int, default=32, help="rows of the batch scored on the CPU for the log-prob comparison")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed |GPU − CPU| log-prob difference")
    parser.add_argument("--bf16-tolerance", type=float, default=0.1,
                        help="largest allowed |hf_static − score| log-prob of a sampled token, bf16 shape models (nats)")  # fmt: skip
    parser.add_argument("--skip-vllm", action="store_true", help="do not run the vLLM GPU tests even where vllm imports")
    parser.add_argument("--skip-ray", action="store_true", help="do not run the Ray part (fractional GPUs, async steps)")
    parser.add_argument("--ray-steps", type=int, default=4, help="async steps of the Ray part's run")
    shapes = parser.add_argument_group("real shapes (bf16, random weights; harness/models/shapes.py)")
    shapes.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="shape archs to measure (none: skip the shape sections)")
    shapes.add_argument("--big-shapes", action="store_true", help=f"also {' and '.join(BIG_SHAPES)} (each within its section caps)")
    shapes.add_argument("--rollout-batches", type=int, nargs="+", default=[256, 64], help="rollout batch sizes, in this order")
    shapes.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per rollout row")
    shapes.add_argument("--rollout-new-tokens", type=int, default=1024, help="new tokens per rollout row")
    shapes.add_argument("--score-rows", type=int, default=4, help="rows of teacher scoring")
    shapes.add_argument("--score-len", type=int, default=4096, help="tokens per scored row")
    shapes.add_argument("--top-k", type=int, default=64, help="k of the top-k teacher scoring")
    shapes.add_argument("--learn-lens", type=int, nargs="+", default=[4096, 8192], help="learner sequence lengths (one row each)")
    shapes.add_argument("--vocab-chunk", type=int, default=1024,
                        help="trainer.vocab_chunk of the chunked learner step (beside the whole one) and of the opd run")  # fmt: skip
    shapes.add_argument("--dry-shapes", action="store_true", help="dry mode: also the shape sections, on one layer of the first shape")
    shapes.add_argument("--opd-steps", type=int, default=10, help="optimizer steps of the end-to-end opd run")
    shapes.add_argument("--opd-teacher", default="qwen3-1.7b-shape", help="teacher shape of the 10-step opd run (student: the first shape)")
    shapes.add_argument("--shape-layers", type=int, default=None, help="build only this many layers of each shape (default: all)")
    shapes.add_argument("--serve-clients", type=int, default=64, help="serve: streamed clients (and the engines' max batch)")
    shapes.add_argument("--serve-tokens", type=int, default=256, help="serve: tokens per client")
    shapes.add_argument("--serve-gap-ms", type=float, default=10.0, help="serve: milliseconds between arrivals")
    shapes.add_argument("--serve-rounds", type=int, default=2, help="serve: rounds of the three engines, order alternated")
    shapes.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget of the whole check (later sections are skipped)")
    shapes.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="each shape section in its own process, killed at its cap (default: on with CUDA)")  # fmt: skip
    for name in ("section", "section-shape", "section-out"):  # internal: the child side of one isolated section
        parser.add_argument(f"--{name}", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--section-cap-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.raw_argv = [a for a in (sys.argv[1:] if argv is None else argv)]
    for name in ("prompts", "samples", "new_tokens", "steps", "reference_rows", "prompt_len", "rollout_new_tokens", "score_rows",
                 "score_len", "top_k", "serve_clients", "serve_tokens", "serve_rounds", "ray_steps"):  # fmt: skip
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def environment() -> dict:
    """Versions and the device, for the JSON."""
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(0)
        info["cuda_runtime"] = torch.version.cuda
    return info


def exact_float32() -> None:
    """Full float32 matrix products on the GPU (no TF32), so GPU log-probs can match the CPU's to 1e-4."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def arith_prompts(count: int) -> list[str]:
    """Deterministic prompts shaped like the demo's arith task (without importing the task)."""
    return [f"Compute {(7 * i) % 50}+{(3 * i) % 9}*{(5 * i) % 9}.\n" for i in range(count)]


def build_pair(student_arch: TinyArch, teacher_arch: TinyArch, tokenizer) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Randomly initialised float32 student (seed 1) and teacher (seed 0), as the demo seeds them."""
    kw = dict(vocab_size=len(tokenizer), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    return build_tiny_model(student_arch, seed=1, **kw).float(), build_tiny_model(teacher_arch, seed=0, **kw).float()


def timed_generate(backend: HFBackend, prompts: list[list[int]], params: SamplingParams, device: str) -> tuple[list[Completion], float]:
    """Completions and the wall seconds they took (the device synchronised before and after)."""
    synchronize(device)
    started = time.perf_counter()
    completions = backend.generate(prompts, params)
    synchronize(device)
    return completions, time.perf_counter() - started


def completions_batch(prompts: list[list[int]], completions: list[Completion], pad_id: int) -> TensorBatch:
    """A right-padded training batch: prompt + completion, the loss on completion tokens, behaviour log-probs from sampling."""
    rows = [(prompts[c.prompt_index], c) for c in completions]
    width = max(len(p) + len(c.token_ids) for p, c in rows)
    size = len(rows)
    input_ids = torch.full((size, width), pad_id, dtype=torch.long)
    attention = torch.zeros((size, width), dtype=torch.long)
    loss_mask = torch.zeros((size, width))
    behaviour = torch.zeros((size, width))
    for b, (prompt, c) in enumerate(rows):
        start, end = len(prompt), len(prompt) + len(c.token_ids)
        input_ids[b, :end] = torch.tensor(prompt + c.token_ids)
        attention[b, :end] = 1
        loss_mask[b, start:end] = 1.0
        behaviour[b, start:end] = torch.tensor(c.logprobs)
    return TensorBatch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        step_index=torch.where(loss_mask > 0, 0, -1),
        behaviour_logprobs=behaviour,
        teacher_logprobs=torch.zeros((size, width)),
        rewards=torch.full((size,), float("nan")),
        policy_version=torch.zeros(size, dtype=torch.long),
        group_ids=torch.tensor([c.prompt_index for c in completions]),
    )


def batch_to(batch: TensorBatch, device: str) -> TensorBatch:
    """The batch with every tensor on ``device``."""
    moved = copy.copy(batch)
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            setattr(moved, name, value.to(device))
    return moved


def max_logprob_difference(model: torch.nn.Module, tokenizer, batch: TensorBatch, rows: int, device: str) -> float:
    """Largest |log-prob on ``device`` − log-prob on the CPU| over the first ``rows`` rows' scored positions."""
    ids, mask = batch.input_ids[:rows], batch.attention_mask[:rows]
    on_device = HFBackend(model, tokenizer, device=device).score(ids.to(device), mask.to(device))["logprobs"].cpu()
    on_cpu = HFBackend(copy.deepcopy(model).to("cpu"), tokenizer, device="cpu").score(ids, mask)["logprobs"]
    scored = mask.bool().clone()
    scored[:, 0] = False
    return float((on_device - on_cpu)[scored].abs().max())


def reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_memory_mib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None


def measure_pair(name: str, args: argparse.Namespace, device: str, tokenizer) -> dict:
    """Generation, teacher scoring, learner steps and the GPU-vs-CPU log-prob check for one model pair."""
    student, teacher = build_pair(*MODEL_PAIRS[name], tokenizer)
    result: dict = {"student_parameters": count_parameters(student), "teacher_parameters": count_parameters(teacher)}
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in arith_prompts(args.prompts)]
    sampler = HFBackend(student, tokenizer, batch_size=args.prompts * args.samples, device=device)
    timed_generate(sampler, prompts[:2], SamplingParams(max_new_tokens=4, seed=1), device)  # warm-up (CUDA context, kernels)

    reset_peak_memory(device)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.samples, seed=0)
    completions, seconds = timed_generate(sampler, prompts, params, device)
    tokens = sum(len(c.token_ids) for c in completions)
    result["generation"] = {
        "sequences": len(completions),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "peak_mib": peak_memory_mib(device),
    }

    batch = completions_batch(prompts, completions, tokenizer.pad_token_id)
    result["logprob_check"] = {
        "rows": min(args.reference_rows, len(completions)),
        "max_abs_diff": max_logprob_difference(student, tokenizer, batch, args.reference_rows, device),
    }
    result["logprob_check"]["ok"] = result["logprob_check"]["max_abs_diff"] <= args.tolerance

    scorer = HFBackend(teacher, tokenizer, batch_size=len(completions), device=device)
    batch = batch_to(batch, device)
    synchronize(device)
    started = time.perf_counter()
    with torch.no_grad():
        scores = scorer.score(batch.input_ids, batch.attention_mask, want=("logprobs", "full"))
    synchronize(device)
    result["teacher_score_s"] = time.perf_counter() - started
    batch.teacher_logprobs, batch.teacher_dist = scores["logprobs"] * batch.loss_mask, scores["full"]

    result["learner"] = learner_steps(student, batch, args.steps, device)
    result["learner"]["batch_shape"] = list(batch.shape)
    return result


def learner_steps(model: torch.nn.Module, batch: TensorBatch, steps: int, device: str) -> dict:
    """One warm-up step, then ``steps`` timed ``opd`` (full reverse KL) steps with AdamW; seconds and peak memory."""
    hparams = OPDParams(estimator="full")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warmup = train_step(model, optimizer, batch, OPD_SPEC, hparams)
    reset_peak_memory(device)
    seconds = []
    for _ in range(steps):
        synchronize(device)
        started = time.perf_counter()
        metrics = train_step(model, optimizer, batch, OPD_SPEC, hparams)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return {
        "step_s_mean": sum(seconds) / len(seconds),
        "step_s": seconds,
        "peak_mib": peak_memory_mib(device),
        "warmup_loss": warmup["loss"],
        "last_loss": metrics["loss"],
    }


# ---------------------------------------------------------------------------------------------------------------
# Real shapes (harness/models/shapes.py): rollout, teacher scoring and learner throughput in bf16, each section in its
# own process with its own time cap on the GPU, so a slow part (a long compile) cannot eat the others' time.

DEFAULT_SHAPES = ["qwen3-0.6b-shape", "qwen3-1.7b-shape"]
BIG_SHAPES = ["qwen3-4b-shape", "qwen3-8b-shape"]
SECTION_CAPS_S = {"rollout": 110, "scoring": 35, "learner": 70, "opd_run": 150, "serve": 90}  # wall-clock cap of a section (per shape)
DRY_SECTION_CAP_S = 300  # the CPU dry mode's cap of every section (a loaded CI machine; the numbers mean nothing there)
MIN_SECTION_S = 20  # a section does not start with less of the budget left
# HBM bandwidth by device name (bytes/s, vendor data sheets): the decode bound's denominator
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12, "A100": 1.555e12, "L40S": 0.864e12}
DRY_SHAPE_SIZES = {
    "rollout_batches": [2],
    "prompt_len": 8,
    "rollout_new_tokens": 4,
    "score_rows": 1,
    "score_len": 16,
    "top_k": 4,
    "learn_lens": [16],
    "opd_teacher": "qwen3-0.6b-shape",
    "shape_layers": 1,
    "serve_clients": 4,
    "serve_tokens": 8,
    "serve_rounds": 1,
}


def hbm_bandwidth(device_name: str | None) -> float | None:
    """The device's HBM bandwidth in bytes/s from :data:`HBM_BYTES_PER_S` (first name contained in ``device_name``)."""
    if not device_name:
        return None
    return next((bw for name, bw in HBM_BYTES_PER_S.items() if name.lower() in device_name.lower()), None)


def decode_bound(config, parameters: int, batch: int, mean_context: float, bandwidth: float | None, dtype_bytes: int = 2) -> dict:
    """The memory-bandwidth bound of decoding: per step the weights once plus every row's KV cache up to its context."""
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes
    step_bytes = parameters * dtype_bytes + batch * mean_context * kv_per_token
    bound = {"weight_bytes": parameters * dtype_bytes, "kv_bytes_per_token": kv_per_token, "step_bytes": step_bytes}
    if bandwidth:
        bound.update(bandwidth_bytes_per_s=bandwidth, step_s=step_bytes / bandwidth, tokens_per_s=batch * bandwidth / step_bytes)
    return bound


def random_prompts(rows: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token ids (never the special ids 0–2): the shapes carry random weights, so text means nothing."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (rows, length), generator=g).tolist()


def shape_model(arch: str, device: str, layers: int | None):
    """A shape model from harness/models/shapes.py (random weights) in eval mode, and its parameter count: bf16 on CUDA,
    float32 in the CPU dry mode (bf16 matrix products at a 152k vocabulary take minutes on a CPU)."""
    from opd_harness.models.shapes import build_shape_model

    model = build_shape_model(arch, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32, layers=layers).eval()
    return model, count_parameters(model)


def shape_tokenizer(vocab_size: int):
    """The shapes' stand-in tokenizer (pad 0, EOS 1; random ids decode to characters)."""
    from opd_harness.models.shapes import build_shape_tokenizer

    return build_shape_tokenizer(vocab_size)


def plain_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int, device: str) -> float:
    """Seconds of transformers' own sampling (dynamic cache, eager) for exactly ``new_tokens`` per row."""
    ids = torch.tensor(prompts, device=device)
    synchronize(device)
    started = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id,
        )  # fmt: skip
    synchronize(device)
    return time.perf_counter() - started


def rollout_section(arch: str, args: argparse.Namespace, device: str, out: dict, deadline: float) -> None:
    """Rollout tokens/s per batch size: plain ``model.generate`` against the hf_static engine (first call compiles on
    CUDA, timed separately), with the decode bandwidth bound and the share of it reached."""
    from opd_harness.backends.hf_static import StaticCacheBackend

    model, parameters = shape_model(arch, device, args.shape_layers)
    tokenizer = shape_tokenizer(model.config.vocab_size)
    bandwidth = hbm_bandwidth(torch.cuda.get_device_name(0) if device == "cuda" else None)
    out.update(parameters=parameters, prompt_len=args.prompt_len, new_tokens=args.rollout_new_tokens, batches={})
    for batch in args.rollout_batches:
        if time.monotonic() > deadline:
            out["batches"][str(batch)] = {"skipped": "section time cap reached"}
            continue
        row: dict = out["batches"].setdefault(str(batch), {})
        prompts = random_prompts(batch, args.prompt_len, model.config.vocab_size)
        reset_peak_memory(device)
        seconds = plain_generate(model, prompts, args.rollout_new_tokens, tokenizer.pad_token_id, device)
        tokens_per_s = batch * args.rollout_new_tokens / seconds
        row["plain_generate"] = {"seconds": seconds, "tokens_per_s": tokens_per_s, "peak_mib": peak_memory_mib(device)}
        yield_partial(out)
        engine = StaticCacheBackend(model, tokenizer, batch_size=batch, device=device)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.rollout_new_tokens, seed=0)
        _, first = timed_generate(engine, prompts, params, device)  # compiles the decode step on CUDA
        reset_peak_memory(device)
        completions, seconds = timed_generate(engine, prompts, params.model_copy(update={"seed": 1}), device)
        tokens = sum(len(c.token_ids) for c in completions)
        mean_context = args.prompt_len + tokens / len(completions) / 2
        bound = decode_bound(model.config, parameters, batch, mean_context, bandwidth)
        row["hf_static"] = {
            "first_call_s": first, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "peak_mib": peak_memory_mib(device), "logprob_vs_score_max_abs_diff": engine_logprob_gap(engine, prompts, completions[:2]),
        }  # fmt: skip
        row["speedup_vs_plain"] = row["hf_static"]["tokens_per_s"] / row["plain_generate"]["tokens_per_s"]
        row["decode_bound"] = bound
        if "tokens_per_s" in bound:
            row["hf_static"]["share_of_bound"] = row["hf_static"]["tokens_per_s"] / bound["tokens_per_s"]
        yield_partial(out)
        del engine


def engine_logprob_gap(engine, prompts: list[list[int]], completions: list[Completion]) -> float:
    """Largest |engine log-prob − ``score`` log-prob| of the sampled tokens of ``completions`` (same model, same dtype)."""
    gap = 0.0
    for c in completions:
        ids = torch.tensor([prompts[c.prompt_index] + c.token_ids], device=engine.device)
        scored = engine.score(ids, torch.ones_like(ids))["logprobs"][0, len(prompts[c.prompt_index]) :].float().cpu()
        gap = max(gap, float((scored - torch.tensor(c.logprobs)).abs().max()))
    return gap


def scoring_section(arch: str, args: argparse.Namespace, device: str, out: dict, deadline: float) -> None:
    """Teacher scoring tokens/s of ``score_rows`` × ``score_len`` tokens: log-probs + top-k, then log-probs + the full distribution."""
    model, parameters = shape_model(arch, device, args.shape_layers)
    scorer = HFBackend(model, shape_tokenizer(model.config.vocab_size), device=device)
    ids = torch.tensor(random_prompts(args.score_rows, args.score_len, model.config.vocab_size), device=device)
    out.update(parameters=parameters, rows=args.score_rows, seq_len=args.score_len)
    for name, want in (("topk", ("logprobs", "topk")), ("full", ("logprobs", "full"))):
        if time.monotonic() > deadline:
            out[name] = {"skipped": "section time cap reached"}
            continue
        for timed in (False, True):  # one untimed call first (kernels, allocator)
            reset_peak_memory(device)
            synchronize(device)
            started = time.perf_counter()
            with torch.no_grad():
                scores = scorer.score(ids, torch.ones_like(ids), want=want, top_k=args.top_k)
            synchronize(device)
            seconds = time.perf_counter() - started
            del scores
        out[name] = {"seconds": seconds, "tokens_per_s": ids.numel() / seconds, "peak_mib": peak_memory_mib(device)}
        yield_partial(out)


def learner_section(arch: str, args: argparse.Namespace, device: str, out: dict, deadline: float) -> None:
    """Learner tokens/s and peak memory of ``opd`` (full reverse KL) steps on one sequence of each length in
    ``learn_lens``, with the step's own perf/… metrics (MFU) as ``train_step`` reports them: the whole (1, T, V) distribution
    (``vocab_chunk`` 0) and chunked (``--vocab-chunk``), and the peak memory the chunks save. Both peaks include the batch's
    (1, T, V) float32 teacher distribution, which chunking does not remove."""
    model, parameters = shape_model(arch, device, args.shape_layers)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, **({"fused": True} if device == "cuda" else {}))
    out.update(parameters=parameters, lengths={})
    vocab = model.config.vocab_size
    for length in args.learn_lens:
        if time.monotonic() > deadline:
            out["lengths"][str(length)] = {"skipped": "section time cap reached"}
            continue
        ids = torch.tensor(random_prompts(1, length, vocab), device=device)
        half = length // 2  # a prompt half and a response half, the loss on the response
        loss_mask = torch.zeros((1, length), device=device)
        loss_mask[:, half:] = 1.0
        batch = TensorBatch(
            input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=loss_mask,
            step_index=torch.where(loss_mask > 0, 0, -1), behaviour_logprobs=torch.zeros((1, length), device=device),
            teacher_logprobs=torch.zeros((1, length), device=device), rewards=torch.full((1,), float("nan"), device=device),
            policy_version=torch.zeros(1, dtype=torch.long, device=device), group_ids=torch.zeros(1, dtype=torch.long, device=device),
            teacher_dist=torch.log_softmax(torch.randn((1, length, vocab), device=device), dim=-1),
        )  # fmt: skip
        hparams = OPDParams(estimator="full")
        row: dict = {"teacher_dist_mib": batch.teacher_dist.numel() * 4 / 2**20}
        for way, chunk in (("whole", 0), ("chunked", args.vocab_chunk)):
            if time.monotonic() > deadline:
                row[way] = {"skipped": "section time cap reached"}
                continue
            row[way] = timed_learner_step(model, optimizer, batch, hparams, chunk, device)
            out["lengths"][str(length)] = row
            yield_partial(out)
        whole, chunked = row.get("whole", {}).get("peak_mib"), row.get("chunked", {}).get("peak_mib")
        if whole is not None and chunked is not None:
            row["chunk_saves_mib"] = whole - chunked
        out["lengths"][str(length)] = row
        yield_partial(out)
        del batch


def timed_learner_step(model, optimizer, batch: TensorBatch, hparams: OPDParams, vocab_chunk: int, device: str) -> dict:
    """One warm-up and one timed ``opd`` step: seconds, tokens/s, peak memory and the step's perf/… metrics."""
    train_step(model, optimizer, batch, OPD_SPEC, hparams, vocab_chunk=vocab_chunk)  # warm-up
    reset_peak_memory(device)
    synchronize(device)
    started = time.perf_counter()
    metrics = train_step(model, optimizer, batch, OPD_SPEC, hparams, vocab_chunk=vocab_chunk)
    synchronize(device)
    seconds = time.perf_counter() - started
    length = batch.input_ids.numel()
    return {
        "vocab_chunk": vocab_chunk, "step_s": seconds, "tokens_per_s": length / seconds, "peak_mib": peak_memory_mib(device),
        "perf": {k: v for k, v in metrics.items() if k.startswith("perf/")}, "loss": metrics["loss"],
    }  # fmt: skip


OPD_RUN = ["run", "--task", "arith", "--preset", "smoke", "--method", "opd",
           "--set", "student.sft_steps=0", "--set", "teacher.sft_steps=0", "--set", "eval.before_training=false",
           "--set", "eval.teacher=false", "--set", "trainer.checkpoint_every=10"]  # fmt: skip


def learner_device_key() -> str | None:
    """The config key that puts the learner on a device, where this tree has one (#28 item 2); else None."""
    from opd_harness.config import ModelSpec, TrainerConfig

    for owner, model in (("trainer", TrainerConfig), ("student", ModelSpec)):
        if "device" in model.model_fields:
            return f"{owner}.device"
    return None


def opd_run_section(arch: str | None, args: argparse.Namespace, device: str, out: dict, deadline: float) -> None:
    """A 10-step ``harness run --method opd`` (full estimator, ``trainer.vocab_chunk``) with ``arch`` as the student and
    ``--opd-teacher`` as the teacher on ``device`` (``trainer.device``; bf16 autocast on CUDA), end to end: exit code, wall
    seconds and the mean of every perf/… and timing_s/… step metric of the run. ``arch`` None (the dry mode): the smoke preset's
    tiny models."""
    import sqlite3
    import tempfile

    from opd_harness.tracking import step_key

    key = learner_device_key()
    if key is None:
        out["skipped"] = "this tree has no config key that puts the learner on a GPU (#28 item 2): the run would train on the CPU"
        return
    with tempfile.TemporaryDirectory() as tmp:
        models = ["--set", f"student.arch={arch}", "--set", f"teacher.arch={args.opd_teacher}"] if arch else []
        learner = ["--set", f"{key}={device}", "--set", f"trainer.vocab_chunk={args.vocab_chunk}"]
        learner += ["--set", f"trainer.steps={args.opd_steps}"]
        learner += ["--set", "trainer.precision=bf16"] if device == "cuda" else []
        out["command"] = command = [sys.executable, "-m", "opd_harness.cli", *OPD_RUN, *models, *learner, "--out", tmp]
        started, cap_s = time.perf_counter(), max(1.0, deadline - time.monotonic())
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=cap_s)
            out.update(returncode=done.returncode, output_tail=(done.stdout + done.stderr)[-2000:])
        except subprocess.TimeoutExpired:
            out.update(timed_out=True, cap_s=cap_s)
        out["seconds"], out["expected_steps"] = time.perf_counter() - started, args.opd_steps
        store = Path(tmp) / "results.sqlite"
        if store.exists():
            with sqlite3.connect(store) as conn:
                rows = conn.execute("SELECT name, AVG(value), COUNT(*) FROM step_metrics GROUP BY name").fetchall()
                out["steps"] = conn.execute("SELECT COUNT(DISTINCT step) FROM step_metrics WHERE name='loss'").fetchone()[0]
            out["perf_mean"] = {step_key(name): mean for name, mean, _ in rows if step_key(name).startswith(("perf/", "timing_s/"))}
    if out.get("returncode", 0) != 0:
        out["error"] = f"harness run exited {out['returncode']}\n{out.get('output_tail', '')}"


def serve_section(arch: str, args: argparse.Namespace, device: str, out: dict, deadline: float) -> None:
    """``harness serve``'s engine before and after continuous batching (``benchmarks/serve_engine.py``'s client row):
    ``--serve-clients`` streamed clients of ``--serve-tokens`` tokens each (EOS masked), ``--serve-gap-ms`` apart, through
    the old engine, the new one with its text work in a thread (the accelerator default) and the new one with it inline;
    tokens/s and median time to first token of each, every side warmed up, ``--serve-rounds`` rounds in alternating order."""
    if str(ROOT / "benchmarks") not in sys.path:  # serve_engine and the old engine beside it
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import serve_engine

    model, parameters = shape_model(arch, device, args.shape_layers)
    tokenizer = shape_tokenizer(model.config.vocab_size)
    model = serve_engine.NoEos(model, tokenizer.eos_token_id)
    sides = {"old": (serve_engine.old, {}), "new": (serve_engine.new, {"text_thread": True}),
             "new_inline": (serve_engine.new, {"text_thread": False})}  # fmt: skip
    lengths = [args.serve_tokens] * args.serve_clients
    out.update(parameters=parameters, clients=args.serve_clients, tokens=args.serve_tokens, gap_ms=args.serve_gap_ms, sides={})

    def run(side: tuple, lengths: list[int]) -> tuple[float, float] | None:
        if time.monotonic() > deadline:
            return None
        module, options = side
        gap_s, clients = args.serve_gap_ms / 1000, len(lengths)
        return serve_engine.staggered(module, model, tokenizer, lengths=lengths, gap_s=gap_s, max_batch=clients, device=device, **options)

    for side in sides.values():  # warm-up: kernels, the allocator, both engines' first prefill and joins
        run(side, lengths[:4])
    results = serve_engine.alternated(args.serve_rounds, sides, lambda side: run(side, lengths))
    for name, runs in results.items():
        done = [r for r in runs if r is not None]
        row = {"tokens_per_s": [r[0] for r in done], "median_ttft_s": [r[1] for r in done]}
        if done:
            row.update(tokens_per_s_mean=sum(row["tokens_per_s"]) / len(done), median_ttft_s_mean=sum(row["median_ttft_s"]) / len(done))
        if len(done) < len(runs):
            row["skipped_rounds"] = len(runs) - len(done)
        out["sides"][name] = row
    old = out["sides"]["old"].get("tokens_per_s_mean")
    for name in ("new", "new_inline"):
        mean = out["sides"][name].get("tokens_per_s_mean")
        if old and mean:
            out[f"{name}_over_old"] = mean / old
    yield_partial(out)


SHAPE_SECTIONS = {"rollout": rollout_section, "scoring": scoring_section, "learner": learner_section, "opd_run": opd_run_section,
                  "serve": serve_section}  # fmt: skip
_PARTIAL: dict = {}  # where a section in a child process writes its partial results


def yield_partial(out: dict) -> None:
    """Write a section's results so far (a child process killed at its cap still leaves them)."""
    path = _PARTIAL.get("path")
    if path is not None:
        Path(path).write_text(json.dumps(out, indent=1) + "\n")


def run_section(name: str, arch: str | None, args: argparse.Namespace, device: str, cap_s: float) -> dict:
    """One section, in a child process with a wall-clock cap on the GPU (``--isolate``), else in this process."""
    if not args.isolate:
        out: dict = {}
        started = time.perf_counter()
        try:
            SHAPE_SECTIONS[name](arch, args, device, out, time.monotonic() + cap_s)
        except Exception:
            out["error"] = traceback.format_exc()
        out["section_s"] = time.perf_counter() - started
        return out
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        partial = Path(tmp) / "section.json"
        command = [sys.executable, str(Path(__file__).resolve()), *args.raw_argv, "--section", name, "--section-shape", arch or "",
                   "--section-out", str(partial), "--section-cap-s", str(cap_s)]  # fmt: skip
        started = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=ROOT, timeout=cap_s + 30, capture_output=True, text=True)  # +30 s: start-up
            status = {"returncode": done.returncode}
            if done.returncode != 0:
                status["stderr_tail"] = done.stderr[-3000:]
        except subprocess.TimeoutExpired:
            status = {"timed_out": True, "cap_s": cap_s}
        out = json.loads(partial.read_text()) if partial.exists() else {}
    out.update(status, section_s=time.perf_counter() - started)
    return out


def section_child(args: argparse.Namespace, device: str) -> int:
    """The child side of :func:`run_section`: run one section, writing its partial results to ``--section-out``."""
    _PARTIAL["path"] = args.section_out
    out: dict = {}
    try:
        SHAPE_SECTIONS[args.section](args.section_shape or None, args, device, out, time.monotonic() + args.section_cap_s)
    except Exception:
        out["error"] = traceback.format_exc()
    yield_partial(out)
    return 1 if "error" in out else 0


def shapes_available() -> str | None:
    """None when harness/models/shapes.py imports, else why the shape sections are skipped."""
    try:
        import opd_harness.models.shapes  # noqa: F401
    except ImportError as exc:
        return f"opd_harness.models.shapes does not import ({exc})"
    return None



def run_vllm_tests(skip_reason: str | None) -> dict:
    """``pytest -m gpu tests/test_vllm_backend.py`` where vllm imports; otherwise why not."""
    if skip_reason is not None:
        return {"ran": False, "reason": skip_reason}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-v", "-m", "gpu", "tests/test_vllm_backend.py"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=VLLM_TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ran": True, "ok": False, "reason": f"timed out after {VLLM_TEST_TIMEOUT_S} s"}
    print(done.stdout[-6000:], done.stderr[-2000:], sep="\n")
    return {
        "ran": True,
        "ok": done.returncode == 0,
        "returncode": done.returncode,
        "summary": (done.stdout.strip().splitlines() or [""])[-1],
    }


def vllm_skip_reason(device: str, skip: bool) -> str | None:
    if skip:
        return "--skip-vllm"
    if device != "cuda":
        return "no CUDA (dry mode)"
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not importable here (install the gpu extra in a separate environment; see DEVELOPERS.md)"
    return None


def ray_command(steps: int, out: str, *, plan_only: bool) -> list[str]:
    """The Ray part's ``harness run``: opd, async with ``max_lag`` 1, ``steps`` steps, learner, rollout and teacher actors on
    one GPU by fractional ``num_gpus`` (:data:`RAY_GPU_SHARES`), a checkpoint at the end; ``plan_only``: ``--dry-run --json``."""
    shares = [arg for role, share in RAY_GPU_SHARES.items() for arg in ("--set", f"trainer.layout.{role}.num_gpus={share}")]
    command = [sys.executable, "-m", "opd_harness.cli", *OPD_RUN, "--mode", "async", "--executor", "ray", "--set", "trainer.max_lag=1",
               "--set", f"trainer.steps={steps}", "--set", f"trainer.checkpoint_every={steps}", *shares]  # fmt: skip
    return command + (["--dry-run", "--json"] if plan_only else ["--out", out])


def ray_part(args: argparse.Namespace, cuda: bool, deadline: float) -> dict:
    """The Ray part: skipped without Ray (or with ``--skip-ray``); without CUDA only planned (``harness run --dry-run``: the
    layout validated, nothing started); on a GPU the run itself (:func:`ray_run`)."""
    if args.skip_ray:
        return {"ran": False, "skipped": "--skip-ray"}
    if importlib.util.find_spec("ray") is None:
        print("ray part skipped: ray not installed", flush=True)
        return {"ran": False, "skipped": "ray not installed"}
    if not cuda:
        command = ray_command(args.ray_steps, "", plan_only=True)
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=DRY_SECTION_CAP_S)
        out = {"ran": False, "mode": "planned", "not_run": "dry mode: the Ray part has NOT run on a GPU (planned only)",
               "command": command, "returncode": done.returncode, "gpu_shares": dict(RAY_GPU_SHARES)}  # fmt: skip
        if done.returncode == 0:
            layout = json.loads(done.stdout)["models"]["layout"]
            out["planned_num_gpus"] = {role: layout[role]["num_gpus"] for role in RAY_GPU_SHARES}
        else:
            out["error"] = f"harness run --dry-run exited {done.returncode}\n{(done.stdout + done.stderr)[-2000:]}"
        print(f"ray part: {out['not_run']}", flush=True)
        return out
    return ray_run(args.ray_steps, max(60.0, min(RAY_RUN_CAP_S, deadline - time.monotonic())))


def ray_run(steps: int, cap_s: float) -> dict:
    """Run the Ray part's ``harness run`` on the GPU: exit code, wall seconds, steps stored, each role's GPU ids (the run's
    placement) and per-step ``sync_seconds``, ``sync_bytes``, ``time_step_s`` with their means."""
    import sqlite3
    import tempfile

    out: dict = {"ran": True, "mode": "gpu", "gpu_shares": dict(RAY_GPU_SHARES), "expected_steps": steps}
    with tempfile.TemporaryDirectory() as tmp:
        out["command"] = command = ray_command(steps, tmp, plan_only=False)
        started = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=cap_s)
            out.update(returncode=done.returncode, output_tail=(done.stdout + done.stderr)[-3000:])
        except subprocess.TimeoutExpired:
            out.update(timed_out=True, cap_s=cap_s)
        out["seconds"] = time.perf_counter() - started
        store = Path(tmp) / "results.sqlite"
        if store.exists():
            with sqlite3.connect(store) as conn:
                rows = conn.execute("SELECT step, name, value FROM step_metrics WHERE name IN "
                                    "('sync_seconds', 'sync_bytes', 'time_step_s', 'loss')").fetchall()  # fmt: skip
                placed = conn.execute("SELECT metrics_json FROM checkpoints ORDER BY step DESC").fetchone()
            per_step: dict[int, dict[str, float]] = {}
            for step, name, value in rows:
                per_step.setdefault(step, {})[name] = value
            out["steps"] = sum("loss" in row for row in per_step.values())
            out["per_step"] = {str(step): row for step, row in sorted(per_step.items())}
            for name in ("sync_seconds", "sync_bytes", "time_step_s"):
                values = [row[name] for row in per_step.values() if name in row]
                out[f"{name}_mean"] = sum(values) / len(values) if values else None
            out["gpus"] = json.loads(placed[0]).get("placement", {}).get("gpus") if placed else None
    if out.get("returncode", 0) != 0:
        out["error"] = f"harness run --executor ray exited {out['returncode']}\n{out.get('output_tail', '')}"
    return out


def dry_sizes(args: argparse.Namespace) -> argparse.Namespace:
    """The toy sizes and the demo pair (with ``--dry-shapes`` one layer of the first shape too): the CPU run checks the code
    path, its numbers mean nothing."""
    shapes = args.shapes[:1] if args.dry_shapes else []
    sizes = {**DRY_SIZES, **(DRY_SHAPE_SIZES if args.dry_shapes else {})}
    return argparse.Namespace(**{**vars(args), **sizes, "models": ["demo"], "shapes": shapes, "big_shapes": False, "dry": True})


def section_plan(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(section, shape) in priority order: the smallest shape's rollout and learner first, then the end-to-end run, then the rest."""
    shapes = list(args.shapes) + (BIG_SHAPES if args.big_shapes else [])
    if getattr(args, "dry", False):  # the end-to-end run on the smoke preset's tiny models (harness run builds whole shapes)
        return [(name, shapes[0]) for name in ("rollout", "learner", "scoring", "serve") if shapes] + [("opd_run", None)]
    if not shapes:
        return []
    first, rest = shapes[0], shapes[1:]
    plan = [("rollout", first), ("learner", first), ("opd_run", first), ("scoring", first), ("serve", first)]
    for arch in rest:
        plan += [("rollout", arch), ("learner", arch), ("scoring", arch)]
    return plan


def check_failures(report: dict, tolerance: float, bf16_tolerance: float = 0.1) -> list[str]:
    """Every failed check, one line each: a pair that raised, log-probs off by more than ``tolerance``, a shape section that
    raised or was killed at its cap, engine log-probs off their scoring by more than ``bf16_tolerance``, failed vLLM tests."""
    failures = []
    for name, measured in report["models"].items():
        if "error" in measured:
            failures.append(f"{name}: raised {measured['error'].strip().splitlines()[-1]}")
        elif not measured["logprob_check"]["ok"]:
            failures.append(f"{name}: GPU vs CPU log-probs differ by {measured['logprob_check']['max_abs_diff']:.2e} > {tolerance}")
    for key, section in report.get("sections", {}).items():
        if "error" in section:
            failures.append(f"{key}: raised {section['error'].strip().splitlines()[-1]}")
        elif section.get("timed_out"):
            failures.append(f"{key}: killed at its cap of {section['cap_s']:.0f} s")
        elif "expected_steps" in section and section.get("steps") != section["expected_steps"]:
            failures.append(f"{key}: the run stored {section.get('steps')} of its {section['expected_steps']} steps")
        for batch, row in section.get("batches", {}).items():
            gap = row.get("hf_static", {}).get("logprob_vs_score_max_abs_diff")
            if gap is not None and gap > bf16_tolerance:
                failures.append(f"{key} batch {batch}: hf_static log-probs differ from scoring by {gap:.3f} > {bf16_tolerance}")
    if report["vllm_tests"].get("ran") and not report["vllm_tests"].get("ok"):
        failures.append(f"vLLM GPU tests failed: {report['vllm_tests']}")
    ray = report.get("ray", {})
    if "error" in ray:
        failures.append(f"ray: {ray['error'].strip().splitlines()[0]}")
    elif ray.get("timed_out"):
        failures.append(f"ray: killed at its cap of {ray['cap_s']:.0f} s")
    elif ray.get("ran") and ray.get("steps") != ray.get("expected_steps"):
        failures.append(f"ray: the run stored {ray.get('steps')} of its {ray.get('expected_steps')} steps")
    return failures


def write_report(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = "cuda" if cuda else "cpu"
    if args.section:  # the child side of an isolated section (sizes already resolved by the parent's arguments)
        return section_child(dry_sizes(args) if not cuda else args, device)
    if args.isolate is None:
        args.isolate = cuda
    if not cuda:
        why = "--dry-run" if args.dry_run else "torch.cuda.is_available() is False"
        print(
            f"DRY MODE ({why}): skipping every CUDA measurement; running the demo pair and one layer of the first shape on the CPU "
            "at toy sizes, the vLLM tests are not run",
            flush=True,
        )
        args = dry_sizes(args)
    else:
        exact_float32()
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    report: dict = {
        "mode": "gpu" if cuda else "dry",
        "device": device,
        "environment": environment(),
        "tolerance": args.tolerance,
        "bf16_tolerance": args.bf16_tolerance,
        "tf32": False if cuda else None,
        "models": {},
        "sections": {},
    }
    sizes = ("prompts", "samples", "new_tokens", "steps", "reference_rows", "rollout_batches", "prompt_len", "rollout_new_tokens",
             "score_rows", "score_len", "top_k", "learn_lens", "vocab_chunk", "opd_steps", "shape_layers", "budget_s",
             "serve_clients", "serve_tokens", "serve_gap_ms", "serve_rounds")  # fmt: skip
    report["sizes"] = {k: getattr(args, k) for k in sizes}
    started = time.perf_counter()
    deadline = time.monotonic() + args.budget_s
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        print(f"measuring {name} on {device} ...", flush=True)
        try:
            report["models"][name] = measure_pair(name, args, device, tokenizer)
        except Exception:  # one pair's failure must not lose the others' numbers
            report["models"][name] = {"error": traceback.format_exc()}
        print(json.dumps({name: report["models"][name]}, indent=1), flush=True)
        write_report(report, args.out)  # partial results survive a later crash or time-out
    if cuda:
        torch.cuda.empty_cache()
    missing = shapes_available()
    for name, arch in section_plan(args):
        key = f"{name}:{arch or 'smoke'}"
        left = deadline - time.monotonic()
        if missing is not None or left < MIN_SECTION_S:
            report["sections"][key] = {"skipped": missing or f"budget: {left:.0f} s left of --budget-s {args.budget_s:.0f}"}
            continue
        cap = min(SECTION_CAPS_S[name] if cuda else DRY_SECTION_CAP_S, left)
        print(f"section {key} (cap {cap:.0f} s) ...", flush=True)
        report["sections"][key] = run_section(name, arch, args, device, cap)
        print(json.dumps({key: report["sections"][key]}, indent=1), flush=True)
        write_report(report, args.out)
    report["vllm_tests"] = run_vllm_tests(vllm_skip_reason(device, args.skip_vllm))
    print("ray part ...", flush=True)
    report["ray"] = ray_part(args, cuda, deadline)
    print(json.dumps({"ray": {k: v for k, v in report["ray"].items() if k not in ("output_tail", "per_step")}}, indent=1), flush=True)
    write_report(report, args.out)
    report["total_s"] = time.perf_counter() - started
    report["failures"] = failures = check_failures(report, args.tolerance, args.bf16_tolerance)
    write_report(report, args.out)
    print(f"wrote {args.out}; vLLM tests: {report['vllm_tests']}; ray part: "
          + (report["ray"].get("skipped") or report["ray"].get("not_run") or f"ran {report['ray'].get('steps')} steps on the GPU"))
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
