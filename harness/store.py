"""Results store: one SQLite file (WAL mode) per results root plus an artifact folder per run.

Every write is an idempotent upsert keyed by its natural key, inside a transaction, so a run
killed at any point and resumed from its last checkpoint neither loses nor duplicates rows.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, kind TEXT NOT NULL, method TEXT, task TEXT, model TEXT,
    status TEXT NOT NULL, config_json TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL, step INTEGER NOT NULL, path TEXT, created_at REAL NOT NULL,
    samples_seen INTEGER, train_seconds REAL, samples_per_hour REAL, metrics_json TEXT,
    PRIMARY KEY (run_id, step)
);
CREATE TABLE IF NOT EXISTS step_metrics (
    run_id TEXT NOT NULL, step INTEGER NOT NULL, name TEXT NOT NULL, value REAL,
    PRIMARY KEY (run_id, step, name)
);
CREATE TABLE IF NOT EXISTS evals (
    run_id TEXT NOT NULL, step INTEGER NOT NULL, task TEXT NOT NULL, k INTEGER NOT NULL,
    n INTEGER NOT NULL, n_problems INTEGER NOT NULL, avg_at_k REAL, ci_low REAL, ci_high REAL,
    pass_at_k REAL, n_errors INTEGER NOT NULL, grader TEXT NOT NULL, grader_version TEXT NOT NULL,
    created_at REAL NOT NULL, metrics_json TEXT, PRIMARY KEY (run_id, step, task)
);
CREATE TABLE IF NOT EXISTS samples (
    run_id TEXT NOT NULL, step INTEGER NOT NULL, task TEXT NOT NULL, problem_id TEXT NOT NULL,
    sample_index INTEGER NOT NULL, completion TEXT, extracted TEXT, score REAL,
    status TEXT NOT NULL CHECK (status IN ('pass', 'fail', 'error')), latency_s REAL, details TEXT, metrics_json TEXT,
    episode_json TEXT, PRIMARY KEY (run_id, step, task, problem_id, sample_index)
);
"""
ADDED_COLUMNS = (
    ("evals", "metrics_json", "TEXT"), ("samples", "metrics_json", "TEXT"), ("samples", "episode_json", "TEXT"),
    ("runs", "protocol", "TEXT"),  # the evaluation protocol of an eval run (harness eval --protocol); NULL: none named
    ("runs", "warmup_json", "TEXT"),  # a train run's warm-up records by role (opd_harness.trainers.warmup.warmup_record); NULL: none
)  # columns newer than the first schema (an older store gains them, NULL in its rows, when it is opened)
TABLES = ("runs", "checkpoints", "step_metrics", "evals", "samples")  # every table keyed by run_id, the run's own row first
EVAL_COLUMNS = ("k", "n_samples", "n_problems", "avg_at_k", "ci_low", "ci_high", "pass_at_k", "n_errors")  # summary keys with columns


def encode_metric(value: float) -> float | str:
    """A metric value for SQLite: finite floats as REAL, NaN/±inf as the text 'nan'/'inf'/'-inf'
    (SQLite would silently store NaN as NULL, and a lost NaN loss reads like a missing one)."""
    value = float(value)
    return value if math.isfinite(value) else str(value)


def decode_metric(value: float | str | None) -> float | None:
    """Inverse of :func:`encode_metric`: the text forms of non-finite values read back as floats."""
    return float(value) if isinstance(value, str) else value


@dataclass(frozen=True)
class SampleRow:
    """One graded sample of an evaluation."""

    problem_id: str
    sample_index: int
    completion: str
    extracted: str | None
    score: float
    status: str
    latency_s: float
    details: str = ""
    metrics: dict = field(default_factory=dict)  # episode counters, grader metrics and timings
    episode: dict = field(default_factory=dict)  # the episode's shape for the viewer: prompt, turns, outcome (episode_record)


def with_metrics(row: sqlite3.Row) -> dict:
    """A row as a dict, its ``metrics_json`` (and ``episode_json``) column decoded into ``metrics`` (``episode``; Python's
    JSON keeps NaN and inf)."""
    out = dict(row)
    out["metrics"] = json.loads(out.pop("metrics_json", None) or "{}")
    if "episode_json" in out:
        out["episode"] = json.loads(out.pop("episode_json") or "{}")
    return out


