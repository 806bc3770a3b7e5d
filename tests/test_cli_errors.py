"""Bad input fails cleanly: exit code 2, a message naming the file:line:field, the flag or the key, and nothing
half-made (no run row left ``running``, no output folder for a refused ``harness run``); JSON output is strict
JSON; a run is executed by one process at a time; task-required inputs are checked when a run is planned."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.config import ConfigError, build_config
from opd_harness.plan import plan_run
from opd_harness.registry import TASKS
from opd_harness.tasks.synthetic.arith import ArithOptions, ArithTask

runner = CliRunner()
GOOD_ROW = {"problem": "What is 1+1?", "answer": "2", "unique_id": "test/a/1.json", "solution": "1+1=\\boxed{2}"}


def flat(text: str) -> str:
    """Rich wraps long messages; compare on single-spaced text."""
    return " ".join(text.split())


def strict_loads(text: str):
    """json.loads that rejects NaN / Infinity, as every non-Python JSON parser does."""

    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def run_rows(out: Path) -> list[tuple[str, str]]:
    """(run_id, status) of every run in ``out``'s store; [] when there is no store."""
    db = out / "results.sqlite"
    if not db.exists():
        return []
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT run_id, status FROM runs").fetchall()


def replay_file(tmp_path: Path, task: str, ids_and_completions: list[tuple[str, str]]) -> Path:
    path = tmp_path / "outputs.jsonl"
    path.write_text("".join(json.dumps({"task": task, "id": i, "completion": c}) + "\n" for i, c in ids_and_completions))
    return path


