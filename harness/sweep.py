"""Config-driven sweeps: a YAML grid of runs (methods × modes × seeds × lags × any dotted key), run
sequentially in-process exactly as ``harness run`` runs them, resumable, recorded under
``<out>/sweeps/<sweep_id>.json``.

Sweep file format::

    id: lag-study                  # optional; default: the file's stem ([A-Za-z0-9._-]+)
    base:                          # the layers every run shares (same precedence as `harness run`)
      preset: smoke                # optional built-in preset
      config: base.yaml            # optional config file, relative to the sweep file
      set:                         # optional dotted overrides (a mapping, or a list of KEY=VALUE)
        eval.teacher: false
    grid:                          # a mapping of dotted key -> list of values (cartesian product),
      method: [opd, f_opd]         # or a list of such mappings (the union of their products)
      trainer.mode: [sync, async]
      seed: [0, 1, 2, 3, 4]

Each grid point becomes ``--set key=value`` overrides applied after ``base.set``. Every point is
validated (config and plan) before any run starts; an error names the grid point. Points whose
resolved configs are identical are run once. Re-running a sweep skips points whose run is
``done``, resumes runs left ``running`` / ``interrupted`` / ``failed`` from their last checkpoint,
and starts the rest.

Several processes may run the same sweep into the same results root at once (one per core, GPU or
host on a shared filesystem): each holds ``sweeps/<sweep_id>.claims/<config_hash>.lock`` while it runs
that point, skips points another process holds, and merges its points into the sweep record under a
short lock, so every point runs once. A run being executed (by a sweep or ``harness run``) also holds
``runs/<run_id>/run.lock`` (:func:`opd_harness.runs.run_lock`). The kernel drops these locks when
their holder exits, however it exits, so a killed worker's point is resumed by the next one to reach it.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.console import Console

from opd_harness.config import ConfigError, RunConfig, build_config, format_validation_error
from opd_harness.registry import EXECUTORS, RegistryError
from opd_harness.runs import create_train_run, execute_run, plan_resume
from opd_harness.store import Store

_ID = re.compile(r"^[A-Za-z0-9._-]+$")


class SweepError(ConfigError):
    """A bad sweep file or grid point; the CLI prints it and exits with code 2."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SweepBase(_Strict):
    preset: str | None = None
    config: str | None = Field(None, description="YAML config file, relative to the sweep file")
    set: dict[str, Any] | list[str] = Field(default_factory=dict, description="dotted overrides")


class SweepSpec(_Strict):
    id: str | None = None
    base: SweepBase = Field(default_factory=SweepBase)
    grid: dict[str, list[Any]] | list[dict[str, list[Any]]]
    source: str | None = Field(None, exclude=True)  # the sweep file, when loaded from one

    def sub_grids(self) -> list[dict[str, list[Any]]]:
        return [self.grid] if isinstance(self.grid, dict) else list(self.grid)

    def grid_keys(self) -> list[str]:
        """Every dotted key any sub-grid varies, in order of first appearance."""
        keys: list[str] = []
        for grid in self.sub_grids():
            keys += [k for k in grid if k not in keys]
        return keys

    def base_overrides(self) -> list[str]:
        if isinstance(self.base.set, list):
            return list(self.base.set)
        return [to_override(k, v) for k, v in self.base.set.items()]

    def config_path(self) -> Path | None:
        if not self.base.config:
            return None
        path = Path(self.base.config)
        if not path.is_absolute() and self.source:
            path = Path(self.source).parent / path
        return path


@dataclass
class SweepPoint:
    """One unique run of the sweep."""

    index: int
    coords: dict[str, Any]
    overrides: list[str]
    config_hash: str
    run_id: str | None = None
    status: str = "pending"  # pending / running / done / failed / interrupted
    config: RunConfig | None = field(default=None, repr=False)
    plan: Any = field(default=None, repr=False)

    def label(self) -> str:
        return _label(self.coords)

    def record(self) -> dict:
        return {
            "index": self.index,
            "coords": self.coords,
            "overrides": self.overrides,
            "config_hash": self.config_hash,
            "run_id": self.run_id,
            "status": self.status,
        }


@dataclass
class SweepResult:
    sweep_id: str
    record_path: Path
    points: list[SweepPoint]
    ran: list[str] = field(default_factory=list)  # run ids started or resumed by this call
    skipped: list[str] = field(default_factory=list)  # run ids already done
    failed: list[str] = field(default_factory=list)
    elsewhere: list[str] = field(default_factory=list)  # labels of points another process was running


