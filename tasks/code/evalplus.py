"""HumanEval+ and MBPP+ (evalplus data format), graded by differential testing inside the sandbox.

Data: ``DIR/humaneval_plus/HumanEvalPlus-v0.1.10.jsonl.gz`` and ``DIR/mbpp_plus/MbppPlus-v0.2.0.jsonl.gz`` (the
evalplus release assets; any ``*.jsonl[.gz]`` in that folder is accepted when the default name is absent). DIR:
the ``data_dir`` argument of ``load()``, then ``options.data_dir``, then ``$HARNESS_DATA_DIR``, else ``./data``. There is no hub
fallback: the Hugging Face copies (``evalplus/humanevalplus``, ``evalplus/mbppplus``) carry no base/plus inputs.

Grading follows evalplus 0.3 (``evalplus/eval/__init__.py``):
  - expected outputs and per-input reference runtimes come from running ``prompt + canonical_solution`` over the
    base and plus inputs IN THE SANDBOX; they are cached per dataset file hash under
    ``<cache>/evalplus/<task>-<sha256[:16]>-v<TRUTH_VERSION>/`` (cache: ``$HARNESS_CACHE_DIR``,
    ``$XDG_CACHE_HOME/opd-harness`` or ``~/.cache/opd-harness``) and never sent into a sandbox again: per problem
    ``<id>.json`` (outputs up to ``DIGEST_OVER`` = 64 KiB as text, larger ones as SHA-256 digests; kept in memory
    once read) and ``<id>.outputs.json`` (every output in full, read only when a digest cannot decide);
  - the candidate runs in a child of the sandbox runner, which measures each input's time and kills it at the
    per-input limit ``max(min_time_limit, gt_time_limit_factor * ref_time)`` (defaults 4.0 s and 4.0x) or the phase
    wall ``min(60, sum(limits)) + 1``; a time-out is a failing test (status ``timeout`` in details);
  - the runner reports the candidate's outputs (tagged JSON, HMAC-authenticated) and THE HARNESS compares them;
    an output over ``DIGEST_OVER`` bytes is reported as its SHA-256 (computed by the trusted supervisor, so 100+ MB
    outputs such as HumanEval/15's and /130's never leave the sandbox): a digest equal to the expected text's is a
    match where identical text means equal (no NaN, opaque value or special oracle); any other digest makes the
    harness grade the sample again with every output shipped, compared as below (``checker.evalplus_match``):
    output ``==`` expected, else ``np.allclose(rtol=1e-7, atol)`` with atol 1e-6 forced
    from the first float output on; the MBPP special oracles and input deserialisation (tuples, sets, complex) as
    evalplus; instances of other classes than builtins are equal to nothing;
  - fast check: a phase stops at its first failing input (exceptions and time-outs in the sandbox, wrong outputs
    here); base and plus run in one sandbox run, plus = base and plus.
Score.details (JSON) has ``base`` and ``plus`` statuses; the task's status is ``plus`` (default) or ``base``
(``options.grade``). An unparsable completion is ``fail``; a sandbox failure is ``error``.

Code extraction (evalplus sanitize / lm-eval style): the last fenced block if the completion has one, else the
raw completion. For HumanEval, code that does not define the entry point is appended to the prompt (a base model
continuing the function body).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from opd_harness.data import download_url
from opd_harness.task import DataError, DataNeed, Problem, Score, read_jsonl
from opd_harness.task import DataNotFound as TaskDataNotFound
from opd_harness.tasks.code import checker
from opd_harness.tasks.code.common import (CodeOptions, SandboxedCodeTask, aligned, cache_root, defines, error, fail, last_fenced_block,
                                           syntax_error)
from opd_harness.tasks.code.sandbox_runner import phase_inputs

INSTRUCTION = "Please provide a self-contained Python script that solves the following problem in a markdown code block:"
TRUTH_TIMEOUT_S = 300.0
TRUTH_VERSION = 3  # bump when the cached ground truth's format changes
DIGEST_OVER = 64 << 10  # outputs longer than this (bytes of tagged JSON) are compared by SHA-256 first


class DataNotFound(TaskDataNotFound):
    """No local data file; the message says where it looked."""


class EvalPlusOptions(CodeOptions):
    grade: Literal["plus", "base"] = Field("plus", description="which test set decides pass/fail")
    base_only: bool = Field(False, description="skip the plus tests (plus is then reported as 'skipped')")
    min_time_limit: float = Field(4.0, gt=0, description="evalplus --min_time_limit (seconds per input)")
    gt_time_limit_factor: float = Field(4.0, gt=0, description="evalplus --gt_time_limit_factor")
    instruction: str = INSTRUCTION


def validate_row(row: Any, path: Path, line: int) -> dict:
    """Check the evalplus fields of one row; a bad one is a DataError naming file, line and field."""
    if not isinstance(row, Mapping):
        raise DataError(path, line, "<row>", "expected a JSON object")
    for name in ("task_id", "prompt", "entry_point", "canonical_solution"):
        if name not in row:
            raise DataError(path, line, name, "missing")
        if not isinstance(row[name], str) or not row[name].strip():
            raise DataError(path, line, name, "expected a non-empty string")
    if not row["entry_point"].isidentifier():
        raise DataError(path, line, "entry_point", f"not an identifier: {row['entry_point']!r}")
    row = dict(row)
    for name in ("base_input", "plus_input"):
        value = row.get(name)
        if value == {}:  # MbppPlus v0.2.0 Mbpp/793 has ``"plus_input": {}``: no plus inputs (as evalplus reads it)
            value = row[name] = []
        if not isinstance(value, list) or not all(isinstance(v, (list, tuple)) for v in value):
            raise DataError(path, line, name, "expected a list of argument lists")
    if not row["base_input"]:
        raise DataError(path, line, "base_input", "empty")
    atol = row.get("atol", 0)
    if isinstance(atol, bool) or not isinstance(atol, (int, float)) or atol < 0:
        raise DataError(path, line, "atol", f"expected a number >= 0, got {atol!r}")
    if "contract" in row and not isinstance(row["contract"], str):
        raise DataError(path, line, "contract", "expected a string")
    return row


class EvalPlusTask(SandboxedCodeTask):
    Options = EvalPlusOptions
    provides_references = True  # prompt + canonical_solution of every row
    dataset: ClassVar[str]  # "humaneval" | "mbpp"
    file_name: ClassVar[str]
    release_url: ClassVar[str]  # the release asset evalplus itself downloads
    content_sha256: ClassVar[str]  # SHA-256 of the gunzipped asset (gzip headers differ between copies)
    expected_rows: ClassVar[int]

    def __init__(self, options=None, sandbox=None) -> None:
        super().__init__(options, sandbox)
        self._rows: dict[str, dict] = {}
        self._hash: str | None = None
        self._truth_locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._truths: dict[str, dict] = {}  # task_id -> truth() (small: large outputs only as digests)

    @property
    def grader(self) -> tuple[str, str]:
        return ("evalplus-sandbox", "1")

    # ---- data

    @classmethod
    def data_needs(cls) -> tuple[DataNeed, ...]:
        """The release asset at ``<task>/<file_name>`` (the hub copies lack base/plus inputs, so it comes from GitHub)."""
        need = DataNeed(
            task=cls.name,
            split="test",
            files=(f"{cls.name}/{cls.file_name}",),
            source=cls.release_url,
            fetch=cls.fetch_release,
            load=lambda folder: cls(cls.Options(source="local")).load(data_dir=folder),
            rows=(cls.expected_rows,),
        )
        return (need,)

    @classmethod
    def fetch_release(cls, folder: Path) -> None:
        """Download the release asset into ``folder/<task>/<file_name>``, checking its content hash."""
        download_url(cls.release_url, folder / cls.name / cls.file_name, gunzipped_sha256=cls.content_sha256)

    def data_path(self, data_dir: Path) -> Path:
        """The release file under the data root (``data_dir/<task>/<file_name>``, else any ``*.jsonl[.gz]`` there)."""
        folder = data_dir / self.name
        path = folder / self.file_name
        if path.is_file():
            return path
        others = sorted(folder.glob("*.jsonl.gz")) + sorted(folder.glob("*.jsonl"))
        if others:
            return others[0]
        raise DataNotFound(f"{self.name}: no {path} (nor any *.jsonl[.gz] in {folder}); expected the evalplus release asset there")

    def read_problems(self, split: str, data_dir: Path) -> list[Problem]:
        opts: EvalPlusOptions = self.options  # type: ignore[assignment]
        if opts.source == "hub":
            raise DataNotFound(f"{self.name}: no hub source (the hub copies lack base/plus inputs); use a local file")
        path = self.data_path(data_dir)
        self._hash = hashlib.sha256(path.read_bytes()).hexdigest()
        problems, first_line = [], {}
        for line, raw in read_jsonl(path):
            row = validate_row(raw, path, line)
            tid = row["task_id"]
            if tid in first_line:
                raise DataError(path, line, "task_id", f"duplicate id {tid!r} (first at line {first_line[tid]})")
            first_line[tid] = line
            row["atol"] = float(row.get("atol") or 0)
            self._rows[tid] = row
            problems.append(
                Problem(
                    id=tid,
                    question=f"{opts.instruction}\n```\n{row['prompt'].strip()}\n```" if opts.instruction else row["prompt"],
                    answer=row["entry_point"],
                    solution=row["prompt"] + row["canonical_solution"],
                    meta={"prompt": row["prompt"], "entry_point": row["entry_point"], "source": str(path),
                          "n_base": len(row["base_input"]), "n_plus": len(row["plus_input"])},
                )
            )
        if not problems:
            raise DataError(path, 1, "<file>", "no rows")
        return problems

    def format_prompt(self, problem: Problem, tokenizer) -> str:
        """Chat models get the instruction and the prompt in a code block; plain completion gets the raw prompt."""
        template = getattr(tokenizer, "chat_template", None)
        if self.options.use_chat_template and template:
            return super().format_prompt(problem, tokenizer)
        return problem.meta["prompt"]

    # ---- code

    def extract_code(self, problem: Problem, completion: str) -> str:
        block = last_fenced_block(completion)
        code = block if block is not None else completion
        if self.dataset == "humaneval" and not defines(code, problem.meta["entry_point"]):
            code = problem.meta["prompt"].rstrip() + "\n" + code.strip("\n") if block is not None else problem.meta["prompt"] + completion
        return code

    # ---- ground truth (sandbox, cached)

    def truth_dir(self) -> Path:
        assert self._hash is not None, "load() first"
        return cache_root() / "evalplus" / f"{self.name}-{self._hash[:16]}-v{TRUTH_VERSION}"

    def truth(self, task_id: str) -> dict:
        """Expected outputs, reference runtimes and first float-output index, per phase (kept in memory once read).

        ``<phase>_outputs[i]`` is the tagged JSON text of an output up to ``DIGEST_OVER`` bytes, else None with
        ``<phase>_digests[i]`` = ``{"sha256", "n", "same_ok"}`` (``same_ok``: identical text is a match); the full
        texts are in a side file (:meth:`full_outputs`), read only when a digest cannot decide.

        Raises:
            RuntimeError: the canonical solution could not be run (sandbox failure or crash).
        """
        if task_id in self._truths:
            return self._truths[task_id]
        path = self._truth_path(task_id, "")
        with self._locks_lock:
            lock = self._truth_locks.setdefault(task_id, threading.Lock())
        with lock:
            if task_id in self._truths:
                return self._truths[task_id]
            try:
                summary = json.loads(path.read_text()) if path.is_file() and self._truth_path(task_id, ".outputs").is_file() else None
            except (OSError, json.JSONDecodeError):
                summary = None
            if summary is None:
                full = self._compute_truth(task_id)
                summary = self._summarise(task_id, full)
                self._write_json(self._truth_path(task_id, ".outputs"), {ph: full[f"{ph}_outputs"] for ph in ("base", "plus")})
                self._write_json(path, summary)  # last: a summary on disk means its side file is complete
            self._truths[task_id] = summary
            return summary

    def full_outputs(self, task_id: str, phase: str) -> list[str]:
        """Every expected output text of a phase, large ones included (read from the side file each time)."""
        return json.loads(self._truth_path(task_id, ".outputs").read_text())[phase]

    def _truth_path(self, task_id: str, kind: str) -> Path:
        return self.truth_dir() / (task_id.replace("/", "_") + kind + ".json")

    def _summarise(self, task_id: str, full: dict) -> dict:
        """The in-memory truth: small outputs as text, large ones as digests (see :meth:`truth`)."""
        entry_point, summary = self._rows[task_id]["entry_point"], {}
        for phase in ("base", "plus"):
            texts = full[f"{phase}_outputs"]
            small = [len(t) <= DIGEST_OVER for t in texts]
            summary[f"{phase}_outputs"] = [t if ok else None for t, ok in zip(texts, small)]
            summary[f"{phase}_digests"] = [
                None if ok else {"sha256": checker.digest(t), "n": len(t), "same_ok": checker.same_text_is_equal(entry_point, t)}
                for t, ok in zip(texts, small)
            ]
            summary[f"{phase}_bytes"] = sum(len(t) for t in texts)
            summary[f"{phase}_times"], summary[f"{phase}_float_from"] = full[f"{phase}_times"], full[f"{phase}_float_from"]
        return summary

    @staticmethod
    def _write_json(path: Path, data: Any) -> None:
        """Write ``data`` to ``path`` atomically (a reader sees the old file or the whole new one)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)

    def _compute_truth(self, task_id: str) -> dict:
        """Run the canonical solution over every input in the sandbox (evalplus get_groundtruth)."""
        row = self._rows[task_id]
        job = {
            "mode": "evalplus_truth", "dataset": self.dataset, "task_id": task_id,
            "code": row["prompt"] + row["canonical_solution"], "entry_point": row["entry_point"],
            "base_input": row["base_input"], "plus_input": row["plus_input"],
        }
        outcome = self.run_job(job, TRUTH_TIMEOUT_S, max_output_bytes=1 << 30)  # some outputs are large (HumanEval/14)
        if outcome.error:
            raise RuntimeError(f"ground truth of {task_id}: sandbox error: {outcome.error}")
        r = outcome.result
        data: dict[str, Any] = {}
        for phase in ("base", "plus"):
            got, end = checker.phase_records(outcome.report, phase)
            n = len(row[f"{phase}_input"])
            if not outcome.done or end is None or sorted(got) != list(range(n)) or r.stdout_truncated:
                hint = f" (more than the sandbox's memory_mb={self.options.memory_mb})" if r.status == "oom" else ""
                why = f"{r.status}{hint}, exit {r.exit_code}"
                raise RuntimeError(f"ground truth of {task_id}: canonical solution failed ({why}): {r.stderr[-500:]}")
            data[f"{phase}_outputs"] = [got[i].payload for i in range(n)]
            data[f"{phase}_times"] = [got[i].header["t"] for i in range(n)]
            data[f"{phase}_float_from"] = next((i for i in range(n) if checker.is_floats(checker.decode(got[i].payload))), None)
        return data

    # ---- grading

    def grade_many(self, problems: list[Problem], completions: list[str]) -> list[Score]:
        aligned(problems, completions)
        return self.parallel(lambda i: self.grade_one(problems[i], completions[i]), len(problems))

    def grade_one(self, problem: Problem, completion: str) -> Score:
        opts: EvalPlusOptions = self.options  # type: ignore[assignment]
        code = self.extract_code(problem, completion)
        bad = syntax_error(code)
        if bad:
            return fail(code, base="fail", plus="fail", reason=f"unparsable: {bad}", graded=opts.grade)
        try:
            truth = self.truth(problem.id)
        except RuntimeError as exc:
            return error(code, reason=str(exc))
        row = self._rows[problem.id]
        names = ["base"] if opts.base_only else ["base", "plus"]
        phases = []
        for phase in names:
            limits = [max(opts.min_time_limit, opts.gt_time_limit_factor * t) for t in truth[f"{phase}_times"]]
            phases.append({"name": phase, "inputs": row[f"{phase}_input"], "limits": limits, "wall": min(60.0, sum(limits)) + 1.0})
        job = {"mode": "evalplus_check", "dataset": self.dataset, "task_id": problem.id, "code": code,
               "entry_point": row["entry_point"], "phases": phases, "digest_over": DIGEST_OVER}
        expected_bytes = sum(truth[f"{phase}_bytes"] for phase in names)
        timeout_s, max_bytes = 5.0 + sum(p["wall"] for p in phases), max(64 << 20, 8 * expected_bytes + (1 << 20))
        outcome = self.run_job(job, timeout_s, max_output_bytes=max_bytes)
        if outcome.error:
            return error(code, reason=f"sandbox: {outcome.error}")
        try:
            verdicts = {phase: self.check_phase(problem.id, phase, truth, outcome) for phase in names}
        except checker.NeedOutputs:  # a large output is not byte-identical to the expected one: grade again, outputs shipped
            outcome = self.run_job({k: v for k, v in job.items() if k != "digest_over"}, timeout_s, max_output_bytes=max_bytes)
            if outcome.error:
                return error(code, reason=f"sandbox: {outcome.error}")
            verdicts = {phase: self.check_phase(problem.id, phase, truth, outcome) for phase in names}
        base = verdicts["base"].status
        details: dict[str, Any] = {"base": base, "graded": opts.grade}
        if opts.base_only:
            details["plus"] = "skipped"
        else:
            own = verdicts["plus"].status
            details["plus"] = own if base == "pass" else ("fail" if own == "pass" else own)
        for phase, v in verdicts.items():
            if v.status != "pass" and (phase == "base" or base == "pass"):
                details[f"{phase}_error"], details[f"{phase}_failed_input"] = v.error, v.failed_input
        if outcome.report.rejected:
            details["rejected_records"] = outcome.report.rejected
        passed = base == "pass" if opts.grade == "base" else details["plus"] == "pass"
        return Score("pass" if passed else "fail", extracted=code, details=json.dumps(details))

    def check_phase(self, task_id: str, phase: str, truth: dict, outcome) -> checker.PhaseVerdict:
        """evalplus's verdict of one phase from the candidate's reported outputs and the ground truth."""
        row = self._rows[task_id]
        entry_point, digests = row["entry_point"], truth[f"{phase}_digests"]
        expected = list(truth[f"{phase}_outputs"])  # a copy: large outputs read below are not kept in memory
        float_from = truth[f"{phase}_float_from"]
        inputs: list = []
        got, end = checker.phase_records(outcome.report, phase)

        def inp(i: int):
            if not inputs:
                inputs.extend(phase_inputs(self.dataset, task_id, row[f"{phase}_input"]))
            return inputs[i]

        def match(i: int, text: str | None) -> None:
            if text is None:  # a digest record: only byte-identical text (where that means equal) decides here
                want = digests[i]
                if want is not None and want["same_ok"] and got[i].header["sha256"] == want["sha256"]:
                    return
                raise checker.NeedOutputs(f"{task_id} {phase} input {i}")
            if expected[i] is None:  # a large expected output, needed in full
                expected[:] = self.full_outputs(task_id, phase)
            if text == expected[i] and checker.same_text_is_equal(entry_point, text):
                return
            # evalplus's atol before input i: the row's, or 1e-6 once an earlier expected output was float (not find_zero)
            atol = row["atol"] or (1e-6 if float_from is not None and i > float_from and entry_point != "find_zero" else 0.0)
            checker.evalplus_match(self.dataset, entry_point, lambda: inp(i), checker.decode(text), checker.decode(expected[i]), atol)

        return checker.check_outputs(len(expected), got, end, match, outcome.result.status)


class HumanEvalPlusTask(EvalPlusTask):
    description = "HumanEval+ (evalplus v0.1.10, 164 problems, base + plus tests) graded in the sandbox"
    dataset = "humaneval"
    file_name = "HumanEvalPlus-v0.1.10.jsonl.gz"
    release_url = "https://github.com/evalplus/humanevalplus_release/releases/download/v0.1.10/HumanEvalPlus.jsonl.gz"
    content_sha256 = "42526ec0e7d5f3ee0b06d6ced98f8c8bae3d76519151bfb3d36f79010645bd7f"
    expected_rows = 164


class MbppPlusTask(EvalPlusTask):
    description = "MBPP+ (evalplus v0.2.0, 378 problems, base + plus tests) graded in the sandbox"
    dataset = "mbpp"
    file_name = "MbppPlus-v0.2.0.jsonl.gz"
    release_url = "https://github.com/evalplus/mbppplus_release/releases/download/v0.2.0/MbppPlus.jsonl.gz"
    content_sha256 = "b54e762755248ca411b523c917fa9f93c07b5ff2966bf60b3917b853926a3dad"
    expected_rows = 378
