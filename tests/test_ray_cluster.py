"""trainer.layout on a two-node Ray cluster: roles placed by placement groups on the nodes their custom resources name,
the same losses as in process, and layouts the cluster cannot hold refused (exit 2, naming the key) before anything is written."""

import json
import sqlite3

import pytest
from typer.testing import CliRunner

from harness.cli import app
from harness.config import ConfigError, build_config
from test_ray_executor import BASE, assert_same_run, run

runner = CliRunner()
LAG = ["--method", "f_opd", "--mode", "async", "--set", "trainer.fixed_lag=1", "--set", "trainer.warmup_steps=3"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.layout.rollout.replicas=0", "trainer.layout.rollout.replicas"),
        ("trainer.layout.critic.num_cpus=1", "trainer.layout.critic"),
        ("trainer.layout.learner.replicas=1000", "trainer.layout.learner.replicas=1000: more learner ranks than samples"),
        ("trainer.layout.teacher.replicas=3", "trainer.layout.teacher.replicas=3"),
        ("trainer.layout.rollout.strategy=scatter", "trainer.layout.rollout.strategy"),
        ("trainer.layout.learner.num_cpus=0", "trainer.layout.learner"),
    ],
)
def test_bad_layouts_are_refused_at_config_time(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config(overrides=["trainer.executor=ray", override])
    result = runner.invoke(app, [*BASE, "--out", str(tmp_path), "--executor", "ray", "--set", override])
    assert result.exit_code == 2 and key in " ".join(result.output.split()), result.output
    assert not (tmp_path / "results.sqlite").exists()


def test_layout_needs_ray_and_eval_is_recorded_only():
    with pytest.raises(ConfigError, match="trainer.layout places the roles on a Ray cluster"):
        build_config(overrides=["trainer.layout.learner.num_cpus=1"])
    layout = build_config(overrides=["trainer.executor=ray", "trainer.layout.eval.replicas=4"]).trainer.layout
    assert layout.eval.replicas == 4 and layout.learner.replicas == 1
    assert build_config(overrides=["trainer.executor=ray"]).trainer.layout is None  # no layout: today's actors, no placement groups


def test_shortfall_names_the_role_key_and_resource():
    from trainers.ray_executor import layout_shortfall

    nodes = [{"Alive": True, "Resources": {"CPU": 2.0, "node_a": 1.0}}, {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}},
             {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}]  # fmt: skip
    layout = lambda *o: build_config(overrides=["trainer.executor=ray", *o]).trainer.layout  # noqa: E731
    assert layout_shortfall(layout("trainer.layout.rollout.resources={node_a: 1}"), nodes) is None
    assert "trainer.layout.learner.num_gpus" in layout_shortfall(layout("trainer.layout.learner.num_gpus=2"), nodes)
    assert "trainer.layout.teacher.num_cpus" in layout_shortfall(layout("trainer.layout.teacher.num_cpus=3"), nodes)
    assert "trainer.layout.rollout.resources.node_b" in layout_shortfall(layout("trainer.layout.rollout.resources={node_b: 1}"), nodes)
    both = layout("trainer.layout.rollout.num_gpus=1", "trainer.layout.rollout.resources={node_a: 1}")  # each exists, not on one node
    assert "trainer.layout.rollout: no single node" in layout_shortfall(both, nodes)


def _last_train_run(db) -> tuple[str, dict]:
    with sqlite3.connect(db) as conn:
        run_id, config = conn.execute("SELECT run_id, config_json FROM runs WHERE kind='train' ORDER BY created_at DESC").fetchone()
    return run_id, json.loads(config)


@pytest.mark.slow
def test_layout_places_roles_on_the_nodes_it_names_with_inprocess_losses(tmp_path, ray_cluster):
    inprocess, _, inprocess_evals = run(tmp_path, *LAG)
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
        (["trainer.layout.learner.num_gpus=1"], "trainer.layout.learner.num_gpus"),
        (["trainer.layout.teacher.resources={node_c: 1}"], "trainer.layout.teacher.resources.node_c"),
        (["trainer.layout.rollout.num_cpus=2", "trainer.layout.rollout.resources={node_a: 1}",
          "trainer.layout.teacher.num_cpus=2", "trainer.layout.teacher.resources={node_a: 1}"], "trainer.layout.teacher"),
    ],
)  # fmt: skip
def test_layouts_the_cluster_cannot_hold_exit_2_before_anything_is_written(tmp_path, ray_cluster, monkeypatch, override, key):
    import trainers.ray_executor as rx

    monkeypatch.setattr(rx, "PLACEMENT_TIMEOUT_S", 3.0)  # the last case fits per node but not together: its wait times out
    sets = [arg for item in override for arg in ("--set", item)]
    result = runner.invoke(app, [*BASE, "--out", str(tmp_path), "--executor", "ray", "--set", f"trainer.ray_address={ray_cluster.address}",
                                 *sets])  # fmt: skip
    assert result.exit_code == 2 and key in " ".join(result.output.split()), result.output
    assert not (tmp_path / "results.sqlite").exists()
    import ray

    assert not ray.is_initialized()
