"""Base classes every task shares: problems, scores and the Task contract (environments: :mod:`opd_harness.episode`)."""

from __future__ import annotations

import gzip
import json
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, final

from pydantic import BaseModel, ConfigDict

from opd_harness.datadir import DATA_DIR_ENV, resolve_data_dir  # noqa: F401 - DATA_DIR_ENV re-exported: tasks name it from here
from opd_harness.episode import Env, SingleTurnEnv

if TYPE_CHECKING:  # annotations only: `harness tasks` lists the task classes without the backend models
    from opd_harness.backends import Backend, SamplingParams
    from opd_harness.trajectory import Trajectory

Status = Literal["pass", "fail", "error"]


@dataclass(frozen=True)
class Problem:
    """One validated benchmark item with a stable id."""

    id: str
    question: str
    answer: str  # gold answer as a string
    solution: str | None = None  # reference solution (used for supervised warm-up)
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Score:
    """Tri-state grade: ``error`` means the grader failed, never a pass or a fail."""

    status: Status
    extracted: str | None = None
    details: str = ""
    reward: float | None = None  # the RL reward when it is not simply 1 for pass and 0 for fail
    metrics: dict = field(default_factory=dict)  # per-episode measurements (turns, tool calls, ...)

    @property
    def value(self) -> float:
        return 1.0 if self.status == "pass" else 0.0

    @property
    def reward_value(self) -> float | None:
        """The reward to train on: None for an ``error`` grade (no reward, never 0), else ``reward`` or the pass value."""
        if self.status == "error":
            return None
        return self.value if self.reward is None else float(self.reward)


class TaskOptions(BaseModel):
    """Options shared by every task; tasks subclass it to add their own."""

    model_config = ConfigDict(extra="forbid")
    k: int = 4  # samples per problem for Avg@k
    limit: int | None = None  # evaluate only the first N problems
    max_new_tokens: int = 512
    use_chat_template: bool = True
    data_dir: str | None = None
    protocol_family: str | None = None  # the family whose rule an evaluation protocol applies (harness eval --protocol)


