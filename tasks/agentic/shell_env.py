"""A mini-swe-agent-style environment: the model fixes a repository one bash command per turn.

Every reply must hold exactly one command (``action_format``: ``fenced`` = one ```bash block, as mini-swe-agent;
``tagged`` = one ``<command>…</command>``). It runs in the episode's sandbox session (the instance container,
network off) with its working directory and exported variables carried over to the next turn (mini-swe-agent
runs each command in a fresh subshell; persistence is the better default here). The observation, a ``user``
message, is ``<returncode>N</returncode>`` and ``<output>…</output>``, head and tail kept when the output
exceeds ``max_output_chars`` (10,000). A reply with no command or several is a format error (the model is told
why); ``max_format_errors`` in a row end the episode. The agent submits with
``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``; the step and wall-time limits also end the episode. However it
ends, its patch (:func:`patch_script`) is the diff against the base commit (recorded when the session opens, so
``git commit``/``git stash``/``git reset`` cannot move it) of every file git tracks (edited, deleted, committed)
and every new file the agent staged with ``git add``; new files left untracked (a reproduction script) are not in
it. It is collected before the container goes; one over ``max_patch_bytes`` is not read (``patch_too_large``).
A first reply that is itself a unified diff is taken as the submitted patch (SWE-bench's prediction format), so
stored predictions and agents go through the same episodes.

Per episode it counts steps, format errors, commands that timed out, whether the agent submitted, whether it
ran any test, and whether it repeated the same command 3+ times in a row (a loop).
"""

from __future__ import annotations

import re
import shlex
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from harness.episode import Env, Observation, StepResult
from tasks.swebench import patches

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
FENCED_BASH = re.compile(r"```(?:bash|sh|shell)?[ \t]*\n(.*?)```", re.DOTALL)
TAGGED = re.compile(r"<command>(.*?)</command>", re.DOTALL)
TEST_COMMAND = re.compile(r"\b(pytest|runtests\.py|unittest|tox|nosetests|manage\.py\s+test|python3?\s+-m\s+(pytest|unittest)|test_\w+\.py)\b")
LOOP_REPEATS = 3  # the same command this many times in a row is a loop

SYSTEM_PROMPT = """You are a helpful assistant that can interact with a computer shell to solve programming tasks.
Your response must contain exactly ONE {block} with ONE command (or commands connected with && or ||).
Include a THOUGHT section before your command explaining your reasoning.
Each command runs in a shell in the repository; the working directory and exported variables persist between commands.
When you are done, submit with the command: echo {submit}"""

INSTANCE_PROMPT = """<pr_description>
Consider the following PR description:
{problem}
</pr_description>

The repository is at {workdir}. Make changes to non-test files so that the issue in the PR description is resolved.
Recommended workflow: find the relevant code, write a script that reproduces the issue, edit the source, verify the fix
(run the reproduction and the relevant tests), then submit with: echo {submit}
Your patch is the diff against the original commit of the files git tracks (edited, deleted or committed) and of the new
files you `git add`; new files you do not `git add` (such as a reproduction script) are left out."""

BLOCK_NAMES = {"fenced": "bash code block (```bash ... ```)", "tagged": "<command>...</command> block"}


@dataclass(frozen=True)
class AgentLimits:
    """Limits of one agent episode."""

    max_steps: int = 30
    wall_time_s: float = 1800.0
    command_timeout_s: float = 60.0
    max_format_errors: int = 3
    max_output_chars: int = 10_000
    max_patch_bytes: int = 2 << 20  # a larger patch is not collected: the episode fails with code patch_too_large


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


def looks_like_patch(text: str) -> bool:
    """Whether a reply is a unified diff (a SWE-bench prediction) rather than an agent's turn."""
    head = text.lstrip()
    return head.startswith(("diff --git ", "--- a/", "--- ")) and "\n+++ " in head


