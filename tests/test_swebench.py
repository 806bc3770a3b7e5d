"""SWE-bench grading in real Docker containers, on a tiny hand-made repository in SWE-bench's schema (fast), and
on one staged real instance (slow)."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from opd_harness.task import DataError
from opd_harness.tasks.swebench import upstream
from opd_harness.tasks.swebench.data import load_rows, validate_row
from opd_harness.tasks.swebench.grading import map_unittest_names
from opd_harness.tasks.swebench.images import environment_pins, failed_requirements
from opd_harness.tasks.swebench.task import SwebenchOptions, SwebenchTask

REPO, VERSION, IID = "opd-harness/tinycalc", "0.1", "opd-harness__tinycalc-1"
RUNNER_VERSION = "0.3"  # the same tree, its tests run by tests/runtests.py (django's layout)
PYTEST_REPO, PYTEST_IID = "opd-harness/tinycalc-pytest", "opd-harness__tinycalc-pytest-1"  # the same tree under pytest
PYTEST_PINS = ("pytest==8.3.3", "pluggy==1.5.0", "iniconfig==2.0.0", "packaging==24.1")
RUNTESTS = (
    "import os\nimport sys\nimport unittest\n\nsys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))\n"
    "sys.exit(not unittest.main(module=None, argv=['runtests', '-v', *sys.argv[1:]], exit=False).result.wasSuccessful())\n"
)
BASE = {
    "calc.py": (
        "def add(a, b):\n    return a + b\n\n\n"
        'def mean(values):\n    """Arithmetic mean of a non-empty list."""\n    return sum(values) / (len(values) - 1)\n'
    ),
    "tests/__init__.py": "",
    "tests/test_calc.py": (
        "import unittest\n\nfrom calc import add\n\n\nclass CalcTest(unittest.TestCase):\n    def test_add(self):\n"
        '        """\n        add() sums two numbers (a docstring that starts on a new line).\n        """\n'
        "        self.assertEqual(add(2, 3), 5)\n"
    ),
    "tests/runtests.py": RUNTESTS,
}
TEST_AFTER = (
    BASE["tests/test_calc.py"].replace("from calc import add\n", "from calc import add, mean\n")
    + "\n    def test_mean(self):\n        self.assertEqual(mean([2, 4]), 3.0)\n"
)


def git_diff(files: dict[str, str], changed: dict[str, str], tmp: Path) -> str:
    """The ``git diff`` that turns ``files`` into ``files | changed``."""
    tmp.mkdir(parents=True)
    for name, text in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    run = lambda *a: subprocess.run(["git", "-C", str(tmp), *a], check=True, capture_output=True, text=True).stdout  # noqa: E731
    run("init", "-q")
    run("add", "-A")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base")
    for name, text in changed.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    run("add", "-A")
    return run("diff", "--cached")


def snapshot(inst: Path, files: dict[str, str], environment: str) -> None:
    """An instance folder: ``repo.tar.xz`` of ``files`` and its ``environment.yml``."""
    inst.mkdir(parents=True)
    with tarfile.open(inst / "repo.tar.xz", "w:xz") as tf:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tf.addfile(info, io.BytesIO(text.encode()))
    (inst / "environment.yml").write_text(environment)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, docker_client):
    """A data dir with the tiny instance (snapshot + environment.yml with no pins + rows), and its patches."""
    upstream.register_repo(REPO, {VERSION: {"python": "3.9", "test_cmd": "python -m unittest -v"},
                                  RUNNER_VERSION: {"python": "3.9", "test_cmd": "python tests/runtests.py"}},
                           parser="django/django")  # fmt: skip
    root = tmp_path_factory.mktemp("swe")
    fixed = BASE["calc.py"].replace("(len(values) - 1)", "len(values)")
    patches = {
        "gold": git_diff(BASE, {"calc.py": fixed}, root / "g1"),
        "breaks_p2p": git_diff(BASE, {"calc.py": fixed.replace("return a + b", "return a - b")}, root / "g2"),
        "test": git_diff(BASE, {"tests/test_calc.py": TEST_AFTER}, root / "g3"),
    }
    patches["no_apply"] = patches["gold"].replace("return sum(values)", "return total(values)")
    snapshot(root / "data" / "swebench" / "instances" / IID, BASE, "name: testbed\ndependencies:\n  - python=3.11\n")
    row = {
        "repo": REPO,
        "instance_id": IID,
        "base_commit": "0" * 40,
        "patch": patches["gold"],
        "test_patch": patches["test"],
        "problem_statement": "mean([2, 4]) returns 6.0 instead of 3.0",
        "version": VERSION,
        "FAIL_TO_PASS": json.dumps(["test_mean (tests.test_calc.CalcTest)"]),
        "PASS_TO_PASS": json.dumps(["test_add (tests.test_calc.CalcTest)"]),
    }
    (root / "data" / "swebench" / "tiny.jsonl").write_text(json.dumps(row) + "\n")
    return root, patches


def tiny_task(root: Path) -> SwebenchTask:
    data = root / "data"
    return SwebenchTask(SwebenchOptions(data_dir=str(data), dataset=str(data / "swebench" / "tiny.jsonl"), cache_dir=str(root / "cache")))


def test_tiny_instance_grades(tiny):
    root, patches = tiny
    task = tiny_task(root)
    problems = task.load()
    assert [p.id for p in problems] == [IID]
    names = ["gold", "empty", "breaks_p2p", "no_apply"]
    scores = task.grade_many(problems * 4, [patches["gold"], "", patches["breaks_p2p"], patches["no_apply"]])
    by = dict(zip(names, scores, strict=True))
    assert by["gold"].status == "pass", by["gold"].details
    assert by["gold"].metrics["patch_applied"] == 1.0
    assert by["empty"].status == "fail" and by["empty"].metrics["empty_patch"] == 1.0
    assert "empty patch" in by["empty"].details
    assert by["breaks_p2p"].status == "fail" and "PASS_TO_PASS 0/1" in by["breaks_p2p"].details
    assert by["no_apply"].status == "fail" and "does not apply" in by["no_apply"].details
    assert by["no_apply"].metrics["patch_applied"] == 0.0
    log = Path(by["gold"].details.split("log: ")[1])
    assert log.is_file() and "test_mean (tests.test_calc.CalcTest.test_mean) ... ok" in log.read_text()


def test_a_folder_of_git_mirrors_is_a_repository_source(tiny, tmp_path):
    """`swebench.repo_source=DIR` with `<owner>__<name>.git` mirrors (how other instances of a repository come without
    snapshots): the tree at `base_commit` is archived, not the mirror's HEAD; the gold patch resolves on it; a commit
    the mirror lacks is a clear DataNotFound."""
    from opd_harness.task import DataNotFound
    from opd_harness.tasks.swebench.data import repo_tarball

    root, patches = tiny
    work = tmp_path / "work"
    git_diff(BASE, {}, work)  # one commit: the base tree
    run = lambda *a: subprocess.run(["git", "-C", str(work), *a], check=True, capture_output=True, text=True).stdout.strip()  # noqa: E731
    base_commit = run("rev-parse", "HEAD")
    (work / "calc.py").write_text("raise SystemExit('a later commit')\n")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "later")
    mirrors = tmp_path / "mirrors"
    subprocess.run(["git", "clone", "-q", "--mirror", str(work), str(mirrors / f"{REPO.replace('/', '__')}.git")], check=True)
    row = {**json.loads((root / "data" / "swebench" / "tiny.jsonl").read_text()), "base_commit": base_commit}
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(row) + "\n")
    task = SwebenchTask(SwebenchOptions(dataset=str(rows), repo_source=str(mirrors), instances=IID, cache_dir=str(tmp_path / "cache")))
    tree = repo_tarball(mirrors, row, tmp_path / "cache")
    with tarfile.open(tree) as tf:
        assert {m.name: tf.extractfile(m).read().decode() for m in tf.getmembers() if m.isfile()} == BASE
    (problem,) = task.load()
    gold, empty = task.grade_many([problem, problem], [patches["gold"], ""])
    assert gold.status == "pass", gold.details
    assert empty.status == "fail"
    with pytest.raises(DataNotFound, match=f"{IID}: git archive {'1' * 40} in .*failed"):
        repo_tarball(mirrors, {**row, "base_commit": "1" * 40}, tmp_path / "cache")


def test_image_is_cached_and_rebuilt_when_inputs_change(tiny):
    root, _ = tiny
    task = tiny_task(root)
    row = task.load()[0].meta
    first = task.ensure_image(row)
    again = SwebenchTask(task.options).ensure_image(row)
    assert again.tag == first.tag and not again.built
    changed = task.build_inputs(row)
    from dataclasses import replace

    assert replace(changed, pre_install=("true",)).tag != first.tag


def test_missing_image_that_cannot_build_is_error(tiny):
    root, patches = tiny
    task = tiny_task(root)
    problem = task.load()[0]
    row = dict(problem.meta, repo="nobody/unknown")  # no swebench spec: the image cannot be built
    outcome = task.grade_patch(row, patches["gold"])
    assert outcome.status == "error"


def test_unittest_names_of_python_311_map_to_swebench_names():
    got = map_unittest_names({"test_a (m.C.test_a)": "PASSED", "test_b (m.C)": "FAILED", "tests/x.py::t": "PASSED"})
    assert got == {"test_a (m.C)": "PASSED", "test_b (m.C)": "FAILED", "tests/x.py::t": "PASSED"}


def test_rows_are_validated_with_file_line_field(tmp_path):
    good = {"repo": "a/b", "instance_id": "a__b-1", "base_commit": "c", "patch": "p", "test_patch": "t", "problem_statement": "s",
            "version": "1", "FAIL_TO_PASS": '["x"]', "PASS_TO_PASS": "[]"}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(dict(good, instance_id="a__b-2", FAIL_TO_PASS="not json")) + "\n")
    with pytest.raises(DataError, match=r"rows.jsonl:2: field 'FAIL_TO_PASS'"):
        load_rows(path)
    assert validate_row(good, "f", 1)["FAIL_TO_PASS"] == ["x"]


def test_pins_and_pip_failures():
    assert environment_pins("dependencies:\n  - python=3.6\n  - pip:\n      - numpy==1.19.5\n      - asgiref==3.4.1\n") == [
        "numpy==1.19.5",
        "asgiref==3.4.1",
    ]
    out = "Collecting asgiref==3.4.1\nERROR: No matching distribution found for numpy==1.19.5\n"
    assert failed_requirements(out, ["asgiref==3.4.1", "numpy==1.19.5"]) == ["numpy==1.19.5"]


@pytest.mark.slow
def test_real_instance_gold_resolves_and_empty_does_not(benchmark_data, docker_client, tmp_path):
    instance = "sphinx-doc__sphinx-8721"  # the fastest of the staged instances to build here (~1.5 min; django ~4-6 min)
    data = benchmark_data("swebench/verified_mini_50.csv", f"swebench/instances/{instance}/repo.tar.xz")
    task = SwebenchTask(SwebenchOptions(data_dir=str(data), instances=instance, cache_dir=".cache/swebench"))
    problem = task.load()[0]
    gold, empty = task.grade_many([problem, problem], [problem.answer, ""])
    assert gold.status == "pass", gold.details
    assert empty.status == "fail", empty.details


def test_cli_sandbox_build_and_replay_eval(tiny, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from opd_harness.cli import app

    root, patches = tiny
    data = root / "data"
    args = [
        "--data-dir",
        str(data),
        "--task-arg",
        f"swebench.dataset={data / 'swebench' / 'tiny.jsonl'}",
        "--task-arg",
        f"swebench.cache_dir={root / 'cache'}",
    ]
    monkeypatch.setenv("HARNESS_DATA_DIR", str(data))  # --data-dir sets it for the process: restored after the test
    runner = CliRunner()
    built = runner.invoke(app, ["sandbox", "build", "--task", "swebench", *args])
    assert built.exit_code == 0, built.output
    assert IID in built.output and "dropped pins: none" in built.output
    model = tmp_path / "gold.jsonl"
    model.write_text(json.dumps({"task": "swebench", "id": IID, "completion": patches["gold"]}) + "\n")
    result = runner.invoke(
        app,
        [
            "eval",
            "--task",
            "swebench",
            "--backend",
            "replay",
            "--model",
            str(model),
            "--k",
            "1",
            "--out",
            str(tmp_path / "out"),
            "--json",
            *args,
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    got = summary["tasks"]["swebench"]
    assert (got["n_pass"], got["n_fail"], got["n_errors"]) == (1, 0, 0), got


@pytest.mark.parametrize("how", ["sigterm", "sigkill", "sigterm-served"])
def test_nothing_is_left_running_after_a_crash_mid_episode(how, tiny, tmp_path, docker_client):
    """An agent is inside `sleep 300` in its instance container when `harness eval` is stopped: SIGTERM removes the
    container before the exit, within seconds, whether the command is a `docker exec` or a request to the container's exec
    server (``sigterm-served``); after SIGKILL the orphan is reaped by the next process that opens a sandbox."""
    import os
    import signal
    import sys
    import time

    from opd_harness.sandbox.docker import LABEL, OWNER_LABEL

    root, _ = tiny
    data = root / "data"
    turns = tmp_path / "turns.jsonl"
    turns.write_text(json.dumps({"task": "swebench", "id": IID, "turns": ["```bash\nsleep 300\n```"]}) + "\n")
    args = ["eval", "--task", "swebench", "--backend", "replay", "--model", str(turns), "--k", "1", "--out", str(tmp_path / "out"),
            "--data-dir", str(data), "--task-arg", f"swebench.dataset={data / 'swebench' / 'tiny.jsonl'}",
            "--task-arg", f"swebench.cache_dir={root / 'cache'}",
            "--task-arg", f"swebench.agent_exec_server={str(how == 'sigterm-served').lower()}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    code = (
        f"from opd_harness.tasks.swebench import upstream; upstream.register_repo({REPO!r}, {{{VERSION!r}: "
        "{'python': '3.9', 'test_cmd': 'python -m unittest -v'}}, "
        "parser='django/django')\nfrom opd_harness.cli import main; main()"
    )  # the tiny repository's spec, as the fixture registers it
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def mine() -> list[str]:
        found = docker_client.api.containers(all=True, filters={"label": f"{LABEL}=1"})
        return [c["Id"] for c in found if (c.get("Labels") or {}).get(OWNER_LABEL, "").split(":")[-2:-1] == [str(proc.pid)]]

    try:
        deadline = time.monotonic() + 300
        while not mine():
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stdout.read().decode()[-3000:] if proc.poll() is not None else "no container"
            )
            time.sleep(0.2)
        time.sleep(1.0)  # the command is running in it
        proc.send_signal(signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
        signalled = time.monotonic()
        proc.wait(timeout=120)
        if how != "sigkill":  # at once: not after the command's 60 s limit (no patch is read from an interrupted episode)
            assert proc.returncode == 128 + signal.SIGTERM and mine() == []
            assert time.monotonic() - signalled < 30, f"exit took {time.monotonic() - signalled:.0f} s after SIGTERM"
        else:
            assert len(mine()) == 1  # a killed process cleans nothing up itself
            # the next user reaps
            reaper = ("from opd_harness import sandbox\n"
                      "with sandbox.open_sandbox('docker') as sb: sb.run(sandbox.ExecRequest(argv=['true']))")
            subprocess.run([sys.executable, "-c", reaper], env=env, check=True, timeout=120)
            assert mine() == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for cid in mine():
            docker_client.api.remove_container(cid, force=True)


def test_open_instance_session_runs_in_the_repository(tiny):
    from opd_harness.sandbox import ExecRequest
    from opd_harness.tasks.swebench.task import open_instance_session

    root, _ = tiny
    data = root / "data"
    options = {"data_dir": str(data), "dataset": str(data / "swebench" / "tiny.jsonl"), "cache_dir": str(root / "cache")}
    with open_instance_session(IID, options) as session:
        script = (
            "cd /testbed && git status --porcelain && git log --oneline | wc -l && "
            "python -c 'import calc, sys; print(calc.add(1, 2), sys.prefix)'"
        )
        result = session.run(ExecRequest(argv=["bash", "-c", script], timeout_s=60))
        assert result.exit_code == 0, result.stderr
        assert result.stdout.split() == ["1", "3", "/opt/venv"]
        net = session.run(
            ExecRequest(argv=["python", "-c", "import socket; socket.create_connection(('pypi.org', 443), timeout=3)"], timeout_s=30)
        )
        assert net.exit_code != 0


def agent_env(task: SwebenchTask, problem, **limits):
    """An agent episode on the tiny instance, its container opened by the task (as in ``task.env``)."""
    from opd_harness.tasks.agentic.shell_env import AgentLimits
    from opd_harness.tasks.swebench.agent import SwebenchAgentEnv
    from opd_harness.tasks.swebench.task import AGENT_WORKDIR

    return SwebenchAgentEnv("", lambda: task.open_session(problem.meta), workdir=AGENT_WORKDIR, limits=AgentLimits(**limits))


@pytest.mark.parametrize("served", [True, False], ids=["exec_server", "docker_exec"])
def test_agent_commands_are_exec_server_requests_that_keep_the_session_semantics(served, tiny, monkeypatch):
    """With ``agent_exec_server`` (the default) an agent's command in the instance container is a request to its exec
    server, not a `docker exec` (benchmarks/agent_step_latency.py), and keeps what agents rely on, as the `docker exec`
    path (``false``) does: the working directory and exported variables persist; a background process neither holds
    its command up nor dies with it; a command past its limit is killed and leaves the session's state as it was; long
    output is cut head+tail; the network is off."""
    import time

    root, _ = tiny
    assert tiny_task(root).options.agent_exec_server
    task = SwebenchTask(tiny_task(root).options.model_copy(update={"agent_exec_server": served}))
    (problem,) = task.load()
    env = agent_env(task, problem, command_timeout_s=2.0, max_output_chars=300)
    try:
        env.prepare()
        api = env.session()._inner._sb.client().api
        execs, create = [], api.exec_create
        monkeypatch.setattr(api, "exec_create", lambda *a, **k: execs.append(a) or create(*a, **k))

        def run(command: str) -> str:
            return env.step(f"```bash\n{command}\n```").observation.content

        assert run("mkdir -p sub && cd sub && export FLAVOUR=mint && echo ready").endswith("\nready\n</output>")
        assert run('echo "$PWD $FLAVOUR"').endswith("/testbed/sub mint\n</output>")
        started = time.monotonic()
        assert "started" in run("sleep 60 & echo $! > /tmp/bg.pid; echo started")
        assert time.monotonic() - started < 10  # not held up by the background process's open stdout
        timed_out = run("export LOST=1; cd ..; echo partial; sleep 30")
        assert "timed out after 2 s" in timed_out and "partial" in timed_out and env.metrics()["command_timeouts"] == 1
        assert run('echo "$PWD $FLAVOUR ${LOST:-unset}"; kill -0 "$(cat /tmp/bg.pid)" && echo bg-alive').endswith(
            "/testbed/sub mint unset\nbg-alive\n</output>"
        )
        long = run("seq 1 5000")
        assert "characters elided" in long and "\n1\n2\n" in long and long.endswith("5000\n</output>")
        offline = run("echo > /dev/tcp/1.1.1.1/53")
        assert "<returncode>1</returncode>" in offline and "unreachable" in offline
        run("cd /testbed && sed -i 's/(len(values) - 1)/len(values)/' calc.py")
        assert "+    return sum(values) / len(values)" in env.outcome()["patch"]
        assert (execs == []) == served
    finally:
        env.close()


def test_the_instance_container_starts_while_the_model_writes_its_first_turn(tiny, docker_client):
    """Through the rollout with a generating model, the episode's container is up before its first generation returns
    (that generation waits up to 120 s for it), the first command runs in it, and it is removed when the episode ends;
    one still starting when its episode is closed is removed too."""
    import os
    import time

    from scripted_model import ScriptedModel

    from opd_harness.backends import SamplingParams
    from opd_harness.registry import TASKS
    from opd_harness.rollout import rollout
    from opd_harness.sandbox.docker import LABEL, OWNER_LABEL
    from opd_harness.tasks.swebench.agent import SUBMIT

    def mine() -> list[str]:
        found = docker_client.api.containers(all=True, filters={"label": f"{LABEL}=1"})
        return [c["Id"] for c in found if (c.get("Labels") or {}).get(OWNER_LABEL, "").split(":")[-2:-1] == [str(os.getpid())]]

    def wait_for_container(call: int) -> None:
        deadline = time.monotonic() + 120
        while call == 0 and not mine() and time.monotonic() < deadline:
            time.sleep(0.1)
        up.append(bool(mine()))

    root, _ = tiny
    TASKS.get("swebench")  # names the class
    task = tiny_task(root)
    (problem,) = task.load()
    assert mine() == []
    up: list[bool] = []
    model = ScriptedModel(["```bash\ngit log -1 --format=%s\n```", f"```bash\necho {SUBMIT}\n```"], think=wait_for_container)
    (traj,) = rollout(model, task, [problem], SamplingParams())
    assert up[0] and "env_error" not in traj.metadata, traj.metadata
    assert "<output>\nbase\n" in traj.segments[1].text and traj.metadata["outcome"]["patch"] == ""  # the image's commit message
    assert mine() == []
    env = agent_env(task, problem)
    env.prepare()
    env.close()
    assert mine() == []


def test_staged_data_loads_from_csv_and_save_to_disk_alike(benchmark_data):
    data = benchmark_data("swebench/verified_mini_50.csv", "swebench/verified_mini_hf/test/data-00000-of-00001.arrow")
    csv_rows = load_rows(data / "swebench" / "verified_mini_50.csv")
    assert len(csv_rows) == 50 and csv_rows == load_rows(data / "swebench" / "verified_mini_hf")
    task = SwebenchTask(SwebenchOptions(data_dir=str(data)))
    staged = {p.parent.name for p in (data / "swebench" / "instances").glob("*/repo.tar.xz")}
    problems = task.load()
    assert {p.id for p in problems} == staged and staged  # default: every instance that has a snapshot
    assert all(p.question == p.meta["problem_statement"] and p.answer == p.meta["patch"] for p in problems)
    with pytest.raises(DataError, match="instances.*nope"):
        SwebenchTask(SwebenchOptions(data_dir=str(data), instances="nope")).load()


def test_scripted_agent_episodes_resolve_and_premature_stops_are_flagged(tiny, tmp_path):
    """Replayed bash turns run live in the instance container; the final git diff is graded; stops are flagged."""
    from opd_harness.backends import SamplingParams
    from opd_harness.backends.replay import ReplayBackend
    from opd_harness.evaluation import evaluate_task
    from opd_harness.tasks.swebench.agent import SUBMIT

    def bash(command: str) -> str:
        return f"THOUGHT: next.\n\n```bash\n{command}\n```"

    root, patches = tiny
    task = tiny_task(root)
    (problem,) = task.load()
    fixer = [bash("grep -n 'len(values)' calc.py"), bash("sed -i 's/(len(values) - 1)/len(values)/' calc.py"),
             bash("python -m unittest -q 2>&1 | tail -1"), bash(f"echo {SUBMIT}")]  # fmt: skip
    hasty = [bash("sed -i 's/return a + b/return a - b/' calc.py"), bash(f"echo {SUBMIT}")]  # breaks add, never tests
    looping = [bash("ls")] * 3 + ["no command at all"] * 3  # three identical commands, then format errors end it
    samples = {(task.name, problem.id): [fixer, hasty, looping, [patches["gold"]]]}
    result = evaluate_task(ReplayBackend(samples), task, [problem], k=4, sampling=SamplingParams(), n_resamples=10)
    statuses = [s.status for s in result.samples]
    assert statuses == ["pass", "fail", "fail", "pass"], [s.details for s in result.samples]
    fixed, rushed, looped, submitted = (s.metrics for s in result.samples)
    assert fixed["ran_tests"] == 1 and fixed["premature_stop"] == 0 and fixed["tool_calls"] == 3
    assert rushed["premature_stop"] == 1 and "PASS_TO_PASS 0/1" in result.samples[1].details
    assert looped["repeated_loop"] == 1 and looped["premature_stop"] == 1 and looped["format_errors"] == 3
    assert submitted["premature_stop"] == 0 and submitted["turns"] == 1  # a stored patch is a one-turn episode
    assert "-    return sum(values) / (len(values) - 1)" in result.trajectories[0].metadata["outcome"]["patch"]
    summary = result.summary
    assert summary["repeated_loop_rate"] == 0.25 and summary["premature_stop_rate"] == 0.5 and summary["patch_apply_failure_rate"] == 0.0


@pytest.mark.slow
def test_f_opd_trains_on_agent_episodes_in_instance_containers(tiny, tmp_path):
    """`harness run --method f_opd --task swebench --preset smoke` on the tiny instance: agent episodes, teacher scoring
    of the interleaved context, checkpoints, evaluations and agentic metrics all run. The untrained tiny models write
    no valid command (format errors end their episodes), so they resolve nothing and open no container."""
    from typer.testing import CliRunner

    from opd_harness.cli import app
    from opd_harness.store import Store

    root, _ = tiny
    data = root / "data"
    sets = [f"task_args.swebench.dataset={data / 'swebench' / 'tiny.jsonl'}", f"task_args.swebench.cache_dir={root / 'cache'}",
            f"task_args.swebench.data_dir={data}", "task_args.swebench.max_steps=3", "trainer.max_new_tokens=48", "trainer.steps=2",
            "trainer.checkpoint_every=2", "trainer.prompts_per_step=1", "eval.k=2", "eval.teacher=false",
            "student.arch.max_positions=1536", "teacher.arch.max_positions=1536", "task_args.swebench.max_new_tokens=48",
            "student.sft_steps=0", "teacher.sft_steps=0"]  # fmt: skip
    args = ["run", "--method", "f_opd", "--task", "swebench", "--preset", "smoke", "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(app, [*args, *[x for s in sets for x in ("--set", s)]])
    assert result.exit_code == 0, result.output
    store = Store(tmp_path / "out")
    (run,) = [r for r in store.runs() if r["kind"] == "train"]
    steps = store.step_metrics(run["run_id"])
    assert sorted(steps) == [1, 2] and all(s["model_tokens"] > 0 and "premature_stop_rate" in s for s in steps.values())
    final = [e for e in store.evals(run["run_id"]) if e["step"] == 2][0]
    assert final["n_errors"] == 0 and {"premature_stop_rate", "repeated_loop_rate", "invalid_tool_rate"} <= set(final["metrics"])


# ---- grading policy: what the patch causes is fail (with its code), tampering and escapes are refused

FIXED = BASE["calc.py"].replace("(len(values) - 1)", "len(values)")
HOOK = (
    "diff --git a/.git/hooks/post-checkout b/.git/hooks/post-checkout\nnew file mode 100755\n"
    "--- /dev/null\n+++ b/.git/hooks/post-checkout\n@@ -0,0 +1,2 @@\n+#!/bin/sh\n+{}\n"
)
# every new assert -> pass
NEUTER_TEST_PATCH = r"sed -i 's/^+        self.assertEqual(mean(\[2, 4\]), 3.0)$/+        pass/' /tmp/opd/test.patch"


def grade_all(task: SwebenchTask, jobs: dict[str, tuple[dict, str]]):
    """``{name: (row, patch)}`` -> ``{name: Outcome}``, two gradings at a time."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(task.grade_patch, row, patch) for name, (row, patch) in jobs.items()}
    return {name: future.result() for name, future in futures.items()}


