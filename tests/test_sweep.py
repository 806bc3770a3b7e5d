"""Sweeps (opd_harness.sweep) and their paper-style tables and lag curve (opd_harness.report)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from opd_harness.config import ConfigError, build_config
from opd_harness.report import plot_lag_curve, render_markdown, summarize_run, sweep_report, write_report
from opd_harness.store import Store
from opd_harness.sweep import SweepError, _claim, load_sweep, run_sweep, sweep_record_path

SWEEP_YAML = """\
id: tiny
base:
  preset: smoke
  set: {threads: 1, eval.teacher: false}
grid:
  - {method: [opd], trainer.mode: [sync, async], seed: [0, 1]}
  - {trainer.mode: [async], trainer.fixed_lag: [0, 1], seed: [0]}
"""


# ---- a real tiny sweep, run in-process on the smoke preset ---------------------------------------


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    spec_path = root / "tiny.yaml"
    spec_path.write_text(SWEEP_YAML)
    out = root / "results"
    result = run_sweep(spec_path, out)
    return spec_path, out, result


@pytest.mark.slow
def test_sweep_runs_every_point_and_records_the_sweep_file(tiny_sweep):
    _, out, result = tiny_sweep
    assert result.failed == [] and result.skipped == [] and len(result.ran) == 6
    record = json.loads((out / "sweeps" / "tiny.json").read_text())
    assert record["sweep_id"] == "tiny"
    assert record["grid_keys"] == ["method", "trainer.mode", "seed", "trainer.fixed_lag"]
    assert [p["run_id"] for p in record["points"]] == result.ran
    assert all(p["status"] == "done" for p in record["points"])
    assert record["points"][0]["coords"] == {"method": "opd", "trainer.mode": "sync", "seed": 0}
    assert record["points"][5]["coords"] == {"trainer.mode": "async", "trainer.fixed_lag": 1, "seed": 0}
    with Store(out) as store:
        for p in record["points"]:
            run = store.get_run(p["run_id"])
            assert run["status"] == "done"
            assert run["config"]["trainer"]["mode"] == p["coords"]["trainer.mode"]
            assert run["config"]["seed"] == p["coords"]["seed"]
            assert run["config"]["trainer"]["fixed_lag"] == p["coords"].get("trainer.fixed_lag")
            assert run["config"]["method_args"]["opd"]["estimator"] == "full"  # recorded like `harness run`
            assert (store.run_dir(p["run_id"]) / "config.json").exists() and (store.run_dir(p["run_id"]) / "method.json").exists()
            assert store.checkpoints(p["run_id"])[-1]["step"] == 4


@pytest.mark.slow
def test_rerunning_a_sweep_skips_done_runs_and_resumes_interrupted_ones(tiny_sweep):
    spec_path, out, first = tiny_sweep
    with Store(out) as store:
        n_runs = len(store.runs())
    again = run_sweep(spec_path, out)
    assert again.ran == [] and again.skipped == first.ran
    with Store(out) as store:
        assert len(store.runs()) == n_runs
        store.set_status(first.ran[3], "interrupted")  # as if killed mid-run
    resumed = run_sweep(spec_path, out)
    assert resumed.ran == [first.ran[3]] and len(resumed.skipped) == 5
    with Store(out) as store:
        assert len(store.runs()) == n_runs and store.get_run(first.ran[3])["status"] == "done"
    dry = run_sweep(spec_path, out, dry_run=True)
    assert [p.status for p in dry.points] == ["done"] * 6


@pytest.mark.slow
def test_report_of_the_tiny_sweep_has_one_row_per_configuration_and_a_lag_curve(tiny_sweep):
    _, out, result = tiny_sweep
    report = write_report(out, "tiny")
    rows = {(r["trainer.mode"], r["trainer.fixed_lag"]): r for r in report["rows"]}
    assert set(rows) == {("sync", None), ("async", None), ("async", 0), ("async", 1)}
    assert [rows[k]["n_done"] for k in [("sync", None), ("async", None), ("async", 0), ("async", 1)]] == [2, 2, 1, 1]
    assert rows[("sync", None)]["relative_throughput"] == pytest.approx(1.0)
    assert rows[("sync", None)]["lag_mean"] == 0.0
    with Store(out) as store:
        sph = {rid: store.checkpoints(rid)[-1]["samples_per_hour"] for rid in result.ran}
    sync_mean = np.mean([sph[rid] for rid in rows[("sync", None)]["run_ids"]])
    async_mean = np.mean([sph[rid] for rid in rows[("async", None)]["run_ids"]])
    assert rows[("async", None)]["relative_throughput"] == pytest.approx(async_mean / sync_mean)
    assert rows[("async", None)]["throughput_baseline"] == "same config, sync"
    assert rows[("async", 1)]["lag_mean"] > 0
    assert [p["fixed_lag"] for p in report["lag_curve"][0]["points"]] == [0, 1]
    png = out / "sweeps" / "tiny" / "lag_curve.png"
    assert png.exists() and png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "sweeps" / "tiny" / "table.md").read_text()
    assert md.count("\n| opd |") == 4 and "collapse" in md
    assert json.loads((out / "sweeps" / "tiny" / "table.json").read_text())["sweep_id"] == "tiny"


WORKERS_YAML = """\
id: two-workers
base:
  preset: smoke
  set: {threads: 1, eval.teacher: false, eval.before_training: false, trainer.steps: 2}
