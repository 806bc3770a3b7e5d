"""Asynchronous pipeline: a rollout worker generates and teacher-scores batches with a snapshot of
the student while the learner trains; finished batches wait in a versioned replay buffer.

Versions: the learner's version v is its number of optimizer steps. Batch b (1-based) is trained
on at learner step b, when v = b − 1; if a policy of version r generated it, its lag is
τ = (b − 1) − r. ``max_lag`` is enforced when a batch is *submitted* (as AReaL does): the worker
starts batch b only with weights r ≥ b − 1 − max_lag, waiting for the learner if needed, so no
sample can ever exceed it. ``fixed_lag`` L generates batch b with exactly r = max(b − 1 − L, 0)
(the lag study); ``sync_every`` N refreshes worker weights every N learner versions. A refresh
(a method's ``refresh_signal``, e.g. f-OPD or hard refresh) drops every buffered batch with lag > 0
and has the worker regenerate them with the newest weights. With ``max_lag = 0`` the schedule is
exactly the synchronous one.

The schedule (:class:`Schedule`, :class:`RolloutWorker`, :func:`drive`) is written against two
small role interfaces, a rollout (``version``, ``load``, ``make``) and a learner (``train``,
``snapshot``, ``pull``); this module gives the in-process ones (a worker thread with its own copy
of the student, the learner in the calling thread) and ``trainers.ray_executor`` the Ray actors.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from rich.console import Console
from tqdm import tqdm

from harness.backends.hf import HFBackend
from harness.registry import PIPELINES
from harness.store import Store
from harness.trajectory import TensorBatch
from trainers.pipeline import Session, add_rates, learn, make_batch, response_lengths, sample_problems
from trainers.sync import provided_inputs


class PipelineStopped(Exception):
    """Raised in a waiting role when the run is shutting down."""


def required_version(batch_index: int, max_lag: int) -> int:
    """Oldest weights allowed to generate batch ``batch_index`` so that its lag stays ≤ max_lag."""
    return max(batch_index - 1 - max_lag, 0)


def fixed_version(batch_index: int, lag: int) -> int:
    """Weights that generate batch ``batch_index`` in the fixed-lag study."""
    return max(batch_index - 1 - lag, 0)


@dataclass(frozen=True)
class Schedule:
    """Which weights may generate each batch: the async knobs, or the synchronous run (max_lag 0)."""

    steps: int
    max_lag: int
    fixed_lag: int | None
    sync_every: int
    floor: int = 0  # oldest version that exists: the resumed checkpoint's step (earlier weights are gone)

    @classmethod
    def of(cls, plan) -> "Schedule":
        """The schedule of ``plan``: sync mode is async with max_lag 0 (a batch always sees the newest weights)."""
        t = plan.config.trainer
        if t.mode == "sync":
            return cls(t.steps, max_lag=0, fixed_lag=None, sync_every=1)
        return cls(t.steps, t.max_lag, t.fixed_lag, t.sync_every)

    @property
    def keep(self) -> int:
        """Weight versions the board must hold so that every allowed version is still there."""
        return max(self.max_lag, self.fixed_lag or 0, self.sync_every) + 2

    def target_version(self, index: int, current: int, latest: int, force_sync: bool) -> int:
        """The weights batch ``index`` must be generated with, given the loaded and the newest version."""
        if self.fixed_lag is not None:
            return max(fixed_version(index, self.fixed_lag), self.floor)  # after a resume the lag ramps back up to L
        required = max(required_version(index, self.max_lag), self.floor)
        if not force_sync and current >= required and latest - current < self.sync_every:
            return current  # current weights are still allowed and not due for a sync
        return max(latest, required)


def state_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the weights, immune to later optimizer steps."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class WeightBoard:
    """The learner publishes versioned weight snapshots; rollout workers wait for and fetch them.

    A snapshot is whatever the rollout role loads: a state dict in process, an object ref with Ray.
    """

    def __init__(self, keep: int) -> None:
        self._cond = threading.Condition()
        self._snapshots: dict[int, Any] = {}
        self._keep = max(keep, 1)
        self.latest = -1
        self.stopped = False

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """Publish a copy of ``model``'s current weights as ``version``."""
        self.publish_snapshot(version, state_snapshot(model))

    def publish_snapshot(self, version: int, snapshot: Any) -> None:
        """Publish ``snapshot`` as ``version`` and forget versions older than ``keep``."""
        with self._cond:
            self._snapshots[version] = snapshot
            self.latest = version
            for old in [v for v in self._snapshots if v <= version - self._keep]:
                del self._snapshots[old]
            self._cond.notify_all()

    def wait_for(self, version: int) -> int:
        """Block until ``version`` (or newer) is published; returns the latest version."""
        with self._cond:
            while self.latest < version and not self.stopped:
                self._cond.wait(timeout=0.5)
            if self.stopped:
                raise PipelineStopped
            return self.latest

    def get(self, version: int) -> Any:
        with self._cond:
            return self._snapshots[version]

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()


