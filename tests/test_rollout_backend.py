"""The rollout role is any registered backend with ``load`` and ``load_weights`` (e.g. vLLM on a GPU while HF
learns); on CPU a second HF-based engine stands in and must give exactly the default run."""

import sqlite3

import pytest
from typer.testing import CliRunner

from opd_harness.backends.hf import HFBackend
from opd_harness.cli import app
from opd_harness.config import ConfigError, build_config
from opd_harness.registry import BACKENDS

runner = CliRunner()
BASE = ["run", "--task", "arith", "--preset", "smoke", "--set", "threads=1", "--set", "eval.teacher=false",
        "--set", "eval.before_training=false", "--method", "opd", "--mode", "async", "--set", "trainer.fixed_lag=1",
        "--set", "trainer.steps=4", "--set", "trainer.checkpoint_every=4"]  # fmt: skip


class RecordingEngine(HFBackend):
    """An HF engine that only exists through the protocol: built by ``load``, fed by ``load_weights``."""

    loads: list[str] = []
    pushed: list[int] = []

    @classmethod
    def load(cls, model: str, **options) -> "RecordingEngine":
        cls.loads.append(model)
        return super().load(model, **options)

    def load_weights(self, state_dict, version: int) -> None:
        type(self).pushed.append(version)
        super().load_weights(state_dict, version)


@pytest.fixture(scope="module")
def engine_name():
    BACKENDS.add("recording_engine", RecordingEngine)
    return "recording_engine"


def losses(out) -> list[float]:
    with sqlite3.connect(out / "results.sqlite") as conn:
        return [v for (v,) in conn.execute("SELECT value FROM step_metrics WHERE name='loss' ORDER BY run_id, step")]


def test_rollout_backend_must_be_a_rollout_engine(engine_name):
    assert build_config(overrides=[f"trainer.rollout_backend={engine_name}"]).trainer.rollout_backend == engine_name
    with pytest.raises(ConfigError, match="cannot be a rollout engine"):
        build_config(overrides=["trainer.rollout_backend=replay"])
    with pytest.raises(ConfigError, match="unknown backends 'vlm'"):
        build_config(overrides=["trainer.rollout_backend=vlm"])


@pytest.mark.slow
def test_a_registered_engine_is_the_rollout_role_and_matches_the_default(tmp_path, engine_name):
    default = runner.invoke(app, [*BASE, "--out", str(tmp_path / "default")])
    assert default.exit_code == 0, default.output
    RecordingEngine.loads.clear(), RecordingEngine.pushed.clear()
    plugged = runner.invoke(app, [*BASE, "--out", str(tmp_path / "plugged"), "--set", f"trainer.rollout_backend={engine_name}"])
    assert plugged.exit_code == 0, plugged.output
    assert len(RecordingEngine.loads) == 1 and "student" in RecordingEngine.loads[0]  # built from the student's folder
    assert RecordingEngine.pushed == [0, 1, 2]  # fixed lag 1: batches 1..4 from versions 0, 0, 1, 2
    assert losses(tmp_path / "plugged") == pytest.approx(losses(tmp_path / "default"), abs=1e-6)


def test_training_refuses_a_rollout_engine_told_to_return_no_logprobs(tmp_path):
    """Training reads the behaviour log-probs of the sampled tokens: an engine told not to return them is a config error
    naming the option (exit 2) before anything is built; an evaluation runs without them (tests/test_openai_backend.py)."""
    from opd_harness.plan import plan_run

    with pytest.raises(ConfigError, match=r"trainer\.rollout_backend_options\.logprobs=False: method 'opd' trains on .*behaviour_logprobs"):
        plan_run(build_config(preset="smoke", overrides=["trainer.rollout_backend_options.logprobs=false"]))
    assert plan_run(build_config(preset="smoke", overrides=["trainer.rollout_backend_options.logprobs=true"])).method.name == "opd"
    result = runner.invoke(
        app, ["run", "--preset", "smoke", "--set", "trainer.rollout_backend_options.logprobs=no", "--out", str(tmp_path)]
    )
    assert result.exit_code == 2 and "trainer.rollout_backend_options.logprobs=False: method 'opd'" in result.output
    assert not (tmp_path / "results.sqlite").exists()
