"""``harness export`` / ``harness import`` (opd_harness.transfer): finished runs carried to another results root keep
every stored row, a sweep there skips them as done, and a bad file or a clashing point changes nothing in the target."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.store import TABLES, Store
from opd_harness.sweep import run_sweep, sweep_record_path

runner = CliRunner()
SWEEP = """\
id: carried
base:
  preset: smoke
  set: {threads: 1, eval.teacher: false, trainer.steps: 2, trainer.checkpoint_every: 2}
grid:
  - {method: [opd], seed: [SEEDS]}
"""


def flat(text: str) -> str:
    return " ".join(text.split())


def write_spec(folder: Path, seeds: str) -> Path:
    path = folder / f"carried-{seeds.replace(', ', '-')}.yaml"
    path.write_text(SWEEP.replace("SEEDS", seeds))
    return path


def snapshot(root: Path) -> dict:
    """Every row of every run in ``root`` and its sweep records: what "nothing changed" compares."""
    with Store(root) as store:
        rows = {r["run_id"]: store.run_rows(r["run_id"]) for r in store.runs()}
    records = {p.name: p.read_text() for p in sorted((root / "sweeps").glob("*.json"))} if (root / "sweeps").exists() else {}
    return {"rows": rows, "records": records}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A real two-point sweep (smoke preset, 2 steps) run into its own root."""
    folder = tmp_path_factory.mktemp("transfer")
    spec = write_spec(folder, "0, 1")
    out = folder / "machine-a"
    result = run_sweep(spec, out)
    assert result.failed == [] and len(result.ran) == 2
    return spec, out, result.ran


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    spec, out, run_ids = source
    path = tmp_path_factory.mktemp("files") / "part-a.jsonl.gz"
    res = runner.invoke(app, ["export", str(path), "--sweep", "carried", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return path


@pytest.mark.slow
def test_imported_runs_have_every_row_and_a_sweep_skips_them(source, exported, tmp_path):
    spec, out_a, run_ids = source
    out_b = tmp_path / "machine-b"
    res = runner.invoke(app, ["import", str(exported), "--out", str(out_b)])
    assert res.exit_code == 0, res.output
    with Store(out_a) as a, Store(out_b) as b:
        for run_id in run_ids:
            theirs, ours = a.run_rows(run_id), b.run_rows(run_id)
            assert all(len(theirs[t]) > 0 for t in TABLES)  # the run has rows in every table, so the comparison bites
            assert ours == theirs
        assert b.get_run(run_ids[0])["config"] == a.get_run(run_ids[0])["config"]
    again = run_sweep(spec, out_b)
    assert again.ran == [] and sorted(again.skipped) == sorted(run_ids)
    record = json.loads(sweep_record_path(out_b, "carried").read_text())
    assert [p["run_id"] for p in record["points"]] == run_ids and {p["status"] for p in record["points"]} == {"done"}


@pytest.mark.slow
def test_importing_twice_changes_nothing_and_two_parts_merge(source, exported, tmp_path):
    spec, out_a, run_ids = source
    out_b = tmp_path / "merged"
    parts = []
    for run_id in run_ids:  # one file a run, as two machines would each write theirs
        parts.append(tmp_path / f"{run_id}.jsonl.gz")
        assert runner.invoke(app, ["export", str(parts[-1]), run_id, "--out", str(out_a)]).exit_code == 0
    assert runner.invoke(app, ["import", str(parts[0]), "--out", str(out_b)]).exit_code == 0
    assert runner.invoke(app, ["import", *map(str, parts), "--out", str(out_b)]).exit_code == 0
    before = snapshot(out_b)
    assert runner.invoke(app, ["import", *map(str, parts), "--out", str(out_b)]).exit_code == 0
    assert snapshot(out_b) == before
    assert sorted(before["rows"]) == sorted(run_ids)
    assert run_sweep(spec, out_b).skipped == run_ids


@pytest.mark.slow
def test_a_point_that_already_has_another_run_refuses_the_whole_import(source, exported, tmp_path):
    spec, out_a, run_ids = source
    out_c = tmp_path / "machine-c"
    own = run_sweep(write_spec(tmp_path, "0"), out_c)  # the same sweep id and seed-0 point, run here
    assert len(own.ran) == 1 and own.ran[0] not in run_ids
    before = snapshot(out_c)
    res = runner.invoke(app, ["import", str(exported), "--out", str(out_c)])
    assert res.exit_code == 2
    assert f"has run {own.ran[0]}, not {run_ids[0]}" in flat(res.output)
    assert snapshot(out_c) == before  # the seed-1 run, which clashes with nothing, was not imported either
    theirs = tmp_path / "c.jsonl.gz"  # C's run and A's, both for the seed-0 point, into a root that has neither
    assert runner.invoke(app, ["export", str(theirs), "--out", str(out_c)]).exit_code == 0
    res = runner.invoke(app, ["import", str(exported), str(theirs), "--out", str(tmp_path / "fresh")])
    assert res.exit_code == 2 and f"runs {run_ids[0]} and {own.ran[0]} in the files" in flat(res.output)
    with Store(tmp_path / "fresh") as store:
        assert store.runs() == []


@pytest.mark.slow
def test_unfinished_runs_are_not_exported(source, tmp_path):
    _, out_a, run_ids = source
    out = tmp_path / "copy"
    shutil.copytree(out_a, out)
    with Store(out) as store:
        store.set_status(run_ids[1], "interrupted")
    path = tmp_path / "x.jsonl.gz"
    res = runner.invoke(app, ["export", str(path), run_ids[1], "--out", str(out)])
    assert res.exit_code == 2 and f"run {run_ids[1]} is interrupted" in flat(res.output)
    assert not path.exists() and not path.with_name(path.name + ".part").exists()
    path.write_text("kept")  # an existing file is never overwritten
    res = runner.invoke(app, ["export", str(path), run_ids[0], "--out", str(out)])
    assert res.exit_code == 2 and "exists" in flat(res.output) and path.read_text() == "kept"


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of runs file ``src`` with its decoded lines passed through ``edit`` (a list in, a list of lines out)."""
    with gzip.open(src, "rt") as handle:
        lines = [json.loads(line) for line in handle]
    with gzip.open(dst, "wt") as handle:
        handle.writelines(line if isinstance(line, str) else json.dumps(line) + "\n" for line in edit(lines))
    return dst


def _set_row(lines: list, index: int, **changes) -> list:
    lines[index] = {**lines[index], **changes}
    return lines


BAD_FILES = {
    "format": (lambda ls: _set_row(ls, 0, format="something-else"), ":1: format: 'something-else'"),
    "version": (lambda ls: _set_row(ls, 0, version=99), ":1: version: 99"),
    "table": (lambda ls: _set_row(ls, 3, table="secrets"), ":4: table: 'secrets'"),
    "foreign run": (lambda ls: _set_row(ls, 2, row={**ls[2]["row"], "run_id": "other"}), ":3: row.run_id: 'other'"),
    "not json": (lambda ls: [*(json.dumps(x) + "\n" for x in ls[:5]), "{oops\n"], ":6: not valid JSON"),
    "column": (lambda ls: _set_row(ls, 4, row={**ls[4]["row"], "score; DROP TABLE runs": 1}), "has no such column"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_runs_file_names_its_line_and_field_and_writes_nothing(source, exported, tmp_path, case):
    spec, out_a, run_ids = source
    edit, message = BAD_FILES[case]
    bad = _rewrite(exported, tmp_path / "bad.jsonl.gz", edit)
    target = tmp_path / "target"
    first = tmp_path / "first.jsonl.gz"
    assert runner.invoke(app, ["export", str(first), run_ids[0], "--out", str(out_a)]).exit_code == 0
    assert runner.invoke(app, ["import", str(first), "--out", str(target)]).exit_code == 0
    before = snapshot(target)
    res = runner.invoke(app, ["import", str(bad), "--out", str(target)])
    assert res.exit_code == 2, res.output
    if message.startswith(":"):
        assert f"{bad}{message}" in flat(res.output)
    else:
        assert message in flat(res.output) and str(bad) in flat(res.output)
    assert snapshot(target) == before


def test_a_file_that_is_not_a_runs_file_is_refused(tmp_path):
    path = tmp_path / "plain.jsonl.gz"
    path.write_text("not gzip")
    res = runner.invoke(app, ["import", str(path), "--out", str(tmp_path / "r")])
    assert res.exit_code == 2 and "not a runs file written by `harness export`" in flat(res.output)
