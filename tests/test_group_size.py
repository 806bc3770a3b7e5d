"""Group-baseline methods (GRPO family) get their papers' samples per prompt and refuse 1 unless allowed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.config import ConfigError, build_config
from opd_harness.plan import plan_run
from opd_harness.registry import METHODS
from opd_harness.store import Store
from opd_harness.runs import create_train_run

GROUP_METHODS = {"grpo": 8, "sod": 16, "saf_opd": 8}  # docs/methods/sod.md (SOD 16), saf-opd.md (SAF-OPD and its GRPO config: 8)


def plan(*overrides: str, preset: str | None = None):
    return plan_run(build_config(preset=preset, overrides=list(overrides)))


def test_group_baseline_methods_are_exactly_the_grpo_family():
    declared = {name for name in METHODS.names() if METHODS.get(name).group_size is not None}
    assert declared == set(GROUP_METHODS)
    for name, size in GROUP_METHODS.items():
        spec = METHODS.get(name)
        assert spec.group_size == size and spec.group_baseline(spec.hparams()) and spec.describe()["samples_per_prompt"] == size


@pytest.mark.parametrize("method", sorted(GROUP_METHODS))
def test_one_sample_per_prompt_is_refused_naming_the_key_and_the_method(method):
    with pytest.raises(ConfigError, match=rf"trainer\.samples_per_prompt=1: method '{method}'.*allow_single_sample"):
        plan(f"method={method}", "trainer.samples_per_prompt=1")


@pytest.mark.parametrize("method", sorted(GROUP_METHODS))
def test_one_sample_per_prompt_is_allowed_when_asked(method):
    p = plan(f"method={method}", "trainer.samples_per_prompt=1", f"method_args.{method}.allow_single_sample=true")
    assert p.config.trainer.samples_per_prompt == 1 and p.hparams.allow_single_sample


@pytest.mark.parametrize("method", ["sod", "saf_opd"])
def test_without_the_grpo_term_there_is_no_baseline_to_refuse(method):
    p = plan(f"method={method}", "trainer.samples_per_prompt=1", f"method_args.{method}.grpo_coef=0")
    assert p.config.trainer.samples_per_prompt == 1


@pytest.mark.parametrize("method", sorted(GROUP_METHODS))
def test_default_group_size_applies_only_when_no_layer_sets_it(method):
    assert plan(f"method={method}").config.trainer.samples_per_prompt == GROUP_METHODS[method]
    assert plan(f"method={method}", "trainer.samples_per_prompt=3").config.trainer.samples_per_prompt == 3
    assert plan(f"method={method}", preset="smoke").config.trainer.samples_per_prompt == 2  # the preset's value
    assert plan(f"method={method}", "trainer.lr=1e-4").config.trainer.samples_per_prompt == GROUP_METHODS[method]  # other trainer keys set


def test_methods_without_a_group_keep_one_sample_per_prompt():
    assert plan("method=opd").config.trainer.samples_per_prompt == 1


def test_applied_default_is_recorded_in_the_run_config(tmp_path):
    p = plan("method=sod", "task=arith")
    with Store(tmp_path) as store:
        run_id = create_train_run(store, p.config, p)
        stored = store.get_run(run_id)["config"]
        written = json.loads((store.run_dir(run_id) / "config.json").read_text())
    assert stored["trainer"]["samples_per_prompt"] == written["trainer"]["samples_per_prompt"] == 16


def test_cli_exits_2_before_creating_a_run(tmp_path):
    args = ["run", "--method", "grpo", "--preset", "smoke", "--set", "trainer.samples_per_prompt=1", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "trainer.samples_per_prompt" in result.output and "'grpo'" in result.output
    with Store(tmp_path) as store:
        assert store.runs() == []
