"""Reference pages generated from the code, so they cannot drift: the CLI (the Typer app), the configuration (the
pydantic models of ``harness/config.py``), each method's hyper-parameters (its ``MethodSpec``) and the Python API
(signatures and docstrings of the names in ``API``). ``docs/hooks.py``
puts them into the pages at build time; ``tests/test_docs.py`` checks they cover every command, key and method."""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(value: object) -> str:
    return "`" + _cell(value).replace("`", "'") + "`"


# ---- the command line -------------------------------------------------------------------------------------------------


def _root_command():
    import typer.main

    from opd_harness.cli import app

    return typer.main.get_command(app)


def cli_commands() -> dict[str, object]:
    """Every leaf command of the ``harness`` app, by its full name (``harness data fetch``), in ``--help`` order."""
    found: dict[str, object] = {}

    def walk(command, name: str) -> None:
        subs = getattr(command, "commands", None)
        if subs:
            for sub_name, sub in subs.items():
                walk(sub, f"{name} {sub_name}")
        else:
            found[name] = command

    walk(_root_command(), "harness")
    return found


def _option_row(param) -> str:
    if getattr(param, "param_type_name", "") == "argument":
        name = _code((param.metavar or param.name or "").upper())
        kind = "argument" + ("" if param.required else ", optional")
    else:
        flags = list(param.opts) + [f"{o}" for o in getattr(param, "secondary_opts", [])]
        name = " / ".join(_code(f) for f in flags)
        kind = "flag" if getattr(param, "is_flag", False) else "option"
        if getattr(param, "multiple", False):
            kind += ", repeatable"
        if param.required:
            kind += ", required"
    default = param.default
    shown = "" if default is None or default == () or callable(default) else _code(default)
    return f"| {name} | {kind} | {shown} | {_cell(getattr(param, 'help', '') or '')} |"


def cli_markdown() -> str:
    """Markdown for every command: its help, usage, options (flags, kind, default, help) and its example."""
    root = _root_command()
    out = [f"`harness` — {_cell(root.help or '')}", ""]
    for name, command in cli_commands().items():
        out += [f"## {name}", ""]
        if command.help:
            out += [command.help.strip(), ""]
        params = [p for p in command.params if not getattr(p, "hidden", False)]
        usage = " ".join(
            (p.metavar or p.name or "").upper() if getattr(p, "param_type_name", "") == "argument" else "" for p in params
        ).split()
        out += ["```text", f"{name} [OPTIONS] {' '.join(usage)}".rstrip(), "```", ""]
        if params:
            out += ["| option | kind | default | help |", "|---|---|---|---|"]
            out += [_option_row(p) for p in params]
            out += ["| `--help` | flag |  | show the command's help and exit |", ""]
        if command.epilog:
            out += [_cell(command.epilog), ""]
    return "\n".join(out)


# ---- the configuration ------------------------------------------------------------------------------------------------


def _type_name(annotation) -> str:
    if annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _models_in(annotation) -> list[type]:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]


def _default(field) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_unset=True) or "(the section's defaults)"
        if isinstance(value, str):
            return value
    return _code(json.dumps(value, default=str))


