"""Under --executor ray the learner writes its checkpoints and loads them on resume, and the driver holds no model:
on the two-node test cluster, with 2 learner ranks (DDP, and FSDP2 whose ranks each write their optimizer shard), a
run whose driver process may construct no torch module at all (a patched ``torch.nn.Module.__init__`` raises there;
the actors, other processes, load theirs) trains, checkpoints, evaluates every checkpoint from its folder, is
interrupted after its step-2 checkpoint and resumed onto 2 ranks with the per-step losses and evaluations of an
uninterrupted in-process run; the tensor bytes the driver receives from Ray over the whole run are a small fraction of
one copy of the weights. A learner or evaluation worker that does not see the run folder stops the run before training
(exit 2, one line naming the node and the path)."""

import sqlite3
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from opd_harness.cli import app
from ray_cluster import driver_output
from test_ray_executor import BASE, run
from test_ray_learner import two_ranks

runner = CliRunner()


def tensor_bytes(value, depth: int = 0) -> int:
    """Bytes of every tensor in ``value`` (nested containers, dataclasses and plain objects), the way Ray hands them over."""
    if depth > 6:
        return 0
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v, depth + 1) for v in value.values())
    if isinstance(value, list | tuple | set):
        return sum(tensor_bytes(v, depth + 1) for v in value)
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return sum(tensor_bytes(v, depth + 1) for v in vars(value).values())
    return 0


def driver_holds_no_model(monkeypatch) -> list[int]:
    """From now on in this process: constructing any torch module raises, and each ``ray.get`` records the tensor bytes
    it returned (the list returned here)."""
    import ray

    received: list[int] = []
    original = ray.get

    def counted(refs, *args, **kwargs):
        result = original(refs, *args, **kwargs)
        received.append(tensor_bytes(result))
        return result

    def refused(self, *args, **kwargs):
        raise AssertionError(f"the driver constructed a model ({type(self).__name__})")

    monkeypatch.setattr(ray, "get", counted)
    monkeypatch.setattr(torch.nn.Module, "__init__", refused)
    return received


def _losses_and_evals(db: Path, run_id: str) -> tuple[dict[int, float], dict[int, float]]:
    with sqlite3.connect(db) as conn:
        losses = dict(conn.execute("SELECT step, value FROM step_metrics WHERE run_id=? AND name='loss'", (run_id,)).fetchall())
        evals = dict(conn.execute("SELECT step, avg_at_k FROM evals WHERE run_id=?", (run_id,)).fetchall())
        status = conn.execute("SELECT status FROM runs WHERE run_id=?", (run_id,)).fetchone()[0]
    return losses, evals | {"status": status}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, dict]:
    """In process, uninterrupted: the run a resumed two-rank run continues exactly (run once for both shardings)."""
    metrics, _, evals = run(tmp_path_factory.mktemp("reference"), "--set", "eval.before_training=true")
    return metrics, evals


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_the_learner_writes_checkpoints_and_a_resumed_two_rank_run_continues_exactly(tmp_path, ray_cluster, monkeypatch, reference,
                                                                                     sharding):  # fmt: skip
    import opd_harness.trainers.pipeline as tp

    reference, reference_evals = reference
    received = driver_holds_no_model(monkeypatch)
    original = tp.Session.record_step

    def interrupt_at_step_3(self, step, *args, **kwargs):
        if step == 3:
            raise KeyboardInterrupt
        return original(self, step, *args, **kwargs)

    out = tmp_path / "ray"
    db = out / "results.sqlite"
    args = [*BASE, "--out", str(out), "--set", "eval.before_training=true", *two_ranks(ray_cluster.address),
            "--set", f"trainer.layout.learner.sharding={sharding}"]  # fmt: skip
    monkeypatch.setattr(tp.Session, "record_step", interrupt_at_step_3)
    interrupted = runner.invoke(app, args)
    monkeypatch.setattr(tp.Session, "record_step", original)
    assert interrupted.exit_code == 130, interrupted.output
    with sqlite3.connect(db) as conn:
        (run_id,) = conn.execute("SELECT run_id FROM runs WHERE kind='train'").fetchone()
    step_2 = out / "runs" / run_id / "checkpoints" / "step-000002"
    if sharding == "fsdp2":  # each of the 2 ranks wrote its own shard of the optimizer state
        assert len(list((step_2 / "optimizer").glob("*.distcp"))) == 2 and not (step_2 / "optimizer.pt").exists()
    else:
        assert (step_2 / "optimizer.pt").exists() and not (step_2 / "optimizer").exists()
    assert (step_2 / "model.safetensors").exists() and (step_2 / "trainer_state.pt").exists()
    resumed = runner.invoke(app, ["run", "--resume", run_id, "--out", str(out)])
    assert resumed.exit_code == 0, resumed.output
    assert f"learner: 2 data-parallel ranks ({sharding}, gloo" in " ".join(resumed.output.split())
    losses, evals = _losses_and_evals(db, run_id)
    assert losses == pytest.approx({s: reference[s]["loss"] for s in (1, 2, 3, 4)}, abs=1e-5)
    assert evals == {**reference_evals, "status": "done"}  # steps 0, 2, 4: read by the evaluation worker from each folder
    weights = (step_2 / "model.safetensors").stat().st_size
    assert sum(received) < weights / 10, (sum(received), weights)  # metrics and lengths only: no weights, no optimizer state