@dataclass
class BufferEntry:
    index: int  # batch index b: trained on at learner step b
    version: int  # behaviour policy version r
    epoch: int  # refresh epoch it was generated in
    batch: TensorBatch | Any  # a TensorBatch, or an object ref to one with Ray
    metrics: dict[str, float] = field(default_factory=dict)


class ReplayBuffer:
    """Teacher-scored batches keyed by batch index, each tagged with its behaviour version."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._entries: dict[int, BufferEntry] = {}
        self.epoch = 0
        self.restart_from: int | None = None
        self.force_sync = False
        self.error: BaseException | None = None
        self.stopped = False

    def put(self, entry: BufferEntry) -> bool:
        """Store a finished batch; refused (False) if a refresh happened while it was generated."""
        with self._cond:
            if entry.epoch != self.epoch:
                return False
            self._entries[entry.index] = entry
            self._cond.notify_all()
            return True

    def take(self, index: int) -> BufferEntry:
        """Block until batch ``index`` is ready (re-raising a worker failure)."""
        with self._cond:
            while index not in self._entries:
                if self.error is not None:
                    raise RuntimeError("the rollout worker failed") from self.error
                if self.stopped:
                    raise PipelineStopped
                self._cond.wait(timeout=0.5)
            return self._entries.pop(index)

    def drop_stale(self) -> list[int]:
        """Refresh: drop every buffered batch that would be trained with lag > 0 (they are regenerated
        with the newest weights); a batch generated in flight is discarded too (new epoch)."""
        with self._cond:
            stale = sorted(i for i, e in self._entries.items() if (i - 1) - e.version > 0)
            for i in stale:
                del self._entries[i]
            self.epoch += 1
            self.force_sync = True
            if stale:
                self.restart_from = stale[0]
            self._cond.notify_all()
            return stale

    def consume_restart(self) -> tuple[int | None, bool]:
        """(index to restart from or None, whether weights must be re-synced) — read once by the worker."""
        with self._cond:
            restart, force = self.restart_from, self.force_sync
            self.restart_from, self.force_sync = None, False
            return restart, force

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()


@dataclass
class RoleClock:
    """Seconds per stage for one role (generate/teacher/reward/wait for the worker, train/wait for the learner)."""

    seconds: Counter = field(default_factory=Counter)

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] += seconds

    def idle_ratio(self) -> float:
        total = sum(self.seconds.values())
        return self.seconds["wait"] / total if total > 0 else 0.0


class Rollout(Protocol):
    """The rollout role: generates and teacher-scores batches with weights fetched from the board."""

    version: int  # weights currently loaded (-1: none yet)

    def load(self, version: int) -> None: ...

    def make(self, index: int) -> tuple[Any, dict[str, float]]: ...


@dataclass
class LearnResult:
    """What the driver needs back from a learner step: metrics, per-sample lags and response lengths."""

    metrics: dict[str, float]
    lags: list[int]
    lengths: torch.Tensor


class Learner(Protocol):
    """The learner role: trains on batch b at version b − 1 and hands out its weights and state."""

    def train(self, batch: Any, version: int) -> LearnResult: ...

    def snapshot(self) -> Any: ...

    def pull(self) -> None: ...


class LocalRollout:
    """In-process rollout: a private copy of the student behind an HF backend; the session's teacher scores."""

    def __init__(self, plan, session: Session, board: WeightBoard) -> None:
        self.plan, self.session, self.board = plan, session, board
        model = copy.deepcopy(session.student.model)
        self.backend = HFBackend(model, session.student.tokenizer, batch_size=plan.config.trainer.generate_batch_size)
        self.backend.version = -1

    @property
    def version(self) -> int:
        return self.backend.version

    def load(self, version: int) -> None:
        self.backend.load_weights(self.board.get(version), version)

    def make(self, index: int) -> tuple[TensorBatch, dict[str, float]]:
        metrics: dict[str, float] = {}
        problems = sample_problems(self.plan.config, self.session.train_problems, index)
        batch, _ = make_batch(self.plan, self.backend, self.session.teacher, problems, index, metrics)
        return batch, metrics


