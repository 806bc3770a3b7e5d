"""Training on multi-turn tool-use episodes from the command line: SOD and OPD in sync mode, f-OPD in async mode,
on arith_tool with the local sandbox provider (the Docker provider runs the same episodes in tests/test_tool_tasks.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from harness.cli import app
from harness.store import Store

TINY = [
    "--preset", "tool-demo",
    "--set", "task_args.arith_tool.sandbox=local", "--set", "task_args.arith_tool.n_train=200", "--set", "task_args.arith_tool.n_test=6",
    "--set", "teacher.arch.hidden=64", "--set", "teacher.arch.layers=1", "--set", "teacher.arch.ffn=128", "--set", "teacher.sft_steps=150",
    "--set", "teacher.sft_batch_size=32", "--set", "student.arch.hidden=32", "--set", "student.arch.layers=1", "--set", "student.arch.ffn=64",
    "--set", "student.sft_steps=20", "--set", "student.sft_batch_size=16",
    "--set", "trainer.steps=2", "--set", "trainer.checkpoint_every=2", "--set", "trainer.prompts_per_step=3", "--set", "trainer.samples_per_prompt=2",
    "--set", "eval.limit=6", "--set", "eval.k=1", "--set", "eval.teacher=true", "--set", "eval.n_resamples=100",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("method, mode", [("sod", "sync"), ("opd", "sync"), ("f_opd", "async")])
def test_training_on_tool_episodes(tmp_path_factory, method, mode):
    out = tmp_path_factory.getbasetemp() / "tool-training"  # one results root: the warmed-up models are built once
    result = CliRunner().invoke(app, ["run", "--method", method, "--mode", mode, *TINY, "--out", str(out)])
    assert result.exit_code == 0, result.output
    store = Store(out)
    run = [r for r in store.runs() if r["method"] == method and r["kind"] == "train"][-1]
    assert store.get_run(run["run_id"])["status"] == "done"
    steps = store.step_metrics(run["run_id"])
    assert sorted(steps) == [1, 2]
    for metrics in steps.values():
        assert metrics["mean_turns"] >= 1 and 0 <= metrics["invalid_tool_rate"] <= 1 and metrics["mean_tool_calls"] >= 0
    evals = {e["step"]: e for e in store.evals(run["run_id"])}
    assert set(evals) == {2} or set(evals) == {0, 2}
    assert {"invalid_tool_rate", "mean_tool_calls", "tool_error_rate", "mean_turns"} <= set(evals[2]["metrics"])
    teacher = store.evals(run["run_id"] + ".teacher")[0]
    assert teacher["metrics"]["mean_tool_calls"] > 0  # the teacher warmed up on tool traces really calls the tool