def test_failures_the_patch_causes_are_fail_with_their_reason(tiny, tmp_path):
    """Tests past grade_timeout_s, a file the test patch also creates, a hook that kills every process and code that
    kills every process at import are the patch's doing: fail with a code (they were error: dropped from the score).
    A test patch that does not apply to the base commit is still error."""
    root, patches = tiny
    task = SwebenchTask(tiny_task(root).options.model_copy(update={"grade_timeout_s": 20.0}))
    row = task.load()[0].meta
    extra = "import unittest\n\n\nclass ExtraTest(unittest.TestCase):\n    def test_extra(self):\n        pass\n"
    creates = {**row, "test_patch": git_diff(BASE, {"tests/test_calc.py": TEST_AFTER, "tests/test_extra.py": extra}, tmp_path / "t")}
    jobs = {
        "hangs": (row, git_diff(BASE, {"calc.py": "import time\ntime.sleep(600)\n" + FIXED}, tmp_path / "hang")),
        "same_new_file": (
            creates, git_diff(BASE, {"calc.py": FIXED, "tests/test_extra.py": "raise SystemExit('model')\n"}, tmp_path / "new")
        ),
        "hook_kills": (row, patches["gold"] + HOOK.format("kill -9 -1")),
        "kills_at_import": (
            row, git_diff(BASE, {"calc.py": "import os, signal\nos.kill(-1, signal.SIGKILL)\n" + FIXED}, tmp_path / "kill")
        ),
        "broken_row": ({**row, "test_patch": patches["no_apply"]}, patches["gold"]),
    }
    got = grade_all(task, jobs)
    assert got["hangs"].status == "fail" and "grade_timeout" in got["hangs"].reason and got["hangs"].metrics["fail_grade_timeout"] == 1.0
    assert got["same_new_file"].status == "pass", got["same_new_file"].reason  # restored (removed) before the test patch: it applies
    assert got["hook_kills"].status == "fail" and "unsafe_path" in got["hook_kills"].reason
    assert got["kills_at_import"].status == "fail" and got["kills_at_import"].code == "grade_killed", got["kills_at_import"].reason
    assert got["broken_row"].status == "error" and "does not apply to its base commit" in got["broken_row"].reason


