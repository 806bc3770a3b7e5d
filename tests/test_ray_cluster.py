"""trainer.layout on a two-node Ray cluster: roles placed by placement groups on the nodes their custom resources name,
the same losses as in process, and layouts the cluster cannot hold refused (exit 2, naming the key) before anything is written."""

import json
import math
import os
import re
import signal
import sqlite3
import threading
import time

import pytest
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.config import ConfigError, build_config
from ray_cluster import driver_output
from test_ray_executor import BASE, assert_same_run, run

runner = CliRunner()
LAG = ["--method", "f_opd", "--mode", "async", "--set", "trainer.fixed_lag=1", "--set", "trainer.warmup_steps=3"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.layout.rollout.replicas=0", "trainer.layout.rollout.replicas"),
        ("trainer.layout.critic.num_cpus=1", "trainer.layout.critic"),
        ("trainer.layout.learner.replicas=1000", "trainer.layout.learner.replicas=1000: more learner ranks than samples"),
        ("trainer.layout.rollout.replicas=-1", "trainer.layout.rollout.replicas"),
        ("trainer.layout.rollout.strategy=scatter", "trainer.layout.rollout.strategy"),
        ("trainer.layout.learner.num_cpus=0", "trainer.layout.learner"),
        ("trainer.layout.eval.replicas=0", "trainer.layout.eval.replicas"),
        ("eval.shard_size=0", "eval.shard_size"),
        ("trainer.layout.learner.sharding=zero3", "trainer.layout.learner.sharding"),
    ],
)
def test_bad_layouts_are_refused_at_config_time(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config(overrides=["trainer.executor=ray", override])
    result = runner.invoke(app, [*BASE, "--out", str(tmp_path), "--executor", "ray", "--set", override])
    assert result.exit_code == 2 and key in " ".join(result.output.split()), result.output
    assert not (tmp_path / "results.sqlite").exists()


def test_fsdp2_where_torch_lacks_it_exits_2_naming_the_key(tmp_path, monkeypatch):
    import opd_harness.config

    config = build_config(overrides=["trainer.executor=ray", "trainer.layout.learner.sharding=fsdp2"])
    assert config.trainer.layout.learner.sharding == "fsdp2"  # torch 2.13 has fully_shard
    monkeypatch.setattr(opd_harness.config, "fsdp2_unsupported", lambda: "torch 2.4.0 has no torch.distributed.fsdp.fully_shard")
    result = runner.invoke(app, [*BASE, "--out", str(tmp_path), "--executor", "ray", "--set", "trainer.layout.learner.sharding=fsdp2"])
    line = " ".join(result.output.split())
    assert result.exit_code == 2 and "trainer.layout.learner.sharding" in line and "torch 2.4.0 has no" in line, result.output
    assert not (tmp_path / "results.sqlite").exists()


def test_layout_needs_ray_and_eval_is_placed_only_when_given():
    from opd_harness.trainers.ray_executor import local_cpus, placed_roles

    with pytest.raises(ConfigError, match="trainer.layout places the roles on a Ray cluster"):
        build_config(overrides=["trainer.layout.learner.num_cpus=1"])
    layout = build_config(overrides=["trainer.executor=ray", "trainer.layout.eval.replicas=4"]).trainer.layout
    assert layout.eval.replicas == 4 and layout.learner.replicas == 1
    assert placed_roles(layout) == ("rollout", "teacher", "learner", "eval") and local_cpus(layout, 1) == 7
    without = build_config(overrides=["trainer.executor=ray", "trainer.layout.rollout.replicas=3"]).trainer.layout
    assert without.rollout.replicas == 3 and without.eval is None  # no eval role: the driver evaluates, as before
    assert placed_roles(without) == ("rollout", "teacher", "learner") and local_cpus(without, 1) == 5
    assert build_config(overrides=["trainer.executor=ray"]).trainer.layout is None  # no layout: today's actors, no placement groups


def test_shortfall_names_the_role_key_and_resource():
    from opd_harness.trainers.ray_executor import layout_shortfall

    nodes = [{"Alive": True, "Resources": {"CPU": 2.0, "node_a": 1.0}}, {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}},
             {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}]  # fmt: skip
    layout = lambda *o: build_config(overrides=["trainer.executor=ray", *o]).trainer.layout  # noqa: E731
    assert layout_shortfall(layout("trainer.layout.rollout.resources={node_a: 1}"), nodes) is None
    assert "trainer.layout.learner.num_gpus" in layout_shortfall(layout("trainer.layout.learner.num_gpus=2"), nodes)
    assert "trainer.layout.teacher.num_cpus" in layout_shortfall(layout("trainer.layout.teacher.num_cpus=3"), nodes)
    assert "trainer.layout.rollout.resources.node_b" in layout_shortfall(layout("trainer.layout.rollout.resources={node_b: 1}"), nodes)
    both = layout("trainer.layout.rollout.num_gpus=1", "trainer.layout.rollout.resources={node_a: 1}")  # each exists, not on one node
    assert "trainer.layout.rollout: no single node" in layout_shortfall(both, nodes)
    assert "trainer.layout.eval.num_gpus" in layout_shortfall(layout("trainer.layout.eval.num_gpus=2"), nodes)
    spread = lambda n: layout(f"trainer.layout.learner.replicas={n}", "trainer.layout.learner.strategy=strict_spread")  # noqa: E731
    assert layout_shortfall(spread(2), nodes) is None  # one rank on each of the two alive nodes
    assert "trainer.layout.learner.strategy=strict_spread: 3 replicas" in layout_shortfall(spread(3), nodes)
    assert layout_shortfall(layout("trainer.layout.learner.replicas=3", "trainer.layout.learner.strategy=spread"), nodes) is None
    pack = lambda n: layout(f"trainer.layout.rollout.replicas={n}", "trainer.layout.rollout.strategy=strict_pack")  # noqa: E731
    assert layout_shortfall(pack(2), nodes) is None  # 2 × 1 CPU on one 2-CPU node
    assert "trainer.layout.rollout.strategy=strict_pack: no single node" in layout_shortfall(pack(3), nodes)


def _last_train_run(db) -> tuple[str, dict]:
    with sqlite3.connect(db) as conn:
        run_id, config = conn.execute("SELECT run_id, config_json FROM runs WHERE kind='train' ORDER BY created_at DESC").fetchone()
    return run_id, json.loads(config)


@pytest.fixture(scope="module")
def shared_out(tmp_path_factory):
    """One results folder for the module's cluster runs: the tiny models are built once."""
    return tmp_path_factory.mktemp("cluster-runs")


@pytest.fixture(scope="module")
def inprocess_lag(shared_out):
    """The in-process fixed-lag run the cluster runs must equal: (step metrics, Avg@k by step)."""
    metrics, _, evals = run(shared_out, *LAG)
    return metrics, evals


