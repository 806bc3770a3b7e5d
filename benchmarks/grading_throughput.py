"""Grading throughput: the harness's math-verify process pool vs a bare sequential math-verify loop.

Both grade the same 2,000 MATH500 completions (4 per problem: the gold boxed, the gold with a
preamble, a wrong number and no answer) in one run, after a warm-up. Prints items/s and the ratio.
Usage: ``python benchmarks/grading_throughput.py [--data-dir ../shared/data] [--workers 2]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from math_verify import parse, verify


from opd_harness.tasks.math_grading import MathGrader
from opd_harness.registry import TASKS


def completions_for(gold: str) -> list[str]:
    return [f"\\boxed{{{gold}}}", f"Let us think.\nSo the answer is $\\boxed{{{gold}}}$.", "\\boxed{-12345}", "I am not sure."]


def sequential(items: list[tuple[str, str]]) -> list[bool]:
    """What a minimal grader does: parse both and verify, one item after another, in the main thread."""
    return [verify(parse(f"${gold}$"), parse(completion)) for completion, gold in items]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    problems = TASKS.get("math500")().load("test", args.data_dir)
    items = [(c, p.answer) for p in problems for c in completions_for(p.answer)][:2000]
    grader = MathGrader(workers=args.workers)
    grader.grade_many(items[:20])  # warm-up: pool start and imports
    sequential(items[:20])
    started = time.perf_counter()
    pooled = grader.grade_many(items)
    pooled_s = time.perf_counter() - started
    started = time.perf_counter()
    bare = sequential(items)
    bare_s = time.perf_counter() - started
    grader.close()
    agree = sum((g.status == "pass") == b for g, b in zip(pooled, bare))
    errors = sum(g.status == "error" for g in pooled)
    print(f"{len(items)} completions; harness pool ({args.workers} workers): {pooled_s:.1f}s = {len(items) / pooled_s:.0f}/s; "
          f"bare sequential: {bare_s:.1f}s = {len(items) / bare_s:.0f}/s; "
          f"ratio harness/bare throughput = {bare_s / pooled_s:.2f}")  # fmt: skip
    print(f"agreement pass/not-pass: {agree}/{len(items)}; harness errors: {errors}")


if __name__ == "__main__":
    main()
