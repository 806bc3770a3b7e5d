"""Sharded evaluation: shards of whole problems at their own seeds, staged so an interrupted eval resumes without
redoing them, and `harness eval --executor ray --workers N` on the two-node test cluster equal to the in-process eval."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.cli import app
from opd_harness.evaluation import EVAL_SHARD_SAMPLES, evaluate_shard, evaluate_task, shard_problems
from opd_harness.registry import TASKS
from opd_harness.tasks.synthetic.arith import ArithOptions
import test_swebench

ArithTask = TASKS.get("arith")  # named by the registry, as the CLI makes it

runner = CliRunner()
tiny = test_swebench.tiny  # the tiny SWE-bench instance (a module fixture) and its repository's specs
TINY_SPECS = {test_swebench.VERSION: {"python": "3.9", "test_cmd": "python -m unittest -v"},
              test_swebench.RUNNER_VERSION: {"python": "3.9", "test_cmd": "python tests/runtests.py"}}  # fmt: skip
SHORT = ArithOptions(max_new_tokens=12)  # tiny-model completions stay short: fast on CPU
TINY_ARGS = ["--task", "arith", "--k", "2", "--limit", "6", "--shard-size", "2", "--task-arg", "arith.max_new_tokens=12", "--json"]


def stored_samples(out: Path) -> list[tuple]:
    """Every stored sample of ``out``'s store: (task, problem, sample index, completion, score, status), sorted."""
    with sqlite3.connect(out / "results.sqlite") as conn:
        return conn.execute("SELECT task, problem_id, sample_index, completion, score, status FROM samples ORDER BY 1, 2, 3").fetchall()


def run_status(out: Path) -> list[str]:
    with sqlite3.connect(out / "results.sqlite") as conn:
        return [row[0] for row in conn.execute("SELECT status FROM runs ORDER BY created_at")]


@pytest.fixture
def tiny_model_dir(tmp_path, char_tokenizer, tiny_model_factory) -> Path:
    from opd_harness.models.tiny import save_model_and_tokenizer

    path = tmp_path / "tiny"
    save_model_and_tokenizer(tiny_model_factory(seed=1), char_tokenizer, path)
    return path


def arith_replay(tmp_path: Path, n: int = 6) -> Path:
    """A replay file answering the first ``n`` arith test problems, every other one wrongly."""
    problems = ArithTask(ArithOptions()).load("test")[:n]
    path = tmp_path / "outputs.jsonl"
    rows = [{"task": "arith", "id": p.id, "completion": f"\\boxed{{{int(p.answer) + i % 2}}}"} for i, p in enumerate(problems)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_shards_hold_whole_problems_and_sample_independently_of_the_others(tiny_model_factory, char_tokenizer):
    problems = ArithTask(SHORT).load("test")[:6]
    assert [len(s) for s in shard_problems(problems * 30, 4)] == [EVAL_SHARD_SAMPLES // 4] * 11 + [180 - 11 * 16]
    assert [[p.id for p in s] for s in shard_problems(problems, 2, 4)] == [[p.id for p in problems[:4]], [p.id for p in problems[4:]]]
    backend = HFBackend(tiny_model_factory(seed=1), char_tokenizer)
    sampling = SamplingParams(max_new_tokens=12, seed=3)
    whole = evaluate_task(backend, ArithTask(SHORT), problems, k=2, sampling=sampling, shard_size=2, n_resamples=10)
    alone, _ = evaluate_shard(backend, ArithTask(SHORT), problems[2:4], k=2, sampling=sampling, index=1)  # shard 1 by itself
    assert whole.shards == 3 and [(s.problem_id, s.completion) for s in whole.samples[4:8]] == [(s.problem_id, s.completion) for s in alone]
    assert len({s.completion for s in whole.samples}) > 1
    one_shard = evaluate_task(backend, ArithTask(SHORT), problems, k=2, sampling=sampling, shard_size=6, n_resamples=10)
    assert one_shard.shards == 1  # per-episode seeds: the shard size does not change a sample
    assert [(s.problem_id, s.completion) for s in one_shard.samples] == [(s.problem_id, s.completion) for s in whole.samples]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--executor", "ray", "--workers", "0"], "--workers"),
        (["--workers", "2"], "--workers"),
        (["--ray-address", "127.0.0.1:1"], "--ray-address"),
        (["--executor", "dask"], "--executor"),
        (["--shard-size", "0"], "--shard-size"),
        (["--max-sandboxes", "2"], "--max-sandboxes"),
        (["--executor", "ray", "--max-sandboxes", "0"], "--max-sandboxes"),
        (["--actor-timeout", "60"], "--actor-timeout"),
        (["--actor-restart-timeout", "60"], "--actor-restart-timeout"),
        (["--executor", "ray", "--actor-timeout", "0"], "--actor-timeout"),
    ],
)
def test_bad_placement_flags_exit_2_naming_the_flag_before_anything_is_written(tmp_path, flags, named):
    out = tmp_path / "out"
    model = arith_replay(tmp_path)
    result = runner.invoke(app, ["eval", "--backend", "replay", "--model", str(model), "--task", "arith", "--out", str(out), *flags])
    assert result.exit_code == 2 and named in result.output, result.output
    assert not out.exists()


