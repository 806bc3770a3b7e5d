"""Every registered method runs end-to-end through `harness run --preset smoke` (in-process CLI)."""

import sqlite3

import pytest
from typer.testing import CliRunner

from harness.cli import app
from harness.registry import METHODS

runner = CliRunner()
BUILTIN_METHODS = [name for name in METHODS.names() if not name.startswith("_")]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("every_method")  # shared: tiny models are built once and cached


@pytest.mark.slow
@pytest.mark.parametrize("method", BUILTIN_METHODS)
def test_method_runs_end_to_end_on_smoke(method, out_dir):
    result = runner.invoke(app, ["run", "--method", method, "--task", "arith", "--preset", "smoke", "--set", "eval.teacher=false", "--out", str(out_dir)])
    assert result.exit_code == 0, result.output
    with sqlite3.connect(out_dir / "results.sqlite") as conn:
        (run_id,) = conn.execute("SELECT run_id FROM runs WHERE method=? AND kind='train' ORDER BY created_at DESC", (method,)).fetchone()
        losses = [v for (v,) in conn.execute("SELECT value FROM step_metrics WHERE run_id=? AND name='loss' ORDER BY step", (run_id,))]
        evals = [s for (s,) in conn.execute("SELECT step FROM evals WHERE run_id=? ORDER BY step", (run_id,))]
    assert len(losses) == 4 and all(v == v for v in losses)  # four finite (non-NaN) losses
    assert evals == [0, 2, 4]
