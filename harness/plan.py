"""Resolve a validated config into plugins, and refuse bad combinations before anything runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError
from rich.console import Console

from opd_harness.config import ConfigError, RunConfig, format_validation_error
from opd_harness.method import HParams, MethodSpec
from opd_harness.registry import BACKENDS, METHODS, PIPELINES, TASKS, RegistryError
from opd_harness.store import Store
from opd_harness.teacher_signal import SCORE_FIELD
from opd_harness.task import DataError, Problem, Task


class Pipeline(Protocol):
    """A registered training pipeline (``trainer.mode``): what it gives a method, and the run itself."""

    name: str

    def provides(self, task: Task) -> frozenset[str]:
        """The method inputs this pipeline can provide when training on ``task``."""

    def warnings(self, method: MethodSpec, hparams: HParams, task: Task) -> list[str]:
        """What to tell the user about this combination before the run starts."""

    def run(self, plan: Plan, store: Store, run_id: str, *, resume: bool = False, console: Console | None = None) -> None:
        """Train ``plan.method`` on ``plan.task``, checkpointing and evaluating into ``store``."""


@dataclass
class Plan:
    """Everything a pipeline needs, looked up and validated."""

    config: RunConfig
    method: MethodSpec
    hparams: HParams
    task: Task
    eval_tasks: list[Task] = field(default_factory=list)
    pipeline: Pipeline | None = None
    warnings: list[str] = field(default_factory=list)
    train_problems: list[Problem] | None = None  # the training split, once load_plan_data has validated it
    eval_problems: dict[str, list[Problem]] = field(default_factory=dict)  # eval task name -> its evaluated test problems


class DataUnavailable(ConfigError):
    """A task's data is missing or has a bad row; the CLI prints it and exits with code 2."""


def data_hint(task_name: str) -> str:
    """How to get a task's data and point the harness at it."""
    return (
        f"get it with `harness data fetch {task_name} --to DIR`, then pass --data-dir DIR (harness eval), "
        f"--set task_args.{task_name}.data_dir=DIR (harness run) or set $HARNESS_DATA_DIR=DIR"
    )


def load_problems(task: Task, split: str, *, data_dir: Path | None = None, limit: int | None = None) -> list[Problem]:
    """The validated problems of ``task``'s ``split`` (the first ``limit``); missing data or a bad row is DataUnavailable."""
    try:
        problems = task.load(split, data_dir)
    except DataError as exc:  # names file:line:field
        raise DataUnavailable(f"{task.name} [{split}]: bad data: {exc}") from None
    except ValueError as exc:  # e.g. options that leave too few distinct problems
        raise DataUnavailable(f"{task.name} [{split}]: {exc}") from None
    except (FileNotFoundError, ImportError) as exc:  # DataNotFound included; ImportError: a reader's optional dependency
        raise DataUnavailable(f"{exc}\n{task.name}: {data_hint(task.name)}") from None
    return problems[:limit] if limit else problems


def load_plan_data(plan: Plan) -> Plan:
    """Load and validate the training split and every eval task's problems onto ``plan``, before anything is created."""
    train = load_problems(plan.task, plan.task.training_split())
    users = reference_users(plan.config, plan.method, plan.hparams)
    lacking = next((p for p in train if p.solution is None), None) if users else None
    if lacking is not None:
        raise DataUnavailable(f"{users[0]} trains on reference solutions, but {plan.task.name} problem {lacking.id!r} has none")
    plan.train_problems = train
    plan.eval_problems = {task.name: load_problems(task, "test", limit=plan.config.eval.limit) for task in plan.eval_tasks}
    return plan


def reference_users(cfg: RunConfig, method: MethodSpec, hparams: HParams) -> list[str]:
    """What in this run trains on the task's reference solutions: a method off-policy or declaring them, SFT warm-ups."""
    users = [f"method {method.name!r}"] if not method.on_policy or "reference_responses" in method.needs(hparams) else []
    return users + [
        f"{role}.sft_steps={getattr(cfg, role).sft_steps}" for role in ("student", "teacher") if getattr(cfg, role).sft_steps > 0
    ]


def check_references(cfg: RunConfig, method: MethodSpec, hparams: HParams, task: Task) -> None:
    """Refuse a run whose method or warm-up needs reference solutions the training task does not declare."""
    for role in ("student", "teacher"):
        spec = getattr(cfg, role)
        if spec.sft_steps > 0 and spec.path is not None:
            raise ConfigError(
                f"{role}.sft_steps={spec.sft_steps}: warm-up is only supported for tiny models built from '{role}.arch'; "
                f"set {role}.sft_steps=0"
            )
    users = reference_users(cfg, method, hparams)
    if users and "reference_responses" not in task.provided_inputs():
        raise ConfigError(
            f"{' and '.join(users)} {'trains' if len(users) == 1 else 'train'} on reference solutions, which task {task.name!r} "
            f"does not provide (it provides {sorted(task.provided_inputs())}); choose a task with reference solutions"
            + (" or set those sft_steps to 0" if any("sft_steps" in u for u in users) else "")
        )


def check_behaviour_logprobs(cfg: RunConfig, method: MethodSpec, hparams: HParams) -> None:
    """Refuse a rollout engine told not to return the sampled tokens' log-probs when the method trains on them
    (``behaviour_logprobs``); only an evaluation may go without them."""
    from opd_harness.backends import as_bool

    option = cfg.trainer.rollout_backend_options.get("logprobs")
    if option is None or not method.on_policy or "behaviour_logprobs" not in method.needs(hparams):
        return
    try:
        wanted = as_bool(option)
    except ValueError as exc:
        raise ConfigError(f"trainer.rollout_backend_options.logprobs: {exc}") from None
    if not wanted:
        raise ConfigError(
            f"trainer.rollout_backend_options.logprobs={option!r}: method {method.name!r} trains on the behaviour policy's log-probs "
            "of the sampled tokens (behaviour_logprobs), so the rollout engine must return them; remove the option"
        )


