"""Evaluation: rollout with eval sampling, grade, summarise (Avg@k with CI, pass@k), store."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from harness.backends import Backend, SamplingParams
from harness.metrics import bootstrap_ci, pass_at_k
from harness.rollout import rollout
from harness.store import SampleRow, Store
from harness.trajectory import Trajectory

GRADE_CHUNK = 64  # completions per grade_many call, so the grading progress bar moves


@dataclass
class EvalResult:
    task: str
    summary: dict
    samples: list[SampleRow]
    trajectories: list[Trajectory]
    grader: tuple[str, str]


def summarize_samples(samples: list[SampleRow], k: int, *, n_resamples: int = 10_000, seed: int = 0) -> dict:
    """Avg@k over problems with a bootstrap CI; ``error`` samples are excluded, never scored.

    A problem's value is the mean over its first k non-error samples; problems whose samples all
    errored are left out (counted in ``n_error_problems``). pass@k uses k' = min(k, n_valid).
    """
    per_problem: dict[str, list[float]] = {}
    n_errors = 0
    for s in sorted(samples, key=lambda s: (s.problem_id, s.sample_index)):
        values = per_problem.setdefault(s.problem_id, [])
        if s.status == "error":
            n_errors += 1
        else:
            values.append(s.score)
    valid = [v[:k] for v in per_problem.values() if v]
    means = np.array([np.mean(v) for v in valid]) if valid else np.array([])
    summary = {
        "k": k,
        "n_problems": len(valid),
        "n_samples": len(samples),
        "n_errors": n_errors,
        "n_pass": sum(s.status == "pass" for s in samples),
        "n_fail": sum(s.status == "fail" for s in samples),
        "n_error_problems": len(per_problem) - len(valid),
        "avg_at_k": float(means.mean()) if valid else float("nan"),
        "ci_low": float("nan"),
        "ci_high": float("nan"),
        "pass_at_k": float(np.mean([pass_at_k(len(v), int(sum(v)), len(v[:k])) for v in valid])) if valid else float("nan"),
    }
    if valid:
        summary["ci_low"], summary["ci_high"] = bootstrap_ci(means, n_resamples=n_resamples, seed=seed)
    return summary


def grade_with_progress(task, problems: list, completions: list[str], *, chunk: int = GRADE_CHUNK, show_progress: bool | None = None) -> list:
    """``task.grade_many`` in chunks with a tqdm bar on stderr (terminals only by default); same scores as one call."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions to grade")
    show = sys.stderr.isatty() if show_progress is None else show_progress
    scores: list = []
    with tqdm(total=len(completions), desc="grade", leave=False, disable=not show, file=sys.stderr) as bar:
        for start in range(0, len(completions), chunk):
            part = task.grade_many(problems[start : start + chunk], completions[start : start + chunk])
            if len(part) != len(completions[start : start + chunk]):
                raise ValueError(f"{task.name}: grade_many returned {len(part)} scores for {len(completions[start : start + chunk])} completions")
            scores.extend(part)
            bar.update(len(part))
    return scores


def task_rollout(backend: Backend, task, problems: list, params: SamplingParams) -> list[Trajectory]:
    """The task's own ``rollout(backend, problems, params)`` when it has one (e.g. scoring-based tasks), else the shared rollout."""
    own = getattr(task, "rollout", None)
    return own(backend, problems, params) if callable(own) else rollout(backend, task, problems, params)


def evaluate_task(
    backend: Backend, task, problems: list, *, k: int, sampling: SamplingParams, n_resamples: int = 10_000, show_progress: bool | None = None
) -> EvalResult:
    """k samples per problem, graded by the task; returns the summary and per-sample rows."""
    started = time.perf_counter()
    trajectories = task_rollout(backend, task, problems, sampling.model_copy(update={"n": k}))
    by_id = {p.id: p for p in problems}
    scores = grade_with_progress(task, [by_id[t.problem_id] for t in trajectories], [t.completion_text for t in trajectories], show_progress=show_progress)
    samples = []
    for traj, score in zip(trajectories, scores, strict=True):
        traj.status, traj.extracted, traj.reward = score.status, score.extracted, score.value
        samples.append(
            SampleRow(
                problem_id=traj.problem_id,
                sample_index=traj.sample_index,
                completion=traj.completion_text,
                extracted=score.extracted,
                score=score.value,
                status=score.status,
                latency_s=traj.timings.get("generate_s", 0.0),
                details=score.details,
            )
        )
    summary = summarize_samples(samples, k, n_resamples=n_resamples)
    summary["seconds"] = time.perf_counter() - started
    return EvalResult(task.name, summary, samples, trajectories, task.grader)


def store_eval(store: Store, run_id: str, step: int, result: EvalResult) -> None:
    """Write summary and samples atomically."""
    name, version = result.grader
    store.add_eval(run_id, step, result.task, result.summary, result.samples, grader=name, grader_version=version)
