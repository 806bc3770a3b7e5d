"""The harness's OPD step with the per-bucket backward (``trainer.graph_memory_gib=0``, the rule before issue 46) vs one
graph over the step's length buckets (the default budget), side by side: the same models, prompts and work as
``benchmarks/vs_trl.py``'s harness side, each arm in its own process, processes alternated A B B A over ``--rounds``,
the first ``--warmup`` steps of every process discarded. Prints per-step medians (whole step, generation, teacher
scoring + learner step) with their interquartile ranges per arm, the ratio, the load average, and both arms' loss on
their first step (before any update: it must be equal).

    PYTHONPATH=. python benchmarks/one_graph_step.py [--steps 6] [--warmup 2] [--rounds 2] [--threads 1]
        [--vocab 0|151936] [--hidden 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import PHASES, build_models, load, quartiles, report, side_run  # noqa: E402

ARMS = {"per_bucket": ["trainer.graph_memory_gib=0"], "one_graph": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per process, warm-ups included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each process discarded")
    parser.add_argument("--rounds", type=int, default=2, help="A B B A rounds (two processes per arm each)")
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size of both models (0: the char tokenizer's)")
    parser.add_argument("--hidden", type=int, default=0, help="hidden size of both models (0: the cpu-demo shapes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="one-graph-"))
    models = build_models(root, args.vocab, args.hidden)
    specs = {}
    for arm, sets in ARMS.items():
        specs[arm] = root / f"{arm}.json"
        specs[arm].write_text(json.dumps({"models": models, "steps": args.steps, "threads": args.threads, "set": sets}))
    print(f"vocab {args.vocab or 'char'}, hidden {args.hidden or 'cpu-demo'}, {args.steps} steps/process ({args.warmup} discarded), "
          f"{args.rounds} ABBA rounds, threads {args.threads}; loadavg {load()}", flush=True)  # fmt: skip
    kept: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    losses: dict[str, float] = {}
    abba, baab = ("per_bucket", "one_graph", "one_graph", "per_bucket"), ("one_graph", "per_bucket", "per_bucket", "one_graph")
    for r in range(args.rounds):
        for arm in abba if r % 2 == 0 else baab:
            rows = side_run(sys.executable, "harness", specs[arm])
            losses.setdefault(arm, rows[0]["loss"])
            kept[arm] += rows[1 + args.warmup :]
            report(arm, rows[1 + args.warmup :])
    for arm in ARMS:
        print(f"{arm:10s} n={len(kept[arm])}: " + "  ".join(f"{phase} {quartiles([r[phase] for r in kept[arm]])}" for phase in PHASES))
    before, after = (statistics.median(r["step"] for r in kept[arm]) for arm in ("per_bucket", "one_graph"))
    tl_before, tl_after = (statistics.median(r["teacher_learner"] for r in kept[arm]) for arm in ("per_bucket", "one_graph"))
    print(f"steps/s one graph / per bucket: {before / after:.2f}x (median step {after:.3f} s vs {before:.3f} s; teacher + learner "
          f"{tl_after:.3f} vs {tl_before:.3f} s)")  # fmt: skip
    print(f"first-step loss: per bucket {losses['per_bucket']:.9f}, one graph {losses['one_graph']:.9f}; loadavg {load()}")


if __name__ == "__main__":
    main()