class Store:
    """Typed access to ``<root>/results.sqlite`` and the run artifact folders under ``<root>/runs``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / "results.sqlite"
        self._conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(SCHEMA)
        self._add_missing_columns()
        self._observers: dict[str, object] = {}  # run id -> its trackers (opd_harness.tracking.Trackers)

    def observe(self, run_id: str, observer: object | None) -> None:
        """After each committed step or evaluation of ``run_id``, call ``observer.log_step(step, metrics)`` or
        ``observer.log_eval(step, task, summary)`` (the run's trackers); None stops it."""
        if observer is None:
            self._observers.pop(run_id, None)
        else:
            self._observers[run_id] = observer

    def _add_missing_columns(self) -> None:
        """Bring a results file written by an older version up to the current schema (columns are only ever added)."""
        for table, column, kind in ADDED_COLUMNS:
            if column not in self.columns(table):
                self._conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def _tx(self):
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def run_dir(self, run_id: str) -> Path:
        """Artifact folder of a run (checkpoints, per-sample JSONL, plots)."""
        path = self.root / "runs" / run_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    # runs ---------------------------------------------------------------------------------
    def create_run(
        self, run_id: str, *, kind: str, config: dict, method: str | None = None, task: str | None = None, model: str | None = None,
        protocol: str | None = None,
    ) -> None:
        """A new run row, status running; ``protocol``: the evaluation protocol an eval run follows (None: none named)."""
        now = time.time()
        with self._tx() as c:
            c.execute(
                "INSERT INTO runs (run_id, kind, method, task, model, status, config_json, created_at, updated_at, protocol)"
                " VALUES (?,?,?,?,?,?,?,?,?,?)",
                (run_id, kind, method, task, model, "running", json.dumps(config, sort_keys=True), now, now, protocol),
            )

    def set_status(self, run_id: str, status: str) -> None:
        with self._tx() as c:
            c.execute("UPDATE runs SET status=?, updated_at=? WHERE run_id=?", (status, time.time(), run_id))

    def get_run(self, run_id: str) -> dict | None:
        row = self._conn.execute("SELECT * FROM runs WHERE run_id=?", (run_id,)).fetchone()
        if row is None:
            return None
        out = dict(row)
        out["config"] = json.loads(out.pop("config_json"))
        out["warmup"] = json.loads(out.pop("warmup_json") or "{}")
        return out

    def set_warmup(self, run_id: str, records: dict[str, dict]) -> None:
        """Record what the warm-ups of a run's models did and reached, by role (``teacher``, ``student``)."""
        with self._tx() as c:
            c.execute(
                "UPDATE runs SET warmup_json=?, updated_at=? WHERE run_id=?", (json.dumps(records, sort_keys=True), time.time(), run_id)
            )

    def runs(self) -> list[dict]:
        return [
            dict(r)
            for r in self._conn.execute(
                "SELECT run_id, kind, method, task, model, status, created_at, protocol FROM runs ORDER BY created_at"
            )
        ]

    # step metrics -------------------------------------------------------------------------
    def log_step(self, run_id: str, step: int, metrics: dict[str, float]) -> None:
        with self._tx() as c:
            c.executemany(
                "INSERT OR REPLACE INTO step_metrics VALUES (?,?,?,?)",
                [(run_id, step, name, encode_metric(value)) for name, value in metrics.items()],
            )
        if (observer := self._observers.get(run_id)) is not None:
            observer.log_step(step, metrics)

    def delete_steps_after(self, run_id: str, step: int) -> None:
        """Drop step rows past a resume point; they are recomputed identically from the checkpoint."""
        with self._tx() as c:
            c.execute("DELETE FROM step_metrics WHERE run_id=? AND step>?", (run_id, step))

    def step_metrics(self, run_id: str) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for row in self._conn.execute("SELECT step, name, value FROM step_metrics WHERE run_id=? ORDER BY step", (run_id,)):
            out.setdefault(row["step"], {})[row["name"]] = decode_metric(row["value"])
        return out

    # checkpoints --------------------------------------------------------------------------
    def add_checkpoint(
        self, run_id: str, step: int, *, path: str | None, samples_seen: int, train_seconds: float, metrics: dict | None = None
    ) -> None:
        per_hour = samples_seen / train_seconds * 3600.0 if train_seconds > 0 else None
        with self._tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO checkpoints VALUES (?,?,?,?,?,?,?,?)",
                (run_id, step, path, time.time(), samples_seen, train_seconds, per_hour, json.dumps(metrics or {})),
            )

    def checkpoints(self, run_id: str) -> list[dict]:
        rows = self._conn.execute("SELECT * FROM checkpoints WHERE run_id=? ORDER BY step", (run_id,))
        return [{**dict(r), "metrics": json.loads(r["metrics_json"] or "{}")} for r in rows]

    # evaluations --------------------------------------------------------------------------
    def add_eval(
        self, run_id: str, step: int, task: str, summary: dict, samples: Iterable[SampleRow], *, grader: str, grader_version: str
    ) -> None:
        """Write an evaluation summary and its samples in one transaction (all or nothing)."""
        with self._tx() as c:
            c.execute("DELETE FROM samples WHERE run_id=? AND step=? AND task=?", (run_id, step, task))
            c.executemany(
                "INSERT INTO samples (run_id, step, task, problem_id, sample_index, completion, extracted, score, status, latency_s,"
                " details, metrics_json, episode_json) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                [
                    (run_id, step, task, s.problem_id, s.sample_index, s.completion, s.extracted, s.score, s.status, s.latency_s, s.details,
                     json.dumps(s.metrics) if s.metrics else None, json.dumps(s.episode, default=str) if s.episode else None)
                    for s in samples
                ],
            )  # fmt: skip
            extra = {k: v for k, v in summary.items() if k not in EVAL_COLUMNS and isinstance(v, int | float)}
            c.execute(
                "INSERT OR REPLACE INTO evals (run_id, step, task, k, n, n_problems, avg_at_k, ci_low, ci_high, pass_at_k, n_errors,"
                " grader, grader_version, created_at, metrics_json) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    run_id, step, task, summary["k"], summary["n_samples"], summary["n_problems"], summary["avg_at_k"],
                    summary["ci_low"], summary["ci_high"], summary.get("pass_at_k"), summary.get("n_errors", 0),
                    grader, grader_version, time.time(), json.dumps(extra) if extra else None,
                ),
            )  # fmt: skip
        if (observer := self._observers.get(run_id)) is not None:
            observer.log_eval(step, task, summary)

    def evals(self, run_id: str | None = None) -> list[dict]:
        """Evaluation rows; ``metrics`` holds the summary's extra measurements (agentic rates, n_pass, ...)."""
        query = "SELECT * FROM evals" + (" WHERE run_id=?" if run_id else "") + " ORDER BY run_id, step, task"
        return [with_metrics(r) for r in self._conn.execute(query, (run_id,) if run_id else ())]

    def has_eval(self, run_id: str, step: int, task: str) -> bool:
        return self._conn.execute("SELECT 1 FROM evals WHERE run_id=? AND step=? AND task=?", (run_id, step, task)).fetchone() is not None

    def samples(self, run_id: str, step: int, task: str) -> list[dict]:
        rows = self._conn.execute(
            "SELECT * FROM samples WHERE run_id=? AND step=? AND task=? ORDER BY problem_id, sample_index", (run_id, step, task)
        )
        return [with_metrics(r) for r in rows]

    # whole runs (harness export / import) ----------------------------------------------------
    def columns(self, table: str) -> list[str]:
        """The columns ``table`` has in this store (the current schema: older files gain columns when opened)."""
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}")
        return [r["name"] for r in self._conn.execute(f"PRAGMA table_info({table})")]

    def run_rows(self, run_id: str) -> dict[str, list[dict]]:
        """Every row of ``run_id`` by table, each as stored (JSON columns as their text, non-finite metrics as 'nan'/'inf')."""
        return {t: [dict(r) for r in self._conn.execute(f"SELECT * FROM {t} WHERE run_id=?", (run_id,))] for t in TABLES}

    def unknown_column(self, table: str, rows: Iterable[dict]) -> str | None:
        """``table.column`` for the first column of ``rows`` this store's ``table`` does not have (None: all known)."""
        known = set(self.columns(table))
        return next((f"{table}.{sorted(set(row) - known)[0]}" for row in rows if set(row) - known), None)

    def put_rows(self, rows: dict[str, list[dict]]) -> None:
        """Write rows as :meth:`run_rows` returns them, in one transaction: a row whose key is already here replaces it, so
        writing the same rows twice changes nothing. A column this store does not have is a ValueError (nothing written)."""
        for table in TABLES:
            if unknown := self.unknown_column(table, rows.get(table, ())):
                raise ValueError(f"{unknown}: this store has no such column")
        with self._tx() as c:
            for table in TABLES:
                for row in rows.get(table, ()):
                    names = ", ".join(row)
                    c.execute(f"INSERT OR REPLACE INTO {table} ({names}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))

    def count(self, table: str, run_id: str) -> int:
        if table not in TABLES[1:]:
            raise ValueError(f"unknown table {table!r}")
        return self._conn.execute(f"SELECT COUNT(*) FROM {table} WHERE run_id=?", (run_id,)).fetchone()[0]
