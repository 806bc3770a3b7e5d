"""Async vs sync throughput on the CPU arith config, against the ideal-overlap bound.

Runs the same config (cached cpu-demo models, N steps, no evaluation) in sync mode and in async
mode (rollout worker and learner one thread each; sync also gets one thread so the comparison is
per-role fair), one after the other in this process. From the sync run's stage times it computes
the ideal-overlap bound: a step can be no faster than max(rollout time, learner time), so
  ideal speed-up = (t_rollout + t_train) / max(t_rollout, t_train).
Also measures f-OPD's overhead over ``opd_async``, the f-OPD paper's "Async OPD" baseline: the like-for-like
loss (the same per-token loss sg(s − T)·s averaged per sample over its valid tokens, the same schedule), so the
ratio is what f-OPD adds: freshness weights, token sets, the anchor term, the refresh check and the refreshes
it triggers (counted and printed). (``opd`` with ``estimator=sampled`` is not that loss: Tinker's
−exp(s − q)·A with a token mean.) Twice:
- learning (lr 1e-3): the two students learn differently and generate responses of different
  lengths, so the step ratio mixes what f-OPD computes with what its student has learnt to generate;
  the per-stage times and response lengths are printed beside it;
- frozen (lr 1e-9, the student practically does not move): both runs generate, score and train on
  the same rollouts, so the ratio is the cost of f-OPD's own machinery per async step.
Each run's first 3 steps (its warm-up: first forward passes, an empty pipeline) are left out of its medians,
and the two sides of a comparison alternate which runs first: f-OPD first while learning, opd_async first
when frozen; with ``--pairs`` sync first in odd pairs and async first in even ones.
The machine's load average is printed before and after: the overlap needs two free cores.
Step times on a shared 2-vCPU machine vary from run to run (the same code gave 34% and 106% of the possible gain
in two runs 20 minutes apart), so ``--pairs N`` repeats only the sync / async OPD pair N times and prints every
pair's share of the bound and their median.
Usage: ``python benchmarks/async_throughput.py [--steps 60] [--out /tmp/bench-async] [--pairs N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from rich.console import Console

from opd_harness.config import build_config
from opd_harness.plan import plan_run
from opd_harness.store import Store
from opd_harness.runs import create_train_run, execute_run


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
    learning = ("trainer.mode=async", "trainer.max_lag=1")
    frozen = (*learning, "trainer.lr=1e-9")
    async_fopd = run_once(args.out, args.steps, *learning, "method=f_opd")  # f-OPD first while learning ...
    async_base = run_once(args.out, args.steps, *learning, "method=opd_async")
    frozen_base = run_once(args.out, args.steps, *frozen, "method=opd_async")  # ... opd_async first when frozen
    frozen_fopd = run_once(args.out, args.steps, *frozen, "method=f_opd")
    speedup, ideal, share = share_of_bound(sync, async_opd)
    print(f"{args.steps} steps of 64 samples, 1 thread per role; medians over steps > 3; {started_load} at the start, {load()} at the end")
    print(f"sync stage times: {stages(sync)}")
    print(f"async OPD step {median(async_opd, 'time_step_s') * 1e3:.0f} ms: speed-up {speedup:.2f}x; ideal-overlap bound {ideal:.2f}x "
          f"({share * 100:.0f}% of the possible gain)")  # fmt: skip
    print(f"async idle ratios: rollout {median(async_opd, 'idle_ratio_rollout'):.2f}, "
          f"learner {median(async_opd, 'idle_ratio_learner'):.2f}; "
          f"mean lag {statistics.mean(m['lag_mean'] for m in async_opd.values()):.2f}")  # fmt: skip
    print_overhead("learning", async_fopd, async_base)
    print_overhead("on the same rollouts, lr 1e-9", frozen_fopd, frozen_base)


def print_overhead(label: str, fopd: dict[int, dict[str, float]], base: dict[int, dict[str, float]]) -> None:
    """f-OPD's async step against opd_async's (the same per-token loss without f-OPD's terms), with both runs' stage times."""
    ratio = median(fopd, "time_step_s") / median(base, "time_step_s")
    refreshes = max(m.get("refreshes", 0.0) for m in fopd.values())
    print(f"f-OPD async step {median(fopd, 'time_step_s') * 1e3:.0f} ms vs opd_async (same sampled-token loss sg(s − T)·s, no freshness "
          f"weight, token sets, anchor or refresh) {median(base, 'time_step_s') * 1e3:.0f} ms: overhead {ratio:.2f}x ({label}; "
          f"f-OPD refreshed {refreshes:.0f} times)")  # fmt: skip
    print(f"  f-OPD      {stages(fopd)}")
    print(f"  opd_async  {stages(base)}")


def share_of_bound(sync: dict[int, dict[str, float]], asynchronous: dict[int, dict[str, float]]) -> tuple[float, float, float]:
    """(async speed-up over sync, ideal-overlap bound, share of the possible gain reached) from one pair of runs."""
    rollout = median(sync, "time_generate_s") + median(sync, "time_teacher_s")
    train = median(sync, "time_train_s")
    ideal = (rollout + train) / max(rollout, train)
    speedup = median(sync, "time_step_s") / median(asynchronous, "time_step_s")
    return speedup, ideal, (speedup - 1) / (ideal - 1) if ideal > 1 else 0.0


def repeat_pairs(args: argparse.Namespace) -> None:
    """Issue row: the async OPD step against the ideal overlap, ``--pairs`` times (sync first in odd pairs, async first in even ones)."""
    shares = []
    for k in range(args.pairs):
        before = load()
        modes = [("trainer.mode=sync",), ("trainer.mode=async", "trainer.max_lag=1")]
        first, second = modes if k % 2 == 0 else modes[::-1]  # alternate which side runs first
        runs = {first[0]: run_once(args.out, args.steps, *first), second[0]: run_once(args.out, args.steps, *second)}
        sync, asynchronous = runs["trainer.mode=sync"], runs["trainer.mode=async"]
        speedup, ideal, share = share_of_bound(sync, asynchronous)
        shares.append(share)
        order = first[0].removeprefix("trainer.mode=")
        print(f"pair {k + 1} ({order} first): sync step {median(sync, 'time_step_s') * 1e3:.0f} ms ({stages(sync)}), async step "
              f"{median(asynchronous, 'time_step_s') * 1e3:.0f} ms ({stages(asynchronous)}); speed-up {speedup:.2f}x of a "
              f"{ideal:.2f}x bound = {share * 100:.0f}% of the possible gain; {before} before, {load()} after", flush=True)  # fmt: skip
    print(f"share of the possible gain over {len(shares)} pairs: {', '.join(f'{x * 100:.0f}%' for x in shares)}; "
          f"median {statistics.median(shares) * 100:.0f}% (target >= 90%)")


if __name__ == "__main__":
    main()
