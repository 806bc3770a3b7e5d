"""Grading cost: the harness's Docker grader (warm pool, and a cold container per run) vs evalplus's own evaluator.

All three grade the same 164 HumanEval+ canonical solutions (base + plus tests) on this machine in one run, with
the same parallelism, and print wall times and speed ratios (evalplus seconds / harness seconds: above 1 means the
harness is faster) side by side; each is measured with its ground truth computed from scratch (cold) and read from
its cache (warm). The harness's cached-truth time counts reading that cache, as evaluate() counts loading its own.

SECURITY: evalplus's evaluator executes the graded code ON THE HOST (its ``reliability_guard`` is not a sandbox).
That is acceptable here only because the code is the trusted canonical solutions from the dataset file; never
point this script at model output. evalplus runs in a subprocess with ``HUMANEVAL_OVERRIDE_PATH`` (a jsonl
built from ``--data-dir``) and ``XDG_CACHE_HOME`` in a temporary directory, so it never touches the network. Its
process exits up to 20 s after the evaluation (a non-daemon ``stucking_checker`` thread sleeps in 20 s steps), so
both the ``evaluate()`` call (timestamps printed by the driver) and the whole process are reported.
Needs ``pip install -e '.[bench]'`` (evalplus 0.3.1), Docker and the sandbox image.
Usage: ``python benchmarks/evalplus_compare.py [--parallel 2] [--data-dir ../shared/data] [--cached-only N --cache-dir DIR]``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from opd_harness import sandbox
from opd_harness.registry import TASKS
from opd_harness.tasks.code.evalplus import HumanEvalPlusTask

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("task_id", "prompt", "entry_point", "canonical_solution", "base_input", "plus_input", "atol", "contract")

# Runs evalplus.evaluate in a child interpreter; prints monotonic timestamps around the call.
DRIVER = r"""
import json, sys, time
t0 = time.monotonic()
from evalplus.evaluate import evaluate
t1 = time.monotonic()
evaluate(dataset="humaneval", samples=sys.argv[1], parallel=int(sys.argv[2]))
t2 = time.monotonic()
print("@@TIMES " + json.dumps({"import_s": t1 - t0, "evaluate_s": t2 - t1, "returned_at": t2}), flush=True)
"""


class ColdDocker:
    """A sandbox whose every run gets a fresh container (created, run, removed): the cost without a warm pool."""

    python = "python3"

    def __init__(self, pool_size: int) -> None:
        self.pool_size = pool_size

    def run(self, request):
        with sandbox.open_sandbox("docker", pool_size=1, reap=False) as sb:
            return sb.run(request)


def write_inputs(data_dir: Path, tmp: Path) -> tuple[Path, Path]:
    """The local HumanEvalPlus jsonl evalplus needs (our data file's rows) and a samples file of canonical solutions."""
    rows = [json.loads(line) for line in gzip.open(data_dir / "humaneval_plus" / HumanEvalPlusTask.file_name, "rt")]
    dataset, samples = tmp / "HumanEvalPlus-local.jsonl", tmp / "samples.jsonl"
    dataset.write_text("".join(json.dumps({k: r.get(k, "" if k == "contract" else 0) for k in FIELDS}) + "\n" for r in rows))
    solutions = ({"task_id": r["task_id"], "solution": r["prompt"] + r["canonical_solution"]} for r in rows)
    samples.write_text("".join(json.dumps(x) + "\n" for x in solutions))
    return dataset, samples


def run_evalplus(dataset: Path, samples: Path, cache: Path, parallel: int) -> dict:
    """One evalplus evaluation in a subprocess: evaluate() wall, process wall, ground-truth seconds, pass counts."""
    result_file = samples.with_name(samples.stem + "_eval_results.json")
    result_file.unlink(missing_ok=True)  # an existing results file would be silently reused
    env = {**os.environ, "HUMANEVAL_OVERRIDE_PATH": str(dataset), "XDG_CACHE_HOME": str(cache)}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(samples), str(parallel)], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=3600)
    process_s = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"evalplus failed ({proc.returncode}): {proc.stderr[-2000:]}")
    times = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("@@TIMES "))[8:])
    marker = "Expected outputs computed in "
    truth_s = next((float(line[len(marker) :].rstrip("s")) for line in proc.stdout.splitlines() if line.startswith(marker)), 0.0)
    evals = json.loads(result_file.read_text())["eval"]
    base = sum(r[0]["base_status"] == "pass" for r in evals.values())
    plus = sum(r[0]["base_status"] == r[0]["plus_status"] == "pass" for r in evals.values())
    failed = {}
    for tid, (r, *_) in evals.items():
        if not r["base_status"] == r["plus_status"] == "pass":
            failing = str(r["base_fail_tests"] or r["plus_fail_tests"])[:120]
            failed[tid] = f"base {r['base_status']}, plus {r['plus_status']}, failing input {failing}"
    return {"evaluate_s": times["evaluate_s"], "process_s": process_s, "truth_s": truth_s, "base": base, "plus": plus, "n": len(evals),
            "failed": failed}


