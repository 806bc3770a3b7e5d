"""LiveCodeBench code generation (schema of the hub dataset ``livecodebench/code_generation_lite``).

Rows: question_title, question_content, platform, question_id, contest_date, starter_code, difficulty,
public_test_cases (JSON string: list of {input, output, testtype}), private_test_cases (JSON string, or base64 of
zlib of a pickle of a JSON string), metadata (JSON string; ``func_name`` marks functional tests).

Sources: local files ``DIR/livecodebench/*.jsonl`` (DIR: ``data_dir`` argument, ``options.data_dir``,
``$HARNESS_DATA_DIR``, else ``./data``) or the hub (``datasets`` imported lazily; ``version_tag=options.release_version``).
Filters: ``release_version`` (for local files named like upstream -- ``test.jsonl``, ``test2.jsonl`` .. --
``release_vN`` keeps test..testN and ``vN`` only testN; other names are all kept), ``start_date`` /
``end_date`` on ``contest_date`` (inclusive, ISO dates).

Private tests are decoded WITHOUT unpickling: :func:`decode_pickled_str` walks the pickle opcodes with
``pickletools.genops`` (a pure parser that executes nothing) and accepts only the opcode sequence of a pickled
``str`` (PROTO, FRAME, one unicode opcode, memo opcodes, STOP); anything else (GLOBAL, REDUCE, ...) is refused,
so no object is constructed and no code can run. zlib output is capped (``MAX_DECOMPRESSED``).

Grading as lcb_runner: code = last fenced block (no block: fail); stdin/stdout tests run the program once per
test with a per-test limit (``timeout``, default 6 s) and compare stripped lines (token-wise Decimal equality
allowed); functional tests call ``Solution().<func_name>`` (or a top-level function) with the JSON-decoded
input lines and compare to the JSON output (tuples as lists, no float tolerance). A sample passes when all
public and private tests pass; a time-out is a failing test. Only the inputs enter the sandbox: the runner
reports each test's stdout (or the function's tagged-JSON result) and the comparison happens here
(``checker``), so model code can neither read the expected outputs nor forge a verdict.
"""

from __future__ import annotations

import base64
import json
import re
import zlib
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import Field

from opd_harness.data import download_hub_files
from opd_harness.task import DataError, DataNeed, DataNotFound, Problem, Score, read_jsonl
from opd_harness.tasks.code import checker
from opd_harness.tasks.code.common import CodeOptions, SandboxedCodeTask, aligned, error, fail, last_fenced_block, syntax_error

HUB_ID = "livecodebench/code_generation_lite"
MAX_DECOMPRESSED = 1 << 30
_STR_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"}
_ALLOWED_OPS = _STR_OPS | {"PROTO", "FRAME", "MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT", "STOP"}

SYSTEM = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will generate "
    "a correct Python program that matches the specification and passes all tests."
)
FORMAT_STARTER = (
    "### Format: You will use the following starter code to write the solution to the problem and enclose your "
    "code within delimiters."
)
FORMAT_STDIN = (
    "### Format: Read the inputs from stdin solve the problem and write the answer to stdout (do not directly test "
    "on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python program "
    "runs, it reads the inputs, runs the algorithm and writes output to STDOUT."
)


class LiveCodeBenchOptions(CodeOptions):
    release_version: str | None = Field(None, description="e.g. release_v5 (cumulative) or v6 (that file only)")
    start_date: str | None = Field(None, description="keep contest_date >= this ISO date")
    end_date: str | None = Field(None, description="keep contest_date <= this ISO date")
    timeout: float = Field(6.0, gt=0, description="seconds per test case (lcb_runner default 6)")