def test_an_interrupted_eval_resumes_without_redoing_staged_shards(tmp_path, monkeypatch):
    import opd_harness.evaluation

    model, out = arith_replay(tmp_path), tmp_path / "out"
    args = ["eval", "--backend", "replay", "--model", str(model), "--task", "arith", "--k", "1", "--limit", "6", "--shard-size", "2",
            "--out", str(out), "--json"]  # fmt: skip
    fresh = runner.invoke(app, [*args[:-3], "--out", str(tmp_path / "fresh"), "--json"])
    assert fresh.exit_code == 0, fresh.output
    real, ran = opd_harness.evaluation.evaluate_shard, []

    def interrupted_after_one(*a, **kw):
        if ran:
            raise KeyboardInterrupt
        ran.append(kw["index"])
        return real(*a, **kw)

    monkeypatch.setattr(opd_harness.evaluation, "evaluate_shard", interrupted_after_one)
    stopped = runner.invoke(app, args)
    assert stopped.exit_code == 130 and "--resume" in stopped.output and run_status(out) == ["interrupted"]
    (run_id,) = [p.name for p in (out / "runs").iterdir()]
    assert len(list((out / "runs" / run_id / "eval_shards").rglob("*.json"))) == 1

    def counted(*a, **kw):
        ran.append(kw["index"])
        return real(*a, **kw)

    monkeypatch.setattr(opd_harness.evaluation, "evaluate_shard", counted)
    other = runner.invoke(app, [*args, "--resume", run_id, "--k", "2"])
    assert other.exit_code == 2 and "other k" in " ".join(other.output.split())
    resumed = runner.invoke(app, [*args, "--resume", run_id])
    assert resumed.exit_code == 0, resumed.output
    assert ran == [0, 1, 2]  # shard 0 ran once, before the interruption
    summary = json.loads(resumed.stdout)["tasks"]["arith"]
    assert summary["shards"] == 3 and summary["shards_reused"] == 1 and run_status(out) == ["done"]
    assert stored_samples(out) == stored_samples(tmp_path / "fresh") and len(stored_samples(out)) == 6
    assert not list((out / "runs" / run_id / "eval_shards").rglob("*.json"))  # staging is dropped once stored
    again = runner.invoke(app, [*args, "--resume", run_id])  # a finished eval resumed: its stored results, nothing run
    assert again.exit_code == 0 and ran == [0, 1, 2] and json.loads(again.stdout)["tasks"]["arith"]["avg_at_k"] == summary["avg_at_k"]


