"""Math answer grading with math-verify, safe to call from any thread.

``grade_answer`` is a pure function meant to run inside worker processes.
``MathGrader`` runs it in a ``pebble.ProcessPool`` with a per-item wall timeout, so
that a C-level hang or a very slow SymPy comparison (power towers and the like)
costs one killed worker and is recorded as ``"error"``, never as pass or fail.

Pool start method: ``forkserver`` (falls back to ``spawn`` where unavailable).
``fork`` is avoided because forking a parent that already runs torch/OpenMP
threads can deadlock the child.  Measured on the 2-core dev box (CPython 3.11.7,
pool of 2, time from ``MathGrader()`` to the first graded result):

* forkserver: 0.55-0.7 s for the first pool in a process (starts the server,
  which preloads math-verify and SymPy), then 0.10-0.13 s for later pools and for
  workers pebble replaces after a timeout kill.
* spawn: 0.8-0.9 s for every pool (each worker re-imports math-verify).
* fork: 0.6-0.7 s (not used, see above).
* If the entry script imports torch at module level, every new worker re-runs
  those imports (CPython 3.11 does not preload ``__main__`` in the forkserver):
  forkserver 2.5-2.9 s, spawn 3.2-3.3 s to the first result.  Importing torch
  inside ``main()`` avoids that.

As with any spawn/forkserver pool, the entry script needs an
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import threading
import weakref
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

from opd_harness.lazy import lazy_import

if TYPE_CHECKING:
    import concurrent.futures as cf
    import multiprocessing

    import pebble
else:  # imported with the first pool: `harness tasks` lists the math tasks without them
    cf = lazy_import("concurrent.futures")
    multiprocessing = lazy_import("multiprocessing")
    pebble = lazy_import("pebble")

GRADER_NAME = "math-verify"
"""Name recorded next to every math score (graders differ; see docs/tasks/math.md, "Grader" and "Known deviations")."""

Status = Literal["pass", "fail", "error"]
GradeFn = Callable[..., "MathGrade"]

_KNOWN_FALLBACKS = ("boxed", "last_number")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})+(?:\.\d+)?|-?\d*\.\d+|-?\d+")
_MATH_DELIMS = ("$", "\\(", "\\[", "\\boxed", "\\fbox")


def grader_version() -> str:
    """Return the grader name and installed version, e.g. ``math-verify==0.9.0``."""
    try:
        return f"{GRADER_NAME}=={metadata.version('math-verify')}"
    except metadata.PackageNotFoundError:
        return f"{GRADER_NAME}==unknown"


@dataclass(frozen=True)
class MathGrade:
    """Outcome of grading one completion against one gold answer."""

    status: Status
    extracted: str | None
    detail: str


# --------------------------------------------------------------------------- extraction


def _balanced_end(text: str, start: int) -> int | None:
    """Index just past the ``}`` closing the brace opened at ``text[start-1]``."""
    depth = 1
    i = start
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2  # skip escaped characters such as \{ \} and \\
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last top-level ``\\boxed{...}``/``\\fbox{...}``; None if absent/unbalanced."""
    last: str | None = None
    pos = 0
    while True:
        m = _BOX_RE.search(text, pos)
        if m is None:
            return last
        end = _balanced_end(text, m.end())
        if end is None:
            return None  # the last box never closes (e.g. a truncated generation)
        last = text[m.end() : end - 1].strip()
        pos = end


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (thousands separators removed), or None."""
    found = _NUMBER_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_answer(completion: str, fallbacks: Sequence[str] = ("boxed",)) -> tuple[str | None, str]:
    """Apply the extraction strategies in order; return (answer, strategy or reason)."""
    for name in fallbacks:
        if name not in _KNOWN_FALLBACKS:
            raise ValueError(f"unknown fallback {name!r}; known: {_KNOWN_FALLBACKS}")
        found = extract_boxed(completion) if name == "boxed" else extract_last_number(completion)
        if found:
            return found, name
    return None, f"no answer found (tried {', '.join(fallbacks) or 'nothing'})"


# --------------------------------------------------------------------------- grading


class _TimeoutSpy(logging.Handler):
    """Counts math-verify's internal timeout warnings, per thread.

    math-verify swallows its own SIGALRM timeouts and returns ``[]``/``False``, which
    would silently turn a timeout into a "fail"; this turns it into an "error".
    """

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.local = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        if "Timeout during" in record.getMessage():
            self.local.count = getattr(self.local, "count", 0) + 1

    def count(self) -> int:
        return getattr(self.local, "count", 0)


_SPY = _TimeoutSpy()
_SPY_LOCK = threading.Lock()
_SPY_INSTALLED = False


def _install_spy() -> None:
    """Attach the timeout spy to the ``math_verify`` logger once per process."""
    global _SPY_INSTALLED
    with _SPY_LOCK:
        if not _SPY_INSTALLED:
            logging.getLogger("math_verify").addHandler(_SPY)
            _SPY_INSTALLED = True


def _parse_gold(gold: str, timeout: int | None) -> list[Any]:
    """Parse a gold answer given as LaTeX (with or without ``$``) or a plain expression."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = gold.strip()
    if any(d in gold for d in _MATH_DELIMS):
        candidates = [gold]
    else:
        candidates = [f"${gold}$", gold]
    first: list[Any] = []
    for cand in candidates:
        parsed = parse(cand, extraction_config=configs, parsing_timeout=timeout)
        if any(not isinstance(p, str) for p in parsed):
            return parsed
        first = first or parsed
    return first


