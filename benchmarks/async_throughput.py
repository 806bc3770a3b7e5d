"""Async vs sync throughput on the CPU arith config, against the ideal-overlap bound.

Runs the same config (cached cpu-demo models, N steps, no evaluation) in sync mode and in async
mode (rollout worker and learner one thread each; sync also gets one thread so the comparison is
per-role fair), one after the other in this process. From the sync run's stage times it computes
the ideal-overlap bound: a step can be no faster than max(rollout time, learner time), so
  ideal speed-up = (t_rollout + t_train) / max(t_rollout, t_train).
Also measures f-OPD's overhead over plain async OPD with the sampled-token loss (same schedule), twice:
- learning (lr 1e-3): the two students learn differently and generate responses of different
  lengths, so the step ratio mixes what f-OPD computes with what its student has learnt to generate;
  the per-stage times and response lengths are printed beside it;
- frozen (lr 1e-9, the student practically does not move): both runs generate, score and train on
  the same rollouts, so the ratio is the cost of f-OPD's own machinery (freshness statistics, token
  sets, anchor term, refresh check) per async step.
The machine's load average is printed before and after: the overlap needs two free cores.
Step times on a shared 2-vCPU machine vary from run to run (the same code gave 34% and 106% of the possible gain
in two runs 20 minutes apart), so ``--pairs N`` repeats only the sync / async OPD pair N times, alternating, and
prints every pair's share of the bound and their median.
Usage: ``python benchmarks/async_throughput.py [--steps 60] [--out /tmp/bench-async] [--pairs N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from rich.console import Console

from harness.config import build_config
from harness.plan import plan_run
from harness.store import Store
from harness.sweep import create_train_run, execute_run


def run_once(out: Path, steps: int, *overrides: str) -> dict[int, dict[str, float]]:
    settings = [f"trainer.steps={steps}", f"trainer.checkpoint_every={steps}", "eval.teacher=false", "eval.before_training=false",
                "eval.limit=8", "eval.k=1", "threads=1", *overrides]  # fmt: skip
    plan = plan_run(build_config(preset="cpu-demo", overrides=settings))
    store = Store(out)
    run_id = create_train_run(store, plan.config, plan)
    execute_run(plan, store, run_id, resume=False, console=Console(stderr=True, quiet=True))
    return store.step_metrics(run_id)


def median(metrics: dict[int, dict[str, float]], key: str, skip: int = 3) -> float:
    """Median over steps, skipping the first few (warm-up, empty pipeline)."""
    return statistics.median(m.get(key, 0.0) for s, m in metrics.items() if s > skip)


def load() -> str:
    """The 1/5/15-minute load averages (2 cores: above ~2 the roles do not get a core each)."""
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def stages(metrics: dict[int, dict[str, float]]) -> str:
    """Median per-stage milliseconds and response length of one run."""
    parts = [f"{key} {median(metrics, f'time_{key}_s') * 1e3:.0f}" for key in ("step", "generate", "teacher", "train")]
    return " / ".join(parts) + f" ms, response {median(metrics, 'response_length'):.1f} tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-async"))
    parser.add_argument("--pairs", type=int, default=0, metavar="N", help="only the sync / async OPD comparison, N times, alternating")
    args = parser.parse_args()
    if args.pairs:
        repeat_pairs(args)
        return
    started_load = load()
    sync = run_once(args.out, args.steps, "trainer.mode=sync")
    async_opd = run_once(args.out, args.steps, "trainer.mode=async", "trainer.max_lag=1")
    async_sampled = run_once(args.out, args.steps, "trainer.mode=async", "trainer.max_lag=1", "method_args.opd.estimator=sampled")
    async_fopd = run_once(args.out, args.steps, "trainer.mode=async", "trainer.max_lag=1", "method=f_opd")
    frozen = ("trainer.mode=async", "trainer.max_lag=1", "trainer.lr=1e-9")
    frozen_sampled = run_once(args.out, args.steps, *frozen, "method_args.opd.estimator=sampled")
    frozen_fopd = run_once(args.out, args.steps, *frozen, "method=f_opd")
    step_async, step_sampled, step_fopd = (median(m, "time_step_s") for m in (async_opd, async_sampled, async_fopd))
    speedup, ideal, share = share_of_bound(sync, async_opd)
    print(f"{args.steps} steps of 64 samples, 1 thread per role; medians over steps > 3; {started_load} at the start, {load()} at the end")
    print(f"sync stage times: {stages(sync)}")
    print(f"async OPD step {step_async * 1e3:.0f} ms: speed-up {speedup:.2f}x; ideal-overlap bound {ideal:.2f}x ({share * 100:.0f}% of the possible gain)")
    print(f"async idle ratios: rollout {median(async_opd, 'idle_ratio_rollout'):.2f}, learner {median(async_opd, 'idle_ratio_learner'):.2f}; "
          f"mean lag {statistics.mean(m['lag_mean'] for m in async_opd.values()):.2f}")  # fmt: skip
    print(f"f-OPD async step {step_fopd * 1e3:.0f} ms vs plain async OPD with the same sampled-token loss {step_sampled * 1e3:.0f} ms: "
          f"overhead {step_fopd / step_sampled:.2f}x (learning)")  # fmt: skip
    print(f"  f-OPD          {stages(async_fopd)}")
    print(f"  plain sampled  {stages(async_sampled)}")
    frozen_ratio = median(frozen_fopd, "time_step_s") / median(frozen_sampled, "time_step_s")
    print(f"f-OPD async step on the same rollouts (lr 1e-9): overhead {frozen_ratio:.2f}x")
    print(f"  f-OPD          {stages(frozen_fopd)}")
    print(f"  plain sampled  {stages(frozen_sampled)}")


def share_of_bound(sync: dict[int, dict[str, float]], asynchronous: dict[int, dict[str, float]]) -> tuple[float, float, float]:
    """(async speed-up over sync, ideal-overlap bound, share of the possible gain reached) from one pair of runs."""
    rollout = median(sync, "time_generate_s") + median(sync, "time_teacher_s")
    train = median(sync, "time_train_s")
    ideal = (rollout + train) / max(rollout, train)
    speedup = median(sync, "time_step_s") / median(asynchronous, "time_step_s")
    return speedup, ideal, (speedup - 1) / (ideal - 1) if ideal > 1 else 0.0


def repeat_pairs(args: argparse.Namespace) -> None:
    """Issue row: the async OPD step against the ideal overlap, ``--pairs`` times (sync then async, alternating)."""
    shares = []
    for k in range(args.pairs):
        before = load()
        sync = run_once(args.out, args.steps, "trainer.mode=sync")
        asynchronous = run_once(args.out, args.steps, "trainer.mode=async", "trainer.max_lag=1")
        speedup, ideal, share = share_of_bound(sync, asynchronous)
        shares.append(share)
        print(f"pair {k + 1}: sync step {median(sync, 'time_step_s') * 1e3:.0f} ms ({stages(sync)}), async step "
              f"{median(asynchronous, 'time_step_s') * 1e3:.0f} ms ({stages(asynchronous)}); speed-up {speedup:.2f}x of a "
              f"{ideal:.2f}x bound = {share * 100:.0f}% of the possible gain; {before} before, {load()} after", flush=True)  # fmt: skip
    print(f"share of the possible gain over {len(shares)} pairs: {', '.join(f'{x * 100:.0f}%' for x in shares)}; "
          f"median {statistics.median(shares) * 100:.0f}% (target >= 90%)")


if __name__ == "__main__":
    main()