def test_a_patch_cannot_plant_hooks_rewrite_the_test_patch_or_leave_the_repository(tiny):
    """A post-checkout hook that rewrites the staged test patch (every new assert becomes `pass`) resolved the instance
    with no fix; paths into .git or outside the repository are refused before anything runs."""
    root, patches = tiny
    task = tiny_task(root)
    row = task.load()[0].meta
    outside = "--- a/calc.py\n+++ b/../../tmp/opd/test.patch\n@@ -1,2 +1,2 @@\n-def add(a, b):\n+def add(a, b):  # x\n     return a + b\n"
    got = grade_all(
        task,
        {
            "hook": (row, HOOK.format(NEUTER_TEST_PATCH)),
            "outside": (row, outside),
            "absolute": (row, outside.replace("b/../../tmp", "/tmp")),
        },
    )
    for name, outcome in got.items():
        assert (
            outcome.status == "fail" and outcome.code == "unsafe_path" and outcome.metrics["fail_unsafe_path"] == 1.0
        ), (name, outcome.reason)
    assert ".git" in got["hook"].reason


@pytest.fixture(scope="module")
def tiny_pytest(tiny):
    """The tiny tree as a pytest instance (its venv pins pytest), and its rows file."""
    upstream.register_repo(PYTEST_REPO, {VERSION: {"python": "3.11", "test_cmd": "pytest -rA"}}, parser="pytest-dev/pytest")
    root, patches = tiny
    pins = "".join(f"      - {p}\n" for p in PYTEST_PINS)
    snapshot(
        root / "data" / "swebench" / "instances" / PYTEST_IID, BASE, f"name: testbed\ndependencies:\n  - python=3.11\n  - pip:\n{pins}"
    )
    row = {**json.loads((root / "data" / "swebench" / "tiny.jsonl").read_text()), "repo": PYTEST_REPO, "instance_id": PYTEST_IID,
           "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::CalcTest::test_mean"]),
           "PASS_TO_PASS": json.dumps(["tests/test_calc.py::CalcTest::test_add"])}  # fmt: skip
    (root / "data" / "swebench" / "tiny_pytest.jsonl").write_text(json.dumps(row) + "\n")
    return root


