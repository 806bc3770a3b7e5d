"""The roles of a run as plain objects that own their models, for executors that run them in other processes
(``trainers.ray_executor``: Ray actors; ``trainers.process_executor``: a spawned child): each rebuilds the run's
plan from its JSON config and computes with the run's torch thread count, so results match the in-process executor.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from harness.trajectory import TensorBatch
from tasks.base import close_tasks
from trainers.loop import LearnResult, state_snapshot
from trainers.pipeline import close_rollout_backend, generate_batch, learn, open_rollout_backend, response_lengths, sample_problems, teacher_phase
from trainers.teacher import open_remote_teacher, wrap_hf_teacher


def setup_role(threads: int) -> None:
    """An actor process computes with the run's torch thread count (so results match in process) and quiet libraries."""
    torch.set_num_threads(threads)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.logging.set_verbosity_error()


def role_plan(config: dict) -> Any:
    """Re-resolve the run's plan inside an actor from its JSON config (registries load in this process)."""
    from harness.config import RunConfig
    from harness.plan import plan_run

    return plan_run(RunConfig.model_validate(config))


class _Role:
    """What every actor answers: ``ready`` returns once the constructor (imports, plan, models) is done;
    ``close`` releases what the actor's own plan holds (task sandboxes, an inference engine) before it is killed."""

    def ready(self) -> bool:
        return True

    def close(self) -> None:
        plan = getattr(self, "plan", None)
        if plan is not None:
            close_tasks([plan.task, *plan.eval_tasks])
        close_rollout_backend(getattr(self, "backend", None))


class RolloutActor(_Role):
    """Rollout role: the run's rollout backend (the shipped student copy for ``hf``, else loaded from the
    student's folder, which the actor's node must see); generates (and grades) batch b with weights r."""

    def __init__(self, config: dict, model: torch.nn.Module, tokenizer: Any, student_path: str, train_problems: list, threads: int) -> None:
        setup_role(threads)
        self.plan = role_plan(config)
        self.backend = open_rollout_backend(self.plan, student_path, model=model, tokenizer=tokenizer)
        self.train_problems = train_problems

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.backend.load_weights(weights, version)

    def generate(self, index: int) -> tuple[TensorBatch, dict[str, float]]:
        """Batch ``index`` from the loaded weights; sampling is seeded by (seed, index) only."""
        metrics: dict[str, float] = {}
        problems = sample_problems(self.plan.config, self.train_problems, index)
        batch, _ = generate_batch(self.plan, self.backend, problems, index, metrics)
        return batch, metrics


class TeacherActor(_Role):
    """Teacher role: holds the teacher (the shipped model for ``hf``, else ``teacher.backend``'s engine or client, opened
    here) and fills its log-probs (or distributions) into batches."""

    def __init__(self, config: dict, model: torch.nn.Module | None, tokenizer: Any, student_path: str, threads: int) -> None:
        setup_role(threads)
        self.plan = role_plan(config)
        spec = self.plan.config.teacher
        if model is not None:
            self.backend = wrap_hf_teacher(model, tokenizer, self.plan.config.trainer.generate_batch_size, spec.backend_options)
        else:
            self.backend = open_remote_teacher(spec, student_path)

    def score(self, batch: TensorBatch, metrics: dict[str, float], index: int | None = None) -> tuple[TensorBatch, dict[str, float]]:
        teacher_phase(self.plan, self.backend, batch, metrics, step=index)
        return batch, metrics


class LearnerActor(_Role):
    """Learner role: student, optimizer and method state; one optimizer step per batch at the driver's learning rates."""

    def __init__(self, config: dict, parts: tuple, threads: int) -> None:
        setup_role(threads)
        self.plan = role_plan(config)
        self.model, self.optimizer, self.method_state = parts  # one pickle: the optimizer still holds this model's parameters

    def train(self, batch: TensorBatch, version: int, lrs: list[float]) -> LearnResult:
        """Train at learner version ``version`` with the learning rates of the driver's schedule (its ``Session`` steps it)."""
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        metrics: dict[str, float] = {}
        learn(self.plan, self.model, self.optimizer, batch, self.method_state, version, metrics)
        return LearnResult(metrics, batch.policy_lag.tolist(), response_lengths(batch))

    def weights(self) -> dict[str, torch.Tensor]:
        return state_snapshot(self.model)

    def state(self) -> dict[str, Any]:
        """Weights, optimizer and method state, for the driver's checkpoints and evaluations."""
        method_state = self.method_state.state_dict() if self.method_state is not None else None
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "method_state": method_state}
