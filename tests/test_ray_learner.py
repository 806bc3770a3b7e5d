"""A data-parallel learner on the two-node test cluster: 2 learner ranks on different nodes (DDP or FSDP2) give the losses,
gradient norms and evaluations of one in-process learner; a rank killed with SIGKILL, or one that never enters a step's
collectives (they time out after trainer.collective_timeout_s), stops the run failed with one clear line, and its last
checkpoint (full weights, from rank 0) resumes onto 1 rank with the losses of the uninterrupted run.
(The exactness of the step for every kind of method is tested without Ray in test_distributed_learner.py.)"""

import json
import os
import signal
import sqlite3

import pytest
from typer.testing import CliRunner

from opd_harness.cli import app
from ray_cluster import driver_output
from test_ray_executor import BASE, run

runner = CliRunner()


def two_ranks(address: str) -> list[str]:
    """Rollout on node_a, teacher on node_b (1 CPU each), 2 learner ranks of 1 CPU: one fits on each node, no more."""
    return [
        "--executor", "ray", "--set", f"trainer.ray_address={address}",
        "--set", "trainer.layout.rollout.resources={node_a: 1}", "--set", "trainer.layout.teacher.resources={node_b: 1}",
        "--set", "trainer.layout.learner.replicas=2", "--set", "trainer.layout.learner.strategy=strict_spread",
    ]  # fmt: skip


def test_resume_takes_only_layout_overrides(tmp_path):
    from opd_harness.config import ConfigError
    from opd_harness.runs import plan_resume
    from opd_harness.store import Store

    store = Store(tmp_path)
    store.create_run("r1", kind="train", config={"trainer": {"executor": "ray"}}, method="opd", task="arith")
    assert plan_resume(store, "r1", ["trainer.layout.learner.replicas=3"]).config.trainer.layout.learner.replicas == 3
    with pytest.raises(ConfigError, match=r"only trainer\.layout\.\* may be --set .*trainer\.lr"):
        plan_resume(store, "r1", ["trainer.lr=1"])
    with pytest.raises(ConfigError, match=r"trainer\.layout\.learner\.replicas"):
        plan_resume(store, "r1", ["trainer.layout.learner.replicas=0"])


class _FakeRay:
    """Just enough of Ray for ``RayLearner._get``: refs are rank indices, ``outcomes`` what each rank's call gives."""

    class exceptions:  # noqa: N801 - mirrors ray.exceptions
        class RayActorError(Exception):
            pass

        class ObjectLostError(Exception):
            pass

        class NodeDiedError(Exception):
            pass

    def __init__(self, outcomes: list) -> None:
        self.outcomes, self.killed = outcomes, []

    def wait(self, pending, num_returns=1, timeout=None):
        return pending[:num_returns], pending[num_returns:]

    def get(self, refs):
        if isinstance(refs, list):
            return [self.get(ref) for ref in refs]
        if isinstance(self.outcomes[refs], Exception):
            raise self.outcomes[refs]
        return self.outcomes[refs]

    def kill(self, actor) -> None:
        self.killed.append(actor)


def test_a_failed_rank_kills_the_others_and_is_named_in_one_line(tmp_path):
    from types import SimpleNamespace

    from opd_harness.trainers.ray_executor import LearnerRankFailed, RayLearner

    store = SimpleNamespace(root=tmp_path, checkpoints=lambda run_id: [{"step": 2}, {"step": 4}])
    session = SimpleNamespace(run_id="r1", store=store)
    fake = _FakeRay(["rank 0", "rank 1"])
    assert RayLearner(fake, ["a0", "a1"], session)._get([0, 1], "step 5") == ["rank 0", "rank 1"] and fake.killed == []
    collective = RuntimeError("gloo: connection closed by peer")  # rank 0's all-reduce fails because rank 1 died
    fake = _FakeRay([collective, _FakeRay.exceptions.RayActorError("the actor died unexpectedly")])
    learner = RayLearner(fake, ["a0", "a1"], session)
    with pytest.raises(LearnerRankFailed) as failed:
        learner._get([0, 1], "step 5")
    resume = f"harness run --resume r1 --out {tmp_path}"
    assert str(failed.value) == f"learner rank 1 of 2 died while step 5; continue from its last checkpoint (step 4) with: {resume}"
    assert fake.killed == ["a0", "a1"] and learner.killed
    store.checkpoints = lambda run_id: []
    fake = _FakeRay(["rank 0", ValueError("a batch of 1 samples cannot be split\nover 2 ranks")])
    with pytest.raises(LearnerRankFailed, match=r"^learner rank 1 of 2 failed \(ValueError: over 2 ranks\) while step 1; continue"):
        RayLearner(fake, ["a0", "a1"], session)._get([0, 1], "step 1")


def _metric(db, run_id: str, name: str) -> dict[int, float]:
    with sqlite3.connect(db) as conn:
        return dict(conn.execute("SELECT step, value FROM step_metrics WHERE run_id=? AND name=?", (run_id, name)).fetchall())