def make_task(name: str, task_args: dict[str, dict]) -> Task:
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
        raise ConfigError(
            f"task_args has options for {sorted(unknown_task_args)}, which this run does not use "
            f"(tasks: {cfg.task}, eval: {', '.join(cfg.eval.tasks)})"
        )
    try:
        method = METHODS.get(cfg.method)
        pipeline = PIPELINES.get(cfg.trainer.mode)
    except RegistryError as exc:
        raise ConfigError(str(exc)) from None
    validated = validate_method_args(cfg.method_args)
    unused = sorted(set(validated) - {method.name})
    if unused:
        raise ConfigError(
            f"method_args.{unused[0]}: options of method {unused[0]!r}, which this run does not select (method={method.name}); "
            f"remove them or choose --method {unused[0]}"
        )
    if cfg.trainer.enable_thinking is not None and cfg.student.path is None:
        raise ConfigError("trainer.enable_thinking (--enable-thinking) is passed to a pretrained model's chat template: "
                          "name the student with --student (a tiny model built from arch has no chat template)")  # fmt: skip
    hparams = validated.get(method.name) or method.hparams()
    apply_group_size(cfg, method, hparams)
    teacher_warnings = choose_teacher_signal(cfg, method, hparams)
    task = make_task(cfg.task, cfg.task_args)
    eval_tasks = [make_task(name, cfg.task_args) for name in cfg.eval.tasks]
    if cfg.trainer.mode not in method.modes:
        raise ConfigError(f"method {method.name!r} supports modes {list(method.modes)}, not trainer.mode={cfg.trainer.mode!r}")
    provided = pipeline.provides(task)
    missing = method.needs(hparams) - provided - {"reference_responses"}  # references: check_references says what to change
    if missing:
        raise ConfigError(
            f"method {method.name!r} needs {sorted(missing)}, which the {cfg.trainer.mode} pipeline cannot provide for task "
            f"{task.name!r} (it provides {sorted(provided)})"
        )
    check_references(cfg, method, hparams, task)
    check_behaviour_logprobs(cfg, method, hparams)
    untestable = next((t for t in eval_tasks if "test" not in t.splits), None)
    if untestable is not None:
        raise ConfigError(f"eval.tasks: {untestable.name} has no test split to evaluate (its splits: {', '.join(untestable.splits)}); "
                          "name the tasks each checkpoint is evaluated on: --set 'eval.tasks=[TASK,...]'")  # fmt: skip
    return Plan(cfg, method, hparams, task, eval_tasks, pipeline, warnings=[*teacher_warnings, *pipeline.warnings(method, hparams, task)])


def validate_method_args(method_args: dict[str, dict]) -> dict[str, HParams]:
    """Every method's args validated against its hyper-parameters (unknown method or key: ConfigError naming it)."""
    validated = {}
    for name, args in method_args.items():
        try:
            spec = METHODS.get(name)
        except RegistryError as exc:
            raise ConfigError(f"method_args.{name}: {exc}") from None
        try:
            validated[name] = spec.hparams.model_validate(args)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, spec.hparams, prefix=f"method_args.{name}.")) from None
    return validated


def choose_teacher_signal(cfg: RunConfig, method: MethodSpec, hparams: HParams) -> list[str]:
    """Resolve ``teacher.signal`` (auto: the first kind the method accepts that the teacher's backend gives) and refuse a kind
    the method does not accept or the backend cannot give; the chosen kind is written into the run's config."""
    accepted = method.accepted_signals(hparams)
    chosen = cfg.teacher.signal
    if not accepted:
        if chosen != "auto":
            raise ConfigError(f"teacher.signal={chosen}: method {method.name!r} reads no teacher signal; leave it auto")
        return []
    top_ids = getattr(BACKENDS.get(cfg.trainer.rollout_backend), "gives_top_ids", False)  # student_topk: the sampler's top-k
    if chosen == "student_topk" and not top_ids:
        raise ConfigError(f"teacher.signal=student_topk: trainer.rollout_backend={cfg.trainer.rollout_backend} returns no top-k token "
                          "ids of the student; use trainer.rollout_backend=hf or hf_static, or teacher.signal=topk")  # fmt: skip
    fields = getattr(BACKENDS.get(cfg.teacher.backend), "score_fields", ())
    given = [kind for kind in accepted if kind == "sampled" or (SCORE_FIELD[kind] in fields and (kind != "student_topk" or top_ids))]
    if chosen == "auto":
        if not given:
            raise ConfigError(
                f"teacher.backend={cfg.teacher.backend}: method {method.name!r} reads the teacher's distribution as one of "
                f"{list(accepted)}, and that backend gives none of them (it scores {list(fields)}); use teacher.backend=hf "
                "or a method that reads only teacher log-probs"
            )
        cfg.teacher.signal = given[0]
        return [] if given[0] == accepted[0] else [
            f"teacher.backend={cfg.teacher.backend} gives no {accepted[0]} teacher signal: method {method.name!r} uses "
            f"teacher.signal={given[0]} (k = teacher.top_k = {cfg.teacher.top_k})"
        ]  # fmt: skip
    if chosen not in accepted:
        raise ConfigError(f"teacher.signal={chosen}: method {method.name!r} with these method_args accepts {list(accepted)}")
    if chosen not in given:
        raise ConfigError(f"teacher.signal={chosen}: teacher.backend={cfg.teacher.backend} cannot give it (it scores {list(fields)})")
    return []


def apply_group_size(cfg: RunConfig, method: MethodSpec, hparams: HParams) -> None:
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
