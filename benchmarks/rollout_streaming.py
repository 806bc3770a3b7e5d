"""Samples per second with heavy-tailed environment steps: rollout workers streaming prompt groups vs whole batches.

The loop's own scheduling (``opd_harness.trainers.loop``: ``WorkQueue``, ``RolloutWorker``, ``ReplayBuffer``, ``WeightBoard``) with
``--workers`` rollout workers and a stand-in learner (``--train-ms`` per step, publishing each version); ``max_lag`` 1.
Each unit is rolled out by ``opd_harness.rollout.run_episodes`` on the synthetic multi-turn task of
``benchmarks/episode_scheduling.py``: every environment step takes ``--step-ms``, except 5 % (``--slow-share``) that take
20× as long (``--slow-factor``), drawn per (batch, prompt, turn) from a fixed seed, so both sides meet the same
steps. Generation is a stand-in engine per worker (``--call-ms`` per call plus ``--row-ms`` per row): ``--engine batching``
lets concurrent calls overlap (a GPU engine that batches concurrent requests), ``serial`` runs them one at a time (an
engine that does not: the pessimistic case for many small units).

Sides: ``batch`` (``trainer.rollout_unit=batch``: a worker makes one whole batch at a time) and ``group`` (one prompt's
samples per unit, a batch's worth of units in flight per worker, each streamed into the buffer when done); with
``--sides batch group swap`` also ``swap``, group streaming whose worker loads new weights without waiting for its groups in
flight (they finish on their own version): the most a swap between groups could gain, since a real worker would need an
engine holding two versions at once. Each side is
warmed up (a short untimed run), then measured ``--rounds`` times in alternating order; printed are the mean samples/s
per side, their ratio and the per-round ratios.

Usage: ``PYTHONPATH=. python benchmarks/rollout_streaming.py [--steps 12] [--max-lag 1 3 8] [--rounds 4] [--engine serial]
[--sides batch group swap]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

from opd_harness.backends import SamplingParams
from opd_harness.rollout import run_episodes
from opd_harness.task import Problem
from opd_harness.trainers.loop import ReplayBuffer, RolloutWorker, Schedule, Unit, WeightBoard, WorkQueue, unit_problems

sys.path.insert(0, str(Path(__file__).parent))
from episode_scheduling import StandInEngine, TailOptions, TailTask  # noqa: E402

SIDES = {"batch": False, "group": True, "swap": True}  # side -> units are prompt groups


class SwappingWorker(RolloutWorker):
    """Group streaming whose weights switch under groups in flight (they finish on the version they were admitted with):
    an upper bound for a swap between groups, since only a rollout holding two versions at once could do it."""

    def _drain(self, running) -> None:
        pass


class SerialEngine(StandInEngine):
    """The stand-in engine with one call at a time (concurrent calls queue)."""

    def __init__(self, call_s: float, row_s: float) -> None:
        super().__init__(call_s, row_s)
        self.lock = threading.Lock()

    def generate(self, prompts, params):
        with self.lock:
            return super().generate(prompts, params)


class StandInRollout:
    """A rollout replica for the loop: units rolled out by ``run_episodes`` on the heavy-tailed task, no teacher."""

    def __init__(self, engine: StandInEngine, task: TailTask, prompts: int, samples: int, env_workers: int) -> None:
        self.engine, self.task, self.prompts, self.env_workers = engine, task, prompts, env_workers
        self.params = SamplingParams(temperature=1.0, max_new_tokens=4, n=samples, seed=0)
        self.version = -1

    def load(self, version: int) -> None:
        self.version = version

    def make(self, unit: Unit):
        problems = [Problem(id=f"b{unit.index}-p{j}", question=f"Q{j}:", answer="") for j in range(self.prompts)]
        trajectories = run_episodes(self.engine, self.task, unit_problems(problems, unit), self.params, env_workers=self.env_workers)
        return None, {"rows": float(len(trajectories))}


def samples_per_s(args, side: str, steps: int, seed: int) -> float:
    """One run of the loop's scheduling (``steps`` batches, ``--workers`` workers): trained samples per second."""
    options = TailOptions(turns=args.turns, step_s=args.step_ms / 1e3, slow_share=args.slow_share, slow_factor=args.slow_factor,
                          seed=seed)  # fmt: skip
    task, groups = TailTask(options), args.prompts if SIDES[side] else 1
    worker_cls = SwappingWorker if side == "swap" else RolloutWorker
    engine_cls = SerialEngine if args.engine == "serial" else StandInEngine
    schedule = Schedule(steps, max_lag=args.max_lag, fixed_lag=None, sync_every=1)
    board, buffer, queue, pause = WeightBoard(schedule.keep), ReplayBuffer(groups), WorkQueue(0, steps, groups), threading.Event()
    pause.set()
    board.publish_snapshot(0, None)
    workers = [
        worker_cls(schedule, StandInRollout(engine_cls(args.call_ms / 1e3, args.row_ms / 1e3), task, args.prompts, args.samples,
                                               args.prompts * args.samples), board, buffer, queue, pause, n, inflight=groups)
        for n in range(args.workers)
    ]  # fmt: skip
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    samples = 0
    try:
        for step in range(1, steps + 1):
            samples += int(buffer.take(step).metrics["rows"])
            time.sleep(args.train_ms / 1e3)
            board.publish_snapshot(step, None)
    finally:
        buffer.stop()
        board.stop()
        for worker in workers:
            worker.join(timeout=30)
    return samples / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch (prompt groups)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (a group's episodes)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2, help="rollout workers")
    parser.add_argument("--step-ms", type=float, default=50.0, help="an ordinary environment step")
    parser.add_argument("--slow-share", type=float, default=0.05, help="share of steps that are slow")
    parser.add_argument("--slow-factor", type=float, default=20.0, help="how much slower a slow step is")
    parser.add_argument("--max-lag", type=int, nargs="+", default=[1, 3, 8], help="staleness bounds to measure, one comparison each")
    parser.add_argument("--train-ms", type=float, default=50.0, help="stand-in learner: time per optimizer step")
    parser.add_argument("--engine", choices=["batching", "serial"], default="batching")
    parser.add_argument("--call-ms", type=float, default=20.0, help="stand-in engine: cost of one generate call")
    parser.add_argument("--row-ms", type=float, default=0.2, help="stand-in engine: cost per row of a call")
    parser.add_argument("--rounds", type=int, default=4, help="measurements per side after the warm-up, in alternating order")
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=["batch", "group"],
                        help="what to compare (swap: group streaming with weights swapped under groups in flight, an upper bound)")
    args = parser.parse_args()
    for max_lag in args.max_lag:
        compare(argparse.Namespace(**{**vars(args), "max_lag": max_lag}))