def config_fields(model=None, prefix: str = "") -> list[tuple[str, object]]:
    """Every key of the run configuration, dotted (``trainer.layout.learner.sharding``), with its pydantic field."""
    if model is None:
        from opd_harness.config import RunConfig

        model = RunConfig
    rows: list[tuple[str, object]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        rows.append((key, field))
        for sub in _models_in(field.annotation):
            rows += config_fields(sub, f"{key}.")
    return rows


def config_markdown() -> str:
    """One table per top-level section (the top-level keys first): key, type, default, description."""
    sections: dict[str, list[str]] = {"Top-level keys": []}
    for key, field in config_fields():
        section = key.split(".")[0] if "." in key else "Top-level keys"
        row = f"| `{key}` | {_cell(_type_name(field.annotation))} | {_default(field)} | {_cell(field.description or '')} |"
        sections.setdefault(section, []).append(row)
    out: list[str] = []
    for section, rows in sections.items():
        title = section if section == "Top-level keys" else f"`{section}`"
        out += [f"## {title}", "", "| key | type | default | description |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out)


# ---- methods ----------------------------------------------------------------------------------------------------------


def method_names() -> list[str]:
    from opd_harness.registry import METHODS

    return [name for name in METHODS.names() if not name.startswith("_")]  # "_name": a test's own registration, not a method to document


def method_markdown(name: str) -> str:
    """One method's spec: description, modes, declared inputs, teacher signal kinds, hyper-parameters, notes."""
    from opd_harness.method import INPUTS
    from opd_harness.registry import METHODS

    spec = METHODS.get(name)
    hp = spec.hparams()
    out = [
        f"**`{name}`** — {_cell(spec.description)}",
        "",
        f"- modes: {', '.join(f'`{m}`' for m in spec.modes)} (default `{spec.default_mode}`); "
        + ("on-policy (the student samples)" if spec.on_policy else "off-policy (reference responses)"),
        "- declared inputs (defaults): " + ", ".join(f"`{i}` ({_cell(INPUTS.get(i, ''))})" for i in sorted(spec.needs(hp))),
    ]
    if "teacher_dist" in spec.needs(hp):
        out.append("- teacher signal kinds: " + ", ".join(f"`{k}`" for k in spec.accepted_signals(hp)))
    out += ["", "| `method_args." + name + ".` key | type | default | description |", "|---|---|---|---|"]
    for key, field in spec.hparams.model_fields.items():
        out.append(f"| `{key}` | {_cell(_type_name(field.annotation))} | {_default(field)} | {_cell(field.description or '')} |")
    if len(spec.hparams.model_fields) == 0:
        out.append("| (none) | | | |")
    if spec.notes:
        out += ["", "Notes (`MethodSpec.notes`, also in every run's `method.json`):", ""]
        out += [f"- `{k}`: {_cell(v)}" for k, v in spec.notes.items()]
    return "\n".join(out) + "\n"


# ---- the Python API ---------------------------------------------------------------------------------------------------

API: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "Tasks",
        "A task is a `Task` subclass declared as an entry point in the group `opd_harness.tasks` "
        "([Adding a task](../extending/add-a-task.md)); multi-turn tasks return an `Env` per episode.",
        (
            "opd_harness.task.Task", "opd_harness.task.TaskOptions", "opd_harness.task.Problem", "opd_harness.task.Score",
            "opd_harness.task.read_jsonl", "opd_harness.task.DataError", "opd_harness.task.DataNotFound",
            "opd_harness.task.DataNeed", "opd_harness.episode.Env", "opd_harness.episode.StepResult",
            "opd_harness.episode.Observation", "opd_harness.episode.SingleTurnEnv",
            "opd_harness.tasks.math_grading.MathVerifyGraded", "opd_harness.tasks.math_grading.grade_answer",
            "opd_harness.tasks.agentic.sandboxed.SandboxedTask", "opd_harness.tasks.agentic.shell_task.ShellAgentTask",
            "opd_harness.tasks.agentic.shell_env.Check",
        ),
    ),
    (
        "Methods",
        "A method is a `MethodSpec` declared as an entry point in the group `opd_harness.methods`; its objective reads "
        "a `TensorBatch` and the student's `StudentOutputs` ([Adding a method](../extending/add-a-method.md)).",
        (
            "opd_harness.method.MethodSpec", "opd_harness.method.HParams", "opd_harness.method.StudentOutputs",
            "opd_harness.method.INPUTS", "opd_harness.trajectory.TensorBatch", "opd_harness.trainers.objectives.masked_mean",
            "opd_harness.lazy.lazy_import",
        ),
    ),
    (
        "Registries",
        "Everything the harness looks up by name ([Plug-ins](../extending/plugins.md)).",
        ("opd_harness.registry.Registry", "opd_harness.registry.RegistryError", "opd_harness.registry.TASKS",
         "opd_harness.registry.METHODS", "opd_harness.registry.BACKENDS"),
    ),
    (
        "Backends",
        "Inference engines (group `opd_harness.backends`): `hf`, `hf_static`, `replay`, `openai`, `vllm`.",
        ("opd_harness.backends.Backend", "opd_harness.backends.RolloutEngine", "opd_harness.backends.SamplingParams",
         "opd_harness.backends.Completion"),
    ),
    (
        "Sandboxes",
        "Where model-written code runs (group `opd_harness.sandboxes`): `docker`, `local`.",
        ("opd_harness.sandbox.open_sandbox", "opd_harness.sandbox.Sandbox", "opd_harness.sandbox.Session",
         "opd_harness.sandbox.ExecRequest", "opd_harness.sandbox.ExecResult"),
    ),
    (
        "Configuration",
        "The run configuration `harness run` builds from a preset, a file and `--set` overrides "
        "([Configuration reference](config.md)).",
        ("opd_harness.config.build_config", "opd_harness.config.RunConfig"),
    ),
    (
        "Results store and statistics",
        "Reading what runs and evaluations wrote to `DIR/results.sqlite` ([Results store](results-store.md)), and the "
        "statistics the leaderboard and the gate use ([Statistics](statistics.md)).",
        ("opd_harness.store.Store", "opd_harness.metrics.avg_at_k", "opd_harness.metrics.pass_at_k",
         "opd_harness.metrics.bootstrap_ci", "opd_harness.metrics.paired_bootstrap", "opd_harness.metrics.PairedResult",
         "opd_harness.metrics.summarize", "opd_harness.gate.gate"),
    ),
)

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc):`~?([^`]+)`")


def api_object(dotted: str) -> object:
    """Import ``package.module.Name`` (the longest importable module prefix, then attributes)."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot import {dotted}")


def _md(text: str) -> str:
    """A docstring as Markdown: reST roles and ``literals`` as code spans; ``<`` escaped outside code spans; every line
    flush left (indented docstring lines would otherwise become code blocks), bullets kept."""
    text = _ROLE.sub(r"`\1`", text).replace("``", "`")
    out = []
    for line in text.splitlines():
        line = line.strip()
        pieces = line.split("`")
        line = "`".join(p.replace("<", "&lt;") if i % 2 == 0 else p for i, p in enumerate(pieces))
        out.append(line)
    return "\n".join(out)