def is_submission(command: str) -> bool:
    """The agent's way to end the episode: a command whose first line echoes the submit word."""
    first = command.strip().splitlines()[0] if command.strip() else ""
    return first.startswith("echo") and SUBMIT in first


GIT = f"{patches.GIT} --no-replace-objects"


def patch_script(workdir: str, base: str, max_bytes: int) -> str:
    """A bash script printing the episode's patch: a scratch index (outside the repository) holding the base tree,
    updated from the work tree for every path the base, ``HEAD`` or the agent's index knows, diffed against the base.
    Untracked files the agent never added are in none of them. Exit 3: the base commit is gone."""
    index = f"/tmp/.opd-patch-index-{uuid.uuid4().hex[:12]}"
    return (
        f"cd {shlex.quote(workdir)} || exit 2\n"
        f"{GIT} cat-file -e {base}^{{commit}} 2>/dev/null || exit 3\n"
        f"{{ {GIT} ls-tree -r -z --name-only {base}; {GIT} ls-tree -r -z --name-only HEAD 2>/dev/null; {GIT} ls-files -z 2>/dev/null; }}"
        f" | sort -zu > {index}.paths\n"
        f"export GIT_INDEX_FILE={index}\n"
        f"{GIT} read-tree {base} || exit 2\n"
        f"{GIT} update-index -q --add --remove --ignore-submodules -z --stdin < {index}.paths >/dev/null 2>&1\n"
        f"{GIT} diff --cached --no-color --no-ext-diff --no-textconv --binary {base} | head -c {max_bytes + 1}\n"
        f"rc=${{PIPESTATUS[0]}}; rm -f {index} {index}.paths\n"
        "[ $rc = 0 ] || [ $rc = 141 ]  # 141: cut by head at the limit (SIGPIPE)\n"
    )


def persistent(command: str, workdir: str, state: str) -> str:
    """A bash script running ``command`` in the directory and with the exports the previous command left behind."""
    return (
        f"mkdir -p {state}; cd \"$(cat {state}/cwd 2>/dev/null || echo {shlex.quote(workdir)})\" 2>/dev/null || cd {shlex.quote(workdir)}\n"
        f"[ -f {state}/env ] && . {state}/env\n"
        f"{command}\n"
        f"__rc=$?; pwd > {state}/cwd; export -p > {state}/env; exit $__rc\n"
    )