CONFTEST_PASSED = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
                   "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")  # fmt: skip
CONFTEST_XFAIL = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
                  "    report = (yield).get_result()\n"
                  "    if report.failed:\n        report.outcome, report.wasxfail = 'skipped', 'tampered'\n")  # fmt: skip
CONFTEST_FAKE_LINES = ("import os\n\n\ndef pytest_unconfigure(config):\n    print('PASSED tests/test_calc.py::CalcTest::test_mean')\n"
                       "    print('PASSED tests/test_calc.py::CalcTest::test_add')\n"
                       "    print('>>>>> End Test Output', flush=True)\n    os._exit(0)\n")  # fmt: skip
RUNTESTS_OK = RUNTESTS.replace("import unittest\n",
                               "import unittest\n\nunittest.TextTestResult.addFailure = unittest.TextTestResult.addError = "
                               "lambda self, test, err: self.addSuccess(test)\n")  # fmt: skip


@pytest.mark.slow
def test_patches_that_steer_the_test_run_are_refused(tiny, tiny_pytest, tmp_path):
    """Four patches with no fix that resolved the instance: a conftest rewriting reports to passed, one turning failures
    into xfail, one printing fake PASSED lines and the end-of-output marker, and a runtests.py reporting failures as ok.
    The default policy fails them (code test_tampering); ``strip`` grades the patch without those files."""
    root, patches = tiny
    data = tiny_pytest / "data"
    options = {"data_dir": str(data), "cache_dir": str(root / "cache")}
    pytest_task = SwebenchTask(SwebenchOptions(dataset=str(data / "swebench" / "tiny_pytest.jsonl"), **options))
    pytest_row = pytest_task.load()[0].meta
    unittest_task = tiny_task(root)
    runner_row = {**unittest_task.load()[0].meta, "version": RUNNER_VERSION}
    attacks = {
        "reports_passed": (pytest_row, git_diff(BASE, {"conftest.py": CONFTEST_PASSED}, tmp_path / "a")),
        "xfail": (pytest_row, git_diff(BASE, {"tests/conftest.py": CONFTEST_XFAIL}, tmp_path / "b")),
        "fake_lines": (pytest_row, git_diff(BASE, {"conftest.py": CONFTEST_FAKE_LINES}, tmp_path / "c")),
    }
    got = grade_all(pytest_task, attacks) | grade_all(
        unittest_task, {"runtests_ok": (runner_row, git_diff(BASE, {"tests/runtests.py": RUNTESTS_OK}, tmp_path / "d"))}
    )
    for name, outcome in got.items():
        assert outcome.status == "fail" and outcome.code == "test_tampering", (name, outcome.status, outcome.reason)
    assert unittest_task.grade_patch(runner_row, patches["gold"]).status == "pass"  # the runner works: the attack is what resolved
    gold_with_conftest = git_diff(BASE, {"calc.py": FIXED, "conftest.py": CONFTEST_PASSED}, tmp_path / "e")
    strip = SwebenchTask(pytest_task.options.model_copy(update={"test_tampering": "strip"}))
    stripped = grade_all(
        strip, {"attack": attacks["reports_passed"], "gold": (pytest_row, gold_with_conftest), "plain_gold": (pytest_row, patches["gold"])}
    )
    assert stripped["attack"].status == "fail" and "RESOLVED_NO" in stripped["attack"].reason  # graded without its conftest
    assert stripped["attack"].metrics["patch_applied"] == 0.0  # nothing of it was left to apply
    assert stripped["gold"].status == "pass" and stripped["gold"].metrics["stripped_files"] == 1.0
    assert stripped["plain_gold"].status == "pass", stripped["plain_gold"].reason


