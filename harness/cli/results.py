"""``harness leaderboard``, ``harness gate`` and ``harness view``: reading the results store."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from opd_harness.cli import options as opts
from opd_harness.errors import ConfigError
from opd_harness.jsonout import to_json

if TYPE_CHECKING:  # the config models and the task classes are imported by the commands that use them (start-up)
    pass


from opd_harness.cli._common import app, console, stdout, _fail, open_interval, check_data_dir, _quiet_libraries


@app.command(epilog="Example: harness leaderboard results --format html --out board.html")
def leaderboard(
    directories: Annotated[
        list[Path] | None, typer.Argument(help="results roots holding results.sqlite (several merge into one board; default: results)")
    ] = None,
    format_: Annotated[str, typer.Option("--format", help="table, md, csv, json, or html (one self-contained page with plots)")] = "table",
    json_: Annotated[bool, typer.Option("--json", help="print the rows as JSON to stdout (--format json)")] = False,
    run: Annotated[list[str] | None, typer.Option(help="only these run ids (repeatable; not for html)")] = None,
    out: Annotated[Path | None, typer.Option(help="write to this file instead of stdout")] = None,
    baseline_method: Annotated[str, typer.Option(help="html: the sync method relative throughput is normalised to")] = "opd",
    collapse_threshold: Annotated[float, typer.Option(help="html: a run collapsed when final Avg@k < this x its peak Avg@k")] = 0.5,
) -> None:
    """Runs × checkpoints × tasks with Avg@k ± 95% CI and throughput; ``--format html`` gives a page with plots and a drill-down per run."""
    from opd_harness.leaderboard import leaderboard_rows, render_csv, render_json, render_markdown, render_table
    from opd_harness.store import Store

    roots = directories or [Path("results")]
    renderers = {"md": render_markdown, "csv": render_csv, "json": render_json}
    if json_:
        if format_ not in ("table", "json"):
            raise _fail(f"--json and --format {format_}: give one of them")
        format_ = "json"
    if format_ not in {"table", "html", *renderers}:
        raise _fail(f"--format {format_!r}: choose one of table, md, csv, json, html")
    for root in roots:
        if not (root / "results.sqlite").is_file():
            raise _fail(f"no results store at {root / 'results.sqlite'}")
    if format_ == "html":
        from opd_harness.leaderboard_page import write_html

        if run:
            raise _fail("--run filters the text formats; the html page shows every run of the given roots")
        if not 0 < collapse_threshold <= 1:
            raise _fail(f"--collapse-threshold {collapse_threshold}: must be in (0, 1]")
        if out is None:
            raise _fail("--format html needs --out FILE (e.g. --out board.html)")
        path = write_html(roots, out, baseline_method=baseline_method, collapse_threshold=collapse_threshold)
        console.print(f"leaderboard page → {path}")
        return
    rows = []
    for root in roots:
        with Store(root) as store:
            rows += leaderboard_rows(store, run)
    if format_ == "table":
        if out is not None:
            raise _fail("--out writes md, csv, json or html; the table is for the terminal")
        stdout.print(render_table(rows))
    elif out is not None:
        out.write_text(renderers[format_](rows))
    else:
        sys.stdout.write(renderers[format_](rows))


@app.command(
    epilog="Example: harness gate --baseline RUN:0 --candidate RUN --task arith --json > gate.json",
    context_settings={"allow_extra_args": True},
)  # extra arguments: the old ``--json FILE`` form, refused by name
def gate(
    ctx: typer.Context,
    baseline: Annotated[
        str, typer.Option(help="the accepted checkpoint: RUN or RUN:STEP (default step: the run's last evaluated one), or a model path")
    ],
    candidate: Annotated[str, typer.Option(help="the checkpoint under test: RUN, RUN:STEP or a model path")],
    task: Annotated[
        str | None, typer.Option(help="task name(s), comma separated (default: every task both evaluated; required for model paths)")
    ] = None,
    out: Annotated[Path, typer.Option(help="results root holding the runs (model paths are evaluated into it)")] = Path("results"),
    alpha: Annotated[float, typer.Option(help="false-alarm rate of the whole gate (one-sided; split over tasks by Bonferroni)")] = 0.05,
    max_drop: Annotated[float, typer.Option(help="tolerated drop in absolute Avg@k points (0.02 = two points)")] = 0.0,
    min_problems: Annotated[int, typer.Option(min=1, help="fewer problems per task than this is inconclusive")] = 10,
    max_error_rate: Annotated[
        float,
        typer.Option(
            help="a side with more errored or missing samples than this fraction is inconclusive",
            callback=open_interval(0, 1, high_open=True),
        ),
    ] = 0.02,
    n_resamples: Annotated[int, typer.Option(min=100, help="paired bootstrap resamples")] = 10_000,
    bootstrap_seed: Annotated[int, typer.Option(min=0, help="bootstrap seed")] = 0,
    json_: Annotated[
        bool, typer.Option("--json", help="print the JSON report to stdout instead of the verdict paragraph (which goes to stderr)")
    ] = False,
    k: Annotated[int | None, typer.Option(min=1, help="model paths: samples per problem (default: the task's k)")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="model paths: first N problems only")] = None,
    temperature: Annotated[float, typer.Option(min=0, help="model paths: sampling temperature")] = 1.0,
    top_p: Annotated[
        float, typer.Option(callback=open_interval(0, 1, low_open=True), help="model paths: nucleus sampling, in (0, 1]")
    ] = 1.0,
    seed: Annotated[int, typer.Option(min=0, help="model paths: sampling seed (the same for both)")] = 0,
    backend: Annotated[str, typer.Option(help="model paths: inference backend (hf, replay, openai, vllm)")] = "hf",
    backend_option: Annotated[
        list[str] | None, typer.Option("--backend-option", help="model paths: backend option KEY=VALUE, repeatable")
    ] = None,
    device: opts.Device = None,
    dtype: opts.Dtype = None,
    task_arg: Annotated[list[str] | None, typer.Option("--task-arg", help="model paths: task option TASK.KEY=VALUE, repeatable")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="model paths: local data root laid out as DIR/<task>/...")] = None,
    html_: Annotated[
        Path | None, typer.Option("--html", help="also write the comparison page (flips, transcripts side by side); the report names it")
    ] = None,
) -> None:
    """Is CANDIDATE significantly worse than BASELINE on the same problems? Exit 0 pass, 1 regression, 2 usage error, 3 inconclusive.

    Paired per problem: exact McNemar test for k = 1, paired bootstrap otherwise; errored or missing samples never count as passes.
    A model path is evaluated first (same problems, k, sampling and seed for both sides; an identical earlier evaluation is reused).
    """
    from opd_harness.config import deep_merge, parse_override
    from opd_harness.gate import EvalSpec, GateUsageError, verdict_paragraph
    from opd_harness.gate import gate as run_gate
    from opd_harness.registry import BACKENDS, RegistryError
    from opd_harness.store import Store

    if ctx.args:
        raise _fail(
            f"unexpected argument {ctx.args[0]!r}: --json is a flag printing the report to stdout, as in every command "
            "(to keep it in a file: harness gate ... --json > gate.json)"
            if json_
            else f"unexpected argument {ctx.args[0]!r} (gate takes options only; see harness gate --help)"
        )
    _quiet_libraries()
    tasks = [t.strip() for t in task.split(",") if t.strip()] if task else None
    paths = [ref for ref in (baseline, candidate) if Path(ref).exists()]
    if not (out / "results.sqlite").is_file() and not paths:
        raise _fail(f"--out {out}: no results store at {out / 'results.sqlite'}")
    spec = None
    if tasks:
        try:
            task_args: dict = {}
            for item in task_arg or []:
                task_args = deep_merge(task_args, parse_override(item))
            if paths:  # only a model path is evaluated: its data, device and backend options are checked before it loads
                check_data_dir(data_dir)
                options = opts.backend_options(BACKENDS.get(backend), backend_option, device=device, dtype=dtype)
            else:
                options = {}
        except (ConfigError, RegistryError) as exc:
            raise _fail(str(exc)) from None
        spec = EvalSpec(
            tuple(tasks),
            k=k,
            limit=limit,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            task_args=task_args,
            backend=backend,
            backend_options=options,
            data_dir=data_dir,
        )
    with Store(out) as store:
        try:
            report = run_gate(store, baseline, candidate, tasks, alpha=alpha, max_drop=max_drop, min_problems=min_problems,
                              max_bad_rate=max_error_rate, n_resamples=n_resamples, seed=bootstrap_seed, eval_spec=spec)  # fmt: skip
        except GateUsageError as exc:
            raise _fail(str(exc)) from None
        if html_ is not None:
            from opd_harness.viewer import gate_page

            report.viewer = str(gate_page(store, report, html_))
            report.notes.append(f"comparison page (flipped problems, both transcripts side by side): {report.viewer}")
    paragraph = verdict_paragraph(report)
    if json_:
        print(to_json(report.to_dict()))
        print(paragraph, file=sys.stderr)
    else:
        print(paragraph)
    raise typer.Exit(report.exit_code)


@app.command(epilog="Example: harness view opd-arith-20261129-101500-ab12:0 --against opd-arith-20261129-101500-ab12:500 --html view.html")
def view(
    run: Annotated[str, typer.Argument(help="the run to show: RUN (every evaluated step) or RUN:STEP")],
    html_: Annotated[Path, typer.Option("--html", help="write the transcript page to this file")],
    task: Annotated[str | None, typer.Option(help="only this task's evaluations")] = None,
    against: Annotated[
        str | None, typer.Option(help="open the comparison with this RUN:STEP (or RUN: its last step) as candidate, RUN's last as baseline")
    ] = None,
    out: Annotated[Path, typer.Option(help="results root holding the run")] = Path("results"),
) -> None:
    """Write one self-contained page with every stored episode of RUN: prompt, turns, observations, outcome, grade, reason.

    Filter by grade, task and evaluation, search, and compare two evaluations on the same problems (flips, side by side).
    """
    from opd_harness.gate import GateUsageError, split_ref
    from opd_harness.store import Store
    from opd_harness.viewer import eval_refs, viewer_payload, write_page

    if not (out / "results.sqlite").is_file():
        raise _fail(f"--out {out}: no results store at {out / 'results.sqlite'}")
    with Store(out) as store:
        try:
            refs, compare = [], None
            for flag, text in (("RUN", run), ("--against", against)):
                if text is None:
                    continue
                run_id, step = split_ref(store, text, flag)
                if store.get_run(run_id) is None:
                    raise GateUsageError(f"{flag} {text!r}: no run {run_id!r} in {store.path} (see `harness leaderboard {out}`)")
                found = eval_refs(store, run_id, step, task)
                if not found:
                    where = (f" on {task}" if task else "") + (f" at step {step}" if step is not None else "")
                    raise GateUsageError(f"{flag} {text!r}: no evaluation{where}")
                refs.append(found)
            if len(refs) == 2:
                last = lambda found: [r for r in found if r.step == found[-1].step]  # noqa: E731
                pairs = [(b, c) for b in last(refs[0]) for c in last(refs[1]) if b.task == c.task]
                if not pairs:
                    raise GateUsageError(f"--against {against!r}: no task evaluated by both {run} and {against}")
                compare = pairs[0]
        except GateUsageError as exc:
            raise _fail(str(exc)) from None
        payload = viewer_payload(store, [r for found in refs for r in found], compare=compare, source=str(out))
    path = write_page(payload, html_, f"opd-harness transcripts: {run}" + (f" vs {against}" if against else ""))
    console.print(f"transcripts of {len(payload['samples'])} samples → {path}")