@pytest.mark.slow
def test_a_learner_that_cannot_see_the_run_folder_stops_the_run_before_training(tmp_path, ray_cluster, monkeypatch):
    import opd_harness.trainers.ray_executor as rx

    original = rx.mark_run_folder
    monkeypatch.setattr(rx, "mark_run_folder", lambda session: (original(session)[0], "not-the-token-written-there"))
    out = tmp_path / "out"
    result = runner.invoke(app, [*BASE, "--out", str(out), *two_ranks(ray_cluster.address)])
    assert result.exit_code == 2, result.output
    run_dir = next((out / "runs").iterdir())
    unwrapped = "".join(result.output.split())  # the console wraps the long path anywhere
    assert f"therunfolder{run_dir}isnotvisiblefromnode" in unwrapped and "(learnerrank0)" in unwrapped, result.output
    assert "Traceback" not in driver_output(result.output)
    with sqlite3.connect(out / "results.sqlite") as conn:
        assert conn.execute("SELECT COUNT(*) FROM step_metrics").fetchone()[0] == 0  # before training


def test_the_run_folder_check_names_the_node_and_the_path(tmp_path):
    from opd_harness.trainers.ray_executor import RUN_FOLDER_TOKEN, run_folder_problem

    (tmp_path / RUN_FOLDER_TOKEN).write_text("abc")
    assert run_folder_problem(str(tmp_path), "abc", "learner") is None
    problem = run_folder_problem(str(tmp_path / "elsewhere"), "abc", "eval")
    assert problem.startswith(f"the run folder {tmp_path / 'elsewhere'} is not visible from node ") and "(eval)" in problem
    assert "\n" not in problem and "same path" in problem


def test_the_session_of_a_ray_run_opens_no_model_and_no_vllm_teacher(tmp_path, monkeypatch):
    """The driver's session under --executor ray with a vLLM teacher (the shipped 16-GPU layout's): no module is built, no
    engine opened (before, the driver opened its own vLLM teacher on its GPU 0, which Ray also hands to an actor); it keeps
    the paths, the counters and a learning-rate schedule at trainer.lr."""
    from rich.console import Console

    from opd_harness.config import build_config
    from opd_harness.plan import plan_run
    from opd_harness.registry import BACKENDS
    from opd_harness.store import Store
    from opd_harness.trainers.pipeline import PreparedModels, Session

    cfg = build_config(preset="smoke", overrides=["trainer.executor=ray", "teacher.backend=vllm", "teacher.path=Qwen/Qwen3-8B"])
    plan = plan_run(cfg)

    def refused(*args, **kwargs):
        raise AssertionError("the driver built a model or opened an engine")

    monkeypatch.setattr(torch.nn.Module, "__init__", refused)
    monkeypatch.setattr(BACKENDS.get("vllm"), "load", classmethod(refused))
    store = Store(tmp_path)
    store.create_run("r1", kind="train", config=cfg.model_dump(mode="json"), method="opd", task="arith")
    prepared = PreparedModels(str(tmp_path / "student"), None)
    session = Session.open(plan, store, "r1", resume=False, console=Console(), prepare=lambda plan, root: prepared)
    assert session.student is None and session.teacher is None and not session.holds_models
    assert session.student_path == session.weights_path == prepared.student_path and "Qwen/Qwen3-8B" in session.teacher_path
    assert [group["lr"] for group in session.optimizer.param_groups] == [cfg.trainer.lr]
