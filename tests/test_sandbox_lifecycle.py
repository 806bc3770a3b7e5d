"""Sandbox lifecycle: readiness is checked before anything is written, and no container outlives the process.

The CLI tests run `harness eval` / `harness run` as real subprocesses against the real Docker daemon and
watch the containers labelled with the subprocess's pid while it runs (so a test cannot pass because no
container was ever started) and after it exits: normally, on an exception, and on SIGTERM.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from opd_harness import sandbox
from opd_harness.sandbox import ExecRequest

from conftest import SANDBOX_IMAGE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MISSING_IMAGE = "opd-sandbox:does-not-exist"
# `harness run`: the smoke preset, shortened, evaluating humaneval_plus with a prewarmed pool (the tiny model's
# completions do not parse, so without prewarm no container would be started and the test would prove nothing)
RUN = [
    "run", "--preset", "smoke", "--set", "trainer.steps=2", "--set", "eval.tasks=[humaneval_plus]", "--set", "eval.limit=2",
    "--set", "eval.k=1", "--set", "task_args.humaneval_plus.max_new_tokens=8",
    "--set", "task_args.humaneval_plus.sandbox_options.prewarm=2", "--set", "task_args.humaneval_plus.sandbox_options.pool_size=2",
]  # fmt: skip
# Makes the store refuse humaneval_plus results: an exception after the sandbox has been used.
INJECT_FAILURE = textwrap.dedent("""
    import opd_harness.store
    add_eval = opd_harness.store.Store.add_eval
    def failing_add_eval(self, run_id, step, task, *args, **kwargs):
        if task == "humaneval_plus":
            raise RuntimeError("injected failure")
        return add_eval(self, run_id, step, task, *args, **kwargs)
    opd_harness.store.Store.add_eval = failing_add_eval
""")


@pytest.fixture(scope="module")
def data_dir(benchmark_data) -> Path:
    from opd_harness.tasks.code.evalplus import HumanEvalPlusTask

    return benchmark_data(f"humaneval_plus/{HumanEvalPlusTask.file_name}")


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory) -> dict[str, str]:
    """The subprocesses' environment: this checkout first on the path, a private ground-truth cache, offline."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["HARNESS_CACHE_DIR"] = str(tmp_path_factory.mktemp("code-cache"))
    env["HF_HUB_OFFLINE"] = "1"
    return env


