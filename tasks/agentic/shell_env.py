"""A mini-swe-agent-style shell agent: one bash command per turn in a sandbox session, with budgets and metrics.

Every reply must hold exactly one command (``action_format``: ``fenced`` = one ```bash block, as mini-swe-agent;
``tagged`` = one ``<command>…</command>``). It runs in the episode's sandbox session (opened on the first command, or
in the background from :meth:`ShellAgentEnv.prepare`, during the model's first turn; a failure to open it is the
first command's infrastructure error; at most 16 sessions opening at once) with its working directory and exported variables
carried over to the next turn (mini-swe-agent runs each command in a fresh subshell; persistence is the better default
here). The observation, a ``user`` message, is ``<returncode>N</returncode>`` and ``<output>…</output>``, head and tail
kept when the output exceeds ``max_output_chars``. A reply with no command or several is a format error (the model is told why);
``max_format_errors`` in a row end the episode. The agent submits with ``echo <submit_word>``; the step and
wall-time limits also end the episode.

What the episode produced is the benchmark's: :meth:`ShellAgentEnv.outcome` runs the optional :class:`Check` (a
grader command, its files written first so the agent cannot have edited them) in the session before it goes;
subclasses override :meth:`~ShellAgentEnv.on_session_open` and :meth:`~ShellAgentEnv.outcome` (SWE-bench's patch,
:mod:`opd_harness.tasks.swebench.agent`).

Per episode it counts steps, format errors, commands that timed out, whether the agent submitted, whether it
ran any test, and whether it repeated the same command 3+ times in a row (a loop).
"""

from __future__ import annotations

import posixpath
import re
import shlex
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opd_harness.episode import Env, Observation, StepResult

if TYPE_CHECKING:  # a Future is made with the first session
    from concurrent.futures import Future

FENCED_BASH = re.compile(r"```(?:bash|sh|shell)?[ \t]*\n(.*?)```", re.DOTALL)
TAGGED = re.compile(r"<command>(.*?)</command>", re.DOTALL)
TEST_COMMAND = re.compile(
    r"\b(pytest|runtests\.py|unittest|tox|nosetests|manage\.py\s+test|python3?\s+-m\s+(pytest|unittest)|test_\w+\.py)\b"
)
LOOP_REPEATS = 3  # the same command this many times in a row is a loop
OPENINGS = threading.BoundedSemaphore(16)  # sessions opening in the background at once (prepare), across episodes

SYSTEM_PROMPT = """You are a helpful assistant that can interact with a computer shell to solve programming tasks.
Your response must contain exactly ONE {block} with ONE command (or commands connected with && or ||).
Include a THOUGHT section before your command explaining your reasoning.
Each command runs in a shell in the repository; the working directory and exported variables persist between commands.
When you are done, submit with the command: echo {submit}"""

BLOCK_NAMES = {"fenced": "bash code block (```bash ... ```)", "tagged": "<command>...</command> block"}


def system_prompt(action_format: str, submit_word: str) -> str:
    """mini-swe-agent's system message: the reply format (one command per turn) and how to submit."""
    return SYSTEM_PROMPT.format(block=BLOCK_NAMES[action_format], submit=submit_word)


@dataclass(frozen=True)
class AgentLimits:
    """Limits of one agent episode."""

    max_steps: int = 30
    wall_time_s: float = 1800.0
    command_timeout_s: float = 60.0
    max_format_errors: int = 3
    max_output_chars: int = 10_000
    max_patch_bytes: int = 2 << 20  # SWE-bench: a larger patch is not collected (the episode fails with code patch_too_large)


@dataclass(frozen=True)
class Check:
    """A grader command run in the episode's session when the agent is done, in ``workdir``; ``files`` (paths relative
    to ``workdir``) are written just before it, so the agent cannot have edited them."""

    command: str
    files: Mapping[str, bytes] = field(default_factory=dict)
    timeout_s: float = 60.0
    max_output_chars: int = 4000


def parse_command(reply: str, action_format: str) -> tuple[str | None, str | None]:
    """(command, None) for a reply with exactly one command, else (None, why it is a format error)."""
    blocks = (FENCED_BASH if action_format == "fenced" else TAGGED).findall(reply)
    if len(blocks) != 1:
        what = "no" if not blocks else f"{len(blocks)}"
        return None, f"Format error: your reply must contain exactly one {BLOCK_NAMES[action_format]}; it contained {what}."
    command = blocks[0].strip()
    return (command, None) if command else (None, "Format error: the command block is empty.")


