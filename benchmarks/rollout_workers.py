"""Rollout workers: samples/s of a rollout-bound cpu-demo run on Ray with 1 vs 2 rollout actors, side by side.

The same config (cached cpu-demo models, async, ``max_lag`` 2 so the workers can run ahead, no evaluation, long
responses so generation dominates) runs under ``--executor ray`` on one local Ray with
``trainer.layout.rollout.replicas`` 1 and 2. Both sides are warmed up first (a short run each: actor start-up,
first forward passes), then measured ``--pairs`` times, alternating which side runs first. Throughput is trained
samples over step time, medians over steps > 3 (an empty pipeline fills first). From the 1-worker run's stage
times the ideal is computed: a step can be no faster than its slowest role, so with N workers
  ideal = max(t_rollout, t_train) / max(t_rollout / N, t_train),   t_rollout = t_generate + t_teacher.
On a 2-core machine the two rollout actors, the teacher and the learner share the cores, so expect well under that.
Usage: ``python benchmarks/rollout_workers.py [--steps 20] [--pairs 2] [--out /tmp/bench-rollout-workers] [--set KEY=VALUE ...]``
(``--set`` adds config overrides to every run, e.g. ``teacher.sft_steps=100`` for models built faster: the sizes, not
their quality, set the stage times).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark's cpu-demo run and step medians
from async_throughput import median, run_once as run_cpu_demo  # noqa: E402

WORKERS = (1, 2)
ROLLOUT_BOUND = ["trainer.samples_per_prompt=4", "trainer.prompts_per_step=16", "trainer.max_new_tokens=48", "trainer.temperature=1.5"]


def run_once(out: Path, steps: int, workers: int, extra: tuple[str, ...] = ()) -> dict[int, dict[str, float]]:
    """One async Ray run with ``workers`` rollout actors; its step metrics."""
    return run_cpu_demo(out, steps, "trainer.mode=async", "trainer.max_lag=2", "trainer.executor=ray",
                        f"trainer.layout.rollout.replicas={workers}", *ROLLOUT_BOUND, *extra)  # fmt: skip


def samples_per_s(metrics: dict[int, dict[str, float]], skip: int = 3) -> float:
    """Trained samples over step time, steps > ``skip``."""
    kept = [m for s, m in metrics.items() if s > skip]
    return sum(m["samples"] for m in kept) / sum(m["time_step_s"] for m in kept)


def ideal_ratio(metrics: dict[int, dict[str, float]], workers: int) -> float:
    """Speed-up of ``workers`` rollout workers over one if only the slowest role bounded a step (1-worker stage times)."""
    rollout = median(metrics, "time_generate_s") + median(metrics, "time_teacher_s")
    train = median(metrics, "time_train_s")
    return max(rollout, train) / max(rollout / workers, train)


def stages(metrics: dict[int, dict[str, float]]) -> str:
    """Median per-stage milliseconds of one run (the rollout stages as each worker sees them)."""
    return " / ".join(f"{key} {median(metrics, f'time_{key}_s') * 1e3:.0f}" for key in ("step", "generate", "teacher", "train")) + " ms"


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-rollout-workers"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="config override for every run")
    args = parser.parse_args()
    extra = tuple(args.overrides)
    from opd_harness.trainers.ray_executor import import_ray

    ray, temp_dir = import_ray(), tempfile.mkdtemp(prefix="opd-rw-", dir="/tmp")  # short: Ray's socket paths
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=512 * 2**20, _temp_dir=temp_dir)  # one Ray for every run
    try:
        print(f"{load()} at the start")
        for workers in WORKERS:  # warm-up: a short run each (not measured)
            run_once(args.out, 5, workers, extra)
        ratios = []
        for k in range(args.pairs):
            order = WORKERS if k % 2 == 0 else WORKERS[::-1]  # alternate which side runs first
            runs = {workers: run_once(args.out, args.steps, workers, extra) for workers in order}
            one, two = runs[1], runs[2]
            ratio = samples_per_s(two) / samples_per_s(one)
            ratios.append(ratio)
            print(f"pair {k + 1} ({order[0]} worker{'s' if order[0] > 1 else ''} first): 1 worker {samples_per_s(one):.1f} samples/s "
                  f"({stages(one)}, idle {median(one, 'idle_ratio_rollout'):.2f}); 2 workers {samples_per_s(two):.1f} samples/s "
                  f"({stages(two)}, idle {median(two, 'idle_ratio_rollout'):.2f}); ratio {ratio:.2f}x, ideal from the stage times "
                  f"{ideal_ratio(one, 2):.2f}x; {load()}", flush=True)  # fmt: skip
        print(f"2 vs 1 rollout workers over {len(ratios)} pairs: {', '.join(f'{r:.2f}x' for r in ratios)}; "
              f"median {statistics.median(ratios):.2f}x")
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
