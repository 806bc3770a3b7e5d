"""The ``harness`` command line: run, eval, serve, tasks, methods, leaderboard, sweep, report, sandbox."""

from __future__ import annotations

import functools
import inspect
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from harness import cli_options as opts
from harness.errors import ConfigError, TrainingAborted
from harness.jsonout import to_json
from harness.registry import METHODS, TASKS, RegistryError

if TYPE_CHECKING:  # the config models and the task classes are imported by the commands that use them (start-up)
    from harness.config import RunConfig
    from harness.task import Task

app = typer.Typer(
    help="Benchmark harness for on-policy distillation of language models.",
    epilog="Example: harness run --preset cpu-demo (then: harness leaderboard)",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=160)
stdout = Console() if sys.stdout.isatty() else Console(width=160)  # pipes get full-width tables


def _quiet_libraries() -> None:
    """Silence transformers/hub progress bars and warnings; the harness draws its own."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def _fail(message: str, code: int = 2) -> typer.Exit:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # escaped: "opd-harness[ray]" is not markup
    return typer.Exit(code)


def open_interval(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Callable[[float | None], float | None]:
    """An option callback refusing a value outside the interval (typer's ``min``/``max`` bounds are closed only): exit 2 naming the flag."""

    def check(value: float | None) -> float | None:
        below = value is not None and (value <= low if low_open else value < low)
        above = value is not None and (value >= high if high_open else value > high)
        if below or above:
            raise typer.BadParameter(f"{value} is not in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}")
        return value

    return check


def plain_text(text: str) -> str:
    """Docstring text as a terminal shows it: RST inline literals (````x````) as ``x``, a paragraph's line breaks as spaces."""
    return re.sub(r"(?<!\n)\n(?!\n)", " ", re.sub(r"``(.+?)``", r"\1", text, flags=re.DOTALL))


def plain_help(typer_app: typer.Typer) -> None:
    """Show the help of ``typer_app``, of its commands and of its sub-apps as ``plain_text`` (docstrings included)."""
    if isinstance(typer_app.info.help, str):
        typer_app.info.help = plain_text(typer_app.info.help)
    for info in typer_app.registered_commands:
        info.help = plain_text(info.help or inspect.getdoc(info.callback) or "")
    for group in typer_app.registered_groups:
        plain_help(group.typer_instance)


# ---- task lifecycle and clean shutdown (readiness before anything is written; sandboxes closed however a command ends)


_tasks_to_close: list[Task] = []  # tasks of the running command, closed when it ends (see ``_closes_tasks``)


def _closes_tasks(command: Callable) -> Callable:
    """Command decorator: close the tasks given to ``_prepare_tasks`` (their sandbox containers) however the command ends."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        finally:
            tasks, _tasks_to_close[:] = list(_tasks_to_close), []
            if tasks:
                from harness.task import close_tasks

                close_tasks(tasks)

    return wrapper


def _prepare_tasks(tasks: list[Task]) -> None:
    """Have ``tasks`` closed when the command ends, and check each can run here (e.g. its sandbox image is built):
    exit 2 with what to do, before any run row or output exists."""
    from harness.task import TaskNotReady

    _tasks_to_close.extend(tasks)
    try:
        for task in tasks:
            task.check_ready()
    except TaskNotReady as exc:
        raise _fail(str(exc)) from None


def _check_executor(plan) -> None:
    """Exit 2 before any run row exists when the run's executor refuses it (e.g. a layout the Ray cluster cannot hold)."""
    from harness.registry import EXECUTORS

    try:
        EXECUTORS.get(plan.config.trainer.executor).check(plan, console)
    except ConfigError as exc:
        raise _fail(str(exc)) from None


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that it unwinds like Ctrl-C: ``finally`` blocks close sandboxes, runs end interrupted."""


_terminated = False


def _raise_terminated(signum: int, frame) -> None:
    global _terminated
    _terminated = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM during the shutdown kills at once
    raise Terminated(f"terminated by signal {signum}")


def check_data_dir(data_dir: Path | None) -> None:
    """``--data-dir`` names an existing folder; the command hands it to the tasks (ahead of ``HARNESS_DATA_DIR``)."""
    if data_dir is not None and not data_dir.is_dir():
        raise ConfigError(f"--data-dir {data_dir}: no such directory (it holds one folder per task: DIR/<task>/...)")


def config_with_data_dir(cfg: RunConfig, data_dir: Path | None) -> RunConfig:
    """``harness run --data-dir``: the data root of every task of the run whose ``task_args`` name none, put in the
    config (stored with the run, so Ray actors and ``--resume`` read the same folder); an explicit option still wins."""
    if data_dir is None:
        return cfg
    names = dict.fromkeys([cfg.task, *cfg.eval.tasks])
    task_args = {**cfg.task_args, **{name: {"data_dir": str(data_dir), **cfg.task_args.get(name, {})} for name in names}}
    return cfg.model_copy(update={"task_args": task_args})


def tasks_with_data_dir(tasks: list, data_dir: Path | None) -> None:
    """``harness run --resume --data-dir``: the data root of each task of the resumed plan whose options name none."""
    for task in tasks if data_dir is not None else ():
        if not task.options.data_dir:
            task.options = task.options.model_copy(update={"data_dir": str(data_dir)})


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
    out: Annotated[Path, typer.Option(help="results root")] = Path("results"),
    resume: Annotated[
        str | None, typer.Option(help="resume RUN_ID from its last checkpoint (--set trainer.layout.* may change where its roles run)")
    ] = None,
    data_dir: Annotated[Path | None, typer.Option(help="local data root laid out as DIR/<task>/... (default: $HARNESS_DATA_DIR)")] = None,
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

    from harness.config import PRESET_NOTES, build_config, check_models_named
    from harness.plan import load_plan_data, plan_run
    from harness.store import Store
    from harness.runs import create_train_run, execute_run, plan_resume, resolved_config

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
    from harness.models.hub import ModelUnavailable, locate_model

    for role in ("student", "teacher"):
        spec = getattr(cfg, role)
        if spec.path is not None and getattr(spec, "backend", "hf") == "hf":
            try:
                locate_model(spec.path, flag=f"--{role}")
            except ModelUnavailable as exc:
                raise ConfigError(str(exc)) from None


def _dry_run(plan, device_memory: float | None, as_json: bool, skip: tuple[str, ...] = ()) -> None:
    """``harness run --dry-run``: the checks of a planned run before anything runs, one step each (:mod:`harness.dry_run`:
    data, models, the teacher–student pair, the teacher's log-probs; then the memory plan). Each step returns (its JSON
    section, a printer, its failure or None); the steps run in order up to the first failure, their sections are printed,
    then that failure is raised (exit 2, one line). ``skip``: steps left out (a recipe's plans skip "data")."""
    from harness import dry_run

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
    """The memory plan of the run (:mod:`harness.memory_plan`): per role and device, against the devices' capacity."""
    from harness.memory_plan import build_memory_plan, fit_failure

    memory = build_memory_plan(plan, device_memory)
    return memory.to_dict(), lambda: _print_memory_plan(memory), fit_failure(memory)


def _print_memory_plan(memory) -> None:
    """The memory plan as a table (GiB), then its assumptions."""
    from rich.table import Table

    from harness.memory_plan import render_rows

    table = Table(title="memory plan (GiB, one replica per device)")
    for name in ("role", "device", "term", "GiB", "note"):
        table.add_column(name, justify="right" if name == "GiB" else "left")
    for row in render_rows(memory):
        table.add_row(*(escape(cell) for cell in row), style="bold" if row[0] == "total" else None)
    stdout.print(table)
    for line in memory.assumptions:
        stdout.print(f"- {escape(line)}", highlight=False)


def _print_run_summary(store, run_id: str, plan, seconds: float) -> None:
    from harness.leaderboard import leaderboard_rows, paired_comparison, render_table

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


EVAL_EXECUTOR_KEYS = ("executor", "workers", "ray_address", "max_sandboxes", "gpus_per_worker")  # where an eval ran, not what it measured


def check_eval_executor(
    executor: str, workers: int | None, ray_address: str | None, max_sandboxes: int | None = None, gpus_per_worker: float | None = None
) -> None:
    """``harness eval``'s placement flags: exit 2 naming the flag when the executor is unknown or a flag needs ``--executor ray``."""
    if executor != "inprocess":
        from harness.registry import EVAL_EXECUTORS

        try:
            EVAL_EXECUTORS.get(executor)
        except RegistryError as exc:
            raise ConfigError(f"--executor {executor!r}: {exc} (or inprocess)") from None
    elif workers is not None or ray_address is not None or max_sandboxes is not None or gpus_per_worker is not None:
        given = {"--workers": workers, "--ray-address": ray_address, "--max-sandboxes": max_sandboxes, "--gpus-per-worker": gpus_per_worker}
        flag = next(name for name, value in given.items() if value is not None)
        raise ConfigError(f"{flag} needs --executor ray (the in-process evaluation runs in this process)")


def resumed_eval(store, run_id: str, config: dict) -> None:
    """``harness eval --resume RUN_ID``: the stored eval run must have measured what this command measures (exit 2)."""
    run = store.get_run(run_id)
    if run is None or run["kind"] != "eval":
        raise ConfigError(f"--resume {run_id}: no eval run of that id in {store.path} (pass the run's --out)")
    stored = {k: v for k, v in run["config"].items() if k not in EVAL_EXECUTOR_KEYS}
    wanted = {k: v for k, v in config.items() if k not in EVAL_EXECUTOR_KEYS}
    differ = sorted(key for key in stored.keys() | wanted.keys() if stored.get(key) != wanted.get(key))
    if differ:
        raise ConfigError(f"--resume {run_id}: the run was started with other {', '.join(differ)} (give the same options to resume it)")


def stored_summary(store, run_id: str, task: str) -> dict:
    """A stored evaluation's summary as ``evaluate_task`` returned it (for a task a resumed eval had finished)."""
    row = next(e for e in store.evals(run_id) if e["task"] == task)
    columns = {"k": row["k"], "n_samples": row["n"], "n_problems": row["n_problems"], "avg_at_k": row["avg_at_k"],
               "ci_low": row["ci_low"], "ci_high": row["ci_high"], "pass_at_k": row["pass_at_k"], "n_errors": row["n_errors"]}  # fmt: skip
    return {**row["metrics"], **columns, "grader": f"{row['grader']}/{row['grader_version']}"}


def eval_shards(problems: list, k: int, shard_size: int | None) -> int:
    """How many shards ``harness eval`` rolls a task out in (its progress counts them)."""
    from harness.evaluation import shard_problems

    return len(shard_problems(problems, k, shard_size))


@app.command("eval", epilog="Example: harness eval --model results/runs/RUN/checkpoints/step-000500 --task arith --k 4 --json")
@_closes_tasks
def eval_(
    model: Annotated[str, typer.Option(help="local model directory (or hub id) to evaluate")],
    task: Annotated[str, typer.Option(help="task name(s), comma separated")],
    backend: Annotated[str, typer.Option(help="inference backend")] = "hf",
    k: Annotated[int | None, typer.Option(min=1, help="samples per problem (default: the task's k, or the --protocol's)")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="first N problems only")] = None,
    temperature: opts.Temperature = None,
    top_p: opts.TopP = None,
    top_k: opts.TopK = None,
    presence_penalty: opts.PresencePenalty = None,
    protocol: opts.Protocol = None,
    output_path: opts.OutputPath = None,
    seed: Annotated[int, typer.Option(min=0, help="sampling seed")] = 0,
    data_dir: Annotated[Path | None, typer.Option(help="local data root laid out as DIR/<task>/...")] = None,
    out: Annotated[Path, typer.Option(help="results root")] = Path("results"),
    json_: Annotated[bool, typer.Option("--json", help="print a JSON summary instead of a table")] = False,
    max_error_rate: Annotated[float, typer.Option(min=0, max=1, help="exit 1 if a task's fraction of grading errors exceeds this")] = 0.02,
    task_arg: Annotated[
        list[str] | None,
        typer.Option("--task-arg", help="task option TASK.KEY=VALUE, repeatable (e.g. arith.max_operand=50, as a run's task_args)"),
    ] = None,
    backend_option: Annotated[
        list[str] | None,
        typer.Option(
            "--backend-option",
            help="backend option KEY=VALUE, repeatable (openai: base_url=http://HOST:PORT/v1, mode=chat, concurrency=16, tokenizer=PATH)",
        ),
    ] = None,
    logger: Annotated[
        list[str] | None,
        typer.Option("--logger", help="also log the results to a tracker, repeatable: tensorboard, wandb, mlflow (jsonl always)"),
    ] = None,
    executor: Annotated[str, typer.Option(help="where the shards run: inprocess (this process) or ray (evaluation workers)")] = "inprocess",
    ray_address: Annotated[str | None, typer.Option(help="Ray cluster to join (--executor ray; default: a local Ray)")] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="evaluation workers (--executor ray; default 1), spread over the nodes")
    ] = None,
    shard_size: Annotated[
        int | None, typer.Option(min=1, help="problems per shard, all k samples of a problem in one (default: as many as fill 64 samples)")
    ] = None,
    max_sandboxes: Annotated[
        int | None,
        typer.Option(min=1, help="most workers holding a task sandbox open at once on one node (--executor ray; default: no bound)"),
    ] = None,
    gpus_per_worker: Annotated[
        float | None,
        typer.Option(min=0, help="GPUs Ray gives each evaluation worker (--executor ray; default 0): its hf backend runs on cuda, "
                     "vLLM finds them through CUDA_VISIBLE_DEVICES"),
    ] = None,
    resume: Annotated[str | None, typer.Option(help="continue the interrupted eval RUN_ID (same options); staged shards are kept")] = None,
    device: opts.Device = None,
    dtype: opts.Dtype = None,
    max_new_tokens: opts.MaxNewTokens = None,
    enable_thinking: opts.EnableThinking = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="check the data, the model config and tokenizer (no weights), print the plan, exit")
    ] = False,
    print_config: Annotated[
        bool,
        typer.Option("--print-config", help="print each task's resolved settings (protocol and flags) as YAML and exit; nothing is loaded"),
    ] = False,
) -> None:
    """Evaluate one model or checkpoint on one or more tasks; rows go to the store.

    Every task's problems are loaded and validated before the model is loaded and the run row created. The problems
    are rolled out in shards (in this process, or on Ray evaluation workers); finished shards are staged under the
    run's folder, so ``--resume`` redoes none of them, and each task's results are stored in one transaction.
    """
    from contextlib import ExitStack, nullcontext

    import yaml

    from harness.backends import SamplingParams
    from harness.config import deep_merge, parse_override
    from harness.evaluation import EvalWorkersFailed, EvalWorkerSpec, LocalShards, ShardStage, describe_episodes, evaluate_task, store_eval
    from harness.progress import progress
    from harness.leaderboard import leaderboard_rows, render_table
    from harness.plan import load_problems, make_task
    from harness.registry import BACKENDS, EVAL_EXECUTORS
    from harness.store import Store
    from harness.runs import new_run_id
    from harness.tracking import RunInfo, TrackerStartFailed, check_loggers, open_trackers

    _quiet_libraries()
    names = [t.strip() for t in task.split(",") if t.strip()]
    try:
        loggers = check_loggers(logger or [])
    except ValueError as exc:
        raise _fail(f"--logger: {exc}") from None
    try:
        check_eval_executor(executor, workers, ray_address, max_sandboxes, gpus_per_worker)
        check_data_dir(data_dir)
        task_args: dict = {}
        for item in task_arg or []:
            task_args = deep_merge(task_args, parse_override(item))
        unused = set(task_args) - set(names)
        if unused:
            raise ConfigError(f"--task-arg names {sorted(unused)}, which are not among --task {', '.join(names)}")
        backend_cls = BACKENDS.get(backend)
        tasks = [make_task(name, task_args) for name in names]
        flags = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "presence_penalty": presence_penalty,
                 "max_new_tokens": max_new_tokens, "k": k, "enable_thinking": enable_thinking}  # fmt: skip
        settings = eval_settings(protocol, tasks, flags, backend_cls)
        if print_config:  # validated, nothing loaded or written
            print(yaml.safe_dump({"model": model, "backend": backend, "protocol": protocol, "seed": seed, "tasks": settings},
                                 sort_keys=False), end="")  # fmt: skip
            return
        problems_of = {t.name: load_problems(t, "test", data_dir=data_dir, limit=limit) for t in tasks}
    except (ConfigError, RegistryError) as exc:  # DataUnavailable included: a missing data folder or a bad row
        raise _fail(str(exc)) from None
    _prepare_tasks(tasks)  # closed at exit; exit 2 if one cannot run here (e.g. no sandbox image)
    thinking = {value for value in (s.get("enable_thinking") for s in settings.values())}
    enable_thinking = thinking.pop() if len(thinking) == 1 else enable_thinking  # one template switch for the whole eval
    options = {}
    for item in backend_option or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise _fail(f"--backend-option {item!r}: expected KEY=VALUE")
        options[key.strip()] = yaml.safe_load(value) if value else value  # "8" -> 8, URLs stay strings
    try:
        options = eval_backend_options(backend_cls, options, device=device, dtype=dtype, enable_thinking=enable_thinking)
        if backend == "hf":  # a folder without weights, or a hub id offline: one line now, not a traceback after the data
            from harness.models.hub import ModelUnavailable, locate_model

            try:
                locate_model(model, flag="--model")
            except ModelUnavailable as exc:
                raise ConfigError(str(exc)) from None
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    if dry_run:
        _eval_dry_run(model, backend, options, tasks, problems_of, settings)
        return
    config = {
        "task_args": task_args,
        "backend_options": {k: v for k, v in options.items() if k != "api_key"},
        "model": model,
        "backend": backend,
        "tasks": names,
        "k": k,
        "limit": limit,
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "seed": seed,
        **({"max_new_tokens": max_new_tokens} if max_new_tokens is not None else {}),  # absent: as before the flag existed
        # absent unless given: an eval stored before these flags existed resumes with the same config
        **{key: value for key, value in (("top_k", top_k), ("presence_penalty", presence_penalty)) if value is not None},
        **({"protocol": protocol, "settings": settings} if protocol else {}),
        "shard_size": shard_size,
        "executor": executor,
        "workers": workers,
        "ray_address": ray_address,
        "max_sandboxes": max_sandboxes,
        "gpus_per_worker": gpus_per_worker,
    }
    store = Store(out) if resume else None  # a new eval's store is opened once the model is loaded
    try:
        if resume:
            resumed_eval(store, resume, config)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    if executor == "inprocess":
        if backend == "hf":
            options.setdefault("show_progress", sys.stderr.isatty())  # a generation progress bar on terminals
        shards = lambda: nullcontext(LocalShards(backend_cls.load(model, **options)))  # noqa: E731
    else:
        spec = EvalWorkerSpec(backend, model, options, task_args, data_dir)
        shards = lambda: EVAL_EXECUTORS.get(executor).open(  # noqa: E731
            spec, workers=workers or 1, address=ray_address, console=console, max_sandboxes=max_sandboxes,
            gpus_per_worker=gpus_per_worker or 0.0,
        )
    errors: tuple[type[BaseException], ...] = (ValueError,)
    if backend == "openai":
        import openai

        errors += (openai.OpenAIError,)
    summaries = {}
    with ExitStack() as stack:
        try:  # the model is loaded (here, or by every worker) before the run row exists
            runner = stack.enter_context(shards())
        except (OSError, ValueError, TypeError, RuntimeError) as exc:  # TypeError: an unknown option; RuntimeError: vllm or ray missing
            raise _fail(str(exc)) from None
        store = store or Store(out)
        run_id = resume or new_run_id("eval", "+".join(names))
        if resume:
            store.set_status(run_id, "running")
        else:
            store.create_run(run_id, kind="eval", config=config, task=",".join(names), model=model, protocol=protocol)
        try:
            info = RunInfo(store.run_dir(run_id), run_id, config=config)
            trackers = open_trackers(loggers, info, lambda message: console.print(f"[yellow]warning:[/] {escape(message)}"))
        except TrackerStartFailed as exc:
            store.set_status(run_id, "failed")
            raise _fail(f"--logger: {exc}") from None
        store.observe(run_id, trackers)
        stage = ShardStage.of_run(store, run_id, 0)
        try:
            for t in tasks:
                if store.has_eval(run_id, 0, t.name):  # stored before the interruption
                    summaries[t.name] = stored_summary(store, run_id, t.name)
                    continue
                chosen = settings[t.name]
                sampling = SamplingParams(temperature=chosen["temperature"], top_p=chosen["top_p"], top_k=chosen["top_k"],
                                          presence_penalty=chosen["presence_penalty"], max_new_tokens=chosen["max_new_tokens"],
                                          seed=seed)  # fmt: skip
                with progress(desc=f"eval {t.name} shards", total=eval_shards(problems_of[t.name], chosen["k"], shard_size)) as bar:
                    result = evaluate_task(None, t, problems_of[t.name], k=chosen["k"], sampling=sampling, shard_size=shard_size,
                                           runner=runner, stage=stage, on_shard=lambda done, _: bar.update(done - bar.n))  # fmt: skip
                store_eval(store, run_id, 0, result)
                stage.clear(t.name)
                summaries[t.name] = {**result.summary, "grader": "/".join(result.grader), "shards": result.shards,
                                     "shards_reused": result.shards_reused}  # fmt: skip
        except errors as exc:  # e.g. a replay file without enough samples, an unreachable server, workers that keep dying
            store.set_status(run_id, "failed")
            raise _fail(str(exc)) from None
        except EvalWorkersFailed as exc:  # infrastructure: workers that keep dying (the finished shards stay staged)
            store.set_status(run_id, "failed")
            raise _fail(f"{exc}; continue with: harness eval --resume {run_id} --out {out} (and the same options)", 1) from None
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the finished shards stay staged
            store.set_status(run_id, "interrupted")
            raise _fail(f"interrupted; continue with: harness eval --resume {run_id} --out {out} (and the same options)", 130) from None
        except BaseException:  # anything else still leaves no run marked running
            store.set_status(run_id, "failed")
            raise
        finally:
            store.observe(run_id, None)
            trackers.close(ok=len(summaries) == len(tasks))
    store.set_status(run_id, "done")
    if output_path is not None:
        from harness.evaluation import write_output_path

        written = write_output_path(store, run_id, output_path, summaries)
        console.print(f"results and samples: {', '.join(str(path) for path in written)}", highlight=False)
    if json_:
        print(to_json({"run_id": run_id, "model": model, "tasks": summaries}))
    else:
        stdout.print(render_table(leaderboard_rows(store, [run_id])))
        for name, summary in summaries.items():
            if line := describe_episodes(summary):
                stdout.print(f"{name}: {line}")
    too_many = {
        name: s["n_errors"] / max(s["n_samples"], 1)
        for name, s in summaries.items()
        if s["n_errors"] / max(s["n_samples"], 1) > max_error_rate
    }
    if too_many:
        rates = ", ".join(f"{name} {rate:.1%}" for name, rate in too_many.items())
        raise _fail(f"grading error rate above --max-error-rate {max_error_rate:.1%}: {rates} (see the samples table for details)", 1)


