"""A non-finite loss stops the run (or, as an option, skips the step), and is recorded as what it was."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from pydantic import Field
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.registry import METHODS
from opd_harness.store import Store
from opd_harness.trajectory import TensorBatch
from batches import make_batch
from opd_harness.trainers.guards import NonFiniteLoss, enforce_finite
from opd_harness.trainers.learner import train_step
from opd_harness.method import HParams, MethodSpec, StudentOutputs
from opd_harness.trainers.objectives import masked_mean

runner = CliRunner()
METHOD = "_nan_at_step"  # test-only: names starting with "_" are not run by test_every_method


class NaNParams(HParams):
    at_call: int = Field(2, ge=1, description="the objective call (= optimizer step) whose loss is NaN")


class Calls:
    """Counts objective calls; saved in checkpoints like any method state."""

    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = state["calls"]


def nan_objective(batch: TensorBatch, student: StudentOutputs, hp: NaNParams, state: Calls) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the sampled tokens; its ``at_call``-th value is 0/0 (NaN, NaN gradients)."""
    state.calls += 1
    loss = -masked_mean(student.logprobs, batch.loss_mask)
    if state.calls == hp.at_call:
        loss = loss * (torch.zeros(()) / torch.zeros(()))
    return loss, {}


METHODS.add(
    METHOD,
    MethodSpec(
        description="test only: NLL of the samples with a NaN loss at one step",
        objective=nan_objective,  # type: ignore[arg-type]
        hparams=NaNParams,
        needs=lambda hp: frozenset(),
        make_state=lambda hp: Calls(),
    ),
)


def test_enforce_finite_stops_or_warns_naming_step_and_method():
    assert enforce_finite({"loss": 1.0, "grad_norm": 2.0}, 3, "opd", "stop") is None
    with pytest.raises(NonFiniteLoss, match=r"step 7 of method 'grpo'.*loss = nan"):
        enforce_finite({"loss": float("nan"), "grad_norm": 1.0}, 7, "grpo", "stop")
    warning = enforce_finite({"loss": 1.0, "grad_norm": float("inf")}, 7, "grpo", "skip")
    assert "step 7" in warning and "'grpo'" in warning and "grad_norm = inf" in warning and "skipped" in warning


def test_train_step_never_applies_a_nonfinite_update(tiny_model_factory):
    model = tiny_model_factory(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    spec = METHODS.get(METHOD)
    batch = make_batch([[1, 1, 1]], [[0.0] * 3], [[0.0] * 3])
    batch.input_ids = torch.tensor([[5, 6, 7]])
    state = Calls()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = train_step(model, optimizer, batch, spec, NaNParams(at_call=2), state)
    after_first = {k: v.clone() for k, v in model.state_dict().items()}
    second = train_step(model, optimizer, batch, spec, NaNParams(at_call=2), state)
    assert math.isfinite(first["loss"]) and first["nonfinite"] == 0.0 and first["skipped"] == 0.0
    assert any(not torch.equal(before[k], after_first[k]) for k in before)  # a finite step trains
    assert math.isnan(second["loss"]) and math.isnan(second["grad_norm"])
    assert second["nonfinite"] == 1.0 and second["skipped"] == 1.0
    assert all(torch.equal(after_first[k], v) for k, v in model.state_dict().items())  # the NaN step changed nothing
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nonfinite")  # shared: tiny models are built once and cached


def smoke_run(out: Path, *extra: str):
    args = ["run", "--method", METHOD, "--task", "arith", "--preset", "smoke", "--set", "eval.teacher=false", *extra, "--out", str(out)]
    return runner.invoke(app, args)


def last_run(store: Store) -> dict:
    return [r for r in store.runs() if r["method"] == METHOD and r["kind"] == "train"][-1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_nonfinite_loss_stops_the_run_and_is_recorded_as_nan(out_dir, mode):
    result = smoke_run(out_dir, "--mode", mode, "--set", f"method_args.{METHOD}.at_call=2")
    assert result.exit_code == 1, result.output
    assert "step 2" in result.output and repr(METHOD) in result.output and "non-finite" in result.output
    with Store(out_dir) as store:
        run = last_run(store)
        steps = store.step_metrics(run["run_id"])
    assert run["status"] == "failed"
    assert sorted(steps) == [1, 2]  # stopped at the NaN step: nothing trained after it
    assert math.isfinite(steps[1]["loss"]) and steps[1]["nonfinite"] == 0.0
    assert math.isnan(steps[2]["loss"]) and math.isnan(steps[2]["grad_norm"])  # NaN read back as NaN, not None
    assert steps[2]["nonfinite"] == 1.0 and steps[2]["skipped"] == 1.0


@pytest.mark.slow
def test_nonfinite_loss_skip_option_skips_that_update_and_continues(out_dir):
    result = smoke_run(out_dir, "--set", f"method_args.{METHOD}.at_call=2", "--set", "trainer.on_nonfinite=skip",
                       "--set", "trainer.checkpoint_every=1", "--set", "trainer.steps=3")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "step 2" in result.output and "skipped" in result.output
    with Store(out_dir) as store:
        run = last_run(store)
        steps = store.step_metrics(run["run_id"])
        paths = {c["step"]: Path(c["path"]) for c in store.checkpoints(run["run_id"])}
    assert run["status"] == "done"
    assert [steps[s]["skipped"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert math.isnan(steps[2]["loss"]) and all(math.isfinite(steps[s]["loss"]) for s in (1, 3))
    weights = {s: weights_of(paths[s]) for s in (1, 2, 3)}
    assert all(torch.equal(weights[1][k], weights[2][k]) for k in weights[1])  # step 2's update was skipped
    assert any(not torch.equal(weights[2][k], weights[3][k]) for k in weights[2])  # training went on at step 3


def weights_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(checkpoint / "model.safetensors")
