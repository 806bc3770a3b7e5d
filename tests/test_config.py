import pytest
from typer.testing import CliRunner

from opd_harness.cli import app
import yaml

from opd_harness.config import ConfigError, RunConfig, build_config, parse_override
from opd_harness.plan import plan_run
from opd_harness.registry import METHODS, TASKS
from opd_harness.task import Score, Task
from opd_harness.method import HParams, MethodSpec

runner = CliRunner()


def test_override_parsing():
    assert parse_override("trainer.lr=1e-5") == {"trainer": {"lr": 1e-5}}
    assert parse_override("eval.tasks=[arith]") == {"eval": {"tasks": ["arith"]}}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("trainer.lr")


def test_layers_merge_in_order(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("trainer: {lr: 0.5, steps: 7}\n")
    cfg = build_config(preset="smoke", config_file=cfg_file, overrides=["trainer.lr=0.25"])
    assert (cfg.trainer.lr, cfg.trainer.steps, cfg.trainer.checkpoint_every) == (0.25, 7, 2)


def test_unknown_key_names_key_and_allowed():
    with pytest.raises(ConfigError) as info:
        build_config(overrides=["trainer.lrr=1"])
    assert "trainer.lrr" in str(info.value) and "lr" in str(info.value) and "checkpoint_every" in str(info.value)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--set", "trainer.lrr=1"], "unknown key 'trainer.lrr'"),
        (["--set", "trainer.lr=-1"], "trainer.lr"),
        (["--set", "trainer.steps=many"], "trainer.steps"),
        (["--preset", "nope"], "available presets: smoke, cpu-demo, tool-demo"),
        (["--method", "opdd"], "Did you mean 'opd'"),
        (["--task", "arithh"], "Did you mean 'arith'"),
        (["--set", "method_args.opd.estimator=exact"], "method_args.opd.estimator"),
        (["--set", "method_args.opd.bogus=1"], "unknown key 'method_args.opd.bogus'; allowed here: aggregation, estimator, kl_coef"),
        (["--set", "method_args.opdd.kl_coef=1"], "method_args.opdd: unknown methods 'opdd'. Did you mean 'opd'?"),
        (["--set", "task_args.arith.num_ops=0"], "task_args.arith.num_ops"),
        (["--set", "task_args.math500.k=1"], "task_args has options for ['math500']"),
        (["--set", "student.path=x", "--set", "student.arch.hidden=64"], "exactly one of 'path'"),
        (["--mode", "turbo"], "trainer.mode"),
        (["--set", "trainer.behaviour_logprobs=vllm"], "trainer.behaviour_logprobs"),
        (["--method", "grpo", "--set", "method_args.grpo.dual_clip=0.5"], "method_args.grpo.dual_clip"),
        (["--config", "/nonexistent.yaml"], "no such file"),
    ],
)
def test_cli_config_errors_exit_2_with_a_clear_message(tmp_path, args, expected):
    result = runner.invoke(app, ["run", "--out", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())


def test_bad_method_task_combination_fails_at_validation():
    class NoReward(Task):
        description = "test task without a reward"
        provides_reward = False

        def read_problems(self, split, data_dir):
            raise AssertionError("must not be loaded during validation")

        def grade_many(self, problems, completions):
            return [Score("fail") for _ in completions]

        @property
        def grader(self):
            return ("none", "0")

    TASKS.add("_no_reward_task", NoReward)
    METHODS.add(
        "_needs_reward",
        MethodSpec("test", objective=lambda *a: None, hparams=HParams, needs=lambda hp: frozenset({"rewards"})),
    )
    cfg = build_config(cli={"method": "_needs_reward", "task": "_no_reward_task"}, overrides=["eval.tasks=[arith]"])
    with pytest.raises(ConfigError, match=r"needs \['rewards'\].*_no_reward_task"):
        plan_run(cfg)


def test_valid_plan():
    plan = plan_run(build_config(preset="smoke"))
    assert plan.method.name == "opd" and plan.hparams.estimator == "full"
    assert plan.task.options.n_test == 16 and [t.name for t in plan.eval_tasks] == ["arith"]


def test_f_opd_in_sync_mode_is_allowed_with_a_warning():
    plan = plan_run(build_config(preset="smoke", cli={"method": "f_opd", "trainer": {"mode": "sync"}}))
    assert plan.config.trainer.mode == "sync" and any("always 0 in sync mode" in w for w in plan.warnings)
    assert plan_run(build_config(preset="smoke")).warnings == []


@pytest.mark.parametrize("method, mode", [("f_opd", "async"), ("opd_async", "async"), ("opd_hard_refresh", "async"), ("opd", "sync")])
def test_a_method_runs_in_its_default_mode_unless_a_layer_sets_one(tmp_path, method, mode):
    """f-OPD and its async baselines declare async (``MethodSpec.default_mode``); a preset, config file, --set or --mode wins."""
    assert build_config(preset="smoke", cli={"method": method}).trainer.mode == mode
    assert build_config(overrides=[f"method={method}"]).trainer.mode == mode
    assert build_config(overrides=[f"method={method}", "trainer.mode=sync"]).trainer.mode == "sync"
    (tmp_path / "c.yaml").write_text("trainer: {mode: sync}\n")
    assert build_config(config_file=tmp_path / "c.yaml", cli={"method": method}).trainer.mode == "sync"


def test_evaluation_follows_the_training_task():
    assert build_config(cli={"task": "arith_tool"}).eval.tasks == ["arith_tool"]
    assert build_config(cli={"task": "arith_tool"}, overrides=["eval.tasks=[arith]"]).eval.tasks == ["arith_tool", "arith"]
    assert RunConfig(task="arith_tool").eval.tasks == ["arith_tool"]


def test_a_training_only_task_is_evaluated_on_the_eval_tasks_alone():
    """dapo_math has only a train split: a run training on it evaluates what eval.tasks names (it would otherwise ask for
    dapo_math's test split and exit 2), and plans with the training problems from its train split."""
    assert TASKS.get("dapo_math").splits == ("train",)
    cfg = build_config(cli={"task": "dapo_math"}, overrides=["eval.tasks=[math500]"])
    assert cfg.eval.tasks == ["math500"]
    plan = plan_run(cfg)
    assert plan.task.training_split() == "train" and [t.name for t in plan.eval_tasks] == ["math500"]
    with pytest.raises(ConfigError, match=r"eval.tasks: dapo_math has no test split to evaluate \(its splits: train\); name the tasks"):
        plan_run(build_config(cli={"task": "dapo_math"}))  # evaluation defaults to the training task, which has none


def test_f_opd_on_swebench_prints_async_and_evaluates_swebench_but_does_not_run_without_models(tmp_path):
    printed = runner.invoke(app, ["run", "--method", "f_opd", "--task", "swebench", "--print-config"])
    assert printed.exit_code == 0, printed.output
    resolved = yaml.safe_load(printed.stdout)
    assert resolved["trainer"]["mode"] == "async" and resolved["eval"]["tasks"] == ["swebench"]
    refused = runner.invoke(app, ["run", "--method", "f_opd", "--task", "swebench", "--out", str(tmp_path / "out")])
    assert refused.exit_code == 2 and "--student MODEL --teacher MODEL" in refused.output and "--preset smoke" in refused.output
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_options_of_a_method_the_run_does_not_select_are_refused():
    with pytest.raises(ConfigError, match="method_args.grpo: options of method 'grpo', which this run does not select"):
        plan_run(build_config(overrides=["method=opd", "method_args.grpo.clip_low=0.3"]))
    cfg = build_config(preset="smoke", cli={"method": "f_opd"})  # the preset's opd options give way
    assert set(cfg.method_args) == set() and plan_run(cfg).method.name == "f_opd"


def test_a_preset_on_another_task_evaluates_that_task():
    from opd_harness.config import build_config

    cfg = build_config(preset="smoke", cli={"task": "arith_tool", "method": "opd"})
    assert cfg.task == "arith_tool" and cfg.eval.tasks == ["arith_tool"] and "arith" not in cfg.task_args
    cfg = build_config(preset="smoke", overrides=["task=arith_tool", "eval.tasks=[arith,arith_tool]", "task_args.arith.n_test=8"])
    assert cfg.eval.tasks == ["arith", "arith_tool"] and cfg.task_args["arith"]["n_test"] == 8  # what the user sets stays
    assert build_config(preset="smoke").task_args["arith"]["n_test"] == 16


def test_a_preset_on_another_task_fits_its_models_to_that_task():
    """The smoke preset's warm-ups need reference solutions and its tiny models hold 512 positions: on swebench (no
    references, episodes of up to max_context_tokens) the preset's warm-ups go and the positions grow."""
    from opd_harness.config import build_config
    from opd_harness.plan import plan_run

    smoke = build_config(preset="smoke")
    cfg = build_config(preset="smoke", cli={"task": "swebench", "method": "f_opd"})
    assert (cfg.student.sft_steps, cfg.teacher.sft_steps) == (0, 0)
    assert cfg.student.arch.max_positions == cfg.teacher.arch.max_positions == 32768
    assert cfg.student.arch.hidden == smoke.student.arch.hidden and cfg.teacher.arch.hidden == smoke.teacher.arch.hidden
    plan_run(cfg)  # plans: nothing in it needs reference solutions
    cfg = build_config(
        preset="smoke", overrides=["task=swebench", "task_args.swebench.max_context_tokens=8192", "student.arch.max_positions=9000"]
    )
    assert (cfg.student.arch.max_positions, cfg.teacher.arch.max_positions) == (9000, 8192)  # what the user sets wins
    tool = build_config(preset="smoke", cli={"task": "arith_tool"})  # references and a budget below 512: unchanged
    assert (tool.student.sft_steps, tool.student.arch.max_positions) == (smoke.student.sft_steps, smoke.student.arch.max_positions)


def test_without_a_preset_the_default_models_fit_the_task_and_only_what_the_user_sets_is_refused():
    """README's headline, ``harness run --method f_opd --task swebench`` with no preset: the default config's warm-ups
    (student 300, teacher 800 steps) need reference solutions swebench lacks, so they go, as a preset's do; a warm-up
    the user sets is still refused, naming that key."""
    from opd_harness.config import RunConfig, build_config
    from opd_harness.plan import plan_run

    cfg = build_config(cli={"task": "swebench", "method": "f_opd"})
    assert (cfg.student.sft_steps, cfg.teacher.sft_steps) == (0, 0)
    assert cfg.student.arch.max_positions == cfg.teacher.arch.max_positions == 32768
    plan_run(cfg)
    assert build_config().model_dump() == RunConfig().model_dump()  # arith has references: the defaults as they are
    cfg = build_config(overrides=["student.sft_steps=50"], cli={"task": "swebench"})  # the default arch, the user's warm-up
    assert (cfg.student.arch.hidden, cfg.student.sft_steps, cfg.teacher.sft_steps) == (128, 50, 0)
    with pytest.raises(ConfigError, match=r"^student.sft_steps=50 trains on reference solutions"):
        plan_run(cfg)
    cfg = build_config(overrides=["student.path=/some/model"], cli={"task": "swebench"})  # the user's own model, nothing added
    assert (cfg.student.path, cfg.student.arch, cfg.student.sft_steps) == ("/some/model", None, 0)


def test_print_config_shows_every_default_round_trips_and_writes_nothing(tmp_path):
    import yaml

    out = tmp_path / "out"
    args = ["run", "--preset", "smoke", "--set", "trainer.lr=0.002", "--out", str(out), "--print-config"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.stdout)
    expected = build_config(preset="smoke", overrides=["trainer.lr=0.002"]).model_dump(mode="json")
    expected["teacher"]["signal"] = "full"  # planning resolves teacher.signal=auto to the kind the run will use
    assert {k: v for k, v in printed.items() if k != "method_args"} == {k: v for k, v in expected.items() if k != "method_args"}
    assert printed["method_args"]["opd"] == plan_run(build_config(preset="smoke")).hparams.model_dump(mode="json")  # defaults resolved
    assert not out.exists()
    (tmp_path / "printed.yaml").write_text(result.stdout)
    again = runner.invoke(app, ["run", "--config", str(tmp_path / "printed.yaml"), "--out", str(out), "--print-config"])
    assert again.exit_code == 0 and again.stdout == result.stdout, again.output
    bad = runner.invoke(app, ["run", "--preset", "smoke", "--set", "trainer.lr=-1", "--out", str(out), "--print-config"])
    assert bad.exit_code == 2 and "trainer.lr" in bad.output and not out.exists(), bad.output
