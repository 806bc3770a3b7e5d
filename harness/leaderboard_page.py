"""The leaderboard as one static, self-contained HTML page: tables, plots (inline SVG/PNG) and a drill-down per run.

No server and no CDN: the page opens offline. Several results roots merge into one page. Columns:

- per run x task: Avg@k ± 95% CI at the best and the last evaluated checkpoint, samples/h of the last
  checkpoint, relative throughput (÷ mean samples/h of the sync runs of the baseline method on the same
  task, with the same configuration but the method when there are such runs: the f-OPD paper's
  normalisation), collapse (final Avg@k < threshold × peak, as in ``harness report``), grader and version;
- the task-specific measurements of the last checkpoint's evaluation (``opd_harness.evaluation``'s summary beyond the
  counts every evaluation has: e.g. an agentic task's invalid tool rate, tool-error rate, tool calls and turns per
  episode), as extra columns where a task has them;
- at the end, the transcript viewer (``opd_harness.viewer``) over every stored sample.
"""

from __future__ import annotations

import base64
import html
import io
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from opd_harness.report import match_key, dotted_get, plot_lag_curve, run_curve, summarize_run, sweep_report
from opd_harness.config import LAYOUT_ROLES
from opd_harness.evaluation import GENERIC_SUMMARY_KEYS
from opd_harness.leaderboard import staleness_to
from opd_harness.store import Store
from opd_harness.viewer import EvalRef, merge_payloads, viewer_payload, viewer_section


@dataclass
class RunInfo:
    """One run of one results root, with everything its drill-down shows."""

    key: str  # unique across the merged roots (the run id, or "run id (root)" on a clash)
    anchor: str
    source: str
    run: dict
    config: dict
    method_record: dict | None
    checkpoints: list[dict]
    steps: dict[int, dict[str, float]]
    evals: list[dict]


@dataclass
class Board:
    """Everything the page shows, gathered from one or more results roots."""

    sources: list[str]
    runs: list[RunInfo]
    rows: list[dict]  # one per (run, task)
    lag_curves: list[tuple[str, dict]] = field(default_factory=list)  # (title, sweep report) with a lag curve
    reproductions: list[tuple[str, list[dict]]] = field(default_factory=list)  # (title, claims.json) of `harness reproduce`
    transcripts: dict = field(default_factory=dict)  # the transcript viewer's payload (opd_harness.viewer): every stored sample


def _mode(config: dict) -> str:
    return dotted_get(config, "trainer.mode", "-") or "-"


def _task_metrics(evaluation: dict) -> dict[str, float]:
    """The task-specific measurements of an evaluation (e.g. an agentic task's invalid tool rate): every numeric
    entry of its stored summary beyond the counts every evaluation has."""
    return {k: float(v) for k, v in evaluation.get("metrics", {}).items() if k not in GENERIC_SUMMARY_KEYS and isinstance(v, int | float)}


def _load_runs(store: Store, source: str, taken: set[str]) -> list[RunInfo]:
    out = []
    for r in store.runs():
        stored = store.get_run(r["run_id"]) or {}
        folder = store.root / "runs" / r["run_id"]
        method_file = folder / "method.json"
        key = r["run_id"] if r["run_id"] not in taken else f"{r['run_id']} ({source})"
        taken.add(key)
        out.append(
            RunInfo(
                key=key, anchor="", source=source, run=r, config=stored.get("config", {}),
                method_record=json.loads(method_file.read_text()) if method_file.is_file() else None,
                checkpoints=store.checkpoints(r["run_id"]), steps=store.step_metrics(r["run_id"]), evals=store.evals(r["run_id"]),
            )
        )  # fmt: skip
    return out


