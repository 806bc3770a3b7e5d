"""Peak memory at a real vocabulary (V = 151,936) of what issue #41 shrinks, each way in a fresh process, on CPU.

    PYTHONPATH=. python benchmarks/real_vocab_memory.py --rows 1 --new 2048 --hidden 32

Section "rollout": the hf engine's generation, the way before issue #41 (fa03cdf: ``output_logits=True``, every step's
(b, V) logits stacked as float32, then a log-softmax and gather; reproduced here by :func:`stacked_logits_backend`) and
the engine's own way now (the sampled tokens' log-probs recorded step by step). The model is a tiny Qwen3 (``--hidden``,
``--layers``) with the 151,936-way tied output head and random weights; rows sample at temperature 1 from one prompt and
run to ``--new`` tokens (every row is checked to reach it).

Each measurement runs in a fresh process: build, warm up (a short run of the same work), then the kernel's peak-RSS mark
is reset (``/proc/self/clear_refs``) and the work's peak above the RSS before it is read (``VmHWM``). glibc's mmap
threshold is held at its default start, 128 KiB (``MALLOC_MMAP_THRESHOLD_``): left dynamic it rises to the size of a
freed (b, V) buffer and the heap then grows by about one such buffer a step whatever the code keeps, which hides what a
process holds at once (``--dynamic-mmap`` measures that way). Ways alternate in order over ``--repeats`` rounds.

Section "teacher signal": the in-process hf teacher scoring ``--rows`` sequences of ``--new`` tokens (``score_chunk`` 128)
into a batch, as each kind of ``teacher.signal`` stores it (harness/teacher_signal.py), against the way before issue #41
(fa03cdf: the (B, T, V) float32 ``full`` field). Its "stored B/token" column is what the batch then holds per token
(the signal plus the sampled tokens' teacher log-probs), read off the tensors.

Another section is one more function like :func:`rollout_after` (kwargs in, a ``Work`` out) registered in ``WORK``, and
its rows in ``SECTIONS``. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.peak_memory import peak_rise  # noqa: E402

VOCAB = 151936


class Work(NamedTuple):
    """What a measured function hands back: a short warm-up, and the measured work, which returns the tokens it made."""

    warmup: Callable[[], object]
    run: Callable[[], int | tuple[int, int]]  # tokens made, or (tokens, bytes the result holds)


def rollout_engine(cls_name: str, rows: int, new: int, hidden: int, layers: int) -> Work:
    """An hf engine (``HFBackend`` or the stacked-logits one) on a tiny V = 151,936 Qwen3: ``rows`` samples of ``new`` tokens."""
    import torch

    from opd_harness.backends import SamplingParams
    from opd_harness.backends.hf import HFBackend
    from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    arch = TinyArch(hidden=hidden, layers=layers, heads=2, kv_heads=1, ffn=2 * hidden, max_positions=new + 64)
    model = build_tiny_model(arch, VOCAB, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, seed=0)
    engine = (stacked_logits_backend() if cls_name == "stacked" else HFBackend)(model, tok, batch_size=rows)
    params = SamplingParams(temperature=1.0, max_new_tokens=new, n=rows, seed=0)

    def run() -> int:
        lengths = [len(c.token_ids) for c in engine.generate([[5, 6, 7]], params)]
        if lengths != [new] * rows:
            raise RuntimeError(f"rows stopped early ({lengths}): the measurement needs every step")
        return sum(lengths)

    return Work(lambda: engine.generate([[5, 6, 7]], params.model_copy(update={"max_new_tokens": 4})), run)


def rollout_before(**kwargs: int) -> Work:
    """The hf engine before issue #41: every step's logits kept, stacked, log-softmaxed."""
    return rollout_engine("stacked", **kwargs)


def rollout_after(**kwargs: int) -> Work:
    """The hf engine now: each step's sampled-token log-prob, nothing else."""
    return rollout_engine("hf", **kwargs)


def teacher_scoring(kind: str, rows: int, new: int, hidden: int, layers: int) -> Work:
    """The hf teacher (a tiny V = 151,936 Qwen3) scoring ``rows`` × ``new`` tokens into a batch as signal ``kind``
    (``before``: fa03cdf's whole (B, T, V) float32 distribution, which :func:`score_teacher` then stored as it came)."""
    import torch

    from opd_harness.backends.hf import HFBackend
    from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model
    from opd_harness.trajectory import TensorBatch
    from opd_harness.trainers.teacher import score_teacher

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    arch = TinyArch(hidden=hidden, layers=layers, heads=2, kv_heads=1, ffn=2 * hidden, max_positions=new + 64)
    model = build_tiny_model(arch, VOCAB, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, seed=0).requires_grad_(False)
    teacher = HFBackend(model, tok, score_chunk=128)

    def batch(length: int) -> TensorBatch:
        g = torch.Generator().manual_seed(0)
        ids, zeros = torch.randint(3, VOCAB, (rows, length), generator=g), torch.zeros(rows, length)
        out = TensorBatch(ids, torch.ones_like(ids), torch.ones(rows, length), torch.zeros_like(ids), zeros, zeros.clone(),
                          torch.full((rows,), float("nan")), torch.zeros(rows, dtype=torch.long), torch.arange(rows))  # fmt: skip
        out.student_topk_ids = torch.randint(3, VOCAB, (rows, length, 20), generator=g) if kind == "student_topk" else None
        return out

    def score(length: int) -> tuple[int, int]:
        scored = batch(length)
        if kind == "before":
            full = teacher.score(scored.input_ids, scored.attention_mask, want=("logprobs", "full"))
            scored.teacher_logprobs, scored.teacher_dist = full["logprobs"], full["full"]
        else:
            score_teacher(teacher, scored, kind=kind, top_k=20)
        dist = scored.teacher_dist
        held = 0 if dist is None else dist.nbytes if hasattr(dist, "untyped_storage") else dist.nbytes()
        return rows * length, held + scored.teacher_logprobs.nbytes

    return Work(lambda: score(16), lambda: score(new))