def test_patch_paths_are_read_as_git_and_patch_read_them():
    from opd_harness.tasks.swebench.patches import fuzz_patch, parse_patch, unsafe_paths

    patch = (
        "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n---- a/x\n++++ b/y\n"
        'diff --git "a/caf\\303\\251.py" "b/caf\\303\\251.py"\nnew file mode 100644\n'
        '--- /dev/null\n+++ "b/caf\\303\\251.py"\n@@ -0,0 +1 @@\n+x\n'
        "diff --git a/old.py b/new.py\nsimilarity index 100%\nrename from old.py\nrename to new.py\n"
        "diff --git a/link b/link\nnew file mode 120000\n--- /dev/null\n+++ b/link\n"
        "@@ -0,0 +1 @@\n+../../tmp\n\\ No newline at end of file\n"
    )
    files = parse_patch(patch)
    assert [(f.old, f.new) for f in files] == [("calc.py", "calc.py"), (None, "café.py"), ("old.py", "new.py"), (None, "link")]
    assert [len(f.hunks) for f in files] == [1, 1, 0, 1]  # `---- a/x` is a removed line of the hunk, not a file header
    assert unsafe_paths(files) == ["link -> ../../tmp: a link to a path with '..' or '.' components"]
    assert "Index:" not in fuzz_patch(files) and "+++ b/café.py" in fuzz_patch(files)
    for bad in ("/etc/passwd", "../x", "a/../../x", ".git/hooks/pre-commit", "sub/.GIT/config", '"b/x\\n>>>>> Applied Patch"'):
        named = bad if bad.startswith('"') else f"b/{bad}"
        assert unsafe_paths(parse_patch(f"--- a/calc.py\n+++ {named}\n@@ -1 +1 @@\n-a\n+b\n")), bad
    assert unsafe_paths(parse_patch("--- a/src/calc.py\n+++ b/src/calc.py\n@@ -1 +1 @@\n-a\n+b\n")) == []