@pytest.mark.slow
def test_layout_places_roles_on_the_nodes_it_names_with_inprocess_losses(shared_out, ray_cluster, inprocess_lag):
    tmp_path, (inprocess, inprocess_evals) = shared_out, inprocess_lag
    placed = [
        "--executor", "ray", "--set", f"trainer.ray_address={ray_cluster.address}",
        "--set", "trainer.layout.rollout.resources={node_a: 1}", "--set", "trainer.layout.learner.resources={node_b: 1}",
        "--set", "trainer.layout.teacher.strategy=spread",
    ]  # fmt: skip
    on_cluster, checkpoints, evals = run(tmp_path, *LAG, *placed)
    assert_same_run(inprocess, on_cluster)
    assert evals == inprocess_evals
    placement = checkpoints[-1]["placement"]
    assert placement["rollout"] == ray_cluster.node_ids["node_a"] and placement["learner"] == ray_cluster.node_ids["node_b"]
    assert placement["teacher"] in ray_cluster.node_ids.values() and all(c["placement"] == placement for c in checkpoints)
    _, config = _last_train_run(tmp_path / "results.sqlite")
    layout = config["trainer"]["layout"]
    assert layout["rollout"]["resources"] == {"node_a": 1.0} and layout["learner"]["resources"] == {"node_b": 1.0}
    assert layout["teacher"] == {"replicas": 1, "num_cpus": 1.0, "num_gpus": 0.0, "resources": {}, "strategy": "spread"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, key",
    [
        (["trainer.layout.learner.num_gpus=3"], "trainer.layout.learner.num_gpus"),  # each node declares 2 fake GPUs
        (["trainer.layout.teacher.resources={node_c: 1}"], "trainer.layout.teacher.resources.node_c"),
        (["trainer.layout.rollout.num_cpus=2", "trainer.layout.rollout.resources={node_a: 1}",
          "trainer.layout.teacher.num_cpus=2", "trainer.layout.teacher.resources={node_a: 1}"], "trainer.layout.teacher"),
    ],
)  # fmt: skip
def test_layouts_the_cluster_cannot_hold_exit_2_before_anything_is_written(tmp_path, ray_cluster, monkeypatch, override, key):
    import opd_harness.trainers.ray_executor as rx

    monkeypatch.setattr(rx, "PLACEMENT_TIMEOUT_S", 3.0)  # the last case fits per node but not together: its wait times out
    sets = [arg for item in override for arg in ("--set", item)]
    result = runner.invoke(app, [*BASE, "--out", str(tmp_path), "--executor", "ray", "--set", f"trainer.ray_address={ray_cluster.address}",
                                 *sets])  # fmt: skip
    assert result.exit_code == 2 and key in " ".join(result.output.split()), result.output
    assert not (tmp_path / "results.sqlite").exists()
    import ray

    assert not ray.is_initialized()


@pytest.mark.slow
def test_a_sweep_point_whose_layout_the_cluster_cannot_hold_stops_the_sweep_before_any_run(tmp_path, ray_cluster):
    from opd_harness.sweep import SweepError, run_sweep

    spec = tmp_path / "grid.yaml"
    spec.write_text(
        "id: layouts\nbase:\n  preset: smoke\n"
        f"  set: {{threads: 1, trainer.executor: ray, trainer.ray_address: '{ray_cluster.address}'}}\n"
        "grid:\n  - {trainer.layout.learner.num_gpus: [0, 3]}\n"
    )
    refused = r"refuses 1 of 2 grid points; nothing was run\ngrid point 1 \(trainer.layout.learner.num_gpus=3\): trainer\.layout\.learner"
    with pytest.raises(SweepError, match=refused):
        run_sweep(spec, tmp_path / "out")
    assert not (tmp_path / "out").exists()


TWO_ROLLOUTS = ["--set", "trainer.layout.rollout.replicas=2", "--set", "trainer.layout.rollout.strategy=strict_spread"]
GROUPS = ["--set", "trainer.rollout_unit=group"]  # prompt groups streamed (4 per batch), several in flight per actor
TWO_TEACHERS = ["--set", "trainer.layout.teacher.replicas=2", "--set", "trainer.layout.teacher.num_cpus=0.5",
                "--set", "trainer.layout.teacher.strategy=strict_spread",
                "--set", "trainer.layout.rollout.num_cpus=0.5"]  # fmt: skip  (per node: a rollout, a teacher; and the learner)


def _losses_per_step(db, run_id: str) -> list[tuple[int, int]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT step, COUNT(*) FROM step_metrics WHERE run_id=? AND name='loss' GROUP BY step ORDER BY step",
                            (run_id,)).fetchall()  # fmt: skip


@pytest.mark.slow
def test_two_rollout_workers_on_two_nodes_survive_a_kill_with_inprocess_losses(shared_out, ray_cluster, inprocess_lag, monkeypatch):
    """Two rollout actors on different nodes stream the batches' prompt groups (the in-process run makes whole batches);
    one is SIGKILLed before a group of batch 3: Ray restarts it, the groups it had in flight are made again with the
    right weights, and every step is trained once with the in-process losses (fixed_lag).
    Two teacher actors score them; one is SIGKILLed before batch 2: its batches go to the other until it is back."""
    import ray

    import opd_harness.trainers.ray_executor as rx

    tmp_path, (inprocess, _) = shared_out, inprocess_lag
    killed: list[int] = []
    original, lock = rx.RayRollout.make, threading.Lock()

    def kill_first_replica_once(self, unit):
        index = unit.index
        with lock:  # groups are made from several threads at once: each kill happens once
            if index == 2 and not killed:
                killed.append(ray.get(self.teacher.actors[0].pid.remote()))
                os.kill(killed[-1], signal.SIGKILL)  # the least loaded teacher: this batch is likely sent to it, dead
            if index == 3 and len(killed) == 1:
                killed.append(ray.get(self.actor.pid.remote()))
                os.kill(killed[-1], signal.SIGKILL)  # mid-run, with weights loaded: its groups in flight are made again
        return original(self, unit)

    monkeypatch.setattr(rx.RayRollout, "make", kill_first_replica_once)
    on_cluster, checkpoints, _ = run(tmp_path, *LAG, "--executor", "ray", "--set", f"trainer.ray_address={ray_cluster.address}",
                                     *TWO_ROLLOUTS, *TWO_TEACHERS, *GROUPS)  # fmt: skip
    assert len(killed) == 2, "the kills never happened"
    assert_same_run(inprocess, on_cluster)
    run_id, _ = _last_train_run(tmp_path / "results.sqlite")
    assert _losses_per_step(tmp_path / "results.sqlite", run_id) == [(1, 1), (2, 1), (3, 1), (4, 1)]
    assert all(math.isfinite(on_cluster[s]["loss"]) for s in on_cluster)
    placement = checkpoints[-1]["placement"]
    assert {placement["rollout.0"], placement["rollout.1"]} == set(ray_cluster.node_ids.values())  # one on each node
    assert {placement["teacher.0"], placement["teacher.1"]} == set(ray_cluster.node_ids.values())
    workers = checkpoints[-1]["rollout_workers"]
    assert len(workers) == 2 and all(w["samples"] > 0 and w["samples_per_s"] > 0 for w in workers)
    assert sum(w["samples"] for w in workers) == sum(on_cluster[s]["samples"] for s in on_cluster)


