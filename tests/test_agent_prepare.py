"""A shell agent's sandbox session opens in the background while the model writes its first turn (``Env.prepare``,
called by the rollout when a model generates): the first command waits for it, a failure to open it is the episode's
infrastructure error, an interrupted rollout still closes a session that was still opening, and replayed turns (no
generation to overlap) open nothing up front. Stub sessions here; the real instance container in test_swebench.py."""

from __future__ import annotations

import threading
import time

import pytest
from scripted_model import ScriptedModel

from opd_harness.backends import SamplingParams
from opd_harness.backends.replay import ReplayBackend
from opd_harness.rollout import rollout
from opd_harness.task import Problem, Score, Task, TaskOptions
from opd_harness.sandbox import ExecResult, SandboxUnavailable
from opd_harness.tasks.agentic.shell_env import AgentLimits, ShellAgentEnv

SUBMIT = "DONE_SUBMIT"


def bash(command: str) -> str:
    return f"```bash\n{command}\n```"


class StubSession:
    """Answers every command with ``ran``; records the commands and whether it was closed."""

    def __init__(self) -> None:
        self.commands: list[str] = []
        self.closed = False

    def run(self, request) -> ExecResult:
        self.commands.append(request.argv[-1])
        return ExecResult(status="ok", stdout="ran\n", exit_code=0)

    def close(self) -> None:
        self.closed = True


class Opener:
    """An ``open_session`` that takes ``delay_s`` (or raises ``fail``); ``started`` is set when an opening begins."""

    def __init__(self, delay_s: float = 0.0, fail: Exception | None = None) -> None:
        self.delay_s, self.fail = delay_s, fail
        self.started = threading.Event()
        self.sessions: list[StubSession] = []

    def __call__(self) -> StubSession:
        self.started.set()
        time.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        self.sessions.append(StubSession())
        return self.sessions[-1]


class AgentTask(Task):
    name = "agent_stub"
    description = "a shell agent on stub sessions"
    Options = TaskOptions
    multi_turn = True

    def __init__(self, opener: Opener) -> None:
        super().__init__(None)
        self.opener = opener
        self.envs: list[ShellAgentEnv] = []

    def read_problems(self, split, data_dir):
        return [Problem(id="p0", question="fix it", answer="x")]

    def env(self, problem, tokenizer) -> ShellAgentEnv:
        env = ShellAgentEnv("fix it\n", self.opener, workdir="/w", limits=AgentLimits(max_steps=5), submit_word=SUBMIT)
        self.envs.append(env)
        return env

    def grade_many(self, problems, completions):
        return [Score("pass") for _ in completions]

    @property
    def grader(self):
        return ("agent_stub", "1")


def test_the_session_opens_while_the_model_writes_its_first_turn():
    """The first generation waits (up to 5 s) for the opening to begin: it begins during that generation, so the
    command then runs at once. (Opened on the first command, it began only after the generation returned.)"""
    opener = Opener(delay_s=0.2)
    seen: list[bool] = []
    model = ScriptedModel([bash("ls"), bash(f"echo {SUBMIT}")], think=lambda call: call == 0 and seen.append(opener.started.wait(5)))
    task = AgentTask(opener)
    (traj,) = rollout(model, task, task.load(), SamplingParams())
    assert seen == [True]
    assert traj.metadata["episode"]["stop_reason"] == "done" and "env_error" not in traj.metadata
    (session,) = opener.sessions
    assert len(session.commands) == 1 and "\nls\n" in session.commands[0] and session.closed
    assert "<returncode>0</returncode>" in traj.segments[1].text


def test_a_session_that_fails_to_open_is_the_episodes_infrastructure_error():
    """The opening's failure surfaces at the first command as the episode's ``env_error`` (graded error, not fail); an
    agent that only submits never needs the session, so the same failure is no error there."""
    opener = Opener(fail=SandboxUnavailable("the daemon is gone"))
    task = AgentTask(opener)
    (traj,) = rollout(ScriptedModel([bash("ls")]), task, task.load(), SamplingParams())
    assert traj.metadata["episode"]["stop_reason"] == "env_error"
    assert traj.metadata["env_error"] == "step: SandboxUnavailable: the daemon is gone"
    task = AgentTask(Opener(fail=SandboxUnavailable("the daemon is gone")))
    (traj,) = rollout(ScriptedModel([bash(f"echo {SUBMIT}")]), task, task.load(), SamplingParams())
    assert traj.metadata["episode"]["stop_reason"] == "done" and "env_error" not in traj.metadata
    assert task.opener.started.is_set()  # it was tried, in the background


