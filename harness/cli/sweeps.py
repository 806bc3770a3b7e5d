"""``harness sweep``, ``harness report`` and ``harness reproduce``: grids of runs and the papers' recipes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from opd_harness.errors import ConfigError

if TYPE_CHECKING:  # the config models and the task classes are imported by the commands that use them (start-up)
    pass


from opd_harness.cli.run import _dry_run
from opd_harness.cli import options as opts
from opd_harness.cli._common import app, console, stdout, _fail, _quiet_libraries


@app.command(epilog="Example: harness sweep benchmarks/f_opd_cpu_study.yaml --out results --dry-run")
def sweep(
    file: Annotated[Path, typer.Argument(help="sweep YAML: base (preset/config/set) and grid (dotted key -> list of values)")],
    out: opts.ResultsRoot = Path("results"),
    dry_run: Annotated[bool, typer.Option("--dry-run", help="validate every grid point and list what would run or be skipped")] = False,
) -> None:
    """Run a grid of training runs (methods x modes x seeds x lags ...) sequentially; re-running continues it, and a second
    process started on the same sweep and --out runs the points the first is not running."""
    from opd_harness.report import render_markdown, write_report
    from opd_harness.sweep import run_sweep

    _quiet_libraries()
    try:
        result = run_sweep(file, out, dry_run=dry_run, console=console)
    except ConfigError as exc:  # SweepError included: bad file or grid point, nothing was run
        raise _fail(str(exc)) from None
    except KeyboardInterrupt:
        raise _fail(f"interrupted; continue with: harness sweep {file} --out {out}", 130) from None
    if dry_run:
        return
    console.print(
        f"sweep {result.sweep_id}: {len(result.ran)} run, {len(result.skipped)} already done, "
        f"{len(result.failed)} failed, {len(result.elsewhere)} running in another process → {result.record_path}"
    )
    sys.stdout.write(render_markdown(write_report(out, result.sweep_id)))
    if result.failed:
        raise _fail(f"{len(result.failed)} run(s) failed: {', '.join(result.failed)}; re-run the sweep to resume them", 1)


@app.command(epilog="Example: harness report f-opd-cpu-study --out results --format md")
def report(
    sweep_id: Annotated[str, typer.Argument(help="sweep id (the sweep file's `id`, default its stem)")],
    out: opts.ResultsRoot = Path("results"),
    format_: Annotated[str, typer.Option("--format", help="md or json")] = "md",
    json_: Annotated[bool, typer.Option("--json", help="print the report as JSON to stdout (--format json)")] = False,
    task: Annotated[str | None, typer.Option(help="evaluation task (default: the training task)")] = None,
    collapse_threshold: Annotated[float, typer.Option(help="a run collapsed when final Avg@k < this x its peak Avg@k")] = 0.5,
    baseline_method: Annotated[str, typer.Option(help="sync method for relative throughput when a row has no sync run of its own")] = "opd",
) -> None:
    """Paper-style tables of a sweep (final/peak Avg@k, peak-final drop, collapse ratio, relative throughput, lag) and the lag curve PNG."""
    from opd_harness.report import render_json, render_markdown, write_report
    from opd_harness.sweep import SweepError

    if json_:
        if format_ not in ("md", "json"):
            raise _fail(f"--json and --format {format_}: give one of them")
        format_ = "json"
    if format_ not in ("md", "json"):
        raise _fail(f"--format {format_!r}: choose md or json")
    if not 0 < collapse_threshold <= 1:
        raise _fail(f"--collapse-threshold {collapse_threshold}: must be in (0, 1]")
    try:
        result = write_report(out, sweep_id, task=task, collapse_threshold=collapse_threshold, baseline_method=baseline_method)
    except SweepError as exc:
        raise _fail(str(exc)) from None
    sys.stdout.write(render_markdown(result) if format_ == "md" else render_json(result) + "\n")


@app.command(epilog="Example: harness reproduce f-opd --scale cpu --dry-run")
def reproduce(
    name: Annotated[str, typer.Argument(help="recipe: f-opd, sod, saf-opd, ap-opd (entry points opd_harness.recipes)")],
    scale: Annotated[str, typer.Option(help="cpu (a miniature that runs on CPU) or paper (the paper's grid)")] = "cpu",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the grid, runs, sources and resources; run nothing")] = False,
    out: opts.ResultsRoot = Path("results"),
    set_: Annotated[list[str] | None, typer.Option("--set", help="extra dotted override KEY=VALUE for every run, repeatable")] = None,
) -> None:
    """Run a paper's recipe through the sweep machinery (resumable), print its tables and check its claims."""
    from opd_harness.reproduce import SCALES, reproduce as reproduce_recipe

    if scale not in SCALES:
        raise _fail(f"--scale {scale!r}: choose one of {', '.join(SCALES)}")
    _quiet_libraries()
    try:
        result = reproduce_recipe(name, scale, out, dry_run=dry_run, overrides=set_, console=console)
    except ConfigError as exc:  # RecipeError and SweepError included: nothing was run
        raise _fail(str(exc)) from None
    except KeyboardInterrupt:
        raise _fail(f"interrupted; continue with: harness reproduce {name} --scale {scale} --out {out}", 130) from None
    if isinstance(result, str):
        sys.stdout.write(result)
        sys.stdout.flush()
        _recipe_plans(name, scale, set_)
        return
    sys.stdout.write(result.markdown)
    console.print(f"report, claims and plots: {result.folder}")
    if result.elsewhere:
        console.print(f"{len(result.elsewhere)} run(s) were running in another process and are not in these tables yet; "
                      f"re-run when it ends: harness reproduce {name} --scale {scale} --out {out}")  # fmt: skip
    if result.failed:
        raise _fail(f"{len(result.failed)} run(s) failed: {', '.join(result.failed)}; re-run to resume them", 1)


def _recipe_plans(name: str, scale: str, overrides: list[str] | None) -> None:
    """``harness reproduce --dry-run`` of a scale that names a layout: each distinct run's ``harness run --dry-run`` plan
    (models, the pair, the teacher, the memory plan; the data is checked when the runs start), printed once with how many
    runs share it; exit 2 at the first plan that fails."""
    from opd_harness.reproduce import distinct_plans, load_recipe

    try:
        recipe = load_recipe(name)
        if not recipe.scales[scale].layout:
            return
        plans = distinct_plans(recipe, scale, overrides)
        for number, (point, count) in enumerate(plans, 1):
            stdout.print(f"\n## plan {number} of {len(plans)}: run [{point.index}] {escape(point.label())} (and {count - 1} more "
                         f"run(s) with the same models, method, tasks and placement; data not checked here)", highlight=False)  # fmt: skip
            _dry_run(point.plan, None, False, skip=("data",))
    except ConfigError as exc:
        raise _fail(str(exc)) from None