TWO_AND_TWO = [*TWO_ROLLOUTS, "--set", "trainer.layout.rollout.num_cpus=0.5", "--set", "trainer.layout.teacher.num_cpus=0.5",
               "--set", "trainer.layout.learner.replicas=2", "--set", "trainer.layout.learner.strategy=strict_spread"]  # fmt: skip
# per node: a rollout worker (0.5 CPU) and a learner rank (1 CPU); the teacher (0.5 CPU) on either


def _assert_both_roles_on_both_nodes(placement: dict[str, str], nodes: dict[str, str]) -> None:
    """Rollout workers 0 and 1 on different nodes, and so learner ranks 0 and 1 (node ids as Ray reports them)."""
    assert {placement["rollout.0"], placement["rollout.1"]} == set(nodes.values()), placement
    assert {placement["learner_rank_0"], placement["learner_rank_1"]} == set(nodes.values()), placement


@pytest.mark.slow
def test_two_rollout_workers_keep_every_sample_within_max_lag(shared_out, ray_cluster):
    """max_lag 1 with 2 rollout workers (and 2 learner ranks), one of each per node: no sample of any worker is older."""
    on_cluster, checkpoints, _ = run(shared_out, "--method", "f_opd", "--mode", "async", "--set", "trainer.max_lag=1",
                                     "--executor", "ray", "--set", f"trainer.ray_address={ray_cluster.address}", *TWO_AND_TWO)  # fmt: skip
    assert sorted(on_cluster) == [1, 2, 3, 4] and all(on_cluster[s]["lag_max"] <= 1 for s in on_cluster)
    assert set(checkpoints[-1]["staleness_hist"]) <= {"0", "1"}  # every sample, whichever worker made it
    _assert_both_roles_on_both_nodes(checkpoints[-1]["placement"], ray_cluster.node_ids)
    assert len(checkpoints[-1]["rollout_workers"]) == 2


def _interrupted_then_resumed(out, monkeypatch, args: list[str], resume: list[str]) -> tuple[str, dict[int, dict[str, float]]]:
    """A run of ``args`` interrupted (as by Ctrl-C) when step 3 is recorded, i.e. after its step-2 checkpoint, then resumed
    with ``resume``: (run id, step metrics of the whole run)."""
    import opd_harness.trainers.pipeline as tp

    original = tp.Session.record_step

    def interrupt_at_step_3(self, step, *a, **kw):
        if step == 3:
            raise KeyboardInterrupt
        return original(self, step, *a, **kw)

    db = out / "results.sqlite"
    monkeypatch.setattr(tp.Session, "record_step", interrupt_at_step_3)
    interrupted = runner.invoke(app, [*BASE, "--out", str(out), *args])
    monkeypatch.setattr(tp.Session, "record_step", original)
    assert interrupted.exit_code == 130 and "--resume" in interrupted.output, interrupted.output
    run_id, _ = _last_train_run(db)
    resumed = runner.invoke(app, ["run", "--resume", run_id, "--out", str(out), *resume])
    assert resumed.exit_code == 0, resumed.output
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT step, name, value FROM step_metrics WHERE run_id=?", (run_id,)).fetchall()
    metrics: dict[int, dict[str, float]] = {}
    for step, name, value in rows:
        metrics.setdefault(step, {})[name] = value
    return run_id, metrics


@pytest.mark.slow
def test_two_rollout_workers_and_two_learner_ranks_on_two_nodes_resume_onto_one_rank(tmp_path, ray_cluster, monkeypatch):
    """The issue's combined layout: 2 rollout workers and 2 learner ranks, one of each per node, under fixed_lag 1.
    The run is interrupted after its step-2 checkpoint and resumed onto 1 learner rank (the 2 workers stay). Every
    step's loss, gradient norm, behaviour version and lag equal an in-process run interrupted and resumed the same way
    (its steps 1–2 are the uninterrupted run's; after a resume only the checkpoint's weights exist, so batch 3 is made
    with version 2 in both, and the lag ramps back up)."""
    _, inprocess = _interrupted_then_resumed(tmp_path, monkeypatch, LAG, [])
    cluster = ["--executor", "ray", "--set", f"trainer.ray_address={ray_cluster.address}", *TWO_AND_TWO]
    one_rank = ["--set", "trainer.layout.learner.replicas=1"]
    run_id, on_cluster = _interrupted_then_resumed(tmp_path, monkeypatch, [*LAG, *cluster], one_rank)
    assert_same_run(inprocess, on_cluster)
    assert [on_cluster[s]["behaviour_version"] for s in (1, 2, 3, 4)] == [0, 0, 2, 2]  # the resume's ramp: lag 1, then 0, 1
    assert [on_cluster[s]["grad_norm"] for s in (1, 2, 3, 4)] == pytest.approx([inprocess[s]["grad_norm"] for s in (1, 2, 3, 4)], abs=1e-5)
    assert _losses_per_step(tmp_path / "results.sqlite", run_id) == [(1, 1), (2, 1), (3, 1), (4, 1)]  # each step trained once
    with sqlite3.connect(tmp_path / "results.sqlite") as conn:
        placements = [json.loads(m)["placement"] for (m,) in conn.execute(
            "SELECT metrics_json FROM checkpoints WHERE run_id=? ORDER BY step", (run_id,))]  # fmt: skip
    assert len(placements) == 2
    _assert_both_roles_on_both_nodes(placements[0], ray_cluster.node_ids)  # step 2: before the interruption
    resumed = placements[1]  # step 4: one learner rank, the two workers still on both nodes
    assert "learner_rank_1" not in resumed and {resumed["rollout.0"], resumed["rollout.1"]} == set(ray_cluster.node_ids.values())


def test_the_f_opd_16_gpu_layout_file_validates_and_fills_two_8_gpu_nodes():
    """README's layout for the f-OPD paper's 16 GPUs: a valid config whose roles ask for exactly the GPUs of its two
    labelled nodes, held by such a cluster and refused (naming the key) by one with a single 8-GPU node."""
    from pathlib import Path

    from opd_harness.trainers.ray_executor import layout_shortfall

    cfg = build_config(config_file=Path(__file__).parents[1] / "docs" / "layouts" / "f-opd-16xh100.yaml")
    layout = cfg.trainer.layout
    gpus: dict[str, float] = {}
    for role in ("rollout", "teacher", "learner"):
        spec = getattr(layout, role)
        (label,) = spec.resources
        gpus[label] = gpus.get(label, 0.0) + spec.replicas * spec.num_gpus
    assert gpus == {"node_a": 8.0, "node_b": 8.0} and cfg.trainer.executor == "ray" and cfg.method == "f_opd"
    node = lambda label: {"Alive": True, "Resources": {"CPU": 64.0, "GPU": 8.0, label: 8.0}}  # noqa: E731
    assert layout_shortfall(layout, [node("node_a"), node("node_b")]) is None
    assert "trainer.layout.teacher.resources.node_b" in layout_shortfall(layout, [node("node_a")])