def test_an_interrupted_rollout_closes_the_session_that_was_still_opening():
    """Generation fails while the session is still opening: the rollout's close waits for the opening and closes it."""
    opener = Opener(delay_s=0.5)

    def interrupt(call: int) -> None:
        opener.started.wait(5)
        raise KeyboardInterrupt

    task = AgentTask(opener)
    with pytest.raises(KeyboardInterrupt):
        rollout(ScriptedModel([bash("ls")], think=interrupt), task, task.load(), SamplingParams())
    (session,) = opener.sessions
    assert session.closed and session.commands == []


def test_close_during_the_opening_waits_for_it_and_closes_the_session_once():
    opener = Opener(delay_s=0.3)
    env = ShellAgentEnv("p", opener, workdir="/w", limits=AgentLimits(), submit_word=SUBMIT)
    env.prepare()
    env.prepare()  # once only
    env.close()
    env.close()
    assert len(opener.sessions) == 1 and opener.sessions[0].closed


def test_replayed_turns_open_nothing_up_front():
    """A replay backend answers at once: no generation to overlap, and an episode that only submits opens no session."""
    opener = Opener()
    task = AgentTask(opener)
    replay = ReplayBackend({(task.name, "p0"): [[bash(f"echo {SUBMIT}")]]})
    (traj,) = rollout(replay, task, task.load(), SamplingParams())
    assert traj.metadata["episode"]["stop_reason"] == "done" and not opener.started.is_set()


def test_close_while_a_step_opens_the_session_closes_it_and_runs_no_command():
    """Without ``prepare`` (replayed turns) the first command opens the session in its step's thread. An interrupt's
    close meanwhile waits for that opening and closes the session, and the step raises instead of starting the
    command; so no interrupted rollout waits for a command's limit (SIGTERM mid-opening took 60-70 s before)."""
    from opd_harness.tasks.agentic.shell_env import EpisodeClosed

    opener = Opener(delay_s=0.5)
    env = ShellAgentEnv("p", opener, workdir="/w", limits=AgentLimits(), submit_word=SUBMIT)
    raised: list[BaseException] = []

    def step() -> None:
        try:
            env.step(bash("sleep 120"))
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            raised.append(exc)

    stepping = threading.Thread(target=step)
    stepping.start()
    assert opener.started.wait(5)
    env.close()
    (session,) = opener.sessions  # close returned after the opening, having closed what it opened
    assert session.closed
    stepping.join(5)
    assert not stepping.is_alive() and session.commands == []
    assert len(raised) == 1 and isinstance(raised[0], EpisodeClosed)
    with pytest.raises(EpisodeClosed):  # closed before any opening began: none begins
        closed = ShellAgentEnv("p", Opener(), workdir="/w", limits=AgentLimits(), submit_word=SUBMIT)
        closed.close()
        closed.step(bash("ls"))



def test_an_interrupted_replay_closes_the_session_its_first_step_was_opening(monkeypatch):
    """The rollout is interrupted (a failed generation for another episode) while a replayed episode's first step opens
    its session: the rollout ends as soon as that opening is done, the session closed and its command (which would
    block for 20 s here) never started."""
    opener = Opener(delay_s=0.5)
    task = AgentTask(opener)
    replay = ReplayBackend({(task.name, "p0"): [[bash("sleep 120")], ["no command", "no command"]]})
    generate, calls = replay.generate, []

    def generate_then_interrupt(prompts, params, keys=None):
        calls.append(len(prompts))
        if len(calls) > 1:  # the second episode's second turn: the first one's step is opening its session by now
            assert opener.started.wait(5)
            raise KeyboardInterrupt
        return generate(prompts, params, keys)

    monkeypatch.setattr(replay, "generate", generate_then_interrupt)
    monkeypatch.setattr(StubSession, "run", lambda self, request: (self.commands.append(request.argv[-1]), time.sleep(20))[0])
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        rollout(replay, task, task.load(), SamplingParams(n=2))
    assert time.monotonic() - started < 10
    (session,) = opener.sessions
    assert session.closed and session.commands == []
