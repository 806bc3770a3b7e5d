"""Replay every canonical solution of HumanEval+ / MBPP+ through the harness grader (Docker warm pool).

For each dataset file in ``--data-dir`` the completion graded for a problem is its own ``prompt +
canonical_solution``, so every one must pass base and plus; the script prints per-dataset base / plus
pass counts, the wall time of the ground-truth runs and of the grading, and every exception with its
details (status, failing input index and a preview of that input). Ground truth is recomputed from
scratch in a temporary cache unless ``--cache-dir`` is given. Needs Docker and the sandbox image.
Usage: ``python benchmarks/code_canonical.py [--tasks humaneval_plus mbpp_plus] [--pool-size 2] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from opd_harness import sandbox
from opd_harness.registry import TASKS
from opd_harness.tasks.code.evalplus import EvalPlusTask

ROOT = Path(__file__).resolve().parents[1]
EVALPLUS_TASKS = ("humaneval_plus", "mbpp_plus")


def input_preview(task: EvalPlusTask, problem_id: str, phase: str, index: int | None, width: int = 160) -> str:
    """A short repr of the input a problem failed on (for the exception list)."""
    if index is None:
        return ""
    text = repr(task._rows[problem_id][f"{phase}_input"][index])
    return text if len(text) <= width else text[: width - 3] + "..."


def replay(name: str, sb, data_dir: Path, limit: int | None) -> dict:
    """Grade every canonical solution of one dataset; returns counts, timings and the exceptions."""
    task = TASKS.get(name)(sandbox=sb)  # the registry names the class (its name is its entry point's)
    problems = task.load(data_dir=data_dir)[:limit]
    started = time.perf_counter()
    truth_errors = {}
    for p, result in zip(problems, task.parallel(lambda i: _truth(task, problems[i].id), len(problems))):
        if result.status == "error":
            truth_errors[p.id] = result.details
    truth_s = time.perf_counter() - started
    started = time.perf_counter()
    scores = task.grade_many(problems, [p.solution for p in problems])
    grade_s = time.perf_counter() - started
    details = [json.loads(s.details) for s in scores]
    exceptions = []
    for p, s, d in zip(problems, scores, details):
        if s.status == "pass" and d.get("base") == "pass" and d.get("plus") == "pass":
            continue
        phase = "base" if d.get("base") != "pass" else "plus"
        exceptions.append({
            "id": p.id, "status": s.status, "base": d.get("base"), "plus": d.get("plus"), "phase": phase,
            "error": d.get(f"{phase}_error") or d.get("reason") or d.get("error") or s.details,
            "failed_input": d.get(f"{phase}_failed_input"),
            "input": input_preview(task, p.id, phase, d.get(f"{phase}_failed_input")),
        })
    return {
        "task": name, "problems": len(problems), "base_pass": sum(d.get("base") == "pass" for d in details),
        "plus_pass": sum(d.get("plus") == "pass" for d in details), "errors": sum(s.status == "error" for s in scores),
        "truth_s": round(truth_s, 1), "grade_s": round(grade_s, 1), "truth_errors": truth_errors, "exceptions": exceptions,
    }


def _truth(task: EvalPlusTask, problem_id: str):
    """Compute (or read) one problem's ground truth; a failure comes back as an ``error`` Score."""
    from opd_harness.task import Score

    try:
        task.truth(problem_id)
        return Score("pass")
    except RuntimeError as exc:
        return Score("error", details=str(exc))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=EVALPLUS_TASKS, default=list(EVALPLUS_TASKS))
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--pool-size", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="first N problems of each dataset")
    parser.add_argument("--cache-dir", type=Path, default=None, help="ground-truth cache (default: a fresh temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="also write the full report here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="opd-canonical-") as tmp:
        os.environ["HARNESS_CACHE_DIR"] = str(args.cache_dir or tmp)
        with sandbox.open_sandbox("docker", pool_size=args.pool_size, prewarm=args.pool_size) as sb:
            reports = [replay(name, sb, args.data_dir, args.limit) for name in args.tasks]
    for r in reports:
        n = r["problems"]
        print(f"{r['task']}: {n} problems, base pass {r['base_pass']}/{n}, plus pass {r['plus_pass']}/{n}, grading errors {r['errors']}; "
              f"ground truth {r['truth_s']} s, grading {r['grade_s']} s (pool {args.pool_size})")
        for tid, why in r["truth_errors"].items():
            print(f"  ground truth failed: {tid}: {why[:300]}")
        for e in r["exceptions"]:
            print(f"  exception {e['id']}: {e['status']} (base {e['base']}, plus {e['plus']}) at {e['phase']} input {e['failed_input']}: "
                  f"{(e['error'] or '')[:300]} | input {e['input']}")
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
