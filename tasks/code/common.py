"""Shared pieces of the code tasks: code extraction, the sandbox job runner, the code tasks' base class.

Model-written code never runs in the harness process: the host only parses it (``ast.parse``) and ships it, with
the test inputs (never the expected outputs), to ``sandbox_runner.py`` inside the sandbox (one sandbox run per
sample, every test batched). The runner reports the program's outputs in HMAC-authenticated records; the verdict
is computed here (``checker.py``).
"""

from __future__ import annotations

import ast
import json
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field

from opd_harness.task import Problem, Score
from opd_harness.tasks.agentic.sandboxed import SandboxedTask, SandboxOptions
from opd_harness.tasks.code.checker import Report, parse_report

RUNNER = (Path(__file__).with_name("sandbox_runner.py")).read_bytes()
_FENCE = re.compile(r"^\s*```")
# CPython 3.11 tracks the AST conversion's recursion depth in interpreter-wide state: ast.parse in two threads at
# once can raise a spurious "SystemError: AST constructor recursion depth mismatch" (seen here; cpython gh-106905).
_AST_LOCK = threading.Lock()


def parse(code: str) -> ast.Module:
    """``ast.parse`` serialised across threads (see ``_AST_LOCK``)."""
    with _AST_LOCK:
        return ast.parse(code)


def last_fenced_block(text: str) -> str | None:
    """The content of the last fenced block (between the last two lines holding a fence, as lcb_runner does).

    ``None`` when the text has fewer than two fence lines. The language tag line is dropped.
    """
    lines = text.split("\n")
    fences = [i for i, line in enumerate(lines) if "```" in line]
    if len(fences) < 2:
        return None
    return "\n".join(lines[fences[-2] + 1 : fences[-1]])


def defines(code: str, name: str) -> bool:
    """Whether ``code`` (parsable) defines a function or class ``name`` anywhere."""
    try:
        tree = parse(code)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name for n in ast.walk(tree))


def syntax_error(code: str) -> str | None:
    """The parse error of ``code`` (parsing only; nothing is executed), or None."""
    try:
        parse(code)
    except SyntaxError as exc:
        return f"SyntaxError: {exc.msg} (line {exc.lineno})"
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, absurd nesting
        return f"{type(exc).__name__}: {exc}"
    return None


def cache_root() -> Path:
    """``$HARNESS_CACHE_DIR``, else ``$XDG_CACHE_HOME/opd-harness``, else ``~/.cache/opd-harness``."""
    if os.environ.get("HARNESS_CACHE_DIR"):
        return Path(os.environ["HARNESS_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "opd-harness"


class CodeOptions(SandboxOptions):
    k: int = 1
    max_new_tokens: int = 1024
    workers: int | None = Field(None, ge=1, description="samples graded at once (default: the sandbox pool size)")
    memory_mb: int = Field(2048, ge=64, description="memory limit of one sample's sandbox run")
    source: Literal["auto", "local", "hub"] = "auto"


class RunOutcome:
    """The runner's authenticated report of one job and the sandbox result, or why the job could not run (``error``)."""

    def __init__(self, report: Report, result, error: str | None) -> None:
        self.report, self.result, self.error = report, result, error

    @property
    def done(self) -> bool:
        return self.report.done


class SandboxedCodeTask(SandboxedTask):
    """A code task: programs run by ``sandbox_runner.py`` in the task's sandbox, many samples graded at once."""

    Options = CodeOptions

    @property
    def workers(self) -> int:
        opts: CodeOptions = self.options  # type: ignore[assignment]
        return opts.workers or int(getattr(self.sandbox, "pool_size", 0) or os.cpu_count() or 1)

    # ---- running jobs

    def run_job(self, job: dict, timeout_s: float, max_output_bytes: int = 64 << 20) -> RunOutcome:
        """Run ``sandbox_runner.py`` on ``job`` in the sandbox; its authenticated report, or an ``error``.

        ``error`` is set only when the sandbox failed or the runner never started (no key line): both happen before
        any model code runs, so a program cannot turn its own failure into an error.
        """
        from opd_harness.sandbox import ExecRequest

        payload = json.dumps(job, allow_nan=True).encode()
        opts: CodeOptions = self.options  # type: ignore[assignment]
        sb = self.sandbox  # once: a close() meanwhile must not make this job open a second sandbox
        request = ExecRequest(
            argv=[sb.python, "runner.py", "job.json"],
            files={"runner.py": RUNNER, "job.json": payload},
            timeout_s=timeout_s,
            memory_mb=opts.memory_mb,
            cpus=1.0,
            pids=64,
            max_output_bytes=max_output_bytes,
        )
        result = sb.run(request)
        if result.status == "error":
            return RunOutcome(Report(started=False), result, result.error or "sandbox error")
        report = parse_report(result.stdout)
        if not report.started:
            why = f"the runner did not start ({result.status}, exit {result.exit_code}): {result.stderr[-300:]}"
            return RunOutcome(report, result, why)
        return RunOutcome(report, result, None)

    def parallel(self, fn: Callable[[int], Score], n: int) -> list[Score]:
        """``[fn(i) for i in range(n)]`` with up to ``workers`` at once; an exception becomes an ``error`` score."""

        def safe(i: int) -> Score:
            try:
                return fn(i)
            except Exception as exc:  # noqa: BLE001 - a grader bug is an error, never a pass/fail
                return Score("error", details=json.dumps({"error": f"{type(exc).__name__}: {exc}"}))

        if n == 0:
            return []
        from concurrent.futures import ThreadPoolExecutor  # with the first batch: `harness tasks` does not load it

        pool = ThreadPoolExecutor(max_workers=max(1, min(self.workers, n)))
        try:
            return list(pool.map(safe, range(n)))
        finally:  # interrupted (Ctrl-C, SIGTERM): do not wait for runs in flight; closing the task ends them
            pool.shutdown(wait=False, cancel_futures=True)


def fail(code: str | None, **details) -> Score:
    return Score("fail", extracted=code, details=json.dumps(details))


def error(code: str | None, **details) -> Score:
    return Score("error", extracted=code, details=json.dumps(details))


def aligned(problems: Sequence[Problem], completions: Sequence[str]) -> None:
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