def eval_settings(protocol: str | None, tasks: list, flags: dict, backend_cls: type) -> dict[str, dict]:
    """Each task's sampling, max new tokens, k and thinking switch: the flags' defaults and the task's own k and
    max_new_tokens, then ``--protocol``'s values for the task's ``protocol_family``, then the flags given. A ConfigError
    for an unknown protocol, a presence penalty the backend cannot apply, or tasks that need different thinking switches."""
    from harness.protocols import get_protocol, resolve

    chosen = get_protocol(protocol) if protocol else None
    out = {}
    for t in tasks:
        defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "presence_penalty": 0.0,
                    "max_new_tokens": t.options.max_new_tokens, "k": t.options.k, "enable_thinking": None}  # fmt: skip
        out[t.name] = resolve(chosen, t.options.protocol_family, flags, defaults)
    penalty = next((s["presence_penalty"] for s in out.values() if s["presence_penalty"]), 0.0)
    if penalty and not getattr(backend_cls, "presence_penalty", False):
        source = "--presence-penalty" if flags.get("presence_penalty") else f"--protocol {protocol}"
        raise ConfigError(f"{source}: presence penalty {penalty:g}, which the {backend_cls.__name__} backend cannot apply; use --backend "
                          "vllm or openai, or --presence-penalty 0 to run without it (a deviation from the protocol)")  # fmt: skip
    if len({s["enable_thinking"] for s in out.values()}) > 1:
        raise ConfigError("the tasks need different --enable-thinking switches; evaluate them in separate commands")
    return out