def stacked_logits_backend() -> type:
    """:class:`opd_harness.backends.hf.HFBackend` with fa03cdf's ``_sample`` (imports torch and transformers: built lazily)."""
    import torch
    import torch.nn.functional as F
    from transformers import LogitsProcessorList

    from opd_harness.backends.hf import HFBackend
    from opd_harness.backends.sampling import RowSampler

    class Stacked(HFBackend):
        def _sample(self, ids, attn, seeds, params, kwargs):  # verbatim fa03cdf
            if not params.greedy:
                kwargs.update(logits_processor=LogitsProcessorList([RowSampler(seeds, params.temperature, params.top_p, self.device)]))
            result = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), output_logits=True, **kwargs)
            new_tokens = result.sequences[:, ids.shape[1] :].cpu()
            logits = torch.stack(result.logits, dim=1).float().cpu()  # (b, new, V) raw logits
            return new_tokens, F.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1), None

    return Stacked


SIGNALS = ("before", "sampled", "topk", "student_topk", "full")
WORK: dict[str, Callable[..., Work]] = {
    "rollout_before": rollout_before, "rollout_after": rollout_after,
    **{f"teacher_{kind}": (lambda kind: lambda **kw: teacher_scoring(kind, **kw))(kind) for kind in SIGNALS},
}  # fmt: skip
SECTIONS: dict[str, list[tuple[str, str]]] = {  # section: (table label, WORK name) per way
    "rollout": [("before (stacked output_logits)", "rollout_before"), ("after (per-step log-prob)", "rollout_after")],
    "teacher signal": [("before (fa03cdf: (B, T, V) float32 full)", "teacher_before"),
                       *[(f"{kind}{' (k = 20)' if 'topk' in kind else ''}", f"teacher_{kind}") for kind in SIGNALS[1:]]],
}  # fmt: skip


def child(fn_name: str, kwargs: dict) -> dict:
    """In the fresh process: build and warm up, reset the peak mark, run; the peak above the RSS before the run."""
    work = WORK[fn_name](**kwargs)
    work.warmup()
    started = time.perf_counter()
    made, peak = peak_rise(work.run)
    tokens, held = made if isinstance(made, tuple) else (made, None)
    return {"peak": peak, "tokens": tokens, "held": held, "seconds": time.perf_counter() - started}


def measure(fn_name: str, kwargs: dict, *, dynamic_mmap: bool = False) -> dict:
    """``WORK[fn_name](**kwargs)`` measured in a fresh process: ``{"peak": bytes, "tokens": n, "seconds": s}``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if not dynamic_mmap:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    command = [sys.executable, __file__, "--child", fn_name, json.dumps(kwargs)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{fn_name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(rows: list[list[str]], header: list[str]) -> None:
    """A plain fixed-width table, right-aligned numbers."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))


def run_section(ways: list[tuple[str, str]], kwargs: dict, repeats: int, dynamic_mmap: bool) -> list[list[str]]:
    """Every way of one section ``repeats`` times, the order reversed each round; one table row per way (median peak)."""
    results: dict[str, list[dict]] = {fn: [] for _, fn in ways}
    for round_ in range(repeats):
        for _, fn in ways if round_ % 2 == 0 else ways[::-1]:
            results[fn].append(measure(fn, kwargs, dynamic_mmap=dynamic_mmap))
            print(f"  {fn} round {round_}: {json.dumps(results[fn][-1])}", file=sys.stderr, flush=True)
    return [table_row(label, results[fn]) for label, fn in ways]


def table_row(label: str, runs: list[dict]) -> list[str]:
    """One way's row: median peak (MiB and bytes per token), tokens, every round's peak, median run time."""
    peaks = [r["peak"] for r in runs]
    peak, tokens = statistics.median(peaks), runs[0]["tokens"]
    every, seconds = " / ".join(f"{p / 2**20:,.0f}" for p in peaks), statistics.median(r["seconds"] for r in runs)
    held = "-" if runs[0].get("held") is None else f"{runs[0]['held'] / tokens:,.0f}"
    return [label, f"{peak / 2**20:,.1f}", f"{peak / tokens:,.0f}", held, f"{tokens:,}", every, f"{seconds:.1f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1, help="rollout rows sampled at once")
    parser.add_argument("--new", type=int, default=2048, help="new tokens per row")
    parser.add_argument("--hidden", type=int, default=32, help="hidden size of the tiny Qwen3")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the tiny Qwen3")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per way (order alternates)")
    parser.add_argument("--dynamic-mmap", action="store_true", help="leave glibc's mmap threshold dynamic (see above)")
    parser.add_argument("--child", nargs=2, metavar=("FN", "KWARGS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], json.loads(args.child[1]))))
        return 0
    kwargs = {"rows": args.rows, "new": args.new, "hidden": args.hidden, "layers": args.layers}
    header = ["way", "peak MiB", "peak B/token", "stored B/token", "tokens", "peaks MiB", "run s"]
    print(f"V={VOCAB:,} rows={args.rows} new={args.new} hidden={args.hidden} layers={args.layers} repeats={args.repeats} "
          f"mmap threshold={'dynamic' if args.dynamic_mmap else '128 KiB fixed'}; "
          f"one (rows, new, V) float32 tensor = {args.rows * args.new * VOCAB * 4 / 2**20:,.1f} MiB")  # fmt: skip
    for name, ways in SECTIONS.items():
        print(f"\n{name}")
        print_table(run_section(ways, kwargs, args.repeats, args.dynamic_mmap), header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