EVAL_WORKERS = ["--set", "trainer.layout.eval.replicas=2", "--set", "trainer.layout.eval.num_cpus=0.5",
                "--set", "trainer.layout.eval.strategy=strict_spread", "--set", "trainer.layout.rollout.num_cpus=0.5",
                "--set", "trainer.layout.teacher.num_cpus=0.5", "--set", "eval.shard_size=2",
                "--set", "trainer.layout.learner.resources={node_a: 0.1}", "--set", "trainer.layout.rollout.resources={node_b: 0.1}",
                "--set", "trainer.layout.teacher.resources={node_b: 0.1}"]  # fmt: skip
# 4 shards a checkpoint; the other roles pinned so that each node keeps 1 CPU for an eval worker, which strict_spread
# puts one on each node (Ray's soft SPREAD could pack both on one node when the scheduler had filled the other)


def _samples(db, run_id: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT step, task, problem_id, sample_index, completion, score, status FROM samples WHERE run_id=? "
                            "ORDER BY 1, 2, 3, 4", (run_id,)).fetchall()  # fmt: skip


def _inprocess_run(db) -> str:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT run_id, config_json FROM runs WHERE kind='train'").fetchall()
    (run_id,) = [r for r, config in rows if json.loads(config)["trainer"]["executor"] == "inprocess"]
    return run_id


@pytest.mark.slow
def test_checkpoint_evaluations_run_on_eval_workers_and_resume_without_redoing_staged_shards(
    shared_out, ray_cluster, inprocess_lag, monkeypatch
):
    """trainer.layout.eval: every checkpoint's shards on 2 evaluation workers (one per node), none in the driver. One
    worker is SIGKILLed once step 2's first shard is staged (Ray restarts it; it must get step 2's weights again); the
    run is interrupted once step 4's first shard is staged, and resumed: that shard is not redone. Every stored sample
    equals the in-process run's."""
    import ray

    import opd_harness.evaluation
    import opd_harness.trainers.ray_eval as re_

    db = shared_out / "results.sqlite"
    in_driver, staged, runners, killed = [], [], [], []
    evaluation = opd_harness.evaluation
    real_shard, real_save, real_call = evaluation.evaluate_shard, evaluation.ShardStage.save, re_.CheckpointShards.__call__
    monkeypatch.setattr(opd_harness.evaluation, "evaluate_shard", lambda *a, **kw: (in_driver.append(kw["index"]), real_shard(*a, **kw))[1])
    monkeypatch.setattr(re_.CheckpointShards, "__call__", lambda self, *a: (runners.append(self), real_call(self, *a))[1])

    def save(self, key, samples, interrupt: bool):
        real_save(self, key, samples)
        staged.append((self.folder.name, key["index"]))
        if self.folder.name == "step2" and not killed:
            killed.append(ray.get(runners[-1].shards.workers[0].pid.remote()))
            os.kill(killed[-1], signal.SIGKILL)
        if interrupt and self.folder.name == "step4":
            raise KeyboardInterrupt

    monkeypatch.setattr(opd_harness.evaluation.ShardStage, "save", lambda self, key, samples: save(self, key, samples, True))
    cluster = ["--executor", "ray", "--set", f"trainer.ray_address={ray_cluster.address}", *EVAL_WORKERS]
    result = runner.invoke(app, [*BASE, "--out", str(shared_out), *LAG, *cluster])
    assert result.exit_code == 130 and "--resume" in result.output, result.output
    run_id, _ = _last_train_run(db)
    assert killed and staged[-1][0] == "step4" and [s for s in staged if s[0] == "step4"] == staged[-1:]
    first = staged[-1]
    monkeypatch.setattr(opd_harness.evaluation.ShardStage, "save", lambda self, key, samples: save(self, key, samples, False))
    resumed = runner.invoke(app, ["run", "--resume", run_id, "--out", str(shared_out)])
    assert resumed.exit_code == 0, resumed.output
    assert in_driver == []  # no shard of the student ran in the driver
    step4 = [s for s in staged if s[0] == "step4"]
    assert sorted(i for _, i in step4) == [0, 1, 2, 3] and step4.count(first) == 1  # the staged shard was not redone
    assert sorted(i for f, i in staged if f == "step2") == [0, 1, 2, 3]
    assert not (shared_out / "runs" / run_id / "eval_shards").exists()
    assert _samples(db, run_id) == _samples(db, _inprocess_run(db)) and {row[0] for row in _samples(db, run_id)} == {2, 4}
    with sqlite3.connect(db) as conn:
        (metrics,) = conn.execute("SELECT metrics_json FROM checkpoints WHERE run_id=? AND step=2", (run_id,)).fetchone()
    placement = json.loads(metrics)["placement"]
    assert {placement["eval.0"], placement["eval.1"]} == set(ray_cluster.node_ids.values())


GPU_LAYOUT = ["--set", "trainer.layout.rollout.num_gpus=1", "--set", "trainer.layout.teacher.num_gpus=1",
              "--set", "trainer.layout.learner.num_gpus=1", "--set", "trainer.layout.learner.resources={node_b: 0.1}",
              "--set", "trainer.layout.rollout.resources={node_a: 0.1}"]  # fmt: skip  (2 fake GPUs per node: 3 of 4 asked)


@pytest.mark.slow
def test_a_gpu_layout_records_each_actor_s_gpu_ids_and_exits_2_naming_the_role_where_torch_sees_no_cuda(tmp_path, ray_cluster):
    """Nodes that declare fake GPUs: Ray places the roles and assigns each actor its GPU ids, which the run's placement
    records; the actors' torch sees no CUDA, so the run stops before training with exit 2 naming the first role's
    num_gpus key (before, the same layout trained on the CPU: the GPUs were only reserved)."""
    result = runner.invoke(app, [*BASE, "--out", str(tmp_path), "--executor", "ray", "--set", f"trainer.ray_address={ray_cluster.address}",
                                 *GPU_LAYOUT])  # fmt: skip
    line = " ".join(result.output.split())
    assert result.exit_code == 2 and "trainer.layout.rollout.num_gpus: Ray gave the rollout actor GPU" in line, result.output
    assert "torch there sees no CUDA device" in line
    run_id, _ = _last_train_run(tmp_path / "results.sqlite")
    with sqlite3.connect(tmp_path / "results.sqlite") as conn:
        assert conn.execute("SELECT status FROM runs WHERE run_id=?", (run_id,)).fetchone() == ("failed",)
        assert conn.execute("SELECT COUNT(*) FROM step_metrics WHERE run_id=?", (run_id,)).fetchone() == (0,)  # nothing trained
    placement = json.loads((tmp_path / "runs" / run_id / "placement.json").read_text())
    gpus = placement["gpus"]
    assert placement["rollout"] == ray_cluster.node_ids["node_a"] and placement["learner"] == ray_cluster.node_ids["node_b"]
    assert sorted(gpus) == ["learner", "rollout", "teacher"] and all(len(ids) == 1 and ids[0] in {"0", "1"} for ids in gpus.values())
    by_node: dict[str, list[str]] = {}
    for role, ids in gpus.items():
        by_node.setdefault(placement[role], []).extend(ids)
    assert all(len(ids) == len(set(ids)) for ids in by_node.values()), placement  # no GPU of a node handed out twice