def eval_backend_options(backend_cls: type, options: dict, *, device: str | None, dtype: str | None,
                         enable_thinking: bool | None) -> dict:  # fmt: skip
    """``harness eval``'s --device, --dtype and --enable-thinking as the backend options they stand for (the flag wins over
    ``--backend-option``), checked before anything loads: an option the backend does not take, an unknown dtype, or a CUDA
    device this host lacks is a ConfigError naming the flag."""
    from harness.config import device_unavailable, load_options
    from harness.models.hub import dtype_name

    flags = {"device": ("--device", device), "dtype": ("--dtype", dtype), "enable_thinking": ("--enable-thinking", enable_thinking)}
    out = dict(options)
    takes = load_options(backend_cls)
    for key, (flag, value) in flags.items():
        if value is not None:
            out[key] = value
        if key in out and key not in takes:
            raise ConfigError(f"{flag if value is not None else '--backend-option ' + key}: the {backend_cls.__name__} backend does "
                              f"not take it (it takes {', '.join(takes)})")  # fmt: skip
    if "device" in out:
        why = device_unavailable(str(out["device"]), key="--device")
        if why:
            raise ConfigError(why)
    if "dtype" in out and backend_cls.__name__ == "HFBackend":
        try:
            dtype_name(str(out["dtype"]), device=str(out.get("device", "cpu")))
        except ValueError as exc:
            raise ConfigError(f"--dtype: {exc}") from None
    return out


