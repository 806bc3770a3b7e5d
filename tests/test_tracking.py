"""Trackers (trainer.loggers, harness eval --logger): the key scheme, one smoke run read back with each library's own
reader and compared with the store, config errors before anything is written, a tracker failing mid-run."""

from __future__ import annotations

import importlib.util
import json
import re
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.store import Store
from opd_harness.tracking import JsonlTracker, RunInfo, Trackers, eval_metrics, step_key, step_metrics

runner = CliRunner()
SMOKE = ["run", "--preset", "smoke", "--set", "eval.teacher=false", "--set", "teacher.sft_steps=0", "--set", "student.sft_steps=0",
         "--set", "eval.limit=4"]  # fmt: skip
ALL = "trainer.loggers=[tensorboard,wandb,mlflow]"
MLFLOW_NAME = re.compile(r"^[A-Za-z0-9_\-. :/]+$")  # what MLflow accepts in a metric name


# ---- the key scheme (a pure function)


def test_step_keys_follow_the_documented_scheme():
    assert {name: step_key(name) for name in ("loss", "grad_norm", "student_entropy", "tokens_per_s", "samples_per_s",
                                              "response_length", "lag_mean", "time_generate_s", "time_step_s", "reward_mean",
                                              "invalid_tool_rate", "kl_lag")} == {  # fmt: skip
        "loss": "train/loss", "grad_norm": "train/grad_norm", "student_entropy": "actor/entropy", "tokens_per_s": "perf/throughput",
        "samples_per_s": "perf/samples_per_s", "response_length": "response_length/mean", "lag_mean": "staleness/lag_mean",
        "time_generate_s": "timing_s/generate", "time_step_s": "timing_s/step", "reward_mean": "critic/rewards/mean",
        "invalid_tool_rate": "agent/invalid_tool_rate", "kl_lag": "train/kl_lag",
    }  # fmt: skip
    assert step_metrics({"loss": 1, "flag": True, "note": "x"}) == {"train/loss": 1.0}  # numbers only


def test_eval_keys_name_the_task_and_k_and_every_tracker_accepts_them():
    summary = {"k": 4, "n_samples": 32, "n_problems": 8, "n_errors": 1, "avg_at_k": 0.5, "ci_low": 0.25, "ci_high": 0.75,
               "pass_at_k": 0.875, "invalid_tool_rate": 0.1, "grader": "math-verify"}  # fmt: skip
    keys = eval_metrics("retool:math500", summary)
    assert keys == {
        "eval/retool:math500/avg_at_4": 0.5, "eval/retool:math500/pass_at_4": 0.875, "eval/retool:math500/ci_low": 0.25,
        "eval/retool:math500/ci_high": 0.75, "eval/retool:math500/n_samples": 32.0, "eval/retool:math500/n_problems": 8.0,
        "eval/retool:math500/n_errors": 1.0, "eval/retool:math500/invalid_tool_rate": 0.1,
    }  # fmt: skip
    assert all(MLFLOW_NAME.match(key) for key in [*keys, step_key("time_a@b_s"), step_key("x@y")])


# ---- one smoke run with every logger, read back with each library's reader


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tracking")
    result = runner.invoke(app, [*SMOKE, "--set", ALL, "--set", "trainer.tracking.tags=[smoke,trackers]", "--out", str(out)])
    assert result.exit_code == 0, result.output
    with Store(out) as store:
        run_id = store.runs()[-1]["run_id"]
        steps, evals, checkpoints = store.step_metrics(run_id), store.evals(run_id), store.checkpoints(run_id)
    return {"out": out, "run_id": run_id, "run_dir": out / "runs" / run_id, "steps": steps, "evals": evals,
            "checkpoints": checkpoints, "output": result.output}  # fmt: skip


def expected_values(run: dict) -> dict[tuple[int, str], float]:
    """(step, tracker key) -> value, from the store's rows: every step metric, and each evaluation's columns and extras."""
    out = {(step, step_key(name)): value for step, metrics in run["steps"].items() for name, value in metrics.items()}
    for row in run["evals"]:
        base, k = f"eval/{row['task']}", row["k"]
        columns = {f"avg_at_{k}": row["avg_at_k"], f"pass_at_{k}": row["pass_at_k"], "ci_low": row["ci_low"], "ci_high": row["ci_high"],
                   "n_problems": row["n_problems"], "n_samples": row["n"], "n_errors": row["n_errors"], **row["metrics"]}  # fmt: skip
        out.update({(row["step"], f"{base}/{name}"): float(value) for name, value in columns.items()})
    return out


