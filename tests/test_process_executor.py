"""Process executor: the rollout role in a spawned child gives the in-process executor's losses, lags and evals, and
a failure inside the child stops the run as a failure of that run."""

import pytest

from test_ray_executor import assert_same_run, run


@pytest.mark.slow
def test_process_executor_matches_inprocess(tmp_path):
    lag = ["--method", "f_opd", "--mode", "async", "--set", "trainer.fixed_lag=1", "--set", "trainer.warmup_steps=3"]
    inprocess, inprocess_ckpts, inprocess_evals = run(tmp_path, *lag)
    child, child_ckpts, child_evals = run(tmp_path, *lag, "--executor", "process")
    assert_same_run(inprocess, child)
    assert [child[s]["behaviour_version"] for s in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert child_evals == inprocess_evals and sorted(child_evals) == [2, 4]
    assert child_ckpts[-1]["staleness_hist"] == inprocess_ckpts[-1]["staleness_hist"] == {"0": 8, "1": 24}
    assert {"generate", "teacher", "wait"} <= set(child_ckpts[-1]["rollout_seconds"])
    sync, _, _ = run(tmp_path, "--method", "opd")
    sync_child, _, _ = run(tmp_path, "--method", "opd", "--executor", "process")
    assert [sync_child[s]["loss"] for s in range(1, 5)] == pytest.approx([sync[s]["loss"] for s in range(1, 5)], abs=1e-5)


@pytest.mark.slow
def test_a_teacher_failure_in_the_rollout_process_fails_the_run(tmp_path):
    """The child's TeacherFailed travels back as itself: the run stops ``failed`` (exit 1) with the teacher's message."""
    from typer.testing import CliRunner

    from harness.backends.hf import HFBackend
    from harness.cli import app
    from harness.models.tiny import load_model_and_tokenizer
    from harness.serve import make_app
    from harness.store import Store
    from serving import Probe, running, saved_tiny_model
    from test_ray_executor import BASE

    model, tokenizer = load_model_and_tokenizer(saved_tiny_model(tmp_path, seed=0))
    probe = Probe(make_app(HFBackend(model, tokenizer), model_name="teacher", max_logprobs=-1))
    probe.fail_next = [500] * 100  # it lists its model (a GET), then fails every scoring request
    with running(probe) as base:
        args = [*BASE, "--out", str(tmp_path / "out"), "--mode", "async", "--executor", "process", "--set", "teacher.backend=openai",
                "--set", f"teacher.base_url={base}/v1", "--set", "teacher.step_retries=0", "--set", "teacher.backend_options.max_retries=0"]
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert "teacher scoring of step 1 failed after 1 attempt(s) (InternalServerError" in message and "the step was not trained" in message, message
    (run,) = [r for r in Store(tmp_path / "out").runs() if r["kind"] == "train"]
    assert run["status"] == "failed" and probe.posts > 0
