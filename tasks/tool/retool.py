"""``retool:<math task>``: any registered math task solved with the code interpreter (ReTool's setting).

``retool:aime24`` loads AIME24 exactly as ``aime24`` does (same data folder, same gold answers, same k) and
asks for tool-assisted solutions; its options are the math task's plus the tool options. The math task's
own answer instruction defaults to empty, since the tool prompt asks for ``<answer>\\boxed{}</answer>``.
"""

from __future__ import annotations

from pathlib import Path

from opd_harness.registry import TASKS, RegistryError
from opd_harness.task import Problem
from opd_harness.tasks.math_grading import MathVerifyGraded
from opd_harness.tasks.tool.base import ToolOptions, ToolTask

PREFIX = "retool"


class RetoolTask(ToolTask):
    """Base of the generated ``retool:<name>`` classes; ``inner`` is the wrapped math task class."""

    inner: type

    def inner_task(self):
        """The wrapped math task, built with the options it knows."""
        fields = self.inner.Options.model_fields
        return self.inner(self.inner.Options(**{k: v for k, v in self.options.model_dump().items() if k in fields}))

    def read_problems(self, split: str, data_dir: Path) -> list[Problem]:
        """The wrapped math task's problems, read from the same data root."""
        return self.inner_task().read_problems(split, data_dir)

    @classmethod
    def data_needs(cls):
        return cls.inner.data_needs()


def make_retool_task(name: str) -> type[RetoolTask]:
    """Any math task solved with a Python code interpreter in the sandbox, multi-turn.

    Name one ``retool:<task>`` with a math task graded by math-verify, e.g. ``retool:aime24`` (also arith, math500, aime25,
    amc23, olympiadbench, minerva, gsm8k, dapo_math); its options are the math task's and the tool loop's.

    Builds the task class ``retool:<name>`` wrapping the registered math task ``name``."""
    try:
        inner = TASKS.get(name)
    except RegistryError as exc:
        raise RegistryError(f"retool:{name}: {exc}") from None
    if not issubclass(inner, MathVerifyGraded) or issubclass(inner, ToolTask):
        raise RegistryError(f"retool:{name}: {name!r} is not a math task (retool wraps a math-verify graded task such as math500)")
    annotations: dict = {}
    defaults: dict = {}
    if "instruction" in inner.Options.model_fields:
        annotations["instruction"], defaults["instruction"] = str, ""
    options = type(
        f"RetoolOptions[{name}]", (inner.Options, ToolOptions), {"__annotations__": annotations, **defaults, "__module__": __name__}
    )
    attrs = {
        "description": f"{name} solved with a ReTool-style Python code interpreter (multi-turn, sandboxed)",
        "inner": inner,
        "Options": options,
        "splits": inner.splits,
        "provides_references": False,  # the math task's solutions are text, not tool traces
        "__module__": __name__,
        "__qualname__": f"RetoolTask[{name}]",
    }
    return type(f"RetoolTask[{name}]", (RetoolTask,), attrs)