def assert_same(found: dict[tuple[int, str], float], run: dict, rel: float = 0.0) -> None:
    expected = expected_values(run)
    assert {(0, "eval/arith/avg_at_2"), (2, "eval/arith/ci_low"), (4, "eval/arith/pass_at_2"), (1, "train/loss"),
            (1, "timing_s/generate"), (3, "perf/throughput"), (4, "actor/entropy"), (2, "staleness/lag_mean")} <= set(expected)  # fmt: skip
    assert set(found) == set(expected)
    for key, value in expected.items():
        assert found[key] == pytest.approx(value, rel=rel, nan_ok=True), key


@pytest.mark.slow
def test_the_run_logs_every_step_and_each_checkpoint_eval_at_its_training_step(smoke_run):
    assert sorted(smoke_run["steps"]) == [1, 2, 3, 4]
    assert [(e["step"], e["task"]) for e in smoke_run["evals"]] == [(0, "arith"), (2, "arith"), (4, "arith")]
    assert "warning" not in smoke_run["output"]


@pytest.mark.slow
def test_jsonl_has_the_store_values(smoke_run):
    lines = [json.loads(line) for line in (smoke_run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    found = {(line["step"], key): value for line in lines for key, value in line.items() if key != "step"}
    assert_same(found, smoke_run)


@pytest.mark.slow
def test_tensorboard_event_files_have_the_store_values(smoke_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(smoke_run["run_dir"] / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    found = {(e.step, tag): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert_same(found, smoke_run, rel=1e-6)  # TensorBoard keeps float32


def wandb_records(path: Path):
    """The protobuf records of a W&B run file (``run-<id>.wandb``: W&B's LevelDB-log framing of ``wandb_internal_pb2.Record``)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, parts = path.read_bytes(), 32768, 7, b""
    assert struct.unpack("<4sHB", data[:7])[0] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # block trailer
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk  # full, first | middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


@pytest.mark.slow
def test_wandb_offline_run_has_the_store_values_names_and_config(smoke_run):
    (path,) = (smoke_run["run_dir"] / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(path))
    found = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            found.update({(record.history.step.num, key): value for key, value in items.items() if not key.startswith("_")})
    assert_same(found, smoke_run)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, list(run.tags)) == ("opd-harness", smoke_run["run_id"], ["smoke", "trackers"])
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["method_json"]["name"] == "opd" and config["trainer"]["loggers"] == ["jsonl", "tensorboard", "wandb", "mlflow"]


@pytest.mark.slow
def test_mlflow_file_store_has_the_store_values_params_and_artifacts(smoke_run, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(smoke_run["run_dir"] / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("opd-harness").experiment_id])
    found = {(m.step, key): m.value for key in run.data.metrics for m in client.get_metric_history(run.info.run_id, key)}
    assert_same(found, smoke_run)
    assert run.info.run_name == smoke_run["run_id"] and run.info.status == "FINISHED"
    assert run.data.params["trainer.lr"] == "0.001" and run.data.tags["smoke"] == "true"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.json", "method.json"}


# ---- harness eval --logger, and a tracker that fails mid-run


@pytest.mark.slow
def test_eval_logger_survives_a_failing_tracker_with_one_warning(smoke_run, monkeypatch):
    from opd_harness import tracking

    def broken(self, metrics, step):
        raise ConnectionError("tensorboard went away")

    monkeypatch.setattr(tracking.TensorBoardTracker, "log", broken)
    model = smoke_run["checkpoints"][-1]["path"]
    out = smoke_run["out"]
    result = runner.invoke(app, ["eval", "--model", model, "--task", "arith", "--limit", "4", "--k", "2",
                                 "--logger", "tensorboard", "--logger", "mlflow", "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.output.count("tracker tensorboard failed") == 1
    with Store(out) as store:
        run_id = [r["run_id"] for r in store.runs() if r["kind"] == "eval"][-1]
        (row,) = store.evals(run_id)
        assert store.count("samples", run_id) == 8 and store.get_run(run_id)["status"] == "done"
    (line,) = [json.loads(x) for x in (out / "runs" / run_id / "metrics.jsonl").read_text().splitlines()]
    assert line["step"] == 0 and line["eval/arith/avg_at_2"] == row["avg_at_k"] and line["eval/arith/ci_high"] == row["ci_high"]


def test_a_tracker_raising_mid_run_warns_once_and_the_store_keeps_every_row(tmp_path):
    class Flaky:
        name = "flaky"
        calls = 0

        def log(self, metrics, step):
            Flaky.calls += 1
            raise OSError("disk gone")

        def close(self, ok=True):
            pass

    warnings: list[str] = []
    with Store(tmp_path) as store:
        store.create_run("r", kind="train", config={})
        jsonl = JsonlTracker(RunInfo(store.run_dir("r"), "r"))
        store.observe("r", Trackers([Flaky(), jsonl], warnings.append))
        for step in (1, 2, 3):
            store.log_step("r", step, {"loss": step / 10, "time_train_s": 0.5})
        store.observe("r", None)
        store.log_step("r", 4, {"loss": 0.4})  # no longer observed
        assert sorted(store.step_metrics("r")) == [1, 2, 3, 4]
    jsonl.close()
    assert Flaky.calls == 1 and len(warnings) == 1 and "flaky failed at step 1" in warnings[0]
    lines = [json.loads(x) for x in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": s, "train/loss": s / 10, "timing_s/train": 0.5} for s in (1, 2, 3)]


# ---- a logger that cannot start: exit 2 naming the key, before anything is written


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["trainer.loggers=[tensorboard,nope]"], "trainer.loggers: Value error, unknown logger(s) ['nope']"),
        (["trainer.loggers=[mlflow]", "trainer.tracking.mlflow_uri=bogus://host/x"], "trainer.tracking.mlflow_uri"),
    ],
)
def test_bad_logger_config_exits_2_before_anything_is_written(tmp_path, sets, message):
    out = tmp_path / "out"
    result = runner.invoke(app, [*SMOKE, *(x for s in sets for x in ("--set", s)), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and not out.exists()


def test_missing_tracker_package_exits_2_naming_the_key_and_the_extra(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    out = tmp_path / "out"
    run = runner.invoke(app, [*SMOKE, "--set", "trainer.loggers=[wandb]", "--out", str(out)])
    evaluation = runner.invoke(app, ["eval", "--model", "m", "--task", "arith", "--logger", "wandb", "--out", str(out)])
    for result, key in ((run, "trainer.loggers"), (evaluation, "--logger")):
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and key in text and "['wandb']" in text and "opd-harness[tracking]" in text, result.output
    assert not out.exists()


def test_unknown_eval_logger_exits_2_before_anything_is_written(tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["eval", "--model", "m", "--task", "arith", "--logger", "tensorbord", "--out", str(out)])
    assert result.exit_code == 2 and "--logger: unknown logger(s) ['tensorbord']" in " ".join(result.output.split())
    assert not out.exists()


def test_resuming_a_run_whose_tracker_package_is_gone_exits_2_naming_the_key(tmp_path, monkeypatch):
    from opd_harness.config import build_config

    with Store(tmp_path) as store:
        store.create_run("r", kind="train", config=build_config(preset="smoke", overrides=["trainer.loggers=[wandb]"]).model_dump())
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    result = runner.invoke(app, ["run", "--resume", "r", "--out", str(tmp_path)])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "--resume r" in text and "trainer.loggers" in text and "opd-harness[tracking]" in text, result.output


def test_a_tracker_that_cannot_start_exits_2_naming_the_key_and_marks_the_run_failed(tmp_path, monkeypatch):
    from opd_harness import tracking

    def refused(self, info):
        raise PermissionError("the tracking server refused the run")

    monkeypatch.setattr(tracking.MlflowTracker, "__init__", refused)
    result = runner.invoke(app, [*SMOKE, "--set", "trainer.loggers=[mlflow]", "--out", str(tmp_path)])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "trainer.loggers: logger mlflow could not start: PermissionError" in text, result.output
    with Store(tmp_path) as store:
        (run,) = store.runs()
        assert run["status"] == "failed" and store.count("step_metrics", run["run_id"]) == 0
