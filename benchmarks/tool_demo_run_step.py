"""Tool-demo training step, the real thing: ``harness run --preset tool-demo`` of an older tree against this one.

Each run trains ``--steps`` steps of the preset (16 prompts x 4 arith_tool episodes a step, Docker sandbox) with the
same overrides on both sides: the student loaded from ``--student`` (a warmed-up model directory, e.g. the one a
tool-demo run cached under ``<out>/cache/models/``; so no warm-up runs and both trees start from the same weights),
the teacher without its warm-up (``teacher.sft_steps=0``: it only scores, its cost does not depend on its weights),
``trainer.lr`` ``--lr`` (default 1e-9: the student stays the model it was, so every step does the same kind of work —
with the preset's rate it stops calling the tool within a few steps and the sandbox drops out of the step), no
evaluation but one 1-problem, k=1 check at the end, ``trainer.max_grade_error_rate=1.0`` (on a saturated machine
the old tree's fresh containers fail a few cells' grading, which would stop its run), and the same seed. The two trees' runs alternate
(old, new, new, old, ...) for ``--rounds`` rounds; each run's first step is its warm-up and is excluded. Per-step
times are read from the run's store (``step_metrics``: ``time_step_s`` and its stages, ``timing_s/<stage>`` in
trackers), with the tool calls per episode.

The preset itself may have changed between the trees (since 2e29556: 3-digit operands, ``value_width`` 10, 5 warm-up
steps, evaluation top_p 0.95); ``--new-set KEY=VALUE`` puts the newer side back on the old preset's task and schedule, so
both sides run the same problems and config (the README's command does).

Usage: ``PYTHONPATH=. python benchmarks/tool_demo_run_step.py --old /tmp/old-tree --student DIR [--steps 4] [--rounds 2]
[--new-set KEY=VALUE ...]``
(``--old`` is a checkout with its own ``.venv``; this tree runs with ``.venv/bin/python`` here).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STAGES = ("time_step_s", "time_generate_s", "time_reward_s", "time_teacher_s", "time_old_logprobs_s", "time_train_s")


def run_once(tree: Path, out: Path, student: str, steps: int, lr: float, extra: list[str] = ()) -> dict[int, dict[str, float]]:
    """One ``harness run`` in ``tree`` (its own ``.venv``), with ``extra`` ``--set`` overrides; {step: {metric: value}}."""
    sets = [f"trainer.steps={steps}", "teacher.sft_steps=0", "student.arch=null", f"student.path={student}", "student.sft_steps=0",
            f"trainer.lr={lr}", "trainer.checkpoint_every=100000", "eval.before_training=false", "eval.teacher=false",
            "eval.limit=1", "eval.k=1", "trainer.max_grade_error_rate=1.0", *extra]  # fmt: skip
    cmd = [str(tree / ".venv/bin/python"), "-m", "opd_harness.cli", "run", "--preset", "tool-demo", "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: harness run exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    with sqlite3.connect(out / "results.sqlite") as conn:
        rows = conn.execute("SELECT step, name, value FROM step_metrics").fetchall()
    steps_seen: dict[int, dict[str, float]] = {}
    for step, name, value in rows:
        steps_seen.setdefault(int(step), {})[name] = float(value)
    return steps_seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="the older tree (with its own .venv)")
    parser.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1], help="the newer tree (default: this one)")
    parser.add_argument("--student", required=True, help="a warmed-up student model directory (loaded by both trees)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per run (the first is excluded)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree, in alternating order")
    parser.add_argument("--lr", type=float, default=1e-9, help="trainer.lr of both sides")
    parser.add_argument("--new-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for the newer tree only (repeatable): puts back what its preset changed since the old "
                        "tree, e.g. task_args.arith_tool.max_operand=99999")  # fmt: skip
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is excluded)")
    sides = {"old": args.old.resolve(), "new": args.new.resolve()}
    later: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    root = Path(tempfile.mkdtemp(prefix="tool-demo-ab-"))
    print(f"load {os.getloadavg()[0]:.1f} at the start; runs under {root}", flush=True)
    for r in range(args.rounds):
        for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
            started = time.perf_counter()
            extra = args.new_set if side == "new" else []
            steps = run_once(sides[side], root / f"{side}-{r}", args.student, args.steps, args.lr, extra)
            kept = [steps[s] for s in sorted(steps) if s > min(steps)]
            later[side] += kept
            line = " ".join(f"{m['time_step_s']:6.2f}" for m in kept)
            calls = " ".join(f"{m.get('mean_tool_calls', float('nan')):.2f}" for m in kept)
            wall = time.perf_counter() - started
            print(f"round {r + 1} {side}: steps after the first {line} s  (tool calls/episode {calls}; run {wall:.0f} s,"
                  f" load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    for side in ("old", "new"):
        means = {k: statistics.mean(m.get(k, 0.0 if k in STAGES else float("nan")) for m in later[side])  # a stage not run took 0 s
                 for k in (*STAGES, "mean_tool_calls")}
        print(f"{side}: " + "  ".join(f"{k.removeprefix('time_').removesuffix('_s')} {v:.2f}" for k, v in means.items()))
    old, new = (statistics.mean(m["time_step_s"] for m in later[s]) for s in ("old", "new"))
    print(f"step time after the first: old {old:.2f} s, new {new:.2f} s: {old / new:.2f}x (load {os.getloadavg()[0]:.1f} at the end)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
