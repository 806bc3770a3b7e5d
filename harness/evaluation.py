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
from harness.task import Problem, Score, Task
from harness.trajectory import Trajectory

GRADE_CHUNK = 64  # completions per grade_many call, so the grading progress bar moves
GENERIC_SUMMARY_KEYS = frozenset(
    {
        "k",
        "n_problems",
        "n_samples",
        "n_errors",
        "n_pass",
        "n_fail",
        "n_error_problems",
        "avg_at_k",
        "ci_low",
        "ci_high",
        "pass_at_k",
        "seconds",
    }
)  # what every evaluation summary has; anything beyond is a task-specific measurement (e.g. agentic rates)


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


def grade_episodes(
    task: Task, problems: list[Problem], trajectories: list[Trajectory], *, chunk: int = GRADE_CHUNK, show_progress: bool | None = None
) -> list[Score]:
    """``task.grade_trajectories`` in chunks with a tqdm bar on stderr (terminals only by default); an episode whose
    environment failed is graded ``error`` without asking the task. Each trajectory's ``grade_s`` is its share."""
    if len(problems) != len(trajectories):
        raise ValueError(f"{len(problems)} problems but {len(trajectories)} trajectories to grade")
    scores: list = [Score("error", details=t.metadata["env_error"]) if "env_error" in t.metadata else None for t in trajectories]
    todo = [i for i, s in enumerate(scores) if s is None]
    show = sys.stderr.isatty() if show_progress is None else show_progress
    with tqdm(total=len(todo), desc="grade", leave=False, disable=not show, file=sys.stderr) as bar:
        for start in range(0, len(todo), chunk):
            part_ids = todo[start : start + chunk]
            started = time.perf_counter()
            part = task.grade_trajectories([problems[i] for i in part_ids], [trajectories[i] for i in part_ids])
            if len(part) != len(part_ids):
                raise ValueError(f"{task.name}: grade_trajectories returned {len(part)} scores for {len(part_ids)} episodes")
            share = (time.perf_counter() - started) / len(part_ids)
            for i, score in zip(part_ids, part, strict=True):
                scores[i] = score
                trajectories[i].timings["grade_s"] = share
            bar.update(len(part))
    return scores


def episode_metrics(traj: Trajectory, score) -> dict:
    """What is stored per sample beyond the grade: the episode's counters, the grader's metrics, and timings."""
    out = dict(traj.metadata.get("episode", {}))
    out.update(score.metrics)
    out.update({k: round(v, 6) for k, v in traj.timings.items()})
    return out


def summarize_episodes(metrics: list[dict], flags: tuple[str, ...] = ()) -> dict:
    """Agentic aggregates over episodes (only when the task reports tool calls): invalid tool rate (share of
    episodes with at least one invalid call), mean tool calls (valid and invalid: what the budget counts) and turns,
    tool-error rate (errored / executed calls: an invalid call ran nothing, so it is no denominator), and
    ``<flag>_rate`` (share of episodes where the flag is set) for each per-episode flag the task declares."""
    rates = {f"{flag}_rate": float(np.mean([bool(m.get(flag)) for m in metrics])) for flag in flags} if metrics else {}
    if not any("tool_calls" in m for m in metrics):  # single-turn tasks: nothing agentic to report
        turns = {"mean_turns": float(np.mean([m.get("turns", 1) for m in metrics]))} if any(m.get("turns", 1) > 1 for m in metrics) else {}
        return {**turns, **rates}
    executed = sum(m.get("executed_tool_calls", 0) for m in metrics)
    return {
        **rates,
        "mean_turns": float(np.mean([m.get("turns", 0) for m in metrics])),
        "mean_tool_calls": float(np.mean([m.get("tool_calls", 0) for m in metrics])),
        "invalid_tool_rate": float(np.mean([m.get("invalid_tool_calls", 0) > 0 for m in metrics])),
        "tool_error_rate": sum(m.get("tool_errors", 0) for m in metrics) / executed if executed else 0.0,
    }


def describe_episodes(summary: dict) -> str:
    """The agentic part of an evaluation summary as one line (empty for tasks without tool calls)."""
    if "invalid_tool_rate" not in summary:
        return ""
    return (
        f"invalid tool rate {summary['invalid_tool_rate']:.3f}, tool-error rate {summary['tool_error_rate']:.3f}, "
        f"{summary['mean_tool_calls']:.2f} tool calls and {summary['mean_turns']:.2f} turns per episode"
    )


def evaluate_task(
    backend: Backend, task: Task, problems: list[Problem], *, k: int, sampling: SamplingParams, n_resamples: int = 10_000,
    show_progress: bool | None = None,
) -> EvalResult:
    """k episodes per problem through the one rollout path, graded by the task; returns the summary and per-sample rows."""
    started = time.perf_counter()
    trajectories = rollout(backend, task, problems, sampling.model_copy(update={"n": k}))
    by_id = {p.id: p for p in problems}
    scores = grade_episodes(task, [by_id[t.problem_id] for t in trajectories], trajectories, show_progress=show_progress)
    samples, per_episode = [], []
    for traj, score in zip(trajectories, scores, strict=True):
        traj.status, traj.extracted, traj.reward = score.status, score.extracted, score.reward_value
        metrics = episode_metrics(traj, score)
        per_episode.append(metrics)
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
                metrics=metrics,
            )
        )
    summary = summarize_samples(samples, k, n_resamples=n_resamples)
    summary.update(summarize_episodes(per_episode, task.episode_flags))
    summary["seconds"] = time.perf_counter() - started
    return EvalResult(task.name, summary, samples, trajectories, task.grader)


def store_eval(store: Store, run_id: str, step: int, result: EvalResult) -> None:
    """Write summary and samples atomically."""
    name, version = result.grader
    store.add_eval(run_id, step, result.task, result.summary, result.samples, grader=name, grader_version=version)