def _eval_dry_run(model: str, backend: str, options: dict, tasks: list, problems_of: dict, settings: dict[str, dict]) -> None:
    """``harness eval --dry-run``: the data is loaded and checked (before this); read the model's config and tokenizer (no
    weights) and print what would run."""
    from harness.dry_run import read_model_files

    if backend == "hf":
        try:
            files = read_model_files(model, flag="--model")
        except ConfigError as exc:
            raise _fail(str(exc)) from None
        stdout.print(f"model: {model} ({files.describe()})", highlight=False)
    shown = {key: value for key, value in options.items() if key != "api_key"}
    stdout.print(f"backend: {backend} {shown}", highlight=False)
    for t in tasks:
        chosen = settings[t.name]
        shown_settings = ", ".join(f"{key} = {value}" for key, value in chosen.items())
        stdout.print(f"task {t.name}: {len(problems_of[t.name])} problems, {shown_settings}", highlight=False)
    stdout.print("dry run: nothing loaded onto a device, nothing written", highlight=False)


@app.command("serve", epilog="Example: harness serve --model results/runs/RUN/checkpoints/step-000500 --port 8000")
def serve_(
    model: Annotated[str, typer.Option(help="local model directory (or hub id) to serve")],
    host: Annotated[str, typer.Option(help="interface to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port")] = 8000,
    max_batch: Annotated[int, typer.Option(help="most sequences (prompt x sample, from any number of requests) decoded together")] = 64,
    max_batch_tokens: Annotated[
        int, typer.Option(help="most padded positions per batch: sequences x (longest prompt + max_tokens)")
    ] = 32768,
    max_logprobs: Annotated[int, typer.Option(help="cap on logprobs / top_logprobs per request (-1: no cap)")] = 20,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when available)")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="model name clients ask for (default: --model as given)")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="HARNESS_SERVE_API_KEY", help="require Authorization: Bearer KEY")] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="context window: prompt + max_tokens per sequence (default: the model's)")
    ] = None,
    max_request_sequences: Annotated[int, typer.Option(help="most sequences (prompts x n) in one request (more: 400)")] = 1024,
    max_request_tokens: Annotated[
        int, typer.Option(help="most tokens (prompt + max_tokens, over all its sequences) in one request (more: 400)")
    ] = 1 << 20,
    max_queued_sequences: Annotated[int, typer.Option(help="most sequences waiting or decoding, all requests together (more: 503)")] = 4096,
    max_body_bytes: Annotated[int, typer.Option(help="largest request body (more: 413, refused before it is read)")] = 16 << 20,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /metrics)."""
    from harness.serve import Limits
    from harness.serve import serve as run_server

    _quiet_libraries()
    limits = Limits(max_model_len, max_request_sequences, max_request_tokens, max_queued_sequences, max_body_bytes)
    try:
        run_server(model, host=host, port=port, max_batch=max_batch, max_batch_tokens=max_batch_tokens, max_logprobs=max_logprobs,
                   device=device, model_name=served_model_name, api_key=api_key, limits=limits)  # fmt: skip
    except (OSError, ValueError) as exc:
        raise _fail(str(exc)) from None


@app.command(epilog="Example: harness tasks --json")
def tasks(json_: Annotated[bool, typer.Option("--json", help="machine-readable list")] = False) -> None:
    """List registered tasks."""
    described = [cls.describe() for _, cls in TASKS.items()]
    if json_:
        print(to_json(described))
        return
    for d in described:
        stdout.print(f"[bold]{d['name']}[/]  {plain_text(d['description'])}  (sandbox: {'yes' if d['needs_sandbox'] else 'no'})")
    for prefix in TASKS.prefixes():
        what, naming = TASKS.prefix_description(prefix)
        stdout.print(f"[bold]{prefix}:<name>[/]  a family of tasks: {plain_text(what)}" + (f"\n    {plain_text(naming)}" if naming else ""))


@app.command(epilog="Example: harness methods --json")
def methods(json_: Annotated[bool, typer.Option("--json", help="machine-readable list")] = False) -> None:
    """List registered training methods with their hyper-parameters and declared inputs."""
    described = [spec.describe() for _, spec in METHODS.items()]
    if json_:
        print(to_json(described))
        return
    for d in described:
        description = plain_text(d["description"])
        stdout.print(f"[bold]{d['name']}[/]  {description}\n    needs: {', '.join(d['inputs'])}; defaults: {d['defaults']}")


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
    from harness.leaderboard import leaderboard_rows, render_csv, render_json, render_markdown, render_table
    from harness.store import Store

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
        from harness.leaderboard_page import write_html

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
    import yaml

    from harness.config import deep_merge, parse_override
    from harness.gate import EvalSpec, GateUsageError, verdict_paragraph
    from harness.gate import gate as run_gate
    from harness.store import Store

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
            options = {}
            for item in backend_option or []:
                key, sep, value = item.partition("=")
                if not sep or not key.strip():
                    raise ConfigError(f"--backend-option {item!r}: expected KEY=VALUE")
                options[key.strip()] = yaml.safe_load(value) if value else value
        except ConfigError as exc:
            raise _fail(str(exc)) from None
        if paths:
            try:
                check_data_dir(data_dir)
            except ConfigError as exc:
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
            from harness.viewer import gate_page

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
    from harness.gate import GateUsageError, split_ref
    from harness.store import Store
    from harness.viewer import eval_refs, viewer_payload, write_page

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


@app.command(epilog="Example: harness sweep benchmarks/f_opd_cpu_study.yaml --out results --dry-run")
def sweep(
    file: Annotated[Path, typer.Argument(help="sweep YAML: base (preset/config/set) and grid (dotted key -> list of values)")],
    out: Annotated[Path, typer.Option(help="results root")] = Path("results"),
    dry_run: Annotated[bool, typer.Option("--dry-run", help="validate every grid point and list what would run or be skipped")] = False,
) -> None:
    """Run a grid of training runs (methods x modes x seeds x lags ...) sequentially; re-running continues it."""
    from harness.report import render_markdown, write_report
    from harness.sweep import run_sweep

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
        f"{len(result.failed)} failed → {result.record_path}"
    )
    sys.stdout.write(render_markdown(write_report(out, result.sweep_id)))
    if result.failed:
        raise _fail(f"{len(result.failed)} run(s) failed: {', '.join(result.failed)}; re-run the sweep to resume them", 1)


@app.command(epilog="Example: harness report f-opd-cpu-study --out results --format md")
def report(
    sweep_id: Annotated[str, typer.Argument(help="sweep id (the sweep file's `id`, default its stem)")],
    out: Annotated[Path, typer.Option(help="results root")] = Path("results"),
    format_: Annotated[str, typer.Option("--format", help="md or json")] = "md",
    json_: Annotated[bool, typer.Option("--json", help="print the report as JSON to stdout (--format json)")] = False,
    task: Annotated[str | None, typer.Option(help="evaluation task (default: the training task)")] = None,
    collapse_threshold: Annotated[float, typer.Option(help="a run collapsed when final Avg@k < this x its peak Avg@k")] = 0.5,
    baseline_method: Annotated[str, typer.Option(help="sync method for relative throughput when a row has no sync run of its own")] = "opd",
) -> None:
    """Paper-style tables of a sweep (final/peak Avg@k, peak-final drop, collapse ratio, relative throughput, lag) and the lag curve PNG."""
    from harness.report import render_json, render_markdown, write_report
    from harness.sweep import SweepError

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
    out: Annotated[Path, typer.Option(help="results root")] = Path("results"),
    set_: Annotated[list[str] | None, typer.Option("--set", help="extra dotted override KEY=VALUE for every run, repeatable")] = None,
) -> None:
    """Run a paper's recipe through the sweep machinery (resumable), print its tables and check its claims."""
    from harness.reproduce import SCALES, reproduce as reproduce_recipe

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
    if result.failed:
        raise _fail(f"{len(result.failed)} run(s) failed: {', '.join(result.failed)}; re-run to resume them", 1)


