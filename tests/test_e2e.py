"""End-to-end runs of the real CLI in subprocesses (tiny models, seconds each)."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

HARNESS = [sys.executable, "-m", "opd_harness.cli"]
SMOKE = ["run", "--method", "opd", "--task", "arith", "--preset", "smoke"]


def harness(*args, check=True, timeout=300):
    result = subprocess.run([*HARNESS, *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"harness {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def query(db, sql, *params):
    with sqlite3.connect(db) as conn:
        return conn.execute(sql, params).fetchall()


def test_tasks_and_methods_json():
    tasks = json.loads(harness("tasks", "--json").stdout)
    methods = json.loads(harness("methods", "--json").stdout)
    arith = next(t for t in tasks if t["name"] == "arith")
    opd = next(m for m in methods if m["name"] == "opd")
    assert arith["description"] and arith["defaults"]["k"] == 4
    assert opd["defaults"]["estimator"] == "sampled" and "teacher_logprobs" in opd["inputs"]


@pytest.mark.slow
def test_smoke_run_leaves_checkpoints_evals_and_a_leaderboard(tmp_path):
    out = tmp_path / "out"
    result = harness(*SMOKE, "--out", str(out))
    db = out / "results.sqlite"
    (run_id, status), *_ = query(db, "SELECT run_id, status FROM runs WHERE kind='train'")
    assert status == "done"
    steps = [s for (s,) in query(db, "SELECT step FROM checkpoints WHERE run_id=? ORDER BY step", run_id)]
    assert steps == [2, 4]
    evals = query(db, "SELECT step, k, n, avg_at_k, ci_low, ci_high, grader FROM evals WHERE run_id=? ORDER BY step", run_id)
    assert [e[0] for e in evals] == [0, 2, 4]
    assert all(e[1] == 2 and e[2] == 16 and e[4] <= e[3] <= e[5] and e[6] == "math-verify" for e in evals)
    assert query(db, "SELECT COUNT(*) FROM samples WHERE run_id=?", run_id)[0][0] == 3 * 16
    names = {n for (n,) in query(db, "SELECT DISTINCT name FROM step_metrics WHERE run_id=?", run_id)}
    assert {"loss", "teacher_kl", "student_entropy", "response_length", "samples_per_s", "tokens_per_s",
            "time_generate_s", "time_teacher_s", "time_train_s"} <= names  # fmt: skip
    assert query(db, "SELECT COUNT(*) FROM evals WHERE run_id=?", run_id + ".teacher")[0][0] == 1
    assert "estimator: full" in result.stdout
    method_record = json.loads((out / "runs" / run_id / "method.json").read_text())
    assert method_record["name"] == "opd" and method_record["hparams"]["estimator"] == "full"
    # leaderboard in every format
    rows = json.loads(harness("leaderboard", str(out), "--format", "json").stdout)
    assert {(r["run_id"], r["step"]) for r in rows} >= {(run_id, 0), (run_id, 2), (run_id, 4), (run_id + ".teacher", 0)}
    assert harness("leaderboard", str(out), "--format", "csv").stdout.startswith("run_id,kind,method,step")
    assert "| run | method |" in harness("leaderboard", str(out), "--format", "md").stdout
    assert harness("leaderboard", str(out), "--format", "xml", check=False).returncode == 2
    # a checkpoint is a loadable model: evaluate it with `harness eval`
    ckpt = query(db, "SELECT path FROM checkpoints WHERE run_id=? AND step=4", run_id)[0][0]
    summary = json.loads(
        harness("eval", "--model", ckpt, "--task", "arith", "--k", "2", "--limit", "4", "--out", str(out), "--json").stdout
    )
    assert summary["tasks"]["arith"]["n_problems"] + summary["tasks"]["arith"]["n_error_problems"] == 4


@pytest.mark.slow
def test_resume_after_sigkill_loses_and_duplicates_nothing(tmp_path):
    out = tmp_path / "killed"
    args = [*SMOKE, "--set", "trainer.steps=30", "--set", "trainer.checkpoint_every=10", "--out", str(out)]
    proc = subprocess.Popen([*HARNESS, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    db = out / "results.sqlite"
    deadline = time.time() + 240
    run_id = None
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
        if not db.exists():
            continue
        try:
            rows = query(db, "SELECT run_id FROM runs WHERE kind='train'")
            if rows:
                run_id = rows[0][0]
                if (query(db, "SELECT MAX(step) FROM step_metrics WHERE run_id=?", run_id)[0][0] or 0) >= 13:
                    break
        except sqlite3.OperationalError:  # schema not created yet
            continue
    assert proc.poll() is None, "the run finished before it could be killed: make it longer"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    last_before = query(db, "SELECT MAX(step) FROM step_metrics WHERE run_id=?", run_id)[0][0]
    assert 13 <= last_before < 30
    result = harness("run", "--resume", run_id, "--out", str(out))
    assert f"from step {10 * (last_before // 10)}" in result.stderr
    steps = query(db, "SELECT step, COUNT(*) FROM step_metrics WHERE run_id=? AND name='loss' GROUP BY step", run_id)
    assert [s for s, _ in steps] == list(range(1, 31)) and all(c == 1 for _, c in steps)
    assert [s for (s,) in query(db, "SELECT step FROM checkpoints WHERE run_id=? ORDER BY step", run_id)] == [10, 20, 30]
    assert [s for (s,) in query(db, "SELECT step FROM evals WHERE run_id=? ORDER BY step", run_id)] == [0, 10, 20, 30]
    assert query(db, "SELECT COUNT(*) FROM samples WHERE run_id=?", run_id)[0][0] == 4 * 16
    assert query(db, "SELECT status FROM runs WHERE run_id=?", run_id)[0][0] == "done"
    # training continued from the checkpoint exactly: an uninterrupted run gives the same losses
    ref_out = tmp_path / "reference"
    harness(*SMOKE, "--set", "trainer.steps=30", "--set", "trainer.checkpoint_every=10", "--out", str(ref_out))
    ref_id = query(ref_out / "results.sqlite", "SELECT run_id FROM runs WHERE kind='train'")[0][0]
    ref = query(ref_out / "results.sqlite", "SELECT step, value FROM step_metrics WHERE run_id=? AND name='loss' ORDER BY step", ref_id)
    got = query(db, "SELECT step, value FROM step_metrics WHERE run_id=? AND name='loss' ORDER BY step", run_id)
    assert [s for s, _ in ref] == [s for s, _ in got]
    assert [v for _, v in got] == pytest.approx([v for _, v in ref], abs=1e-4)
