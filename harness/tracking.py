"""Experiment trackers: every step's metrics and every evaluation a run writes to the results store also go to
TensorBoard, Weights & Biases (offline), MLflow and a JSONL file, under one key scheme close to verl's.

The store stays the source of truth: a tracker that fails while the run goes on is switched off with one warning.
A tracker that cannot start (unknown name, package missing, unsupported MLflow URI) is refused by
:func:`check_loggers` when the config or the command line is validated, before anything is written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from opd_harness.store import Store

LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # the module each tracker imports
INSTALL_HINT = "install the trackers with: pip install 'opd-harness[tracking]'"

# Store step-metric name -> tracker key (verl's names where it has one); other names follow the rules of step_key.
STEP_KEYS = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "student_entropy": "actor/entropy",
    "teacher_kl": "actor/teacher_kl",
    "teacher_entropy": "actor/teacher_entropy",
    "reward_mean": "critic/rewards/mean",
    "response_length": "response_length/mean",
    "tokens_per_s": "perf/throughput",
    "samples_per_s": "perf/samples_per_s",
    "learner_tokens_per_s": "perf/learner_tokens_per_s",
    "mfu": "perf/mfu/actor",
    "model_tokens": "perf/total_num_tokens",
    "samples": "perf/samples",
    "lag_mean": "staleness/lag_mean",
    "lag_max": "staleness/lag_max",
    "behaviour_version": "staleness/behaviour_version",
    "buffer_size": "staleness/buffer_size",
    "refreshes": "staleness/refreshes",
    "dropped_batches": "staleness/dropped_batches",
    "idle_ratio_learner": "perf/idle_ratio_learner",
    "idle_ratio_rollout": "perf/idle_ratio_rollout",
    "mean_turns": "agent/mean_turns",
    "mean_tool_calls": "agent/mean_tool_calls",
    "invalid_tool_rate": "agent/invalid_tool_rate",
    "tool_error_rate": "agent/tool_error_rate",
}
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. :/]")  # what MLflow accepts in a metric name (it refuses '@')


def _safe(key: str) -> str:
    """A key every tracker accepts: characters MLflow refuses become '_'."""
    return _UNSAFE.sub("_", key)


OFF_POLICY = re.compile(r"(trajectory_spans|trajectory_staleness|trajectory_staleness_worst)_(mean|max|min)")  # verl's names


def step_key(name: str) -> str:
    """The tracker key of a store step metric: ``STEP_KEYS``, ``time_<stage>_s`` -> ``timing_s/<stage>``,
    ``trajectory_<x>_<stat>`` -> verl's ``training/off_policy/trajectory_<x>/<stat>``, else ``train/<name>``."""
    if name in STEP_KEYS:
        return STEP_KEYS[name]
    off_policy = OFF_POLICY.fullmatch(name)
    if off_policy:
        return f"training/off_policy/{off_policy[1]}/{off_policy[2]}"
    if name.startswith("time_") and name.endswith("_s") and len(name) > len("time__s"):
        return _safe(f"timing_s/{name[len('time_'):-len('_s')]}")
    return _safe(f"train/{name}")


def step_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A step's store metrics under their tracker keys (numbers only)."""
    return {step_key(name): float(value) for name, value in metrics.items() if _is_number(value)}


def eval_metrics(task: str, summary: dict) -> dict[str, float]:
    """An evaluation summary (as the store receives it) under ``eval/<task>/...``: ``avg_at_<k>``, ``pass_at_<k>``,
    ``ci_low``, ``ci_high`` and every other number of the summary (counts, seconds, agentic rates) by its own name."""
    k = int(summary["k"])
    renamed = {"avg_at_k": f"avg_at_{k}", "pass_at_k": f"pass_at_{k}"}
    return {
        _safe(f"eval/{task}/{renamed.get(name, name)}"): float(value)
        for name, value in summary.items()
        if name != "k" and _is_number(value)
    }


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_loggers(names: Iterable[str]) -> list[str]:
    """The loggers to open, ``jsonl`` first (always on); raises ValueError for an unknown name or a tracker whose
    package is missing (``trainer.tracking.mlflow_uri`` is checked by :func:`check_mlflow_uri`)."""
    chosen = list(dict.fromkeys(["jsonl", *names]))
    unknown = [name for name in chosen if name not in LOGGERS]
    if unknown:
        raise ValueError(f"unknown logger(s) {unknown}: choose from {', '.join(LOGGERS)}")
    missing = [name for name in chosen if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None]
    if missing:
        raise ValueError(f"logger(s) {missing} need their package(s), which are not installed; {INSTALL_HINT}")
    return chosen