HANG_TIMEOUT_S = 12.0  # trainer.actor_timeout_s of the hang test: longer than any call of the tiny run on 2 busy cores


@pytest.mark.slow
def test_a_hung_rollout_actor_is_killed_within_its_timeout_restarted_and_every_step_trained_once(
    shared_out, ray_cluster, inprocess_lag, monkeypatch
):
    """The rollout actor is stopped (SIGSTOP: alive, never answering) before a group of batch 3: its calls exceed
    trainer.actor_timeout_s, the driver kills it once (Ray restarts it), the groups it held are made again and every
    step is trained once with the in-process losses (fixed_lag)."""
    import ray

    import opd_harness.trainers.ray_executor as rx

    tmp_path, (inprocess, _) = shared_out, inprocess_lag
    stopped: list[float] = []
    kills: list[float] = []
    original_make, original_kill, lock = rx.RayRollout.make, ray.kill, threading.Lock()

    def stop_once(self, unit):
        with lock:
            if unit.index == 3 and not stopped:
                os.kill(ray.get(self.actor.pid.remote()), signal.SIGSTOP)
                stopped.append(time.monotonic())
        return original_make(self, unit)

    def kill(actor, *, no_restart=True):
        if not no_restart:  # a kill for Ray to restart (the run's end kills for good)
            kills.append(time.monotonic())
        return original_kill(actor, no_restart=no_restart)

    monkeypatch.setattr(rx.RayRollout, "make", stop_once)
    monkeypatch.setattr(ray, "kill", kill)
    on_cluster, _, _ = run(tmp_path, *LAG, *GROUPS, "--executor", "ray", "--set", f"trainer.ray_address={ray_cluster.address}",
                           "--set", f"trainer.actor_timeout_s={HANG_TIMEOUT_S}")  # fmt: skip
    assert stopped, "the actor was never stopped"
    assert len(kills) == 1 and kills[0] - stopped[0] < HANG_TIMEOUT_S + 5, (stopped, kills)  # once, within the timeout
    assert_same_run(inprocess, on_cluster)
    run_id, _ = _last_train_run(tmp_path / "results.sqlite")
    assert _losses_per_step(tmp_path / "results.sqlite", run_id) == [(1, 1), (2, 1), (3, 1), (4, 1)]


@pytest.mark.slow
def test_a_hung_eval_worker_is_killed_within_its_timeout_restarted_and_its_shard_evaluated_again(
    shared_out, ray_cluster, inprocess_lag, monkeypatch
):
    """The run's evaluation worker is stopped (SIGSTOP: alive, never answering) once it holds step 4's weights: its shard
    call exceeds trainer.actor_timeout_s, the driver kills it once (Ray restarts it, it reads step 4's weights again), the
    shard is re-queued and every stored sample equals the in-process run's. (Before, the driver waited on the shard for
    ever: here a watchdog resumes the stopped worker after WATCHDOG_S, so the run ends and the test fails on the kill.)"""
    import ray

    import opd_harness.trainers.ray_eval as re_

    db = shared_out / "results.sqlite"
    stopped: list[float] = []
    kills: list[float] = []
    runners: list = []
    watchdog: list[threading.Timer] = []
    real_call, original_kill = re_.CheckpointShards.__call__, ray.kill

    def stop_at_step_4(self, path, step):
        shards = real_call(self, path, step)
        runners.append(shards)
        if step == 4 and not stopped:
            pid = ray.get(shards.workers[0].pid.remote())
            os.kill(pid, signal.SIGSTOP)
            stopped.append(time.monotonic())
            watchdog.append(threading.Timer(WATCHDOG_S, os.kill, (pid, signal.SIGCONT)))
            watchdog[-1].start()
        return shards

    def kill(actor, *, no_restart=True):
        if not no_restart:  # a kill for Ray to restart (the run's end kills for good)
            kills.append(time.monotonic())
            for timer in watchdog:
                timer.cancel()
        return original_kill(actor, no_restart=no_restart)

    monkeypatch.setattr(re_.CheckpointShards, "__call__", stop_at_step_4)
    monkeypatch.setattr(ray, "kill", kill)
    try:
        on_cluster, _, evals = run(shared_out, *LAG, "--executor", "ray", "--set", f"trainer.ray_address={ray_cluster.address}",
                                   "--set", f"trainer.actor_timeout_s={HANG_TIMEOUT_S}")  # fmt: skip
    finally:
        for timer in watchdog:
            timer.cancel()
    assert stopped, "the evaluation worker was never stopped"
    assert len(kills) == 1 and kills[0] - stopped[0] < HANG_TIMEOUT_S + 5, (stopped, kills)  # once, within the timeout
    assert runners[-1].requeued >= 1 and runners[-1].kills == 1
    assert_same_run(inprocess_lag[0], on_cluster)
    assert evals == inprocess_lag[1]
    run_id, _ = _last_train_run(db)
    assert _samples(db, run_id) == _samples(db, _inprocess_run(db)) and {row[0] for row in _samples(db, run_id)} == {2, 4}


WATCHDOG_S = 90.0  # the hung-eval-worker test resumes its stopped worker after this (without detection the run never ends)


