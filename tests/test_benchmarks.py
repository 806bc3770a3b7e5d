"""What the throughput benchmarks compare and in which order (the project standard: a benchmark warms up both
sides and alternates their order, and compares like with like), with their runs replaced by recorders."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_episode_throughput_warms_up_both_ways_then_alternates_their_order(monkeypatch, capsys):
    bench = load_benchmark("episode_throughput")
    calls = []
    rates = {True: iter([1.0, 2.0, 4.0]), False: iter([1.0, 10.0, 30.0])}  # per way: the warm-up, then the measurements

    def fake_rate(backend, task, problems, params, *, one_at_a_time):
        calls.append((len(problems), one_at_a_time))
        return next(rates[one_at_a_time])

    monkeypatch.setattr(bench, "rollout_rate", fake_rate)
    bench.compare("w", None, None, list(range(40)), None, rounds=2)
    warmup = bench.WARMUP_PROBLEMS
    assert calls == [(warmup, True), (warmup, False), (40, True), (40, False), (40, False), (40, True)]
    out = capsys.readouterr().out
    assert "ratio  6.67x" in out  # mean 20 ep/s batched over mean 3 ep/s one at a time
    assert "5.00x, 7.50x" in out  # each round's ratio


def fake_metrics(steps: int = 6) -> dict[int, dict[str, float]]:
    keys = ("time_step_s", "time_generate_s", "time_teacher_s", "time_train_s", "response_length")
    keys += ("idle_ratio_rollout", "idle_ratio_learner")
    return {s: {**{k: 0.5 for k in keys}, "lag_mean": 1.0, "refreshes": 0.0} for s in range(1, steps + 1)}


def test_async_throughput_compares_f_opd_with_opd_async_in_alternating_order(monkeypatch, capsys):
    bench = load_benchmark("async_throughput")
    runs: list[tuple[str, ...]] = []
    monkeypatch.setattr(bench, "run_once", lambda out, steps, *overrides: runs.append(overrides) or fake_metrics())
    monkeypatch.setattr(sys, "argv", ["async_throughput.py", "--steps", "6"])
    bench.main()
    assert not any("estimator=sampled" in o for run in runs for o in run)  # opd's Tinker loss is not f-OPD's
    f_opd = [i for i, run in enumerate(runs) if "method=f_opd" in run]
    base = [i for i, run in enumerate(runs) if "method=opd_async" in run]
    assert len(f_opd) == len(base) == 2
    for i, j in zip(f_opd, base):  # each f-OPD run has its like-for-like run, with the same schedule and learning rate
        assert set(runs[i]) - {"method=f_opd"} == set(runs[j]) - {"method=opd_async"}
    assert [f_opd[0] < base[0], f_opd[1] < base[1]] == [True, False]  # the order alternates
    out = capsys.readouterr().out
    assert out.count("vs opd_async") == 2 and "plain async OPD with the same sampled-token loss" not in out


def test_async_throughput_pairs_alternate_which_side_runs_first(monkeypatch):
    bench = load_benchmark("async_throughput")
    runs: list[str] = []
    monkeypatch.setattr(bench, "run_once", lambda out, steps, *overrides: runs.append(overrides[0]) or fake_metrics())
    monkeypatch.setattr(sys, "argv", ["async_throughput.py", "--steps", "6", "--pairs", "2"])
    bench.main()
    assert runs == ["trainer.mode=sync", "trainer.mode=async", "trainer.mode=async", "trainer.mode=sync"]


def test_interpreter_latency_warms_up_both_ways_then_alternates_their_order():
    bench = load_benchmark("interpreter_latency")
    calls: list[str] = []
    seen = bench.alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, warmup=2)
    assert calls == ["a", "a", "b", "b", "a", "b", "b", "a", "a", "b"]
    assert [len(seen["a"]), len(seen["b"])] == [3, 3]
    assert bench.summary([0.001, 0.002, 0.003])[0] == 2.0


def test_serve_engine_warms_up_both_engines_then_alternates_their_order(monkeypatch, capsys):
    bench = load_benchmark("serve_engine")
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(bench, "decode_work_old", lambda tok, tokens: calls.append(("old", len(tokens))) or 4.0)
    monkeypatch.setattr(bench, "decode_work_new", lambda tok, tokens: calls.append(("new", len(tokens))) or 1.0)

    def fake_staggered(module, model, tokenizer, *, lengths, gap_s, max_batch, **options):
        name = "old" if module is bench.old else "thread" if options.get("text_thread") else "new"
        calls.append((name, len(lengths), sum(lengths)))
        return {"old": (100.0, 1.0), "new": (300.0, 0.1), "thread": (250.0, 0.2)}[name]

    monkeypatch.setattr(bench, "staggered", fake_staggered)
    argv = ["serve_engine.py", "--rounds", "2", "--lengths", "64", "--clients", "8", "--mixed-clients", "16", "--long-every", "4"]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    mixed = 4 * 256 + 12 * 16  # one client in 4 long, the rest short
    assert calls == [("old", 256), ("new", 256), ("old", 64), ("new", 64), ("new", 64), ("old", 64),
                     ("old", 4, 64), ("new", 4, 64),
                     ("old", 8, 8 * 256), ("new", 8, 8 * 256), ("new", 8, 8 * 256), ("old", 8, 8 * 256),
                     ("old", 16, mixed), ("new", 16, mixed), ("new", 16, mixed), ("old", 16, mixed)]  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("new / old tokens/s: 3.00; old / new median TTFT: 10.0") == 2 and "4.0" in out and "thread" not in out
    calls.clear()
    monkeypatch.setattr(sys, "argv", [*argv[:4], "--text-thread", "--mixed-clients", "0", "--clients", "8"])
    bench.main()
    row = ("old", 8, 8 * 256), ("new", 8, 8 * 256), ("thread", 8, 8 * 256)
    assert calls[3:] == [*row, *row[::-1]]  # the third side joins the alternation, warmed up with the others
    assert [c[0] for c in calls[:3]] == ["old", "new", "thread"] and all(c[1] == 4 for c in calls[:3])
    assert "new, text thread / old tokens/s: 2.50; old / new, text thread median TTFT: 5.0" in capsys.readouterr().out


def test_serve_engine_step_costs_time_both_engines_at_each_batch_size_alternating(monkeypatch, capsys):
    bench = load_benchmark("serve_engine")
    calls: list[tuple[str, int, int]] = []

    def fake_step_costs(module, model, tokenizer, *, batch, kv, window):
        calls.append(("old" if module is bench.old else "new", batch, kv))
        return {"step": 2.0 * batch, "forward": 1.0} if module is bench.old else {"step": 1.0 * batch, "forward": 1.0, "keep": 0.5}

    monkeypatch.setattr(bench, "step_costs", fake_step_costs)
    argv = ["serve_engine.py", "--lengths", "--skip-clients", "--step-costs", "--batches", "1", "8", "--kv", "64"]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    assert calls == [("old", 4, 16), ("new", 4, 16), ("old", 1, 64), ("new", 1, 64), ("new", 1, 64), ("old", 1, 64),
                     ("old", 8, 64), ("new", 8, 64), ("new", 8, 64), ("old", 8, 64)]  # fmt: skip
    out = capsys.readouterr().out
    assert "   old     8       16.000" in out and "   new     8        8.000" in out


def test_mixed_lengths_are_seeded_and_one_in_n_long():
    bench = load_benchmark("serve_engine")
    lengths = bench.mixed_lengths(64, 16, 256, 8, seed=3)
    assert sorted(lengths) == [16] * 56 + [256] * 8 and lengths == bench.mixed_lengths(64, 16, 256, 8, seed=3)


def test_rollout_workers_warms_up_both_then_alternates_their_order(monkeypatch, capsys):
    bench = load_benchmark("rollout_workers")
    runs: list[tuple[int, int]] = []

    def fake_run(out, steps, workers, extra):
        runs.append((steps, workers))
        return {s: {**fake_metrics()[s], "samples": 64.0, "time_step_s": 1.0 / workers} for s in range(1, steps + 1)}

    class FakeRay:
        def init(self, **options) -> None:
            runs.append(("init", options["num_cpus"]))

        def shutdown(self) -> None:
            runs.append(("shutdown", 0))

    import opd_harness.trainers.ray_executor as rx

    monkeypatch.setattr(bench, "run_once", fake_run)
    monkeypatch.setattr(rx, "import_ray", lambda: FakeRay())
    monkeypatch.setattr(sys, "argv", ["rollout_workers.py", "--steps", "6", "--pairs", "2"])
    bench.main()
    assert runs == [("init", 4), (5, 1), (5, 2), (6, 1), (6, 2), (6, 2), (6, 1), ("shutdown", 0)]
    assert "ratio 2.00x" in capsys.readouterr().out


def test_agent_step_latency_warms_up_then_alternates_which_episode_start_runs_first(monkeypatch):
    """Episode wall times: one warm-up pair excluded, then the overlapped start and the start on the first command
    alternate which runs first; the ratio is of the medians."""
    bench = load_benchmark("agent_step_latency")
    order, walls = [], iter([9.0, 9.0, 4.0, 6.0, 6.0, 4.0, 5.0, 7.0])

    class Traj:
        metadata: dict = {}
        num_steps = 2

    def fake_rollout(model, task, problems, params):
        order.append(type(task).__name__)
        return [Traj()]

    monkeypatch.setattr(bench, "rollout", fake_rollout)
    monkeypatch.setattr(bench, "timed", lambda fn: (fn(), next(walls))[1])
    result = bench.measure_episodes(None, None, rounds=3, turns=2, think_s=0.0)
    first = ["StartOnFirstCommand", "SwebenchTask"]
    assert order == [*first, *first[::-1], *first, *first[::-1]]
    assert result["wall_s"] == {"overlapped": [4.0, 4.0, 5.0], "start_on_first_command": [6.0, 6.0, 7.0]}
    assert result["ratio_start_on_first_command_over_overlapped"] == 1.5


def test_rollout_streaming_warms_up_every_side_then_alternates_their_order(monkeypatch, capsys):
    bench = load_benchmark("rollout_streaming")
    runs: list[tuple[str, int, int]] = []

    def fake_rate(args, side, steps, seed):
        runs.append((side, steps, seed))
        return {"batch": 10.0, "group": 8.0, "swap": 12.0}[side]

    monkeypatch.setattr(bench, "samples_per_s", fake_rate)
    argv = ["--steps", "6", "--rounds", "2", "--max-lag", "1", "--sides", "batch", "group", "swap"]
    monkeypatch.setattr(sys, "argv", ["rollout_streaming.py", *argv])
    bench.main()
    assert runs == [("batch", 2, -1), ("group", 2, -1), ("swap", 2, -1),
                    ("batch", 6, 0), ("group", 6, 0), ("swap", 6, 0), ("swap", 6, 1), ("group", 6, 1), ("batch", 6, 1)]  # fmt: skip
    out = capsys.readouterr().out
    assert "ratio group / batch 0.80x" in out and "ratio swap / batch 1.20x" in out


def test_rollout_streaming_runs_every_side_through_the_loop():
    """Each side (the swap side's worker loads weights under its groups in flight) trains every batch of a short run."""
    import argparse

    bench = load_benchmark("rollout_streaming")
    args = argparse.Namespace(turns=2, step_ms=1.0, slow_share=0.2, slow_factor=5.0, prompts=2, samples=2, max_lag=1,
                              engine="batching", call_ms=1.0, row_ms=0.0, workers=2, train_ms=1.0)  # fmt: skip
    for side in bench.SIDES:
        assert bench.samples_per_s(args, side, 4, seed=0) > 0, side


def test_tool_demo_run_step_alternates_the_trees_and_leaves_out_each_runs_first_step(monkeypatch, capsys, tmp_path):
    bench = load_benchmark("tool_demo_run_step")
    order = []

    def fake_run(tree, out, student, steps, lr, extra):
        side = "old" if tree == tmp_path / "old" else "new"
        order.append((side, steps, lr))
        assert list(extra) == (["task_args.arith_tool.value_width=0"] if side == "new" else [])  # --new-set: the newer side only
        seconds = {"old": 40.0, "new": 10.0}[side]
        return {1: {"time_step_s": 999.0}, **{s: {"time_step_s": seconds, "mean_tool_calls": 1.0} for s in range(2, steps + 1)}}

    monkeypatch.setattr(bench, "run_once", fake_run)
    monkeypatch.setattr(sys, "argv", ["x", "--old", str(tmp_path / "old"), "--new", str(tmp_path / "new"), "--student", "s",
                                      "--steps", "3", "--rounds", "3", "--new-set", "task_args.arith_tool.value_width=0"])  # fmt: skip
    bench.main()
    assert [side for side, _, _ in order] == ["old", "new", "new", "old", "old", "new"]
    assert {(steps, lr) for _, steps, lr in order} == {(3, 1e-9)}
    assert "old 40.00 s, new 10.00 s: 4.00x" in capsys.readouterr().out  # the 999 s first steps are left out


def test_interpreter_cells_warms_up_both_supervisors_then_alternates_their_order(monkeypatch, capsys):
    import contextlib

    bench = load_benchmark("interpreter_cells")
    runs: list[tuple[bool, int]] = []

    def fake_drive(sb, sessions, cells, threads, walk):
        runs.append((walk, sessions))
        return (1.0, 100.0, 5.0) if not walk else (0.5, 6.0, 5.0)

    monkeypatch.setattr(bench, "drive", fake_drive)
    monkeypatch.setattr(bench.sandbox, "open_sandbox", lambda name: contextlib.nullcontext(None))
    monkeypatch.setattr(sys, "argv", ["interpreter_cells.py", "--sessions", "16", "--background", "0", "--rounds", "3"])
    bench.main()
    assert runs == [(False, 8), (True, 8), (False, 16), (True, 16), (True, 16), (False, 16), (False, 16), (True, 16)]
    out = capsys.readouterr().out
    assert "before: wall 1.0 s" in out and "sandbox CPU 100.0 ms a cell" in out and "now: wall 0.5 s" in out
    # the "before" supervisor is today's with the children walk switched off, nothing else changed
    before, now = bench.supervisor_source(False), bench.supervisor_source(True)
    assert now != before and now.replace(bench.WALK, "CHILDREN_FILES = False") == before
