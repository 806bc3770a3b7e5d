"""Training on multi-turn tool-use episodes from the command line: SOD and OPD in sync mode, f-OPD in async mode,
on arith_tool with the local sandbox provider (the Docker provider runs the same episodes in tests/test_tool_tasks.py).

The batches the learner trains on are captured (the pipeline's ``to_tensor_batch`` and ``train_step`` wrapped here)
with the episodes they were packed from: the student's episodes are multi-turn, the environment's tokens between its
turns are never trained on, and SOD's steps are the episode's model turns."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.store import Store
from opd_harness.trajectory import Trajectory
from opd_harness.trainers.objectives.sod import step_ids

TINY = [
    "--preset", "tool-demo",
    "--set", "task_args.arith_tool.sandbox=local", "--set", "task_args.arith_tool.n_train=200", "--set", "task_args.arith_tool.n_test=6",
    "--set", "teacher.arch.hidden=64", "--set", "teacher.arch.layers=1", "--set", "teacher.arch.ffn=128", "--set", "teacher.sft_steps=150",
    "--set", "teacher.sft_batch_size=32", "--set", "teacher.sft_target=null",  # a fixed warm-up: not what this file tests
    "--set", "student.arch.hidden=32", "--set", "student.arch.layers=1",
    "--set", "student.arch.ffn=64", "--set", "student.sft_steps=300",
    "--set", "student.sft_batch_size=16",  # enough warm-up that some of its episodes call the tool
    "--set", "trainer.steps=2", "--set", "trainer.checkpoint_every=2", "--set", "trainer.prompts_per_step=3",
    "--set", "trainer.samples_per_prompt=2",
    "--set", "eval.limit=6", "--set", "eval.k=1", "--set", "eval.teacher=true", "--set", "eval.n_resamples=100",
]  # fmt: skip


@pytest.fixture
def trained_on(monkeypatch) -> list[tuple[torch.Tensor, list[Trajectory]]]:
    """(loss mask at training time, the episodes the batch was packed from) for every batch the learner trains on."""
    import opd_harness.trainers.pipeline as pipeline

    packed: dict[int, tuple[object, list[Trajectory]]] = {}
    trained: list[tuple[torch.Tensor, list[Trajectory]]] = []
    pack, train = pipeline.to_tensor_batch, pipeline.train_step

    def packing(trajectories, pad_id):
        batch = pack(trajectories, pad_id)
        packed[id(batch)] = (batch, list(trajectories))  # the batch is kept, so its id is not reused
        return batch

    def training(model, optimizer, batch, *args, **kwargs):
        trained.append((batch.loss_mask.clone(), packed[id(batch)][1]))  # KeyError: a batch not packed from episodes
        return train(model, optimizer, batch, *args, **kwargs)

    monkeypatch.setattr(pipeline, "to_tensor_batch", packing)
    monkeypatch.setattr(pipeline, "train_step", training)
    return trained


def positions(traj: Trajectory, kind: str) -> list[int]:
    """Batch positions of the trajectory's ``kind`` tokens (the prompt comes first)."""
    out, at = [], len(traj.prompt_ids)
    for segment in traj.segments:
        out += list(range(at, at + len(segment.token_ids))) if segment.kind == kind else []
        at += len(segment.token_ids)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method, mode", [("sod", "sync"), ("opd", "sync"), ("f_opd", "async")])
def test_training_on_tool_episodes(tmp_path_factory, trained_on, method, mode):
    out = tmp_path_factory.getbasetemp() / "tool-training"  # one results root: the warmed-up models are built once
    result = CliRunner().invoke(app, ["run", "--method", method, "--mode", mode, *TINY, "--out", str(out)])
    assert result.exit_code == 0, result.output
    store = Store(out)
    run = [r for r in store.runs() if r["method"] == method and r["kind"] == "train"][-1]
    assert store.get_run(run["run_id"])["status"] == "done"
    steps = store.step_metrics(run["run_id"])
    assert sorted(steps) == [1, 2] and len(trained_on) == 2
    for mask, episodes in trained_on:
        assert mask.shape[0] == len(episodes) == 6
        for row, traj in enumerate(episodes):
            assert (mask[row, positions(traj, "env")] == 0).all()  # observations are never trained on
            assert int(step_ids(mask[row : row + 1]).max()) == traj.num_steps  # SOD's steps are the model turns
    episodes = [traj for _, batch in trained_on for traj in batch]
    assert any(traj.num_steps > 1 and positions(traj, "env") for traj in episodes)  # multi-turn, with tool output in between
    assert sum(m["mean_turns"] for m in steps.values()) / len(steps) > 1
    if method == "sod":
        assert max(m["steps_per_seq"] for m in steps.values()) > 1  # SOD's own count of steps per sequence
    evals = {e["step"]: e for e in store.evals(run["run_id"])}
    assert set(evals) == {2} or set(evals) == {0, 2}
    assert {"invalid_tool_rate", "mean_tool_calls", "tool_error_rate", "mean_turns"} <= set(evals[2]["metrics"])
    teacher = store.evals(run["run_id"] + ".teacher")[0]
    assert teacher["metrics"]["mean_tool_calls"] > 0  # the teacher warmed up on tool traces really calls the tool
