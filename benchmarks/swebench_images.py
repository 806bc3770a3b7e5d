"""SWE-bench instance images and grading: build seconds per instance (cold and cached) and grading seconds per
instance (gold patch and empty patch), with the pins each image dropped.

    PYTHONPATH=. python benchmarks/swebench_images.py --data-dir DATA [--instances ID,ID] [--cold] [--out FILE.jsonl]

``--cold`` removes an instance's image first (the pip cache under ``--cache-dir`` stays warm unless you delete it);
without it an existing image counts as a cached build. One JSON line per instance; a summary at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from opd_harness.tasks.swebench.task import SwebenchOptions, SwebenchTask


def measure(task: SwebenchTask, problem, cold: bool) -> dict:
    """Build (cold when asked), rebuild from cache, grade the gold and the empty patch; the seconds of each."""
    row = problem.meta
    tag = task.build_inputs(row).tag
    if cold:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
    t0 = time.perf_counter()
    try:
        first = task.ensure_image(row)
    except Exception as exc:  # noqa: BLE001 - reported in the line, the others go on
        return {"instance": problem.id, "error": f"build: {exc}"[:2000]}
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    SwebenchTask(task.options).ensure_image(row)
    cached_s = time.perf_counter() - t0
    out = {
        "instance": problem.id,
        "image": first.tag,
        "built": first.built,
        "build_s": round(build_s, 1),
        "cached_build_s": round(cached_s, 2),
        "dropped_pins": first.dropped,
    }
    for name, patch in (("gold", problem.answer), ("empty", "")):
        t0 = time.perf_counter()
        outcome = task.grade_patch(row, patch)
        out[f"{name}_status"], out[f"{name}_grade_s"], out[f"{name}_reason"], out[f"{name}_log"] = (
            outcome.status,
            round(time.perf_counter() - t0, 1),
            outcome.reason,
            outcome.log_path,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--instances", default="", help="comma-separated ids (default: every instance with a snapshot)")
    parser.add_argument("--cache-dir", default=".cache/swebench")
    parser.add_argument("--cold", action="store_true", help="remove each image before building it")
    parser.add_argument("--out", type=Path, help="also append the JSON lines here")
    args = parser.parse_args(argv)
    task = SwebenchTask(SwebenchOptions(data_dir=str(args.data_dir), instances=args.instances, cache_dir=args.cache_dir))
    lines = []
    for problem in task.load():
        line = measure(task, problem, args.cold)
        lines.append(line)
        text = json.dumps(line)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")
    ok = [x for x in lines if "error" not in x]
    print(json.dumps({
        "instances": len(lines), "build_errors": len(lines) - len(ok),
        "gold_resolved": sum(x["gold_status"] == "pass" for x in ok), "empty_resolved": sum(x["empty_status"] == "pass" for x in ok),
        "grade_errors": sum(x[f"{k}_status"] == "error" for x in ok for k in ("gold", "empty")),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
