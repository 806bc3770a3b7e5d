"""Shared pieces of the code tasks: code extraction, the sandbox job runner, the sandbox-owning base class.

Model-written code never runs in the harness process: the host only parses it (``ast.parse``) and ships it,
with its tests, to ``sandbox_runner.py`` inside the sandbox (one sandbox run per sample, every test batched).
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from tasks.base import Problem, Score, Task, TaskOptions

RUNNER = (Path(__file__).with_name("sandbox_runner.py")).read_bytes()
_FENCE = re.compile(r"^\s*```")


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
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name for n in ast.walk(tree))


def syntax_error(code: str) -> str | None:
    """The parse error of ``code`` (parsing only; nothing is executed), or None."""
    try:
        ast.parse(code)
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


class CodeOptions(TaskOptions):
    k: int = 1
    max_new_tokens: int = 1024
    sandbox: str = Field("docker", description="sandbox provider (docker; local isolates much less)")
    sandbox_options: dict[str, Any] = Field(default_factory=dict, description="options for sandbox.open_sandbox")
    workers: int | None = Field(None, ge=1, description="samples graded at once (default: the sandbox pool size)")
    memory_mb: int = Field(2048, ge=64, description="memory limit of one sample's sandbox run")
    source: Literal["auto", "local", "hub"] = "auto"


class RunOutcome:
    """Parsed result lines of one runner job, or the sandbox failure."""

    def __init__(self, lines: list[dict], result, error: str | None) -> None:
        self.lines, self.result, self.error = lines, result, error

    @property
    def done(self) -> bool:
        return any(line.get("done") for line in self.lines)


class SandboxedTask(Task):
    """A task graded by running code in a sandbox it opens lazily (or one given with :meth:`use_sandbox`)."""

    needs_sandbox = True
    Options = CodeOptions

    def __init__(self, options: TaskOptions | None = None, sandbox=None) -> None:
        super().__init__(options)
        self._sandbox = sandbox
        self._owns_sandbox = False
        self._sb_lock = threading.Lock()

    # ---- sandbox lifecycle

    def use_sandbox(self, sb) -> None:
        """Grade through ``sb`` (not closed by this task)."""
        self._sandbox, self._owns_sandbox = sb, False

    @property
    def sandbox(self):
        with self._sb_lock:
            if self._sandbox is None:
                import sandbox as sandbox_pkg

                opts: CodeOptions = self.options  # type: ignore[assignment]
                self._sandbox = sandbox_pkg.open_sandbox(opts.sandbox, **opts.sandbox_options)
                self._owns_sandbox = True
            return self._sandbox

    def close(self) -> None:
        """Close the sandbox if this task opened it."""
        if self._sandbox is not None and self._owns_sandbox:
            self._sandbox.close()
        self._sandbox = None

    @property
    def workers(self) -> int:
        opts: CodeOptions = self.options  # type: ignore[assignment]
        return opts.workers or int(getattr(self.sandbox, "pool_size", 0) or os.cpu_count() or 1)

    # ---- running jobs

    def run_job(self, job: dict, timeout_s: float, max_output_bytes: int = 64 << 20) -> RunOutcome:
        """Run ``sandbox_runner.py`` on ``job`` in the sandbox; returns its result lines (or the failure)."""
        from sandbox import ExecRequest

        nonce = "@@" + secrets.token_hex(8) + "@@"
        payload = json.dumps({**job, "nonce": nonce}, allow_nan=True).encode()
        opts: CodeOptions = self.options  # type: ignore[assignment]
        request = ExecRequest(
            argv=[self.sandbox.python, "runner.py", "job.json"],
            files={"runner.py": RUNNER, "job.json": payload},
            timeout_s=timeout_s,
            memory_mb=opts.memory_mb,
            cpus=1.0,
            pids=64,
            max_output_bytes=max_output_bytes,
        )
        result = self.sandbox.run(request)
        if result.status == "error":
            return RunOutcome([], result, result.error or "sandbox error")
        lines = []
        for raw in result.stdout.split("\n"):
            if raw.startswith(nonce):
                try:
                    lines.append(json.loads(raw[len(nonce) :]))
                except json.JSONDecodeError:
                    pass
        return RunOutcome(lines, result, None)

    def parallel(self, fn: Callable[[int], Score], n: int) -> list[Score]:
        """``[fn(i) for i in range(n)]`` with up to ``workers`` at once; an exception becomes an ``error`` score."""

        def safe(i: int) -> Score:
            try:
                return fn(i)
            except Exception as exc:  # noqa: BLE001 - a grader bug is an error, never a pass/fail
                return Score("error", details=json.dumps({"error": f"{type(exc).__name__}: {exc}"}))

        if n == 0:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.workers, n))) as pool:
            return list(pool.map(safe, range(n)))


def fail(code: str | None, **details) -> Score:
    return Score("fail", extracted=code, details=json.dumps(details))


def error(code: str | None, **details) -> Score:
    return Score("error", extracted=code, details=json.dumps(details))


def aligned(problems: Sequence[Problem], completions: Sequence[str]) -> None:
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
