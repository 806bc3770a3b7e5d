"""Reference pages generated from the code, so they cannot drift: the CLI (the Typer app), the configuration (the
pydantic models of ``harness/config.py``) and each method's hyper-parameters (its ``MethodSpec``). ``docs/hooks.py``
puts them into the pages at build time; ``tests/test_docs.py`` checks they cover every command, key and method."""

from __future__ import annotations

import json
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