def _parse_pred(extracted: str, timeout: int | None) -> list[Any]:
    """Parse an extracted answer as the content of a ``\\boxed{}``."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse(f"\\boxed{{{extracted}}}", extraction_config=configs, parsing_timeout=timeout)


def grade_answer(
    completion: str,
    gold: str,
    *,
    fallbacks: Sequence[str] = ("boxed",),
    mv_timeout_s: int | None = 5,
) -> MathGrade:
    """Grade ``completion`` against ``gold``: pass/fail, or error if grading itself broke.

    Runs math-verify's own SIGALRM timeouts (``mv_timeout_s`` whole seconds per
    parse/compare) when called on a main thread; on other threads they are switched
    off, so there the caller must bound the time (``MathGrader`` does).
    """
    extracted: str | None = None
    try:
        from math_verify import verify

        _install_spy()
        on_main = threading.current_thread() is threading.main_thread()
        timeout = mv_timeout_s if on_main else None
        before = _SPY.count()

        extracted, how = extract_answer(completion, fallbacks)
        if extracted is None:
            return MathGrade("fail", None, how)
        gold_parsed = _parse_gold(gold, timeout)
        if not gold_parsed:
            return MathGrade("error", extracted, f"could not parse gold answer {gold!r}")
        pred_parsed = _parse_pred(extracted, timeout)
        if _SPY.count() != before:
            return MathGrade("error", extracted, "math-verify timeout while parsing")
        if not pred_parsed:
            return MathGrade("fail", extracted, f"unparsable answer (via {how})")
        ok = verify(gold_parsed, pred_parsed, timeout_seconds=timeout)
        if _SPY.count() != before:
            return MathGrade("error", extracted, "math-verify timeout while verifying")
        if ok:
            return MathGrade("pass", extracted, f"equivalent (via {how})")
        return MathGrade("fail", extracted, f"not equivalent to gold (via {how})")
    except BaseException as exc:  # noqa: BLE001 - incl. math-verify's TimeoutException
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        return MathGrade("error", extracted, f"{type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- process pool


def _worker_init() -> None:
    """Warm a worker: import math-verify and pay its first-call cost up front."""
    _install_spy()
    grade_answer("\\boxed{1}", "1")


def _mp_context(method: str) -> multiprocessing.context.BaseContext:
    """Multiprocessing context; forkserver preloads math-verify so workers start warm."""
    if method not in multiprocessing.get_all_start_methods():
        method = "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        from multiprocessing import forkserver

        current = list(getattr(forkserver._forkserver, "_preload_modules", []) or [])
        wanted = ["math_verify", "sympy", __name__]
        ctx.set_forkserver_preload(current + [m for m in wanted if m not in current])
    return ctx


def grade_chunk(fn: GradeFn, items: Sequence[tuple[str, str]], fallbacks: tuple[str, ...]) -> list[MathGrade]:
    """Grade several items inside one worker call (runs in the pool)."""
    return [fn(c, g, fallbacks=fallbacks) for c, g in items]


class MathGrader:
    """Grades batches of (completion, gold) in a pebble process pool with wall timeouts."""

    def __init__(self, workers: int | None = None, *, start_method: str = "forkserver") -> None:
        self.workers = workers if workers is not None else min(2, os.cpu_count() or 1)
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        self.start_method = start_method
        self._pool: pebble.ProcessPool | None = None
        self._lock = threading.Lock()
        _LIVE.add(self)

    def _get_pool(self) -> pebble.ProcessPool:
        """Create the pool on first use (thread-safe)."""
        with self._lock:
            if self._pool is None or not self._pool.active:
                self._pool = pebble.ProcessPool(
                    max_workers=self.workers,
                    initializer=_worker_init,
                    context=_mp_context(self.start_method),
                )
            return self._pool

    def grade_many(
        self,
        items: Sequence[tuple[str, str]],
        timeout_s: float = 10.0,
        *,
        fallbacks: Sequence[str] = ("boxed",),
        chunk_size: int | None = None,
        _fn: GradeFn | None = None,
    ) -> list[MathGrade]:
        """Grade (completion, gold) pairs in order; timeouts and crashes become "error".

        ``_fn`` is a test hook replacing ``grade_answer`` (must be picklable, top level).
        """
        if not items:
            return []
        fn = _fn or grade_answer
        pool = self._get_pool()
        fb = tuple(fallbacks)
        # Items go to workers in chunks (one IPC round trip per chunk, not per item); a chunk that
        # times out or crashes is re-graded item by item, so each hang still costs only its own item.
        size = chunk_size or max(1, min(32, math.ceil(len(items) / (self.workers * 4))))
        chunks = [list(items[i : i + size]) for i in range(0, len(items), size)]
        chunk_futures = [
            pool.schedule(grade_chunk, args=(fn, chunk, fb), timeout=2 * timeout_s + 0.25 * len(chunk)) for chunk in chunks
        ]
        backstop = (2 * timeout_s + 0.25 * size) * (math.ceil(len(chunks) / self.workers) + 1) + 60.0
        cf.wait(chunk_futures, timeout=backstop)
        out: list[MathGrade] = []
        for future, chunk in zip(chunk_futures, chunks):
            if future.done() and future.exception() is None:
                out.extend(future.result())
            else:
                future.cancel()
                out.extend(self._grade_each(pool, fn, chunk, fb, timeout_s))
        return out

    def _grade_each(self, pool, fn: GradeFn, items: Sequence[tuple[str, str]], fb: tuple[str, ...], timeout_s: float) -> list[MathGrade]:
        """One task per item with its own wall timeout (the fallback for a chunk that failed)."""
        futures = [pool.schedule(fn, args=(c, g), kwargs={"fallbacks": fb}, timeout=timeout_s) for c, g in items]
        backstop = timeout_s * (math.ceil(len(items) / self.workers) + 1) + 60.0
        cf.wait(futures, timeout=backstop)
        return [self._collect(f, c, fb, timeout_s) for f, (c, _) in zip(futures, items)]

    @staticmethod
    def _collect(fut: cf.Future, completion: str, fallbacks: Sequence[str], timeout_s: float) -> MathGrade:
        """Turn a finished (or stalled) future into a MathGrade."""
        if not fut.done():
            fut.cancel()
            return MathGrade("error", _safe_extract(completion, fallbacks), "grader pool stalled")
        exc = fut.exception()
        if exc is None:
            return fut.result()
        extracted = _safe_extract(completion, fallbacks)
        if isinstance(exc, cf.TimeoutError):
            return MathGrade("error", extracted, f"timeout after {timeout_s:g}s")
        if isinstance(exc, pebble.ProcessExpired):
            return MathGrade("error", extracted, f"worker crashed: {exc} (exit code {exc.exitcode})")
        return MathGrade("error", extracted, f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Shut the worker pool down; a later ``grade_many`` starts a new one."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join(timeout=10)

    def __enter__(self) -> MathGrader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _safe_extract(completion: str, fallbacks: Sequence[str]) -> str | None:
    """Extract in the parent for error records; never raises."""
    try:
        return extract_answer(completion, fallbacks)[0]
    except Exception:  # noqa: BLE001
        return None


_LIVE: "weakref.WeakSet[MathGrader]" = weakref.WeakSet()
_DEFAULT: MathGrader | None = None
_DEFAULT_LOCK = threading.Lock()


def default_grader() -> MathGrader:
    """The shared process-wide grader (created on first call)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = MathGrader()
        return _DEFAULT


@atexit.register
def _shutdown_all() -> None:
    """Stop every live pool at interpreter exit."""
    for grader in list(_LIVE):
        try:
            grader.close()
        except Exception:  # noqa: BLE001
            pass


def _measure_startup(method: str, n: int = 3) -> float:
    """Seconds from pool creation to the first graded result (for the note above)."""
    import time

    t0 = time.perf_counter()
    with MathGrader(workers=1, start_method=method) as g:
        g.grade_many([("\\boxed{2}", "2")] * n)
    return time.perf_counter() - t0


class MathVerifyGraded:
    """Task mixin: completions are graded against ``Problem.answer`` by the shared math-verify pool."""

    def grade_many(self, problems, completions):
        from opd_harness.task import Score

        grades = default_grader().grade_many([(c, p.answer) for p, c in zip(problems, completions, strict=True)])
        return [Score(g.status, g.extracted, g.detail) for g in grades]

    @property
    def grader(self) -> tuple[str, str]:
        return GRADER_NAME, grader_version()
