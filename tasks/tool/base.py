r"""Tool-use tasks on the code-interpreter environment: options, prompts, episodes and grading.

A :class:`ToolTask` owns one sandbox (Docker by default; ``sandbox: local`` for machines without Docker) and
opens one persistent Python interpreter per episode, on the episode's first tool call; the episode closes it (its
session, a warm pooled container, is reset for a later episode: nothing of this one is visible there).
The final answer is read from the model's own text only (observations are never graded): the last
``<answer>...</answer>`` block, or the last model turn when there is none, and its last ``\boxed{}`` is graded
with math-verify against the problem's answer.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Literal

from pydantic import Field

from opd_harness.task import Problem, Score
from opd_harness.tasks.agentic.sandboxed import SandboxedTask, SandboxOptions
from opd_harness.tasks.math_grading import MathVerifyGraded
from opd_harness.tasks.agentic.tool_env import ToolEnv
from opd_harness.tasks.agentic.tool_formats import CODE_INTERPRETER_SCHEMA, FORMATS, ToolFormat


class ToolOptions(SandboxOptions):
    """Options of every tool-use task (limits default to the f-OPD paper's: 6 tool calls, 10 assistant turns)."""

    format: Literal["retool", "hermes"] = Field(
        "retool", description="tool-call format: retool (<code> blocks) or hermes (<tool_call> JSON)"
    )
    prompt: Literal["instruction", "bare"] = Field(
        "instruction", description="instruction: explain the tool and answer format; bare: the question only"
    )
    max_tool_calls: int = Field(
        6, ge=0, description="tool calls per episode, invalid ones included; later calls are refused without running"
    )
    max_turns: int = Field(10, ge=1, description="assistant turns per episode")
    max_context_tokens: int = Field(16384, ge=16, description="context budget of an episode (prompt, model and tool tokens)")
    tool_timeout_s: float = Field(10.0, gt=0, description="wall-clock limit of one tool call")
    memory_mb: int = Field(1024, ge=64, description="memory limit of an episode's interpreter")
    disk_mb: int = Field(256, ge=1, description="most an episode's work dir may hold (Docker: in memory, within memory_mb)")
    max_output_chars: int = Field(2048, ge=64, description="tool output kept per call (the rest is cut with a marker)")
    prewarm_sessions: int = Field(
        0, ge=0, description="interpreter sessions started in the background when the task is checked, before the first episode"
    )


def model_text(trajectory) -> str:
    """Everything the model wrote in an episode (observations excluded)."""
    return "".join(s.text for s in trajectory.model_segments)


def final_answer_text(trajectory) -> str:
    """The last ``<answer>`` block the model wrote, else its last turn: the text that is graded."""
    text = model_text(trajectory)
    start = text.rfind("<answer>")
    if start >= 0:
        end = text.find("</answer>", start)
        return text[start + len("<answer>") : end if end >= 0 else len(text)]
    turns = trajectory.model_segments
    return turns[-1].text if turns else ""


class ToolTask(MathVerifyGraded, SandboxedTask):
    """A math problem solved with a code interpreter; subclasses provide ``read_problems``."""

    Options = ToolOptions
    multi_turn = True

    @property
    def tool_format(self) -> ToolFormat:
        return FORMATS[self.options.format]()

    def prompt_text(self, problem: Problem) -> str:
        return (self.tool_format.instruction() if self.options.prompt == "instruction" else "") + problem.question

    def format_prompt(self, problem: Problem, tokenizer) -> str:
        """The question (with the tool instructions) in the model's chat template; hermes also passes the tool schema."""
        text = self.prompt_text(problem)
        if not (self.options.use_chat_template and getattr(tokenizer, "chat_template", None)):
            return text
        tools = [CODE_INTERPRETER_SCHEMA] if self.options.format == "hermes" else None
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tools=tools, tokenize=False, add_generation_prompt=True)

    def env(self, problem: Problem, tokenizer) -> ToolEnv:
        opts: ToolOptions = self.options  # type: ignore[assignment]
        return ToolEnv(
            self.format_prompt(problem, tokenizer),
            self.tool_format,
            self.open_interpreter,
            max_tool_calls=opts.max_tool_calls,
            max_turns=opts.max_turns,
            timeout_s=opts.tool_timeout_s,
        )

    def check_ready(self) -> None:
        """The sandbox check, then ``prewarm_sessions`` interpreter sessions started in a background thread (so that a
        run's first episodes take warm ones while the models load)."""
        super().check_ready()
        n = self.options.prewarm_sessions  # type: ignore[attr-defined]
        if n:
            interpreter = self.open_interpreter()
            threading.Thread(target=interpreter.prewarm, args=(n,), name=f"{self.name}-prewarm", daemon=True).start()

    def open_interpreter(self):
        """A fresh persistent interpreter in this task's sandbox (no network; the task's memory and disk limits)."""
        from opd_harness.sandbox.interpreter import PythonInterpreter

        opts: ToolOptions = self.options  # type: ignore[assignment]
        return PythonInterpreter(self.sandbox, memory_mb=opts.memory_mb, disk_mb=opts.disk_mb, max_output_chars=opts.max_output_chars)

    def grade_trajectories(self, problems: list[Problem], trajectories: list) -> list[Score]:
        """math-verify on each episode's final answer; whether an ``<answer>`` block was given is a per-episode metric."""
        answers = [final_answer_text(t) for t in trajectories]
        scores = self.grade_many(problems, answers)
        return [
            dataclasses.replace(s, metrics={"answer_block": float("<answer>" in model_text(t))})
            for s, t in zip(scores, trajectories, strict=True)
        ]

    @property
    def grader(self) -> tuple[str, str]:
        name, version = super().grader
        return f"{self.options.format}-answer+{name}", version

    def reference_turns(self, value: str, code: str) -> list[dict]:
        """A reference episode: one tool call running ``code`` (which prints ``value``), then the boxed answer."""
        fmt = self.tool_format
        return [
            {"model": fmt.call_text(code), "observation": dataclasses.asdict(fmt.observation(f"{value}\n"))},
            {"model": f"<answer>\\boxed{{{value}}}</answer>"},
        ]
