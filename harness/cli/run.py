"""``harness run``: train with a method on a task (plan, dry run, resume, summary)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from opd_harness.cli import options as opts
from opd_harness.errors import ConfigError, TrainingAborted
from opd_harness.jsonout import to_json
from opd_harness.registry import RegistryError

if TYPE_CHECKING:  # the config models and the task classes are imported by the commands that use them (start-up)
    from opd_harness.config import RunConfig


from opd_harness.cli._common import (
    app,
    console,
    stdout,
    _fail,
    open_interval,
    _closes_tasks,
    _prepare_tasks,
    _check_executor,
    check_data_dir,
    config_with_data_dir,
    tasks_with_data_dir,
    _quiet_libraries,
)


@app.command(epilog="Example: harness run --method opd --task arith --preset smoke --out results")
@_closes_tasks
def run(
    method: Annotated[str | None, typer.Option(help="training method (see `harness methods`)")] = None,
    task: Annotated[str | None, typer.Option(help="training task (see `harness tasks`)")] = None,
    mode: Annotated[str | None, typer.Option(help="pipeline: sync, or async (rollout and learning overlap)")] = None,
    executor: Annotated[
        str | None,
        typer.Option(help="where the roles run: inprocess (threads in this process) or ray (actors; local Ray, or trainer.ray_address)"),
    ] = None,
    preset: Annotated[str | None, typer.Option(help="built-in preset: smoke, cpu-demo, tool-demo")] = None,
    config: Annotated[Path | None, typer.Option("--config", help="YAML config file")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="dotted override KEY=VALUE, repeatable (e.g. trainer.lr=1e-5)")] = None,
    out: opts.ResultsRoot = Path("results"),
    resume: Annotated[
        str | None, typer.Option(help="resume RUN_ID from its last checkpoint (--set trainer.layout.* may change where its roles run)")
    ] = None,
    data_dir: opts.DataDir = None,
    print_config: Annotated[
        bool, typer.Option("--print-config", help="print the resolved config (every default included) as YAML and exit; nothing is written")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="print the run's memory plan (role × device × term, vs capacity) and exit: 0 if it fits, 2 if "
                     "not; reads model configs only, loads no weights, writes nothing"),
    ] = False,
    device_memory: Annotated[
        float | None,
        typer.Option("--device-memory", callback=open_interval(0, float("inf"), low_open=True),
                     help="--dry-run: each accelerator's memory in GiB (default: this host's CUDA device, else unknown)"),
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="--dry-run: print the plan as JSON")] = False,
    student: opts.Student = None,
    teacher: opts.Teacher = None,
    steps: opts.Steps = None,
    lr: opts.LearningRate = None,
    device: opts.Device = None,
    dtype: opts.Dtype = None,
    temperature: opts.RunTemperature = None,
    top_p: opts.RunTopP = None,
    enable_thinking: opts.RunEnableThinking = None,
) -> None:
    """Train a student with METHOD on TASK, evaluating every checkpoint (Avg@k) into the store.

    Everything (config, plan, every task's data) is validated before the output folder or the store is created.
    """
    import yaml

    from opd_harness.config import PRESET_NOTES, build_config, check_models_named
    from opd_harness.plan import load_plan_data, plan_run
    from opd_harness.store import Store
    from opd_harness.runs import create_train_run, execute_run, plan_resume, resolved_config

    _quiet_libraries()
    store = None
    planning = print_config or dry_run  # nothing runs here: a GPU config is planned on any host
    try:
        check_data_dir(data_dir)
        if (device_memory is not None or json_) and not dry_run:
            raise ConfigError(f"{'--device-memory' if device_memory is not None else '--json'} is used only with --dry-run")
        if resume:
            given = (method, task, mode, executor, preset, config, student, teacher, steps, lr, device, dtype,
                     temperature, top_p, enable_thinking)  # fmt: skip
            if any(v is not None for v in given):
                raise ConfigError("--resume continues a run with its stored config; drop the other options (--set trainer.layout.* only)")
            if not (out / "results.sqlite").is_file():
                raise ConfigError(f"--resume {resume}: no results store at {out / 'results.sqlite'} (pass the run's --out)")
            store = Store(out)
            plan, run_id = plan_resume(store, resume, set_ or []), resume
            tasks_with_data_dir([plan.task, *plan.eval_tasks], data_dir)
        else:
            flags = opts.run_flags_as_config(student=student, teacher=teacher, steps=steps, lr=lr, device=device, dtype=dtype,
                                             temperature=temperature, top_p=top_p, enable_thinking=enable_thinking)  # fmt: skip
            trainer = {key: value for key, value in (("mode", mode), ("executor", executor)) if value is not None}
            cli = {"method": method, "task": task, **flags, "trainer": {**flags.get("trainer", {}), **trainer} or None}
            built = build_config(preset=preset, config_file=config, overrides=set_ or [], cli=cli, planning=planning)
            plan = plan_run(config_with_data_dir(built, data_dir))
            if not print_config:  # the printed config shows what the command plans; running it needs named models
                check_models_named(preset=preset, config_file=config, overrides=set_ or [], cli=cli)
        if print_config:  # validated, nothing loaded or written
            print(yaml.safe_dump(resolved_config(plan), sort_keys=False), end="")
            return
        if dry_run:  # validated and planned: nothing loaded onto a device, no weights read, nothing written
            _dry_run(plan, device_memory, json_)
            return
        check_model_folders(plan.config)
        load_plan_data(plan)
    except (ConfigError, RegistryError) as exc:  # DataUnavailable included: missing data or a bad row, nothing created
        raise _fail(str(exc)) from None
    _prepare_tasks([plan.task, *plan.eval_tasks])  # closed at exit; exit 2 if one cannot run here (e.g. no sandbox image)
    _check_executor(plan)
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    run_id = resume
    started = time.perf_counter()
    try:
        if store is None:
            store = Store(out)
            run_id = create_train_run(store, plan.config, plan)
        console.print(f"run [bold]{run_id}[/] → {store.path}")
        if preset in PRESET_NOTES and not resume:
            console.print(f"{preset}: {PRESET_NOTES[preset].format(models=out / 'cache' / 'models')}", highlight=False)
        execute_run(plan, store, run_id, resume=bool(resume), console=console)
    except ConfigError as exc:  # RunLocked, or a tracker of trainer.loggers that cannot start
        raise _fail(str(exc)) from None
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM, also in the moment between creating the run and executing it
        if store is not None and run_id is not None and not resume and (store.get_run(run_id) or {}).get("status") == "running":
            store.set_status(run_id, "interrupted")
        raise _fail(f"interrupted; continue with: harness run --resume {run_id} --out {out}", 130) from None
    except TrainingAborted as exc:  # non-finite loss, too many grading errors: the run is marked failed
        raise _fail(f"run {run_id} failed: {exc}", 1) from None
    _print_run_summary(store, run_id, plan, time.perf_counter() - started)


def check_model_folders(cfg: RunConfig) -> None:
    """Every model the run loads here can be read: a folder with config and weights, or a hub id cached or reachable
    (offline, one line at once naming the local folder to give instead); a ConfigError naming the flag otherwise."""
    from opd_harness.models.hub import ModelUnavailable, locate_model

    for role in ("student", "teacher"):
        spec = getattr(cfg, role)
        if spec.path is not None and getattr(spec, "backend", "hf") == "hf":
            try:
                locate_model(spec.path, flag=f"--{role}")
            except ModelUnavailable as exc:
                raise ConfigError(str(exc)) from None


def _dry_run(plan, device_memory: float | None, as_json: bool, skip: tuple[str, ...] = ()) -> None:
    """``harness run --dry-run``: the checks of a planned run before anything runs, one step each (:mod:`opd_harness.dry_run`:
    data, models, the teacher–student pair, the teacher's log-probs; then the memory plan). Each step returns (its JSON
    section, a printer, its failure or None); the steps run in order up to the first failure, their sections are printed,
    then that failure is raised (exit 2, one line). ``skip``: steps left out (a recipe's plans skip "data")."""
    from opd_harness import dry_run

    files: dict = {}

    def lines(step: Callable[..., tuple]) -> Callable[..., tuple]:
        def run_step(plan, **_) -> tuple:
            section, printed, failure = step(plan, files)
            return section, lambda: [stdout.print(escape(line), highlight=False) for line in printed], failure

        return run_step

    def models(plan, **_) -> tuple:
        try:
            files.update({role: dry_run.role_files(getattr(plan.config, role), role) for role in ("student", "teacher")})
        except ConfigError as exc:
            return {"ok": False}, lambda: None, str(exc)
        return lines(dry_run.models_step)(plan)

    steps = {"data": lines(lambda plan, _: dry_run.data_step(plan)), "models": models, "pair": lines(dry_run.pair_step),
             "teacher": lines(dry_run.teacher_step), "memory": _memory_step}  # fmt: skip
    results = {}
    for name, step in steps.items():
        if name in skip:
            continue
        results[name] = step(plan, device_memory=device_memory)
        if results[name][2]:
            break
    if as_json:
        print(to_json({name: section for name, (section, _, _) in results.items()}))
    else:
        for _, show, _ in results.values():
            show()
    failure = next((failure for _, _, failure in results.values() if failure), None)
    if failure:
        raise ConfigError(failure)
    if not as_json:
        stdout.print("dry run: every check passed; nothing was loaded onto a device or written", highlight=False)


def _memory_step(plan, *, device_memory: float | None) -> tuple[dict, Callable[[], None], str | None]:
    """The memory plan of the run (:mod:`opd_harness.memory_plan`): per role and device, against the devices' capacity."""
    from opd_harness.memory_plan import build_memory_plan, fit_failure

    memory = build_memory_plan(plan, device_memory)
    return memory.to_dict(), lambda: _print_memory_plan(memory), fit_failure(memory)


def _print_memory_plan(memory) -> None:
    """The memory plan as a table (GiB), then its assumptions."""
    from rich.table import Table

    from opd_harness.memory_plan import render_rows

    table = Table(title="memory plan (GiB, one replica per device)")
    for name in ("role", "device", "term", "GiB", "note"):
        table.add_column(name, justify="right" if name == "GiB" else "left")
    for row in render_rows(memory):
        table.add_row(*(escape(cell) for cell in row), style="bold" if row[0] == "total" else None)
    stdout.print(table)
    for line in memory.assumptions:
        stdout.print(f"- {escape(line)}", highlight=False)


def _print_run_summary(store, run_id: str, plan, seconds: float) -> None:
    from opd_harness.leaderboard import leaderboard_rows, paired_comparison, render_table

    stdout.print(render_table(leaderboard_rows(store, [run_id])))
    estimator = getattr(plan.hparams, "estimator", None)
    if estimator:
        stdout.print(f"method {plan.method.name}, estimator: {estimator}")
    checkpoints = store.checkpoints(run_id)
    if checkpoints:
        last = checkpoints[-1]
        stdout.print(
            f"throughput: {last['samples_per_hour']:.0f} training samples/hour "
            f"({last['samples_seen']} samples in {last['train_seconds']:.1f}s of training)"
        )
    for ev in plan.eval_tasks:
        evals = {e["step"]: e for e in store.evals(run_id) if e["task"] == ev.name}
        if 0 in evals and len(evals) > 1:
            final = max(evals)
            result = paired_comparison(store, ev.name, evals[final]["k"], (run_id, 0), (run_id, final))
            verdict = "improved" if result.ci_low > 0 else "worse" if result.ci_high < 0 else "no significant change"
            stdout.print(
                f"{ev.name}: step 0 → {final}: Avg@{evals[final]['k']} {result.mean_a:.3f} → {result.mean_b:.3f}, "
                f"Δ = {result.delta:+.3f} [{result.ci_low:+.3f}, {result.ci_high:+.3f}], p = {result.p_value:.4f} "
                f"(paired bootstrap, {result.n} problems): {verdict}"
            )
    stdout.print(f"wall time: {seconds:.0f}s")




