r"""Real math benchmarks, declared as data: where the rows live, which field holds what, how the gold is read.

Every task reads one file layout (``DIR/<task name>/<file>``, what ``harness data fetch`` writes) and falls
back to the Hugging Face hub when no local file exists. ``harness data fetch`` rewrites hub rows in the local
layout (``hub_to_local``: AIME24, AMC23 and Minerva's hub copies use other field names; Minerva's has no
worked solution, so its gold is stored as ``\boxed{answer}``). Rows are validated one by one: a bad row raises
:class:`opd_harness.task.DataError` naming the file, the 1-based line (row number for Parquet and hub rows) and
the field. Duplicate ids are an error. Grading is math-verify (:mod:`opd_harness.tasks.math_grading`) on the last
``\boxed{}`` of a completion against the gold below.

Data directory (:meth:`opd_harness.task.Task.load`), first one set wins: the ``data_dir`` argument of ``load()``,
then ``options.data_dir``, then ``$HARNESS_DATA_DIR``, else ``./data``. ``options.source`` picks ``"auto"``
(local file, else hub), ``"local"`` (never the hub) or ``"hub"`` (always the hub). If neither source works the
error names the paths looked at.

========================  =========================================  ===============================================
task (split)              local file / hub id [config] (split)       id ; gold
========================  =========================================  ===============================================
math500 (test)            math500/test.jsonl                         ``unique_id`` (``test/precalculus/807.json``);
                          HuggingFaceH4/MATH-500 (test)              ``answer`` (LaTeX string)
aime24 (test)             aime24/test.jsonl (Qwen2.5-Math copy)      ``id`` (``"60"``..``"89"``); ``answer``, a string
                                                                     with leading zeros kept (``"025"``): math-verify
                                                                     compares numerically
                          Maxwell-Jia/AIME_2024 (train)              ``ID`` (``"2024-I-1"``); ``Answer`` (an integer)
aime25 (test)             aime25/test.jsonl                          ``id``; ``answer`` (integer or digit string)
                          math-ai/aime25 (test)
amc23 (test)              amc23/test.jsonl (Qwen2.5-Math copy)       ``id``; ``answer`` is a float: 27.0 -> ``"27"``
                          math-ai/amc23 (test)                       (``id``, else the row index; ``question``)
olympiadbench (test)      olympiadbench/test.jsonl (Qwen copy, 675)  ``id``; ``final_answer[0]`` (as Qwen's
                          Hothan/OlympiadBench [OE_TO_maths_en_COMP] ``parse_ground_truth``) with every ``$`` removed:
                          (train; 674 rows upstream)                 ``$69$,$84$`` -> ``69,84`` (Qwen: ``69$,$84``)
minerva (test)            minerva/test.jsonl (Qwen2.5-Math copy)     ``idx``; last ``\boxed{}`` of ``solution``
                          math-ai/minervamath (test)                 row index; ``answer``
gsm8k (train, test)       gsm8k/<split>.jsonl (original layout)      row index; the number after ``####`` in
                          openai/gsm8k [main] (<split>)              ``answer``, commas removed
dapo_math (train)         dapo_math/dapo_math_17k.parquet (dedup)    ``extra_info.index``; ``reward_model.ground_truth``
                          BytedTsinghua-SIA/DAPO-Math-17k (train)    (question: the user message of ``prompt``, with
                                                                     DAPO's "Answer:" wrapper removed when present)
========================  =========================================  ===============================================

Every gold then goes through :func:`clean_gold`: ``$`` signs are removed (MATH500 has three currency
golds such as ``\$18.90``, which math-verify cannot parse as a gold; OlympiadBench has 21 multi-part
answers like ``$69$,$84$`` and one broken ``$221,$8$``; Minerva ``idx`` 72 has a stray ``$ $`` inside its
box), whitespace is collapsed and a trailing period dropped. The original is kept in
``Problem.meta["raw_answer"]`` when it changed. With that, ``\boxed{<gold>}`` grades "pass" for every
row of every file of the project's data folder (tests/test_math_tasks.py).

Default k (samples per problem for Avg@k) follows the AP-OPD paper: MATH500, Minerva and OlympiadBench 4;
AMC23 and AIME 16; GSM8K and DAPO-Math 1. Default ``max_new_tokens`` is 4096 (enough for a non-thinking
chat model's chain of thought on MATH-level problems), 8192 for AIME and AMC23 (long competition
solutions), 2048 for GSM8K. Raise it for long-thinking models.

Prompt: ``Problem.question`` is the problem text, a newline and ``options.instruction`` (default: the Qwen
boxed-answer instruction). ``options.few_shot = n`` (0..4) prepends the first ``n`` of four fixed worked
MATH exemplars (the Minerva 4-shot problems) as ``Problem:``/``Solution:`` pairs, the instruction first
and the new problem last, followed by ``Solution:``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field as OptionField

from opd_harness.data import hub_dataset_rows, write_rows
from opd_harness.task import DATA_DIR_ENV, DataError, DataNeed, Problem, Task, TaskOptions, read_jsonl
from opd_harness.task import DataNotFound as TaskDataNotFound
from opd_harness.tasks.math_grading import MathVerifyGraded, extract_boxed

log = logging.getLogger(__name__)

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# The four Minerva few-shot exemplars (MATH train problems), each ending in a boxed answer.
FEW_SHOT: tuple[tuple[str, str], ...] = (
    (
        "Find the domain of the expression $\\frac{\\sqrt{x-2}}{\\sqrt{5-x}}$.",
        "The expressions inside each square root must be non-negative, so $x-2 \\ge 0$ and $5-x \\ge 0$, "
        "i.e. $2 \\le x \\le 5$. The denominator cannot be zero, so $5-x>0$ and $x<5$. "
        "Therefore the domain is $\\boxed{[2,5)}$.",
    ),
    (
        "If $\\det \\mathbf{A} = 2$ and $\\det \\mathbf{B} = 12,$ then find $\\det (\\mathbf{A} \\mathbf{B}).$",
        "We have $\\det (\\mathbf{A} \\mathbf{B}) = (\\det \\mathbf{A})(\\det \\mathbf{B}) = (2)(12) = \\boxed{24}$.",
    ),
    (
        "Terrell usually lifts two 20-pound weights 12 times. If he uses two 15-pound weights instead, "
        "how many times must Terrell lift them in order to lift the same total weight?",
        "Two 20-pound weights lifted 12 times make $2\\cdot 12\\cdot 20=480$ pounds. Two 15-pound weights lifted "
        "$n$ times make $2\\cdot 15\\cdot n=30n$ pounds. Setting $30n=480$ gives $n=480/30=\\boxed{16}$.",
    ),
    (
        "If the system of equations\n\\begin{align*}\n6x-4y&=a,\\\\\n6y-9x &=b.\n\\end{align*}has a solution "
        "$(x, y)$ where $x$ and $y$ are both nonzero, find $\\frac{a}{b},$ assuming $b$ is nonzero.",
        "Multiplying the first equation by $-\\frac{3}{2}$ gives $6y-9x=-\\frac{3}{2}a$. Since also $6y-9x=b$, "
        "we have $-\\frac{3}{2}a=b$, so $\\frac{a}{b}=\\boxed{-\\frac{2}{3}}$.",
    ),
)

# DAPO-Math-17k's upstream instruction wrapper around each problem (stripped in the MasterVito/SvS copy that dapo_math_17k.parquet is).
_DAPO_PREFIX = "Solve the following math problem step by step."
_DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


class DataNotFound(TaskDataNotFound):
    """Neither a local file nor the hub gave the split; the message says where it looked."""


class BadValue(ValueError):
    """A field's value has the wrong type or content (turned into a DataError by the loader)."""