def _recipe_plans(name: str, scale: str, overrides: list[str] | None) -> None:
    """``harness reproduce --dry-run`` of a scale that names a layout: each distinct run's ``harness run --dry-run`` plan
    (models, the pair, the teacher, the memory plan; the data is checked when the runs start), printed once with how many
    runs share it; exit 2 at the first plan that fails."""
    from harness.reproduce import distinct_plans, load_recipe

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


sandbox_app = typer.Typer(
    help="The code sandbox: build its Docker image, remove leftover containers.",
    epilog="Example: harness sandbox build",
    no_args_is_help=True,
)
app.add_typer(sandbox_app, name="sandbox")


@sandbox_app.command("build", epilog="Example: harness sandbox build --task swebench --data-dir data")
def sandbox_build(
    tag: Annotated[str, typer.Option(help="image tag")] = "opd-sandbox:bookworm",
    force: Annotated[bool, typer.Option("--force", help="rebuild the rootfs tarball and re-import even if the image exists")] = False,
    cache_dir: Annotated[Path, typer.Option(help="where the rootfs tarball is cached (git-ignored)")] = Path(".cache/sandbox"),
    task: Annotated[
        str | None, typer.Option(help="also build the images a task needs (a task with build_images(), e.g. one image per instance)")
    ] = None,
    data_dir: Annotated[Path | None, typer.Option(help="local data root laid out as DIR/<task>/... (with --task)")] = None,
    task_arg: Annotated[list[str] | None, typer.Option("--task-arg", help="task option TASK.KEY=VALUE, repeatable (with --task)")] = None,
) -> None:
    """Build the sandbox's Docker image from Debian packages (mmdebstrap + docker import; never docker pull); with
    --task, then the images that task needs (--force then rebuilds those, not the base image)."""
    from sandbox.build import BuildError, build_base_image

    try:
        info = build_base_image(tag=tag, cache_dir=cache_dir, force=force and task is None)
    except BuildError as exc:
        raise _fail(str(exc), 1) from None
    if info["built"]:
        s = info["seconds"]
        stdout.print(f"built {tag} ({info['image_id'][:19]}): rootfs {s['rootfs']:.1f}s, import {s['import']:.1f}s")
    else:
        stdout.print(f"{tag} exists ({info['image_id'][:19]}); --force rebuilds it")
    if task is not None:
        _build_task_images(task, data_dir, task_arg or [], force)


