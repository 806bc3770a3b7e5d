"""SWE-bench rows: loading and validating them, and finding each instance's repository tree and environment.

Rows come from a local file (CSV, JSON, JSONL, Parquet), a ``datasets.save_to_disk`` folder, or the hub
(``princeton-nlp/SWE-bench_Verified``); every row is checked (a bad one names file, row and field). Trees come
from ``repo_source``: a snapshot folder (``<id>/repo.tar.xz`` + ``<id>/environment.yml``), a folder of git
mirrors (``<owner>__<name>[.git]``, archived at ``base_commit``), or ``github`` (cloned once into the cache).
"""

from __future__ import annotations

import csv
import json
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from opd_harness.task import DataError, DataNotFound, read_jsonl

HUB_DATASET = "princeton-nlp/SWE-bench_Verified"
LOCAL_FILES = ("verified_mini_50.csv", "verified_mini_hf", "verified.jsonl")  # under <data dir>/swebench, tried in this order
REQUIRED = ("repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement", "version", "FAIL_TO_PASS", "PASS_TO_PASS")
OPTIONAL = ("hints_text", "created_at", "environment_setup_commit")
LIST_FIELDS = ("FAIL_TO_PASS", "PASS_TO_PASS")


def validate_row(raw: Mapping[str, Any], where: Path | str, line: int) -> dict[str, Any]:
    """One row with every required field a non-empty string (the patch may not be empty) and FAIL_TO_PASS /
    PASS_TO_PASS lists of test names (JSON strings in the files); DataError naming file, row and field."""
    row: dict[str, Any] = {}
    for name in REQUIRED:
        value = raw.get(name)
        if value is None:
            raise DataError(where, line, name, "missing")
        if name in LIST_FIELDS:
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise DataError(where, line, name, f"not a JSON list ({exc.msg})") from None
            if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
                raise DataError(where, line, name, "must be a list of test names")
        elif not isinstance(value, str):
            raise DataError(where, line, name, f"must be a string, got {type(value).__name__}")
        elif not value.strip() and name not in ("problem_statement",):
            raise DataError(where, line, name, "is empty")
        row[name] = value
    if not row["FAIL_TO_PASS"]:
        raise DataError(where, line, "FAIL_TO_PASS", "is empty: an instance needs at least one test the fix makes pass")
    if "/" not in row["repo"]:
        raise DataError(where, line, "repo", f"must be owner/name, got {row['repo']!r}")
    for name in OPTIONAL:
        if raw.get(name) is not None:
            row[name] = str(raw[name])
    return row


def _raw_rows(path: Path) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """(row number: the line in text files, else the 1-based index; raw row) of a local file or save_to_disk folder."""
    if path.is_dir():
        from datasets import DatasetDict, load_from_disk

        ds = load_from_disk(str(path))
        if isinstance(ds, DatasetDict):
            ds = ds["test"] if "test" in ds else next(iter(ds.values()))
        yield from enumerate(ds, start=1)
    elif path.suffix == ".csv":
        csv.field_size_limit(1 << 30)
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            start = reader.line_num + 1
            for raw in reader:
                yield start, raw
                start = reader.line_num + 1
    elif path.suffix in (".jsonl", ".gz"):
        yield from read_jsonl(path)
    elif path.suffix == ".json":
        rows = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rows, list):
            raise DataError(path, 1, "<file>", "must be a JSON list of rows")
        yield from enumerate(rows, start=1)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(path).to_pylist(), start=1)
    else:
        raise DataError(path, 0, "<file>", "unknown format (use .csv, .json, .jsonl, .parquet or a save_to_disk folder)")


def load_rows(path: Path) -> list[dict[str, Any]]:
    """Validated rows of a local file or folder; a repeated instance_id is a DataError."""
    rows, seen = [], {}
    for line, raw in _raw_rows(path):
        if not isinstance(raw, Mapping):
            raise DataError(path, line, "<row>", "not an object")
        row = validate_row(raw, path, line)
        if row["instance_id"] in seen:
            raise DataError(path, line, "instance_id", f"{row['instance_id']!r} repeats row {seen[row['instance_id']]}")
        seen[row["instance_id"]] = line
        rows.append(row)
    return rows