class Task(ABC):
    """A benchmark: loads validated problems, builds environments, grades trajectories.

    ``name`` is set by the registry from the task's entry-point name (a task declares no name of its own)."""

    name: ClassVar[str]
    description: ClassVar[str]
    Options: ClassVar[type[TaskOptions]] = TaskOptions
    needs_sandbox: ClassVar[bool] = False
    multi_turn: ClassVar[bool] = False
    provides_reward: ClassVar[bool] = True  # graded outcome usable as an RL reward
    provides_references: ClassVar[bool] = False  # every problem of the training split carries a reference solution
    splits: ClassVar[tuple[str, ...]] = ("test",)
    episode_flags: ClassVar[tuple[str, ...]] = ()  # per-episode 0/1 metrics reported as "<flag>_rate" (e.g. repeated_loop)

    def __init__(self, options: TaskOptions | None = None) -> None:
        self.options = options if options is not None else self.Options()

    @final
    def load(self, split: str = "test", data_dir: Path | None = None) -> list[Problem]:
        """Validated problems of ``split`` (a bad row names its file, line and field), the first ``options.limit``.

        The one loading path of every task: it checks the split, resolves the data root (:meth:`data_root`), has
        the family read the rows (:meth:`read_problems`), names the data root in a ``DataNotFound`` and applies
        ``options.limit``."""
        if split not in self.splits:
            raise ValueError(f"{self.name} has splits {self.splits}, not {split!r}")
        root, how = self.data_root(data_dir)
        try:
            problems = self.read_problems(split, root)
        except DataNotFound as exc:
            exc.args = (f"{exc} [data root {root}: {how}]",)
            raise
        limit = self.options.limit
        return problems[:limit] if limit else problems

    def data_root(self, data_dir: Path | str | None = None) -> tuple[Path, str]:
        """(the data root, how it was chosen): ``data_dir``, else ``options.data_dir``, else ``$HARNESS_DATA_DIR``, else ``./data``."""
        return resolve_data_dir(data_dir, self.options.data_dir)

    @abstractmethod
    def read_problems(self, split: str, data_dir: Path) -> list[Problem]:
        """Every validated problem of ``split``, read from the family's files under the data root ``data_dir``
        (``data_dir/<folder>/...``) or generated; a missing file is ``DataNotFound``. :meth:`load` calls it."""

    def training_split(self) -> str:
        """The split a run trains (and warms models up) on: ``train`` when the task has one, else ``test``."""
        return "train" if "train" in self.splits else "test"

    def provided_inputs(self) -> frozenset[str]:
        """Method inputs this task's data gives (``rewards``, ``reference_responses``), checked when a run is planned."""
        rewards = frozenset({"rewards"} if self.provides_reward else ())
        return rewards | frozenset({"reference_responses"} if self.provides_references else ())

    def format_prompt(self, problem: Problem, tokenizer) -> str:
        """The model's chat template with the question when it has one, else the plain question."""
        template = getattr(tokenizer, "chat_template", None)
        if self.options.use_chat_template and template:
            messages = [{"role": "user", "content": problem.question}]
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return problem.question

    def env(self, problem: Problem, tokenizer) -> Env:
        """A fresh environment for one episode on ``problem``."""
        return SingleTurnEnv(self.format_prompt(problem, tokenizer))

    @abstractmethod
    def grade_many(self, problems: list[Problem], completions: list[str]) -> list[Score]:
        """Grade completions (one per problem entry, aligned); never raises for a bad completion."""

    def grade_trajectories(self, problems: list[Problem], trajectories: list) -> list[Score]:
        """Grade whole episodes (aligned with ``problems``). Default, for single-turn tasks: ``grade_many`` on each
        episode's text; multi-turn tasks override it to read the turns, observations and episode counters."""
        return self.grade_many(problems, [t.completion_text for t in trajectories])

    def grade(self, problem: Problem, trajectory) -> Score:
        """Grade one episode."""
        return self.grade_trajectories([problem], [trajectory])[0]

    @property
    @abstractmethod
    def grader(self) -> tuple[str, str]:
        """(grader name, grader version), stored with every score."""

    def check_ready(self) -> None:
        """Raise ``TaskNotReady`` saying what to do when this task cannot run here (e.g. its sandbox image is not
        built); the CLI calls it before it writes anything. Default: ready."""

    def rollout(self, backend: Backend, problems: list[Problem], params: SamplingParams) -> list[Trajectory] | None:
        """This task's own episodes (e.g. lm-eval's scored multiple choice); default None: :func:`opd_harness.rollout.rollout` runs them."""
        return None

    def build_images(
        self, force: bool = False, on_start: Callable[[str], None] | None = None, on_done: Callable[[str, Any], None] | None = None
    ) -> list:
        """Build the sandbox images this task needs beyond the base image (``harness sandbox build --task``); default: none."""
        return []

    @classmethod
    def data_needs(cls) -> tuple[DataNeed, ...]:
        """The files this task reads under the data folder, one :class:`DataNeed` per split (``harness data``); default: none."""
        return ()

    def close(self) -> None:
        """Release what the task holds (e.g. its sandbox's containers); idempotent, and the task may be used again."""

    def __enter__(self) -> Task:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def describe(cls) -> dict:
        """Name, description, defaults and needs, for ``harness tasks --json``."""
        return {
            "name": cls.name,
            "description": cls.description,
            "defaults": cls.Options().model_dump(),
            "needs_sandbox": cls.needs_sandbox,
            "multi_turn": cls.multi_turn,
            "provides_reward": cls.provides_reward,
            "provides_references": cls.provides_references,
            "splits": list(cls.splits),
        }


class DataNotFound(FileNotFoundError):
    """A task's data folder or file is missing (and no other source gave it); the message names where it looked."""


class TaskNotReady(RuntimeError):
    """A task cannot run on this machine as configured; the message says what to do (e.g. the command to run)."""


def close_tasks(tasks: Iterable[Task]) -> None:
    """Close every task (each once, however often it is listed). A failure to close one is a warning, not an
    exception: callers close in ``finally`` blocks, where raising would hide the error that is unwinding."""
    for task in {id(t): t for t in tasks}.values():
        try:
            task.close()
        except Exception as exc:  # noqa: BLE001 - the others must still be closed
            warnings.warn(f"closing task {task.name!r} failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)


class DataError(ValueError):
    """A bad data row; the message names file, line and field."""

    def __init__(self, path: Path | str, line: int, field_name: str, problem: str) -> None:
        super().__init__(f"{path}:{line}: field {field_name!r}: {problem}")


def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based line, parsed row) for each non-blank line of a JSONL (or .jsonl.gz) file; a non-JSON line is a DataError."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(path, line_no, "<line>", f"not valid JSON ({exc.msg} at column {exc.colno})") from None


@dataclass(frozen=True)
class DataNeed:
    """One split of one task: which files it reads under the data folder and how ``harness data fetch`` makes them."""

    task: str
    split: str
    files: tuple[str, ...]  # glob patterns relative to the data folder, e.g. "math500/test.jsonl", "livecodebench/test*.jsonl"
    source: str  # where fetch downloads from, for messages ("hf:HuggingFaceH4/MATH-500[test]", a URL)
    fetch: Callable[[Path], None]  # downloads the split into a folder, in the same layout (<task>/<file>)
    load: Callable[[Path], Sized]  # the task's loader, local files only; raises (DataError ...) on a bad row or id
    rows: tuple[int, ...] = ()  # problem counts of the known good copies; () accepts any count
