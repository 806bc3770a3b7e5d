"""Grading errors during training are no reward (NaN, never 0), counted per step, and stop the run above a share."""

from __future__ import annotations

import math

import pytest
import torch

from opd_harness.backends.hf import HFBackend
from opd_harness.config import build_config
from opd_harness.plan import plan_run
from opd_harness.task import Score
from opd_harness.tasks.synthetic.arith import ArithTask
from opd_harness.trainers.guards import GradingErrors
from opd_harness.trainers.pipeline import generate_batch, sample_problems

ERRORED = {1, 6}  # trajectory indices whose grading fails (of 4 prompts × 2 samples)


class FlakyArith(ArithTask):
    """Arith whose grader fails on chosen trajectories and otherwise alternates fail / pass (no grading pool)."""

    def grade_many(self, problems, completions):
        grades = [Score("pass" if i % 2 else "fail") for i in range(len(completions))]
        return [Score("error", details="grader crashed") if i in ERRORED else grade for i, grade in enumerate(grades)]


def flaky_plan(*overrides: str):
    plan = plan_run(build_config(preset="smoke", overrides=["method=grpo", *overrides]))
    plan.task = FlakyArith(plan.task.options)
    return plan


@pytest.fixture(scope="module")
def student(tiny_model_factory, char_tokenizer):
    return HFBackend(tiny_model_factory(seed=0), char_tokenizer, batch_size=16)


def test_errored_grades_are_nan_rewards_counted_per_step(student):
    plan = flaky_plan("trainer.max_grade_error_rate=0.5")
    problems = sample_problems(plan.config, plan.task.load("train"), 3)
    metrics: dict[str, float] = {}
    batch, trajectories = generate_batch(plan, student, problems, 3, metrics)
    assert len(trajectories) == 8
    assert [i for i, r in enumerate(batch.rewards.tolist()) if math.isnan(r)] == sorted(ERRORED)  # not 0.0
    assert batch.rewards[[0, 2, 4]].tolist() == [0.0, 0.0, 0.0] and batch.rewards[[3, 5, 7]].tolist() == [1.0, 1.0, 1.0]
    assert metrics["grade_errors"] == 2.0
    assert metrics["reward_mean"] == pytest.approx(3 / 6)  # over the six graded samples, errors not counted as 0


def test_too_many_grading_errors_stop_the_run_naming_the_step_and_the_key(student):
    plan = flaky_plan()  # default trainer.max_grade_error_rate = 0.02; 2 of 8 errored
    assert plan.config.trainer.max_grade_error_rate == 0.02
    problems = sample_problems(plan.config, plan.task.load("train"), 5)
    with pytest.raises(GradingErrors, match=r"step 5: 2 of 8 .*25\.0% > trainer\.max_grade_error_rate 2\.0%"):
        generate_batch(plan, student, problems, 5, {})


def test_share_at_the_threshold_is_allowed(student):
    plan = flaky_plan("trainer.max_grade_error_rate=0.25")  # 2 / 8 = 0.25 is not above it (the eval rule: > rate fails)
    problems = sample_problems(plan.config, plan.task.load("train"), 1)
    metrics: dict[str, float] = {}
    batch, _ = generate_batch(plan, student, problems, 1, metrics)
    assert metrics["grade_errors"] == 2.0 and int(torch.isnan(batch.rewards).sum()) == 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_past_the_error_share_ends_failed_with_one_line(tmp_path, mode):
    """Raised in the rollout role (a worker thread in both modes), the error reaches the CLI as itself: exit 1, no traceback."""
    import sqlite3

    from typer.testing import CliRunner

    from opd_harness.cli import app
    from opd_harness.registry import TASKS

    class FlakyRunTask(FlakyArith):
        pass

    if "_flaky_arith" not in TASKS:
        TASKS.add("_flaky_arith", FlakyRunTask)
    args = ["run", "--method", "grpo", "--task", "_flaky_arith", "--mode", mode, "--preset", "smoke", "--set", "eval.teacher=false",
            "--set", "eval.before_training=false", "--set", "threads=1", "--out", str(tmp_path)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert "step 1: 2 of" in message and "trainer.max_grade_error_rate" in message and "Traceback" not in message
    with sqlite3.connect(tmp_path / "results.sqlite") as conn:
        assert conn.execute("SELECT status FROM runs WHERE kind='train'").fetchall() == [("failed",)]
