"""The tool-demo preset's task is one a tiny character model can learn to solve with the tool: in every reference
episode both copies the model makes (the question's expression into the code, the printed value into ``\\boxed{}``)
sit at the same distance from their source, so one attention head with rotary positions can make them.
(Whether the warmed-up teacher then reaches Avg@4 >= 0.8 is measured in README's tool-use section, not here.)"""

from __future__ import annotations

from pathlib import Path

from opd_harness.config import build_config
from opd_harness.plan import make_task


def copy_offsets(problem) -> tuple[int, int]:
    """(expression copy distance, value copy distance) in characters of the episode's text, prompt included."""
    expression = problem.question.removeprefix("Compute ").removesuffix(".\n")
    call, answer = problem.meta["reference_turns"]
    printed = call["observation"]["content"]
    text = problem.question + call["model"] + call["observation"]["raw"] + answer["model"]
    code_at = len(problem.question) + call["model"].index(expression)
    observed_at = len(problem.question) + len(call["model"]) + call["observation"]["raw"].index(printed)
    answered_at = text.rindex(printed)
    return code_at - problem.question.index(expression), answered_at - observed_at


def test_the_tool_demo_preset_puts_both_copies_at_constant_offsets():
    cfg = build_config(preset="tool-demo")
    options = {**cfg.task_args["arith_tool"], "sandbox": "local", "n_train": 300, "n_test": 50}
    task = make_task("arith_tool", {"arith_tool": options})
    problems = task.read_problems("train", Path(".")) + task.read_problems("test", Path("."))
    offsets = {copy_offsets(p) for p in problems}
    assert len(offsets) == 1, sorted(offsets)[:5]
