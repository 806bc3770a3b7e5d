"""Resolve a validated config into plugins, and refuse bad combinations before anything runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from harness.config import ConfigError, RunConfig, format_validation_error
from harness.registry import METHODS, PIPELINES, TASKS, RegistryError


@dataclass
class Plan:
    """Everything a pipeline needs, looked up and validated."""

    config: RunConfig
    method: object  # trainers.objectives.MethodSpec
    hparams: object
    task: object  # tasks.base.Task
    eval_tasks: list = field(default_factory=list)
    pipeline: object = None
    warnings: list[str] = field(default_factory=list)


def make_task(name: str, task_args: dict[str, dict]) -> object:
    """Instantiate a registered task with its options from ``task_args[name]``."""
    try:
        cls = TASKS.get(name)
    except RegistryError as exc:
        raise ConfigError(str(exc)) from None
    try:
        options = cls.Options.model_validate(task_args.get(name, {}))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, cls.Options, prefix=f"task_args.{name}.")) from None
    return cls(options)


def plan_run(cfg: RunConfig) -> Plan:
    """Look up method, tasks and pipeline; check the method's declared inputs are provided."""
    unknown_task_args = set(cfg.task_args) - {cfg.task, *cfg.eval.tasks}
    if unknown_task_args:
        raise ConfigError(f"task_args has options for {sorted(unknown_task_args)}, which this run does not use (tasks: {cfg.task}, eval: {', '.join(cfg.eval.tasks)})")
    try:
        method = METHODS.get(cfg.method)
        pipeline = PIPELINES.get(cfg.trainer.mode)
    except RegistryError as exc:
        raise ConfigError(str(exc)) from None
    hparams = None
    for name, args in cfg.method_args.items():  # validate every method's args, so typos never wait
        try:
            spec = METHODS.get(name)
        except RegistryError as exc:
            raise ConfigError(f"method_args.{name}: {exc}") from None
        try:
            validated = spec.hparams.model_validate(args)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, spec.hparams, prefix=f"method_args.{name}.")) from None
        if name == method.name:
            hparams = validated
    hparams = hparams if hparams is not None else method.hparams()
    apply_group_size(cfg, method, hparams)
    task = make_task(cfg.task, cfg.task_args)
    eval_tasks = [make_task(name, cfg.task_args) for name in cfg.eval.tasks]
    if cfg.trainer.mode not in method.modes:
        raise ConfigError(f"method {method.name!r} supports modes {list(method.modes)}, not trainer.mode={cfg.trainer.mode!r}")
    provided = pipeline.provides(task)
    missing = method.needs(hparams) - provided
    if missing:
        raise ConfigError(
            f"method {method.name!r} needs {sorted(missing)}, which the {cfg.trainer.mode} pipeline cannot provide for task "
            f"{task.name!r} (it provides {sorted(provided)})"
        )
    return Plan(cfg, method, hparams, task, eval_tasks, pipeline, warnings=list(pipeline.warnings(method, hparams, task)))


def apply_group_size(cfg: RunConfig, method, hparams) -> None:
    """Give a group-baseline method (GRPO family) its default samples per prompt when no layer set one,
    and refuse 1 sample per prompt, where its advantage would be the raw reward, unless explicitly allowed."""
    trainer = cfg.trainer
    if method.group_size is not None and "samples_per_prompt" not in trainer.model_fields_set:
        trainer.samples_per_prompt = method.group_size  # recorded in the run's config like a set value
    if method.group_baseline(hparams) and trainer.samples_per_prompt < 2 and not getattr(hparams, "allow_single_sample", False):
        raise ConfigError(
            f"trainer.samples_per_prompt={trainer.samples_per_prompt}: method {method.name!r} centres each reward on its prompt's group "
            f"mean, which needs at least 2 samples per prompt (its default is {method.group_size}); with 1 it would train on the raw "
            f"reward with no baseline. Set trainer.samples_per_prompt >= 2, "
            f"or method_args.{method.name}.allow_single_sample=true to allow it"
        )
