"""Checks that stop a training run instead of letting it record something false: a non-finite loss or
gradient norm, and a step whose share of grading errors is too high. Both raise a :class:`opd_harness.errors.TrainingAborted`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from opd_harness.errors import TrainingAborted


class NonFiniteLoss(TrainingAborted):
    """The loss or the gradient norm of a step was NaN or infinite (``trainer.on_nonfinite=stop``)."""


class GradingErrors(TrainingAborted):
    """A step's share of grading errors exceeded ``trainer.max_grade_error_rate``."""


GUARDED = ("loss", "grad_norm")  # the learner values that must be finite for an update to be applied


def nonfinite_values(metrics: Mapping[str, float]) -> dict[str, float]:
    """The guarded values of a learner step (loss, grad norm) that are NaN or ±inf."""
    return {name: metrics[name] for name in GUARDED if name in metrics and not math.isfinite(metrics[name])}


def enforce_finite(metrics: Mapping[str, float], step: int, method: str, policy: str) -> str | None:
    """Raise :class:`NonFiniteLoss` under ``policy='stop'`` if the step was non-finite; under ``'skip'``
    return the warning to print (the learner already skipped the update); None for a finite step."""
    bad = nonfinite_values(metrics)
    if not bad:
        return None
    values = ", ".join(f"{name} = {value}" for name, value in bad.items())
    if policy == "stop":
        raise NonFiniteLoss(
            f"step {step} of method {method!r}: non-finite {values}; the run stops (recorded in step_metrics; "
            "trainer.on_nonfinite=skip skips such steps instead)"
        )
    return f"step {step} of method {method!r}: non-finite {values}; optimizer step skipped (trainer.on_nonfinite=skip)"


def grade_error_count(statuses: Sequence[str]) -> int:
    """How many grades are ``error`` (the grader failed: neither pass nor fail)."""
    return sum(status == "error" for status in statuses)


def enforce_grade_error_rate(errors: int, total: int, max_rate: float, step: int, task: str) -> None:
    """Raise :class:`GradingErrors` when ``errors / total`` exceeds ``max_rate`` (the rule of ``harness eval --max-error-rate``)."""
    rate = errors / max(total, 1)
    if rate > max_rate:
        raise GradingErrors(
            f"step {step}: {errors} of {total} training samples of task {task!r} could not be graded ({rate:.1%} > "
            f"trainer.max_grade_error_rate {max_rate:.1%}); the run stops rather than train on missing rewards"
        )
