"""Process executor (``--executor process``): the rollout role (generation, grading, teacher scoring) in a spawned
child process, the learner in this one.

Why: the in-process executor's two role threads share one interpreter lock, and a small model's generation and
training are mostly Python between tiny kernels, so overlapped they slow each other down (measured on 2 CPU cores:
rollout 1.4x, training 2x their sync times) and async keeps little of the overlap it promises. A child process has
its own interpreter. The learner's weights reach it through ``torch.multiprocessing`` (shared memory, no copy
through the pipe) before each batch that needs them; batches come back the same way. The child rebuilds the run's
plan from its config, loads its own student from the student's folder and shares the frozen teacher's tensors
(``trainers.roles``, as the Ray actors do), so it costs the memory of one more student. Results equal the in-process executor's for the same seed:
sampling for batch b depends only on (seed, b, weights) and the child computes with the run's thread count.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch.multiprocessing as mp
from rich.console import Console

from harness.backends.hf import HFBackend
from harness.registry import EXECUTORS
from harness.trajectory import TensorBatch
from trainers.inprocess import LocalLearner
from trainers.loop import Roles, WeightBoard, role_threads
from trainers.pipeline import Session, needs_teacher
from trainers.roles import RolloutActor, TeacherActor

CLOSE_TIMEOUT_S = 60.0  # how long the child gets to release its tasks' sandboxes and engines before it is killed


class RolloutFailed(RuntimeError):
    """The rollout process raised something that cannot travel back as itself; the message carries its traceback."""


def _serve(conn, config: dict, student: tuple, teacher: tuple, student_path: str, train_problems: list, threads: int, score: bool) -> None:
    """The child: build the rollout and teacher roles, then answer ``load`` / ``make`` / ``close`` until told to stop."""
    roles: list = []
    try:
        rollout = RolloutActor(config, *student, student_path, train_problems, threads)
        roles.append(rollout)
        scorer = TeacherActor(config, *teacher, student_path, threads) if score else None
        roles.append(scorer)
        conn.send(("ready", None))
        while True:
            op, arg = conn.recv()
            if op == "close":
                break
            if op == "load":
                rollout.load_weights(*arg)
                continue
            batch, metrics = rollout.generate(arg)
            if scorer is not None:
                batch, metrics = scorer.score(batch, metrics, arg)
            conn.send(("batch", (batch, metrics)))
    except (EOFError, KeyboardInterrupt):  # the parent is gone, or Ctrl-C reached the whole process group
        pass
    except BaseException as exc:  # noqa: BLE001 - surfaced to the learner, which stops the run
        _send_error(conn, exc)
    finally:
        for role in roles:
            if role is not None:
                role.close()
        conn.close()


def _send_error(conn, exc: BaseException) -> None:
    """Send ``exc`` itself when it pickles (TeacherFailed keeps its type), else a RolloutFailed with its traceback."""
    try:
        conn.send(("error", exc))
    except Exception:  # noqa: BLE001 - an exception that does not pickle
        conn.send(("error", RolloutFailed("".join(traceback.format_exception(exc)))))


class ProcessRollout:
    """Parent side of the rollout process, for ``RolloutWorker``: pushes weights, asks for batches."""

    def __init__(self, plan, session: Session, board: WeightBoard, threads: int) -> None:
        ctx = mp.get_context("spawn")  # a fork of a process that already runs torch threads is unsafe
        self.conn, child = ctx.Pipe()
        teacher = session.teacher
        # The frozen teacher is shared (its tensors move to shared memory, read by both processes); the student is loaded
        # from its folder, as the in-process rollout does: a shared copy would see the learner's in-place updates.
        shipped = (teacher.model, teacher.tokenizer) if isinstance(teacher, HFBackend) else (None, teacher.tokenizer)
        args = (child, plan.config.model_dump(mode="json"), (None, None), shipped,
                session.student_path, session.train_problems, threads, needs_teacher(plan))  # fmt: skip
        self.process = ctx.Process(target=_serve, args=args, name="rollout-process", daemon=True)
        self.process.start()
        child.close()
        self.board, self.version, self._ready = board, -1, False

    def ready(self) -> None:
        """Block until the child has built its roles (so start-up is not counted as training time)."""
        if not self._ready:
            self._answer("ready")
            self._ready = True

    def load(self, version: int) -> None:
        self.ready()
        self.conn.send(("load", (self.board.get(version), version)))
        self.version = version

    def make(self, index: int) -> tuple[TensorBatch, dict[str, float]]:
        self.ready()
        self.conn.send(("make", index))
        return self._answer("batch")

    def _answer(self, expected: str) -> Any:
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RolloutFailed(f"the rollout process died (exit code {self.process.exitcode})") from None
        if kind == "error":
            raise value
        if kind != expected:
            raise RolloutFailed(f"the rollout process answered {kind!r} where {expected!r} was due")
        return value

    def close(self) -> None:
        """Let the child release its sandboxes and engines, then make sure it is gone."""
        try:
            self.conn.send(("close", None))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(CLOSE_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class ProcessExecutor:
    """The rollout role in a spawned child process, the learner in this one (see the module docstring)."""

    def runtime(self, plan, console: Console):
        return nullcontext()

    @contextmanager
    def roles(self, plan, session: Session, board: WeightBoard, console: Console) -> Iterator[Roles]:
        rollout = ProcessRollout(plan, session, board, role_threads(plan))  # starts up while step 0 is evaluated
        try:
            yield Roles(rollout, LocalLearner(plan, session), ready=rollout.ready)
        finally:
            rollout.close()


EXECUTORS.add("process", ProcessExecutor())
