"""Evaluation: rollout with eval sampling, grade, summarise (Avg@k with CI, pass@k), store."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

import numpy as np
from tqdm import tqdm

from opd_harness.backends import Backend, SamplingParams
from opd_harness.metrics import bootstrap_ci, pass_at_k
from opd_harness.rollout import rollout
from opd_harness.store import SampleRow, Store
from opd_harness.task import Problem, Score, Task
from opd_harness.trajectory import Trajectory

EVAL_SHARD_SAMPLES = 64  # samples per evaluation shard by default (the hf backend's default generation batch)
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
    shards: int = 1  # shards the evaluation was split into
    shards_reused: int = 0  # of them, staged by an earlier, interrupted attempt (not run again)


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


def episode_record(traj: Trajectory) -> dict:
    """What the transcript viewer needs beyond the stored completion: the prompt, each segment's kind and length in
    characters (the completion is their concatenation: model turns and observations in order) and the episode's outcome."""
    turns = [["model" if s.kind == "model" else "observation", len(s.text)] for s in traj.segments]
    record: dict = {"prompt": traj.prompt_text, "turns": turns}
    if outcome := traj.metadata.get("outcome"):
        record["outcome"] = outcome
    return record


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


def shard_problems(problems: list[Problem], k: int, shard_size: int | None = None) -> list[list[Problem]]:
    """The evaluation's shards: consecutive runs of ``shard_size`` problems (default: as many as fill
    :data:`EVAL_SHARD_SAMPLES` samples), each with all k samples of its problems. The same rule on every executor."""
    size = shard_size or max(1, EVAL_SHARD_SAMPLES // max(k, 1))
    return [problems[start : start + size] for start in range(0, len(problems), size)]


def shard_key(task: Task, problems: list[Problem], k: int, sampling: SamplingParams, index: int) -> dict:
    """What a staged shard must match to be reused: the task, its problems, k and the shard's sampling."""
    params = sampling.model_copy(update={"n": k})
    return {"task": task.name, "index": index, "problems": [p.id for p in problems], "k": k, "sampling": params.model_dump(mode="json")}


def evaluate_shard(
    backend: Backend, task: Task, problems: list[Problem], *, k: int, sampling: SamplingParams, index: int,
    show_progress: bool | None = None,
) -> tuple[list[SampleRow], list[Trajectory]]:
    """One shard: k episodes per problem in one rollout call at the evaluation's sampling, graded; its rows and
    trajectories. Every episode has its own seed, so a sample depends on neither ``index`` (which shard this is, for
    the caller) nor the executor or the other shards."""
    params = sampling.model_copy(update={"n": k})
    trajectories = rollout(backend, task, problems, params)
    by_id = {p.id: p for p in problems}
    scores = grade_episodes(task, [by_id[t.problem_id] for t in trajectories], trajectories, show_progress=show_progress)
    samples = []
    for traj, score in zip(trajectories, scores, strict=True):
        traj.status, traj.extracted, traj.reward = score.status, score.extracted, score.reward_value
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
                metrics=episode_metrics(traj, score),
                episode=episode_record(traj),
            )
        )
    return samples, trajectories


class ShardRunner(Protocol):
    """Runs an evaluation's shards (in this process, or on workers); yields each one as it finishes, in any order."""

    def run(
        self, task: Task, shards: dict[int, list[Problem]], *, k: int, sampling: SamplingParams
    ) -> Iterator[tuple[int, list[SampleRow], list[Trajectory]]]: ...


@dataclass
class LocalShards:
    """Shards one after another on this process's backend."""

    backend: Backend
    show_progress: bool | None = None

    def run(
        self, task: Task, shards: dict[int, list[Problem]], *, k: int, sampling: SamplingParams
    ) -> Iterator[tuple[int, list[SampleRow], list[Trajectory]]]:
        for index, problems in shards.items():
            show = self.show_progress
            rows, trajectories = evaluate_shard(self.backend, task, problems, k=k, sampling=sampling, index=index, show_progress=show)
            yield index, rows, trajectories


class EvalWorkersFailed(RuntimeError):
    """Evaluation workers kept dying on a shard (an infrastructure failure: the run is marked failed, its shards kept)."""


@dataclass(frozen=True)
class EvalWorkerSpec:
    """What an evaluation worker needs to make its own backend and task instances (as ``harness eval`` makes them)."""

    backend: str
    model: str
    backend_options: dict
    task_args: dict
    data_dir: Path | None = None
    sandbox_per_shard: bool = False  # close a sandboxed task's sandbox after each shard (a node's open ones: its shards in flight)


class EvalExecutor(Protocol):
    """Where an evaluation's shards run besides this process (``harness eval --executor NAME``, an ``eval_executors``
    entry point): ``open`` starts ``workers`` workers (on the cluster at ``address``) for the command's duration, at most
    ``max_sandboxes`` of them on one node holding a task sandbox open at once."""

    def open(
        self, spec: EvalWorkerSpec, *, workers: int, address: str | None, console, max_sandboxes: int | None = None
    ) -> AbstractContextManager[ShardRunner]: ...