def head_tail(text: str, limit: int) -> str:
    """``text`` when it fits, else its head and tail with the number of characters left out between them."""
    if len(text) <= limit:
        return text
    keep = limit // 2
    return f"{text[:keep]}\n[... {len(text) - 2 * keep} characters elided ...]\n{text[-keep:]}"


def is_submission(command: str, submit_word: str) -> bool:
    """The agent's way to end the episode: a command whose first line echoes the submit word."""
    first = command.strip().splitlines()[0] if command.strip() else ""
    return first.startswith("echo") and submit_word in first


def persistent(command: str, workdir: str, state: str) -> str:
    """A bash script running ``command`` in the directory and with the exports the previous command left behind."""
    return (
        f"mkdir -p {state}; cd \"$(cat {state}/cwd 2>/dev/null || echo {shlex.quote(workdir)})\" 2>/dev/null || cd {shlex.quote(workdir)}\n"
        f"[ -f {state}/env ] && . {state}/env\n"
        f"{command}\n"
        f"__rc=$?; pwd > {state}/cwd; export -p > {state}/env; exit $__rc\n"
    )


class EpisodeClosed(RuntimeError):
    """The episode was closed (an interrupt) while its step waited for its session."""


class ShellAgentEnv(Env):
    """One agent episode in one sandbox session opened on the first command (``open_session()``)."""

    def __init__(
        self,
        prompt: str,
        open_session: Callable[[], object],
        *,
        workdir: str,
        limits: AgentLimits,
        submit_word: str,
        action_format: str = "fenced",
        check: Check | None = None,
    ) -> None:
        if action_format not in BLOCK_NAMES:
            raise ValueError(f"action_format must be one of {sorted(BLOCK_NAMES)}, got {action_format!r}")
        self.prompt, self.workdir, self.limits, self.action_format = prompt, workdir, limits, action_format
        self.submit_word, self.check = submit_word, check
        self.max_turns = limits.max_steps
        self._open_session = open_session
        self._session = None
        self._opening: Future | None = None  # the session being opened (in the background by prepare, or by a step)
        self._closed = False  # close() was called: a session still opening is closed, no command starts
        self._state = f"/tmp/.agent-{uuid.uuid4().hex[:12]}"  # outside the work directory, so never part of what it produced
        self._started = time.monotonic()
        self.commands: list[str] = []
        self.counts = {"steps": 0, "format_errors": 0, "command_timeouts": 0, "submitted": 0, "ran_tests": 0, "repeated_loop": 0}
        self._consecutive_format_errors = 0

    def reset(self) -> str:
        return self.prompt

    def step(self, model_text: str) -> StepResult:
        self.counts["steps"] += 1
        command, error = parse_command(model_text, self.action_format)
        if command is None:
            self.counts["format_errors"] += 1
            self._consecutive_format_errors += 1
            give_up = self._consecutive_format_errors >= self.limits.max_format_errors
            return StepResult(self.observation(error or ""), give_up or self.out_of_budget())
        self._consecutive_format_errors = 0
        self.commands.append(command)
        if self.commands[-LOOP_REPEATS:] == [command] * LOOP_REPEATS:
            self.counts["repeated_loop"] = 1
        if is_submission(command, self.submit_word):
            self.counts["submitted"] = 1
            return StepResult(None, True)
        if TEST_COMMAND.search(command):
            self.counts["ran_tests"] = 1
        return StepResult(self.observation(self.execute(command)), self.out_of_budget())

    def out_of_budget(self) -> bool:
        return self.counts["steps"] >= self.limits.max_steps or time.monotonic() - self._started >= self.limits.wall_time_s

    def execute(self, command: str) -> str:
        """Run one command with persistence; its return code and (head+tail) output as the agent sees them."""
        from opd_harness.sandbox import ExecRequest

        script = persistent(command, self.workdir, self._state)
        result = self.session().run(ExecRequest(argv=["bash", "-c", script], timeout_s=self.limits.command_timeout_s))
        if result.status == "error":
            raise RuntimeError(f"the sandbox failed while running a command: {result.error}")
        output = result.stdout + result.stderr
        if result.status == "timeout":
            self.counts["command_timeouts"] += 1
            output += f"\nThe command timed out after {self.limits.command_timeout_s:g} s and was killed."
        code = result.exit_code if result.exit_code is not None else -1
        return f"<returncode>{code}</returncode>\n<output>\n{head_tail(output, self.limits.max_output_chars)}</output>"

    def observation(self, text: str) -> Observation:
        return Observation(content=text, role="user", raw=f"\n{text}\n")

    def prepare(self) -> None:
        """Open the session in a background thread (the first command waits for it)."""
        if self._session is None and self._opening is None and not self._closed:
            threading.Thread(target=self._open_into, args=(self._new_opening(),), name="agent-session-open", daemon=True).start()

    def _new_opening(self) -> Future:
        """A fresh opening for :meth:`close` to find: the Future the session is delivered through."""
        from concurrent.futures import Future  # with the first session: `harness tasks` does not load it

        self._opening = Future()
        return self._opening

    def _open_into(self, opening: Future) -> None:
        try:
            with OPENINGS:
                opening.set_result(self._open())
        except BaseException as exc:  # noqa: BLE001 - raised again where the session is needed
            opening.set_exception(exc)

    def _open(self):
        """A new session, with :meth:`on_session_open` run on it (closed again if that fails)."""
        session = self._open_session()
        try:
            self.on_session_open(session)
        except BaseException:
            session.close()
            raise
        return session

    def session(self):
        """The episode's session, opened on first use (in this thread) or awaited from :meth:`prepare` (then
        :meth:`on_session_open` has run on it); a failed opening raises here, and so does an episode closed meanwhile
        (:meth:`close` closed the session as soon as it was open: a command is never started in it)."""
        if self._session is None:
            opening = self._opening
            if opening is None:  # opened here, but through a Future as prepare's: close() can find it and close it
                opening = self._new_opening()
                if self._closed:
                    opening.set_exception(EpisodeClosed("the episode was closed before its session opened"))
                else:
                    self._open_into(opening)
            session = opening.result()
            if self._closed:
                raise EpisodeClosed("the episode was closed while its session opened")
            self._session = session
        return self._session

    def on_session_open(self, session) -> None:
        """Hook: called once the session is open, before any command runs (SWE-bench records the base commit)."""

    def metrics(self) -> dict[str, float]:
        """The counters, plus the tool-use view every agentic task shares (``opd_harness.evaluation.summarize_episodes``): tool
        calls are commands run and format errors, invalid calls the format errors, executed calls the commands run, and
        tool errors the commands that timed out."""
        executed = sum(not is_submission(command, self.submit_word) for command in self.commands)
        shared = {
            "tool_calls": executed + self.counts["format_errors"],
            "invalid_tool_calls": self.counts["format_errors"],
            "executed_tool_calls": executed,
            "tool_errors": self.counts["command_timeouts"],
        }
        return {name: float(value) for name, value in {**self.counts, **shared}.items()}

    def outcome(self) -> dict:
        """The commands run and, with a :class:`Check`, its result (``check``: exit code, status, head+tail output)."""
        if self.check is None:
            return {"commands": list(self.commands)}
        return {"commands": list(self.commands), "check": self.run_check(self.check)}

    def run_check(self, check: Check) -> dict:
        """Write the check's files, run its command in ``workdir`` (a fresh shell: none of the agent's exports)."""
        from opd_harness.sandbox import ExecRequest

        session = self.session()  # an agent that never ran a command is checked on the untouched work directory
        if check.files:
            session.write_files({posixpath.join(self.workdir, name): data for name, data in check.files.items()})
        script = f"cd {shlex.quote(self.workdir)} || exit 2\n{check.command}\n"
        result = session.run(ExecRequest(argv=["bash", "-c", script], timeout_s=check.timeout_s))
        if result.status == "error":
            raise RuntimeError(f"the sandbox failed while running the check: {result.error}")
        output = head_tail(result.stdout + result.stderr, check.max_output_chars)
        return {"status": result.status, "exit_code": result.exit_code, "output": output}

    def close(self) -> None:
        """Close the session; one still opening (:meth:`prepare`, or a step's first command) is awaited and closed."""
        self._closed = True
        opening, self._opening = self._opening, None
        session, self._session = self._session, None
        if session is None and opening is not None:
            try:
                session = opening.result()
            except BaseException:  # noqa: BLE001 - it never opened: nothing to close
                session = None
        if session is not None:
            session.close()
