"""SWE-bench grading in real Docker containers, on a tiny hand-made repository in SWE-bench's schema (fast), and
on one staged real instance (slow)."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from tasks.base import DataError
from tasks.swebench import upstream
from tasks.swebench.data import load_rows, validate_row
from tasks.swebench.grading import map_unittest_names
from tasks.swebench.images import environment_pins, failed_requirements
from tasks.swebench.task import SwebenchOptions, SwebenchTask

REPO, VERSION, IID = "opd-harness/tinycalc", "0.1", "opd-harness__tinycalc-1"
BASE = {
    "calc.py": 'def add(a, b):\n    return a + b\n\n\ndef mean(values):\n    """Arithmetic mean of a non-empty list."""\n    return sum(values) / (len(values) - 1)\n',
    "tests/__init__.py": "",
    "tests/test_calc.py": "import unittest\n\nfrom calc import add\n\n\nclass CalcTest(unittest.TestCase):\n    def test_add(self):\n        \"\"\"\n        add() sums two numbers (a docstring that starts on a new line).\n        \"\"\"\n        self.assertEqual(add(2, 3), 5)\n",
}
TEST_AFTER = BASE["tests/test_calc.py"].replace("from calc import add\n", "from calc import add, mean\n") + "\n    def test_mean(self):\n        self.assertEqual(mean([2, 4]), 3.0)\n"


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
        (tmp / name).write_text(text)
    return run("diff")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, docker_client):
    """A data dir with the tiny instance (snapshot + environment.yml with no pins + rows), and its patches."""
    upstream.register_repo(REPO, {VERSION: {"python": "3.9", "test_cmd": "python -m unittest -v"}}, parser="django/django")
    root = tmp_path_factory.mktemp("swe")
    fixed = BASE["calc.py"].replace("(len(values) - 1)", "len(values)")
    patches = {
        "gold": git_diff(BASE, {"calc.py": fixed}, root / "g1"),
        "breaks_p2p": git_diff(BASE, {"calc.py": fixed.replace("return a + b", "return a - b")}, root / "g2"),
        "test": git_diff(BASE, {"tests/test_calc.py": TEST_AFTER}, root / "g3"),
    }
    patches["no_apply"] = patches["gold"].replace("return sum(values)", "return total(values)")
    inst = root / "data" / "swebench" / "instances" / IID
    inst.mkdir(parents=True)
    with tarfile.open(inst / "repo.tar.xz", "w:xz") as tf:
        for name, text in BASE.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tf.addfile(info, io.BytesIO(text.encode()))
    (inst / "environment.yml").write_text("name: testbed\ndependencies:\n  - python=3.11\n")
    row = {
        "repo": REPO, "instance_id": IID, "base_commit": "0" * 40, "patch": patches["gold"], "test_patch": patches["test"],
        "problem_statement": "mean([2, 4]) returns 6.0 instead of 3.0", "version": VERSION,
        "FAIL_TO_PASS": json.dumps(["test_mean (tests.test_calc.CalcTest)"]), "PASS_TO_PASS": json.dumps(["test_add (tests.test_calc.CalcTest)"]),
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
    from tasks.base import DataNotFound
    from tasks.swebench.data import repo_tarball

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
    assert environment_pins("dependencies:\n  - python=3.6\n  - pip:\n      - numpy==1.19.5\n      - asgiref==3.4.1\n") == ["numpy==1.19.5", "asgiref==3.4.1"]
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

    from harness.cli import app

    root, patches = tiny
    data = root / "data"
    args = ["--data-dir", str(data), "--task-arg", f"swebench.dataset={data / 'swebench' / 'tiny.jsonl'}", "--task-arg", f"swebench.cache_dir={root / 'cache'}"]
    monkeypatch.setenv("HARNESS_DATA_DIR", str(data))  # --data-dir sets it for the process: restored after the test
    runner = CliRunner()
    built = runner.invoke(app, ["sandbox", "build", "--task", "swebench", *args])
    assert built.exit_code == 0, built.output
    assert IID in built.output and "dropped pins: none" in built.output
    model = tmp_path / "gold.jsonl"
    model.write_text(json.dumps({"task": "swebench", "id": IID, "completion": patches["gold"]}) + "\n")
    result = runner.invoke(app, ["eval", "--task", "swebench", "--backend", "replay", "--model", str(model), "--k", "1", "--out", str(tmp_path / "out"), "--json", *args])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])
    got = summary["tasks"]["swebench"]
    assert (got["n_pass"], got["n_fail"], got["n_errors"]) == (1, 0, 0), got


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_nothing_is_left_running_after_a_crash_mid_episode(how, tiny, tmp_path, docker_client):
    """An agent is inside `sleep 300` in its instance container when `harness eval` is stopped: SIGTERM removes the
    container before the exit; after SIGKILL the orphan is reaped by the next process that opens a sandbox."""
    import os
    import signal
    import sys
    import time

    from sandbox.docker import LABEL, OWNER_LABEL

    root, _ = tiny
    data = root / "data"
    turns = tmp_path / "turns.jsonl"
    turns.write_text(json.dumps({"task": "swebench", "id": IID, "turns": ["```bash\nsleep 300\n```"]}) + "\n")
    args = ["eval", "--task", "swebench", "--backend", "replay", "--model", str(turns), "--k", "1", "--out", str(tmp_path / "out"), "--data-dir", str(data),
            "--task-arg", f"swebench.dataset={data / 'swebench' / 'tiny.jsonl'}", "--task-arg", f"swebench.cache_dir={root / 'cache'}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    code = (f"from tasks.swebench import upstream; upstream.register_repo({REPO!r}, {{{VERSION!r}: {{'python': '3.9', 'test_cmd': 'python -m unittest -v'}}}}, "
            "parser='django/django')\nfrom harness.cli import main; main()")  # the tiny repository's spec, as the fixture registers it
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def mine() -> list[str]:
        found = docker_client.api.containers(all=True, filters={"label": f"{LABEL}=1"})
        return [c["Id"] for c in found if (c.get("Labels") or {}).get(OWNER_LABEL, "").split(":")[-2:-1] == [str(proc.pid)]]

    try:
        deadline = time.monotonic() + 300
        while not mine():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:] if proc.poll() is not None else "no container"
            time.sleep(0.2)
        time.sleep(1.0)  # the command is running in it
        proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        signalled = time.monotonic()
        proc.wait(timeout=120)
        if how == "sigterm":  # at once: not after the command's 60 s limit (no patch is read from an interrupted episode)
            assert proc.returncode == 128 + signal.SIGTERM and mine() == []
            assert time.monotonic() - signalled < 30, f"exit took {time.monotonic() - signalled:.0f} s after SIGTERM"
        else:
            assert len(mine()) == 1  # a killed process cleans nothing up itself
            reaper = "import sandbox\nwith sandbox.open_sandbox('docker') as sb: sb.run(sandbox.ExecRequest(argv=['true']))"  # the next user reaps
            subprocess.run([sys.executable, "-c", reaper], env=env, check=True, timeout=120)
            assert mine() == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for cid in mine():
            docker_client.api.remove_container(cid, force=True)


def test_open_instance_session_runs_in_the_repository(tiny):
    from sandbox import ExecRequest
    from tasks.swebench.session import open_instance_session

    root, _ = tiny
    data = root / "data"
    options = {"data_dir": str(data), "dataset": str(data / "swebench" / "tiny.jsonl"), "cache_dir": str(root / "cache")}
    with open_instance_session(IID, options) as session:
        script = "cd /testbed && git status --porcelain && git log --oneline | wc -l && python -c 'import calc, sys; print(calc.add(1, 2), sys.prefix)'"
        result = session.run(ExecRequest(argv=["bash", "-c", script], timeout_s=60))
        assert result.exit_code == 0, result.stderr
        assert result.stdout.split() == ["1", "3", "/opt/venv"]
        net = session.run(ExecRequest(argv=["python", "-c", "import socket; socket.create_connection(('pypi.org', 443), timeout=3)"], timeout_s=30))
        assert net.exit_code != 0


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
    from harness.backends import SamplingParams
    from harness.backends.replay import ReplayBackend
    from harness.evaluation import evaluate_task
    from tasks.swebench.agent_env import SUBMIT

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

    from harness.cli import app
    from harness.store import Store

    root, _ = tiny
    data = root / "data"
    sets = [f"task_args.swebench.dataset={data / 'swebench' / 'tiny.jsonl'}", f"task_args.swebench.cache_dir={root / 'cache'}",
            f"task_args.swebench.data_dir={data}", "task_args.swebench.max_steps=3", "trainer.max_new_tokens=48", "trainer.steps=2",
            "trainer.checkpoint_every=2", "trainer.prompts_per_step=1", "eval.k=2", "eval.teacher=false",
            "student.arch.max_positions=1024", "teacher.arch.max_positions=1024", "task_args.swebench.max_new_tokens=48",
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
