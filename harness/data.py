"""Benchmark files on disk: ``harness data fetch`` downloads them into the layout the tasks read, ``harness data check``
validates a data folder.

A task that reads files declares them in its own module with a classmethod ``data_needs()`` returning one
:class:`opd_harness.task.DataNeed` per split: the files under the data folder, where they come from, the function that downloads
them, the task's own loader and the problem counts of the known good copies. This module names no benchmark; it
runs those declarations. ``fetch`` downloads each split into a staging folder inside the data folder, validates it
with the task's loader and only then moves the files into place, so a failed or bad download leaves nothing
half-made. ``check`` loads every declared split that is present and reports the rest as missing.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.console import Console
from rich.markup import escape

from opd_harness.datadir import DATA_DIR_ENV, resolve_data_dir
from opd_harness.registry import TASKS, RegistryError

if TYPE_CHECKING:  # the task classes load with the tasks a command checks or fetches (`harness --help` imports this module)
    from rich.table import Table

    from opd_harness.task import DataNeed

Status = Literal["ok", "missing", "invalid", "error"]  # error: the download itself failed (network, hub), not the data


class DataFetchError(RuntimeError):
    """A download failed (status ``error``) or gave data the task's loader refuses (``invalid``); nothing was moved in."""

    def __init__(self, message: str, status: Status) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class CheckResult:
    """What ``check`` found for one DataNeed."""

    need: DataNeed
    status: Status
    files: tuple[Path, ...] = ()
    rows: int | None = None
    detail: str = ""


# --------------------------------------------------------------------------- declarations


def needs_of(task_name: str) -> tuple[DataNeed, ...]:
    """The data needs a registered task declares (() for tasks that read no files, e.g. generated ones)."""
    return tuple(TASKS.get(task_name).data_needs())


def all_needs() -> dict[str, tuple[DataNeed, ...]]:
    """task name -> needs, for every registered task that reads files."""
    return {name: needs for name in TASKS.names() if (needs := needs_of(name))}


def matching_files(folder: Path, need: DataNeed) -> tuple[list[Path], list[str]]:
    """(files of ``need`` present under ``folder``, patterns that matched nothing)."""
    found: list[Path] = []
    missing: list[str] = []
    for pattern in need.files:
        hits = sorted(p for p in folder.glob(pattern) if p.is_file())
        found.extend(hits)
        if not hits:
            missing.append(pattern)
    return found, missing


# --------------------------------------------------------------------------- check


def check_need(folder: Path, need: DataNeed) -> CheckResult:
    """Validate one split in ``folder`` with the task's own loader and the declared row counts."""
    files, missing = matching_files(folder, need)
    if missing:
        return CheckResult(need, "missing", tuple(files), detail=f"no {', '.join(missing)}")
    try:
        rows = len(need.load(folder))
    except Exception as exc:  # noqa: BLE001 - any loader failure makes the copy invalid; its message names file:line:field
        return CheckResult(need, "invalid", tuple(files), detail=f"{type(exc).__name__}: {exc}")
    if need.rows and rows not in need.rows:
        expected = " or ".join(str(n) for n in need.rows)
        return CheckResult(need, "invalid", tuple(files), rows, f"{rows} problems, expected {expected}")
    return CheckResult(need, "ok", tuple(files), rows)


def check_folder(folder: Path, tasks: Iterable[str] | None = None) -> list[CheckResult]:
    """One CheckResult per declared split of ``tasks`` (default: every task that reads files)."""
    chosen = {name: needs_of(name) for name in tasks} if tasks else all_needs()
    return [check_need(folder, need) for needs in chosen.values() for need in needs]


def unknown_entries(folder: Path, results: Iterable[CheckResult]) -> list[str]:
    """Top-level folders and files of ``folder`` that no task declares (e.g. data of another tool)."""
    known = {pattern.split("/")[0] for needs in all_needs().values() for need in needs for pattern in need.files}
    known |= {r.need.task for r in results}
    return sorted(p.name for p in folder.iterdir() if p.name not in known and not p.name.startswith(".") and not _is_doc(p))


def _is_doc(path: Path) -> bool:
    return path.is_file() and any(fnmatch(path.name, pat) for pat in ("*.md", "*.txt", "LICENSE*"))


# --------------------------------------------------------------------------- fetch