class LocalLearner:
    """In-process learner: trains the session's own student, so checkpoints need no pull."""

    def __init__(self, plan, session: Session) -> None:
        self.plan, self.session = plan, session

    def train(self, batch: TensorBatch, version: int) -> LearnResult:
        metrics: dict[str, float] = {}
        learn(self.plan, self.session.student.model, self.session.optimizer, batch, self.session.method_state, version, metrics)
        return LearnResult(metrics, batch.policy_lag.tolist(), response_lengths(batch))

    def snapshot(self) -> dict[str, torch.Tensor]:
        return state_snapshot(self.session.student.model)

    def pull(self) -> None:
        pass


class RolloutWorker(threading.Thread):
    """Generates and teacher-scores batches b = start+1 .. steps with the weight versions the schedule allows."""

    def __init__(self, schedule: Schedule, rollout: Rollout, board: WeightBoard, buffer: ReplayBuffer, start: int, pause: threading.Event) -> None:
        super().__init__(name="rollout-worker", daemon=True)
        self.schedule, self.rollout, self.board, self.buffer = schedule, rollout, board, buffer
        self.next_index = start + 1
        self.pause = pause  # cleared while the learner evaluates
        self.clock = RoleClock()

    def target_version(self, index: int, force_sync: bool) -> int:
        """The weights batch ``index`` must be generated with (at least this version; waits are the caller's)."""
        return self.schedule.target_version(index, self.rollout.version, self.board.latest, force_sync)

    def run(self) -> None:
        try:
            self._loop()
        except PipelineStopped:
            pass
        except BaseException as exc:  # surfaced to the learner by the buffer
            self.buffer.fail(exc)

    def _loop(self) -> None:
        steps, fixed = self.schedule.steps, self.schedule.fixed_lag is not None
        force_sync = False
        while not self.buffer.stopped:
            self.pause.wait()  # evaluation pauses are not idle time
            restart, forced = self.buffer.consume_restart()
            self.next_index = restart if restart is not None else self.next_index
            force_sync = force_sync or forced
            if self.next_index > steps:
                time.sleep(0.01)
                continue
            index, epoch = self.next_index, self.buffer.epoch
            waited = time.perf_counter()
            wanted = self.target_version(index, force_sync)
            latest = self.board.wait_for(wanted)
            if not fixed and wanted != self.rollout.version:
                wanted = latest  # syncing anyway: take the newest weights
            self.clock.add("wait", time.perf_counter() - waited)
            if self.rollout.version != wanted:
                self.rollout.load(wanted)
            force_sync = False
            batch, metrics = self.rollout.make(index)
            for key in ("generate", "teacher", "reward"):
                self.clock.add(key, metrics.get(f"time_{key}_s", 0.0))
            if self.buffer.put(BufferEntry(index, wanted, epoch, batch, metrics)):
                self.next_index = index + 1


class AsyncPipeline:
    """Async pipeline: a rollout worker beside the learner, in process (threads) or as Ray actors."""

    name = "async"

    def provides(self, task) -> frozenset[str]:
        return provided_inputs(task)

    def warnings(self, method, hparams, task) -> list[str]:
        return []

    def run(self, plan, store: Store, run_id: str, *, resume: bool = False, console: Console | None = None) -> None:
        console = console or Console(stderr=True)
        if plan.config.trainer.executor == "ray":
            from trainers.ray_executor import run_ray

            run_ray(plan, store, run_id, resume=resume, console=console)
        else:
            run_async(plan, store, run_id, resume=resume, console=console)


