"""Paper-style tables for a sweep (the f-OPD Table 1/2 layout) and the lag-sensitivity curve.

Only runs of the sweep whose status is ``done`` enter the statistics; the ``runs`` column shows
done / total. Per run, on one evaluation task:

- **final Avg@k**: Avg@k of the last evaluated checkpoint; **peak Avg@k**: the best Avg@k over all
  evaluated checkpoints, the initial student (step 0) included; **peak−final drop** = peak − final.
- **collapse**: a run *collapsed* when ``final < collapse_threshold × peak`` (default 0.5: it lost
  more than half of its best Avg@k) and ``peak > 0``. The *collapse ratio* of a row is
  ``collapsed runs / runs`` over its seeds, printed like the paper's ``3/5``.
- **throughput**: ``samples_per_hour`` of the run's last checkpoint (training samples per hour of
  training wall time, evaluation excluded).

Per row (all grid keys but ``seed``), over seeds: final mean ± sample standard deviation (ddof=1),
mean peak, mean drop, collapse ratio, mean throughput, mean policy lag (mean over steps of
``lag_mean``; 0 for sync runs, which never record it), and **relative throughput** = mean
throughput of the row / mean throughput of the sync runs with the same configuration except
``trainer.mode``, the seed and the knobs a sync run ignores (``trainer.max_lag``, ``fixed_lag``,
``sync_every``, ``executor``). When the sweep has no such sync run (e.g. a method that only runs
async), the sync runs of ``baseline_method`` (default ``opd``) with otherwise the same
configuration are used, as the paper normalises to synchronous OPD; ``throughput_baseline`` says
which one was used.

**Lag curve**: for async runs with ``trainer.fixed_lag`` set, final Avg@k against the lag, one line
per combination of the other grid keys: the mean over seeds and a 95% percentile bootstrap CI over
seeds (``opd_harness.metrics.bootstrap_ci``; with one seed the CI is the point). The mean of matching
sync runs, when the sweep has them, is drawn as a dashed reference line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from opd_harness.jsonout import to_json
from opd_harness.metrics import bootstrap_ci
from opd_harness.store import Store

ASYNC_ONLY = ("max_lag", "fixed_lag", "sync_every", "executor")


def dotted_get(config: dict, key: str, default: Any = None) -> Any:
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


def match_key(config: dict, *, drop_method: bool = False) -> str:
    """Canonical config minus what a throughput baseline may differ in."""
    cfg = json.loads(json.dumps(config))
    cfg.pop("seed", None)
    trainer = cfg.get("trainer", {})
    trainer.pop("mode", None)
    for key in ASYNC_ONLY:
        trainer.pop(key, None)
    if drop_method:
        cfg.pop("method", None)
        cfg.pop("method_args", None)
    return json.dumps(cfg, sort_keys=True)


def run_curve(store: Store, run_id: str, task: str) -> list[tuple[int, float, int]]:
    """(step, Avg@k, k) of every evaluated checkpoint of ``run_id`` on ``task``, by step."""
    return [(e["step"], e["avg_at_k"], e["k"]) for e in store.evals(run_id) if e["task"] == task and e["avg_at_k"] is not None]


def summarize_run(curve: list[tuple], collapse_threshold: float = 0.5) -> dict | None:
    """initial / peak / final Avg@k, the drop and the collapse verdict of one run's eval curve.

    ``curve``: ``(step, avg_at_k)`` or ``(step, avg_at_k, k)`` tuples, in any order.
    """
    if not curve:
        return None
    ordered = sorted(curve, key=lambda c: c[0])
    steps, values = [c[0] for c in ordered], [c[1] for c in ordered]
    peak, final = max(values), values[-1]
    return {
        "initial": values[0] if steps[0] == 0 else None,
        "peak": peak,
        "peak_step": steps[values.index(peak)],
        "final": final,
        "final_step": steps[-1],
        "drop": peak - final,
        "collapsed": bool(peak > 0 and final < collapse_threshold * peak),
        "k": ordered[-1][2] if len(ordered[-1]) > 2 else None,
    }


def _mean(xs: list[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def _std(xs: list[float]) -> float | None:
    return float(np.std(xs, ddof=1)) if len(xs) > 1 else None


def _sweep_runs(store: Store, record: dict, task: str | None, collapse_threshold: float) -> tuple[list[dict], str | None]:
    """Every run of the sweep with its config, grid coordinates and per-run summary."""
    keys = record.get("grid_keys") or sorted({k for p in record["points"] for k in p.get("coords", {})})
    runs = []
    for point in record["points"]:
        run_id = point.get("run_id")
        stored = store.get_run(run_id) if run_id else None
        if stored is None:
            coords = {k: point.get("coords", {}).get(k) for k in keys}  # every grid key, as for a stored run: one row per setting
            runs.append({"run_id": run_id, "status": "pending", "config": None, "coords": coords})
            continue
        cfg = stored["config"]
        if task is None:
            task = cfg["task"] if cfg["task"] in cfg["eval"]["tasks"] else cfg["eval"]["tasks"][0]
        coords = {k: dotted_get(cfg, k, point.get("coords", {}).get(k)) for k in keys}
        checkpoints = store.checkpoints(run_id)
        lags = [m["lag_mean"] for m in store.step_metrics(run_id).values() if "lag_mean" in m]
        mode = dotted_get(cfg, "trainer.mode")
        runs.append(
            {
                "run_id": run_id,
                "status": stored["status"],
                "config": cfg,
                "coords": coords,
                "mode": mode,
                "samples_per_hour": checkpoints[-1]["samples_per_hour"] if checkpoints else None,
                "lag_mean": float(np.mean(lags)) if lags else (0.0 if mode == "sync" else None),
            }
        )
    for r in runs:
        r["summary"] = summarize_run(run_curve(store, r["run_id"], task), collapse_threshold) if r["config"] is not None and task else None
    return runs, task


def _row_key(coords: dict, drop: tuple[str, ...] = ("seed",)) -> tuple:
    return tuple((k, json.dumps(v, sort_keys=True)) for k, v in coords.items() if k not in drop)


def sweep_report(
    store: Store, record: dict, *, task: str | None = None, collapse_threshold: float = 0.5, baseline_method: str = "opd"
) -> dict:
    """The table rows and the lag curve of a sweep (``record``: the ``sweeps/<id>.json`` content)."""
    runs, task = _sweep_runs(store, record, task, collapse_threshold)
    keys = [k for k in (record.get("grid_keys") or []) if k != "seed"]
    done = [r for r in runs if r["status"] == "done" and r["summary"] is not None]
    sync_done = [r for r in done if r["mode"] == "sync" and r["samples_per_hour"] is not None]

    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault(_row_key(r["coords"]), []).append(r)
    rows = []
    for key, members in groups.items():
        ok = [r for r in members if r in done]
        summaries = [r["summary"] for r in ok]
        finals = [s["final"] for s in summaries]
        tps = [r["samples_per_hour"] for r in ok if r["samples_per_hour"] is not None]
        lags = [r["lag_mean"] for r in ok if r["lag_mean"] is not None]
        rel, baseline = None, None
        if ok and tps:
            same = match_key(ok[0]["config"])
            base = [r["samples_per_hour"] for r in sync_done if match_key(r["config"]) == same]
            baseline = "same config, sync"
            if not base:
                loose = match_key(ok[0]["config"], drop_method=True)
                base = [
                    r["samples_per_hour"]
                    for r in sync_done
                    if r["config"]["method"] == baseline_method and match_key(r["config"], drop_method=True) == loose
                ]
                baseline = f"sync {baseline_method}"
            if base and np.mean(base) > 0:
                rel = float(np.mean(tps) / np.mean(base))
            else:
                baseline = None
        rows.append(
            {
                **{k: v for k, v in members[0]["coords"].items() if k != "seed"},
                "task": task,
                "k": summaries[0]["k"] if summaries else None,
                "n_runs": len(members),
                "n_done": len(ok),
                "seeds": [dotted_get(r["config"], "seed") for r in ok],
                "run_ids": [r["run_id"] for r in ok],
                "final_mean": _mean(finals),
                "final_std": _std(finals),
                "peak_mean": _mean([s["peak"] for s in summaries]),
                "drop_mean": _mean([s["drop"] for s in summaries]),
                "initial_mean": _mean([s["initial"] for s in summaries if s["initial"] is not None]),
                "n_collapsed": sum(s["collapsed"] for s in summaries),
                "collapse_ratio": (sum(s["collapsed"] for s in summaries) / len(summaries)) if summaries else None,
                "samples_per_hour": _mean(tps),
                "relative_throughput": rel,
                "throughput_baseline": baseline,
                "lag_mean": _mean(lags),
            }
        )
    return {
        "sweep_id": record.get("sweep_id"),
        "task": task,
        "grid_keys": keys,
        "collapse_threshold": collapse_threshold,
        "collapse_criterion": f"final Avg@k < {collapse_threshold:g} x peak Avg@k (peak over all evaluated checkpoints, step 0 included)",
        "baseline_method": baseline_method,
        "rows": rows,
        "lag_curve": lag_curve(done, keys),
    }


def lag_curve(done_runs: list[dict], keys: list[str], n_resamples: int = 10_000) -> list[dict]:
    """One line per combination of the grid keys other than seed, mode and the async knobs."""
    drop = ("seed", "trainer.mode", *(f"trainer.{k}" for k in ASYNC_ONLY))
    lines: dict[tuple, dict] = {}
    for r in done_runs:
        if r["mode"] != "async":
            continue
        lag = dotted_get(r["config"], "trainer.fixed_lag")
        if lag is None:
            continue
        key = _row_key(r["coords"], drop)
        line = lines.setdefault(key, {"line": {k: json.loads(v) for k, v in key}, "finals": {}, "match": match_key(r["config"])})
        line["finals"].setdefault(int(lag), []).append(r["summary"]["final"])
    out = []
    for line in lines.values():
        sync = [r["summary"]["final"] for r in done_runs if r["mode"] == "sync" and match_key(r["config"]) == line["match"]]
        points = []
        for lag in sorted(line["finals"]):
            finals = line["finals"][lag]
            lo, hi = bootstrap_ci(finals, n_resamples=n_resamples, seed=0)
            points.append(
                {"fixed_lag": lag, "n": len(finals), "final_mean": float(np.mean(finals)), "ci_low": lo, "ci_high": hi, "finals": finals}
            )
        out.append({"line": line["line"], "points": points, "sync_final_mean": _mean(sync)})
    return out


def plot_lag_curve(curve: list[dict], path: str | Path, *, title: str = "lag sensitivity", k: int | None = None) -> Path:
    """Final Avg@k (mean, 95% bootstrap CI over seeds) vs trainer.fixed_lag, as a PNG (Agg backend)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        raise RuntimeError("the lag curve needs matplotlib: pip install matplotlib") from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(6, 4), dpi=120)
    ax = fig.subplots()
    for i, line in enumerate(curve):
        color = f"C{i % 10}"
        label = ", ".join(f"{k}={v}" for k, v in line["line"].items()) or "async"
        xs = [p["fixed_lag"] for p in line["points"]]
        ys = [p["final_mean"] for p in line["points"]]
        err = np.array([[y - p["ci_low"] for y, p in zip(ys, line["points"])], [p["ci_high"] - y for y, p in zip(ys, line["points"])]])
        ax.errorbar(xs, ys, yerr=np.clip(err, 0, None), marker="o", capsize=3, color=color, label=label)
        if line["sync_final_mean"] is not None:
            ax.axhline(line["sync_final_mean"], linestyle="--", color=color, alpha=0.6, label=f"{label} (sync)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("policy lag (trainer.fixed_lag)")
    ax.set_ylabel(f"final Avg@{k}" if k else "final Avg@k")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if curve:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _f(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_markdown(report: dict) -> str:
    keys = report["grid_keys"]
    k = next((r["k"] for r in report["rows"] if r["k"]), None)
    avg = f"Avg@{k}" if k else "Avg@k"
    headers = [
        *keys,
        "runs",
        f"final {avg} (mean ± std)",
        f"peak {avg}",
        "peak−final drop",
        "collapse",
        "rel. throughput",
        "samples/h",
        "mean lag",
    ]
    lines = [f"### sweep {report['sweep_id']}: {report['task']}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in report["rows"]:
        final = "-" if r["final_mean"] is None else _f(r["final_mean"]) + (f" ± {_f(r['final_std'])}" if r["final_std"] is not None else "")
        collapse = f"{r['n_collapsed']}/{r['n_done']}" if r["n_done"] else "-"
        rel = (
            "-"
            if r["relative_throughput"] is None
            else f"{r['relative_throughput']:.2f}×"
            + ("" if r["throughput_baseline"] == "same config, sync" else f" (vs {r['throughput_baseline']})")
        )
        cells = ["-" if r.get(key) is None else r[key] if isinstance(r[key], str) else json.dumps(r[key]) for key in keys]
        cells += [
            f"{r['n_done']}/{r['n_runs']}",
            final,
            _f(r["peak_mean"]),
            _f(r["drop_mean"]),
            collapse,
            rel,
            _f(r["samples_per_hour"], 0),
            _f(r["lag_mean"], 2),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Collapse: {report['collapse_criterion']}. Relative throughput: mean samples/h over seeds ÷ that of the matching sync runs.",
    ]
    if report["lag_curve"]:
        lines += ["", f"#### lag sensitivity: final {avg} vs trainer.fixed_lag (mean [95% bootstrap CI over seeds])", ""]
        for line in report["lag_curve"]:
            label = ", ".join(f"{k}={v}" for k, v in line["line"].items()) or "async"
            pts = "; ".join(
                f"lag {p['fixed_lag']}: {_f(p['final_mean'])} [{_f(p['ci_low'])}, {_f(p['ci_high'])}] (n={p['n']})" for p in line["points"]
            )
            sync = f"; sync {_f(line['sync_final_mean'])}" if line["sync_final_mean"] is not None else ""
            lines.append(f"- {label}: {pts}{sync}")
    if report.get("lag_curve_png"):
        lines += ["", f"Plot: {report['lag_curve_png']}"]
    return "\n".join(lines) + "\n"


def render_json(report: dict) -> str:
    return to_json(report)


def write_report(
    out: str | Path, sweep_id: str, *, task: str | None = None, collapse_threshold: float = 0.5, baseline_method: str = "opd"
) -> dict:
    """Build the report of sweep ``sweep_id`` in ``out`` and write ``table.md``, ``table.json`` and
    (when the sweep has fixed-lag runs) ``lag_curve.png`` under ``<out>/sweeps/<sweep_id>/``."""
    from opd_harness.sweep import load_sweep_record

    out = Path(out)
    record = load_sweep_record(out, sweep_id)
    with Store(out) as store:
        report = sweep_report(store, record, task=task, collapse_threshold=collapse_threshold, baseline_method=baseline_method)
    folder = out / "sweeps" / sweep_id
    folder.mkdir(parents=True, exist_ok=True)
    report["lag_curve_png"] = None
    if report["lag_curve"]:
        k = next((r["k"] for r in report["rows"] if r["k"]), None)
        report["lag_curve_png"] = str(
            plot_lag_curve(report["lag_curve"], folder / "lag_curve.png", title=f"{sweep_id}: {report['task']}", k=k)
        )
    (folder / "table.md").write_text(render_markdown(report))
    (folder / "table.json").write_text(render_json(report))
    return report