def replay_file(path: Path, data_dir: Path, body: str | None = None) -> Path:
    """Completions for the first two HumanEval+ problems: the canonical solutions, or the prompt with ``body``."""
    with gzip.open(data_dir / "humaneval_plus" / "HumanEvalPlus-v0.1.10.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(2), f, strict=False)]
    with path.open("w") as f:
        for row in rows:
            code = row["prompt"] + (row["canonical_solution"] if body is None else body)
            f.write(json.dumps({"task": "humaneval_plus", "id": row["task_id"], "completion": f"```python\n{code}\n```"}) + "\n")
    return path


def eval_args(replay: Path, data_dir: Path, out: Path, *extra: str, image: str = SANDBOX_IMAGE) -> list[str]:
    return ["eval", "--backend", "replay", "--model", str(replay), "--task", "humaneval_plus", "--k", "1", "--limit", "2",
            "--data-dir", str(data_dir), "--out", str(out),
            "--task-arg", f"humaneval_plus.sandbox_options.image={image}", *extra]  # fmt: skip


def containers_of(client, pid: int) -> list[str]:
    """Ids of the sandbox containers whose owner label names process ``pid`` on this host."""
    from opd_harness.sandbox.docker import LABEL, OWNER_LABEL

    found = client.api.containers(all=True, filters={"label": f"{LABEL}=1"})
    mine = []
    for c in found:
        host, owner_pid, _ = (c.get("Labels") or {}).get(OWNER_LABEL, "::").rsplit(":", 2)
        if host == socket.gethostname() and owner_pid == str(pid):
            mine.append(c["Id"])
    return mine


class Watched:
    """A CLI subprocess, the most containers it was seen holding, and those left after it exited."""

    def __init__(self, returncode: int, stderr: str, pid: int, seen: int, left: list[str], exit_after_signal_s: float | None) -> None:
        self.returncode, self.stderr, self.pid, self.seen, self.left = returncode, stderr, pid, seen, left
        self.exit_after_signal_s = exit_after_signal_s


def watch_cli(client, args: list[str], env: dict, tmp_path: Path, *, inject: str = "", sigterm_when=None,
              timeout_s: float = 900) -> Watched:  # fmt: skip
    """Run the harness CLI (``opd_harness.cli.main``), polling its containers; send SIGTERM once ``sigterm_when(seen)`` holds."""
    code = inject + "\nfrom opd_harness.cli import main\nmain()\n"
    log = tmp_path / f"cli-{time.monotonic_ns()}.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    seen, signalled_at, deadline = 0, None, time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"harness {' '.join(args)} still running after {timeout_s}s:\n{log.read_text()[-3000:]}")
            seen = max(seen, len(containers_of(client, proc.pid)))
            if sigterm_when is not None and signalled_at is None and sigterm_when(seen):
                proc.send_signal(signal.SIGTERM)
                signalled_at = time.monotonic()
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    waited = time.monotonic() - signalled_at if signalled_at is not None else None
    left = containers_of(client, proc.pid)
    remove(client, left)  # recorded for the assertions; never left running whatever they say
    return Watched(proc.returncode, log.read_text(), proc.pid, seen, left, waited)


def remove(client, ids: list[str]) -> None:
    for cid in ids:
        try:
            client.api.remove_container(cid, force=True, v=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def assert_nothing_left(w: Watched) -> None:
    assert w.seen > 0, f"no sandbox container was ever seen for pid {w.pid}: the test proves nothing\n{w.stderr[-3000:]}"
    assert w.left == [], f"{len(w.left)} container(s) of pid {w.pid} outlived it (exit {w.returncode})\n{w.stderr[-3000:]}"


def run_rows(out: Path) -> list[tuple]:
    db = out / "results.sqlite"
    if not db.exists():
        return []
    with sqlite3.connect(db) as conn:
        try:
            return conn.execute("SELECT run_id, kind, status FROM runs").fetchall()
        except sqlite3.OperationalError:  # the store is being created (no tables yet): no run row yet
            return []


# ---------------------------------------------------------------- readiness (item: missing image / daemon)


def test_unreachable_daemon_is_reported_before_any_run():
    """No daemon listens on port 9: the readiness check says so instead of grading every sample as `error`."""
    pytest.importorskip("docker")
    from opd_harness.registry import TASKS
    from opd_harness.task import TaskNotReady
    from opd_harness.tasks.code.evalplus import EvalPlusOptions

    HumanEvalPlusTask = TASKS.get("humaneval_plus")
    task = HumanEvalPlusTask(EvalPlusOptions(sandbox_options={"base_url": "tcp://127.0.0.1:9"}))
    try:
        with pytest.raises(TaskNotReady, match=r"humaneval_plus: Docker daemon unreachable at tcp://127\.0\.0\.1:9 .*start it"):
            task.check_ready()
    finally:
        task.close()


def test_bad_sandbox_options_are_not_ready():
    pytest.importorskip("docker")
    from opd_harness.registry import TASKS
    from opd_harness.task import TaskNotReady
    from opd_harness.tasks.code.evalplus import EvalPlusOptions

    HumanEvalPlusTask = TASKS.get("humaneval_plus")
    with pytest.raises(TaskNotReady, match="humaneval_plus: task option sandbox / sandbox_options: .*no_such_option"):
        HumanEvalPlusTask(EvalPlusOptions(sandbox_options={"no_such_option": 1})).check_ready()


@pytest.mark.docker
def test_missing_image_names_the_build_command(docker_client):
    from opd_harness.registry import TASKS
    from opd_harness.task import TaskNotReady
    from opd_harness.tasks.code.evalplus import EvalPlusOptions

    HumanEvalPlusTask = TASKS.get("humaneval_plus")
    with HumanEvalPlusTask(EvalPlusOptions(sandbox_options={"image": MISSING_IMAGE})) as task:
        with pytest.raises(TaskNotReady, match=f"'{MISSING_IMAGE}' not found; build it with `harness sandbox build --tag {MISSING_IMAGE}`"):
            task.check_ready()
    with HumanEvalPlusTask(EvalPlusOptions(sandbox_options={"image": SANDBOX_IMAGE})) as task:
        task.check_ready()  # the built image: ready


@pytest.mark.docker
@pytest.mark.slow
def test_eval_with_missing_image_exits_2_before_writing(docker_client, data_dir, cli_env, tmp_path):
    out = tmp_path / "out"
    replay = replay_file(tmp_path / "replay.jsonl", data_dir)
    args = eval_args(replay, data_dir, out, image=MISSING_IMAGE)
    result = subprocess.run([sys.executable, "-m", "opd_harness.cli", *args], cwd=ROOT, env=cli_env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"harness sandbox build --tag {MISSING_IMAGE}" in " ".join(result.stderr.split()), result.stderr
    assert run_rows(out) == []


@pytest.mark.docker
@pytest.mark.slow
def test_run_with_missing_image_exits_2_before_creating_the_run(docker_client, data_dir, cli_env, tmp_path):
    out = tmp_path / "out"
    args = [*RUN, "--set", f"task_args.humaneval_plus.sandbox_options.image={MISSING_IMAGE}", "--out", str(out)]
    result = subprocess.run([sys.executable, "-m", "opd_harness.cli", *args], cwd=ROOT, env={**cli_env, "HARNESS_DATA_DIR": str(data_dir)},
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"harness sandbox build --tag {MISSING_IMAGE}" in " ".join(result.stderr.split()), result.stderr
    assert run_rows(out) == []
    assert not (out / "runs").exists() or not any((out / "runs").iterdir())


# ---------------------------------------------------------------- the provider (item: leaked containers)


@pytest.mark.docker
def test_a_sandbox_dropped_without_close_is_still_removed_at_exit(docker_client):
    """The exit hook holds open sandboxes strongly: one garbage-collected without close() leaves no container."""
    code = (
        "import gc, os\nfrom opd_harness import sandbox\n"
        "def grade():\n"
        f"    sb = sandbox.open_sandbox('docker', image={SANDBOX_IMAGE!r}, pool_size=1, prewarm=1)\n"
        "    assert sb.stats['created'] == 1\n"
        "grade()\n"
        "gc.collect()\n"
        "print(os.getpid(), flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    left = containers_of(docker_client, int(result.stdout.split()[-1]))
    remove(docker_client, left)
    assert left == []


@pytest.mark.docker
def test_close_removes_busy_containers_and_their_runs_end_as_error(docker_client):
    from opd_harness.sandbox.docker import OWNER, OWNER_LABEL

    def ours() -> set[str]:  # plain listing: no per-container inspect racing with removals
        return {c["Id"] for c in docker_client.api.containers(all=True, filters={"label": f"{OWNER_LABEL}={OWNER}"})}

    before = ours()
    sb = sandbox.open_sandbox("docker", image=SANDBOX_IMAGE, pool_size=1, retries=2)
    results = []
    runner = threading.Thread(target=lambda: results.append(sb.run(ExecRequest(argv=["sleep", "60"], timeout_s=60))))
    try:
        runner.start()
        deadline = time.monotonic() + 60
        while not (ours() - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        busy = ours() - before
        assert len(busy) == 1, "the run's container never started"
        time.sleep(0.5)  # the program is running
        t0 = time.perf_counter()
        sb.close()
        runner.join(timeout=30)
        seconds, left = time.perf_counter() - t0, busy & ours()
    finally:
        sb.close()
        remove(docker_client, list(ours() - before))
    assert not runner.is_alive() and seconds < 30 and left == set(), (seconds, left)
    assert results[0].status == "error" and results[0].attempts == 1, results[0]  # no retry into a closed pool


# ---------------------------------------------------------------- the CLI (item: leaked containers)


@pytest.mark.docker
@pytest.mark.slow
def test_eval_leaves_no_container_on_normal_exit(docker_client, data_dir, cli_env, tmp_path):
    replay = replay_file(tmp_path / "replay.jsonl", data_dir)
    w = watch_cli(docker_client, [*eval_args(replay, data_dir, tmp_path / "out"), "--json"], cli_env, tmp_path)
    assert w.returncode == 0, w.stderr
    assert '"n_pass": 2' in w.stderr  # graded in the sandbox (stdout and stderr share the log)
    assert_nothing_left(w)


@pytest.mark.docker
@pytest.mark.slow
def test_eval_leaves_no_container_on_an_exception(docker_client, data_dir, cli_env, tmp_path):
    replay = replay_file(tmp_path / "replay.jsonl", data_dir)
    w = watch_cli(docker_client, eval_args(replay, data_dir, tmp_path / "out"), cli_env, tmp_path, inject=INJECT_FAILURE)
    assert w.returncode == 1 and "RuntimeError: injected failure" in w.stderr, w.stderr
    assert_nothing_left(w)


@pytest.mark.docker
@pytest.mark.slow
def test_eval_leaves_no_container_on_sigterm(docker_client, data_dir, cli_env, tmp_path):
    """SIGTERM while candidates sleep in their containers: the CLI exits 143 at once and removes them."""
    replay = replay_file(tmp_path / "replay.jsonl", data_dir, body="    import time\n    time.sleep(120)\n")
    args = eval_args(replay, data_dir, tmp_path / "out", "--task-arg", "humaneval_plus.min_time_limit=120")
    w = watch_cli(docker_client, args, cli_env, tmp_path, sigterm_when=lambda seen: seen > 0)
    assert w.returncode == 128 + signal.SIGTERM, w.stderr
    assert w.exit_after_signal_s is not None and w.exit_after_signal_s < 60, w.exit_after_signal_s
    assert_nothing_left(w)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("how", ["normal", "exception", "sigterm"])
def test_run_leaves_no_container(how, docker_client, data_dir, cli_env, tmp_path):
    out = tmp_path / "out"
    env = {**cli_env, "HARNESS_DATA_DIR": str(data_dir)}
    args = [*RUN, "--set", f"task_args.humaneval_plus.sandbox_options.image={SANDBOX_IMAGE}", "--out", str(out)]

    def running(seen: int) -> bool:  # containers up and the run row written: SIGTERM lands inside the run
        return seen > 0 and any(status == "running" for _, _, status in run_rows(out))

    w = watch_cli(docker_client, args, env, tmp_path, inject=INJECT_FAILURE if how == "exception" else "",
                  sigterm_when=running if how == "sigterm" else None)  # fmt: skip
    train = [status for _, kind, status in run_rows(out) if kind == "train"]
    if how == "normal":
        assert w.returncode == 0 and train == ["done"], (train, w.stderr[-3000:])
    elif how == "exception":
        assert w.returncode == 1 and "RuntimeError: injected failure" in w.stderr and train == ["failed"], (train, w.stderr[-3000:])
    else:
        assert w.returncode == 128 + signal.SIGTERM and train == ["interrupted"], (train, w.stderr[-3000:])
        assert "harness run --resume" in " ".join(w.stderr.split())
    assert_nothing_left(w)
