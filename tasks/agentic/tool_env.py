"""The code-interpreter environment of one tool-use episode (ReTool, f-OPD App. B.1).

Each model turn either calls the tool (the code runs in a persistent interpreter in the task's sandbox, its
output comes back as an observation) or makes no call, which ends the episode. A timeout, an exception or a
crash of the code is an observation the model sees, never a harness error; a failure of the sandbox itself
raises :class:`ToolInfrastructureError` (the rollout grades that episode ``error``). Limits: ``max_tool_calls``
calls (a call past it is refused without running, and the model is told so) and ``max_turns`` assistant turns.

Counting (f-OPD App. B.1: "at most six tool calls" per episode, an invalid tool call being a malformed block, an
unparsable payload or an unsupported invocation): every call the model makes within the budget is a tool call,
valid or invalid, so an invalid call uses up one of the six, as each tool round does in ReTool's rollout loop. Only
calls that ran code are ``executed_tool_calls``, the denominator of the tool-error rate (``tool_errors``: executed
calls that raised, timed out or crashed); invalid calls are measured by the invalid tool rate instead.
"""

from __future__ import annotations

from collections.abc import Callable

from opd_harness.episode import Env, StepResult
from opd_harness.tasks.agentic.tool_formats import InvalidCall, ToolCall, ToolFormat


class ToolInfrastructureError(RuntimeError):
    """The sandbox behind the interpreter failed (not the model's code)."""


def cell_output(result, timeout_s: float) -> str:
    """What the model sees for one executed cell: its output (tracebacks and the interpreter's own notes, e.g. a
    restart that lost earlier variables, included), plus a ``TimeoutError`` line when it ran out of time."""
    if result.status == "timeout":
        return result.output + f"\nTimeoutError: the code ran longer than {timeout_s:g} s and was stopped"
    return result.output


class ToolEnv(Env):
    """One episode: opening prompt, tool calls through ``fmt``, an interpreter opened on the first call and closed with the episode."""

    def __init__(
        self,
        prompt: str,
        fmt: ToolFormat,
        open_interpreter: Callable[[], object],
        *,
        max_tool_calls: int,
        max_turns: int,
        timeout_s: float,
    ) -> None:
        self.prompt = prompt
        self.fmt = fmt
        self.stop = fmt.stop  # type: ignore[misc]
        self.max_turns = max_turns
        self.max_tool_calls = max_tool_calls
        self.timeout_s = timeout_s
        self._open_interpreter = open_interpreter
        self._interpreter = None
        self.counts = {"tool_calls": 0, "invalid_tool_calls": 0, "executed_tool_calls": 0, "tool_errors": 0, "refused_tool_calls": 0}

    def reset(self) -> str:
        return self.prompt

    def step(self, model_text: str) -> StepResult:
        call = self.fmt.parse(model_text)
        if call is None:
            return StepResult(None, True)
        if self.counts["tool_calls"] >= self.max_tool_calls:
            self.counts["refused_tool_calls"] += 1
            note = f"Tool call limit reached ({self.max_tool_calls} calls); the code was not run. Give the final answer."
            return StepResult(self.fmt.observation(note), False)
        self.counts["tool_calls"] += 1
        if isinstance(call, InvalidCall):
            self.counts["invalid_tool_calls"] += 1
            return StepResult(self.fmt.observation(f"Error: invalid tool call: {call.reason}"), False)
        return StepResult(self.fmt.observation(self.run(call)), False)

    def run(self, call: ToolCall) -> str:
        """Run the call's code in this episode's interpreter; its output as the model will see it."""
        if self._interpreter is None:
            self._interpreter = self._open_interpreter()
        result = self._interpreter.run_cell(call.code, timeout_s=self.timeout_s)
        if result.status == "error":
            raise ToolInfrastructureError(f"sandbox failed while running a tool call: {result.error}")
        self.counts["executed_tool_calls"] += 1
        if result.status != "ok" or result.raised:
            self.counts["tool_errors"] += 1
        return cell_output(result, self.timeout_s)

    def metrics(self) -> dict[str, float]:
        return dict(self.counts)

    def close(self) -> None:
        interpreter, self._interpreter = self._interpreter, None
        if interpreter is not None:
            interpreter.close()