class ShellAgentEnv(Env):
    """One agent episode in one sandbox session opened on the first command (``open_session()``)."""

    def __init__(self, prompt: str, open_session: Callable[[], object], *, workdir: str, limits: AgentLimits, action_format: str = "fenced") -> None:
        if action_format not in BLOCK_NAMES:
            raise ValueError(f"action_format must be one of {sorted(BLOCK_NAMES)}, got {action_format!r}")
        self.prompt, self.workdir, self.limits, self.action_format = prompt, workdir, limits, action_format
        self.max_turns = limits.max_steps
        self._open_session = open_session
        self._session = None
        self._state = f"/tmp/.agent-{uuid.uuid4().hex[:12]}"  # outside the repository, so never part of the patch
        self._started = time.monotonic()
        self.commands: list[str] = []
        self.counts = {"steps": 0, "format_errors": 0, "command_timeouts": 0, "submitted": 0, "ran_tests": 0, "repeated_loop": 0}
        self._consecutive_format_errors = 0
        self.submitted_patch: str | None = None
        self.base_commit: str | None = None  # HEAD when the session opened: what the patch is diffed against

    def reset(self) -> str:
        return self.prompt

    def step(self, model_text: str) -> StepResult:
        self.counts["steps"] += 1
        if self.counts["steps"] == 1 and looks_like_patch(model_text):  # a prediction in SWE-bench's own format
            self.submitted_patch = model_text
            self.counts["submitted"] = 1
            return StepResult(None, True)
        command, error = parse_command(model_text, self.action_format)
        if command is None:
            self.counts["format_errors"] += 1
            self._consecutive_format_errors += 1
            return StepResult(self.observation(error or ""), self._consecutive_format_errors >= self.limits.max_format_errors or self.out_of_budget())
        self._consecutive_format_errors = 0
        self.commands.append(command)
        if self.commands[-LOOP_REPEATS:] == [command] * LOOP_REPEATS:
            self.counts["repeated_loop"] = 1
        if is_submission(command):
            self.counts["submitted"] = 1
            return StepResult(None, True)
        if TEST_COMMAND.search(command):
            self.counts["ran_tests"] = 1
        return StepResult(self.observation(self.execute(command)), self.out_of_budget())

    def out_of_budget(self) -> bool:
        return self.counts["steps"] >= self.limits.max_steps or time.monotonic() - self._started >= self.limits.wall_time_s

    def execute(self, command: str) -> str:
        """Run one command with persistence; its return code and (head+tail) output as the agent sees them."""
        from sandbox import ExecRequest

        result = self.session().run(ExecRequest(argv=["bash", "-c", persistent(command, self.workdir, self._state)], timeout_s=self.limits.command_timeout_s))
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

    def session(self):
        """The episode's session, opened on first use; the repository's commit then is the base of the patch."""
        if self._session is None:
            from sandbox import ExecRequest

            self._session = self._open_session()
            head = self._session.run(
                ExecRequest(argv=["bash", "-c", f"cd {shlex.quote(self.workdir)} && {GIT} rev-parse HEAD"], timeout_s=60)
            )
            if head.status != "ok" or head.exit_code != 0 or not re.fullmatch(r"[0-9a-f]{40,64}", head.stdout.strip()):
                raise RuntimeError(
                    f"the repository in the session has no commit to diff against ({head.status}): "
                    f"{(head.stderr or head.error or '')[-300:]}"
                )
            self.base_commit = head.stdout.strip()
        return self._session

    def metrics(self) -> dict[str, float]:
        """The counters, plus the tool-use view every agentic task shares (``harness.evaluation.summarize_episodes``): tool
        calls are commands run and format errors, invalid calls the format errors, executed calls the commands run, and
        tool errors the commands that timed out."""
        executed = sum(not is_submission(command) for command in self.commands)  # a diff submitted as the first reply is no command
        shared = {
            "tool_calls": executed + self.counts["format_errors"],
            "invalid_tool_calls": self.counts["format_errors"],
            "executed_tool_calls": executed,
            "tool_errors": self.counts["command_timeouts"],
        }
        return {name: float(value) for name, value in {**self.counts, **shared}.items()}

    def outcome(self) -> dict:
        """The episode's patch (:func:`patch_script`); ``patch_too_large`` when it is over ``max_patch_bytes``, and
        ``patch_note`` when the agent removed the base commit (an empty patch: the agent's doing, graded fail)."""
        from sandbox import ExecRequest

        if self.submitted_patch is not None:
            return {"patch": self.submitted_patch, "commands": []}
        if self._session is None:  # no command ever ran: the repository is untouched
            return {"patch": "", "commands": list(self.commands)}
        limit = self.limits.max_patch_bytes
        script = patch_script(self.workdir, self.base_commit or "HEAD", limit)
        result = self.session().run(ExecRequest(argv=["bash", "-c", script], timeout_s=120, max_output_bytes=limit + 1))
        if result.status == "ok" and result.exit_code == 3:
            return {
                "patch": "",
                "commands": list(self.commands),
                "patch_note": "the base commit is gone from the repository (the agent rewrote .git)",
            }
        if result.status != "ok" or result.exit_code != 0:
            raise RuntimeError(f"could not read the patch ({result.status}, exit {result.exit_code}): {(result.stderr or result.error or '')[-500:]}")
        if len(result.stdout.encode(errors="surrogateescape")) > limit or result.stdout_truncated:
            return {"patch": "", "commands": list(self.commands), "patch_too_large": True}
        return {"patch": result.stdout, "commands": list(self.commands)}

    def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()