@pytest.mark.slow
def test_an_eval_worker_that_hangs_in_a_checkpoint_load_is_killed_restarted_and_the_evaluation_completes(
    shared_out, ray_cluster, inprocess_lag, monkeypatch
):
    """The run's evaluation worker hangs while it reads step 2's weights from the checkpoint folder (a subclass shipped by
    value whose first load sleeps): the load exceeds trainer.actor_timeout_s, the driver kills the worker once, Ray
    restarts it, it reads the checkpoint again before its first shard, and every stored sample equals the in-process run's."""
    import ray

    import opd_harness.trainers.ray_eval as re_

    db, marker = shared_out / "results.sqlite", str(shared_out / "eval-load-hung")
    loads: list[float] = []
    kills: list[float] = []
    real_load, original_kill = re_.RayShards.load, ray.kill

    class HangingLoadWorker(re_.EvalWorker):
        def load_checkpoint(self, path: str, version: int) -> None:
            if not os.path.exists(marker):  # the first load only (a file: the restarted worker is a new process)
                open(marker, "w").close()
                time.sleep(WATCHDOG_S)  # a read stuck on a filesystem; without detection the run goes on after this
            re_.EvalWorker.load_checkpoint(self, path, version)

    def load(self, path, version):
        loads.append(time.monotonic())
        return real_load(self, path, version)

    def kill(actor, *, no_restart=True):
        if not no_restart:  # a kill for Ray to restart (the run's end kills for good)
            kills.append(time.monotonic())
        return original_kill(actor, no_restart=no_restart)

    monkeypatch.setattr(re_, "EvalWorker", HangingLoadWorker)
    monkeypatch.setattr(re_.RayShards, "load", load)
    monkeypatch.setattr(ray, "kill", kill)
    on_cluster, _, evals = run(shared_out, *LAG, "--executor", "ray", "--set", f"trainer.ray_address={ray_cluster.address}",
                               "--set", f"trainer.actor_timeout_s={HANG_TIMEOUT_S}")  # fmt: skip
    assert os.path.exists(marker), "the checkpoint load never hung"
    assert len(kills) == 1 and kills[0] - loads[0] < HANG_TIMEOUT_S + 5, (loads, kills)  # once, within the timeout
    assert_same_run(inprocess_lag[0], on_cluster)
    assert evals == inprocess_lag[1]
    run_id, _ = _last_train_run(db)
    assert _samples(db, run_id) == _samples(db, _inprocess_run(db)) and {row[0] for row in _samples(db, run_id)} == {2, 4}


EVAL_ON_NODE_B = ["--set", "trainer.layout.eval.replicas=2", "--set", "trainer.layout.eval.num_cpus=0.5",
                  "--set", "trainer.layout.eval.strategy=strict_spread", "--set", "eval.shard_size=2",
                  "--set", "trainer.layout.rollout.num_cpus=0.5", "--set", "trainer.layout.rollout.resources={node_a: 0.1}",
                  "--set", "trainer.layout.teacher.num_cpus=0.5", "--set", "trainer.layout.teacher.resources={node_a: 0.1}",
                  "--set", "trainer.layout.learner.num_cpus=0.5", "--set", "trainer.layout.learner.resources={node_a: 0.1}"]  # fmt: skip
# every role but one evaluation worker on node a (4 × 0.5 CPUs); the other evaluation worker alone on node b
NODE_LOSS_RESTART_S = 180.0  # trainer.actor_restart_timeout_s of the lost-eval-node test: it bounds the actors' start-up too,
# which took over 60 s at load 16 (and a lost node is detected at once: its worker's calls fail and its raylet refuses)


@pytest.mark.slow
def test_an_eval_worker_whose_node_dies_ends_the_run_failed_naming_it_and_the_node(tmp_path, monkeypatch):
    """Its own two-node cluster (this test kills a node): one of the run's two evaluation workers runs alone on node b,
    which is killed (every process of it) as step 2's checkpoint evaluation starts. The run ends failed (exit 1) within
    its timeouts, with one line naming that worker (``eval.N``) and node b, and no traceback."""
    pytest.importorskip("ray")
    from ray_cluster import remove_cluster_dir, start_two_node_cluster

    import opd_harness.trainers.ray_eval as re_

    cluster = start_two_node_cluster()
    try:
        real_call, killed = re_.CheckpointShards.__call__, []

        def lose_node_b(self, path, step):
            if not killed:
                cluster.kill_node("b")
                killed.append(time.monotonic())
            return real_call(self, path, step)

        monkeypatch.setattr(re_.CheckpointShards, "__call__", lose_node_b)
        args = [*BASE, "--out", str(tmp_path), *LAG, "--executor", "ray", "--set", f"trainer.ray_address={cluster.address}",
                *EVAL_ON_NODE_B, "--set", f"trainer.actor_timeout_s={HANG_TIMEOUT_S}",
                "--set", f"trainer.actor_restart_timeout_s={NODE_LOSS_RESTART_S}"]  # fmt: skip
        failed = runner.invoke(app, args)
        ended = time.monotonic()
        line = " ".join(failed.output.split())
        assert killed and failed.exit_code == 1, failed.output[-3000:]
        run_id, _ = _last_train_run(tmp_path / "results.sqlite")
        placement = json.loads((tmp_path / "runs" / run_id / "placement.json").read_text())
        node_b = cluster.node_ids["node_b"]
        (on_b,) = [name for name in ("eval.0", "eval.1") if placement[name] == node_b]
        assert re.search(rf"\berror: run \S+ failed: {re.escape(on_b)} .*; node {node_b} died", line), line[-3000:]
        assert "Traceback" not in driver_output(failed.output) and "continue from" in line
        assert ended - killed[0] < HANG_TIMEOUT_S + NODE_LOSS_RESTART_S + 30  # bounded: not a hang
        print(f"lost evaluation node: the run ended {ended - killed[0]:.1f}s after the kill: {line[line.index('error: run'):]}")
        with sqlite3.connect(tmp_path / "results.sqlite") as conn:
            assert conn.execute("SELECT status FROM runs WHERE run_id=?", (run_id,)).fetchone() == ("failed",)
    finally:
        assert cluster.stop() == []
        remove_cluster_dir(cluster)


NODE_LOSS_LAYOUT = ["--set", "trainer.layout.rollout.resources={node_a: 0.1}", "--set", "trainer.layout.teacher.resources={node_a: 0.1}"]
# the rollout and teacher actors fill node a's 2 CPUs, so the learner (1 CPU) goes to node b; halved, all fit on node a


@pytest.mark.slow
def test_a_lost_worker_node_fails_the_run_naming_it_and_resume_onto_the_head_node_finishes(tmp_path, monkeypatch):
    """Its own two-node cluster (this test kills a node): the learner runs on node b, which is killed (every process of
    it) once step 3 is recorded, after the step-2 checkpoint. The run ends failed (exit 1) with one line naming the
    learner and node b; --resume with the learner moved to the head node trains steps 3 and 4, each step once."""
    pytest.importorskip("ray")
    from ray_cluster import remove_cluster_dir, start_two_node_cluster

    import opd_harness.trainers.pipeline as tp

    cluster = start_two_node_cluster()
    try:
        original = tp.Session.record_step

        def lose_node_b_at_step_3(self, step, *a, **kw):
            if step == 3:
                cluster.kill_node("b")
            return original(self, step, *a, **kw)

        monkeypatch.setattr(tp.Session, "record_step", lose_node_b_at_step_3)
        args = [*BASE, "--out", str(tmp_path), *LAG, "--executor", "ray", "--set", f"trainer.ray_address={cluster.address}",
                *NODE_LOSS_LAYOUT]  # fmt: skip
        failed = runner.invoke(app, args)
        monkeypatch.setattr(tp.Session, "record_step", original)
        line = " ".join(failed.output.split())
        node_b = cluster.node_ids["node_b"]
        assert failed.exit_code == 1 and f"node {node_b} died" in line and "learner" in line, line[-3000:]
        assert "continue from its last checkpoint (step 2) with: harness run --resume" in line
        assert "Traceback" not in driver_output(failed.output)
        run_id, _ = _last_train_run(tmp_path / "results.sqlite")
        with sqlite3.connect(tmp_path / "results.sqlite") as conn:
            assert conn.execute("SELECT status FROM runs WHERE run_id=?", (run_id,)).fetchone() == ("failed",)
        resumed = runner.invoke(app, ["run", "--resume", run_id, "--out", str(tmp_path), "--set", "trainer.layout.rollout.num_cpus=0.5",
                                      "--set", "trainer.layout.teacher.num_cpus=0.5"])  # fmt: skip
        assert resumed.exit_code == 0, resumed.output
        assert _losses_per_step(tmp_path / "results.sqlite", run_id) == [(1, 1), (2, 1), (3, 1), (4, 1)]
    finally:
        assert cluster.stop() == []
        remove_cluster_dir(cluster)