grid: {seed: [0, 1, 2, 3]}
"""


def _harness(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "opd_harness.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)  # fmt: skip


@pytest.mark.slow
def test_two_processes_on_one_sweep_run_every_point_once(tmp_path):
    spec, out = tmp_path / "two-workers.yaml", tmp_path / "results"
    spec.write_text(WORKERS_YAML)
    workers = [_harness("sweep", str(spec), "--out", str(out)) for _ in range(2)]
    logs = [w.communicate(timeout=900)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], logs
    record = json.loads(sweep_record_path(out, "two-workers").read_text())
    run_ids = [p["run_id"] for p in record["points"]]
    assert [p["status"] for p in record["points"]] == ["done"] * 4 and len(set(run_ids)) == 4
    with Store(out) as store:
        assert sorted(r["run_id"] for r in store.runs()) == sorted(run_ids)  # no point ran twice
        assert [store.get_run(r)["config"]["seed"] for r in run_ids] == [0, 1, 2, 3]
    started = [[r for r in run_ids if f"running {r}" in log] for log in logs]
    assert sorted(started[0] + started[1]) == sorted(run_ids)  # each point started by exactly one of them


@pytest.mark.slow
def test_a_point_another_process_holds_is_skipped_and_run_by_the_next_invocation(tmp_path):
    spec, out = tmp_path / "two-workers.yaml", tmp_path / "results"
    spec.write_text(WORKERS_YAML.replace("seed: [0, 1, 2, 3]", "seed: [0, 1]"))
    record_path = sweep_record_path(out, "two-workers")
    record_path.parent.mkdir(parents=True)
    held = load_sweep(spec)
    from opd_harness.sweep import expand

    first_hash = expand(held)[0].config_hash
    with _claim(record_path, first_hash) as claimed:  # as another worker running seed 0
        assert claimed
        result = run_sweep(spec, out)
    assert result.elsewhere == ["seed=0"] and len(result.ran) == 1
    record = json.loads(record_path.read_text())
    assert [p["status"] for p in record["points"]] == ["pending", "done"]
    again = run_sweep(spec, out)
    assert again.elsewhere == [] and again.skipped == result.ran and len(again.ran) == 1
    assert [p["status"] for p in json.loads(record_path.read_text())["points"]] == ["done", "done"]


# ---- validation before anything runs ------------------------------------------------------------


def _spec(tmp_path, grid: str, base: str = "  preset: smoke\n") -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(f"base:\n{base}grid:\n{grid}")
    return path


def test_an_unknown_grid_key_fails_before_any_run(tmp_path):
    path = _spec(tmp_path, "  trainer.mode: [sync]\n  trainer.lrr: [0.1]\n")
    with pytest.raises(SweepError, match=r"grid point 0 \(trainer.mode=sync, trainer.lrr=0.1\): unknown key 'trainer.lrr'") as err:
        run_sweep(path, tmp_path / "out")
    assert isinstance(err.value, ConfigError) and "allowed here" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_one_bad_grid_point_stops_the_whole_sweep(tmp_path):
    path = _spec(tmp_path, "  trainer.mode: [sync, bogus]\n")
    with pytest.raises(SweepError, match=r"1 of 2 grid points are invalid; nothing was run\ngrid point 1 \(trainer.mode=bogus\)"):
        run_sweep(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_bad_method_value_names_its_grid_point(tmp_path):
    path = _spec(tmp_path, "  method: [opd, no_such_method]\n")
    with pytest.raises(SweepError, match=r"grid point 1 \(method=no_such_method\)"):
        run_sweep(path, tmp_path / "out", dry_run=True)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("base: {preset: smoke}\n", "grid"),
        ("grid: {seed: []}\n", "empty list"),
        ("grid: {seed: 3}\n", "grid"),
        ("grid: []\n", "empty"),
        ("base: {presett: smoke}\ngrid: {seed: [0]}\n", "presett"),
        ("id: 'a b'\ngrid: {seed: [0]}\n", "id"),
    ],
)
def test_malformed_sweep_files_are_refused(tmp_path, text, message):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SweepError, match=message):
        load_sweep(path)


def test_dry_run_writes_nothing_and_duplicate_points_run_once(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("base: {preset: smoke}\ngrid:\n  - {seed: [0, 1]}\n  - {seed: [1, 2]}\n")
    result = run_sweep(path, tmp_path / "out", dry_run=True)
    assert [p.coords["seed"] for p in result.points] == [0, 1, 2]
    assert all(p.status == "pending" for p in result.points)
    assert not (tmp_path / "out").exists()


# ---- table arithmetic on a hand-made store ------------------------------------------------------


def _add_run(store, run_id, *, mode, seed, curve, samples_per_hour, method="opd", fixed_lag=None, lags=(), status="done"):
    overrides = [f"method={method}", f"trainer.mode={mode}", f"seed={seed}"] + (
        [f"trainer.fixed_lag={fixed_lag}"] if fixed_lag is not None else []
    )
    cfg = build_config(preset="smoke", overrides=overrides).model_dump()
    store.create_run(run_id, kind="train", config=cfg, method=method, task="arith")
    for step, avg in curve:
        summary = {"k": 2, "n_samples": 16, "n_problems": 8, "avg_at_k": avg, "ci_low": avg, "ci_high": avg}
        store.add_eval(run_id, step, "arith", summary, [], grader="test", grader_version="0")
    store.add_checkpoint(run_id, curve[-1][0], path=None, samples_seen=samples_per_hour, train_seconds=3600.0)  # exact samples/h
    for step, lag in enumerate(lags, start=1):
        store.log_step(run_id, step, {"lag_mean": lag})
    store.set_status(run_id, status)
    coords = {"method": method, "trainer.mode": mode, "seed": seed, **({"trainer.fixed_lag": fixed_lag} if fixed_lag is not None else {})}
    return {"run_id": run_id, "coords": coords}


@pytest.fixture
def hand_made(tmp_path):
    store = Store(tmp_path)
    points = [
        _add_run(store, "s0", mode="sync", seed=0, curve=[(0, 0.2), (2, 0.5), (4, 0.4)], samples_per_hour=1000),
        _add_run(store, "s1", mode="sync", seed=1, curve=[(0, 0.2), (2, 0.3), (4, 0.6)], samples_per_hour=2000),
        _add_run(store, "a0", mode="async", seed=0, curve=[(0, 0.2), (2, 0.6), (4, 0.1)], samples_per_hour=1500, lags=[1, 1, 0, 0]),
        _add_run(store, "a1", mode="async", seed=1, curve=[(0, 0.2), (2, 0.4), (4, 0.3)], samples_per_hour=3000, lags=[1, 1, 1, 1]),
        _add_run(store, "f0", mode="async", seed=0, method="f_opd", curve=[(0, 0.2), (4, 0.3)], samples_per_hour=1200, lags=[1, 1]),
        _add_run(store, "x0", mode="async", seed=2, curve=[(0, 0.2), (2, 0.0)], samples_per_hour=9999, status="failed"),
    ]
    record = {"sweep_id": "hand", "grid_keys": ["method", "trainer.mode", "seed"], "points": points}
    yield store, record
    store.close()


def test_table_rows_and_relative_throughput_arithmetic(hand_made):
    store, record = hand_made
    report = sweep_report(store, record)
    rows = {(r["method"], r["trainer.mode"]): r for r in report["rows"]}
    assert list(rows) == [("opd", "sync"), ("opd", "async"), ("f_opd", "async")]
    sync, async_, f_opd = rows[("opd", "sync")], rows[("opd", "async")], rows[("f_opd", "async")]
    assert sync["final_mean"] == pytest.approx(0.5) and sync["final_std"] == pytest.approx(np.std([0.4, 0.6], ddof=1))
    assert sync["peak_mean"] == pytest.approx(0.55) and sync["drop_mean"] == pytest.approx(0.05)
    assert sync["relative_throughput"] == pytest.approx(1.0) and sync["samples_per_hour"] == pytest.approx(1500)
    assert sync["lag_mean"] == 0.0 and sync["n_collapsed"] == 0
    assert (
        async_["final_mean"] == pytest.approx(0.2)
        and async_["peak_mean"] == pytest.approx(0.5)
        and async_["drop_mean"] == pytest.approx(0.3)
    )
    assert (async_["n_collapsed"], async_["n_done"], async_["n_runs"]) == (1, 2, 3)  # the failed seed-2 run is left out
    assert async_["collapse_ratio"] == pytest.approx(0.5)
    assert async_["relative_throughput"] == pytest.approx(2250 / 1500)  # mean over seeds / mean of the matching sync runs
    assert async_["lag_mean"] == pytest.approx(0.75) and async_["throughput_baseline"] == "same config, sync"
    assert f_opd["relative_throughput"] == pytest.approx(1200 / 1500) and f_opd["throughput_baseline"] == "sync opd"
    assert f_opd["final_std"] is None  # one seed
    md = render_markdown(report)
    assert "| opd | async | 2/3 | 0.200 ± 0.141 | 0.500 | 0.300 | 1/2 | 1.50× | 2250 | 0.75 |" in md
    assert "0.80× (vs sync opd)" in md


def test_collapse_ratio_follows_the_documented_threshold(hand_made):
    store, record = hand_made
    assert summarize_run([(0, 0.2), (2, 0.6), (4, 0.29)])["collapsed"] is True  # 0.29 < 0.5 × 0.6
    assert summarize_run([(0, 0.2), (2, 0.6), (4, 0.30)])["collapsed"] is False  # not strictly below
    assert summarize_run([(0, 0.0), (2, 0.0)])["collapsed"] is False  # nothing to collapse from
    s = summarize_run([(4, 0.35), (0, 0.6)], collapse_threshold=0.6)  # unordered input; the peak may be step 0
    assert (s["peak"], s["peak_step"], s["final"], s["initial"], s["collapsed"]) == (0.6, 0, 0.35, 0.6, True)
    strict = {(r["method"], r["trainer.mode"]): r for r in sweep_report(store, record, collapse_threshold=0.9)["rows"]}
    assert strict[("opd", "sync")]["n_collapsed"] == 1  # 0.4 < 0.9 × 0.5
    assert strict[("opd", "async")]["n_collapsed"] == 2
    assert "0.9 x peak" in sweep_report(store, record, collapse_threshold=0.9)["collapse_criterion"]


def test_lag_curve_means_cis_and_png(tmp_path):
    with Store(tmp_path) as store:
        points = [
            _add_run(store, "s0", mode="sync", seed=0, curve=[(0, 0.1), (4, 0.7)], samples_per_hour=100),
            _add_run(store, "l0a", mode="async", seed=0, fixed_lag=0, curve=[(0, 0.1), (4, 0.4)], samples_per_hour=100),
            _add_run(store, "l0b", mode="async", seed=1, fixed_lag=0, curve=[(0, 0.1), (4, 0.6)], samples_per_hour=100),
            _add_run(store, "l2a", mode="async", seed=0, fixed_lag=2, curve=[(0, 0.1), (4, 0.2)], samples_per_hour=100),
            _add_run(store, "l2b", mode="async", seed=1, fixed_lag=2, curve=[(0, 0.1), (4, 0.2)], samples_per_hour=100),
        ]
        record = {"sweep_id": "lag", "grid_keys": ["trainer.mode", "trainer.fixed_lag", "seed"], "points": points}
        report = sweep_report(store, record)
    (line,) = report["lag_curve"]
    lag0, lag2 = line["points"]
    assert (lag0["fixed_lag"], lag0["n"], lag0["final_mean"]) == (0, 2, pytest.approx(0.5))
    assert 0.4 <= lag0["ci_low"] <= 0.5 <= lag0["ci_high"] <= 0.6
    assert (lag2["final_mean"], lag2["ci_low"], lag2["ci_high"]) == (pytest.approx(0.2), pytest.approx(0.2), pytest.approx(0.2))
    assert line["sync_final_mean"] == pytest.approx(0.7)
    png = plot_lag_curve(report["lag_curve"], tmp_path / "plots" / "lag_curve.png", k=2)
    assert png.stat().st_size > 1000


def test_report_of_an_unknown_sweep_is_a_clear_error(tmp_path):
    with pytest.raises(SweepError, match="no sweep 'nope'"):
        write_report(tmp_path, "nope")


def test_pending_points_of_a_later_sub_grid_join_the_row_of_their_setting(hand_made):
    """A sub-grid without trainer.fixed_lag still lands in the same row as finished runs of that setting."""
    store, record = hand_made
    record = {**record, "grid_keys": ["method", "trainer.mode", "trainer.fixed_lag", "seed"]}
    record["points"] = [*record["points"], {"coords": {"method": "f_opd", "trainer.mode": "async", "seed": 3}}]
    rows = [r for r in sweep_report(store, record)["rows"] if r["method"] == "f_opd"]
    assert len(rows) == 1 and (rows[0]["n_done"], rows[0]["n_runs"]) == (1, 2)