def load_hub_rows(dataset: str = HUB_DATASET, split: str = "test") -> list[dict[str, Any]]:
    """Validated rows of a hub dataset (needs network access to the Hugging Face hub)."""
    from datasets import load_dataset

    return [validate_row(raw, f"hf:{dataset}[{split}]", i) for i, raw in enumerate(load_dataset(dataset, split=split), start=1)]


def find_rows_file(data_dir: Path) -> Path | None:
    """The first of ``LOCAL_FILES`` under ``data_dir/swebench``."""
    for name in LOCAL_FILES:
        if (data_dir / "swebench" / name).exists():
            return data_dir / "swebench" / name
    return None


def fetch_hub(folder: Path, dataset: str = HUB_DATASET) -> None:
    """``harness data fetch swebench``: the hub dataset's rows, validated, as ``folder/swebench/verified.jsonl``."""
    rows = load_hub_rows(dataset)
    out = folder / "swebench" / "verified.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def load_local(folder: Path) -> list[dict[str, Any]]:
    """The rows of the first local file under ``folder/swebench``; DataNotFound naming the files looked for."""
    path = find_rows_file(folder)
    if path is None:
        raise DataNotFound(f"swebench: none of {', '.join(LOCAL_FILES)} under {folder / 'swebench'}")
    return load_rows(path)


# --------------------------------------------------------------------------- repository sources


def snapshot_ids(folder: Path) -> set[str]:
    """Instance ids that have a snapshot (``<id>/repo.tar.xz``) in ``folder``."""
    return {p.parent.name for p in folder.glob("*/repo.tar*")} if folder.is_dir() else set()


def environment_yml(source: Path | str, instance_id: str) -> str | None:
    """The instance's frozen ``environment.yml`` from a snapshot folder, or None."""
    if isinstance(source, Path) and (source / instance_id / "environment.yml").is_file():
        return (source / instance_id / "environment.yml").read_text(encoding="utf-8")
    return None


def repo_tarball(source: Path | str, row: Mapping[str, Any], cache_dir: Path) -> Path:
    """A tar of the repository tree at ``base_commit``: the snapshot's own, or ``git archive`` of a mirror (``github``:
    a mirror cloned into ``cache_dir/mirrors`` first). DataNotFound when the source has neither."""
    iid, repo, commit = row["instance_id"], row["repo"], row["base_commit"]
    if isinstance(source, Path):
        for name in ("repo.tar.xz", "repo.tar.gz", "repo.tar"):
            if (source / iid / name).is_file():
                return source / iid / name
        mirror = next((m for m in (source / repo.replace("/", "__"), source / f"{repo.replace('/', '__')}.git") if m.is_dir()), None)
        if mirror is None:
            raise DataNotFound(
                f"{iid}: no snapshot {source / iid / 'repo.tar.xz'} and no git mirror {source / repo.replace('/', '__')}[.git]"
            )
    else:  # github
        mirror = cache_dir / "mirrors" / f"{repo.replace('/', '__')}.git"
        if not mirror.is_dir():
            mirror.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "clone", "--mirror", "--quiet", f"https://github.com/{repo}.git", str(mirror)], check=True, timeout=3600)
    out = cache_dir / "trees" / f"{iid}-{commit[:12]}.tar"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_suffix(".partial")
        with open(part, "wb") as f:
            proc = subprocess.run(
                ["git", "-C", str(mirror), "archive", "--format=tar", commit], stdout=f, stderr=subprocess.PIPE, timeout=600
            )
        if proc.returncode != 0:
            part.unlink(missing_ok=True)
            raise DataNotFound(f"{iid}: git archive {commit} in {mirror} failed: {proc.stderr.decode(errors='replace')[-300:]}")
        part.replace(out)
    return out
