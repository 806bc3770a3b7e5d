"""What per-row seeded sampling costs per decode step: the hf backend's ``RowSampler`` (each row drawn from its own
generator, so a row's tokens do not depend on its batch) vs transformers' batched draw from the global RNG (before
issue 25), on the same logits, side by side in one run.

For each batch size and vocabulary size both ways are warmed up (untimed), then timed over ``--steps`` steps in
alternating order; printed are the ms per step of each and their ratio, next to nothing else (a model's forward pass
per step is the cost these compare against: a tiny CPU model's is ~1-5 ms, a 1.5B model's on a GPU ~10-20 ms).

Usage: ``PYTHONPATH=. python benchmarks/row_sampling.py [--steps 50] [--rounds 4] [--device cpu|cuda] [--top-p 1.0] [--threads 1]``
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from opd_harness.backends.sampling import RowSampler

VOCABS = {"char tokenizer": 100, "Qwen3 vocabulary": 151_936}


def batched_step(warpers: LogitsProcessorList, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """transformers' sampling step: warp, softmax, one multinomial over the batch from the global RNG."""
    probs = torch.softmax(warpers(ids, logits), dim=-1)
    return torch.multinomial(probs, 1).squeeze(1)


def row_step(sampler: RowSampler, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The hf backend's step: RowSampler's per-row draws, then greedy's argmax over what it leaves."""
    return sampler(ids, logits).argmax(-1)


def timed(step, steps: int, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"device {args.device}, threads {torch.get_num_threads()}, temperature 1.0, top_p {args.top_p}")
    for vocab_name, vocab in VOCABS.items():
        for rows in (16, 64):
            logits = torch.randn(rows, vocab, device=args.device) * 3
            ids = torch.zeros(rows, 1, dtype=torch.long, device=args.device)
            warpers = LogitsProcessorList([TemperatureLogitsWarper(1.0)] + ([TopPLogitsWarper(args.top_p)] if args.top_p < 1 else []))
            sampler = RowSampler(list(range(rows)), 1.0, args.top_p, args.device)
            ways = {"batched": lambda: batched_step(warpers, ids, logits), "per-row": lambda: row_step(sampler, ids, logits)}
            for step in ways.values():
                timed(step, 3, args.device)
            ms: dict[str, list[float]] = {name: [] for name in ways}
            for r in range(args.rounds):
                for name in list(ways) if r % 2 == 0 else list(ways)[::-1]:
                    ms[name].append(timed(ways[name], args.steps, args.device))
            batched, per_row = (min(ms[name]) for name in ways)
            print(f"{vocab_name:<17} {rows:3d} rows: batched {batched:7.3f} ms/step   per-row {per_row:7.3f} ms/step   "
                  f"ratio {per_row / batched:5.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