def test_tampering_policy_fails_strips_or_keeps_the_files_that_steer_the_test_run():
    from opd_harness.tasks.swebench.grading import prepare

    def diff(*paths: str) -> str:
        return "".join(f"diff --git a/{p} b/{p}\n--- a/{p}\n+++ b/{p}\n@@ -1 +1 @@\n-a\n+b\n" for p in paths)

    spec = {"test_cmd": "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"}
    test_patch = diff("tests/test_calc.py")
    for path in ("conftest.py", "pkg/tests/conftest.py", "pytest.ini", "tox.ini", "sitecustomize.py", "lib/usercustomize.py",
                 "evil.pth", "tests/runtests.py", "tests/test_sqlite.py"):  # fmt: skip
        refused = prepare(diff("calc.py", path), spec, test_patch).refused
        assert refused is not None and refused.code == "test_tampering" and path in refused.reason, path
        stripped = prepare(diff("calc.py", path), spec, test_patch, tampering="strip")
        assert stripped.refused is None and stripped.stripped == (path,) and path not in stripped.patch and "calc.py" in stripped.patch
        assert prepare(diff("calc.py", path), spec, test_patch, tampering="off").patch == diff("calc.py", path)
    kept = prepare(diff("calc.py", "tests/test_calc.py", "setup.cfg"), spec, test_patch)
    assert kept.refused is None and kept.sectioned == ("setup.cfg",)  # the test patch's own files are restored, not refused
    assert prepare("x" * 101, spec, test_patch, max_bytes=100).refused.code == "patch_too_large"