def compare(args: argparse.Namespace) -> None:
    """Both sides under ``args.max_lag``: warm-up, then ``--rounds`` alternating measurements; prints the ratio."""
    names = args.sides
    for side in names:  # warm-up, untimed
        samples_per_s(args, side, 2, seed=-1)
    rates: dict[str, list[float]] = {side: [] for side in names}
    for r in range(args.rounds):
        for side in names if r % 2 == 0 else names[::-1]:
            rates[side].append(samples_per_s(args, side, args.steps, seed=r))
    print(f"{args.steps} steps x {args.prompts} prompts x {args.samples} samples, {args.turns} turns, steps {args.step_ms:g} ms "
          f"({args.slow_share:.0%} x{args.slow_factor:g}), {args.workers} rollout workers, max_lag {args.max_lag}, "
          f"train {args.train_ms:g} ms, engine {args.engine} ({args.call_ms:g} ms/call + {args.row_ms:g} ms/row)")  # fmt: skip
    for side in names:
        print(f"  {side:<6} {statistics.mean(rates[side]):7.2f} samples/s   (rounds: {', '.join(f'{x:.1f}' for x in rates[side])})")
    for side in [s for s in names if s != "batch"] if "batch" in names else []:
        per_round = ", ".join(f"{g / b:.2f}x" for b, g in zip(rates["batch"], rates[side]))
        print(f"  ratio {side} / batch {statistics.mean(rates[side]) / statistics.mean(rates['batch']):.2f}x   "
              f"(per round, alternating order: {per_round})", flush=True)

if __name__ == "__main__":
    main()