def decode_pickled_str(data: bytes) -> str:
    """The ``str`` held by a pickle, read without unpickling; any other pickle raises ``ValueError``."""
    import pickletools  # with the first pickled test case: `harness tasks` does not load it

    value = None
    ops = list(pickletools.genops(data))  # parses only; raises ValueError on a malformed pickle
    for opcode, _arg, _pos in ops:
        if opcode.name not in _ALLOWED_OPS:
            raise ValueError(f"pickle opcode {opcode.name} not allowed (only a pickled str is accepted)")
    for opcode, arg, _pos in ops:
        if opcode.name in _STR_OPS:
            if value is not None:
                raise ValueError("more than one string in the pickle")
            value = arg
    if not isinstance(value, str):
        raise ValueError("the pickle holds no string")
    return value


def decode_private_tests(text: str) -> list:
    """``private_test_cases``: a JSON list, or base64(zlib(pickle(JSON string))) decoded safely."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raw = base64.b64decode(text.encode(), validate=False)
        d = zlib.decompressobj()
        inflated = d.decompress(raw, MAX_DECOMPRESSED)
        if d.unconsumed_tail:
            raise ValueError(f"decompressed private tests exceed {MAX_DECOMPRESSED} bytes") from None
        value = json.loads(decode_pickled_str(inflated))
    if not isinstance(value, list):
        raise ValueError("expected a list of test cases")
    return value


def _tests(value: Any, where: Path | str, line: int, name: str) -> list[dict]:
    try:
        tests = json.loads(value) if name == "public_test_cases" else decode_private_tests(value)
        if not isinstance(tests, list):
            raise ValueError("expected a list")
    except (ValueError, TypeError, zlib.error) as exc:
        raise DataError(where, line, name, f"cannot decode: {exc}") from None
    for i, t in enumerate(tests):
        if not (isinstance(t, Mapping) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str)):
            raise DataError(where, line, name, f"test {i}: expected {{input: str, output: str, testtype}}")
        if t.get("testtype", "stdin") not in ("stdin", "functional"):
            raise DataError(where, line, name, f"test {i}: unknown testtype {t.get('testtype')!r}")
    return tests


def _date(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value.replace(tzinfo=None)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "")).replace(tzinfo=None)
        except ValueError:
            return None
    return None


def _file_number(path: Path) -> int | None:
    m = re.fullmatch(r"test(\d*)\.jsonl", path.name)
    return (int(m.group(1)) if m.group(1) else 1) if m else None


def select_files(folder: Path, release_version: str | None) -> list[Path]:
    files = sorted(folder.glob("*.jsonl"))
    if not release_version:
        return files
    m = re.fullmatch(r"(release_)?v(\d+)", release_version)
    if not m:
        raise ValueError(f"release_version {release_version!r}: expected release_vN or vN")
    n = int(m.group(2))
    numbered = [f for f in files if _file_number(f) is not None]
    if not numbered:
        return files
    keep = (lambda k: k <= n) if m.group(1) else (lambda k: k == n)
    return [f for f in numbered if keep(_file_number(f))]


class LiveCodeBenchTask(SandboxedCodeTask):
    description = "LiveCodeBench code generation (stdin and LeetCode-style functional tests) graded in the sandbox"
    Options = LiveCodeBenchOptions
    provides_references = False  # the release files hold tests, no reference solutions

    @property
    def grader(self) -> tuple[str, str]:
        return ("lcb-sandbox", "1")

    # ---- data

    @classmethod
    def data_needs(cls) -> tuple[DataNeed, ...]:
        """Upstream's release files ``test.jsonl``, ``test2.jsonl`` .. (release_v5: 880 problems), copied from the hub."""
        need = DataNeed(
            task=cls.name,
            split="test",
            files=(f"{cls.name}/test*.jsonl",),
            source=f"hf:{HUB_ID} (test*.jsonl)",
            fetch=lambda folder: download_hub_files(HUB_ID, "test*.jsonl", folder / cls.name),
            load=lambda folder: cls(cls.Options(source="local")).load(data_dir=folder),
        )
        return (need,)

    def _rows(self, data_dir: Path) -> Iterator[tuple[str, int, Any]]:
        opts: LiveCodeBenchOptions = self.options  # type: ignore[assignment]
        folder = data_dir / self.name
        files = select_files(folder, opts.release_version) if folder.is_dir() and opts.source != "hub" else []
        if files:
            for path in files:
                for line_no, row in read_jsonl(path):
                    yield str(path), line_no, row
            return
        looked = f"no {folder}/*.jsonl (release_version={opts.release_version})"
        if opts.source == "local":
            raise DataNotFound(f"livecodebench: {looked}")
        try:
            from datasets import load_dataset  # optional, imported only on the hub path

            kwargs = {"version_tag": opts.release_version} if opts.release_version else {}
            ds = load_dataset(HUB_ID, split="test", trust_remote_code=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any hub failure ends in one clear error
            hint = " (pip install datasets)" if isinstance(exc, ImportError) else ""
            raise DataNotFound(
                f"livecodebench: {looked}; Hugging Face hub fallback {HUB_ID} failed: {type(exc).__name__}: {exc}{hint}"
            ) from exc
        for i, row in enumerate(ds, start=1):
            yield f"hub:{HUB_ID}", i, row

    def read_problems(self, split: str, data_dir: Path) -> list[Problem]:
        opts: LiveCodeBenchOptions = self.options  # type: ignore[assignment]
        start, end = _date(opts.start_date), _date(opts.end_date)
        problems: list[Problem] = []
        seen: dict[str, str] = {}
        for where, line, row in self._rows(data_dir):
            problem = self.row_to_problem(row, where, line)
            date = _date(problem.meta["contest_date"])
            if (start and (date is None or date < start)) or (end and (date is None or date > end)):
                continue
            if problem.id in seen:
                raise DataError(where, line, "question_id", f"duplicate id {problem.id!r} (first at {seen[problem.id]})")
            seen[problem.id] = f"{where}:{line}"
            problems.append(problem)
        if not problems:
            raise DataError("livecodebench", 1, "<file>", "no rows (after the release/date filter)")
        return problems

    def row_to_problem(self, row: Any, where: str, line: int) -> Problem:
        if not isinstance(row, Mapping):
            raise DataError(where, line, "<row>", "expected a JSON object")
        for name in ("question_id", "question_content", "public_test_cases", "private_test_cases"):
            if not isinstance(row.get(name), str) or (name != "private_test_cases" and not row[name].strip()):
                raise DataError(where, line, name, "missing or not a (non-empty) string")
        starter = row.get("starter_code") or ""
        if not isinstance(starter, str):
            raise DataError(where, line, "starter_code", "expected a string")
        try:
            metadata = json.loads(row.get("metadata") or "{}")
            if not isinstance(metadata, dict):
                raise ValueError("not an object")
        except (ValueError, TypeError) as exc:
            raise DataError(where, line, "metadata", f"expected a JSON object string: {exc}") from None
        public = _tests(row["public_test_cases"], where, line, "public_test_cases")
        private = _tests(row["private_test_cases"], where, line, "private_test_cases") if row["private_test_cases"].strip() else []
        fn_name = metadata.get("func_name")
        if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
            raise DataError(where, line, "metadata", f"func_name must be an identifier, got {fn_name!r}")
        if not public + private:
            raise DataError(where, line, "public_test_cases", "no tests at all")
        if fn_name is None and any(t.get("testtype") == "functional" for t in public + private):
            raise DataError(where, line, "metadata", "functional tests but no func_name")
        question = f"### Question:\n{row['question_content']}\n\n"
        if starter:
            question += f"{FORMAT_STARTER}\n```python\n{starter}\n```\n\n"
        else:
            question += f"{FORMAT_STDIN}\n```python\n# YOUR CODE HERE\n```\n\n"
        question += "### Answer: (use the provided format with backticks)\n\n"
        tests = public + private
        return Problem(
            id=str(row["question_id"]),
            question=question,
            answer=fn_name or "stdin",
            meta={
                "title": row.get("question_title"), "platform": row.get("platform"), "difficulty": row.get("difficulty"),
                "contest_date": str(row.get("contest_date")), "source": where, "fn_name": fn_name,
                "n_public": len(public), "n_private": len(private),
                "inputs": [t["input"] for t in tests], "outputs": [t["output"] for t in tests],
            },
        )

    def format_prompt(self, problem: Problem, tokenizer) -> str:
        template = getattr(tokenizer, "chat_template", None)
        if self.options.use_chat_template and template:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": problem.question}]
            try:
                return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception:  # noqa: BLE001 - templates without a system role
                return super().format_prompt(problem, tokenizer)
        return f"{SYSTEM}\n\n{problem.question}"

    # ---- grading

    def grade_many(self, problems: list[Problem], completions: list[str]) -> list[Score]:
        aligned(problems, completions)
        return self.parallel(lambda i: self.grade_one(problems[i], completions[i]), len(problems))

    def grade_one(self, problem: Problem, completion: str) -> Score:
        opts: LiveCodeBenchOptions = self.options  # type: ignore[assignment]
        code = last_fenced_block(completion)
        if not code or not code.strip():
            return fail(code, reason="no fenced code block")
        bad = syntax_error(code)
        if bad:
            return fail(code, reason=f"unparsable: {bad}")
        inputs, outputs = problem.meta["inputs"], problem.meta["outputs"]
        n, limit = len(inputs), opts.timeout
        if problem.meta["fn_name"]:
            phase = {"name": "tests", "inputs": inputs, "limits": [limit] * n, "wall": (limit + 1) * n + 1}
            job = {"mode": "lcb_functional", "code": code, "fn_name": problem.meta["fn_name"], "load_limit": limit, "phases": [phase]}
        else:
            job = {"mode": "lcb_stdin", "code": code, "inputs": inputs, "timeout": limit}
        expected_bytes = sum(len(o) for o in outputs)
        outcome = self.run_job(job, min(500.0, (limit + 1) * n + 5), max_output_bytes=max(64 << 20, 4 * expected_bytes + (1 << 20)))
        if outcome.error:
            return error(code, reason=f"sandbox: {outcome.error}")
        if problem.meta["fn_name"]:
            verdict = self._functional_verdict(outputs, outcome)
        else:
            verdict = self._stdin_verdict(outputs, outcome)
        if verdict.status == "pass":
            return Score("pass", extracted=code, details=json.dumps({"result": "pass", "tests": n}))
        return fail(code, result=verdict.status, failed_test=verdict.failed_input, reason=verdict.error)

    @staticmethod
    def _functional_verdict(outputs: list[str], outcome) -> checker.PhaseVerdict:
        """prediction == json.loads(output), in test order (the child turned a top-level tuple into a list)."""

        def match(i: int, text: str) -> None:
            assert checker.decode(text) == json.loads(outputs[i]), "wrong answer"

        got, end = checker.phase_records(outcome.report, "tests")
        return checker.check_outputs(len(outputs), got, end, match, outcome.result.status)

    @staticmethod
    def _stdin_verdict(outputs: list[str], outcome) -> checker.PhaseVerdict:
        """Each test's reported stdout against its expected output, in order; the first bad one decides."""
        tests = {r.header["test"]: r for r in outcome.report.records if isinstance(r.header.get("test"), int) and r.payload is not None}
        for i, gold in enumerate(outputs):
            r = tests.get(i)
            if r is None:
                status = "timeout" if outcome.result.status == "timeout" else "fail"
                return checker.PhaseVerdict(status, f"no result for test {i} (sandbox status {outcome.result.status})", i)
            if r.header.get("status") != "ok":
                return checker.PhaseVerdict("timeout" if r.header["status"] == "timeout" else "fail", r.header.get("error"), i)
            try:
                stdout = base64.b64decode(r.payload, validate=True).decode("utf-8", errors="replace")
            except ValueError:
                return checker.PhaseVerdict("fail", "malformed stdout record", i)
            if not checker.stdout_matches(stdout, gold):
                return checker.PhaseVerdict("fail", "wrong answer", i)
        return checker.PhaseVerdict("pass")