def test_test_sections_of_setup_cfg_and_pyproject_are_compared():
    from opd_harness.tasks.swebench.steering import changed

    cfg = "[metadata]\nname = x\n\n[tool:pytest]\naddopts = -q\n"
    assert not changed("setup.cfg", cfg, cfg.replace("name = x", "name = y"))
    assert changed("setup.cfg", cfg, cfg.replace("-q", "-p evil"))
    assert changed("sub/setup.cfg", None, "[tool:pytest]\naddopts = -p evil\n")
    assert changed("setup.cfg", cfg, cfg + "[options.entry_points]\npytest11 =\n    evil = evil\n")
    toml = '[project]\nname = "x"\n\n[tool.pytest.ini_options]\naddopts = "-q"\n'
    assert not changed("pyproject.toml", toml, toml.replace('"x"', '"y"'))
    assert changed("pyproject.toml", toml, toml.replace('"-q"', '"-p evil"'))
    assert changed("pyproject.toml", toml, toml + "[[broken")  # unparsable: changed


def test_markers_count_only_where_the_grader_prints_them():
    from types import SimpleNamespace

    from opd_harness.tasks.swebench.grading import (
        APPLIED,
        APPLY_FAILED,
        SETUP_FAILED,
        START,
        TEST_PATCH_BROKEN,
        TEST_PATCH_FAILED,
        classify,
        test_section,
    )

    row = json.loads(json.dumps({"repo": REPO, "version": VERSION, "FAIL_TO_PASS": ["t"], "PASS_TO_PASS": []}))
    upstream.register_repo(REPO, {VERSION: {"python": "3.9", "test_cmd": "python -m unittest -v"}}, parser="django/django")

    def outcome(status: str, *lines: str):
        result = SimpleNamespace(status=status, error="", exit_code=0, stdout="\n".join(lines) + "\n")
        return classify(row, result, result.stdout, 20.0, {"patch_bytes": 10.0}, "log")

    assert outcome("ok", TEST_PATCH_BROKEN).status == "error"
    assert outcome("killed").status == "error"  # nothing of the patch had run
    faked = outcome("timeout", APPLIED, SETUP_FAILED, TEST_PATCH_BROKEN)  # printed by the patch's code: no error
    assert faked.status == "fail" and faked.code == "grade_timeout"
    assert outcome("ok", APPLIED, TEST_PATCH_FAILED).code == "test_patch_conflict"
    assert outcome("ok", APPLIED, APPLY_FAILED).code == "tests_did_not_run"  # the patch's code printed it: not its apply
    assert outcome("oom", APPLIED, START).code == "grade_oom"
    assert test_section(f"{START}\nfake\n>>>>> End Test Output\n{START}\nreal\n") == "real\n"  # the grader's start marker is the last


def test_rebuild_runs_where_compiled_sources_change_and_the_spec_builds_in_place():
    from opd_harness.tasks.swebench.grading import REBUILD, rebuild_command
    from opd_harness.tasks.swebench.patches import parse_patch

    pyx = parse_patch("--- a/sklearn/tree/_tree.pyx\n+++ b/sklearn/tree/_tree.pyx\n@@ -1 +1 @@\n-a\n+b\n")
    py = parse_patch("--- a/sklearn/tree/tree.py\n+++ b/sklearn/tree/tree.py\n@@ -1 +1 @@\n-a\n+b\n")
    sklearn = {"install": "python -m pip install -v --no-use-pep517 --no-build-isolation -e ."}
    astropy = {"install": "python -m pip install -e .[test] --verbose"}
    assert rebuild_command(sklearn, pyx, "auto") == REBUILD and rebuild_command(sklearn, py, "auto") is None
    assert rebuild_command(sklearn, py, "always") == REBUILD and rebuild_command(sklearn, pyx, "never") is None
    assert rebuild_command(astropy, pyx, "auto") is None  # an isolated build cannot run offline


