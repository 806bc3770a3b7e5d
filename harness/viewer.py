"""The transcript viewer: every stored sample's episode (prompt, model turns, observations, outcome, grade, reason,
metrics) and the comparison of two evaluations on the same problems, as one self-contained HTML fragment or page.

The samples travel as JSON inside the page and are rendered in the browser one page of cards at a time, so ten thousand
samples stay responsive; filtering (status, task, evaluation, flips) and search run over that data. Code blocks and
patches are highlighted by the page's own few lines of JavaScript: no CDN, nothing fetched.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from opd_harness.jsonout import to_json
from opd_harness.store import Store


@dataclass(frozen=True)
class EvalRef:
    """One stored evaluation: a run's step on a task."""

    run_id: str
    step: int
    task: str

    @property
    def label(self) -> str:
        return f"{self.run_id}:{self.step} · {self.task}"


def problem_flips(problems: list[str], baseline: np.ndarray, candidate: np.ndarray) -> dict[str, list[str]]:
    """Problems whose mean score over their valid samples (rows of the gate's (problems, k) matrices, NaN = errored or
    missing) fell (``pass_to_fail``; for k = 1 a pass became a fail) or rose (``fail_to_pass``); a problem with no valid
    sample on a side is neither."""
    out: dict[str, list[str]] = {"pass_to_fail": [], "fail_to_pass": []}
    for problem, b, c in zip(problems, baseline, candidate, strict=True):
        if np.isnan(b).all() or np.isnan(c).all():
            continue
        if np.nanmean(c) != np.nanmean(b):
            out["pass_to_fail" if np.nanmean(c) < np.nanmean(b) else "fail_to_pass"].append(problem)
    return out


def eval_refs(store: Store, run_id: str, step: int | None = None, task: str | None = None) -> list[EvalRef]:
    """The evaluations of a run (at ``step`` and on ``task`` when given), in step then task order."""
    return [
        EvalRef(run_id, ev["step"], ev["task"])
        for ev in store.evals(run_id)
        if (step is None or ev["step"] == step) and (task is None or ev["task"] == task)
    ]


def _turns(completion: str, episode: dict) -> list[list[str]]:
    """The completion cut into [role, text] turns by the stored segment lengths (one model turn for rows without them)."""
    shape = episode.get("turns") or [["model", len(completion)]]
    out, start = [], 0
    for role, length in shape:
        out.append([role, completion[start : start + int(length)]])
        start += int(length)
    if start < len(completion):
        out.append(["model", completion[start:]])
    return out


def viewer_payload(store: Store, refs: list[EvalRef], *, compare: tuple[EvalRef, EvalRef] | None = None, source: str = "") -> dict:
    """The JSON the viewer renders: the evaluations, each evaluation's prompts (once per problem), every sample's turns,
    grade, reason, metrics and outcome, and the comparison to open first (indices into ``evals``) when given."""
    evals, samples, prompts = [], [], []
    summaries = {(ev["run_id"], ev["step"], ev["task"]): ev for ref in {r.run_id for r in refs} for ev in store.evals(ref)}
    for ref in dict.fromkeys([*refs, *(compare or ())]):
        summary = summaries.get((ref.run_id, ref.step, ref.task), {})
        evals.append({"run": ref.run_id, "step": ref.step, "task": ref.task, "label": ref.label, "source": source,
                      "k": summary.get("k"), "avg": summary.get("avg_at_k"), "grader": summary.get("grader")})  # fmt: skip
        prompts.append({})
        for s in store.samples(ref.run_id, ref.step, ref.task):
            episode = s.get("episode") or {}
            if "prompt" in episode:
                prompts[-1].setdefault(s["problem_id"], episode["prompt"])  # the k samples of a problem share it
            samples.append({
                "e": len(evals) - 1, "p": s["problem_id"], "i": s["sample_index"], "st": s["status"], "sc": s["score"],
                "t": _turns(s["completion"] or "", episode), "x": s["extracted"], "d": s["details"] or "", "m": s["metrics"],
                "o": episode.get("outcome") or {},
            })  # fmt: skip
    index = {(e["run"], e["step"], e["task"]): i for i, e in enumerate(evals)}
    pair = [index[(r.run_id, r.step, r.task)] for r in compare] if compare else None
    return {"evals": evals, "prompts": prompts, "samples": samples, "compare": pair}


def merge_payloads(payloads: list[dict]) -> dict:
    """One payload from several results roots' (evaluation indices shifted; labels name the root when there are several)."""
    merged: dict = {"evals": [], "prompts": [], "samples": [], "compare": None}
    for payload in payloads:
        offset = len(merged["evals"])
        for ev in payload["evals"]:
            merged["evals"].append({**ev, "label": ev["label"] + (f" ({ev['source']})" if len(payloads) > 1 else "")})
        merged["prompts"].extend(payload["prompts"])
        merged["samples"].extend({**s, "e": s["e"] + offset} for s in payload["samples"])
    return merged


def _script_json(payload: dict) -> str:
    """JSON safe inside a <script> element (no ``</script>``, no HTML comment openers)."""
    return to_json(payload, indent=None, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


ASSETS = Path(__file__).with_name("viewer_assets")
VIEWER_STYLE = (ASSETS / "viewer.css").read_text(encoding="utf-8")
VIEWER_SCRIPT = (ASSETS / "viewer.js").read_text(encoding="utf-8")



def viewer_section(payload: dict) -> str:
    """The viewer as an HTML fragment (style, container, data, script) for a page that has no other ``#viewer``."""
    return (
        f"<style>{VIEWER_STYLE}</style><div id=\"viewer\"></div>"
        f'<script type="application/json" id="viewer-data">{_script_json(payload)}</script><script>{VIEWER_SCRIPT}</script>'
    )


def render_page(payload: dict, title: str) -> str:
    """A standalone page around :func:`viewer_section`."""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title><style>
body{{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1400px;padding:1em 2em;color:#1d2330}} .muted{{color:#778}}
table{{border-collapse:collapse}} td,th{{padding:.2em .6em;border-bottom:1px solid #e4e6ee;text-align:left}}
td.num{{text-align:right}}</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="muted">{len(payload["samples"])} samples of {len(payload["evals"])} evaluation(s). Filter by grade, task or evaluation;
search any text; pick two evaluations to see the problems that flipped and click one for both transcripts side by side.</p>
{viewer_section(payload)}
</body></html>
"""


def write_page(payload: dict, out: Path, title: str) -> Path:
    """Write the standalone page atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(render_page(payload, title), encoding="utf-8")
    tmp.replace(out)
    return out


def gate_page(store: Store, report, out: Path) -> Path:
    """The page behind a ``harness gate`` verdict (a :class:`opd_harness.gate.GateReport`): both checkpoints' samples on the
    gated tasks, opened on the comparison of the first task with a pass→fail flip (else the first task)."""
    sides = [(ref.rpartition(":")[0], int(ref.rpartition(":")[2])) for ref in (report.baseline, report.candidate)]  # RUN:STEP
    tasks = [v.task for v in report.tasks]
    first = next((t for t in tasks if report.flips.get(t, {}).get("pass_to_fail")), tasks[0])
    refs = [EvalRef(run_id, step, task) for run_id, step in sides for task in tasks]
    compare = (EvalRef(*sides[0], first), EvalRef(*sides[1], first))
    title = f"harness gate {report.verdict}: {report.candidate} vs {report.baseline}"
    return write_page(viewer_payload(store, refs, compare=compare, source=str(store.root)), out, title)