def _rows(store: Store, info: RunInfo, collapse_threshold: float) -> list[dict]:
    """One row per evaluated task of a run: best and last checkpoint, throughput, collapse, task metrics."""
    rows = []
    last_ckpt = info.checkpoints[-1] if info.checkpoints else {}
    for task in sorted({e["task"] for e in info.evals}):
        evals = sorted((e for e in info.evals if e["task"] == task), key=lambda e: e["step"])
        scored = [e for e in evals if e["avg_at_k"] is not None]
        last = evals[-1]
        best = max(scored, key=lambda e: e["avg_at_k"]) if scored else last
        summary = summarize_run(run_curve(store, info.run["run_id"], task), collapse_threshold)
        rows.append(
            {
                "run": info.key, "anchor": info.anchor, "source": info.source, "kind": info.run["kind"],
                "method": info.run.get("method") or "-", "mode": _mode(info.config) if info.run["kind"] == "train" else "-",
                "seed": info.config.get("seed") if info.run["kind"] == "train" else None,
                "model": info.run.get("model"), "task": task, "k": last["k"],
                "grader": grader_label(last["grader"], last["grader_version"]),
                "best": best, "last": last, "n_errors": last["n_errors"],
                "samples_per_hour": last_ckpt.get("samples_per_hour"), "relative_throughput": None, "throughput_baseline": None,
                "collapsed": summary["collapsed"] if summary and info.run["kind"] == "train" and len(scored) > 1 else None,
                "task_metrics": _task_metrics(last),
                "staleness": staleness_to(info.steps, last["step"]),
                "config": info.config,
            }
        )  # fmt: skip
    return rows


def _relative_throughput(rows: list[dict], baseline_method: str) -> None:
    """Fill ``relative_throughput``: samples/h ÷ mean samples/h of the sync ``baseline_method`` runs on the same task,
    those with the same configuration but the method when any (else all of them on the task)."""
    for row in rows:
        if row["kind"] != "train" or not row["samples_per_hour"]:
            continue
        pool = [
            r
            for r in rows
            if r["kind"] == "train"
            and r["method"] == baseline_method
            and r["mode"] == "sync"
            and r["task"] == row["task"]
            and r["samples_per_hour"]
        ]
        same = [r for r in pool if match_key(r["config"], drop_method=True) == match_key(row["config"], drop_method=True)]
        base = same or pool
        if base:
            row["relative_throughput"] = row["samples_per_hour"] / float(np.mean([r["samples_per_hour"] for r in base]))
            row["throughput_baseline"] = f"sync {baseline_method}" + (", same config" if same else f", {len(base)} run(s) on {row['task']}")


def _lag_curves(root: Path, store: Store, source: str) -> list[tuple[str, dict]]:
    out = []
    for record_path in sorted((root / "sweeps").glob("*.json")):
        try:
            record = json.loads(record_path.read_text())
            report = sweep_report(store, record)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a record being written, or from an older layout: the tables still show its runs
        if report["lag_curve"]:
            out.append((f"{source}: sweep {report['sweep_id']} ({report['task']})", report))
    return out


def _reproductions(root: Path, source: str) -> list[tuple[str, list[dict]]]:
    """The claims `harness reproduce` wrote under ``<root>/reproduce/<recipe>-<scale>/claims.json``."""
    out = []
    for path in sorted((root / "reproduce").glob("*/claims.json")):
        try:
            out.append((f"{source}: {path.parent.name}", json.loads(path.read_text())))
        except (OSError, ValueError):
            continue  # being written: the next page has it
    return out


def load_board(roots: list[Path], *, baseline_method: str = "opd", collapse_threshold: float = 0.5) -> Board:
    """Gather runs, rows and sweep lag curves from every results root (each must hold ``results.sqlite``)."""
    taken: set[str] = set()
    runs, rows, curves, reproductions, transcripts = [], [], [], [], []
    for root in roots:
        reproductions.extend(_reproductions(Path(root), str(root)))
        source = str(root)
        with Store(root) as store:
            infos = _load_runs(store, source, taken)
            for info in infos:
                info.anchor = f"run-{len(runs)}"
                runs.append(info)
                rows.extend(_rows(store, info, collapse_threshold))
            curves.extend(_lag_curves(Path(root), store, source))
            refs = [EvalRef(info.run["run_id"], ev["step"], ev["task"]) for info in infos for ev in info.evals]
            transcripts.append(viewer_payload(store, refs, source=source))
    _relative_throughput(rows, baseline_method)
    return Board([str(r) for r in roots], runs, rows, curves, reproductions, merge_payloads(transcripts))


# ---- plots ---------------------------------------------------------------------------------------


def _figure(width: float = 6.4, height: float = 3.6):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100)