def _label(coords: dict) -> str:
    return ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in coords.items())


def to_override(key: str, value: Any) -> str:
    """A ``--set`` string for ``key``/``value`` (JSON is YAML, so ``parse_override`` reads it back exactly)."""
    return f"{key}={json.dumps(value)}"


def load_sweep(path: str | Path) -> SweepSpec:
    """Read and validate a sweep YAML file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SweepError(f"sweep file {path}: no such file") from None
    except yaml.YAMLError as exc:
        raise SweepError(f"sweep file {path}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SweepError(f"sweep file {path}: the top level must be a mapping with 'base' and 'grid'")
    data.setdefault("id", path.stem)
    return parse_sweep(data, source=str(path))


def parse_sweep(data: dict, source: str | None = None) -> SweepSpec:
    where = f"sweep file {source}" if source else "sweep"
    try:
        spec = SweepSpec.model_validate({**data, "source": source})
    except ValidationError as exc:
        raise SweepError(f"{where}: " + format_validation_error(exc, SweepSpec).replace("\n", f"\n{where}: ")) from None
    if not spec.id or not _ID.match(spec.id):
        raise SweepError(f"{where}: id {spec.id!r} must be non-empty and use only letters, digits, '.', '_' and '-'")
    grids = spec.sub_grids()
    if not grids:
        raise SweepError(f"{where}: 'grid' is empty")
    for i, grid in enumerate(grids):
        name = "grid" if isinstance(spec.grid, dict) else f"grid[{i}]"
        if not grid:
            raise SweepError(f"{where}: {name} has no keys")
        for key, values in grid.items():
            if not key or any(not part for part in key.split(".")):
                raise SweepError(f"{where}: {name}: bad key {key!r}; use a dotted config key such as trainer.mode")
            if not values:
                raise SweepError(f"{where}: {name}.{key} is an empty list")
    return spec


def config_hash(cfg: RunConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.model_dump(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def expand(spec: SweepSpec) -> list[SweepPoint]:
    """Every grid point, validated (config + plan) before anything runs; duplicates merged.

    Raises :class:`SweepError` listing every bad point (its index and coordinates) and the error.
    """
    from opd_harness.plan import plan_run

    base = spec.base_overrides()
    config_file = spec.config_path()
    points: list[SweepPoint] = []
    seen: set[str] = set()
    errors: list[str] = []
    n = 0
    for grid in spec.sub_grids():
        keys = list(grid)
        for values in itertools.product(*(grid[k] for k in keys)):
            coords = dict(zip(keys, values))
            overrides = base + [to_override(k, v) for k, v in coords.items()]
            label = _label(coords)
            try:
                cfg = only_selected_method_args(build_config(preset=spec.base.preset, config_file=config_file, overrides=overrides))
                plan = plan_run(cfg)
            except (ConfigError, RegistryError) as exc:
                errors.append(f"grid point {n} ({label}): " + str(exc).replace("\n", "\n    "))
                n += 1
                continue
            n += 1
            digest = config_hash(cfg)
            if digest in seen:
                continue
            seen.add(digest)
            points.append(SweepPoint(len(points), coords, overrides, digest, config=cfg, plan=plan))
    if errors:
        raise SweepError(f"sweep {spec.id!r}: {len(errors)} of {n} grid points are invalid; nothing was run\n" + "\n".join(errors))
    return points


def only_selected_method_args(cfg: RunConfig) -> RunConfig:
    """A grid point's config with only its own method's ``method_args``: a sweep's base may set several methods' options
    for the points that select them (each is validated, so a typo in one still stops the sweep before anything runs)."""
    from opd_harness.plan import validate_method_args

    validate_method_args(cfg.method_args)
    return cfg.model_copy(update={"method_args": {k: v for k, v in cfg.method_args.items() if k == cfg.method}})


def check_executors(spec: SweepSpec, points: list[SweepPoint], console: Console) -> None:
    """Every point's executor accepts its plan (e.g. a Ray layout the cluster can hold), before any run is recorded;
    else :class:`SweepError` naming each refused point, as ``harness run`` refuses one run (exit 2)."""
    errors: list[str] = []
    for point in points:
        try:
            EXECUTORS.get(point.config.trainer.executor).check(point.plan, console)
        except ConfigError as exc:
            errors.append(f"grid point {point.index} ({point.label()}): " + str(exc).replace("\n", "\n    "))
    if errors:
        raise SweepError(f"sweep {spec.id!r}: the executor refuses {len(errors)} of {len(points)} grid points; nothing was run\n"
                         + "\n".join(errors))  # fmt: skip


# ---- sweeps ------------------------------------------------------------------------------------


def sweep_record_path(out: str | Path, sweep_id: str) -> Path:
    return Path(out) / "sweeps" / f"{sweep_id}.json"


def load_sweep_record(out: str | Path, sweep_id: str) -> dict:
    path = sweep_record_path(out, sweep_id)
    if not path.exists():
        raise SweepError(f"no sweep {sweep_id!r}: {path} does not exist (run `harness sweep FILE --out {out}` first)")
    return json.loads(path.read_text())


def _write_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _read_record(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


@contextmanager
def _record_lock(record_path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<sweep_id>.lock`` for a read-merge-write of the record (waits for another holder)."""
    with open(record_path.with_suffix(".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # closing the descriptor releases the lock


def sweep_places(out: str | Path, run_id: str) -> list[dict]:
    """Where ``run_id`` stands in the sweeps of results root ``out``: ``{"sweep_id": ..., "point": <its record>}`` each."""
    places = []
    for path in sorted((Path(out) / "sweeps").glob("*.json")):
        record = _read_record(path)
        sweep_id = record.get("sweep_id", path.stem)
        places += [{"sweep_id": sweep_id, "point": q} for q in record.get("points", []) if q.get("run_id") == run_id]
    return places


def place_conflicts(out: str | Path, places: list[dict], has_run: Callable[[str], bool]) -> list[str]:
    """The places whose sweep point already has another run in root ``out`` (``has_run``: that run is in its store)."""
    runs_of = {sweep_id: {q["config_hash"]: q.get("run_id") for q in _read_record(sweep_record_path(out, sweep_id)).get("points", [])}
               for sweep_id in {place["sweep_id"] for place in places}}  # fmt: skip  # each record read once
    conflicts = []
    for place in places:
        point = place["point"]
        ours = runs_of[place["sweep_id"]].get(point["config_hash"])
        if ours and ours != point["run_id"] and has_run(ours):
            where = f"sweep {place['sweep_id']} point {_label(point.get('coords', {}))}"
            conflicts.append(f"{where}: {out} has run {ours}, not {point['run_id']}")
    return conflicts


def adopt_places(out: str | Path, places: list[dict]) -> None:
    """Record each place's point (config hash -> run id) in its sweep under the record's lock, so a sweep or recipe run
    on ``out`` skips that point as done (:func:`run_sweep` attaches points by config hash)."""
    for place in places:
        record_path = sweep_record_path(out, place["sweep_id"])
        record_path.parent.mkdir(parents=True, exist_ok=True)
        with _record_lock(record_path):
            record = _read_record(record_path) or {"sweep_id": place["sweep_id"], "created_at": time.time()}
            if place["point"] in record.get("points", []):
                continue  # recorded already: importing a file twice leaves the record as it was
            points = [q for q in record.get("points", []) if q["config_hash"] != place["point"]["config_hash"]]
            record["points"] = points + [place["point"]]
            record["updated_at"] = time.time()
            _write_atomic(record_path, record)


@contextmanager
def _claim(record_path: Path, digest: str) -> Iterator[bool]:
    """Hold ``<sweep_id>.claims/<config_hash>.lock`` for the block; yields False (holding nothing) when another process
    holds it. Its note names the holder."""
    folder = record_path.with_suffix(".claims")
    folder.mkdir(exist_ok=True)
    with open(folder / f"{digest}.lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        yield True


def _refresh(point: SweepPoint, store: Store, record_path: Path) -> None:
    """``point``'s run and status as the record and the store know them now (another process may have run it)."""
    with _record_lock(record_path):
        theirs = {q["config_hash"]: q for q in _read_record(record_path).get("points", [])}.get(point.config_hash)
    run_id = (theirs or {}).get("run_id") or point.run_id
    stored = store.get_run(run_id) if run_id else None
    if stored is not None:
        point.run_id, point.status = stored["run_id"], stored["status"]


def _run_point(
    p: SweepPoint, store: Store, result: SweepResult, save: Callable[[], None], where: str, keep_going: bool, console: Console
) -> None:
    """Start or resume ``p``'s run in this process, recording its status before and after."""
    resume = p.run_id is not None
    if resume:
        plan = plan_resume(store, p.run_id)
    else:
        plan = p.plan
        p.run_id = create_train_run(store, p.config, plan)
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    p.status = "running"
    save()
    console.print(f"{where}: {'resuming' if resume else 'running'} {p.run_id}", highlight=False)
    result.ran.append(p.run_id)
    try:
        execute_run(plan, store, p.run_id, resume=resume, console=console)
    except KeyboardInterrupt:
        p.status = "interrupted"
        save()
        raise
    except Exception as exc:  # noqa: BLE001 - recorded; the sweep goes on
        p.status = "failed"
        result.failed.append(p.run_id)
        save()
        if not keep_going:
            raise
        console.print(f"[bold red]run {p.run_id} failed:[/] {type(exc).__name__}: {exc}")
        return
    p.status = "done"
    save()


def run_sweep(
    spec: SweepSpec | str | Path, out: str | Path, dry_run: bool = False, *, console: Console | None = None, keep_going: bool = True
) -> SweepResult:
    """Validate every grid point, then run the sweep's runs one after another into ``out``.

    ``dry_run`` validates and reports what would run or be skipped, writing nothing. With
    ``keep_going`` a failed run is recorded and the sweep continues (``result.failed``); Ctrl-C marks
    the current run interrupted, saves the sweep record and re-raises.
    """
    if not isinstance(spec, SweepSpec):
        spec = load_sweep(spec)
    console = console or Console(stderr=True)
    out = Path(out)
    points = expand(spec)  # raises before anything is created
    check_executors(spec, points, console)
    record_path = sweep_record_path(out, spec.id)
    previous = json.loads(record_path.read_text()) if record_path.exists() else {}
    by_hash = {p["config_hash"]: p for p in previous.get("points", []) if p.get("run_id")}
    result = SweepResult(spec.id, record_path, points)

    if dry_run:
        store = Store(out) if (out / "results.sqlite").exists() else None
        for p in points:
            old = by_hash.get(p.config_hash)
            stored = store.get_run(old["run_id"]) if (store and old) else None
            p.run_id = stored["run_id"] if stored else None
            p.status = stored["status"] if stored else "pending"
            action = "skip (done)" if p.status == "done" else "resume" if stored else "run"
            console.print(f"  [{p.index}] {p.label()}: {action}" + (f" {p.run_id}" if p.run_id else ""), highlight=False)
        return result

    record = {
        "sweep_id": spec.id,
        "source": spec.source,
        "spec": spec.model_dump(mode="json"),
        "grid_keys": spec.grid_keys(),
        "created_at": previous.get("created_at", time.time()),
        "updated_at": time.time(),
        "points": [],
    }
    mine: set[str] = set()  # config hashes of the points this process has claimed

    def sync() -> None:
        """Under the record's lock: adopt other processes' news of the points this one does not hold, write the rest."""
        with _record_lock(record_path):
            on_disk = {q["config_hash"]: q for q in _read_record(record_path).get("points", [])}
            for p in points:
                theirs = on_disk.get(p.config_hash)
                if p.config_hash not in mine and theirs and theirs.get("run_id"):
                    p.run_id, p.status = theirs["run_id"], theirs["status"]
            record["updated_at"] = time.time()
            record["points"] = [p.record() for p in points]
            _write_atomic(record_path, record)

    store = Store(out)
    record_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        for p in points:  # attach runs from earlier invocations
            old = by_hash.get(p.config_hash)
            stored = store.get_run(old["run_id"]) if old else None
            if stored is not None:
                p.run_id, p.status = stored["run_id"], stored["status"]
        sync()
        for p in points:
            where = f"sweep {spec.id} [{p.index + 1}/{len(points)}] {p.label()}"
            with _claim(record_path, p.config_hash) as claimed:
                if not claimed:
                    result.elsewhere.append(p.label())
                    console.print(f"{where}: another process is running it, skipped", highlight=False)
                    continue
                mine.add(p.config_hash)
                _refresh(p, store, record_path)  # another process may have run or started it before this claim
                if p.status == "done":
                    result.skipped.append(p.run_id)
                    console.print(f"{where}: done ({p.run_id}), skipped", highlight=False)
                    continue
                _run_point(p, store, result, sync, where, keep_going, console)
    finally:
        store.close()
    return result
