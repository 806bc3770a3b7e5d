"""The in-process executor, the layout with one replica of each role: the rollout role is a worker thread with
its own inference backend (the run's ``trainer.rollout_backend``, weights pushed through ``load_weights``); the
session's teacher scores its batches; the learner trains the session's own student in the calling thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from rich.console import Console

from opd_harness.trajectory import TensorBatch, concat_batches
from opd_harness.config import ConfigError
from opd_harness.registry import WEIGHT_SYNCS
from opd_harness.trainers.loop import LearnResult, Roles, Unit, WeightBoard, unit_problems
from opd_harness.trainers.weight_sync import Published, checksum, engine_dtype, rollout_copy, state_bytes
from opd_harness.trainers.teacher import output_head, rescore_teacher
from opd_harness.trainers.pipeline import (
    CONCURRENT_ENGINES,
    Session,
    close_rollout_backend,
    learn,
    load_rollout_weights,
    make_batch,
    open_behaviour_scorer,
    open_rollout_backend,
    response_lengths,
    run_device,
    sample_problems,
    serialize_calls,
)


class LocalRollout:
    """In-process rollout: a private inference backend (loaded from the student's folder) fed weights from the board,
    with the trainer's model beside it when π_old is recomputed for a non-hf engine (:func:`open_behaviour_scorer`)."""

    def __init__(self, plan, session: Session, board: WeightBoard) -> None:
        self.plan, self.session, self.board = plan, session, board
        if plan.config.trainer.rollout_unit == "group" and plan.config.teacher.backend not in CONCURRENT_ENGINES:
            serialize_calls(session.teacher)  # streamed groups score from several threads: a vLLM teacher takes turns
        device = run_device(plan.config.trainer.device)
        self.backend = open_rollout_backend(plan, session.student_path, device=device)
        self.scorer = open_behaviour_scorer(plan, self.backend, session.student_path, device=device)

    @property
    def version(self) -> int:
        return self.backend.version

    def load(self, version: int) -> None:
        published: Published = self.board.get(version)
        load_rollout_weights(self.backend, self.scorer, published.payload, version, published.checksum)

    def make(self, unit: Unit) -> tuple[TensorBatch, dict[str, float]]:
        """Unit ``unit``'s samples (its share of batch ``unit.index``'s prompts), graded and teacher-scored."""
        metrics: dict[str, float] = {}
        problems = unit_problems(sample_problems(self.plan.config, self.session.train_problems, unit.index), unit)
        batch, _ = make_batch(self.plan, self.backend, self.session.teacher, problems, unit.index, metrics, self.scorer, check_errors=False)
        return batch, metrics

    def close(self) -> None:
        close_rollout_backend(self.backend)


class LocalLearner:
    """In-process learner: trains the session's own student, so checkpoints need no pull; publishes one CPU copy per
    loaded version in the rollout engine's dtype (``dtype``)."""

    def __init__(self, plan, session: Session, dtype: torch.dtype = torch.float32) -> None:
        self.plan, self.session, self.dtype = plan, session, dtype

    def train(self, parts: list[TensorBatch], version: int) -> LearnResult:
        batch = concat_batches(parts)
        metrics: dict[str, float] = {}
        teacher = self.session.teacher
        learn(self.plan, self.session.student.model, self.session.optimizer, batch, self.session.method_state, version, metrics,
              teacher_head=output_head(teacher) if teacher is not None else None,
              rescore=self.rescore if teacher is not None else None)  # fmt: skip
        return LearnResult(metrics, batch.policy_lag.tolist(), response_lengths(batch))

    def rescore(self, batch: TensorBatch) -> torch.Tensor:
        """T^fresh: the session's teacher scores the batch's sampled tokens now (on the learner's thread)."""
        return rescore_teacher(self.session.teacher, batch, retries=self.plan.config.teacher.step_retries)

    def publish(self, version: int) -> Published:
        """The ``object_store`` transport in process: a copy in the rollout dtype, passed by reference."""
        weights = rollout_copy(self.session.student.model.state_dict(), self.dtype)
        return Published(weights, checksum(weights), state_bytes(weights))

    def checkpoint(self, folder, small: dict) -> None:
        self.session.write_own_checkpoint(folder, small)


class InProcessExecutor:
    """Roles as threads of this process: nothing to start up, nothing to wait for."""

    def runtime(self, plan, console: Console):
        return nullcontext()

    def prepare(self) -> None:
        """None: the session builds the models in this process, where the roles run."""
        return None

    def check(self, plan, console: Console) -> None:
        """Refuse a collective weight transport (it needs separate processes); threads can run any other planned run."""
        name = plan.config.trainer.weight_sync
        if WEIGHT_SYNCS.get(name).collective:
            raise ConfigError(f"trainer.weight_sync={name} moves weights between processes: use --executor ray, or object_store")

    @contextmanager
    def roles(self, plan, session: Session, board: WeightBoard, console: Console) -> Iterator[Roles]:
        rollout = LocalRollout(plan, session, board)
        try:
            yield Roles([rollout], LocalLearner(plan, session, engine_dtype(rollout.backend)))
        finally:
            rollout.close()


IN_PROCESS_EXECUTOR = InProcessExecutor()
