"""A plug-in package adds a task, a method and a sandbox provider through entry points alone: the real CLI
lists them, trains and evaluates with them, and ``open_sandbox`` finds the provider (subprocesses, so the
fake installed distribution never leaks into this process's registries)."""

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
HARNESS = [sys.executable, "-m", "opd_harness.cli"]

PLUGIN_MODULE = '''
"""A third-party plug-in: nothing here is imported or named by the harness."""
import torch

from opd_harness.sandbox.local import LocalSandbox
from opd_harness.tasks.synthetic.arith import ArithTask
from opd_harness.method import HParams, MethodSpec
from opd_harness.trainers.objectives import masked_mean


class PluginArith(ArithTask):
    description = "arith, served by a plug-in package"


class PluginParams(HParams):
    scale: float = 1.0


def plugin_objective(batch, student, hp, state=None):
    """Sampled-token reverse-KL surrogate sg(s - T)*s, token mean."""
    coef = (student.logprobs.detach() - batch.teacher_logprobs) * hp.scale
    loss = masked_mean(coef * student.logprobs, batch.loss_mask)
    teacher_kl = masked_mean(batch.behaviour_logprobs - batch.teacher_logprobs, batch.loss_mask)
    return loss, {"teacher_kl": float(teacher_kl), "plugin_scale": hp.scale}


PLUGIN_OPD = MethodSpec(
    description="a plug-in method",
    objective=plugin_objective,
    hparams=PluginParams,
    needs=lambda hp: frozenset({"teacher_logprobs", "behaviour_logprobs"}),
)


class PluginSandbox(LocalSandbox):
    """The local provider under another name."""
'''

ENTRY_POINTS = """
[opd_harness.tasks]
plugin_arith = opd_test_plugin:PluginArith

[opd_harness.methods]
plugin_opd = opd_test_plugin:PLUGIN_OPD

[opd_harness.sandboxes]
plugin_local = opd_test_plugin:PluginSandbox
"""


@pytest.fixture
def plugin_env(tmp_path) -> dict[str, str]:
    """Environment whose sys.path holds a fake installed distribution ``opd-test-plugin`` and its module."""
    site = tmp_path / "site"
    dist = site / "opd_test_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: opd-test-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(ENTRY_POINTS))
    (site / "opd_test_plugin.py").write_text(PLUGIN_MODULE)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}


def harness(env: dict[str, str], *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    result = subprocess.run([*HARNESS, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, f"harness {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


def test_cli_lists_plugin_task_and_method_beside_the_builtins(plugin_env):
    tasks = {t["name"]: t for t in json.loads(harness(plugin_env, "tasks", "--json").stdout)}
    methods = {m["name"]: m for m in json.loads(harness(plugin_env, "methods", "--json").stdout)}
    assert tasks["plugin_arith"]["description"] == "arith, served by a plug-in package" and "arith" in tasks
    assert methods["plugin_opd"]["defaults"] == {"scale": 1.0} and "opd" in methods


def test_open_sandbox_finds_a_plugin_provider(plugin_env):
    code = ("from opd_harness import sandbox; import opd_test_plugin as p; sb = sandbox.open_sandbox('plugin_local'); "
            "print(type(sb) is p.PluginSandbox); sb.close()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=plugin_env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
    typo = "from opd_harness import sandbox; sandbox.open_sandbox('plugin_locl')"
    unknown = subprocess.run([sys.executable, "-c", typo], capture_output=True, text=True, timeout=300, env=plugin_env, cwd=ROOT)
    assert "valid: docker, local, plugin_local" in unknown.stderr


@pytest.mark.slow
def test_run_and_eval_with_plugin_task_and_method(plugin_env, tmp_path):
    out = tmp_path / "out"
    smoke = yaml.safe_load((ROOT / "harness" / "presets" / "smoke.yaml").read_text())  # the smoke preset, retargeted
    config = {
        **smoke,
        "method": "plugin_opd",
        "task": "plugin_arith",
        "method_args": {"plugin_opd": {"scale": 0.5}},
        "task_args": {"plugin_arith": smoke["task_args"]["arith"]},
        "trainer": {**smoke["trainer"], "steps": 2, "checkpoint_every": 2},
        "eval": {**smoke["eval"], "tasks": ["plugin_arith"], "limit": 4, "teacher": False},
    }
    (tmp_path / "plugin.yaml").write_text(yaml.safe_dump(config))
    harness(plugin_env, "run", "--config", str(tmp_path / "plugin.yaml"), "--out", str(out), timeout=1500)
    with sqlite3.connect(out / "results.sqlite") as db:
        (run_id, method, task, status), = db.execute("SELECT run_id, method, task, status FROM runs WHERE kind = 'train'").fetchall()
        scales = db.execute("SELECT DISTINCT value FROM step_metrics WHERE run_id = ? AND name = 'plugin_scale'", (run_id,)).fetchall()
        evaluated = {row[0] for row in db.execute("SELECT task FROM evals WHERE run_id = ?", (run_id,))}
    assert (method, task, status) == ("plugin_opd", "plugin_arith", "done")
    assert scales == [(0.5,)]  # the plug-in's objective ran, with the run's hyper-parameter
    assert evaluated == {"plugin_arith"}
    checkpoint = sorted((out / "runs" / run_id / "checkpoints").iterdir())[-1]
    eval_result = harness(
        plugin_env, "eval", "--model", str(checkpoint), "--task", "plugin_arith", "--limit", "2", "--k", "1", "--out", str(out), "--json"
    )
    summary = json.loads(eval_result.stdout)
    assert summary["tasks"]["plugin_arith"]["n_samples"] == 2
