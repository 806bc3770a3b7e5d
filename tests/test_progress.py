"""Progress output in logs: periodic lines, never carriage-return redraws."""

from __future__ import annotations

import io

from opd_harness.progress import LogProgress


def test_log_progress_writes_lines_not_redraws(monkeypatch):
    clock = iter(range(0, 1000, 10))  # each monotonic() call advances 10 s
    monkeypatch.setattr("opd_harness.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    bar = LogProgress(range(6), desc="train", every_s=25.0, file=out)
    for i in bar:
        bar.set_postfix(loss=f"{i / 10:.1f}")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert 1 < len(lines) < 6  # a line now and then, not one per step
    assert lines[-1].startswith("train: 6/6 after ") and lines[-1].endswith("(loss=0.5)")


def test_progress_in_a_non_terminal_is_a_log_line(capsys):
    from opd_harness.progress import progress

    for _ in progress(range(3), desc="SFT teacher", total=3):
        pass
    err = capsys.readouterr().err
    assert "\r" not in err and err.strip().startswith("SFT teacher: 3/3 after")


def test_log_progress_does_not_repeat_its_final_line(monkeypatch):
    """A last step slower than ``every_s`` (training's last checkpoint evaluation) wrote the final count already: close
    adds no second identical line."""
    clock = iter(range(0, 1000, 40))  # every step slower than every_s
    monkeypatch.setattr("opd_harness.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    for _ in LogProgress(range(3), desc="train", every_s=30.0, file=out):
        pass
    lines = out.getvalue().splitlines()
    assert [line.split(" after")[0] for line in lines] == ["train: 1/3", "train: 2/3", "train: 3/3"]
    assert lines[0] == "train: 1/3 after 80s, ~160s left" and "left" not in lines[-1]  # an ETA from the rate so far


def test_harness_eval_reports_progress_per_task(tmp_path):
    """``harness eval`` in a log: a line per task saying how many of its shards are done (none before: minutes of silence)."""
    import json

    from typer.testing import CliRunner

    from opd_harness.cli import app
    from opd_harness.tasks.synthetic.arith import ArithOptions, ArithTask

    problems = ArithTask(ArithOptions()).load("test")[:5]
    model = tmp_path / "outputs.jsonl"
    model.write_text("".join(json.dumps({"task": "arith", "id": p.id, "completion": "\\boxed{1}"}) + "\n" for p in problems))
    args = ["eval", "--backend", "replay", "--model", str(model), "--task", "arith", "--k", "1", "--limit", "5", "--shard-size", "2"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "out"), "--max-error-rate", "1"])
    assert result.exit_code == 0, result.output
    assert "eval arith shards: 3/3 after " in result.stderr and result.stderr.count("eval arith shards: 3/3") == 1, result.stderr


def test_warmed_up_models_say_they_are_cached_and_then_loaded(tmp_path, capsys):
    from opd_harness.config import ModelSpec
    from opd_harness.models.tiny import TinyArch
    from opd_harness.plan import make_task
    from opd_harness.trainers.warmup import prepare_model

    task = make_task("arith", {})
    spec = ModelSpec(arch=TinyArch(hidden=16, layers=1, heads=2, kv_heads=1, ffn=16), sft_steps=2, sft_batch_size=4)
    for _ in range(2):
        prepare_model(spec, "teacher", task, task.load("train")[:8], tmp_path)
    err = capsys.readouterr().err
    assert "teacher: cached at " in err and "the next run with the same teacher and task loads it from there" in err
    assert "teacher: loaded from " in err and "(2 SFT steps (seed 0, " in err and "done by an earlier run)" in err


def test_the_cpu_demo_states_how_long_it_takes_and_that_its_models_are_cached(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import opd_harness.runs
    from opd_harness.cli import app
    from opd_harness.errors import TrainingAborted

    def stop(*args, **kwargs):
        raise TrainingAborted("stopped by the test")

    monkeypatch.setattr(opd_harness.runs, "execute_run", stop)
    result = CliRunner().invoke(app, ["run", "--preset", "cpu-demo", "--out", str(tmp_path)])
    text = " ".join(result.stderr.split())
    assert result.exit_code == 1 and "cpu-demo: takes about 6 minutes on 2 CPU cores" in text, result.output
    assert f"cached under {tmp_path / 'cache' / 'models'}, so the next run loads them" in text