def run_harness(sb, data_dir: Path, cache: Path, workers: int) -> dict:
    """Ground truth (computed unless cached in ``cache``) then grading of every canonical solution, timed apart."""
    os.environ["HARNESS_CACHE_DIR"] = str(cache)
    task = TASKS.get("humaneval_plus")(HumanEvalPlusTask.Options(workers=workers), sandbox=sb)
    problems = task.load(data_dir=data_dir)
    started = time.monotonic()
    task.parallel(lambda i: task.truth(problems[i].id) and None, len(problems))
    truth_s = time.monotonic() - started
    scores = task.grade_many(problems, [p.solution for p in problems])
    grade_s = time.monotonic() - started - truth_s
    details = [json.loads(s.details) for s in scores]
    failed = {p.id: s.details[:300] for p, s in zip(problems, scores) if s.status != "pass"}
    return {"truth_s": truth_s, "grade_s": grade_s, "total_s": truth_s + grade_s, "n": len(scores),
            "base": sum(d.get("base") == "pass" for d in details), "plus": sum(s.status == "pass" for s in scores), "failed": failed}


def report(n: int, ep_cold: dict, ep_warm: dict, warm_cold: dict, warm_warm: dict, cold_warm: dict) -> None:
    """Print pass counts, wall times and ratios side by side, then whatever did not pass."""
    base = ep_warm["evaluate_s"]
    print(f"HumanEval+ canonical solutions, {ep_cold['n']} problems, parallelism {n}; pass counts base/plus:")
    print(f"  evalplus 0.3.1 (host) {ep_warm['base']}/{ep_warm['plus']}; harness warm pool {warm_warm['base']}/{warm_warm['plus']}; "
          f"harness cold containers {cold_warm['base']}/{cold_warm['plus']}")
    print("grading seconds (ground truth cached; harness: reading its cached truth + grading, as evaluate() loads its own):")
    print(f"  evalplus evaluate()         {base:7.1f}   (whole process {ep_warm['process_s']:.1f}: exit waits up to 20 s)")
    print(
        f"  harness Docker warm pool    {warm_warm['total_s']:7.1f}   "
        f"(truth read {warm_warm['truth_s']:.1f}, grading {warm_warm['grade_s']:.1f}); "
        f"speed vs evalplus (evalplus s / harness s) {base / warm_warm['total_s']:.2f}"
    )
    print(f"  harness Docker cold per run {cold_warm['total_s']:7.1f}   speed vs evalplus {base / cold_warm['total_s']:.2f}; "
          f"cold/warm {cold_warm['total_s'] / warm_warm['total_s']:.2f}x")
    print("ground truth computed from scratch, then grading:")
    print(f"  evalplus evaluate()         {ep_cold['evaluate_s']:7.1f}   (ground truth {ep_cold['truth_s']:.1f}; "
          f"whole process {ep_cold['process_s']:.1f})")
    print(f"  harness Docker warm pool    {warm_cold['total_s']:7.1f}   (ground truth {warm_cold['truth_s']:.1f}, "
          f"grading {warm_cold['grade_s']:.1f}); speed vs evalplus {ep_cold['evaluate_s'] / warm_cold['total_s']:.2f}")
    runs = {"evalplus, ground truth cold": ep_cold, "evalplus, ground truth cached": ep_warm,
            "harness warm pool, ground truth cold": warm_cold, "harness warm pool": warm_warm, "harness cold containers": cold_warm}
    for name, r in runs.items():
        for tid, why in r["failed"].items():
            print(f"  not passed ({name}): {tid}: {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--parallel", type=int, default=2, help="evalplus --parallel and harness workers / pool size")
    parser.add_argument("--cached-only", type=int, metavar="N", default=0,
                        help="only the cached-ground-truth comparison, N times (evalplus then harness, alternating; "
                             "ground truth is computed first, untimed, where --cache-dir lacks it)")
    parser.add_argument("--cache-dir", type=Path, help="keep both ground-truth caches here between runs (default: a temporary folder)")
    args = parser.parse_args()
    n = args.parallel
    with tempfile.TemporaryDirectory(prefix="opd-evalplus-compare-") as tmp_s:
        tmp = Path(tmp_s)
        cache = args.cache_dir or tmp
        dataset, samples = write_inputs(args.data_dir, tmp)
        if args.cached_only:
            cached_only(args, dataset, samples, cache)
            return
        ep_cold = run_evalplus(dataset, samples, cache / "xdg", n)
        ep_warm = run_evalplus(dataset, samples, cache / "xdg", n)
        with sandbox.open_sandbox("docker", pool_size=n, prewarm=n) as sb:
            warm_cold = run_harness(sb, args.data_dir, cache / "harness", n)
            warm_warm = run_harness(sb, args.data_dir, cache / "harness", n)
        cold_warm = run_harness(ColdDocker(n), args.data_dir, cache / "harness", n)
    report(n, ep_cold, ep_warm, warm_cold, warm_warm, cold_warm)
    print(json.dumps({"evalplus_cold": ep_cold, "evalplus_warm": ep_warm, "harness_warm_pool_cold_truth": warm_cold,
                      "harness_warm_pool": warm_warm, "harness_cold_containers": cold_warm}))