class ShardStage:
    """Finished shards of an evaluation, staged durably under ``folder`` (one JSON file per shard, written atomically)
    until the evaluation's one store transaction; an interrupted evaluation reuses them on resume."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @classmethod
    def of_run(cls, store: Store, run_id: str, step: int) -> "ShardStage":
        """The staging folder of (run, step): ``runs/<run_id>/eval_shards/step<step>`` (made when a shard is staged)."""
        return cls(store.root / "runs" / run_id / "eval_shards" / f"step{step}")

    def _path(self, task: str, index: int) -> Path:
        return self.folder / quote(task, safe="") / f"{index:06d}.json"

    def load(self, key: dict) -> list[SampleRow] | None:
        """The staged rows of the shard ``key`` names, or None (not staged, or staged for other problems or sampling)."""
        path = self._path(key["task"], key["index"])
        try:
            staged = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return [SampleRow(**row) for row in staged["samples"]] if staged.get("key") == key else None

    def save(self, key: dict, samples: list[SampleRow]) -> None:
        path = self._path(key["task"], key["index"])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"key": key, "samples": [asdict(s) for s in samples]}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def clear(self, task: str) -> None:
        """Drop a task's staged shards once its results are stored."""
        shutil.rmtree(self.folder / quote(task, safe=""), ignore_errors=True)
        for folder in (self.folder, self.folder.parent, self.folder.parent.parent):  # step, eval_shards, the run's folder
            try:
                folder.rmdir()  # only when empty: nothing else of the run is touched
            except OSError:
                break


def evaluate_task(
    backend: Backend | None, task: Task, problems: list[Problem], *, k: int, sampling: SamplingParams, n_resamples: int = 10_000,
    show_progress: bool | None = None, shard_size: int | None = None, runner: ShardRunner | None = None, stage: ShardStage | None = None,
    on_shard: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """k episodes per problem through the one rollout path in shards (:func:`shard_problems`), graded by the task; the
    summary and per-sample rows. Shards run on ``runner`` (default: this process's ``backend``); those ``stage`` holds
    are reused, the others staged as they finish. ``on_shard(done, total)`` follows progress. ``trajectories`` are
    those of the shards run now."""
    started = time.perf_counter()
    shards = shard_problems(problems, k, shard_size)
    keys = [shard_key(task, shard, k, sampling, index) for index, shard in enumerate(shards)] if stage is not None else []
    done: dict[int, list[SampleRow]] = {}
    if stage is not None:
        done = {i: rows for i, key in enumerate(keys) if (rows := stage.load(key)) is not None}
    reused, trajectories = len(done), {}
    runner = runner or LocalShards(backend, show_progress)
    for index, rows, trajs in runner.run(task, {i: s for i, s in enumerate(shards) if i not in done}, k=k, sampling=sampling):
        if stage is not None:
            stage.save(keys[index], rows)
        done[index], trajectories[index] = rows, trajs
        if on_shard is not None:
            on_shard(len(done), len(shards))
    samples = [row for index in range(len(shards)) for row in done[index]]
    summary = summarize_samples(samples, k, n_resamples=n_resamples)
    summary.update(summarize_episodes([s.metrics for s in samples], task.episode_flags))
    summary["seconds"] = time.perf_counter() - started
    ran = [t for index in sorted(trajectories) for t in trajectories[index]]
    return EvalResult(task.name, summary, samples, ran, task.grader, shards=len(shards), shards_reused=reused)


def store_eval(store: Store, run_id: str, step: int, result: EvalResult) -> None:
    """Write summary and samples atomically."""
    name, version = result.grader
    store.add_eval(run_id, step, result.task, result.summary, result.samples, grader=name, grader_version=version)


def output_name(text: str) -> str:
    """A task or model name as part of a file name (lm-eval's sanitising: anything but letters, digits, ``._-`` as ``_``)."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def write_output_path(store: Store, run_id: str, folder: Path, summaries: dict[str, dict]) -> list[Path]:
    """``harness eval --output-path DIR``: the eval run's results as lm-eval names them, read back from the store (so their
    numbers are the store's): ``results_<timestamp>.json`` (config, protocol and every task's summary) and one
    ``samples_<task>_<timestamp>.jsonl`` per task (one graded sample a line). Returns the files written."""
    from datetime import datetime

    from opd_harness.jsonout import to_json

    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().isoformat().replace(":", "-")  # lm-eval's timestamp
    run = store.get_run(run_id) or {}
    written = []
    results = {}
    for row in store.evals(run_id):
        if row["step"] != 0 or row["task"] not in summaries:
            continue
        results[row["task"]] = {
            "k": row["k"], "n_samples": row["n"], "n_problems": row["n_problems"], "avg_at_k": row["avg_at_k"], "ci_low": row["ci_low"],
            "ci_high": row["ci_high"], "pass_at_k": row["pass_at_k"], "n_errors": row["n_errors"],
            "grader": f"{row['grader']}/{row['grader_version']}", **row["metrics"],
        }  # fmt: skip
        path = folder / f"samples_{output_name(row['task'])}_{stamp}.jsonl"
        with path.open("w") as out:
            for sample in store.samples(run_id, 0, row["task"]):
                out.write(to_json({key: value for key, value in sample.items() if key not in ("run_id", "step")}, indent=None) + "\n")
        written.append(path)
    path = folder / f"results_{stamp}.json"
    payload = {"run_id": run_id, "model": run.get("model"), "protocol": run.get("protocol"), "store": str(store.path),
               "config": run.get("config", {}), "results": results}  # fmt: skip
    path.write_text(to_json(payload) + "\n")
    return [path, *written]
