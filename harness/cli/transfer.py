"""``harness export`` and ``harness import``: finished runs carried between results roots (machines, sessions) as one file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from opd_harness.cli import options as opts
from opd_harness.cli._common import _fail, app, console
from opd_harness.errors import ConfigError


@app.command(epilog="Example: harness export part-a.jsonl.gz --sweep sod-cpu --out results")
def export(
    file: Annotated[Path, typer.Argument(help="the runs file to write (gzipped JSON lines; e.g. part-a.jsonl.gz)")],
    run_ids: Annotated[
        list[str] | None, typer.Argument(help="finished runs to export (default: every finished run of --sweep, or of the root)")
    ] = None,
    sweep: Annotated[str | None, typer.Option(help="export this sweep's (or recipe's, e.g. sod-cpu) finished runs")] = None,
    out: opts.ResultsRoot = Path("results"),
) -> None:
    """Write finished runs (every stored row, and their places in sweeps) to one file that `harness import` reads elsewhere."""
    from opd_harness.store import Store
    from opd_harness.sweep import load_sweep_record
    from opd_harness.transfer import export_runs, finished_runs

    if not (out / "results.sqlite").is_file():
        raise _fail(f"--out {out}: no results store at {out / 'results.sqlite'}")
    if run_ids and sweep:
        raise _fail("give run ids or --sweep, not both")
    if file.exists():
        raise _fail(f"{file} exists: export to a new file (nothing is overwritten)")
    if not file.parent.is_dir():
        raise _fail(f"{file}: no folder {file.parent}")
    try:
        points = load_sweep_record(out, sweep).get("points", []) if sweep else None
        with Store(out) as store:
            chosen = finished_runs(store, run_ids, points)
        if not chosen:
            raise _fail(f"no finished runs to export in {out}" + (f" (sweep {sweep})" if sweep else ""))
        n = export_runs(out, file, chosen)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    console.print(f"{len(chosen)} run(s), {n} rows → {file}")


@app.command("import", epilog="Example: harness import part-a.jsonl.gz part-b.jsonl.gz --out results")
def import_(
    files: Annotated[list[Path], typer.Argument(help="runs files written by `harness export`")],
    out: opts.ResultsRoot = Path("results"),
) -> None:
    """Add exported runs to a results root: a sweep or recipe run there then skips them as done and reports them."""
    from opd_harness.transfer import import_runs

    for file in files:
        if not file.is_file():
            raise _fail(f"{file}: no such file")
    try:
        run_ids = import_runs(files, out)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    console.print(f"{len(run_ids)} run(s) imported into {out}: {', '.join(run_ids)}")