PIPELINES.add("async", AsyncPipeline())


def run_async(plan, store: Store, run_id: str, *, resume: bool, console: Console) -> None:
    """Train with rollout and learning overlapped in this process; lag, staleness and idle time go to the store."""
    session = Session.open(plan, store, run_id, resume=resume, console=console, threads=plan.config.threads or 1)
    session.evaluate_start()
    schedule = Schedule.of(plan)
    board = WeightBoard(schedule.keep)
    drive(plan, session, schedule, LocalRollout(plan, session, board), LocalLearner(plan, session), board)
    store.set_status(run_id, "done")


def resumed_counters(session: Session) -> dict:
    """The cumulative async counters (staleness histogram, refreshes, stage seconds) stored with the checkpoint
    a run resumes from, so they continue instead of restarting at zero; empty for a fresh run."""
    if session.state.step == 0:
        return {}
    stored = [c for c in session.store.checkpoints(session.run_id) if c["step"] == session.state.step]
    return stored[-1]["metrics"] if stored else {}


def drive(plan, session: Session, schedule: Schedule, rollout: Rollout, learner: Learner, board: WeightBoard) -> None:
    """The learner loop of every executor: take batch b, train, publish version b, refresh, record, checkpoint."""
    buffer, pause = ReplayBuffer(), threading.Event()
    schedule = dataclasses.replace(schedule, floor=session.state.step)
    board.publish_snapshot(session.state.step, learner.snapshot())
    pause.set()
    worker = RolloutWorker(schedule, rollout, board, buffer, session.state.step, pause)
    clock = RoleClock()
    carried = resumed_counters(session)
    staleness: Counter = Counter({int(k): v for k, v in carried.get("staleness_hist", {}).items()})
    refreshes, dropped = int(carried.get("refreshes", 0)), int(carried.get("dropped_batches", 0))
    worker.clock.seconds.update(carried.get("rollout_seconds", {}))
    clock.seconds.update(carried.get("learner_seconds", {}))
    worker.start()
    trainer = plan.config.trainer
    label = trainer.mode + (f", {trainer.executor}" if trainer.executor != "inprocess" else "")
    bar = tqdm(range(session.state.step + 1, schedule.steps + 1), desc=f"train {plan.method.name} ({label})", initial=session.state.step, total=schedule.steps, dynamic_ncols=True)
    try:
        last_end = time.perf_counter()
        for step in bar:
            waited = time.perf_counter()
            entry = buffer.take(step)
            clock.add("wait", time.perf_counter() - waited)
            result = learner.train(entry.batch, step - 1)
            metrics = {**entry.metrics, **result.metrics}
            clock.add("train", metrics["time_train_s"])
            board.publish_snapshot(step, learner.snapshot())
            staleness.update(result.lags)
            if metrics.get("refresh_signal", 0.0) > 0 and schedule.fixed_lag is None:  # the lag study keeps its lag
                refreshes += 1
                dropped += len(buffer.drop_stale())
            now = time.perf_counter()
            add_rates(metrics, result.lengths, now - last_end)
            metrics.update(behaviour_version=float(entry.version), buffer_size=float(len(buffer)), refreshes=float(refreshes), dropped_batches=float(dropped),
                           idle_ratio_rollout=worker.clock.idle_ratio(), idle_ratio_learner=clock.idle_ratio())  # fmt: skip
            pause.clear()  # the worker finishes its current batch, then waits while we checkpoint/evaluate
            checkpoint_metrics = {
                "staleness_hist": {str(k): v for k, v in sorted(staleness.items())},
                "rollout_seconds": dict(worker.clock.seconds),
                "learner_seconds": dict(clock.seconds),
                "idle_ratio_rollout": worker.clock.idle_ratio(),
                "idle_ratio_learner": clock.idle_ratio(),
                "refreshes": refreshes,
                "dropped_batches": dropped,
            }
            session.record_step(step, metrics, metrics["time_step_s"], checkpoint_metrics, before_checkpoint=learner.pull)
            pause.set()
            last_end = time.perf_counter()
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", lag=f"{metrics['lag_mean']:.1f}")
    finally:
        buffer.stop()
        board.stop()
        pause.set()
        worker.join(timeout=30)
        bar.close()
