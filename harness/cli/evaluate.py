"""``harness eval``: evaluate a model or checkpoint (protocols, sharded on Ray, dry run, output files)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from opd_harness.cli import options as opts
from opd_harness.errors import ConfigError
from opd_harness.jsonout import to_json
from opd_harness.registry import RegistryError

if TYPE_CHECKING:  # the config models and the task classes are imported by the commands that use them (start-up)
    pass


from opd_harness.cli._common import (app, console, stdout, _fail, _closes_tasks, _prepare_tasks, check_data_dir, _quiet_libraries,
                                     open_interval)


EVAL_EXECUTOR_KEYS = ("executor", "workers", "ray_address", "max_sandboxes", "gpus_per_worker", "actor_timeout",
                      "actor_restart_timeout")  # where an eval ran and how its workers were watched, not what it measured


def seconds_option(help: str) -> typer.models.OptionInfo:
    """An option of a positive number of seconds (exit 2 naming the flag otherwise), None when not given."""
    return typer.Option(callback=open_interval(0, math.inf, low_open=True), help=help)


def check_eval_executor(executor: str, **placement: object) -> None:
    """``harness eval``'s placement flags (``placement``: ``ray_address=…``, ``workers=…``, … as the options' names, None when
    not given): exit 2 naming the flag when the executor is unknown or a flag needs ``--executor ray``."""
    if executor != "inprocess":
        from opd_harness.registry import EVAL_EXECUTORS

        try:
            EVAL_EXECUTORS.get(executor)
        except RegistryError as exc:
            raise ConfigError(f"--executor {executor!r}: {exc} (or inprocess)") from None
        return
    flag = next((name for name, value in placement.items() if value is not None), None)
    if flag is not None:
        raise ConfigError(f"--{flag.replace('_', '-')} needs --executor ray (the in-process evaluation runs in this process)")


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
    from opd_harness.evaluation import shard_problems

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
    data_dir: opts.DataDir = None,
    out: opts.ResultsRoot = Path("results"),
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
    actor_timeout: Annotated[
        float | None,
        seconds_option("seconds a shard may take on a worker (--executor ray; default: no bound); past it the worker counts as hung: it "
                       "is killed, Ray restarts it and the shard goes back to the queue"),
    ] = None,
    actor_restart_timeout: Annotated[
        float | None,
        seconds_option("seconds a worker may take to start, or to come back after it died or hung (--executor ray; default: no bound, "
                       "or 300 with --actor-timeout); past it the eval fails naming the worker and its node"),
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

    from opd_harness.backends import SamplingParams
    from opd_harness.config import deep_merge, parse_override
    from opd_harness.evaluation import (EvalWorkersFailed, EvalWorkerSpec, LocalShards, ShardStage, describe_episodes, evaluate_task,
                                        store_eval)
    from opd_harness.progress import progress
    from opd_harness.leaderboard import leaderboard_rows, render_table
    from opd_harness.plan import load_problems, make_task
    from opd_harness.registry import BACKENDS, EVAL_EXECUTORS
    from opd_harness.store import Store
    from opd_harness.runs import new_run_id
    from opd_harness.tracking import RunInfo, TrackerStartFailed, check_loggers, open_trackers

    _quiet_libraries()
    names = [t.strip() for t in task.split(",") if t.strip()]
    try:
        loggers = check_loggers(logger or [])
    except ValueError as exc:
        raise _fail(f"--logger: {exc}") from None
    try:
        check_eval_executor(executor, workers=workers, ray_address=ray_address, max_sandboxes=max_sandboxes,
                            gpus_per_worker=gpus_per_worker, actor_timeout=actor_timeout,
                            actor_restart_timeout=actor_restart_timeout)  # fmt: skip
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
    try:
        options = opts.backend_options(backend_cls, backend_option, device=device, dtype=dtype, enable_thinking=enable_thinking)
        if backend == "hf":  # a folder without weights, or a hub id offline: one line now, not a traceback after the data
            from opd_harness.models.hub import ModelUnavailable, locate_model

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
        "actor_timeout": actor_timeout,
        "actor_restart_timeout": actor_restart_timeout,
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
            gpus_per_worker=gpus_per_worker or 0.0, actor_timeout=actor_timeout, actor_restart_timeout=actor_restart_timeout,
        )
    errors: tuple[type[BaseException], ...] = (ValueError,)
    if backend == "openai":
        import openai

        errors += (openai.OpenAIError,)
    summaries = {}
    with ExitStack() as stack:
        try:  # the model is loaded (here, or by every worker) before the run row exists
            runner = stack.enter_context(shards())
        except EvalWorkersFailed as exc:  # infrastructure: a worker that did not start within --actor-restart-timeout
            raise _fail(str(exc), 1) from None
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
        from opd_harness.evaluation import write_output_path

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
    from opd_harness.protocols import get_protocol, resolve

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


def _eval_dry_run(model: str, backend: str, options: dict, tasks: list, problems_of: dict, settings: dict[str, dict]) -> None:
    """``harness eval --dry-run``: the data is loaded and checked (before this); read the model's config and tokenizer (no
    weights) and print what would run."""
    from opd_harness.dry_run import read_model_files

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


