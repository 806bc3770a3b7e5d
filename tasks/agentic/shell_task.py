"""A shell-agent benchmark in the task's sandbox: the agent works in a folder, a check run there grades the episode.

A subclass reads its problems and says, per problem, which files the work folder starts with (:meth:`workspace`)
and which command grades it (:meth:`check`, exit 0 = pass); the kit gives the rest: options (sandbox, budgets),
mini-swe-agent's prompt, one :class:`~opd_harness.tasks.agentic.shell_env.ShellAgentEnv` per episode in a fresh session
(network off), the check run in that session before it closes, and the scores.
"""

from __future__ import annotations

import json
import posixpath
from abc import abstractmethod
from typing import Literal

from pydantic import Field

from opd_harness.tasks.agentic.sandboxed import SandboxedTask, SandboxOptions
from opd_harness.tasks.agentic.shell_env import AgentLimits, Check, ShellAgentEnv, system_prompt
from opd_harness.task import Problem, Score

SUBMIT_WORD = "TASK_COMPLETE"


class ShellAgentOptions(SandboxOptions):
    """Options of every shell-agent task: the episode's budgets and the reply format."""

    max_new_tokens: int = 1024
    max_context_tokens: int = Field(16384, ge=256, description="context budget of an episode (prompt, replies and observations)")
    max_steps: int = Field(15, ge=1, description="model turns (one bash command each) per episode")
    command_timeout_s: float = Field(30.0, gt=0, description="wall-clock limit of one command")
    wall_time_s: float = Field(600.0, gt=0, description="wall-clock limit of an episode")
    max_format_errors: int = Field(3, ge=1, description="consecutive replies without exactly one command that end the episode")
    max_output_chars: int = Field(10_000, ge=200, description="command output kept per observation (head and tail)")
    action_format: Literal["fenced", "tagged"] = Field("fenced", description="one ```bash block per reply, or one <command>...</command>")
    memory_mb: int = Field(512, ge=64, description="memory of an episode's session")


def chat_prompt(system: str, user: str, tokenizer, use_chat_template: bool) -> str:
    """A system and a user message through the model's chat template when it has one, else both as plain text."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system}\n\n{user}\n\n"


def check_score(outcome: dict | None, env_error: str | None) -> Score:
    """The score of one episode from its check: pass on exit 0, fail otherwise, error when the check never ran."""
    result = (outcome or {}).get("check")
    if result is None:
        return Score("error", details=json.dumps({"error": env_error or "the episode has no check result"}))
    status = "pass" if result["status"] == "ok" and result["exit_code"] == 0 else "fail"
    return Score(status, details=json.dumps(result), metrics={"commands": float(len(outcome.get("commands", [])))})  # type: ignore[arg-type]


class ShellAgentTask(SandboxedTask):
    """A benchmark of shell-agent episodes graded by a check; subclasses implement ``workspace`` and ``check``."""

    Options = ShellAgentOptions
    multi_turn = True
    workdir = "work"  # the agent's folder, relative to the session's work root
    submit_word = SUBMIT_WORD

    @abstractmethod
    def workspace(self, problem: Problem) -> dict[str, bytes]:
        """The files the work folder starts with (paths relative to it)."""

    @abstractmethod
    def check(self, problem: Problem) -> Check:
        """The command that grades the episode in the work folder (exit 0: pass), and the files it needs."""

    def instructions(self, problem: Problem) -> str:
        """The user message: the problem's question, where the folder is and how to submit."""
        return f"{problem.question}\n\nYou are in the folder {self.workdir}. When you are done, submit with: echo {self.submit_word}"

    def format_prompt(self, problem: Problem, tokenizer) -> str:
        opts: ShellAgentOptions = self.options  # type: ignore[assignment]
        system = system_prompt(opts.action_format, self.submit_word)
        return chat_prompt(system, self.instructions(problem), tokenizer, opts.use_chat_template)

    def env(self, problem: Problem, tokenizer) -> ShellAgentEnv:
        opts: ShellAgentOptions = self.options  # type: ignore[assignment]
        limits = AgentLimits(opts.max_steps, opts.wall_time_s, opts.command_timeout_s, opts.max_format_errors, opts.max_output_chars)
        return ShellAgentEnv(
            self.format_prompt(problem, tokenizer), lambda: self.open_session(problem), workdir=self.workdir, limits=limits,
            submit_word=self.submit_word, action_format=opts.action_format, check=self.check(problem),
        )  # fmt: skip

    def open_session(self, problem: Problem):
        """A fresh session in the task's sandbox (network off) holding the problem's work folder."""
        opts: ShellAgentOptions = self.options  # type: ignore[assignment]
        session = self.sandbox.session(memory_mb=opts.memory_mb, network=False)
        try:
            session.write_files({posixpath.join(self.workdir, name): data for name, data in self.workspace(problem).items()})
        except BaseException:
            session.close()
            raise
        return session

    def grade_trajectories(self, problems: list[Problem], trajectories: list) -> list[Score]:
        """Each episode's check result (collected in its session before it closed)."""
        return [check_score(t.metadata.get("outcome"), t.metadata.get("env_error")) for t in trajectories]

    def grade_many(self, problems: list[Problem], completions: list[str]) -> list[Score]:
        """A bare completion has no work folder to check: shell-agent tasks grade episodes only."""
        return [Score("error", details=json.dumps({"error": "a shell-agent task grades episodes, not completions"})) for _ in problems]

    @property
    def grader(self) -> tuple[str, str]:
        return "shell-check", "1"
