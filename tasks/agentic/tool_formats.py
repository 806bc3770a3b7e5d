r"""Tool-call formats: how a model turn asks for code to run, and how the interpreter's answer is written back.

``retool`` (default; ReTool's own evaluation format): the model writes
``<code>\n```python\n...\n```\n</code>``, generation stops at ``</code>``, the code runs and
``<interpreter>\n...\n</interpreter>`` is appended inline (the model continues its own turn). The final
answer is ``<answer>\boxed{...}</answer>``.

``hermes`` (verl's retool recipe, SOD's code): ``<tool_call>{"name": "code_interpreter", "arguments":
{"code": "..."}}</tool_call>``, generation stops at ``</tool_call>``, and the output comes back as a ``tool``
message (``<tool_response>...</tool_response>`` when the model has no chat template).

An *invalid* call is a malformed tool block (unclosed, no fenced Python block, empty code), an unparsable
payload (bad JSON, no ``code`` string) or an unsupported invocation (another tool name).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from opd_harness.episode import Observation

FENCED_PYTHON = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
TOOL_NAME = "code_interpreter"
CODE_INTERPRETER_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run Python code in a persistent interpreter (state is kept between calls) and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python code to run"}},
            "required": ["code"],
        },
    },
}


@dataclass(frozen=True)
class ToolCall:
    """A parsed request to run ``code``."""

    code: str


@dataclass(frozen=True)
class InvalidCall:
    """A tool block that cannot be executed, and why."""

    reason: str


class ToolFormat(ABC):
    """Parses tool calls out of a model turn and writes observations back."""

    name: ClassVar[str]
    stop: ClassVar[tuple[str, ...]]

    @abstractmethod
    def parse(self, turn: str) -> ToolCall | InvalidCall | None:
        """The turn's tool call, an invalid one, or None when the turn makes no call (the model is done)."""

    @abstractmethod
    def observation(self, output: str) -> Observation:
        """The interpreter's output as an observation in this format."""

    @abstractmethod
    def call_text(self, code: str) -> str:
        """A well-formed call running ``code`` (reference solutions and scripted agents)."""

    @abstractmethod
    def instruction(self) -> str:
        """How to call the tool and give the answer, for prompts of models without a tool-aware chat template."""


class RetoolFormat(ToolFormat):
    name = "retool"
    stop = ("</code>",)

    def parse(self, turn: str) -> ToolCall | InvalidCall | None:
        start = turn.find("<code>")
        if start < 0:
            return None
        end = turn.find("</code>", start)
        if end < 0:
            return InvalidCall("unclosed <code> block")
        fenced = FENCED_PYTHON.search(turn[start + len("<code>") : end])
        if fenced is None:
            return InvalidCall("no ```python fenced block inside <code>")
        code = fenced.group(1)
        return ToolCall(code) if code.strip() else InvalidCall("empty code block")

    def observation(self, output: str) -> Observation:
        body = output.rstrip("\n")
        return Observation(content=body, role="inline", raw=f"\n<interpreter>\n{body}\n</interpreter>\n")

    def call_text(self, code: str) -> str:
        return f"<code>\n```python\n{code.rstrip()}\n```\n</code>"

    def instruction(self) -> str:
        return (
            "Solve the following problem step by step. You can write Python code to help your reasoning: it runs in a "
            "sandbox and its output comes back as <interpreter>output</interpreter>. Write each code snippet as\n"
            "<code>\n```python\ncode snippet\n```\n</code>\n"
            "The last part of your response must be the final answer in the format\n<answer>\n\\boxed{answer}\n</answer>\n\n"
        )


class HermesFormat(ToolFormat):
    name = "hermes"
    stop = ("</tool_call>",)

    def parse(self, turn: str) -> ToolCall | InvalidCall | None:
        start = turn.find("<tool_call>")
        if start < 0:
            return None
        end = turn.find("</tool_call>", start)
        if end < 0:
            return InvalidCall("unclosed <tool_call> block")
        try:
            payload = json.loads(turn[start + len("<tool_call>") : end])
        except json.JSONDecodeError as exc:
            return InvalidCall(f"tool call is not valid JSON ({exc.msg})")
        if not isinstance(payload, dict) or "name" not in payload:
            return InvalidCall('tool call must be a JSON object with "name" and "arguments"')
        if payload["name"] != TOOL_NAME:
            return InvalidCall(f"unsupported tool {payload['name']!r}; the only tool is {TOOL_NAME!r}")
        arguments = payload.get("arguments")
        if isinstance(arguments, str):  # some models send the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return InvalidCall(f"tool arguments are not valid JSON ({exc.msg})")
        code = arguments.get("code") if isinstance(arguments, dict) else None
        if not isinstance(code, str):
            return InvalidCall('tool arguments must be an object with a "code" string')
        return ToolCall(code) if code.strip() else InvalidCall("empty code")

    def observation(self, output: str) -> Observation:
        body = output.rstrip("\n")
        return Observation(content=body, role="tool", raw=f"\n<tool_response>\n{body}\n</tool_response>\n")

    def call_text(self, code: str) -> str:
        return "<tool_call>\n" + json.dumps({"name": TOOL_NAME, "arguments": {"code": code.rstrip()}}) + "\n</tool_call>"

    def instruction(self) -> str:
        return (
            "Solve the following problem step by step. You may call the tool code_interpreter, which runs Python code "
            "and returns what it prints, by writing\n"
            '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "..."}}\n</tool_call>\n'
            "End with the final answer in the format\n<answer>\n\\boxed{answer}\n</answer>\n\n"
        )


FORMATS: dict[str, type[ToolFormat]] = {"retool": RetoolFormat, "hermes": HermesFormat}
