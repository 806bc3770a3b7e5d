"""Finished runs carried from one results root to another as one file (``harness export`` / ``harness import``).

A grid that outlives one machine or one session (a recipe's CPU miniature takes most of a day) is run in parts: each
machine exports the runs it finished, and importing them into any root makes ``harness sweep`` / ``harness reproduce``
there skip those points as done and report them with the rest. The file is gzipped JSON lines: a header (format,
version, the runs, their places in sweeps) and then one line per stored row, every column as the store holds it, so an
import reproduces the rows exactly. Checkpoint weights and other artifacts under ``runs/<run_id>/`` do not travel;
copy those folders alongside when they are needed.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from opd_harness.errors import ConfigError
from opd_harness.jsonout import json_object_line
from opd_harness.store import TABLES, Store
from opd_harness.sweep import adopt_places, place_conflicts, sweep_places

FORMAT = "opd-harness-runs"
VERSION = 1


class TransferError(ConfigError):
    """A runs file that cannot be written or read as asked; nothing was written to the target."""


@dataclass(frozen=True)
class RunsFile:
    """What a runs file holds: its runs, their places in sweeps and their rows by table."""

    path: Path
    run_ids: list[str]
    places: list[dict]
    rows: dict[str, list[dict]]


def finished_runs(store: Store, run_ids: list[str] | None, sweep_points: list[dict] | None) -> list[str]:
    """The runs to export: those named, or a sweep's, or every run of the store; each must exist and be ``done``."""
    if run_ids:
        wanted = list(dict.fromkeys(run_ids))
    elif sweep_points is not None:
        wanted = [q["run_id"] for q in sweep_points if q.get("run_id") and q.get("status") == "done"]
    else:
        wanted = [r["run_id"] for r in store.runs() if r["status"] == "done"]
    for run_id in wanted:
        run = store.get_run(run_id)
        if run is None:
            raise TransferError(f"no run {run_id!r} in {store.path}")
        if run["status"] != "done":
            raise TransferError(f"run {run_id} is {run['status']}: only finished runs (status done) are exported")
    return wanted


def export_runs(root: Path, path: Path, run_ids: list[str]) -> int:
    """Write ``run_ids`` of results root ``root`` to ``path`` (gzipped JSON lines); returns the number of rows written.
    The file is written beside ``path`` and renamed into place, so a failed export leaves no partial file."""
    places = [place for run_id in run_ids for place in sweep_places(root, run_id)]
    header = {"format": FORMAT, "version": VERSION, "runs": run_ids, "places": places}
    tmp = path.with_name(path.name + ".part")
    n = 0
    try:
        with Store(root) as store, gzip.open(tmp, "wt", encoding="utf-8") as handle:
            handle.write(json.dumps(header) + "\n")
            for run_id in run_ids:
                for table, rows in store.run_rows(run_id).items():
                    for row in rows:
                        handle.write(json.dumps({"table": table, "row": row}) + "\n")
                        n += 1
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    return n


def read_runs_file(path: Path) -> RunsFile:
    """Parse and check a runs file; a bad line is a :class:`TransferError` naming ``file:line`` and the field."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TransferError(f"{path}: not a runs file written by `harness export` ({exc})") from None
    header = json_object_line(path, 1, lines[0] if lines else "", TransferError)
    if header.get("format") != FORMAT:
        raise TransferError(f"{path}:1: format: {header.get('format')!r}, expected {FORMAT!r}")
    if not isinstance(header.get("version"), int) or header["version"] > VERSION:
        raise TransferError(f"{path}:1: version: {header.get('version')!r}; this harness reads up to {VERSION}")
    run_ids = header.get("runs")
    if not isinstance(run_ids, list) or not all(isinstance(r, str) for r in run_ids):
        raise TransferError(f"{path}:1: runs: expected a list of run ids")
    rows: dict[str, list[dict]] = {t: [] for t in TABLES}
    for number, line in enumerate(lines[1:], 2):
        item = json_object_line(path, number, line, TransferError)
        table, row = item.get("table"), item.get("row")
        if table not in TABLES:
            raise TransferError(f"{path}:{number}: table: {table!r} is not one of {', '.join(TABLES)}")
        if not isinstance(row, dict) or row.get("run_id") not in run_ids:
            raise TransferError(f"{path}:{number}: row.run_id: {(row or {}).get('run_id')!r} is not a run of this file")
        rows[table].append(row)
    missing = sorted(set(run_ids) - {r["run_id"] for r in rows["runs"]})
    if missing:
        raise TransferError(f"{path}: runs: {missing[0]} has no run row")
    return RunsFile(path, run_ids, _places(path, header.get("places", [])), rows)


def _places(path: Path, places: object) -> list[dict]:
    """The header's sweep places, each with a sweep id and a point holding a config hash and a run id."""
    ok = isinstance(places, list) and all(
        isinstance(p, dict) and isinstance(p.get("sweep_id"), str) and isinstance(p.get("point"), dict)
        and isinstance(p["point"].get("config_hash"), str) and isinstance(p["point"].get("run_id"), str)
        for p in places
    )  # fmt: skip
    if not ok:
        raise TransferError(f"{path}:1: places: expected a list of {{sweep_id, point: {{config_hash, run_id, ...}}}}")
    return places


def twice_placed(places: list[dict]) -> list[str]:
    """Sweep points that the files being imported give two different runs."""
    first: dict[tuple[str, str], str] = {}
    out = []
    for place in places:
        key, run_id = (place["sweep_id"], place["point"]["config_hash"]), place["point"]["run_id"]
        if first.setdefault(key, run_id) != run_id:
            out.append(f"sweep {key[0]} point {key[1]}: runs {first[key]} and {run_id} in the files")
    return out


def import_runs(paths: list[Path], root: Path) -> list[str]:
    """Read and check every file, then write their rows into ``root``'s store in one transaction and record their sweep
    places; returns the run ids imported. A file that fails its checks, a column the store lacks, or a sweep point that
    already has another run in ``root`` stops the import before anything is written."""
    files = [read_runs_file(p) for p in paths]
    rows = {t: [row for f in files for row in f.rows[t]] for t in TABLES}
    places = [place for f in files for place in f.places]
    with Store(root) as store:
        for f in files:
            for table in TABLES:
                if unknown := store.unknown_column(table, f.rows[table]):
                    raise TransferError(f"{f.path}: {unknown}: this store has no such column (a newer harness wrote it)")
        conflicts = twice_placed(places) + place_conflicts(root, places, lambda run_id: store.get_run(run_id) is not None)
        if conflicts:
            raise TransferError(f"{len(conflicts)} sweep point(s) already have another run; nothing imported: " + "; ".join(conflicts))
        store.put_rows(rows)
    adopt_places(root, places)
    return [run_id for f in files for run_id in f.run_ids]