HUNG_TIMEOUT_S = 20  # trainer.collective_timeout_s of the hung-rank run: rank 0 waits this long for rank 1's collectives
FAULTS = {  # how rank 1 fails at step 3, and the line that names it
    "killed": "learner rank 1 of 2 died while step 3;",
    "hung": f"learner rank 0 of 2 failed (CollectiveTimeout: a collective did not complete within "
            f"trainer.collective_timeout_s={HUNG_TIMEOUT_S}s) while step 3;",
}  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, dict]:
    """In process, sync opd: the run a resumed run continues exactly (run once: every case compares with it)."""
    metrics, _, evals = run(tmp_path_factory.mktemp("reference"))
    return metrics, evals


@pytest.mark.slow
@pytest.mark.parametrize(("sharding", "fault"), [("ddp", "killed"), ("fsdp2", "killed"), ("ddp", "hung")])
def test_a_killed_or_hung_learner_rank_fails_the_run_and_it_resumes_onto_one_rank(tmp_path, ray_cluster, monkeypatch, reference,
                                                                                  sharding, fault):  # fmt: skip
    """Rank 1 killed at step 3, or never given step 3 (a hung rank: rank 0's collectives time out after
    trainer.collective_timeout_s): the run fails with one line, and its step-2 checkpoint resumes onto one rank."""
    import ray

    import opd_harness.trainers.ray_executor as rx

    reference, reference_evals = reference
    original = rx.RayLearner.train

    def fail_rank_1_at_step_3(self, batch, version):
        if version == 2 and fault == "killed":
            os.kill(ray.get(self.ranks[1].pid.remote()), signal.SIGKILL)
        if version == 2 and fault == "hung":  # only rank 0 is asked to train: it waits in the step's first collective
            lrs = [group["lr"] for group in self.session.optimizer.param_groups]
            return self._get([self.ranks[0].train.remote(version, lrs, *batch)], f"step {version + 1}")[0]
        return original(self, batch, version)

    monkeypatch.setattr(rx.RayLearner, "train", fail_rank_1_at_step_3)
    out = tmp_path / "failed"
    db = out / "results.sqlite"
    sharded = ["--set", f"trainer.layout.learner.sharding={sharding}", "--set", f"trainer.collective_timeout_s={HUNG_TIMEOUT_S}",
               "--set", "trainer.forward_tokens=60", "--set", "trainer.graph_memory_gib=0"]  # fmt: skip  # rows of ~45-60 tokens:
    # ranks cut different bucket counts, and run the per-bucket backward (gradient caching) however small the step
    result = runner.invoke(app, [*BASE, "--out", str(out), *two_ranks(ray_cluster.address), *sharded])
    assert result.exit_code == 1, result.output
    assert f"learner: 2 data-parallel ranks ({sharding}, gloo" in " ".join(result.output.split())
    line = " ".join(result.output.split())
    assert f"{FAULTS[fault]} continue from its last checkpoint (step 2) with: harness run --resume" in line
    assert "Traceback" not in driver_output(result.output)
    with sqlite3.connect(db) as conn:
        run_id, status = conn.execute("SELECT run_id, status FROM runs WHERE kind='train'").fetchone()
        ((step, checkpoint),) = conn.execute("SELECT step, metrics_json FROM checkpoints WHERE run_id=?", (run_id,)).fetchall()
        (avg_at_k,) = conn.execute("SELECT avg_at_k FROM evals WHERE run_id=? AND step=2", (run_id,)).fetchone()
    assert status == "failed" and step == 2
    placement = json.loads(checkpoint)["placement"]  # the two ranks ran on the two nodes
    assert {placement["learner_rank_0"], placement["learner_rank_1"]} == set(ray_cluster.node_ids.values())
    for name in ("loss", "grad_norm", "student_entropy", "teacher_kl", "teacher_kl_full"):  # global values, not rank 0's
        assert _metric(db, run_id, name) == pytest.approx({s: reference[s][name] for s in (1, 2)}, abs=1e-5), name
    assert avg_at_k == reference_evals[2]  # the checkpoint holds the ranks' weights
    monkeypatch.setattr(rx.RayLearner, "train", original)
    result = runner.invoke(app, ["run", "--resume", run_id, "--out", str(out), "--set", "trainer.layout.learner.replicas=1"])
    assert result.exit_code == 0, result.output
    assert "learner_rank_1" not in json.dumps(json.loads(_last_checkpoint_metrics(db, run_id))["placement"])  # one rank now
    assert _metric(db, run_id, "loss") == pytest.approx({s: reference[s]["loss"] for s in (1, 2, 3, 4)}, abs=1e-5)


def _last_checkpoint_metrics(db, run_id: str) -> str:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT metrics_json FROM checkpoints WHERE run_id=? ORDER BY step DESC", (run_id,)).fetchone()[0]