def _svg(fig) -> str:
    """The figure as inline SVG markup (text kept as text; no XML prologue)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "opd-harness"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg") :]


def grader_label(name: str, version: str) -> str:
    """The grader column: ``math-verify==0.9.0`` once, not after its own name again; ``tool-judge 2`` otherwise."""
    return version if version.startswith(name) else f"{name} {version}"


def short_label(text: str, limit: int = 28) -> str:
    """A legend label that fits beside a plot: long ones keep their start and end around an ellipsis."""
    return text if len(text) <= limit else f"{text[: limit // 2 - 1]}…{text[-(limit - limit // 2):]}"


def _group(row: dict) -> str:
    """The legend entry of a row: runs of one method and mode share a colour (seeds are lines of that colour); an
    eval-only run is named by its model's folder (or file) name, not its long run id."""
    if row["kind"] == "train":
        return f"{row['method']} {row['mode']}"
    model = str(row.get("model") or row["run"]).rstrip("/")
    return f"eval {short_label(model.rsplit('/', 1)[-1])}"


def _colours(rows: list[dict]) -> dict[str, str]:
    return {g: f"C{i % 10}" for i, g in enumerate(dict.fromkeys(_group(r) for r in rows))}


def _legend(ax, handles_by_label: dict) -> None:
    """One legend entry per method/mode, outside the axes so that many runs never hide the curves (10 pt: readable
    where the page shows the plot at its width)."""
    ax.legend(handles_by_label.values(), handles_by_label.keys(), fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def plot_avg_vs_step(board: Board, task: str) -> str:
    """Avg@k vs checkpoint step per run on ``task``, with the 95% CI as a band; eval-only runs as dashed lines."""
    fig = _figure()
    ax = fig.subplots()
    runs = {info.key: info for info in board.runs}
    rows = [r for r in board.rows if r["task"] == task]
    colours, handles = _colours(rows), {}
    for row in rows:
        evals = sorted((e for e in runs[row["run"]].evals if e["task"] == task and e["avg_at_k"] is not None), key=lambda e: e["step"])
        if not evals:
            continue
        group, colour = _group(row), colours[_group(row)]
        steps = [e["step"] for e in evals]
        if row["kind"] != "train" or len(evals) == 1:
            handles[group] = ax.axhline(evals[-1]["avg_at_k"], linestyle="--", color=colour, alpha=0.8)
            continue
        (handles[group],) = ax.plot(steps, [e["avg_at_k"] for e in evals], marker="o", markersize=3, color=colour, linewidth=1.2)
        lo = [e["ci_low"] if e["ci_low"] is not None else e["avg_at_k"] for e in evals]
        hi = [e["ci_high"] if e["ci_high"] is not None else e["avg_at_k"] for e in evals]
        ax.fill_between(steps, lo, hi, color=colour, alpha=0.08)
    k = next((r["k"] for r in rows), None)
    ax.set(xlabel="step", ylabel=f"Avg@{k} (95% CI)", title=f"{task}: Avg@{k} vs step")
    ax.grid(alpha=0.3)
    _legend(ax, handles)
    return _svg(fig)


def plot_throughput_vs_accuracy(board: Board) -> str | None:
    """Final Avg@k (with CI) against throughput, one marker per training run and task (the f-OPD paper's Fig. 4 view);
    None under two runs, where it would be one lone point on a meaningless axis."""
    rows = [r for r in board.rows if r["kind"] == "train" and r["samples_per_hour"] and r["last"]["avg_at_k"] is not None]
    if len({r["run"] for r in rows}) < 2:
        return None
    relative = all(r["relative_throughput"] for r in rows)
    fig = _figure()
    ax = fig.subplots()
    colours, handles = _colours(rows), {}
    markers = {t: m for t, m in zip(sorted({r["task"] for r in rows}), "osD^vP*X", strict=False)}
    for row in rows:
        last = row["last"]
        x = row["relative_throughput"] if relative else row["samples_per_hour"]
        err = [[max(last["avg_at_k"] - (last["ci_low"] if last["ci_low"] is not None else last["avg_at_k"]), 0)],
               [max((last["ci_high"] if last["ci_high"] is not None else last["avg_at_k"]) - last["avg_at_k"], 0)]]  # fmt: skip
        label = _group(row) + (f" · {row['task']}" if len(markers) > 1 else "")
        handles[label] = ax.errorbar(
            [x], [last["avg_at_k"]], yerr=err, marker=markers.get(row["task"], "o"), capsize=3, color=colours[_group(row)], alpha=0.85
        )
    _legend(ax, handles)
    ax.set(
        xlabel="relative throughput (× sync baseline)" if relative else "training samples / hour",
        ylabel="final Avg@k (95% CI)",
        title="throughput vs final accuracy",
    )
    ax.grid(alpha=0.3)
    return _svg(fig)


def plot_training_curves(board: Board, names: tuple[str, ...] = ("student_entropy", "teacher_kl")) -> str | None:
    """Per-step student entropy and teacher KL of every training run that logged them (one colour per method and mode),
    each plot with its y-axis label and its own legend."""
    runs = [info for info in board.runs if info.run["kind"] == "train" and any(n in m for m in info.steps.values() for n in names)]
    if not runs:
        return None
    fig = _figure(9.6, 3.4)
    axes = np.atleast_1d(fig.subplots(1, len(names)))
    groups = {info.key: f"{info.run.get('method')} {_mode(info.config)}" for info in runs}
    colours = {g: f"C{i % 10}" for i, g in enumerate(dict.fromkeys(groups.values()))}
    for ax, name in zip(axes, names, strict=True):
        handles = {}
        for info in runs:
            points = [(step, m[name]) for step, m in sorted(info.steps.items()) if m.get(name) is not None]
            if points:
                (handles[groups[info.key]],) = ax.plot(*zip(*points), color=colours[groups[info.key]], linewidth=1.0, alpha=0.8)
        ax.set(xlabel="step", ylabel=CURVE_LABELS.get(name, name.replace("_", " ")), title=name.replace("_", " "))
        ax.grid(alpha=0.3)
        if handles:
            ax.legend(handles.values(), handles.keys(), fontsize=10, loc="best", frameon=False)
    return _svg(fig)


CURVE_LABELS = {"student_entropy": "student entropy (nats / token)", "teacher_kl": "reverse KL to teacher (nats / token)"}


def plot_staleness(hist: dict[str, int]) -> str:
    """Bar chart of a run's staleness histogram (policy lag of trained samples, cumulative to its last checkpoint)."""
    fig = _figure(3.6, 2.4)
    ax = fig.subplots()
    lags = sorted(int(k) for k in hist)
    ax.bar(lags, [hist[str(k)] for k in lags], color="C0")
    ax.set(xlabel="policy lag (versions)", ylabel="samples", title="staleness")
    ax.set_xticks(lags)
    return _svg(fig)


def lag_curve_png(report: dict, title: str) -> str:
    """The sweep's lag-sensitivity curve (``harness report``'s plot) as a PNG data URI."""
    k = next((r["k"] for r in report["rows"] if r["k"]), None)
    with tempfile.TemporaryDirectory() as tmp:
        path = plot_lag_curve(report["lag_curve"], Path(tmp) / "lag.png", title=title, k=k)
        return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


# ---- HTML ----------------------------------------------------------------------------------------

e = html.escape

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1400px;padding:1em 2em;color:#1d2330}
h1{font-size:1.5em;margin:.2em 0} h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #dde;padding-bottom:.2em}
table{border-collapse:collapse;margin:.6em 0;font-size:13px} \
th,td{padding:.3em .6em;border-bottom:1px solid #e4e6ee;text-align:left;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.sortable th{cursor:pointer;user-select:none;background:#f3f4f8;position:sticky;top:0}
table.sortable th:hover{background:#e6e8f0} th[aria-sort=ascending]::after{content:" ▲"} th[aria-sort=descending]::after{content:" ▼"}
.ci{color:#667;font-size:12px} .muted{color:#778} .bad{color:#b3261e;font-weight:600} .ok{color:#1b6e3a}
.plots{display:flex;flex-wrap:wrap;gap:1em} .plot{flex:1 1 560px;max-width:100%} .plot svg{max-width:100%;height:auto} \
.plot img{max-width:min(100%,640px);height:auto}
details{margin:.4em 0;border:1px solid #e4e6ee;border-radius:6px;padding:.3em .8em} summary{cursor:pointer;font-weight:600}
pre{background:#f6f7fa;padding:.6em;overflow:auto;max-height:24em;font-size:12px}
"""

SCRIPT = """
document.querySelectorAll("table.sortable").forEach(function (table) {
  table.querySelectorAll("th").forEach(function (th, col) {
    th.addEventListener("click", function () {
      var asc = th.getAttribute("aria-sort") !== "ascending";
      table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", asc ? "ascending" : "descending");
      var key = function (row) { var c = row.cells[col], v = c.dataset.sort !== undefined ? c.dataset.sort : c.textContent.trim();
        return v === "" || v === "-" ? null : isNaN(Number(v)) ? v : Number(v); };
      var body = table.tBodies[0];
      Array.from(body.rows).sort(function (a, b) {
        var x = key(a), y = key(b);
        if (x === null || y === null) return (x === null) - (y === null);  /* blanks last either way */
        var d = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
        return asc ? d : -d;
      }).forEach(function (row) { body.appendChild(row); });
    });
  });
});
"""


def _num(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return '<td class="num" data-sort="">-</td>'
    return f'<td class="num" data-sort="{value!r}">{value:.{digits}f}</td>'


def _avg_cell(ev: dict) -> str:
    """Avg@k with its CI and step, sortable by Avg@k."""
    if ev["avg_at_k"] is None:
        return '<td class="num" data-sort="">-</td>'
    ci = f"[{ev['ci_low']:.3f}, {ev['ci_high']:.3f}]" if ev["ci_low"] is not None and ev["ci_high"] is not None else ""
    return f'<td class="num" data-sort="{ev["avg_at_k"]!r}">{ev["avg_at_k"]:.3f} <span class="ci">{ci} @{ev["step"]}</span></td>'


def _table(headers: list[str], body: list[str], table_id: str) -> str:
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    return f'<table class="sortable" id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def main_table(board: Board) -> str:
    """The sortable runs x tasks table."""
    metric_names = sorted({name for r in board.rows for name in r["task_metrics"]})
    headers = [
        "run",
        "method",
        "mode",
        "task",
        "k",
        "best Avg@k [95% CI] @step",
        "last Avg@k [95% CI] @step",
        "samples/h",
        "rel. throughput",
        "stale newest (mean)",
        "stale worst (max)",
        "spans (max)",
        "collapsed",
        "errors",
        *metric_names,
        "grader",
    ]
    body = []
    for r in board.rows:
        collapsed = "-" if r["collapsed"] is None else ('<span class="bad">yes</span>' if r["collapsed"] else "no")
        rel_title = f' title="{e(r["throughput_baseline"])}"' if r["throughput_baseline"] else ""
        rel = _num(r["relative_throughput"], 2).replace("<td", f"<td{rel_title}", 1)
        cells = [
            f'<td><a href="#{r["anchor"]}">{e(r["run"])}</a></td>', f"<td>{e(r['method'])}</td>", f"<td>{e(r['mode'])}</td>",
            f"<td>{e(r['task'])}</td>", f'<td class="num">{r["k"]}</td>', _avg_cell(r["best"]), _avg_cell(r["last"]),
            _num(r["samples_per_hour"], 0), rel,
            _num(r["staleness"]["staleness_mean"], 1), _num(r["staleness"]["staleness_worst_max"], 0), _num(r["staleness"]["spans_max"], 0),
            f'<td data-sort="{"" if r["collapsed"] is None else int(r["collapsed"])}">{collapsed}</td>',
            f'<td class="num">{r["n_errors"]}</td>',
            *[_num(r["task_metrics"].get(name)) for name in metric_names], f"<td>{e(r['grader'])}</td>",
        ]  # fmt: skip
        body.append("<tr>" + "".join(cells) + "</tr>")
    return _table(headers, body, "board")


def summary_table(board: Board) -> str:
    """Methods x tasks: training runs grouped by method, mode and task (seeds pooled)."""
    groups: dict[tuple, list[dict]] = {}
    for r in board.rows:
        if r["kind"] == "train":
            groups.setdefault((r["method"], r["mode"], r["task"]), []).append(r)
    headers = ["method", "mode", "task", "runs", "mean last Avg@k", "mean best Avg@k", "collapse", "mean rel. throughput", "grader"]
    body = []
    for (method, mode, task), rows in sorted(groups.items()):
        last = [r["last"]["avg_at_k"] for r in rows if r["last"]["avg_at_k"] is not None]
        best = [r["best"]["avg_at_k"] for r in rows if r["best"]["avg_at_k"] is not None]
        judged = [r["collapsed"] for r in rows if r["collapsed"] is not None]
        rel = [r["relative_throughput"] for r in rows if r["relative_throughput"] is not None]
        collapse = f"{sum(judged)}/{len(judged)}" if judged else "-"
        body.append(
            f"<tr><td>{e(method)}</td><td>{e(mode)}</td><td>{e(task)}</td><td class=num>{len(rows)}</td>"
            + _num(float(np.mean(last)) if last else None) + _num(float(np.mean(best)) if best else None)
            + f'<td data-sort="{sum(judged) / len(judged) if judged else ""}">{collapse}</td>'
            + _num(float(np.mean(rel)) if rel else None, 2)
            + f"<td>{e(', '.join(sorted({r['grader'] for r in rows})))}</td></tr>"
        )  # fmt: skip
    return _table(headers, body, "methods")


STEP_COLUMNS = ("loss", "teacher_kl", "student_entropy", "lag_mean")  # per-step metrics averaged between checkpoints in a run's table


def _mean_of(window: list[dict[str, float]], name: str) -> float | None:
    values = [m[name] for m in window if m.get(name) is not None and np.isfinite(m[name])]
    return float(np.mean(values)) if values else None


def _role_nodes(role: str, placement: dict[str, str]) -> list[str]:
    """The distinct nodes the run's placement puts ``role`` on (keys ``role``, ``role.<i>``, ``learner_rank_<i>``)."""
    keys = [k for k in placement if k == role or k.startswith(f"{role}.") or k.startswith(f"{role}_rank_")]
    return sorted({placement[k] for k in keys})


def layout_rows(config: dict, placement: dict[str, str]) -> list[dict[str, str]]:
    """One row per placed role of a run's record: replicas, what each asks for, strategy and the nodes it ran on
    (from ``trainer.layout`` and the last checkpoint's ``placement``; a role without a layout shows only its nodes)."""
    layout = dotted_get(config, "trainer.layout", None) or {}
    rows = []
    for role in LAYOUT_ROLES:
        spec, nodes = layout.get(role), _role_nodes(role, placement)
        if spec is None and not nodes:
            continue
        asks = "-"
        if spec is not None:
            resources = {"CPU": spec.get("num_cpus", 0), "GPU": spec.get("num_gpus", 0), **(spec.get("resources") or {})}
            asks = ", ".join(f"{amount:g} {name}" for name, amount in resources.items() if amount) or "-"
            if spec.get("max_sandboxes"):
                asks += f"; max {spec['max_sandboxes']} sandboxes per node"
        replicas = spec.get("replicas", 1) if spec is not None else len([k for k in placement if k.split(".")[0] == role]) or 1
        rows.append({"role": role, "replicas": str(replicas), "per replica": asks,
                     "strategy": spec.get("strategy", "-") if spec is not None else "-",
                     "nodes": ", ".join(node[:12] for node in nodes) or "-"})  # fmt: skip
    return rows


def run_section(info: RunInfo) -> str:
    """The drill-down of one run: config, method record, per-checkpoint metrics, staleness, stage timings."""
    parts = [
        f'<details id="{info.anchor}"><summary>{e(info.key)} <span class="muted">{e(info.run["kind"])} · '
        f"{e(info.run.get('method') or '-')} · {e(info.run.get('task') or '')} · "
        f"{e(info.run['status'] if 'status' in info.run else '')} · {e(info.source)}</span></summary>"
    ]
    if info.method_record:
        notes = info.method_record.get("notes") or {}
        parts.append(f"<h4>method {e(str(info.method_record.get('name')))}</h4><p>{e(str(info.method_record.get('description', '')))}</p>")
        parts.append("<table><tr><th>hyper-parameter</th><th>value</th><th>note</th></tr>" + "".join(
            f"<tr><td>{e(k)}</td><td>{e(json.dumps(v))}</td><td>{e(str(notes.get(k, '')))}</td></tr>"
            for k, v in (info.method_record.get("hparams") or {}).items()) + "</table>")  # fmt: skip
        hparams = info.method_record.get("hparams") or {}
        for key, note in notes.items():
            if key not in hparams:
                parts.append(f"<p><b>{e(str(key))}</b>: {e(str(note))}</p>")
        if info.method_record.get("inputs"):
            parts.append(f'<p class="muted">inputs: {e(", ".join(map(str, info.method_record["inputs"])))}</p>')
        for warning in info.method_record.get("warnings") or []:
            parts.append(f'<p class="bad">warning: {e(str(warning))}</p>')
    tasks = sorted({ev["task"] for ev in info.evals})
    by_step: dict[int, dict] = {}
    for ev in info.evals:
        by_step.setdefault(ev["step"], {})[ev["task"]] = ev
    ckpts = {c["step"]: c for c in info.checkpoints}
    logged = [name for name in STEP_COLUMNS if any(name in m for m in info.steps.values())]
    headers = [
        "step",
        *[f"{t} Avg@k [95% CI]" for t in tasks],
        "samples seen",
        "train s",
        "samples/h",
        *logged,
        "refreshes",
        "idle rollout",
        "idle learner",
    ]
    body, previous = [], 0
    for step in sorted(set(by_step) | set(ckpts)):
        c = ckpts.get(step, {})
        m = c.get("metrics", {})
        window = [v for s, v in info.steps.items() if previous < s <= step]  # the steps since the previous row: their means
        cells = [
            f'<td class="num">{step}</td>',
            *[_avg_cell(by_step[step][t]) if t in by_step.get(step, {}) else '<td data-sort="">-</td>' for t in tasks],
        ]
        cells += [
            _num(c.get("samples_seen"), 0) if c.get("samples_seen") is not None else _num(None),
            _num(c.get("train_seconds"), 1),
            _num(c.get("samples_per_hour"), 0),
        ]
        cells += [_num(_mean_of(window, name)) for name in logged]
        cells += [_num(m.get("refreshes"), 0), _num(m.get("idle_ratio_rollout"), 2), _num(m.get("idle_ratio_learner"), 2)]
        body.append("<tr>" + "".join(cells) + "</tr>")
        previous = step
    parts.append("<h4>checkpoints</h4>" + _table(headers, body, f"{info.anchor}-checkpoints"))
    last = info.checkpoints[-1]["metrics"] if info.checkpoints else {}
    if last.get("staleness_hist"):
        parts.append(
            f"<h4>staleness (to step {info.checkpoints[-1]['step']})</h4>"
            f'<div class="plot" style="max-width:420px">{plot_staleness(last["staleness_hist"])}</div>'
        )
    timings = [
        (role, stage, seconds) for role in ("rollout_seconds", "learner_seconds") for stage, seconds in (last.get(role) or {}).items()
    ]
    if timings:
        parts.append("<h4>stage timings (cumulative seconds)</h4><table><tr><th>role</th><th>stage</th><th>seconds</th></tr>" + "".join(
            f"<tr><td>{e(role.split('_')[0])}</td><td>{e(stage)}</td>{_num(float(s), 1)}</tr>"
            for role, stage, s in timings) + "</table>")  # fmt: skip
    roles = layout_rows(info.config, last.get("placement") or {})
    if roles:
        parts.append("<h4>layout</h4><table><tr>" + "".join(f"<th>{e(h)}</th>" for h in roles[0]) + "</tr>" + "".join(
            "<tr>" + "".join(f"<td>{e(v)}</td>" for v in row.values()) + "</tr>" for row in roles) + "</table>")  # fmt: skip
    workers = last.get("rollout_workers") or []
    if len(workers) > 1:
        parts.append("<h4>rollout workers</h4><table><tr><th>worker</th><th>samples</th><th>samples/s</th><th>idle</th></tr>" + "".join(
            f"<tr><td>{i}</td>{_num(w.get('samples'), 0)}{_num(w.get('samples_per_s'), 1)}{_num(w.get('idle_ratio'), 2)}</tr>"
            for i, w in enumerate(workers)) + "</table>")  # fmt: skip
    parts.append(f"<h4>config</h4><pre>{e(json.dumps(info.config, indent=2, sort_keys=True))}</pre></details>")
    return "".join(parts)


def reproductions_section(board: Board) -> str:
    """One claims table per `harness reproduce` report: verdict, means, delta, interval, p-value, seeds, test."""
    if not board.reproductions:
        return ""
    parts = ["<h2>Paper reproductions</h2>"]
    headers = ["claim", "verdict", "candidate", "baseline", "delta", "interval", "p (holds)", "seeds", "test"]
    for i, (title, claims) in enumerate(board.reproductions):
        body = []
        for c in claims:
            interval = f"[{c['ci_low']:.3f}, {c['ci_high']:.3f}]" if c.get("ci_low") is not None and c.get("ci_high") is not None else "-"
            body.append(
                f"<tr><td>{e(c['id'])}: {e(c['text'])}</td><td><b>{e(c['verdict'])}</b></td>{_num(c.get('candidate'))}"
                f"{_num(c.get('baseline'))}{_num(c.get('delta'))}<td>{interval}</td>{_num(c.get('p_holds'))}"
                f"<td class=\"num\">{c.get('n_seeds', 0)}</td><td>{e(c.get('test') or '-')}</td></tr>"
            )
        held = sum(c["verdict"] == "holds" for c in claims)
        parts.append(f"<h3>{e(title)}</h3><p class=\"muted\">{held} of {len(claims)} claims held.</p>"
                     + _table(headers, body, f"reproduction-{i}"))  # fmt: skip
    return "".join(parts)


def render_html(board: Board) -> str:
    """The whole page as one string: inline CSS, inline SVG/PNG plots, a few lines of inline JavaScript."""
    tasks = sorted({r["task"] for r in board.rows})
    plots = [plot_avg_vs_step(board, t) for t in tasks]
    plots += [p for p in (plot_throughput_vs_accuracy(board), plot_training_curves(board)) if p]
    plots += [f'<img alt="{e(title)}" src="{lag_curve_png(report, title)}">' for title, report in board.lag_curves]
    plot_html = "".join(f'<div class="plot">{p}</div>' for p in plots) or '<p class="muted">no evaluations to plot</p>'
    sources = ", ".join(f"<code>{e(s)}</code>" for s in board.sources)
    generated = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>opd-harness leaderboard</title><style>{STYLE}</style></head><body>
<h1>opd-harness leaderboard</h1>
<p class="muted">{len(board.runs)} runs from {sources}; generated {generated}. Click a column to sort; click a run for its details.</p>
<h2>Runs × tasks</h2>
<p class="muted">Avg@k ± 95% bootstrap CI (over problems) at the best and the last evaluated checkpoint. \
Relative throughput: samples/h ÷ that of the
sync baseline method on the same task (hover for which runs). Collapsed: final Avg@k below the threshold × its peak.</p>
{main_table(board) if board.rows else '<p class="muted">no evaluations yet</p>'}
<h2>Methods × tasks</h2>
{summary_table(board)}
<h2>Plots</h2><div class="plots">{plot_html}</div>
{reproductions_section(board)}
<h2>Runs</h2>
{"".join(run_section(info) for info in board.runs)}
<h2 id="transcripts">Transcripts</h2>
<p class="muted">Every stored sample's episode (prompt, model turns, observations, outcome, grade and reason), filterable and
searchable, and any two evaluations compared on the same problems.</p>
{viewer_section(board.transcripts) if board.transcripts.get("samples") else '<p class="muted">no stored samples</p>'}
<script>{SCRIPT}</script>
</body></html>
"""


def write_html(roots: list[Path], out: Path, *, baseline_method: str = "opd", collapse_threshold: float = 0.5) -> Path:
    """Render the page for ``roots`` and write it to ``out`` atomically (a half-written page never replaces a good one)."""
    page = render_html(load_board(roots, baseline_method=baseline_method, collapse_threshold=collapse_threshold))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out