def _build_task_images(name: str, data_dir: Path | None, task_arg: list[str], force: bool) -> None:
    """``sandbox build --task NAME``: the task's own ``build_images`` with a progress bar; exit 1 if one failed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from harness.config import deep_merge, parse_override
    from harness.plan import make_task
    from harness.task import Task

    task_args: dict = {}
    for item in task_arg:
        task_args = deep_merge(task_args, parse_override(item))
    if data_dir is not None:
        if not data_dir.is_dir():
            raise _fail(f"--data-dir {data_dir}: no such directory (it holds one folder per task: DIR/<task>/...)")
        task_args.setdefault(name, {})["data_dir"] = str(data_dir)
    try:
        task = make_task(name, task_args)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    if type(task).build_images is Task.build_images:  # the default builds nothing
        raise _fail(f"task {name!r} builds no images of its own (only the sandbox base image: `harness sandbox build`)")
    failed = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=stdout) as bar:
        job = bar.add_task(f"{name} images", total=None)

        def done(item: str, result) -> None:
            if isinstance(result, Exception):
                failed.append(item)
                bar.console.print(f"[red]failed[/] {item}: {result}")
            else:
                how = f"built in {result.seconds:.0f}s" if result.built else "cached"
                drops = ", ".join(f"{pin} ({why})" for pin, why in result.dropped.items()) or "none"
                bar.console.print(f"{item}: {result.tag} {how}; dropped pins: {drops}")
            bar.advance(job)

        try:
            results = task.build_images(force=force, on_start=lambda item: bar.update(job, description=f"{name}: {item}"), on_done=done)
        except (FileNotFoundError, ValueError) as exc:
            raise _fail(str(exc)) from None
        bar.update(job, total=len(results), description=f"{name} images")
    if failed:
        raise _fail(f"{len(failed)} image(s) failed to build: {', '.join(failed)}", 1)


@sandbox_app.command("cleanup", epilog="Example: harness sandbox cleanup")
def sandbox_cleanup(
    all_: Annotated[bool, typer.Option("--all", help="also containers of harness processes still running")] = False,
) -> None:
    """Remove sandbox containers left behind by crashed runs."""
    from sandbox.docker import reap_leftovers

    try:
        n = reap_leftovers(everything=all_)
    except Exception as exc:  # noqa: BLE001 - daemon down, SDK missing
        raise _fail(f"could not reach Docker: {exc}", 1) from None
    stdout.print(f"removed {n} sandbox container(s)")


from harness.data import data_app  # noqa: E402 - the `data` sub-app (harness data fetch / check) lives beside its code

app.add_typer(data_app, name="data")
plain_help(app)


def _show_version(value: bool) -> None:
    """``harness --version``: the installed package's version."""
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"opd-harness {version('opd-harness')}")
        except PackageNotFoundError:
            print("opd-harness (not installed as a package)")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True, help="print the version and exit")] = False,
) -> None:
    """Benchmark harness for on-policy distillation of language models."""


def main() -> None:
    """Entry point. SIGTERM shuts down cleanly (see ``Terminated``) and exits 143 (128 + SIGTERM)."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        app()
    except SystemExit:
        if _terminated:
            console.print("[bold red]terminated[/] by SIGTERM")
            raise SystemExit(128 + signal.SIGTERM) from None
        raise


if __name__ == "__main__":
    main()
