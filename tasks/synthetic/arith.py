"""``arith``: multi-step integer arithmetic with a step-by-step solution and a boxed answer.

Problems such as ``Compute 37+4*12.`` are generated from a seed; the reference solution performs
one operation per line (multiplication first, then left to right) and ends with ``\\boxed{N}``.
Train and test splits are disjoint. Ids are ``<split>-<index>``. Graded with math-verify in a
process pool, like the real math benchmarks. It is the CPU stand-in for math reasoning.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import Field

from opd_harness.task import Problem, Task, TaskOptions
from opd_harness.tasks.math_grading import MathVerifyGraded


class ArithOptions(TaskOptions):
    k: int = 4
    max_new_tokens: int = 48
    num_ops: int = Field(2, ge=1, le=6, description="operators per expression")
    operators: str = Field("+*", pattern=r"^[+\-*]+$", description="operators to draw from")
    max_operand: int = Field(99, ge=1, description="operands are drawn from 0..max_operand")
    max_mul_operand: int = Field(12, ge=1, description="operands of a multiplication are at most this")
    seed: int = 1234
    n_train: int = Field(20000, ge=1)
    n_test: int = Field(200, ge=1)


def solve_steps(operands: list[int], operators: list[str]) -> tuple[list[str], int]:
    """Evaluate with precedence, one operation per line; returns (lines, value)."""
    values, ops, lines = list(operands), list(operators), []
    for group in ("*", "+-"):
        i = 0
        while i < len(ops):
            if ops[i] in group:
                a, b, op = values[i], values[i + 1], ops[i]
                result = a * b if op == "*" else a + b if op == "+" else a - b
                lines.append(f"{a}{op}{b}={result}")
                values[i : i + 2] = [result]
                del ops[i]
            else:
                i += 1
    return lines, values[0]


def make_problem(rng: random.Random, opts: ArithOptions) -> tuple[str, list[str], int]:
    """Draw one expression; operands next to a ``*`` are capped by ``max_mul_operand``."""
    operators = [rng.choice(opts.operators) for _ in range(opts.num_ops)]
    operands = []
    for i in range(opts.num_ops + 1):
        near_mul = (i > 0 and operators[i - 1] == "*") or (i < opts.num_ops and operators[i] == "*")
        operands.append(rng.randint(0, opts.max_mul_operand if near_mul else opts.max_operand))
    expression = "".join(f"{a}{op}" for a, op in zip(operands, operators)) + str(operands[-1])
    lines, value = solve_steps(operands, operators)
    return expression, lines, value


T = TypeVar("T")


def draw_distinct_splits(
    rng: random.Random, wanted: dict[str, int], split: str, draw: Callable[[random.Random], T], task: str
) -> dict[str, list[T]]:
    """Draws per split, in the order of ``wanted`` (test first, so that train excludes its expressions), up to
    ``split``; ``draw(rng)`` returns a tuple whose first item is the expression that must be new."""
    seen: set[str] = set()
    out: dict[str, list[T]] = {}
    for name, count in wanted.items():
        out[name], attempts = [], 0
        while len(out[name]) < count:
            attempts += 1
            if attempts > 20 * count + 1000:
                raise ValueError(f"{task}: cannot draw {count} distinct {name} problems; widen the operand ranges")
            item = draw(rng)
            if item[0] not in seen:  # type: ignore[index]
                seen.add(item[0])  # type: ignore[index]
                out[name].append(item)
        if name == split:
            break
    return out


class ArithTask(MathVerifyGraded, Task):
    description = "Synthetic multi-step arithmetic (e.g. 37+4*12) with step-by-step solutions and a boxed answer"
    Options = ArithOptions
    splits = ("train", "test")
    provides_references = True  # every problem carries its step-by-step solution

    def read_problems(self, split: str, data_dir: Path) -> list[Problem]:
        """Generate ``split`` deterministically from the seed; test expressions never appear in train (reads no files)."""
        opts: ArithOptions = self.options  # type: ignore[assignment]
        drawn = draw_distinct_splits(
            random.Random(opts.seed), {"test": opts.n_test, "train": opts.n_train}, split, lambda rng: make_problem(rng, opts), "arith"
        )
        out: dict[str, list[Problem]] = {}
        for name, items in drawn.items():
            out[name] = [
                Problem(
                    id=f"{name}-{i}",
                    question=f"Compute {expression}.\n",
                    answer=str(value),
                    solution="\n".join(lines + [f"\\boxed{{{value}}}"]),
                )
                for i, (expression, lines, value) in enumerate(items)
            ]
        return out[split]