@pytest.mark.slow
def test_an_eval_killed_with_sigkill_resumes_from_its_staged_shards(tmp_path, tiny_model_dir):
    """The driver process SIGKILLed once a shard is staged (no handler runs): `--resume` reuses every staged shard,
    runs the rest, and stores what an uninterrupted eval stores."""
    import subprocess
    import sys
    import time

    args = ["eval", "--model", str(tiny_model_dir), "--task", "arith", "--k", "1", "--limit", "12", "--shard-size", "1",
            "--task-arg", "arith.max_new_tokens=24", "--json"]  # fmt: skip
    out = tmp_path / "killed"
    log = tmp_path / "killed.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "opd_harness.cli", *args, "--out", str(out)], stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while not list(out.glob("runs/*/eval_shards/step0/arith/*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    staged = list(out.glob("runs/*/eval_shards/step0/arith/*.json"))
    assert proc.returncode == -signal.SIGKILL and 1 <= len(staged) < 12, log.read_text()[-2000:]
    run_id = staged[0].parts[-5]
    resumed = runner.invoke(app, [*args, "--out", str(out), "--resume", run_id])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["tasks"]["arith"]["shards_reused"] >= len(staged)  # a shard staged during the kill counts too
    fresh = runner.invoke(app, [*args, "--out", str(tmp_path / "fresh")])
    assert fresh.exit_code == 0 and stored_samples(out) == stored_samples(tmp_path / "fresh") and len(stored_samples(out)) == 12


def tool_replay(tmp_path: Path, n: int = 4) -> tuple[Path, dict]:
    """A replay file of agents that answer the first ``n`` arith_tool test problems with one interpreter call (every other
    one wrongly), and the task options that run their calls in the local sandbox."""
    args = {"arith_tool": {"sandbox": "local"}}
    problems = TASKS.get("arith_tool")(TASKS.get("arith_tool").Options(**args["arith_tool"])).load("test")[:n]
    call, boxed = "<code>\n```python\nprint({})\n```\n</code>", "<answer>\\boxed{{{}}}</answer>"
    rows = [{"task": "arith_tool", "id": p.id, "turns": [call.format(p.meta.get("expression", "1")), boxed.format(int(p.answer) + i % 2)]}
            for i, p in enumerate(problems)]  # fmt: skip
    path = tmp_path / "tool_agents.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path, args


def test_an_eval_worker_under_max_sandboxes_closes_its_sandbox_after_each_shard(tmp_path):
    """The worker side of ``max_sandboxes``: a sandboxed task's sandbox is open only while a shard runs (the next shard
    opens it again); without the bound it stays open for the next shard, as before."""
    import torch

    from opd_harness.evaluation import EvalWorkerSpec
    from opd_harness.trainers.ray_eval import EvalWorker

    model, args = tool_replay(tmp_path, 2)
    problems = TASKS.get("arith_tool")(TASKS.get("arith_tool").Options(**args["arith_tool"])).load("test")[:2]
    threads = torch.get_num_threads()
    try:
        for per_shard in (True, False):
            worker = EvalWorker(EvalWorkerSpec("replay", str(model), {}, args, sandbox_per_shard=per_shard), 1)
            assert worker.ready() is None
            rows = [row for i in range(2) for row in worker.run_shard("arith_tool", problems[i : i + 1], 1, SamplingParams(), i)]
            assert [row.status for row in rows] == ["pass", "fail"]
            assert (worker.tasks["arith_tool"]._sandbox is None) is per_shard
            worker.close()
    finally:
        torch.set_num_threads(threads)


# ---- on the two-node test cluster


@pytest.mark.slow
def test_ray_eval_on_two_nodes_equals_in_process_and_resumes(tmp_path, tiny_model_dir, ray_cluster, monkeypatch):
    """Math with the tiny model: 3 shards over 2 workers (one per node) store what the in-process eval stores; a run
    interrupted after its first staged shard resumes on the workers and runs only the other two."""
    import opd_harness.evaluation

    base = ["eval", "--model", str(tiny_model_dir), *TINY_ARGS]
    inproc = runner.invoke(app, [*base, "--out", str(tmp_path / "inproc")])
    assert inproc.exit_code == 0, inproc.output
    ray_args = [*base, "--executor", "ray", "--ray-address", ray_cluster.address, "--workers", "2", "--out", str(tmp_path / "ray")]
    real_save, saved = opd_harness.evaluation.ShardStage.save, []

    def save_then_stop(self, key, samples):
        real_save(self, key, samples)
        saved.append(key["index"])
        raise KeyboardInterrupt

    monkeypatch.setattr(opd_harness.evaluation.ShardStage, "save", save_then_stop)
    stopped = runner.invoke(app, ray_args)
    assert stopped.exit_code == 130 and len(saved) == 1, stopped.output
    assert "2 workers on 2 node(s)" in stopped.output
    counted = lambda self, key, samples: (saved.append(key["index"]), real_save(self, key, samples))  # noqa: E731
    monkeypatch.setattr(opd_harness.evaluation.ShardStage, "save", counted)
    run_id = next((tmp_path / "ray" / "runs").iterdir()).name
    resumed = runner.invoke(app, [*ray_args, "--resume", run_id])
    assert resumed.exit_code == 0, resumed.output
    assert sorted(saved) == [0, 1, 2] and json.loads(resumed.stdout)["tasks"]["arith"]["shards_reused"] == 1
    assert stored_samples(tmp_path / "ray") == stored_samples(tmp_path / "inproc") and len(stored_samples(tmp_path / "inproc")) == 12


def restarted_pid(ray, worker, timeout_s: float = 120.0) -> int:
    """The worker's process id once it answers again (while Ray restarts it, calls fail as unavailable)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(worker.pid.remote())
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.mark.slow
def test_a_killed_eval_worker_is_restarted_and_its_shard_requeued(tmp_path, tiny_model_dir, ray_cluster):
    """SIGKILL a worker once the first shard is in: the shard it holds (or the next one it is handed while Ray restarts
    it) goes back to the queue, the workers finish the rest, every (problem, sample) is stored once and equals the
    in-process result."""
    import torch
    from rich.console import Console

    from opd_harness.evaluation import EvalWorkerSpec
    from opd_harness.trainers.ray_eval import RAY_EVAL

    problems = ArithTask(SHORT).load("test")[:6]
    sampling = SamplingParams(max_new_tokens=12, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers compute
    try:
        reference = evaluate_task(HFBackend.load(str(tiny_model_dir)), ArithTask(SHORT), problems, k=2, sampling=sampling, shard_size=2)
    finally:
        torch.set_num_threads(threads)
    spec = EvalWorkerSpec("hf", str(tiny_model_dir), {}, {"arith": {"max_new_tokens": 12}})
    with RAY_EVAL.open(spec, workers=2, address=ray_cluster.address, console=Console(stderr=True)) as shards:
        import ray

        pids = ray.get([worker.pid.remote() for worker in shards.workers])

        def kill_workers(done: int, total: int) -> None:
            if done == 1:
                os.kill(pids[0], signal.SIGKILL)

        result = evaluate_task(None, ArithTask(SHORT), problems, k=2, sampling=sampling, shard_size=2, runner=shards, on_shard=kill_workers)
        assert shards.requeued >= 1
        assert restarted_pid(ray, shards.workers[0]) != pids[0]  # Ray restarted it: a new process
    rows = [(s.problem_id, s.sample_index, s.completion, s.status) for s in result.samples]
    assert rows == [(s.problem_id, s.sample_index, s.completion, s.status) for s in reference.samples]
    assert len({(p, i) for p, i, *_ in rows}) == len(rows) == 12


EVAL_SHARD_TIMEOUT_S = 10.0  # --actor-timeout of the hung-shard test: a tiny shard takes ~1 s


@pytest.mark.slow
def test_a_hung_eval_worker_under_actor_timeout_is_killed_restarted_and_its_shard_requeued(tmp_path, tiny_model_dir, ray_cluster,
                                                                                         monkeypatch):  # fmt: skip
    """harness eval --executor ray --actor-timeout: the first shard a worker takes hangs (a worker subclass shipped by
    value sleeps in it), so that worker is killed once within the timeout, Ray restarts it, the shard goes back to the
    queue and every stored sample equals the in-process eval's (before, a hung worker stalled the eval for ever: there
    was no such flag)."""
    import time

    import ray

    import opd_harness.trainers.ray_eval as re_

    base = ["eval", "--model", str(tiny_model_dir), *TINY_ARGS]
    inproc = runner.invoke(app, [*base, "--out", str(tmp_path / "inproc")])
    assert inproc.exit_code == 0, inproc.output
    marker, kills, shards_of = str(tmp_path / "shard-hung"), [], []
    original_kill, original_init = ray.kill, re_.RayShards.__init__

    class HangingShardWorker(re_.EvalWorker):
        def run_shard(self, *args, **kwargs):
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))  # the first shard of either worker only
            except FileExistsError:
                return re_.EvalWorker.run_shard(self, *args, **kwargs)
            time.sleep(300)  # a shard stuck (a sandbox or an endpoint that never answers)
            return re_.EvalWorker.run_shard(self, *args, **kwargs)

    def kill(actor, *, no_restart=True):
        if not no_restart:  # a kill for Ray to restart (the eval's end kills for good)
            kills.append(time.monotonic())
        return original_kill(actor, no_restart=no_restart)

    monkeypatch.setattr(re_, "EvalWorker", HangingShardWorker)
    monkeypatch.setattr(ray, "kill", kill)
    monkeypatch.setattr(re_.RayShards, "__init__", lambda self, *a, **kw: (shards_of.append(self), original_init(self, *a, **kw))[1])
    started = time.monotonic()
    result = runner.invoke(app, [*base, "--executor", "ray", "--ray-address", ray_cluster.address, "--workers", "2",
                                 "--actor-timeout", str(EVAL_SHARD_TIMEOUT_S), "--out", str(tmp_path / "ray")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert os.path.exists(marker) and len(kills) == 1 and shards_of[0].kills == 1 and shards_of[0].requeued >= 1, kills
    assert f"hung (no answer within --actor-timeout={EVAL_SHARD_TIMEOUT_S:g}s" in " ".join(result.output.split())
    assert time.monotonic() - started < 300  # the hung shard's sleep did not end the wait
    assert stored_samples(tmp_path / "ray") == stored_samples(tmp_path / "inproc") and len(stored_samples(tmp_path / "inproc")) == 12


@pytest.mark.slow
@pytest.mark.docker
def test_ray_eval_of_a_docker_code_task_and_a_retool_replay_equals_in_process(tmp_path, ray_cluster, benchmark_data, docker_client):
    """HumanEval+ graded in each worker's own Docker sandboxes and ReTool episodes whose tool calls run there, replayed
    (right and wrong agents): the sharded eval stores exactly the in-process eval's samples and scores."""
    from opd_harness.plan import make_task

    data = benchmark_data(f"humaneval_plus/{TASKS.get('humaneval_plus').file_name}", "aime24/test.jsonl")
    code = make_task("humaneval_plus", {}).load("test", data)[:3]
    lines = [{"task": "humaneval_plus", "id": p.id, "completion": f"```python\n{p.solution if i != 1 else 'def nothing(): pass'}\n```"}
             for i, p in enumerate(code)]  # fmt: skip
    aime = [json.loads(line) for line in (data / "aime24" / "test.jsonl").read_text().splitlines()[:3]]
    call, boxed = "<code>\n```python\nprint({})\n```\n</code>", "<answer>\\boxed{{{}}}</answer>"
    turns = [[call.format(row["answer"]), boxed.format(row["answer"])] for row in aime[:2]] + [["<code>print(1)</code>", boxed.format(0)]]
    lines += [{"task": "retool:aime24", "id": row["id"], "turns": t} for row, t in zip(aime, turns, strict=True)]
    replay = tmp_path / "agents.jsonl"
    replay.write_text("".join(json.dumps(line) + "\n" for line in lines))
    base = ["eval", "--backend", "replay", "--model", str(replay), "--task", "humaneval_plus,retool:aime24", "--k", "1", "--limit", "3",
            "--shard-size", "1", "--data-dir", str(data), "--json"]  # fmt: skip
    inproc = runner.invoke(app, [*base, "--out", str(tmp_path / "inproc")])
    assert inproc.exit_code == 0, inproc.output
    ray_args = ["--executor", "ray", "--ray-address", ray_cluster.address, "--workers", "2", "--out", str(tmp_path / "ray")]
    sharded = runner.invoke(app, [*base, *ray_args])
    assert sharded.exit_code == 0, sharded.output
    assert stored_samples(tmp_path / "ray") == stored_samples(tmp_path / "inproc")
    summaries = json.loads(sharded.stdout)["tasks"]
    assert summaries["humaneval_plus"]["n_pass"] == 2 and summaries["retool:aime24"]["n_pass"] == 2
    assert summaries["retool:aime24"]["shards"] == 3 and summaries["retool:aime24"]["mean_tool_calls"] > 0



@pytest.mark.slow
@pytest.mark.docker
def test_ray_eval_of_a_swebench_replay_grades_on_the_worker(tiny, tmp_path, ray_cluster):
    """The tiny SWE-bench instance (its repository registered in the workers too, by a Ray setup hook): the gold patch
    and one that breaks PASS_TO_PASS, graded on the workers in the images they build or find, equal the in-process eval."""
    import functools

    import ray

    from opd_harness.tasks.swebench import upstream

    root, patches = tiny
    data = root / "data"
    model = tmp_path / "patches.jsonl"
    rows = [{"task": "swebench", "id": test_swebench.IID, "completion": patches[name]} for name in ("gold", "breaks_p2p")]
    model.write_text("".join(json.dumps(row) + "\n" for row in rows))
    base = ["eval", "--task", "swebench", "--backend", "replay", "--model", str(model), "--k", "2", "--shard-size", "1", "--json",
            "--data-dir", str(data), "--task-arg", f"swebench.dataset={data / 'swebench' / 'tiny.jsonl'}",
            "--task-arg", f"swebench.cache_dir={root / 'cache'}"]  # fmt: skip
    inproc = runner.invoke(app, [*base, "--out", str(tmp_path / "inproc")])
    assert inproc.exit_code == 0, inproc.output
    hook = functools.partial(upstream.register_repo, test_swebench.REPO, TINY_SPECS, parser="django/django")
    hook.__name__ = "register_tinycalc"  # Ray names a setup hook by it
    ray.init(address=ray_cluster.address, runtime_env={"worker_process_setup_hook": hook}, logging_level="ERROR")
    try:  # the eval joins this Ray (initialised already) and leaves it running
        sharded = runner.invoke(app, [*base, "--executor", "ray", "--workers", "1", "--out", str(tmp_path / "ray")])
    finally:
        ray.shutdown()
    assert sharded.exit_code == 0, sharded.output
    assert stored_samples(tmp_path / "ray") == stored_samples(tmp_path / "inproc")
    assert [row[-1] for row in stored_samples(tmp_path / "ray")] == ["pass", "fail"]


@pytest.mark.slow
def test_max_sandboxes_bounds_the_sandboxed_shards_in_flight_per_node(tmp_path, ray_cluster):
    """4 workers on the two nodes (2 each) and a sandboxed tool task (the local sandbox): unbounded, both workers of a
    node hold a shard (and its sandbox) at once; with max_sandboxes 1, one per node at a time. Both store exactly the
    in-process eval's samples."""
    from rich.console import Console

    from opd_harness.backends.replay import ReplayBackend
    from opd_harness.evaluation import EvalWorkerSpec
    from opd_harness.trainers.ray_eval import RAY_EVAL

    model, args = tool_replay(tmp_path, 4)
    task_of = lambda: TASKS.get("arith_tool")(TASKS.get("arith_tool").Options(**args["arith_tool"]))  # noqa: E731
    problems = task_of().load("test")[:4]
    rows = lambda result: [(s.problem_id, s.sample_index, s.completion, s.status) for s in result.samples]  # noqa: E731
    reference = rows(evaluate_task(ReplayBackend.load(str(model)), task_of(), problems, k=1, sampling=SamplingParams(), shard_size=1))
    assert [r[-1] for r in reference] == ["pass", "fail", "pass", "fail"]
    spec = EvalWorkerSpec("replay", str(model), {}, args)
    for bound, peak in ((None, 2), (1, 1)):
        with RAY_EVAL.open(spec, workers=4, address=ray_cluster.address, console=Console(stderr=True), max_sandboxes=bound) as shards:
            assert sorted(Counter(shards.node_of.values()).values()) == [2, 2]  # SPREAD: two workers on each node
            result = evaluate_task(None, task_of(), problems, k=1, sampling=SamplingParams(), shard_size=1, runner=shards)
            assert rows(result) == reference
            assert dict(shards.peak_sandboxes) == {node: peak for node in ray_cluster.node_ids.values()}, shards.peak_sandboxes