def fetch_need(folder: Path, need: DataNeed, *, force: bool = False) -> CheckResult:
    """Download one split into ``folder`` unless a valid copy is there; validated in staging, then moved in."""
    if not force:
        present = check_need(folder, need)
        if present.status == "ok":
            return CheckResult(need, "ok", present.files, present.rows, "already present (--force downloads again)")
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".fetch-{need.task}-", dir=folder))
    try:
        try:
            need.fetch(staging)
        except Exception as exc:  # noqa: BLE001 - network, hub and library failures end in one message
            raise DataFetchError(f"download from {need.source} failed: {type(exc).__name__}: {exc}", "error") from exc
        result = check_need(staging, need)
        if result.status != "ok":
            detail = result.detail.replace(str(staging), "<download>")  # the staged copy is removed; name the file in it
            raise DataFetchError(f"the download from {need.source} is {result.status}: {detail}", "invalid")
        placed = []
        for path in result.files:
            target = folder / path.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
            placed.append(target)
        return CheckResult(need, "ok", tuple(placed), result.rows, f"fetched from {need.source}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------- helpers for the tasks' fetch functions


def show_progress() -> bool:
    """Progress bars only on a terminal (logs and pipes stay clean)."""
    return sys.stderr.isatty()


def write_rows(path: Path, rows: Iterable[Mapping[str, Any]]) -> int:
    """Write rows as JSON lines (``.jsonl``) or Parquet (``.parquet``); returns the number written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    return len(rows)


def download_hub_files(repo_id: str, pattern: str, dest: Path, *, revision: str | None = None) -> list[Path]:
    """Copy every file of a hub dataset repo matching ``pattern`` (top level) into ``dest``; progress bars on a terminal."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    (enable_progress_bars if show_progress() else disable_progress_bars)()
    names = [f for f in HfApi().list_repo_files(repo_id, repo_type="dataset", revision=revision) if "/" not in f and fnmatch(f, pattern)]
    if not names:
        raise FileNotFoundError(f"hf:{repo_id} has no file matching {pattern!r}")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name in sorted(names):
        cached = hf_hub_download(repo_id, name, repo_type="dataset", revision=revision)
        shutil.copyfile(cached, dest / name)
        written.append(dest / name)
    return written


def hub_dataset_rows(dataset: str, config: str | None, split: str) -> Iterable[dict]:
    """Rows of a hub dataset split through ``datasets.load_dataset`` (progress bars on a terminal)."""
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(f"{exc}: reading a hub dataset needs `datasets` (pip install 'opd-harness[lmeval]')") from None

    (datasets.enable_progress_bars if show_progress() else datasets.disable_progress_bars)()
    return datasets.load_dataset(dataset, config, split=split)


def download_url(url: str, dest: Path, *, gunzipped_sha256: str | None = None, timeout: float = 60.0) -> Path:
    """Download ``url`` to ``dest`` (progress bar on a terminal); check the SHA-256 of its gunzipped content if given."""
    import urllib.request

    from tqdm import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    request = urllib.request.Request(url, headers={"User-Agent": "opd-harness"})
    with urllib.request.urlopen(request, timeout=timeout) as response, dest.open("wb") as out:
        total = int(response.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, desc=dest.name, disable=not show_progress()) as bar:
            while chunk := response.read(1 << 20):
                out.write(chunk)
                bar.update(len(chunk))
    if gunzipped_sha256:
        digest = hashlib.sha256()
        with gzip.open(dest, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        if digest.hexdigest() != gunzipped_sha256:
            raise ValueError(f"{url}: content SHA-256 {digest.hexdigest()[:16]}…, expected {gunzipped_sha256[:16]}… (a different release?)")
    return dest


# --------------------------------------------------------------------------- the commands (harness data fetch / check)

def default_folder() -> Path:
    """Where ``fetch`` writes without ``--to``: the tasks' data root, ``$HARNESS_DATA_DIR``, else ``./data``."""
    return resolve_data_dir()[0]


def _fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` on stderr and return the Exit to raise (2: bad input; 1: a failed download or check)."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(code)


def _known_tasks(tasks: Iterable[str]) -> list[str]:
    """The named tasks, each registered and reading files; otherwise a usage error (exit 2) naming it."""
    readers = all_needs()
    for name in tasks:
        try:
            TASKS.get(name)
        except RegistryError as exc:
            raise _fail(str(exc)) from None
        if name not in readers:
            raise _fail(f"task {name!r} reads no data files (tasks that do: {', '.join(sorted(readers))})")
    return list(dict.fromkeys(tasks))


def _table(results: list[CheckResult], folder: Path) -> Table:
    """A table of check/fetch results: task, split, status, problems, files (what is wrong is printed below it)."""
    from rich.table import Table

    colour = {"ok": "green", "missing": "yellow", "invalid": "bold red", "error": "bold red"}
    table = Table("task", "split", "status", "problems", "files")
    for r in results:
        files = ", ".join(str(p.relative_to(folder)) if p.is_relative_to(folder) else str(p) for p in r.files)
        note = r.detail if r.status == "missing" or (r.status == "ok" and r.detail) else ""
        rows = "" if r.rows is None else str(r.rows)
        table.add_row(
            r.need.task, r.need.split, f"[{colour[r.status]}]{r.status}[/]", rows, escape("; ".join(x for x in (files, note) if x))
        )
    return table


def _print_problems(results: list[CheckResult]) -> None:
    """One unwrapped line per invalid or failed split, so its file:line:field message stays whole."""
    for r in results:
        if r.status in ("invalid", "error"):
            out.print(f"{r.status}: {r.need.task} [{r.need.split}]: {r.detail}", markup=False, highlight=False, soft_wrap=True)


data_app = typer.Typer(
    help="Benchmark files: download them into the layout the tasks read, check a data folder.",
    epilog="Example: harness data fetch math500 --to data",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(stderr=True)
out = Console() if sys.stdout.isatty() else Console(width=160)


@data_app.command("check", epilog="Example: harness data check data math500 aime24")
def check(
    folder: Annotated[Path, typer.Argument(help="data folder to validate")],
    tasks: Annotated[list[str] | None, typer.Argument(help="only these tasks (then a missing one is an error)")] = None,
) -> None:
    """Validate a data folder (layout, rows via each task's loader, ids, row counts); list what is present and missing.

    Exit 1 when a present split is invalid or a task named here is missing; missing tasks are only listed otherwise.
    """
    if not folder.is_dir():
        raise _fail(f"data folder {folder} does not exist (create it with `harness data fetch TASK --to {folder}`)")
    named = _known_tasks(tasks or [])
    results = check_folder(folder, named or None)
    out.print(_table(results, folder))
    _print_problems(results)
    unknown = unknown_entries(folder, results)
    if unknown:
        out.print(f"not read by any task: {', '.join(unknown)}", highlight=False, markup=False)
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "missing", "invalid")}
    out.print(f"{folder}: {counts['ok']} ok, {counts['missing']} missing, {counts['invalid']} invalid", highlight=False, markup=False)
    if counts["missing"] and not named:
        missing = sorted({r.need.task for r in results if r.status == "missing"})
        out.print(
            f"fetch the missing ones with: harness data fetch {' '.join(missing)} --to {folder}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    if counts["invalid"] or (named and counts["missing"]):
        raise typer.Exit(1)


@data_app.command("fetch", epilog="Example: harness data fetch math500 aime24 humaneval_plus --to data")
def fetch(
    tasks: Annotated[list[str], typer.Argument(help="tasks whose files to download (see `harness data check DIR`)")],
    to: Annotated[Path | None, typer.Option("--to", help=f"data folder (default ${DATA_DIR_ENV}, else ./data)")] = None,
    force: Annotated[bool, typer.Option("--force", help="download again even when a valid copy is present")] = False,
) -> None:
    """Download TASK... from the Hugging Face hub (evalplus: its release) into DIR/<task>/<file>, validated first.

    Each split is downloaded into a staging folder, loaded with the task's own loader and counted, and only then
    moved into place: a failed or invalid download writes nothing. Exit 1 when any download fails.
    """
    folder = to if to is not None else default_folder()
    if folder.exists() and not folder.is_dir():
        raise _fail(f"--to {folder} is a file, not a folder")
    names = _known_tasks(tasks)
    created = not folder.exists()
    results: list[CheckResult] = []
    for name in names:
        for need in needs_of(name):
            console.print(
                f"{name} [{need.split}]: {need.source} -> {folder}/{', '.join(need.files)}", highlight=False, markup=False, soft_wrap=True
            )
            try:
                results.append(fetch_need(folder, need, force=force))
            except DataFetchError as exc:
                results.append(CheckResult(need, exc.status, detail=str(exc)))
    if created and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()  # nothing fetched: leave no empty folder behind
    out.print(_table(results, folder))
    _print_problems(results)
    failed = sum(r.status != "ok" for r in results)
    if failed:
        out.print(f"{failed} download(s) failed; nothing of them was written to {folder}", highlight=False, markup=False)
        raise typer.Exit(1)


if __name__ == "__main__":  # `python -m opd_harness.data ...` runs the same commands as `harness data ...`
    data_app()
