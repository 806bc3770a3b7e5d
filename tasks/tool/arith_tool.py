"""``arith_tool``: large-operand arithmetic that a small model can only get right with the code interpreter.

Problems such as ``Compute 48213*771-5512.`` are generated from a seed (train and test disjoint; ids
``<split>-<index>``). Every problem carries a reference episode that uses the tool: one call printing the
expression, then ``<answer>\\boxed{value}</answer>``; its observation is rendered exactly as a live episode
renders the interpreter's output, so teacher and student can be warmed up on tool traces (SFT) on CPU. The
default prompt is the bare question (tiny models learn the format from the traces) and the context budget
fits the tiny models' 512 positions.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Literal

from pydantic import Field

from opd_harness.task import Problem
from opd_harness.tasks.synthetic.arith import draw_distinct_splits
from opd_harness.tasks.tool.base import ToolOptions, ToolTask


class ArithToolOptions(ToolOptions):
    k: int = 4
    max_new_tokens: int = 64
    prompt: Literal["instruction", "bare"] = Field(
        "bare", description="instruction: explain the tool and answer format; bare: the question only"
    )
    max_context_tokens: int = Field(480, ge=16, description="context budget of an episode (prompt, model and tool tokens)")
    num_ops: int = Field(2, ge=1, le=4, description="operators per expression")
    operators: str = Field("+-*", pattern=r"^[+\-*]+$", description="operators to draw from")
    min_operand: int = Field(100, ge=0, description="operands are drawn from min_operand..max_operand")
    max_operand: int = Field(99999, ge=1, description="operands are drawn from min_operand..max_operand")
    value_width: int = Field(
        0,
        ge=0,
        le=32,
        description="reference episodes print the value zero-padded to this many characters and answer it so (a copy at a fixed "
        "offset, which tiny models learn quickly); 0: the plain value",
    )
    seed: int = 4321
    n_train: int = Field(5000, ge=1)
    n_test: int = Field(200, ge=1)


def make_expression(rng: random.Random, opts: ArithToolOptions) -> str:
    """One random expression such as ``48213*771-5512``."""
    operands = [rng.randint(opts.min_operand, opts.max_operand) for _ in range(opts.num_ops + 1)]
    operators = [rng.choice(opts.operators) for _ in range(opts.num_ops)]
    return "".join(f"{a}{op}" for a, op in zip(operands, operators)) + str(operands[-1])


def evaluate_expression(expression: str) -> int:
    """The exact value of an expression of non-negative integers and + - * (precedence as in Python)."""
    if not set(expression) <= set("0123456789+-*"):
        raise ValueError(f"not an integer +-* expression: {expression!r}")
    return int(eval(expression, {"__builtins__": {}}, {}))  # noqa: S307 - digits and + - * only, checked above


def reference_print(expression: str, value: int, width: int) -> tuple[str, str]:
    """(what the reference code prints, the code): the plain value, or with ``width`` the value zero-padded to that width."""
    if not width:
        return str(value), f"print({expression})"
    printed = f"{value:0{width}d}"
    if len(printed) > width:
        raise ValueError(f"arith_tool: value_width {width} is too narrow for {expression} = {value}; raise value_width")
    return printed, f'print(f"{{{expression}:0{width}d}}")'


class ArithToolTask(ToolTask):
    description = "Synthetic large-operand arithmetic solved with a Python code interpreter (multi-turn tool use, CPU scale)"
    Options = ArithToolOptions
    splits = ("train", "test")
    provides_references = True  # every problem carries a reference episode that uses the tool

    def read_problems(self, split: str, data_dir: Path) -> list[Problem]:
        """Generate ``split`` deterministically from the seed; test expressions never appear in train (reads no files)."""
        opts: ArithToolOptions = self.options  # type: ignore[assignment]
        if opts.min_operand > opts.max_operand:
            raise ValueError(f"arith_tool: min_operand ({opts.min_operand}) is above max_operand ({opts.max_operand})")
        draw = lambda rng: (make_expression(rng, opts),)  # noqa: E731
        drawn = draw_distinct_splits(random.Random(opts.seed), {"test": opts.n_test, "train": opts.n_train}, split, draw, "arith_tool")
        out = {name: [self.problem(f"{name}-{i}", expression) for i, (expression,) in enumerate(items)] for name, items in drawn.items()}
        return out[split]

    def problem(self, problem_id: str, expression: str) -> Problem:
        """The problem for ``expression`` with its reference episode (one tool call printing it, then the answer)."""
        opts: ArithToolOptions = self.options  # type: ignore[assignment]
        value = str(evaluate_expression(expression))
        printed, code = reference_print(expression, int(value), opts.value_width)
        turns = self.reference_turns(printed, code)
        return Problem(
            problem_id, f"Compute {expression}.\n", value, solution="".join(t["model"] for t in turns), meta={"reference_turns": turns}
        )