def test_a_scripted_training_step_runs_its_commands_in_the_instance_container(tiny):
    """One f-OPD step on a scripted episode: its commands run in the instance container (the observation holds the
    image's commit and user, which the host has not), env tokens are masked out, and the step trains."""
    import torch

    from opd_harness.backends import SamplingParams
    from opd_harness.backends.hf import HFBackend
    from opd_harness.backends.replay import ReplayBackend
    from opd_harness.models.tiny import TinyArch, build_tiny_model
    from opd_harness.registry import METHODS
    from opd_harness.rollout import rollout
    from opd_harness.trajectory import to_tensor_batch
    from opd_harness.tasks.swebench.agent import SUBMIT
    from opd_harness.trainers.learner import train_step
    from opd_harness.trainers.pipeline import behaviour_logprobs
    from opd_harness.trainers.teacher import score_teacher

    root, _ = tiny
    task = tiny_task(root)
    (problem,) = task.load()
    turns = [
        "```bash\ngit log -1 --format='%an/%s' && id -u && sed -i 's/(len(values) - 1)/len(values)/' calc.py\n```",
        f"```bash\necho {SUBMIT}\n```",
    ]
    scripted = ReplayBackend({(task.name, problem.id): [turns]})
    (traj,) = rollout(scripted, task, [problem], SamplingParams())
    env_segments = [s for s in traj.segments if s.kind == "env"]
    assert len(env_segments) == 1 and "SWE-bench/base\n65534\n" in env_segments[0].text  # the image's commit, the sandbox user
    assert "+    return sum(values) / len(values)" in traj.metadata["outcome"]["patch"]  # the command changed the container's tree
    tok = scripted.tokenizer
    arch = TinyArch(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64, max_positions=4096)
    student, teacher = (build_tiny_model(arch, len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, seed=s) for s in (0, 1))
    batch = to_tensor_batch([traj], tok.pad_token_id)
    method = METHODS.get("f_opd")
    hparams = method.hparams()
    needs = method.needs(hparams)
    if "old_logprobs" in needs:
        batch.old_logprobs = behaviour_logprobs(HFBackend(student, tok, batch_size=1), batch)
    score_teacher(HFBackend(teacher.requires_grad_(False), tok, batch_size=1), batch, kind="full" if "teacher_dist" in needs else "sampled")
    prompt = len(traj.prompt_ids)
    offsets, at = {}, prompt
    for seg in traj.segments:
        offsets.setdefault(seg.kind, []).append((at, at + len(seg.token_ids)))
        at += len(seg.token_ids)
    mask = batch.loss_mask[0]
    assert all(mask[a:b].sum() == 0 for a, b in offsets["env"]) and mask[:prompt].sum() == 0
    assert all(bool((mask[a:b] == 1).all()) for a, b in offsets["model"])
    before = [p.detach().clone() for p in student.parameters()]
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
    state = method.make_state(hparams) if method.make_state else None
    stats = train_step(student, optimizer, batch, method, hparams, state)
    assert torch.isfinite(torch.tensor(stats["loss"])) and stats["grad_norm"] > 0 and stats["skipped"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, student.parameters(), strict=True))


def test_a_52_mb_replayed_patch_fails_quickly_in_bounded_memory(tiny, tmp_path):
    """A replay row with a 52 MB patch (it took `harness eval` past 17 GB RSS, tokenised character by character) fails
    with code patch_too_large, in seconds and a few hundred MB over the process's baseline, before any image is built."""
    import os
    import sys
    import time

    root, patches = tiny
    data = root / "data"
    big = patches["gold"] + "".join(f"+# padding line {i:07d} {'x' * 40}\n" for i in range(52_000_000 // 64))
    model = tmp_path / "big.jsonl"
    model.write_text(json.dumps({"task": "swebench", "id": IID, "completion": big}) + "\n")
    code = (f"from opd_harness.tasks.swebench import upstream; upstream.register_repo({REPO!r}, "
            f"{{{VERSION!r}: {{'python': '3.9', 'test_cmd': 'python -m unittest -v'}}}}, "
            "parser='django/django')\nimport atexit, resource, sys\n"
            "from opd_harness.cli import main\nimport opd_harness.evaluation, opd_harness.tasks.swebench.task\n"
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "atexit.register(lambda: print('RSS_KB', base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr))\n"
            "main()")  # fmt: skip
    args = ["eval", "--task", "swebench", "--backend", "replay", "--model", str(model), "--k", "1", "--out", str(tmp_path / "out"),
            "--json", "--data-dir", str(data), "--task-arg", f"swebench.dataset={data / 'swebench' / 'tiny.jsonl'}",
            "--task-arg", f"swebench.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout[proc.stdout.index("{") :])["tasks"]["swebench"]
    assert (got["n_pass"], got["n_fail"], got["n_errors"]) == (0, 1, 0), got
    from opd_harness.store import Store

    store = Store(tmp_path / "out")
    (run,) = store.runs()
    (sample,) = store.samples(run["run_id"], 0, "swebench")
    assert "patch_too_large" in sample["details"] and not (tmp_path / "cache" / "logs").exists()  # refused before any grading
    base_kb, peak_kb = (int(x) for x in proc.stderr.rsplit("RSS_KB", 1)[1].split())
    assert (peak_kb - base_kb) < 1_000_000 and seconds < 120, (peak_kb - base_kb, seconds)


@pytest.mark.parametrize(
    ("rebuild", "code"), [("true", ""), ("false", "install_failed"), ("echo 'collect_ignore = []' > conftest.py", "test_tampering")]
)
def test_a_rebuild_runs_before_the_tests_and_cannot_plant_test_infrastructure(rebuild, code, tiny, monkeypatch):
    """Where a rebuild runs (code of the patched repository, before the tests), a failed one fails the patch and a
    steering file it writes is found by the hash check that follows it."""
    from opd_harness.tasks.swebench import grading

    root, patches = tiny
    task = tiny_task(root)
    row = task.load()[0].meta
    monkeypatch.setattr(grading, "rebuild_command", lambda spec, files, policy: rebuild)
    outcome = task.grade_patch(row, patches["gold"])
    assert (outcome.status, outcome.code) == (("pass", "") if not code else ("fail", code)), outcome.reason
