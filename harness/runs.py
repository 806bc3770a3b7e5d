"""``harness run``'s run record and execution, shared by ``harness sweep``: a new run's id, its ``train`` row and
artifacts (:func:`create_train_run`), the plan of a stored run for ``--resume`` (:func:`plan_resume`), and running a
planned run under its run lock (:func:`execute_run`).

A run being executed (by ``harness run`` or a sweep) holds ``runs/<run_id>/run.lock`` (:func:`run_lock`), so no
second process resumes it at the same time; the kernel drops the lock when its holder exits, however it exits.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from opd_harness.config import ConfigError, RunConfig, deep_merge, format_validation_error, parse_override
from opd_harness.store import Store
from opd_harness.task import close_tasks


def new_run_id(method: str, task: str) -> str:
    """A fresh run id: what ran, on what, when, and 4 random hex digits so two runs started in one second differ."""
    return f"{method}-{task}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def resolved_config(plan) -> dict:
    """A planned run's config as it is recorded: every key with its default, the method's hyper-parameters resolved (JSON types)."""
    cfg = plan.config.model_dump(mode="json")
    cfg["method_args"] = {**cfg["method_args"], cfg["method"]: plan.hparams.model_dump(mode="json")}
    return cfg


def create_train_run(store: Store, cfg: RunConfig, plan) -> str:
    """Record a new training run exactly as ``harness run`` does: every hyper-parameter (defaults
    included) in the config, the ``runs`` row, ``config.json`` and ``method.json``. Returns the run id."""
    cfg.method_args[cfg.method] = plan.hparams.model_dump()
    run_id = new_run_id(cfg.method, cfg.task)
    store.create_run(run_id, kind="train", config=cfg.model_dump(), method=cfg.method, task=cfg.task)
    (store.run_dir(run_id) / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2))
    method_record = {**plan.method.describe(plan.hparams), "hparams": plan.hparams.model_dump(), "warnings": plan.warnings}
    (store.run_dir(run_id) / "method.json").write_text(json.dumps(method_record, indent=2))
    return run_id


RESUME_OVERRIDABLE = "trainer.layout."  # where a resumed run's roles run may change (e.g. its learner ranks); what it trains may not


def plan_resume(store: Store, run_id: str, layout_overrides: list[str] = ()):
    """The plan of a stored training run, for ``--resume``, with ``trainer.layout.*`` overrides (e.g. resume onto another
    number of learner ranks: the checkpoint does not depend on it); raises ConfigError if there is no such run or an
    override is not a layout key."""
    from opd_harness.plan import plan_run

    stored = store.get_run(run_id)
    if stored is None or stored["kind"] != "train":
        raise ConfigError(f"--resume: no training run {run_id!r} in {store.path}")
    config = stored["config"]
    for item in layout_overrides:
        if not item.startswith(RESUME_OVERRIDABLE):
            raise ConfigError(f"--resume continues a run with its stored config: only {RESUME_OVERRIDABLE}* may be --set (got {item!r})")
        config = deep_merge(config, parse_override(item))
    try:
        cfg = RunConfig.model_validate(config)
    except ValidationError as exc:  # e.g. trainer.loggers names a tracker whose package is no longer installed
        raise ConfigError(f"--resume {run_id}: the stored config is not valid here: {format_validation_error(exc, RunConfig)}") from None
    # runs recorded before a run refused other methods' options may hold them (ignored then, as now)
    return plan_run(cfg.model_copy(update={"method_args": {k: v for k, v in cfg.method_args.items() if k == cfg.method}}))


class RunLocked(ConfigError):
    """Another live process is executing this run; the CLI prints it and exits with code 2."""


LOCK_FILE = "run.lock"


@contextmanager
def run_lock(run_dir: Path, run_id: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<run_dir>/run.lock`` for the block; refuse with RunLocked if another process
    holds it.

    The kernel drops the lock when its holder exits, however it exits, so a dead process never blocks a resume.
    """
    handle = open(Path(run_dir) / LOCK_FILE, "a+")  # noqa: SIM115 - held for the block; "a+" never truncates a holder's note
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            message = f"run {run_id} is already being executed by {holder} (lock {handle.name}); wait for it to end or stop it first"
            raise RunLocked(message) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # closing the descriptor releases the lock


@contextmanager
def run_trackers(cfg: RunConfig, store: Store, run_id: str, console: Console) -> Iterator[None]:
    """``trainer.loggers`` for the block: the run's steps and evaluations also go to its trackers (harness/tracking.py).

    A tracker that cannot start is a ConfigError naming ``trainer.loggers`` (the run is marked failed)."""
    from opd_harness.tracking import RunInfo, TrackerStartFailed, tracked

    run_dir = store.run_dir(run_id)
    method = run_dir / "method.json"
    record = {**cfg.model_dump(), "method_json": json.loads(method.read_text()) if method.is_file() else None}
    info = RunInfo(run_dir, run_id, **cfg.trainer.tracking.model_dump(exclude={"tags"}), tags=tuple(cfg.trainer.tracking.tags),
                   config=record, files=(run_dir / "config.json", method))  # fmt: skip
    try:
        with tracked(store, cfg.trainer.loggers, info, lambda message: console.print(f"[yellow]warning:[/] {escape(message)}")):
            yield
    except TrackerStartFailed as exc:
        raise ConfigError(f"trainer.loggers: {exc}") from exc


def execute_run(plan, store: Store, run_id: str, *, resume: bool, console: Console) -> None:
    """Run a planned training run under its run lock; the store's status ends done, interrupted (Ctrl-C) or failed.

    Raises RunLocked, leaving the run untouched, when another process is executing it.
    """
    try:
        with run_lock(store.run_dir(run_id), run_id):
            if resume:
                store.set_status(run_id, "running")
            try:
                with run_trackers(plan.config, store, run_id, console):
                    plan.pipeline.run(plan, store, run_id, resume=resume, console=console)
            except KeyboardInterrupt:
                store.set_status(run_id, "interrupted")
                raise
            except Exception:
                store.set_status(run_id, "failed")
                raise
    finally:  # the tasks' sandbox containers go with the run, however it ends
        close_tasks([plan.task, *plan.eval_tasks])
