"""``trainer.device`` (where the in-process run's models go) and ``trainer.vocab_chunk`` (chunked full-vocabulary objectives)
through the real CLI: bad values exit 2 naming the key, ``cpu`` and ``auto`` run, and a chunked run trains like an unchunked one."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.config import ConfigError, build_config

runner = CliRunner()
TINY_RUN = ["run", "--method", "opd", "--task", "arith", "--preset", "smoke", "--set", "trainer.steps=2",
            "--set", "student.sft_steps=0", "--set", "teacher.sft_steps=0", "--set", "eval.before_training=false",
            "--set", "eval.teacher=false", "--set", "trainer.checkpoint_every=100"]  # fmt: skip


def run_losses(out, *overrides: str) -> list[float]:
    """Run the tiny 2-step opd (full estimator) run with ``overrides``; its per-step losses."""
    command = [sys.executable, "-m", "opd_harness.cli", *TINY_RUN, *(a for o in overrides for a in ("--set", o)), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with sqlite3.connect(out / "results.sqlite") as conn:
        return [v for (v,) in conn.execute("SELECT value FROM step_metrics WHERE name='loss' ORDER BY step")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: trainer.device=cuda is valid here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_exits_2_naming_the_key(tmp_path, device):
    result = runner.invoke(app, ["run", "--out", str(tmp_path), "--set", f"trainer.device={device}"])
    assert result.exit_code == 2, result.output
    assert f"trainer.device={device!r}" in " ".join(result.output.split()) and "no CUDA" in result.output
    assert not (tmp_path / "results.sqlite").exists()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.device=tpu"], "trainer.device='tpu': choose cpu, cuda, cuda:N or auto"),
        (["trainer.device=cuda:x"], "choose cpu, cuda, cuda:N or auto"),
        (["trainer.vocab_chunk=-1"], "trainer.vocab_chunk"),
    ],
)
def test_bad_device_or_chunk_values_are_config_errors(overrides, expected):
    with pytest.raises(ConfigError, match="trainer"):
        build_config(overrides=overrides)
    result = runner.invoke(app, ["run", *(a for o in overrides for a in ("--set", o))])
    assert result.exit_code == 2 and expected in " ".join(result.output.split()), result.output


def test_vocab_chunk_is_accepted_with_fsdp2_and_cuda_under_ray_needs_gpus_for_every_role(monkeypatch):
    pytest.importorskip("ray")  # fsdp2 + vocab_chunk is tested against one rank in test_distributed_learner.py
    config = build_config(overrides=["trainer.executor=ray", "trainer.vocab_chunk=64", "trainer.layout.learner.sharding=fsdp2"])
    assert config.trainer.vocab_chunk == 64 and config.trainer.layout.learner.sharding == "fsdp2"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert build_config(overrides=["trainer.device=cuda:0"]).trainer.device == "cuda:0"
    with pytest.raises(ConfigError, match=r"trainer\.layout\.rollout\.num_gpus is 0"):  # the actors take Ray's GPUs, not the driver's
        build_config(overrides=["trainer.executor=ray", "trainer.device=cuda"])
    with pytest.raises(ConfigError, match="this machine has 1 CUDA device"):
        build_config(overrides=["trainer.device=cuda:1"])


@pytest.mark.slow  # two tiny runs (one in a subprocess): 160 s at load 15–35 on 2 shared cores
def test_cpu_and_auto_run_and_a_chunked_run_trains_like_an_unchunked_one(tmp_path, monkeypatch):
    import opd_harness.trainers.learner

    chunk_sizes: list[int] = []
    chunked_outputs = opd_harness.trainers.learner.chunked_student_outputs

    def spy(model, batch, vocab_chunk, **kwargs):
        chunk_sizes.append(vocab_chunk)
        return chunked_outputs(model, batch, vocab_chunk, **kwargs)

    monkeypatch.setattr(opd_harness.trainers.learner, "chunked_student_outputs", spy)
    plain = run_losses(tmp_path / "plain", "trainer.device=cpu")
    overrides = ["trainer.device=auto", "trainer.vocab_chunk=5"]
    result = runner.invoke(app, [*TINY_RUN, *(a for o in overrides for a in ("--set", o)), "--out", str(tmp_path / "chunked")])
    assert result.exit_code == 0, result.output[-3000:]
    with sqlite3.connect(tmp_path / "chunked" / "results.sqlite") as conn:
        chunked = [v for (v,) in conn.execute("SELECT value FROM step_metrics WHERE name='loss' ORDER BY step")]
    assert chunk_sizes == [5, 5]  # the key reached each training step's forward (the in-process run)
    assert len(plain) == len(chunked) == 2 and plain[0] != 0.0
    assert chunked == pytest.approx(plain, abs=1e-5)  # step 2 after an update from chunked gradients
