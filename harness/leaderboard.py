"""Leaderboard: runs × checkpoints × tasks with Avg@k ± CI and throughput, from the results store."""

from __future__ import annotations

import csv
import io

import numpy as np
from rich.table import Table

from opd_harness.jsonout import to_json
from opd_harness.metrics import PairedResult, paired_bootstrap
from opd_harness.store import Store

COLUMNS = (
    "run_id",
    "kind",
    "method",
    "step",
    "task",
    "k",
    "avg_at_k",
    "ci_low",
    "ci_high",
    "n_problems",
    "n_errors",
    "samples_per_hour",
    "staleness_mean",
    "staleness_worst_max",
    "spans_max",
    "grader",
    "protocol",
)


def leaderboard_rows(store: Store, run_ids: list[str] | None = None) -> list[dict]:
    """One row per (run, checkpoint step, task) evaluation, with the checkpoint's throughput."""
    runs = {r["run_id"]: r for r in store.runs()}
    throughput = {(c["run_id"], c["step"]): c["samples_per_hour"] for rid in runs for c in store.checkpoints(rid)}
    steps: dict[str, dict[int, dict[str, float]]] = {}
    rows = []
    for e in store.evals():
        if run_ids and e["run_id"] not in run_ids and e["run_id"].split(".")[0] not in run_ids:
            continue
        run = runs.get(e["run_id"], {})
        if e["run_id"] not in steps:
            steps[e["run_id"]] = store.step_metrics(e["run_id"]) if run.get("kind") == "train" else {}
        stale = staleness_to(steps[e["run_id"]], e["step"])
        rows.append(
            {
                "run_id": e["run_id"],
                "kind": run.get("kind"),
                "method": run.get("method") or "-",
                "step": e["step"],
                "task": e["task"],
                "k": e["k"],
                "avg_at_k": e["avg_at_k"],
                "ci_low": e["ci_low"],
                "ci_high": e["ci_high"],
                "n_problems": e["n_problems"],
                "n_errors": e["n_errors"],
                "samples_per_hour": throughput.get((e["run_id"], e["step"])),
                **stale,
                "grader": f"{e['grader']} {e['grader_version']}",
                "protocol": run.get("protocol"),  # the eval run's --protocol; None: none named (and every training run)
                "created_at": run.get("created_at", 0.0),
            }
        )
    rows.sort(key=lambda r: (r["created_at"], r["run_id"], r["task"], r["step"]))
    for r in rows:
        r.pop("created_at")
    return rows


STALE = "trajectory_"  # the learner's per-trajectory off-policy metrics (opd_harness.trainers.pipeline.staleness_metrics)


def staleness_to(step_metrics: dict[int, dict[str, float]], step: int) -> dict[str, float | None]:
    """A training run's off-policy accounting over its steps up to ``step``: mean over steps of the mean newest-version
    staleness, the worst staleness of any trajectory, and the most policy versions one trajectory spans (None: not logged)."""
    logged = [m for s, m in step_metrics.items() if s <= step and f"{STALE}staleness_mean" in m]
    if not logged:
        return {"staleness_mean": None, "staleness_worst_max": None, "spans_max": None}
    return {
        "staleness_mean": float(np.mean([m[f"{STALE}staleness_mean"] for m in logged])),
        "staleness_worst_max": float(max(m[f"{STALE}staleness_worst_max"] for m in logged)),
        "spans_max": float(max(m[f"{STALE}spans_max"] for m in logged)),
    }


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _display(row: dict) -> list[str]:
    return [
        row["run_id"],
        row["method"],
        str(row["step"]),
        row["task"],
        f"{_fmt(row['avg_at_k'])} [{_fmt(row['ci_low'])}, {_fmt(row['ci_high'])}]",
        str(row["k"]),
        str(row["n_problems"]),
        _fmt(row["samples_per_hour"], 0),
        _staleness_cell(row),
        _fmt(row.get("spans_max"), 0),
        row.get("protocol") or "-",
    ]


def _staleness_cell(row: dict) -> str:
    """'newest mean / worst max' versions, or '-' for a run that logged none (an evaluation, or a run before the metric)."""
    if row.get("staleness_mean") is None:
        return "-"
    return f"{_fmt(row['staleness_mean'], 1)} / {_fmt(row['staleness_worst_max'], 0)}"


HEADERS = ("run", "method", "step", "task", "Avg@k [95% CI]", "k", "problems", "samples/h", "stale newest/worst", "spans", "protocol")


def render_table(rows: list[dict]) -> Table:
    table = Table(title="opd-harness leaderboard")
    for h in HEADERS:
        table.add_column(h, justify="right" if h in ("step", "k", "problems", "samples/h", "spans") else "left")
    for row in rows:
        table.add_row(*_display(row))
    return table


def render_markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(_display(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def render_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def render_json(rows: list[dict]) -> str:
    return to_json(rows)


def sample_scores(store: Store, run_id: str, step: int, task: str, k: int) -> dict[str, np.ndarray]:
    """Each problem's scores of samples 0..k-1 of one evaluation; NaN where a sample errored or is missing.

    The one reader of per-problem samples for paired comparisons (``paired_comparison`` and ``harness gate``).
    """
    out: dict[str, np.ndarray] = {}
    for s in store.samples(run_id, step, task):
        row = out.setdefault(s["problem_id"], np.full(k, np.nan))
        if s["sample_index"] < k and s["status"] != "error" and s["score"] is not None:
            row[s["sample_index"]] = float(s["score"])
    return out


def per_problem_values(store: Store, run_id: str, step: int, task: str, k: int) -> dict[str, float]:
    """Mean score of each problem's valid samples among its first k; problems with none are left out."""
    return {pid: float(np.nanmean(row)) for pid, row in sample_scores(store, run_id, step, task, k).items() if not np.isnan(row).all()}


def paired_comparison(
    store: Store, task: str, k: int, baseline: tuple[str, int], candidate: tuple[str, int], seed: int = 0
) -> PairedResult:
    """Paired bootstrap (10,000 resamples) of candidate − baseline Avg@k over shared problems."""
    a = per_problem_values(store, *baseline, task, k)
    b = per_problem_values(store, *candidate, task, k)
    shared = sorted(set(a) & set(b))
    if not shared:
        raise ValueError(f"no problems of {task!r} were graded in both {baseline} and {candidate}")
    return paired_bootstrap([a[p] for p in shared], [b[p] for p in shared], seed=seed)