class _Annotation:
    """An annotation written as source text (``from __future__ import annotations``), shown without quotes."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(obj: object, *, returns: bool = True) -> str:
    """``(a: int, b: str = 'x') -> T``: annotations as written in the source, no quotes; '' when there is none to show."""
    import inspect

    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""

    def unquoted(annotation: object) -> object:
        return _Annotation(annotation) if isinstance(annotation, str) else annotation

    params = [p.replace(annotation=unquoted(p.annotation)) for p in sig.parameters.values()]
    ret = unquoted(sig.return_annotation) if returns else inspect.Signature.empty
    text = str(sig.replace(parameters=params, return_annotation=ret))
    return "" if text in ("(*args, **kwargs)", "(self, /, *args, **kwargs)") else text


def _fields_table(obj: type) -> list[str]:
    """Fields of a pydantic model or a dataclass: name, type, default (and description)."""
    import dataclasses

    from pydantic import BaseModel

    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    if isinstance(obj, type) and issubclass(obj, BaseModel):
        for name, field in obj.model_fields.items():
            rows.append(f"| `{name}` | {_cell(_type_name(field.annotation))} | {_default(field)} | {_cell(field.description or '')} |")
    else:
        for f in dataclasses.fields(obj):
            if f.default is not dataclasses.MISSING:
                default = "(a function)" if callable(f.default) else _code(repr(f.default))
            elif f.default_factory is not dataclasses.MISSING:
                default = "(computed)"
            else:
                default = "(required)"
            kind = f.type if isinstance(f.type, str) else _type_name(f.type)
            rows.append(f"| `{f.name}` | {_cell(kind)} | {default} | |")
    return rows if len(rows) > 2 else []


def _members(cls: type) -> list[str]:
    """The public methods and properties a class defines itself, each with its signature and first docstring paragraph."""
    import inspect

    import dataclasses

    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    out = []
    for name, member in vars(cls).items():
        if name.startswith("_") or name in fields:  # a dataclass field's default (a function, say) is not a method
            continue
        func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if isinstance(member, property):
            func, sig = member.fget, ""
        elif inspect.isfunction(func):
            sig = _signature(func)
        else:
            continue
        doc = (inspect.getdoc(func) or "").split("\n\n")[0]
        out.append(f"- `{name}{sig}`" + (f": {_md(doc)}".replace("\n", " ") if doc else ""))
    return out


def api_entry(dotted: str) -> str:
    """One public name: its kind, signature, docstring, and for classes their fields and own public methods."""
    import dataclasses
    import inspect

    from pydantic import BaseModel

    obj = api_object(dotted)
    out = [f"### `{dotted}`", ""]
    if inspect.isclass(obj) or inspect.isfunction(obj):
        kind = "class" if inspect.isclass(obj) else "function"
        is_model = inspect.isclass(obj) and (issubclass(obj, BaseModel) or dataclasses.is_dataclass(obj))
        sig = "" if is_model else _signature(obj, returns=kind == "function")
        out += ["```python", f"{kind} {dotted.rsplit('.', 1)[1]}{sig}", "```", ""]
        out += [_md(inspect.getdoc(obj) or ""), ""]
        if is_model:
            out += _fields_table(obj) + [""]
        if inspect.isclass(obj):
            members = _members(obj)
            if members:
                out += ["Methods:", "", *members, ""]
    elif isinstance(obj, dict):
        out += [f"A `dict` of {len(obj)} entries:", "", "| key | value |", "|---|---|"]
        out += [f"| `{k}` | {_cell(v)} |" for k, v in obj.items()] + [""]
    elif hasattr(obj, "entry_point_group"):
        name = dotted.rsplit(".", 1)[1]
        out += [f"The `Registry` of the entry-point group `{obj.entry_point_group}`: `{name}.names()` lists what is "
                f"registered, `{name}.get(name)` returns one (an unknown name raises `RegistryError` listing the valid "
                f"names and the closest match), `{name}.add(name, obj)` registers one (a test's own, say).", ""]
    else:
        out += [f"An instance of `{type(obj).__module__}.{type(obj).__qualname__}`.", ""]
    return "\n".join(out)


def api_names() -> list[str]:
    """Every name the Python API page documents, in page order."""
    return [name for _, _, names in API for name in names]


def api_markdown() -> str:
    """Every section of ``API``: its introduction, then one entry per name."""
    out: list[str] = []
    for title, intro, names in API:
        out += [f"## {title}", "", intro, ""]
        out += [api_entry(name) for name in names]
    return "\n".join(out)