def cached_only(args: argparse.Namespace, dataset: Path, samples: Path, cache: Path) -> None:
    """Issue row: evalplus evaluate() seconds / harness seconds with both ground truths cached, ``--cached-only`` times."""
    n = args.parallel
    with sandbox.open_sandbox("docker", pool_size=n, prewarm=n) as sb:
        if not any((cache / "xdg").glob("evalplus/*")):
            run_evalplus(dataset, samples, cache / "xdg", n)  # computes and caches evalplus's ground truth
        if not any((cache / "harness").glob("evalplus/*/*")):
            run_harness(sb, args.data_dir, cache / "harness", n)
        ratios = []
        for k in range(args.cached_only):
            ep = run_evalplus(dataset, samples, cache / "xdg", n)
            ours = run_harness(sb, args.data_dir, cache / "harness", n)
            ratios.append(ep["evaluate_s"] / ours["total_s"])
            print(f"run {k + 1}: evalplus evaluate() {ep['evaluate_s']:.1f} s ({ep['base']}/{ep['plus']} pass), harness warm pool "
                  f"{ours['total_s']:.1f} s (truth read {ours['truth_s']:.1f}; {ours['base']}/{ours['plus']} pass); "
                  f"evalplus s / harness s = {ratios[-1]:.2f}", flush=True)
    print(f"evalplus s / harness s over {len(ratios)} runs: {', '.join(f'{r:.2f}' for r in ratios)} (target >= 1.0)")


if __name__ == "__main__":
    main()
