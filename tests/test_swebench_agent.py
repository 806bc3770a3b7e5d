"""The mini-swe-agent-style environment on a real sandbox session with a small git repository: persistent shell
state, observations, format errors, limits, loop detection, and the patch collected however the episode ends."""

from __future__ import annotations

import pytest

from opd_harness.tasks.agentic.shell_env import AgentLimits, head_tail, parse_command
from opd_harness.tasks.swebench.agent import SUBMIT, SwebenchAgentEnv

REPO = {"repo/calc.py": b"def add(a, b):\n    return a - b\n", "repo/README": b"calc\n"}


def bash(command: str) -> str:
    return f"THOUGHT: next step.\n\n```bash\n{command}\n```"


@pytest.fixture
def make_env(sb):
    """Agent environments on sessions of the provider under test, each with a committed copy of REPO."""
    from opd_harness.sandbox import ExecRequest

    envs = []

    def open_session():
        session = sb.session()
        session.write_files(REPO)
        setup = (
            "cd repo && git init -q && git -c user.email=a@b -c user.name=a add -A && git -c user.email=a@b -c user.name=a commit -qm base"
        )
        assert session.run(ExecRequest(argv=["bash", "-c", setup])).success
        return session

    def make(**limits):
        env = SwebenchAgentEnv("fix add", open_session, workdir="repo", limits=AgentLimits(**limits))
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()


def test_shell_state_persists_and_the_patch_is_the_diff(make_env):
    env = make_env()
    first = env.step(bash("mkdir -p sub && cd sub && export FLAVOUR=mint && echo ready"))
    assert first.observation.content == "<returncode>0</returncode>\n<output>\nready\n</output>" and not first.done
    second = env.step(bash('echo "$PWD $FLAVOUR"'))
    assert second.observation.content.endswith("/repo/sub mint\n</output>")
    env.step(
        bash("cd .. && sed -i 's/a - b/a + b/' calc.py && echo new > NOTES && git add NOTES && python3 -m pytest -q 2>&1 | tail -1; false")
    )
    assert env.step(bash(f"echo {SUBMIT}")).done
    patch = env.outcome()["patch"]
    assert "-    return a - b\n+    return a + b" in patch and "+++ b/NOTES" in patch and ".agent-" not in patch
    assert env.metrics()["submitted"] == 1 and env.metrics()["ran_tests"] == 1 and env.metrics()["steps"] == 4


def test_the_patch_is_against_the_base_commit_and_leaves_untracked_files_out(make_env):
    """Commits and stashes move HEAD, not the base; files the agent staged are shipped, scratch files it never added
    are not; a patch over max_patch_bytes is not read."""
    env = make_env()
    env.step(bash("sed -i 's/a - b/a + b/' calc.py && git -c user.email=a@b -c user.name=a commit -qam fix"))  # HEAD moves to the fix
    env.step(bash("echo wip >> calc.py && git stash -q"))  # the work tree is back at the fix commit
    env.step(bash("echo staged > ADDED && git add ADDED && git rm -q README && echo 'print(1)' > reproduce.py"))
    patch = env.outcome()["patch"]
    assert "-    return a - b\n+    return a + b" in patch and "wip" not in patch
    assert "+++ b/ADDED" in patch and "--- a/README\n+++ /dev/null" in patch and "reproduce.py" not in patch
    env = make_env(max_patch_bytes=200)
    env.step(bash("seq 1 1000 > big.txt && git add big.txt"))
    assert env.outcome() == {"patch": "", "commands": ["seq 1 1000 > big.txt && git add big.txt"], "patch_too_large": True}


def test_format_errors_and_limits_end_the_episode(make_env):
    env = make_env(max_format_errors=2)
    assert "exactly one" in env.step("no command here").observation.content
    assert env.step(bash("echo a") + bash("echo b")).done  # second format error in a row
    assert env.metrics()["format_errors"] == 2 and env.outcome()["patch"] == ""  # nothing ran: no container needed
    env = make_env(max_steps=2)
    assert not env.step(bash("echo 1")).done and env.step(bash("echo 2")).done


def test_loops_timeouts_and_long_output(make_env):
    env = make_env(command_timeout_s=1.0, max_output_chars=200)
    for _ in range(3):
        env.step(bash("ls"))
    assert env.metrics()["repeated_loop"] == 1
    timed_out = env.step(bash("sleep 5")).observation.content
    assert "timed out after 1 s" in timed_out and env.metrics()["command_timeouts"] == 1
    long = env.step(bash("seq 1 5000")).observation.content
    assert "characters elided" in long and "\n1\n2\n" in long and long.rstrip().endswith("5000\n</output>")


def test_parsing_and_truncation_units():
    assert parse_command(bash("ls -la"), "fenced") == ("ls -la", None)
    assert parse_command("<command>pwd</command>", "tagged") == ("pwd", None)
    assert parse_command("```bash\n\n```", "fenced")[0] is None
    assert head_tail("x" * 10, 20) == "x" * 10 and len(head_tail("ab" * 100, 20)) < 80


def test_a_unified_diff_as_first_reply_is_the_submitted_patch(make_env):
    patch = (
        "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n"
        "@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
    )
    env = make_env()
    assert env.step(patch).done and env.outcome()["patch"] == patch and env.metrics()["submitted"] == 1
    assert env.metrics()["tool_calls"] == 0 and env.metrics()["invalid_tool_calls"] == 0  # no command ran (was -1)
    env = make_env()
    assert not env.step(bash("echo hi")).done and "format error" in env.step(patch).observation.content.lower()  # only as the first reply
