"""A run's method.json records its reconstructed and non-default choices: for ``opd`` the token-mean vs sum
aggregation (docs/methods/opd.md specifies a sum) and the estimator that run used, not the defaults."""

import json

import pytest

from opd_harness.config import build_config
from opd_harness.plan import plan_run
from opd_harness.registry import METHODS
from opd_harness.store import Store
from opd_harness.runs import create_train_run


def method_record(tmp_path, *overrides: str) -> dict:
    """The method.json a run with ``overrides`` (on the smoke preset, method opd) writes."""
    plan = plan_run(build_config(preset="smoke", overrides=list(overrides), cli={"method": "opd"}))
    store = Store(tmp_path)
    run_id = create_train_run(store, plan.config, plan)
    return json.loads((store.run_dir(run_id) / "method.json").read_text())


@pytest.mark.parametrize(
    ("aggregation", "says"),
    [("token-mean", "token-mean over the batch's valid tokens (verl-style; the default), NOT docs/methods/opd.md's Tinker sum"),
     ("sum", "sum over the batch's valid tokens, as docs/methods/opd.md (Tinker) specifies")],
)  # fmt: skip
def test_opd_method_json_notes_the_runs_aggregation(tmp_path, aggregation, says):
    record = method_record(tmp_path, f"method_args.opd.aggregation={aggregation}")
    assert record["hparams"]["aggregation"] == aggregation
    assert record["notes"]["aggregation"].startswith(says)


def test_opd_method_json_notes_and_inputs_follow_the_runs_estimator(tmp_path):
    sampled = method_record(tmp_path / "a", "method_args.opd.estimator=sampled")
    full = method_record(tmp_path / "b", "method_args.opd.estimator=full")
    assert "importance-sampling" in sampled["notes"]["estimator"] and "teacher_dist" not in sampled["inputs"]
    assert "exact full-vocabulary" in full["notes"]["estimator"] and {"teacher_dist", "student_full"} <= set(full["inputs"])


def test_harness_methods_shows_the_default_choice():
    notes = METHODS.get("opd").describe()["notes"]
    assert notes["aggregation"].startswith("token-mean") and notes["estimator"].startswith("Tinker")