COLLECTIVE = ["--set", "trainer.weight_sync=collective"]
EVERY_3 = ["--method", "opd", "--mode", "async", "--set", "trainer.steps=6", "--set", "trainer.sync_every=3",
           "--set", "trainer.max_lag=3"]  # fmt: skip


class _SyncProbe:
    """From the driver: the learner's hash of all its weights (in the rollout dtype) at each version it publishes, each
    rollout actor's hash of its engine's weights after each load, and the weight group's generation."""

    def __init__(self, monkeypatch) -> None:
        import ray

        import opd_harness.trainers.ray_executor as rx
        from opd_harness.trainers.weight_sync import checksum

        self.learner: dict[int, str] = {}
        self.loaded: list[tuple[str, int, str]] = []
        self.generations: list[int] = []
        publish, load = rx.RayLearner.publish, rx.RayRollout.load

        def publish_probe(learner, version):
            published = publish(learner, version)  # the learner's next step is sent after this returns: it still holds `version`
            self.learner[version] = checksum(ray.get(learner.actor.rollout_weights.remote(learner.dtype)), every=True)
            self.generations.append(learner.generation)
            return published

        def load_probe(side, version):
            load(side, version)
            self.loaded.append((side.name, version, ray.get(side.actor.loaded_checksum.remote())))

        monkeypatch.setattr(rx.RayLearner, "publish", publish_probe)
        monkeypatch.setattr(rx.RayRollout, "load", load_probe)

    def assert_bit_for_bit(self) -> None:
        assert self.loaded
        wrong = [(name, version) for name, version, digest in self.loaded if digest != self.learner[version]]
        assert not wrong, wrong


def _parameter_bytes(out) -> int:
    """The student's parameter bytes in the hf rollout engine's dtype (float32 here), a tied tensor once."""
    from transformers import AutoModelForCausalLM

    (student,) = (out / "cache" / "models").glob("student-*")
    model = AutoModelForCausalLM.from_pretrained(student)
    assert next(model.parameters()).dtype == __import__("torch").float32 and model.config.tie_word_embeddings
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters(): a tied tensor once


@pytest.mark.slow
def test_collective_weight_sync_on_two_nodes_is_bit_for_bit_in_the_rollout_dtype_once_per_three_versions(
    shared_out, ray_cluster, monkeypatch
):
    """trainer.weight_sync=collective with 2 rollout workers, one per node (nodes with 2 fake GPUs each), sync_every=3:
    versions 0, 3 and 6 are broadcast (no other), each step's sync_bytes is the parameter bytes in the rollout dtype
    (tied embedding and head once) or 0, and after every load each worker's weights equal the learner's bit for bit."""
    probe = _SyncProbe(monkeypatch)
    metrics, checkpoints, _ = run(shared_out, *EVERY_3, *COLLECTIVE, *TWO_ROLLOUTS, "--executor", "ray",
                                  "--set", f"trainer.ray_address={ray_cluster.address}")  # fmt: skip
    expected = _parameter_bytes(shared_out)
    assert {s: metrics[s]["sync_bytes"] for s in sorted(metrics)} == {1: 0, 2: 0, 3: expected, 4: 0, 5: 0, 6: expected}
    assert sorted(probe.learner) == [0, 3, 6]  # weights moved once per three versions (and the start)
    probe.assert_bit_for_bit()
    assert {name for name, _, _ in probe.loaded} == {"rollout.0", "rollout.1"} and {v for _, v, _ in probe.loaded} <= {0, 3, 6}
    placement = checkpoints[-1]["placement"]
    assert {placement["rollout.0"], placement["rollout.1"]} == set(ray_cluster.node_ids.values())


@pytest.mark.slow
def test_a_rollout_worker_killed_under_collective_sync_rejoins_and_every_step_is_trained_once(
    shared_out, ray_cluster, inprocess_lag, monkeypatch
):
    """weight_sync=collective, 2 rollout workers on 2 nodes, fixed_lag 1: the worker that makes batch 3 is SIGKILLed before
    it does (which worker that is depends on which finished its first batch sooner: the shared queue hands batch 3 to the
    first idle one). Ray restarts it; it loads the version it missed from the learner's copy, every member joins a new
    weight group before the next broadcast, every load of both workers equals the learner's weights bit for bit, and
    every step is trained once with the in-process losses (before, the restarted worker had no staged weights and the
    broadcast lost a rank)."""
    import ray

    import opd_harness.trainers.ray_executor as rx

    probe = _SyncProbe(monkeypatch)
    tmp_path, (inprocess, _) = shared_out, inprocess_lag
    killed: list[tuple[str, int]] = []
    original, lock = rx.RayRollout.make, threading.Lock()

    def kill_once(self, unit):
        with lock:
            if unit.index == 3 and not killed:
                killed.append((self.name, ray.get(self.actor.pid.remote())))
                os.kill(killed[-1][1], signal.SIGKILL)
        return original(self, unit)

    monkeypatch.setattr(rx.RayRollout, "make", kill_once)
    on_cluster, _, _ = run(tmp_path, *LAG, *COLLECTIVE, *TWO_ROLLOUTS, "--executor", "ray",
                           "--set", f"trainer.ray_address={ray_cluster.address}")  # fmt: skip
    assert killed, "the kill never happened"
    assert_same_run(inprocess, on_cluster)
    run_id, _ = _last_train_run(tmp_path / "results.sqlite")
    assert _losses_per_step(tmp_path / "results.sqlite", run_id) == [(1, 1), (2, 1), (3, 1), (4, 1)]
    probe.assert_bit_for_bit()
    assert max(probe.generations) >= 2, probe.generations  # the group was formed anew with the restarted worker
    (victim, _), = killed
    restarted = [version for name, version, _ in probe.loaded if name == victim]
    assert len(restarted) >= 2, (victim, probe.loaded)  # loads before and after its restart, each checked above
    assert {name for name, _, _ in probe.loaded} == {"rollout.0", "rollout.1"}