# --------------------------------------------------------------------------- field converters
# Each takes the raw value of one field and returns the string the Problem stores, or raises BadValue.


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def text(value: Any) -> str:
    """A non-empty string, stripped."""
    if not isinstance(value, str):
        raise BadValue(f"expected a string, got {_type_name(value)}")
    if not value.strip():
        raise BadValue("empty string")
    return value.strip()


def identifier(value: Any) -> str:
    """An id given as a non-empty string or an integer."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return text(value)


def integer_answer(value: Any) -> str:
    """An integer answer given as an int or a string; a string is kept as is (``"025"``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return text(value)


def whole_number(value: Any) -> str:
    """A numeric answer stored as a float: 27.0 -> ``"27"``, 2.5 -> ``"2.5"``; strings pass through."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadValue(f"expected a number, got {_type_name(value)}")
    if not math.isfinite(value):
        raise BadValue(f"not a finite number: {value!r}")
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def last_boxed(value: Any) -> str:
    """The content of the last ``\\boxed{}`` of a solution (Minerva keeps its answer only there)."""
    found = extract_boxed(text(value))
    if not found:
        raise BadValue("no complete \\boxed{...} in the solution")
    return found


def first_final_answer(value: Any) -> str:
    """OlympiadBench ``final_answer[0]`` (its ``$`` delimiters go in :func:`clean_gold`)."""
    if not isinstance(value, list):
        raise BadValue(f"expected a list of strings, got {_type_name(value)}")
    if not value:
        raise BadValue("empty list")
    return text(value[0])


def gsm8k_answer(value: Any) -> str:
    """The number after the last ``####`` of a GSM8K answer, thousands commas removed."""
    _, sep, tail = text(value).rpartition("####")
    if not sep:
        raise BadValue("no '#### <answer>' line")
    answer = tail.strip().replace(",", "")
    if not answer:
        raise BadValue("empty answer after ####")
    return answer


def gsm8k_solution(value: Any) -> str:
    """GSM8K's worked answer with calculator notes ``<<3*4=12>>`` removed and the result boxed."""
    body = re.sub(r"<<[^>]*>>", "", text(value).rpartition("####")[0]).strip()
    return f"{body}\nThe answer is $\\boxed{{{gsm8k_answer(value)}}}$."


def solution_text(value: Any) -> str:
    """A reference solution: a string, or the first of a list of strings (OlympiadBench)."""
    if isinstance(value, list):
        if not value:
            raise BadValue("empty list")
        value = value[0]
    return text(value)


def dapo_question(value: Any) -> str:
    """The user message of a verl ``prompt`` (list of chat messages), DAPO's Answer: wrapper removed."""
    if not isinstance(value, list) or not value:
        raise BadValue(f"expected a non-empty list of chat messages, got {_type_name(value)}")
    users = [m for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
    if not users:
        raise BadValue("no message with role 'user'")
    content = text(users[-1].get("content"))
    if content.startswith(_DAPO_PREFIX) and "\n\n" in content:
        content = content.split("\n\n", 1)[1]
    return text(content.split(_DAPO_SUFFIX, 1)[0])


def clean_gold(gold: str) -> str:
    """A gold as one bare LaTeX expression, for math-verify.

    Drops currency signs ``\\$`` (math-verify cannot parse a gold containing them; MATH500 has three)
    and every other ``$`` (OlympiadBench ``$69$,$84$`` -> ``69,84``; Qwen only strips the outer ones,
    which leaves ``69$,$84``), collapses whitespace and drops a trailing period.
    """
    cleaned = re.sub(r"\s+", " ", gold.replace("\\$", "").replace("$", "")).strip()
    cleaned = cleaned.removesuffix(".").rstrip()
    if not cleaned:
        raise BadValue(f"empty answer once $ signs are removed ({gold!r})")
    return cleaned


# --------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Field:
    """Where one Problem attribute comes from: a dotted path into the row and its converter."""

    path: str
    convert: Callable[[Any], str] = text
    required: bool = True  # False: a missing or null value is allowed (None, or the row index for ids)


@dataclass(frozen=True)
class Layout:
    """How the rows of one file (or hub dataset) map onto Problems."""

    question: Field
    answer: Field
    id: Field | None = None  # None: the 0-based row index
    solution: Field | None = None
    context: str | None = None  # a field whose non-empty text is put before the question
    meta: tuple[str, ...] = ()  # fields copied into Problem.meta when present


@dataclass(frozen=True)
class HubSource:
    """A Hugging Face dataset split read with ``datasets.load_dataset(dataset, config, split=split)``."""

    dataset: str
    split: str
    layout: Layout
    config: str | None = None

    def where(self) -> str:
        config = f"/{self.config}" if self.config else ""
        return f"hf:{self.dataset}{config}[{self.split}]"


# --------------------------------------------------------------------------- row readers


def read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based row number, row dict) of a Parquet file (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow)") from exc
    for row_no, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield row_no, row


def read_local(path: Path) -> Iterator[tuple[int, Any]]:
    """Rows of a local ``.jsonl`` or ``.parquet`` file."""
    if path.suffix == ".parquet":
        return read_parquet(path)
    return read_jsonl(path)


def read_hub(source: HubSource) -> Iterator[tuple[int, Any]]:
    """(1-based row number, row dict) of a hub split; ``datasets`` is imported only here."""
    from datasets import load_dataset  # optional dependency, imported lazily

    dataset = load_dataset(source.dataset, source.config, split=source.split)
    for row_no, row in enumerate(dataset, start=1):
        yield row_no, row


# --------------------------------------------------------------------------- hub rows in the local layout (harness data fetch)
# Each takes the hub rows of a split and yields them in the layout of the local file, so that a fetched folder
# loads like any local copy. Tasks whose hub copy already has the local layout write the rows as they come.


def aime24_hub_to_local(rows: Iterable[Mapping[str, Any]]) -> Iterator[dict]:
    """Maxwell-Jia/AIME_2024 (``ID``, ``Problem``, ``Solution``, ``Answer``) as the local ``id/problem/solution/answer``."""
    for row in rows:
        yield {"id": row.get("ID"), "problem": row.get("Problem"), "solution": row.get("Solution"), "answer": row.get("Answer")}


def amc23_hub_to_local(rows: Iterable[Mapping[str, Any]]) -> Iterator[dict]:
    """math-ai/amc23 (``question``, ``answer``, maybe ``id``/``url``) as the local layout; no id: the row index."""
    for index, row in enumerate(rows):
        ident = row.get("id")
        local = {"id": index if ident is None else ident, "problem": row.get("question"), "answer": row.get("answer")}
        yield local | ({"url": row["url"]} if row.get("url") else {})


def minerva_hub_to_local(rows: Iterable[Mapping[str, Any]]) -> Iterator[dict]:
    """math-ai/minervamath (``question``, ``answer``) as the local layout: ``idx`` = row index, gold boxed in ``solution``."""
    for index, row in enumerate(rows):
        yield {"idx": index, "problem": row.get("question"), "solution": f"\\boxed{{{row.get('answer')}}}"}


def without_exact_repeats(rows: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    """Rows minus exact repeats (DAPO-Math-17k's parquet repeats each row about 100 times)."""
    seen: set[str] = set()
    for row in rows:
        key = json.dumps(row, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            yield row


_MISSING = object()


def lookup(row: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path (``reward_model.ground_truth``), or ``_MISSING``."""
    value: Any = row
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return _MISSING
        value = value[key]
    return value


# --------------------------------------------------------------------------- options and task


class MathOptions(TaskOptions):
    k: int = 4
    max_new_tokens: int = 4096
    instruction: str = OptionField(BOXED_INSTRUCTION, description="appended to every problem; '' for none")
    few_shot: int = OptionField(0, ge=0, le=len(FEW_SHOT), description="fixed worked MATH exemplars put before the problem")
    source: Literal["auto", "local", "hub"] = OptionField("auto", description="auto: local file, else the Hugging Face hub")


class CompetitionOptions(MathOptions):
    """AIME and AMC23: many samples per problem (few problems), long solutions."""

    k: int = 16
    max_new_tokens: int = 8192
    protocol_family: str | None = "competition"  # the Qwen3 protocols' AIME rule: 38,912 new tokens (thinking), 64 samples


class SingleSampleOptions(MathOptions):
    k: int = 1


class Gsm8kOptions(SingleSampleOptions):
    max_new_tokens: int = 2048


def build_question(problem_text: str, instruction: str, shots: Iterable[tuple[str, str]] = ()) -> str:
    """Problem text plus instruction; with exemplars: instruction, worked pairs, then the problem."""
    shots = list(shots)
    if not shots:
        return f"{problem_text}\n{instruction}" if instruction else problem_text
    head = f"{instruction}\n\n" if instruction else ""
    worked = "".join(f"Problem:\n{q}\n\nSolution:\n{s}\n\n" for q, s in shots)
    return f"{head}{worked}Problem:\n{problem_text}\n\nSolution:"


class MathTask(MathVerifyGraded, Task):
    """A math benchmark declared by its files, hub sources and row layout; graded with math-verify."""

    Options = MathOptions
    files: ClassVar[Mapping[str, str]]  # split -> file name under DIR/<task name>/
    local_layout: ClassVar[Layout]
    hub: ClassVar[Mapping[str, HubSource]]  # split -> hub source
    collapse_identical: ClassVar[bool] = False  # skip exact repeats of (id, question, answer)
    expected_rows: ClassVar[Mapping[str, tuple[int, ...]]] = {}  # split -> problem counts of the known good copies
    hub_to_local: ClassVar[Callable[[Iterable[Mapping[str, Any]]], Iterable[Mapping[str, Any]]] | None] = None  # None: same layout

    # ---- data on disk (harness data fetch / check)

    @classmethod
    def data_needs(cls) -> tuple[DataNeed, ...]:
        """One need per split: the local file, fetched from the hub source and rewritten in the local layout."""
        return tuple(
            DataNeed(
                task=cls.name,
                split=split,
                files=(f"{cls.name}/{cls.files[split]}",),
                source=cls.hub[split].where(),
                fetch=partial(cls.fetch_split, split),
                load=partial(cls.load_local, split),
                rows=cls.expected_rows.get(split, ()),
            )
            for split in cls.splits
        )

    @classmethod
    def fetch_split(cls, split: str, folder: Path) -> None:
        """Download ``split`` from its hub source into ``folder/<name>/<file>``, in the local file's layout."""
        hub = cls.hub[split]
        rows: Iterable[Mapping[str, Any]] = hub_dataset_rows(hub.dataset, hub.config, hub.split)
        write_rows(folder / cls.name / cls.files[split], cls.hub_to_local(rows) if cls.hub_to_local else rows)

    @classmethod
    def load_local(cls, split: str, folder: Path) -> list[Problem]:
        """The problems of ``split`` read from the local file under ``folder`` only (never the hub)."""
        return cls(cls.Options(source="local")).load(split, data_dir=folder)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Declare ``provides_references`` from the layouts, for the default source (``auto``: local or hub)."""
        super().__init_subclass__(**kwargs)
        if "local_layout" in cls.__dict__:
            cls.provides_references = cls.references_guaranteed("auto")

    @classmethod
    def references_guaranteed(cls, source: str) -> bool:
        """Whether every training problem read from ``source`` has a reference solution (a required solution field)."""
        split = "train" if "train" in cls.splits else "test"
        layouts = ([] if source == "hub" else [cls.local_layout]) + ([] if source == "local" else [cls.hub[split].layout])
        return all(layout.solution is not None and layout.solution.required for layout in layouts)

    def provided_inputs(self) -> frozenset[str]:
        """Rewards, and reference responses when the layouts of ``options.source`` all carry solutions."""
        refs = self.references_guaranteed(self.options.source)  # type: ignore[attr-defined]
        return (super().provided_inputs() - {"reference_responses"}) | frozenset({"reference_responses"} if refs else ())

    # ---- loading

    def read_problems(self, split: str, data_dir: Path) -> list[Problem]:
        """Validated problems of ``split``, from the local file under ``data_dir`` if there is one, else from the hub."""
        rows, layout, where = self._rows(split, data_dir)
        return self.build_problems(rows, layout, where)

    def local_path(self, split: str, data_dir: Path) -> Path:
        """The local file of ``split`` under the data root: ``data_dir/<name>/<file>``."""
        return data_dir / self.name / self.files[split]

    def _rows(self, split: str, data_dir: Path) -> tuple[Iterator[tuple[int, Any]], Layout, str]:
        """The row source of ``split``: (rows, their layout, where they come from for messages)."""
        source = self.options.source  # type: ignore[attr-defined]
        path = self.local_path(split, data_dir)
        looked = "options.source is 'hub'" if source == "hub" else f"looked for {path}"
        if source != "hub" and path.is_file():
            return read_local(path), self.local_layout, str(path)
        if source == "local":
            raise DataNotFound(f"{self.name} [{split}]: no local data file; {looked}")
        hub = self.hub[split]
        try:
            rows = read_hub(hub)
            first = next(rows, None)  # touch the hub now, so a failure is reported here
        except Exception as exc:  # noqa: BLE001 - any hub failure ends in one clear error
            hint = " (pip install datasets)" if isinstance(exc, ImportError) else ""
            raise DataNotFound(
                f"{self.name} [{split}]: {looked}; Hugging Face hub fallback {hub.where()} failed: "
                f"{type(exc).__name__}: {exc}{hint}. Put the file at <DIR>/{self.name}/{self.files[split]} and pass "
                f"data_dir=<DIR>, set options.data_dir or ${DATA_DIR_ENV}."
            ) from exc
        if source == "auto":
            log.info("%s [%s]: %s; loading %s", self.name, split, looked, hub.where())
        return _chain(first, rows), hub.layout, hub.where()

    def build_problems(self, rows: Iterable[tuple[int, Any]], layout: Layout, where: str) -> list[Problem]:
        """Validate every row into a Problem; a duplicate id is a DataError at its second line."""
        problems: list[Problem] = []
        first_line: dict[str, tuple[int, Problem]] = {}
        for index, (line, row) in enumerate(rows):
            problem = self.row_to_problem(row, layout, where, line, index)
            if problem.id in first_line:
                seen_line, seen = first_line[problem.id]
                identical = (seen.question, seen.answer) == (problem.question, problem.answer)
                if self.collapse_identical and identical:
                    continue
                field_name = layout.id.path if layout.id else "<row index>"
                raise DataError(where, line, field_name, f"duplicate id {problem.id!r} (first at line {seen_line})")
            first_line[problem.id] = (line, problem)
            problems.append(problem)
        if not problems:
            raise DataError(where, 1, "<file>", "no rows")
        return problems

    def row_to_problem(self, row: Any, layout: Layout, where: str, line: int, index: int) -> Problem:
        """One validated Problem from one raw row."""
        if not isinstance(row, Mapping):
            raise DataError(where, line, "<row>", f"expected a JSON object, got {_type_name(row)}")
        problem_text = _get(row, layout.question, where, line)
        context = row.get(layout.context) if layout.context else None
        if isinstance(context, str) and context.strip():
            problem_text = f"{context.strip()}\n{problem_text}"
        raw_answer = _get(row, layout.answer, where, line)
        answer = _clean(raw_answer, layout.answer.path, where, line)
        meta = {"problem": problem_text, "source": where, **{k: row[k] for k in layout.meta if k in row}}
        if answer != raw_answer:
            meta["raw_answer"] = raw_answer
        ident = _get(row, layout.id, where, line) if layout.id else None
        opts: MathOptions = self.options  # type: ignore[assignment]
        return Problem(
            id=ident if ident is not None else str(index),
            question=build_question(problem_text, opts.instruction, FEW_SHOT[: opts.few_shot]),
            answer=answer,
            solution=_get(row, layout.solution, where, line) if layout.solution else None,
            meta=meta,
        )


def _get(row: Mapping[str, Any], spec: Field, where: str, line: int) -> Any:
    """Convert one field; a missing or bad value is a DataError naming file, line and field."""
    value = lookup(row, spec.path)
    if value is _MISSING or value is None:
        if not spec.required:
            return None
        raise DataError(where, line, spec.path, "missing" if value is _MISSING else "is null")
    try:
        return spec.convert(value)
    except BadValue as exc:
        raise DataError(where, line, spec.path, str(exc)) from None


def _clean(raw_answer: str, field_name: str, where: str, line: int) -> str:
    """:func:`clean_gold`, its failure reported as a DataError."""
    try:
        return clean_gold(raw_answer)
    except BadValue as exc:
        raise DataError(where, line, field_name, str(exc)) from None


def _chain(first: tuple[int, Any] | None, rest: Iterator[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
    if first is not None:
        yield first
        yield from rest


# --------------------------------------------------------------------------- benchmarks

_PROBLEM_ANSWER = Layout(question=Field("problem"), answer=Field("answer", integer_answer), id=Field("id", identifier))


class Math500Task(MathTask):
    description = "MATH-500 (500 MATH test problems, LaTeX answers); hub HuggingFaceH4/MATH-500"
    files = {"test": "test.jsonl"}
    local_layout = Layout(
        question=Field("problem"), answer=Field("answer"), id=Field("unique_id"), solution=Field("solution"), meta=("subject", "level")
    )
    hub = {"test": HubSource("HuggingFaceH4/MATH-500", "test", local_layout)}
    expected_rows = {"test": (500,)}


class Aime24Task(MathTask):
    description = "AIME 2024 (30 problems, integer answers); hub Maxwell-Jia/AIME_2024"
    Options = CompetitionOptions
    files = {"test": "test.jsonl"}
    local_layout = Layout(
        question=Field("problem"),
        answer=Field("answer", integer_answer),
        id=Field("id", identifier),
        solution=Field("solution"),
        meta=("url",),
    )
    hub = {
        "test": HubSource(
            "Maxwell-Jia/AIME_2024",
            "train",
            Layout(
                question=Field("Problem"), answer=Field("Answer", integer_answer), id=Field("ID", identifier), solution=Field("Solution")
            ),
        )
    }
    expected_rows = {"test": (30,)}
    hub_to_local = staticmethod(aime24_hub_to_local)


class Aime25Task(MathTask):
    description = "AIME 2025 (30 problems, integer answers); hub math-ai/aime25"
    Options = CompetitionOptions
    files = {"test": "test.jsonl"}
    local_layout = _PROBLEM_ANSWER
    hub = {"test": HubSource("math-ai/aime25", "test", _PROBLEM_ANSWER)}
    expected_rows = {"test": (30,)}


class Amc23Task(MathTask):
    description = "AMC 2023 (40 problems, numeric answers); hub math-ai/amc23"
    Options = CompetitionOptions
    files = {"test": "test.jsonl"}
    local_layout = Layout(question=Field("problem"), answer=Field("answer", whole_number), id=Field("id", identifier), meta=("url",))
    hub = {
        "test": HubSource(
            "math-ai/amc23",
            "test",
            Layout(question=Field("question"), answer=Field("answer", whole_number), id=Field("id", identifier, required=False)),
        )
    }
    expected_rows = {"test": (40,)}
    hub_to_local = staticmethod(amc23_hub_to_local)


_OLYMPIAD_LAYOUT = Layout(
    question=Field("question"),
    answer=Field("final_answer", first_final_answer),
    id=Field("id", identifier),
    solution=Field("solution", solution_text, required=False),
    context="context",
    meta=("answer_type", "unit", "is_multiple_answer", "subfield"),
)


class OlympiadBenchTask(MathTask):
    description = "OlympiadBench OE_TO_maths_en_COMP (text-only English competition math); hub Hothan/OlympiadBench"
    files = {"test": "test.jsonl"}
    local_layout = _OLYMPIAD_LAYOUT
    hub = {"test": HubSource("Hothan/OlympiadBench", "train", _OLYMPIAD_LAYOUT, config="OE_TO_maths_en_COMP")}
    expected_rows = {"test": (675, 674)}  # the Qwen2.5-Math copy; the hub's


class MinervaTask(MathTask):
    description = "Minerva math (272 university STEM problems; gold = last \\boxed{} of the solution); hub math-ai/minervamath"
    files = {"test": "test.jsonl"}
    local_layout = Layout(
        question=Field("problem"),
        answer=Field("solution", last_boxed),
        id=Field("idx", identifier),
        solution=Field("solution"),
        meta=("type",),
    )
    hub = {"test": HubSource("math-ai/minervamath", "test", Layout(question=Field("question"), answer=Field("answer")))}
    expected_rows = {"test": (272,)}
    hub_to_local = staticmethod(minerva_hub_to_local)


_GSM8K_LAYOUT = Layout(question=Field("question"), answer=Field("answer", gsm8k_answer), solution=Field("answer", gsm8k_solution))


class Gsm8kTask(MathTask):
    description = "GSM8K grade-school word problems (gold after '####'); hub openai/gsm8k (config main)"
    Options = Gsm8kOptions
    splits = ("train", "test")
    files = {"train": "train.jsonl", "test": "test.jsonl"}
    local_layout = _GSM8K_LAYOUT
    hub = {split: HubSource("openai/gsm8k", split, _GSM8K_LAYOUT, config="main") for split in ("train", "test")}
    expected_rows = {"train": (7473,), "test": (1319,)}


_DAPO_LAYOUT = Layout(
    question=Field("prompt", dapo_question),
    answer=Field("reward_model.ground_truth"),
    id=Field("extra_info.index", identifier),
    meta=("data_source",),
)


class DapoMathTask(MathTask):
    description = "DAPO-Math-17k training prompts with integer gold answers; hub BytedTsinghua-SIA/DAPO-Math-17k"
    Options = SingleSampleOptions
    splits = ("train",)
    files = {"train": "dapo_math_17k.parquet"}
    local_layout = _DAPO_LAYOUT
    hub = {"train": HubSource("BytedTsinghua-SIA/DAPO-Math-17k", "train", _DAPO_LAYOUT)}
    collapse_identical = True  # the upstream parquet repeats every row about 100 times
    expected_rows = {"train": (17917,)}
    hub_to_local = staticmethod(without_exact_repeats)