def math500_data(root: Path, rows: list) -> Path:
    """A data folder holding math500/test.jsonl with ``rows`` (dicts are JSON-encoded, strings written as they are)."""
    folder = root / "math500"
    folder.mkdir(parents=True)
    (folder / "test.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return root


# --------------------------------------------------------------------------- item 7: harness eval


@pytest.mark.parametrize(
    "task, problem, missing", [("math500", "test/a/1.json", "math500/test.jsonl"), ("humaneval_plus", "HumanEval/0", "humaneval_plus")]
)
def test_eval_missing_data_folder_exits_2_naming_the_path_and_how_to_get_it(tmp_path, task, problem, missing):
    model = replay_file(tmp_path, task, [(problem, "\\boxed{2}")])
    empty, out = tmp_path / "data", tmp_path / "out"
    empty.mkdir()
    result = runner.invoke(
        app, ["eval", "--backend", "replay", "--model", str(model), "--task", task, "--data-dir", str(empty), "--out", str(out)]
    )
    assert result.exit_code == 2, result.output
    message = flat(result.output)
    assert str(empty / missing) in message and "--data-dir" in message and f"harness data fetch {task}" in message
    assert "Traceback" not in result.output and run_rows(out) == [] and not out.exists()


def test_eval_data_dir_that_does_not_exist_is_named(tmp_path):
    model = replay_file(tmp_path, "math500", [("test/a/1.json", "\\boxed{2}")])
    result = runner.invoke(
        app,
        [
            "eval",
            "--backend",
            "replay",
            "--model",
            str(model),
            "--task",
            "math500",
            "--data-dir",
            str(tmp_path / "nope"),
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 2 and f"--data-dir {tmp_path / 'nope'}: no such directory" in flat(result.output)
    assert not (tmp_path / "out").exists()


def test_eval_lm_eval_task_with_a_missing_data_file_exits_2_naming_it(tmp_path):
    pytest.importorskip("lm_eval")
    include = tmp_path / "lm_eval_tasks"
    include.mkdir()
    missing = tmp_path / "gone.jsonl"
    template = (Path(__file__).parent / "data" / "lm_eval" / "arith_gen.yaml.tmpl").read_text()
    (include / "arith_gen.yaml").write_text(template.format(data_file=missing))
    model = replay_file(tmp_path, "lm_eval:arith_gen", [("0", "5")])
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "eval",
            "--backend",
            "replay",
            "--model",
            str(model),
            "--task",
            "lm_eval:arith_gen",
            "--task-arg",
            f"lm_eval:arith_gen.include_path={include}",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 2, result.output
    assert "could not build it or load its data" in flat(result.output) and run_rows(out) == []


def test_eval_malformed_row_exits_2_with_file_line_field_and_no_run(tmp_path):
    data = math500_data(
        tmp_path / "data", [GOOD_ROW, {k: v for k, v in GOOD_ROW.items() if k != "answer"} | {"unique_id": "test/a/2.json"}]
    )
    model = replay_file(tmp_path, "math500", [("test/a/1.json", "\\boxed{2}")])
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["eval", "--backend", "replay", "--model", str(model), "--task", "math500", "--data-dir", str(data), "--out", str(out)]
    )
    assert result.exit_code == 2, result.output
    assert f"{data / 'math500' / 'test.jsonl'}:2: field 'answer': missing" in flat(result.output)
    assert run_rows(out) == []


def test_eval_failure_after_the_run_row_exists_marks_it_failed(tmp_path, monkeypatch):
    import opd_harness.evaluation

    def broken(*args, **kwargs):
        raise RuntimeError("grader infrastructure down")

    monkeypatch.setattr(opd_harness.evaluation, "evaluate_task", broken)
    problem = ArithTask(ArithOptions()).load("test")[0]
    model = replay_file(tmp_path, "arith", [(problem.id, f"\\boxed{{{problem.answer}}}")])
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["eval", "--backend", "replay", "--model", str(model), "--task", "arith", "--k", "1", "--limit", "1", "--out", str(out)]
    )
    assert result.exit_code != 0 and isinstance(result.exception, RuntimeError)
    assert [status for _, status in run_rows(out)] == ["failed"]


# --------------------------------------------------------------------------- item 7: harness run


def test_run_with_missing_training_data_exits_2_and_creates_nothing(tmp_path):
    empty, out = tmp_path / "data", tmp_path / "out"
    empty.mkdir()
    args = [
        "run",
        "--preset",
        "smoke",
        "--task",
        "math500",
        "--set",
        "eval.tasks=[math500]",
        "--set",
        f"task_args.math500.data_dir={empty}",
        "--set",
        "task_args.math500.source=local",
        "--out",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert str(empty / "math500" / "test.jsonl") in flat(result.output) and "task_args.math500.data_dir" in flat(result.output)
    assert not out.exists()


def test_run_with_a_malformed_row_exits_2_naming_it_and_creates_nothing(tmp_path):
    data = math500_data(tmp_path / "data", [GOOD_ROW, "{not json"])
    out = tmp_path / "out"
    args = ["run", "--preset", "smoke", "--task", "math500", "--set", "eval.tasks=[math500]", "--set", f"task_args.math500.data_dir={data}",
            "--out", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert f"{data / 'math500' / 'test.jsonl'}:2: field '<line>': not valid JSON" in flat(result.output)
    assert not out.exists()


def test_run_with_missing_eval_data_exits_2_and_creates_nothing(tmp_path, monkeypatch):
    empty, out = tmp_path / "data", tmp_path / "out"
    empty.mkdir()
    monkeypatch.setenv("HARNESS_DATA_DIR", str(empty))
    args = ["run", "--preset", "smoke", "--set", "eval.tasks=[arith,aime25]", "--set", "task_args.aime25.source=local", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert str(empty / "aime25" / "test.jsonl") in flat(result.output)
    assert not out.exists()


def test_run_reads_data_from_data_dir_and_refuses_a_missing_one(tmp_path, monkeypatch):
    empty, out = tmp_path / "data", tmp_path / "out"
    empty.mkdir()
    monkeypatch.setenv("HARNESS_DATA_DIR", str(tmp_path / "elsewhere"))  # --data-dir wins (and is restored after the test)
    args = ["run", "--preset", "smoke", "--set", "eval.tasks=[arith,aime25]", "--set", "task_args.aime25.source=local", "--out", str(out)]
    result = runner.invoke(app, [*args, "--data-dir", str(empty)])
    assert result.exit_code == 2 and str(empty / "aime25" / "test.jsonl") in flat(result.output), result.output
    result = runner.invoke(app, [*args, "--data-dir", str(tmp_path / "missing")])
    assert result.exit_code == 2 and f"--data-dir {tmp_path / 'missing'}: no such directory" in flat(result.output)
    assert not out.exists()


@pytest.mark.parametrize("command", ["eval", "run"])
def test_data_dir_is_handed_to_the_tasks_not_put_in_the_environment(tmp_path, monkeypatch, command):
    """``--data-dir X`` is the data root the tasks read (ahead of a different ``$HARNESS_DATA_DIR``), and the
    process environment is left as it was."""
    given, elsewhere = tmp_path / "given", tmp_path / "elsewhere"
    (given / "math500").mkdir(parents=True)
    (given / "math500" / "test.jsonl").write_text("{not json\n")
    (elsewhere / "math500").mkdir(parents=True)
    (elsewhere / "math500" / "test.jsonl").write_text(json.dumps(GOOD_ROW) + "\n")
    monkeypatch.setenv("HARNESS_DATA_DIR", str(elsewhere))
    if command == "eval":
        args = ["eval", "--model", str(tmp_path / "no-model"), "--task", "math500", "--task-arg", "math500.source=local"]
    else:
        args = ["run", "--preset", "smoke", "--task", "math500", "--set", "task_args.math500.source=local"]
    result = runner.invoke(app, [*args, "--data-dir", str(given), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert f"{given / 'math500' / 'test.jsonl'}:1: field '<line>': not valid JSON" in flat(result.output)
    assert os.environ["HARNESS_DATA_DIR"] == str(elsewhere)


def test_run_config_error_and_resume_without_a_store_create_nothing(tmp_path):
    out = tmp_path / "out"
    assert runner.invoke(app, ["run", "--set", "trainer.lrr=1", "--out", str(out)]).exit_code == 2
    result = runner.invoke(app, ["run", "--resume", "opd-arith-x", "--out", str(out)])
    assert result.exit_code == 2 and "no results store" in flat(result.output)
    assert not out.exists()


def test_plan_data_is_loaded_once_onto_the_plan():
    from opd_harness.plan import load_plan_data

    plan = load_plan_data(plan_run(build_config(preset="smoke")))
    assert len(plan.train_problems) == 2000 and plan.train_problems[0].id == "train-0"
    assert list(plan.eval_problems) == ["arith"] and [p.id for p in plan.eval_problems["arith"]] == [f"test-{i}" for i in range(8)]


# --------------------------------------------------------------------------- item 9: strict JSON


def test_eval_json_with_every_sample_errored_is_strict_json(tmp_path):
    problem = ArithTask(ArithOptions()).load("test")[0]
    model = replay_file(tmp_path, "arith", [(problem.id, "\\boxed{9^{9^{9}}}")])  # math-verify blows up: an error
    out = tmp_path / "out"
    args = [
        "eval",
        "--backend",
        "replay",
        "--model",
        str(model),
        "--task",
        "arith",
        "--k",
        "1",
        "--limit",
        "1",
        "--out",
        str(out),
        "--json",
        "--max-error-rate",
        "1",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = strict_loads(result.stdout)["tasks"]["arith"]
    assert summary["n_errors"] == 1 and summary["avg_at_k"] is None
    board = runner.invoke(app, ["leaderboard", str(out), "--format", "json"])
    assert board.exit_code == 0 and strict_loads(board.stdout)[0]["avg_at_k"] is None
    assert runner.invoke(app, ["leaderboard", str(out), "--json"]).stdout == board.stdout  # --json: one meaning in every command
    both = runner.invoke(app, ["leaderboard", str(out), "--json", "--format", "csv"])
    assert both.exit_code == 2 and "--json and --format csv" in both.output


def test_leaderboard_and_report_json_renderers_write_null_for_non_finite_values():
    from opd_harness.leaderboard import render_json as leaderboard_json
    from opd_harness.report import render_json as report_json

    rows = [{"run_id": "r", "avg_at_k": float("nan"), "ci_low": np.float64("nan"), "ci_high": float("inf"), "n": 3}]
    assert strict_loads(leaderboard_json(rows)) == [{"run_id": "r", "avg_at_k": None, "ci_low": None, "ci_high": None, "n": 3}]
    report = {"rows": [{"final": np.float32("nan"), "peak": 0.5, "drop": [float("-inf"), 1.0]}], "curve": (float("nan"), 2)}
    assert strict_loads(report_json(report)) == {"rows": [{"final": None, "peak": 0.5, "drop": [None, 1.0]}], "curve": [None, 2]}


# --------------------------------------------------------------------------- item 10: one process per run


def _stored_run(out: Path) -> str:
    """A stored smoke training run (no training), status 'interrupted'."""
    from opd_harness.store import Store
    from opd_harness.runs import create_train_run

    plan = plan_run(build_config(preset="smoke"))
    with Store(out) as store:
        run_id = create_train_run(store, plan.config, plan)
        store.set_status(run_id, "interrupted")
    return run_id


HOLDER = textwrap.dedent(
    """
    import fcntl, sys, time
    handle = open(sys.argv[1], "a+")
    fcntl.flock(handle, fcntl.LOCK_EX)
    handle.write("pid holder-process\\n"); handle.flush()
    print("locked", flush=True)
    time.sleep(120)
    """
)


def test_a_second_process_resuming_a_run_in_progress_is_refused(tmp_path):
    out = tmp_path / "out"
    run_id = _stored_run(out)
    lock = out / "runs" / run_id / "run.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = runner.invoke(app, ["run", "--resume", run_id, "--out", str(out)])
        assert result.exit_code == 2, result.output
        assert f"run {run_id} is already being executed by pid holder-process" in flat(result.output)
        assert run_rows(out) == [(run_id, "interrupted")]  # the refused process touched nothing
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_holder_does_not_block_and_the_lock_is_held_while_running(tmp_path):
    from opd_harness.runs import RunLocked, run_lock

    folder = tmp_path / "run"
    folder.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder / "run.lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(RunLocked, match="already being executed by pid holder-process"):
        with run_lock(folder, "r1"):
            pass
    os.kill(holder.pid, signal.SIGKILL)  # dies without releasing anything itself
    holder.wait()
    with run_lock(folder, "r1"):
        assert f"pid {os.getpid()}" in (folder / "run.lock").read_text()
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "import fcntl, sys; fcntl.flock(open(sys.argv[1]), fcntl.LOCK_EX | fcntl.LOCK_NB)",
                str(folder / "run.lock"),
            ],
            capture_output=True,
        )
        assert probe.returncode != 0 and b"BlockingIOError" in probe.stderr  # held against other processes
    with run_lock(folder, "r1"):  # released at the end of the block
        pass


# --------------------------------------------------------------------------- item 11: task-required inputs


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["method=sft", "student.sft_steps=0", "teacher.sft_steps=0"],
            "method 'sft' trains on reference solutions, which task 'dapo_math' does not provide",
        ),
        (
            ["method=opd", "student.sft_steps=10", "teacher.sft_steps=30"],
            "student.sft_steps=10 and teacher.sft_steps=30 train on reference solutions, which task 'dapo_math' does not provide",
        ),
        (["method=opd", "teacher.sft_steps=30"], "teacher.sft_steps=30 trains on reference solutions"),
    ],
)
def test_reference_solutions_are_checked_when_the_run_is_planned(overrides, expected, tmp_path):
    cfg = build_config(preset="smoke", overrides=["task=dapo_math", *overrides])
    with pytest.raises(ConfigError) as info:
        plan_run(cfg)
    assert expected in str(info.value)
    result = runner.invoke(
        app,
        ["run", "--preset", "smoke", "--out", str(tmp_path / "out"), *(x for o in ["task=dapo_math", *overrides] for x in ("--set", o))],
    )
    assert result.exit_code == 2 and expected in flat(result.output) and not (tmp_path / "out").exists()


def test_warm_up_of_a_pretrained_model_is_refused_at_validation():
    cfg = build_config(overrides=["student.path=/some/model", "student.sft_steps=5", "eval.tasks=[arith]"])
    with pytest.raises(ConfigError, match="student.sft_steps=5: warm-up is only supported for tiny models"):
        plan_run(cfg)


def test_tasks_with_references_pass_validation():
    assert plan_run(build_config(overrides=["method=sft", "task=gsm8k", "eval.tasks=[arith]"])).method.name == "sft"
    assert (
        plan_run(build_config(overrides=["method=sft", "task=minerva", "task_args.minerva.source=local", "eval.tasks=[arith]"])).task.name
        == "minerva"
    )
    with pytest.raises(ConfigError, match="task 'minerva' does not provide"):  # the hub copy has no solutions
        plan_run(build_config(overrides=["method=sft", "task=minerva", "eval.tasks=[arith]"]))


REFERENCES = {  # task -> whether its training split (default source) carries reference solutions
    "arith": True, "gsm8k": True, "math500": True, "aime24": True, "minerva": False, "aime25": False, "amc23": False,
    "olympiadbench": False, "dapo_math": False, "humaneval_plus": True, "mbpp_plus": True, "livecodebench": False, "arith_tool": True,
    "swebench": False,
}  # fmt: skip


def test_every_task_declares_what_it_provides():
    assert set(REFERENCES) >= {name for name in TASKS.names() if not name.startswith("_")}  # "_name": tasks other tests register
    for name, references in REFERENCES.items():
        task = TASKS.get(name)()
        assert ("reference_responses" in task.provided_inputs()) is references, name
        assert "rewards" in task.provided_inputs(), name
        assert TASKS.get(name).describe()["provides_references"] is references, name


def test_lm_eval_generation_tasks_provide_references_and_choice_tasks_do_not(tmp_path):
    pytest.importorskip("lm_eval")
    from opd_harness.plan import make_task

    data = Path(__file__).parent / "data" / "lm_eval"
    for template in data.glob("*.yaml.tmpl"):
        (tmp_path / template.name.removesuffix(".tmpl")).write_text(template.read_text().format(data_file=(data / "arith.jsonl").resolve()))
    shutil.copy(data / "utils.py", tmp_path / "utils.py")
    for name, references in (("arith_gen", True), ("arith_mc", False)):
        task = make_task(f"lm_eval:{name}", {f"lm_eval:{name}": {"include_path": str(tmp_path)}})
        assert ("reference_responses" in task.provided_inputs()) is references
        assert all((p.solution is not None) is references for p in task.load("test"))


@pytest.mark.parametrize(
    "name, options, data_file",
    [
        ("math500", {}, "math500/test.jsonl"),
        ("aime24", {}, "aime24/test.jsonl"),
        ("minerva", {"source": "local"}, "minerva/test.jsonl"),
        ("humaneval_plus", {}, "humaneval_plus/HumanEvalPlus-v0.1.10.jsonl.gz"),
        ("mbpp_plus", {}, "mbpp_plus/MbppPlus-v0.2.0.jsonl.gz"),
    ],
)
def test_declared_references_match_the_data(name, options, data_file, benchmark_data):
    """A task declaring references has a solution on every training problem of the real files."""
    cls = TASKS.get(name)
    task = cls(cls.Options(**options))
    data_dir = benchmark_data(data_file)
    assert "reference_responses" in task.provided_inputs()
    problems = task.load(task.training_split(), data_dir)
    assert problems and all(p.solution for p in problems)


EVAL_ARGS = ["eval", "--backend", "replay", "--task", "arith", "--limit", "2", "--model"]  # + a replay file answering every problem
GATE_ARGS = ["gate", "--baseline", "a", "--candidate", "b"]


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        (EVAL_ARGS, "--k", "-1"),
        (EVAL_ARGS, "--k", "0"),  # not silently the task's k
        (EVAL_ARGS, "--limit", "0"),
        (EVAL_ARGS, "--temperature", "-0.5"),
        (EVAL_ARGS, "--top-p", "0"),
        (EVAL_ARGS, "--top-p", "1.5"),
        (EVAL_ARGS, "--seed", "-3"),
        (EVAL_ARGS, "--max-error-rate", "-0.1"),
        (EVAL_ARGS, "--workers", "0"),
        (EVAL_ARGS, "--shard-size", "-2"),
        (GATE_ARGS, "--k", "0"),
        (GATE_ARGS, "--limit", "-1"),
        (GATE_ARGS, "--top-p", "0"),
        (GATE_ARGS, "--min-problems", "0"),
        (GATE_ARGS, "--n-resamples", "10"),
        (GATE_ARGS, "--max-error-rate", "1"),
        (GATE_ARGS, "--bootstrap-seed", "-1"),
    ],
)
def test_out_of_range_numeric_flags_exit_2_naming_the_flag_and_write_nothing(tmp_path, command, flag, value):
    out = tmp_path / "out"
    problems = ArithTask(ArithOptions()).load("test")[:2]
    model = replay_file(tmp_path, "arith", [(p.id, f"\\boxed{{{p.answer}}}") for p in problems] * 4)
    result = runner.invoke(app, [*command, str(model), "--out", str(out), flag, value])
    assert result.exit_code == 2 and f"'{flag}'" in result.output, result.output
    assert not out.exists()



@pytest.mark.parametrize("port", ["70000", "-1"])
def test_serve_port_out_of_range_exits_2_naming_the_flag_before_loading_a_model(tmp_path, port):
    result = runner.invoke(app, ["serve", "--model", str(tmp_path), "--port", port])
    assert result.exit_code == 2 and "'--port'" in result.output, result.output