REGROUP_TIMEOUT_S = 120.0  # trainer.actor_timeout_s of the regroup test: what a join waited before a lost member was detected


@pytest.mark.slow
def test_a_rollout_worker_lost_while_the_weight_group_is_formed_anew_is_restarted_and_both_rejoin(
    shared_out, ray_cluster, inprocess_lag, monkeypatch
):
    """weight_sync=collective, 2 rollout workers on 2 nodes, fixed_lag 1: the worker that makes batch 3 is SIGKILLed (as
    above), and while the group is formed anew with it (generation 2) the other worker is SIGKILLed too. The forming
    group's store is stopped at once, so the restarted worker and the learner give up their join instead of waiting
    trainer.actor_timeout_s (and no live worker is killed as hung); the lost worker is restarted, a later group forms with
    both, every load equals the learner's weights bit for bit and every step is trained once with the in-process losses.
    (Before, the members waited out the timeout in their join, and the live one was then killed as hung.)"""
    import ray

    import opd_harness.trainers.ray_executor as rx
    import opd_harness.trainers.weight_sync as ws

    probe = _SyncProbe(monkeypatch)
    tmp_path, (inprocess, _) = shared_out, inprocess_lag
    pids: dict[str, int] = {}
    killed: list[str] = []
    hung_kills: list[str] = []
    regroups: list[tuple[int, bool, float, float]] = []  # (generation, formed, started, ended)
    make, settle, regroup, original_kill = rx.RayRollout.make, rx.RayLearner.settle, ws.CollectiveSync.regroup, ray.kill
    lock = threading.Lock()

    def kill_maker_of_batch_3(self, unit):
        with lock:
            if unit.index == 3 and not killed:
                killed.append(self.name)
                os.kill(pids[self.name], signal.SIGKILL)
        return make(self, unit)

    def settle_probe(learner, refs, doing, abort=None):
        if doing == "joining the weight group" and learner.generation == 2 and len(killed) == 1:
            (other,) = set(pids) - set(killed)  # alive since the start: its join is sent and not answered yet
            killed.append(other)
            os.kill(pids[other], signal.SIGKILL)
        answers = settle(learner, refs, doing, **({"abort": abort} if abort is not None else {}))
        if doing == "joining the weight group" and not pids:  # the first group formed: every worker is idle now
            names = replica_names_of(learner)
            pids.update(zip(names, ray.get([actor.pid.remote() for actor in learner.rollouts]), strict=True))
        return answers

    def regroup_probe(sync, learner):
        started = time.monotonic()
        formed = regroup(sync, learner)
        regroups.append((learner.generation, formed, started, time.monotonic()))
        return formed

    def kill(actor, *, no_restart=True):
        if not no_restart:  # only a hang is killed for Ray to restart: here no worker hangs
            hung_kills.append(repr(actor))
        return original_kill(actor, no_restart=no_restart)

    def replica_names_of(learner):
        return rx.replica_names("rollout", len(learner.rollouts))

    monkeypatch.setattr(rx.RayRollout, "make", kill_maker_of_batch_3)
    monkeypatch.setattr(rx.RayLearner, "settle", settle_probe)
    monkeypatch.setattr(ws.CollectiveSync, "regroup", regroup_probe)
    monkeypatch.setattr(ray, "kill", kill)
    cluster = ["--executor", "ray", "--set", f"trainer.ray_address={ray_cluster.address}"]
    on_cluster, _, _ = run(tmp_path, *LAG, *COLLECTIVE, *TWO_ROLLOUTS, *cluster, "--set", f"trainer.actor_timeout_s={REGROUP_TIMEOUT_S}")
    print("regroups (generation, formed, seconds):", [(g, f, round(end - start, 1)) for g, f, start, end in regroups])
    assert len(killed) == 2, ("the kills never happened", killed, regroups)
    broken = [r for r in regroups if r[0] == 2]
    assert broken and not broken[0][1], regroups  # generation 2 lost a member while forming
    assert broken[0][3] - broken[0][2] < REGROUP_TIMEOUT_S, regroups  # given up at once (the lost one's restart included)
    assert hung_kills == [], hung_kills  # no live worker taken for hung
    assert any(formed and generation > 2 for generation, formed, _, _ in regroups), regroups
    assert_same_run(inprocess, on_cluster)
    run_id, _ = _last_train_run(tmp_path / "results.sqlite")
    assert _losses_per_step(tmp_path / "results.sqlite", run_id) == [(1, 1), (2, 1), (3, 1), (4, 1)]
    probe.assert_bit_for_bit()
    assert {name for name, _, _ in probe.loaded} == {"rollout.0", "rollout.1"}


@pytest.mark.slow
def test_a_hung_teacher_actor_is_killed_within_its_timeout_restarted_and_its_batch_scored_again(
    shared_out, ray_cluster, inprocess_lag, monkeypatch
):
    """The only teacher actor is stopped (SIGSTOP: alive, never answering) before it scores batch 3: the call exceeds
    trainer.actor_timeout_s, the driver kills it once (Ray restarts it), the batch is scored again by the restarted
    actor and every step is trained once with the in-process losses (fixed_lag)."""
    import ray

    import opd_harness.trainers.ray_executor as rx

    tmp_path, (inprocess, _) = shared_out, inprocess_lag
    stopped: list[float] = []
    kills: list[float] = []
    original_score, original_kill, lock = rx.TeacherActors.score, ray.kill, threading.Lock()

    def stop_once(self, batch, metrics, index):
        with lock:
            if index == 3 and not stopped:
                os.kill(ray.get(self.actors[0].pid.remote()), signal.SIGSTOP)
                stopped.append(time.monotonic())
        return original_score(self, batch, metrics, index)

    def kill(actor, *, no_restart=True):
        if not no_restart:  # a kill for Ray to restart (the run's end kills for good)
            kills.append(time.monotonic())
        return original_kill(actor, no_restart=no_restart)

    monkeypatch.setattr(rx.TeacherActors, "score", stop_once)
    monkeypatch.setattr(ray, "kill", kill)
    on_cluster, _, _ = run(tmp_path, *LAG, "--executor", "ray", "--set", f"trainer.ray_address={ray_cluster.address}",
                           "--set", f"trainer.actor_timeout_s={HANG_TIMEOUT_S}")  # fmt: skip
    assert stopped, "the teacher was never stopped"
    assert len(kills) == 1 and kills[0] - stopped[0] < HANG_TIMEOUT_S + 5, (stopped, kills)  # once, within the timeout
    assert_same_run(inprocess, on_cluster)
    run_id, _ = _last_train_run(tmp_path / "results.sqlite")
    assert _losses_per_step(tmp_path / "results.sqlite", run_id) == [(1, 1), (2, 1), (3, 1), (4, 1)]
