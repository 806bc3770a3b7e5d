"""Every registered method runs end-to-end through `harness run --preset smoke` (in-process CLI)."""

import math
import sqlite3

import pytest
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.registry import METHODS
from opd_harness.store import Store

runner = CliRunner()
BUILTIN_METHODS = [name for name in METHODS.names() if not name.startswith("_")]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("every_method")  # shared: tiny models are built once and cached


@pytest.mark.slow
@pytest.mark.parametrize("method", BUILTIN_METHODS)
def test_method_runs_end_to_end_on_smoke(method, out_dir):
    result = runner.invoke(
        app, ["run", "--method", method, "--task", "arith", "--preset", "smoke", "--set", "eval.teacher=false", "--out", str(out_dir)]
    )
    assert result.exit_code == 0, result.output
    with Store(out_dir) as store:
        run_id = [r["run_id"] for r in store.runs() if r["method"] == method and r["kind"] == "train"][-1]
        steps = store.step_metrics(run_id)
        evals = [e["step"] for e in store.evals(run_id)]
    assert sorted(steps) == [1, 2, 3, 4]
    spec = METHODS.get(method)
    for step, metrics in steps.items():  # the values themselves, as the store reads them back (NaN stays NaN)
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]), (step, metrics)
        assert metrics["nonfinite"] == 0.0 and metrics["skipped"] == 0.0, (step, metrics)
        if "rewards" in spec.needs(spec.hparams()):  # graded every step; arith's grader never errors
            assert metrics["grade_errors"] == 0.0 and math.isfinite(metrics["reward_mean"]), (step, metrics)
    assert evals == [0, 2, 4]


@pytest.mark.slow
def test_schedule_state_is_saved_in_checkpoints_and_restored(out_dir):
    """SAF's warm-up/anneal state machine travels with the checkpoint, so a resume does not restart it."""
    import torch

    from opd_harness.trainers.objectives.saf import SAFParams, Schedule

    result = runner.invoke(app, ["run", "--method", "saf_opd", "--task", "arith", "--preset", "smoke", "--set", "eval.teacher=false",
                                 "--set", "method_args.saf_opd.warmup_steps=10", "--set", "method_args.saf_opd.kl_drop_delta=0",
                                 "--out", str(out_dir)])  # fmt: skip
    assert result.exit_code == 0, result.output
    with sqlite3.connect(out_dir / "results.sqlite") as conn:
        (run_id,) = conn.execute("SELECT run_id FROM runs WHERE method='saf_opd' ORDER BY created_at DESC").fetchone()
        (path,) = conn.execute("SELECT path FROM checkpoints WHERE run_id=? AND step=4", (run_id,)).fetchone()
        (scale,) = conn.execute("SELECT value FROM step_metrics WHERE run_id=? AND step=4 AND name='warmup_scale'", (run_id,)).fetchone()
    saved = torch.load(f"{path}/trainer_state.pt", weights_only=False)["extra"]["method_state"]
    restored = Schedule.from_params(SAFParams(warmup_steps=10, kl_drop_delta=0))
    restored.load_state_dict(saved)
    assert restored.state_dict() == saved
    assert scale == pytest.approx(0.4)  # step 4 of a 10-step warm-up: the schedule really advanced
    assert restored.advance()[0] == pytest.approx(0.5)  # and continues from step 5, not from 1
