"""The in-process executor: the rollout role is a worker thread with its own inference backend (the
run's ``trainer.rollout_backend``, weights pushed through ``load_weights``); the session's teacher
scores its batches; the learner trains the session's own student in the calling thread.

Both roles are threads of one process, so in async mode they share the GIL while they overlap. With
CPython's default 5 ms switch interval a role that releases the GIL for every torch op (the learner's
forward/backward) waits up to 5 ms to get it back from one that runs Python between its ops
(``generate``'s decoding loop); an async run therefore uses a 0.5 ms interval
(:data:`GIL_SWITCH_INTERVAL_S`, measured in ``benchmarks/async_throughput.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from rich.console import Console

from harness.registry import EXECUTORS
from harness.trajectory import TensorBatch
from trainers.loop import LearnResult, Roles, WeightBoard, state_snapshot
from trainers.pipeline import Session, close_rollout_backend, learn, make_batch, open_rollout_backend, response_lengths, sample_problems


class LocalRollout:
    """In-process rollout: a private inference backend (loaded from the student's folder) fed weights from the board."""

    def __init__(self, plan, session: Session, board: WeightBoard) -> None:
        self.plan, self.session, self.board = plan, session, board
        self.backend = open_rollout_backend(plan, session.student_path)

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

    def close(self) -> None:
        close_rollout_backend(self.backend)


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


GIL_SWITCH_INTERVAL_S = 0.0005  # async runs: 0.5 ms instead of CPython's 5 ms (see the module docstring)


@contextmanager
def gil_switch_interval(seconds: float) -> Iterator[None]:
    """Run the body with ``sys.setswitchinterval(seconds)``; the previous interval is restored after."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


class InProcessExecutor:
    """Roles as threads of this process: nothing to start up, nothing to wait for."""

    def runtime(self, plan, console: Console):
        """A short GIL switch interval while async roles overlap; sync roles never overlap, so nothing changes."""
        return gil_switch_interval(GIL_SWITCH_INTERVAL_S) if plan.config.trainer.mode == "async" else nullcontext()

    @contextmanager
    def roles(self, plan, session: Session, board: WeightBoard, console: Console) -> Iterator[Roles]:
        rollout = LocalRollout(plan, session, board)
        try:
            yield Roles(rollout, LocalLearner(plan, session))
        finally:
            rollout.close()


EXECUTORS.add("inprocess", InProcessExecutor())