def check_mlflow_uri(uri: str) -> None:
    """Raise ValueError when no MLflow tracking store serves ``uri``'s scheme; nothing is opened or written."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry  # the registry MlflowClient resolves URIs with

    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception as exc:  # noqa: BLE001 - MlflowException (unsupported scheme) or a malformed URI
        schemes = [s for s in getattr(exc, "supported_uri_schemes", []) if s]
        served = f"; MLflow serves the schemes {', '.join(schemes)} (or a local path)" if schemes else f" ({exc})"
        raise ValueError(f"MLflow tracking URI {uri!r}: no MLflow tracking store serves it{served}") from None


class Tracker(Protocol):
    """One tracker of a run: takes ``{key: value}`` at a step, and is closed once when the run ends."""

    name: str

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self, ok: bool = True) -> None: ...  # ok: the run ended without an error


@dataclass(frozen=True)
class RunInfo:
    """What a tracker is told about its run: where its files go, its names, and the run config it records."""

    run_dir: Path
    run_id: str
    project: str = "opd-harness"
    name: str | None = None  # default: the run id
    tags: tuple[str, ...] = ()
    mlflow_uri: str | None = None  # default: a file store under the run folder
    config: dict = field(default_factory=dict)
    files: tuple[Path, ...] = ()  # config.json, method.json: kept as artifacts where the tracker has them

    @property
    def display_name(self) -> str:
        return self.name or self.run_id


class JsonlTracker:
    """``<run>/metrics.jsonl``: one line per logged step or evaluation, ``{"step": s, key: value, ...}``."""

    name = "jsonl"

    def __init__(self, info: RunInfo) -> None:
        self.path = info.run_dir / "metrics.jsonl"
        self._file = self.path.open("a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")  # NaN and inf as JSON5-style literals, as the store's JSON
        self._file.flush()

    def close(self, ok: bool = True) -> None:
        self._file.close()


class TensorBoardTracker:
    """Event files under ``<run>/tensorboard`` (``tensorboard --logdir <run>/tensorboard``), the run config as text."""

    name = "tensorboard"

    def __init__(self, info: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(info.run_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(info.config, indent=2, default=str) + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, ok: bool = True) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run under ``<run>/wandb`` in offline mode unless ``WANDB_MODE`` says otherwise (``wandb sync`` uploads it)."""

    name = "wandb"

    def __init__(self, info: RunInfo) -> None:
        import wandb

        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True, save_code=False)
        self.run = wandb.init(
            mode=os.environ.get("WANDB_MODE", "offline"), dir=str(info.run_dir), project=info.project, name=info.display_name,
            tags=list(info.tags), config=info.config, settings=settings, reinit="create_new",
        )  # fmt: skip

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self, ok: bool = True) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MlflowTracker:
    """An MLflow run (experiment: the project) in a file store under ``<run>/mlruns``, or at the tracking URI given;
    the flattened config as params, config.json and method.json as artifacts."""

    name = "mlflow"

    def __init__(self, info: RunInfo) -> None:
        uri = info.mlflow_uri or (info.run_dir / "mlruns").resolve().as_uri()
        if urlparse(uri).scheme in ("", "file"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store only on request
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(info.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(info.project)
        tags = {"harness.run_id": info.run_id, **{tag: "true" for tag in info.tags}}
        self.run_id = self.client.create_run(experiment_id, run_name=info.display_name, tags=tags).info.run_id
        params = [Param(_safe(key)[:250], str(value)[:6000]) for key, value in flatten(info.config).items()]
        for start in range(0, len(params), 100):  # MLflow's batch limit for params
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        for path in info.files:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in metrics.items()])

    def close(self, ok: bool = True) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


TRACKER_CLASSES: dict[str, Callable[[RunInfo], Tracker]] = {
    "jsonl": JsonlTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """A nested dict as ``{"a.b.c": leaf}`` (lists stay leaves)."""
    out: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class TrackerStartFailed(ValueError):
    """A tracker that passed :func:`check_loggers` could not start (e.g. a tracking server that refuses the run)."""


class Trackers:
    """The run's trackers behind the store: each step and evaluation goes to every tracker still working."""

    def __init__(self, trackers: list[Tracker], warn: Callable[[str], None]) -> None:
        self.active = list(trackers)
        self.warn = warn

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self._log(step_metrics(metrics), step)

    def log_eval(self, step: int, task: str, summary: dict) -> None:
        self._log(eval_metrics(task, summary), step)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        for tracker in list(self.active):
            try:
                tracker.log(metrics, step)
            except Exception as exc:  # noqa: BLE001 - a tracker going away never stops the run
                self.active.remove(tracker)
                self.warn(f"tracker {tracker.name} failed at step {step} ({type(exc).__name__}: {exc}); it is off for the rest "
                          "of the run, the results store has every value")  # fmt: skip

    def close(self, ok: bool = True) -> None:
        """Close every tracker still working; ``ok``: the run ended without an error (W&B exit code, MLflow status)."""
        for tracker in self.active:
            try:
                tracker.close(ok)
            except Exception as exc:  # noqa: BLE001
                self.warn(f"tracker {tracker.name} failed to close ({type(exc).__name__}: {exc})")
        self.active = []


def open_trackers(names: Iterable[str], info: RunInfo, warn: Callable[[str], None]) -> Trackers:
    """Start the named trackers (closing those already started if one fails: TrackerStartFailed)."""
    started: list[Tracker] = []
    for name in dict.fromkeys(["jsonl", *names]):
        try:
            started.append(TRACKER_CLASSES[name](info))
        except Exception as exc:  # noqa: BLE001 - any start failure is reported as one error naming the tracker
            Trackers(started, warn).close(ok=False)
            raise TrackerStartFailed(f"logger {name} could not start: {type(exc).__name__}: {exc}") from exc
    return Trackers(started, warn)


@contextmanager
def tracked(store: Store, names: Iterable[str], info: RunInfo, warn: Callable[[str], None]) -> Iterator[Trackers]:
    """For the block, every step and evaluation ``store`` writes for ``info.run_id`` also goes to the trackers."""
    trackers = open_trackers(names, info, warn)
    store.observe(info.run_id, trackers)
    ok = False
    try:
        yield trackers
        ok = True
    finally:
        store.observe(info.run_id, None)
        trackers.close(ok)
