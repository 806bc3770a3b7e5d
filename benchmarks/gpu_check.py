"""GPU check: the HF backend and OPD training steps on CUDA (absolute numbers), and the vLLM GPU tests where vllm imports.

Run from the repository root (``benchmarks/gpu_check.sh`` first provides pydantic where the machine lacks it):

    python3 benchmarks/gpu_check.py --out results/gpu_check.json

For each model pair (``demo``: the cpu-demo student and teacher; ``wide``: hidden 1024 × 8 layers for
both) it measures, on the GPU, in float32 with TF32 off:

* generation: ``HFBackend.generate`` of ``--prompts`` prompts × ``--samples`` samples, ``--new-tokens``
  new tokens each (temperature 1, seeded), as generated tokens per second;
* teacher scoring (log-probs and full distributions, as the demo's ``opd`` full estimator needs);
* the learner: ``trainers.learner.train_step`` with ``opd`` (full reverse KL) and AdamW on that batch,
  seconds per step (mean of ``--steps`` steps after one warm-up step) and peak allocated memory;
* log-probs of the batch scored by the student on the GPU against the same student on the CPU:
  the largest absolute difference must be at most ``--tolerance`` (1e-4).

Then, where ``import vllm`` works, it runs ``pytest -m gpu tests/test_vllm_backend.py`` (vLLM
against the HF backend) and records the outcome; elsewhere it records why it skipped them.

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

from harness.backends import Completion, SamplingParams  # noqa: E402
from harness.backends.hf import HFBackend  # noqa: E402
from harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model, count_parameters  # noqa: E402
from harness.trajectory import TensorBatch  # noqa: E402
from trainers.learner import train_step  # noqa: E402
from trainers.objectives.opd import OPD_SPEC, OPDParams  # noqa: E402

# The cpu-demo preset's models (harness/presets/cpu-demo.yaml) and a wider pair for GPU-sized numbers.
MODEL_PAIRS: dict[str, tuple[TinyArch, TinyArch]] = {
    "demo": (TinyArch(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256), TinyArch(hidden=192, layers=3, heads=4, kv_heads=2, ffn=384)),
    "wide": (
        TinyArch(hidden=1024, layers=8, heads=16, kv_heads=8, ffn=4096),
        TinyArch(hidden=1024, layers=8, heads=16, kv_heads=8, ffn=4096),
    ),
}
DRY_SIZES = {"prompts": 4, "samples": 2, "new_tokens": 8, "steps": 1, "reference_rows": 4}
VLLM_TEST_TIMEOUT_S = 900


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; argparse exits with code 2 on a bad one."""
    default_out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else ROOT / "results" / "gpu_check.json"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=default_out, help="where to write the JSON results")
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU at toy sizes even where CUDA is available")
    parser.add_argument("--models", nargs="+", choices=sorted(MODEL_PAIRS), default=["demo", "wide"], help="model pairs to measure")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per generation batch")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per sample")
    parser.add_argument("--steps", type=int, default=3, help="timed learner steps (after one warm-up step)")
    parser.add_argument("--reference-rows", type=int, default=32, help="rows of the batch scored on the CPU for the log-prob comparison")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed |GPU − CPU| log-prob difference")
    parser.add_argument("--skip-vllm", action="store_true", help="do not run the vLLM GPU tests even where vllm imports")
    args = parser.parse_args(argv)
    for name in ("prompts", "samples", "new_tokens", "steps", "reference_rows"):
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
    batch.teacher_logprobs, batch.teacher_full = scores["logprobs"] * batch.loss_mask, scores["full"]

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


def dry_sizes(args: argparse.Namespace) -> argparse.Namespace:
    """The toy sizes and the demo pair only: the CPU run checks the code path, its numbers mean nothing."""
    return argparse.Namespace(**{**vars(args), **DRY_SIZES, "models": ["demo"]})


def check_failures(report: dict, tolerance: float) -> list[str]:
    """Every failed check, one line each: a pair that raised, log-probs off by more than ``tolerance``, failed vLLM tests."""
    failures = []
    for name, measured in report["models"].items():
        if "error" in measured:
            failures.append(f"{name}: raised {measured['error'].strip().splitlines()[-1]}")
        elif not measured["logprob_check"]["ok"]:
            failures.append(f"{name}: GPU vs CPU log-probs differ by {measured['logprob_check']['max_abs_diff']:.2e} > {tolerance}")
    if report["vllm_tests"].get("ran") and not report["vllm_tests"].get("ok"):
        failures.append(f"vLLM GPU tests failed: {report['vllm_tests']}")
    return failures


def write_report(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = "cuda" if cuda else "cpu"
    if not cuda:
        why = "--dry-run" if args.dry_run else "torch.cuda.is_available() is False"
        print(
            f"DRY MODE ({why}): skipping every CUDA measurement; running the demo pair on the CPU at toy sizes, the vLLM tests are not run",
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
        "tf32": False if cuda else None,
        "models": {},
    }
    report["sizes"] = {k: getattr(args, k) for k in ("prompts", "samples", "new_tokens", "steps", "reference_rows")}
    started = time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        print(f"measuring {name} on {device} ...", flush=True)
        try:
            report["models"][name] = measure_pair(name, args, device, tokenizer)
        except Exception:  # one pair's failure must not lose the others' numbers
            report["models"][name] = {"error": traceback.format_exc()}
        print(json.dumps({name: report["models"][name]}, indent=1), flush=True)
        write_report(report, args.out)  # partial results survive a later crash or time-out
    report["vllm_tests"] = run_vllm_tests(vllm_skip_reason(device, args.skip_vllm))
    report["total_s"] = time.perf_counter() - started
    report["failures"] = failures = check_failures(report, args.tolerance)
    write_report(report, args.out)
    print(f"wrote {args.out}; vLLM tests: {report['vllm_tests']}")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
