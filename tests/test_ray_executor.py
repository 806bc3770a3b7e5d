"""Ray executor: the same tiny run under --executor inprocess and --executor ray gives the same losses, lags and evals."""

import importlib.util
import json
import os
import re
import shutil
import sqlite3
import tempfile
import time

import pytest
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.config import ConfigError, build_config
from opd_harness.trainers.weight_sync import Published
from ray_cluster import driver_output

runner = CliRunner()
BASE = [
    "run",
    "--task",
    "arith",
    "--preset",
    "smoke",
    "--set",
    "threads=1",
    "--set",
    "eval.teacher=false",
    "--set",
    "eval.before_training=false",
]


def test_executor_flag_is_validated(tmp_path, monkeypatch):
    assert build_config(cli={"trainer": {"executor": "ray"}}).trainer.executor == "ray"
    result = runner.invoke(app, ["run", "--out", str(tmp_path), "--executor", "threads"])
    assert result.exit_code == 2 and "trainer.executor" in result.output
    with pytest.raises(ConfigError, match="ray_address"):
        build_config(overrides=["trainer.ray_address=127.0.0.1:6379"])
    original = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "ray" else original(name, *a, **k))
    result = runner.invoke(app, ["run", "--out", str(tmp_path), "--mode", "async", "--executor", "ray"])
    assert result.exit_code == 2
    message = " ".join(result.output.split())
    assert "--executor ray needs Ray" in message and "pip install 'opd-harness[ray]'" in message


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the module (as environment.md §4 sets it up): 2 CPUs, 512 MiB object store, no auth token."""
    ray = pytest.importorskip("ray")
    saved = {key: os.environ.get(key) for key in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    temp_dir = tempfile.mkdtemp(prefix="opd-ray-")  # short: Ray's socket paths must stay under 108 characters
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=512 * 2**20, _temp_dir=temp_dir)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def run(out, *extra) -> tuple[dict[int, dict[str, float]], list[dict], dict[int, float]]:
    """Run the CLI into ``out`` (shared, so the tiny models are built once); (step metrics, checkpoints, Avg@k by step)."""
    db = out / "results.sqlite"
    before = _train_runs(db)
    result = runner.invoke(app, [*BASE, "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    (run_id,) = _train_runs(db) - before
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT step, name, value FROM step_metrics WHERE run_id=?", (run_id,)).fetchall()
        checkpoints = [
            json.loads(m) for (m,) in conn.execute("SELECT metrics_json FROM checkpoints WHERE run_id=? ORDER BY step", (run_id,))
        ]
        evals = dict(conn.execute("SELECT step, avg_at_k FROM evals WHERE run_id=?", (run_id,)).fetchall())
        (status,) = conn.execute("SELECT status FROM runs WHERE run_id=?", (run_id,)).fetchone()
    assert status == "done"
    metrics: dict[int, dict[str, float]] = {}
    for step, name, value in rows:
        metrics.setdefault(step, {})[name] = value
    return metrics, checkpoints, evals


def _train_runs(db) -> set[str]:
    if not db.exists():
        return set()
    with sqlite3.connect(db) as conn:
        return {r for (r,) in conn.execute("SELECT run_id FROM runs WHERE kind='train'")}


def assert_same_run(a: dict, b: dict) -> None:
    """Same steps, losses within 1e-5, and identical behaviour versions and lags."""
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert [b[s]["loss"] for s in b] == pytest.approx([a[s]["loss"] for s in b], abs=1e-5)
    for name in ("behaviour_version", "lag_mean", "lag_max"):
        assert [b[s][name] for s in sorted(b)] == [a[s][name] for s in sorted(a)], name


@pytest.mark.slow
def test_ray_executor_matches_inprocess(tmp_path, ray_session):
    started = time.perf_counter()
    lag = [
        "--method",
        "f_opd",
        "--mode",
        "async",
        "--set",
        "trainer.fixed_lag=1",
        "--set",
        "trainer.warmup_steps=3",
    ]  # warm-up: the LR schedule crosses checkpoints
    inprocess, inprocess_ckpts, inprocess_evals = run(tmp_path, *lag)
    on_ray, ray_ckpts, ray_evals = run(tmp_path, *lag, "--executor", "ray")
    assert_same_run(inprocess, on_ray)
    assert [on_ray[s]["behaviour_version"] for s in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert ray_evals == inprocess_evals and sorted(ray_evals) == [2, 4]  # checkpoints evaluate the learner's pulled weights
    for step in on_ray.values():
        assert {
            "idle_ratio_rollout",
            "idle_ratio_learner",
            "samples_per_s",
            "tokens_per_s",
            "time_generate_s",
            "time_teacher_s",
            "time_train_s",
        } <= set(step)
    final = ray_ckpts[-1]
    assert final["staleness_hist"] == inprocess_ckpts[-1]["staleness_hist"] == {"0": 8, "1": 24}
    assert {"generate", "teacher", "wait"} <= set(final["rollout_seconds"]) and {"train", "wait"} <= set(final["learner_seconds"])
    # sync mode on Ray is the async schedule with max_lag 0: the synchronous losses
    sync, _, _ = run(tmp_path, "--method", "opd")
    sync_on_ray, _, _ = run(tmp_path, "--method", "opd", "--executor", "ray")
    assert sorted(sync) == sorted(sync_on_ray) == [1, 2, 3, 4]
    assert [sync_on_ray[s]["loss"] for s in range(1, 5)] == pytest.approx([sync[s]["loss"] for s in range(1, 5)], abs=1e-5)
    assert [(m["behaviour_version"], m["lag_max"]) for _, m in sorted(sync_on_ray.items())] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    print(f"ray executor test: {time.perf_counter() - started:.1f}s")


STARTUP_LIMIT_S = 45  # trainer.actor_restart_timeout_s of the start-up test: every other actor starts within it


@pytest.mark.slow
def test_a_learner_whose_run_folder_check_hangs_stops_the_run_within_the_call_timeout(tmp_path, ray_session, monkeypatch):
    """trainer.actor_timeout_s bounds the learner's run-folder check too (before, wait_ready waited for ever on a shared
    filesystem that hangs instead of failing): the learner's check sleeps (a subclass defined here, shipped to the worker
    by value), so the run stops with exit 2 and one line naming the key and the run folder, before training."""
    import opd_harness.trainers.ray_executor as rx

    class HangingFolderLearner(rx.LearnerActor):
        def sees_run_folder(self, folder: str, token: str) -> str | None:
            time.sleep(3600)  # a read stuck on a filesystem that never answers
            return None

    monkeypatch.setattr(rx, "LearnerActor", HangingFolderLearner)
    monkeypatch.setattr(rx, "CLOSE_TIMEOUT_S", 5.0)  # the hung actor never answers close(); it is killed after this
    started = time.monotonic()
    result = runner.invoke(app, [*BASE, "--out", str(tmp_path), "--executor", "ray", "--set", "trainer.actor_timeout_s=20"])
    line = "".join(result.output.split())  # the console wraps the long path anywhere
    assert result.exit_code == 2 and "Traceback" not in driver_output(result.output), result.output
    assert "thelearnerdidnotanswerwithintrainer.actor_timeout_s=20swhenitcheckedtherunfolder" in line, result.output[-2000:]
    assert time.monotonic() - started < 300
    (run_id,) = _train_runs(tmp_path / "results.sqlite")
    with sqlite3.connect(tmp_path / "results.sqlite") as conn:
        assert conn.execute("SELECT COUNT(*) FROM step_metrics WHERE run_id=?", (run_id,)).fetchone() == (0,)


@pytest.mark.slow
def test_an_actor_start_up_past_its_limit_ends_the_run_failed_with_one_line_naming_the_role_and_node(tmp_path, ray_session, monkeypatch):
    """trainer.actor_restart_timeout_s bounds the actors' start-up too (before, wait_ready waited for ever): the rollout
    actor's constructor hangs (a subclass defined here, so Ray ships it to the worker by value, sleeps in ``__init__``),
    so the run stops failed after the limit, with one line naming the rollout role (the first actor waited for)
    and its node and the resume command, and nothing trained. The limit bounds every start-up, the evaluation worker's
    too, so it is long enough for a real one on a busy machine (STARTUP_LIMIT_S)."""
    import opd_harness.trainers.ray_executor as rx

    class HangingRollout(rx.RolloutActor):
        def __init__(self, *args, **kwargs) -> None:
            time.sleep(3600)  # a start-up that never finishes (a model load stuck on a filesystem, a device that never answers)

    monkeypatch.setattr(rx, "RolloutActor", HangingRollout)
    monkeypatch.setattr(rx, "CLOSE_TIMEOUT_S", 5.0)  # the hung actor never answers close(); it is killed after this
    started = time.monotonic()
    limit = f"trainer.actor_restart_timeout_s={STARTUP_LIMIT_S}"
    result = runner.invoke(app, [*BASE, "--out", str(tmp_path), "--executor", "ray", "--set", limit])
    line = " ".join(result.output.split())
    node = ray_session.get_runtime_context().get_node_id()
    assert result.exit_code == 1 and "Traceback" not in driver_output(result.output), result.output
    assert re.search(rf"\berror: run \S+ failed: rollout did not start within {re.escape(limit)}s \(on node {node}\)",
                     line), line[-2000:]  # fmt: skip
    assert "continue from the start (no checkpoint yet) with: harness run --resume" in line
    assert time.monotonic() - started < 300  # the limit ended the wait (Ray kills the sleeping actor at the run's end)
    (run_id,) = _train_runs(tmp_path / "results.sqlite")
    with sqlite3.connect(tmp_path / "results.sqlite") as conn:
        assert conn.execute("SELECT status FROM runs WHERE run_id=?", (run_id,)).fetchone() == ("failed",)
        assert conn.execute("SELECT COUNT(*) FROM step_metrics WHERE run_id=?", (run_id,)).fetchone() == (0,)


class _Recorder:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def close(self) -> None:
        self.log.append(f"close {self.name}")


def test_actors_release_their_tasks_and_engines_before_they_are_killed(monkeypatch):
    """``ray.kill`` skips an actor's exit hooks, so the executor asks every actor to close (task sandboxes,
    inference engine) first; a dead actor does not stop the others from being killed."""
    from types import SimpleNamespace

    import opd_harness.trainers.ray_executor as rx

    log: list[str] = []
    role = rx.ActorRole()
    role.plan = SimpleNamespace(task=_Recorder(log, "train task"), eval_tasks=[_Recorder(log, "eval task")])
    role.backend = _Recorder(log, "engine")
    role.close()
    assert sorted(log) == ["close engine", "close eval task", "close train task"]

    class FakeActor:
        def __init__(self, name: str) -> None:
            self.name = name
            self.close = SimpleNamespace(remote=lambda: log.append(f"close {name}") or name)

    class FakeRay:
        def get(self, refs, timeout=None):
            log.append(f"get {refs} timeout={timeout}")
            raise RuntimeError("one actor died")

        def kill(self, actor) -> None:
            log.append(f"kill {actor.name}")

    log.clear()
    actors = ([FakeActor("rollout")], [FakeActor("teacher")], [FakeActor("learner")], ())  # one replica of each, one learner rank
    learner_role = SimpleNamespace(killed=False, ranks=actors[2])
    monkeypatch.setattr(rx, "import_ray", lambda: FakeRay())
    monkeypatch.setattr(rx, "start_actors", lambda *a, **k: actors)
    monkeypatch.setattr(rx, "RayRollout", lambda *a, **k: "rollout role")
    monkeypatch.setattr(rx, "RayLearner", lambda *a, **k: learner_role)
    monkeypatch.setattr(rx, "mark_run_folder", lambda session: ("/runs/r1", "token"))
    monkeypatch.setattr(rx, "checkpoint_evaluation", lambda *a, **k: __import__("contextlib").nullcontext())  # no eval workers
    trainer = SimpleNamespace(layout=None, actor_timeout_s=900.0, actor_restart_timeout_s=300.0, weight_sync="object_store")
    plan = SimpleNamespace(config=SimpleNamespace(threads=1, trainer=trainer))
    session = SimpleNamespace(optimizer=None, teacher="a served teacher's client")  # its reference evaluation stays here
    with rx.RayExecutor().roles(plan, session, board=None, console=rx.Console(quiet=True)) as roles:
        assert roles.rollouts == ["rollout role"] and roles.learner is learner_role and log == []
    assert log[:3] == ["close rollout", "close teacher", "close learner"]
    assert log[3].startswith("get ['rollout', 'teacher', 'learner']")
    assert log[4:] == ["kill rollout", "kill teacher", "kill learner"]


@pytest.mark.slow
def test_an_error_inside_an_actor_reaches_the_driver_as_itself(ray_session):
    """Ray wraps an actor's exception in a RayTaskError whose message is the remote traceback; the executor re-raises
    the original (its type and its one-line message), as the CLI shows it."""
    import opd_harness.trainers.ray_executor as rx
    from opd_harness.trainers.teacher import TeacherFailed

    @ray_session.remote
    def score() -> None:
        raise TeacherFailed("teacher scoring failed at step 3 after 2 retries")

    with pytest.raises(TeacherFailed) as wrapped:
        ray_session.get(score.remote())
    assert type(wrapped.value) is not TeacherFailed and 'File "' in str(wrapped.value)  # plain ray.get: the remote traceback
    with pytest.raises(TeacherFailed) as caught:
        rx.ray_get(ray_session, score.remote())
    assert type(caught.value) is TeacherFailed and str(caught.value) == "teacher scoring failed at step 3 after 2 retries"


def test_a_lost_rollout_actor_is_waited_for_then_its_batch_is_given_back(monkeypatch):
    """While Ray restarts a dead rollout actor its calls fail fast (ActorUnavailableError): the driver side waits until
    it answers again, forgets the weights it had loaded and raises RolloutLost (the worker re-queues the batch); an
    actor that stays dead (its restarts used up) stops the run with one line."""
    from types import SimpleNamespace

    import ray.exceptions as rex

    import opd_harness.trainers.ray_executor as rx
    from opd_harness.trainers.loop import RolloutLost, Unit

    answers: list = []

    class Call:
        def __init__(self, name: str) -> None:
            self.name = name

        def options(self, **_):
            return self

        def remote(self, *args):
            return (self.name, self.name) if self.name == "generate" else self.name

    class FakeRay:
        exceptions = rex

        def get(self, ref, timeout=None):
            answer = answers.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return answer

    actor = SimpleNamespace(generate=Call("generate"), ready=Call("ready"), load_weights=Call("load"))
    monkeypatch.setattr(rx.time, "sleep", lambda s: None)
    rollout = rx.RayRollout(FakeRay(), SimpleNamespace(method=SimpleNamespace(needs=lambda h: set()), hparams=None), actor, None,
                            SimpleNamespace(get=lambda v: Published("weights", "", 0)))  # fmt: skip
    answers[:] = [None]  # the load is waited for (the actor may run several units at once)
    rollout.load(4)
    assert rollout.version == 4 and answers == []
    unavailable = rex.ActorUnavailableError("restarting", None)
    answers[:] = [rex.ActorDiedError(), unavailable, unavailable, True]  # the batch dies; two tries while it restarts; back
    with pytest.raises(RolloutLost, match="batch 7"):
        rollout.make(Unit(7))
    assert rollout.version == -1 and answers == []  # reloaded before its next batch
    answers[:] = [rex.ActorDiedError(), rex.ActorDiedError()]  # dies again and is not restarted
    with pytest.raises(rx.ActorLost, match="rollout was not restarted by Ray"):
        rollout.make(Unit(8, 3, 4))


def test_teacher_actors_take_batches_least_loaded_first_and_a_dead_one_s_batch_goes_to_another(monkeypatch):
    """Several teacher actors behind one chooser: the replica with the fewest batches in flight scores the next one; a
    replica that dies has the batch re-sent to another; when every replica is down the chooser waits for a restart."""
    from types import SimpleNamespace

    import ray.exceptions as rex

    import opd_harness.trainers.ray_executor as rx

    calls: list[tuple[str, int]] = []
    dead: set[str] = set()

    class Score:
        def __init__(self, name: str) -> None:
            self.name = name

        def options(self, **_):
            return self

        def remote(self, batch, metrics, index):
            calls.append((self.name, index))
            return f"{self.name}:{batch}", ("died" if self.name in dead else {**metrics, "scored_by": self.name})

    class FakeRay:
        exceptions = rex

        def get(self, ref, timeout=None):
            if ref == "died":
                raise rex.ActorDiedError()
            if ref == "ready":
                dead.clear()  # restarted
                return True
            return ref

    actors = [SimpleNamespace(score=Score(n), ready=SimpleNamespace(remote=lambda: "ready")) for n in ("t0", "t1")]
    teachers = rx.TeacherActors(FakeRay(), actors)
    teachers.inflight[0] = 1  # t0 is busy with another worker's batch
    assert teachers.score("b1", {"generate": 1.0}, 1) == ("t1:b1", {"generate": 1.0, "scored_by": "t1"})
    dead.add("t1")
    assert teachers.score("b2", {}, 2) == ("t0:b2", {"scored_by": "t0"}) and calls[-2:] == [("t1", 2), ("t0", 2)]
    teachers.inflight[0] = 0
    dead.update({"t0", "t1"})  # both down: wait for the last one tried to come back, then it scores the batch
    assert teachers.score("b3", {}, 3)[0] in {"t0:b3", "t1:b3"} and teachers.failovers == 3 and teachers.inflight == [0, 0]


def test_device_cuda_under_ray_asks_every_role_for_gpus():
    """trainer.device=cuda with --executor ray no longer refused outright: it asks that every placed role has GPUs (the
    driver's own CUDA is not checked: its models stay on the CPU); cuda:N is Ray's choice, refused."""
    gpus = [f"trainer.layout.{role}.num_gpus=1" for role in ("rollout", "teacher", "learner")]
    assert build_config(overrides=["trainer.executor=ray", "trainer.device=cuda", *gpus]).trainer.device == "cuda"
    with pytest.raises(ConfigError, match=r"trainer\.layout\.teacher\.num_gpus is 0"):
        build_config(overrides=["trainer.executor=ray", "trainer.device=cuda", gpus[0], gpus[2]])
    with pytest.raises(ConfigError, match="Ray picks each actor's GPUs"):
        build_config(overrides=["trainer.executor=ray", "trainer.device=cuda:1", *gpus])


def test_a_restart_past_its_limit_ends_the_run_with_one_line_naming_the_role_and_node(monkeypatch):
    """await_restart: a restart slower than trainer.actor_restart_timeout_s (Ray's GetTimeoutError, which escaped before)
    is ActorLost naming the role and its node, with the resume line."""
    from types import SimpleNamespace

    import ray.exceptions as rex

    import opd_harness.trainers.ray_executor as rx

    class FakeRay:
        exceptions = rex

        def get(self, ref, timeout=None):
            raise rex.GetTimeoutError("slow")

        def nodes(self):
            return []  # no node known dead

    actor = SimpleNamespace(ready=SimpleNamespace(remote=lambda: "ready"))
    faults = rx.Faults(restart_s=2.0, placement={"rollout": "abc123"})
    with pytest.raises(rx.ActorLost, match=r"^rollout did not come back within trainer\.actor_restart_timeout_s=2s .*on node abc123$"):
        rx.await_restart(FakeRay(), actor, "a rollout actor died with batch 3", 3, faults, "rollout")


def test_an_actor_class_built_outside_ray_starts_no_ray():
    """Asking for the assigned GPUs outside an actor must not start a local Ray (``ray.get_gpu_ids`` auto-initialises one):
    a test that builds a role in process would leave it running, and a later ``ray.init(address=...)`` would then join
    the local Ray instead of the cluster (the full suite hung on it once)."""
    import subprocess
    import sys

    code = ("import ray; from opd_harness.trainers.ray_executor import assigned_device; "
            "print(assigned_device(), ray.is_initialized())")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "('cpu', []) False"


LOOKUP_TIMEOUT_S = 8.0  # trainer.actor_timeout_s of the node-lookup test: a node-id answer takes milliseconds


@pytest.mark.slow
def test_an_eval_worker_whose_node_lookup_hangs_is_killed_and_asked_again_and_past_its_restart_limit_named(tmp_path, ray_session):
    """RayShards asks each evaluation worker for its node, bounded like a shard call (before, a hung worker raised Ray's raw
    GetTimeoutError out of ``ray.get(..., timeout=trainer.actor_timeout_s)``): worker 0's answer hangs, so it is killed once
    within trainer.actor_timeout_s, Ray restarts it and it is asked again, while worker 1 answers at once; both nodes are
    recorded. A worker whose answer hangs and whose restart hangs too ends it past trainer.actor_restart_timeout_s with
    one line naming ``eval.N`` and its node."""
    from types import SimpleNamespace

    from rich.console import Console

    from opd_harness.trainers.ray_eval import RayShards
    from opd_harness.trainers.ray_executor import ActorLost, Faults

    class NodeLookupWorker:  # defined here: Ray ships it to the worker by value
        """A stand-in evaluation worker whose node-id answer hangs once while the file ``hang`` exists; its restart hangs
        while ``hang_restart`` exists."""

        def __init__(self, hang: str, hang_restart: str) -> None:
            from pathlib import Path

            self.hang = Path(hang)
            if Path(hang_restart).exists() and Path(f"{hang}.asked").exists():
                time.sleep(3600)  # a restart that never finishes (a model load stuck on a filesystem)

        def ready(self) -> None:
            return None

        def node_id(self) -> str:
            import ray

            if self.hang.exists():
                self.hang.rename(f"{self.hang}.asked")  # once: the restarted worker answers
                time.sleep(3600)
            return ray.get_runtime_context().get_node_id()

    ray = ray_session
    node = ray.get_runtime_context().get_node_id()
    remote = ray.remote(NodeLookupWorker).options(num_cpus=0, max_restarts=1, max_task_retries=0)
    (tmp_path / "w0").touch()
    (tmp_path / "w2").touch()
    (tmp_path / "w2-restart").touch()
    workers = [remote.remote(str(tmp_path / f"w{i}"), str(tmp_path / f"w{i}-restart")) for i in range(3)]
    ray.get([w.ready.remote() for w in workers])
    started = time.monotonic()
    shards = RayShards(ray, workers[:2], Console(), faults=Faults(call_s=LOOKUP_TIMEOUT_S, restart_s=120.0))
    assert shards.kills == 1 and time.monotonic() - started < LOOKUP_TIMEOUT_S + 60, shards.kills
    assert shards.placement() == [node, node] and not (tmp_path / "w0").exists()  # worker 0 was asked again, once restarted
    started = time.monotonic()
    session = SimpleNamespace(run_id="r1", store=SimpleNamespace(root="/out", checkpoints=lambda run_id: []))  # a run's: ActorLost
    with pytest.raises(ActorLost) as lost:
        RayShards(ray, workers[2:], Console(), faults=Faults(LOOKUP_TIMEOUT_S, 5.0, session=session), names=["eval.2"])
    assert re.fullmatch(rf"eval\.2 did not come back within trainer\.actor_restart_timeout_s=5s \(restarted after it died or "
                        rf"hung\); on node {node}; continue from the start \(no checkpoint yet\) with: harness run --resume r1 "
                        r"--out /out", str(lost.value)), str(lost.value)  # fmt: skip
    assert time.monotonic() - started < LOOKUP_TIMEOUT_S + 5.0 + 30
    for worker in workers:
        ray.kill(worker, no_restart=True)


@pytest.mark.slow
def test_an_eval_workers_gpu_lookup_that_hangs_is_killed_and_asked_again(tmp_path, ray_session):
    """The placed evaluation workers' GPU lookup (``devices``, recorded under the run's placement) is bounded like the
    node lookup (before, a hung worker raised Ray's raw GetTimeoutError out of ``ray.get(..., timeout=...)``): worker 0's
    answer hangs once, so it is killed within trainer.actor_timeout_s, restarted and asked again; both answers come back."""
    from rich.console import Console

    from opd_harness.trainers.ray_eval import RayShards
    from opd_harness.trainers.ray_executor import Faults

    class DevicesWorker:  # defined here: Ray ships it to the worker by value
        """A stand-in evaluation worker whose ``devices`` answer hangs once while the file ``hang`` exists."""

        def __init__(self, hang: str) -> None:
            from pathlib import Path

            self.hang = Path(hang)

        def ready(self) -> None:
            return None

        def node_id(self) -> str:
            import ray

            return ray.get_runtime_context().get_node_id()

        def devices(self) -> list[int]:
            if self.hang.exists():
                self.hang.unlink()  # once: the restarted worker answers
                time.sleep(3600)
            return [7]

    ray = ray_session
    remote = ray.remote(DevicesWorker).options(num_cpus=0, max_restarts=1, max_task_retries=0)
    (tmp_path / "w0").touch()
    workers = [remote.remote(str(tmp_path / f"w{i}")) for i in range(2)]
    ray.get([w.ready.remote() for w in workers])
    shards = RayShards(ray, workers, Console(), faults=Faults(call_s=LOOKUP_TIMEOUT_S, restart_s=120.0))
    started = time.monotonic()
    answers = shards.ask_each(workers, "devices", "its GPUs")
    assert [answers.get(id(w)) for w in workers] == [[7], [7]] and shards.kills == 1, (answers, shards.kills)
    assert time.monotonic() - started < LOOKUP_TIMEOUT_S + 60
    for worker in workers:
        ray.kill(worker, no_restart=True)
