"""Options shared by the ``harness`` commands, defined once so a flag means the same everywhere, and the ``--set`` key
(or backend option) each one stands for. Imports nothing heavy: ``harness --help`` stays free of torch."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

DTYPES = ("auto", "bf16", "fp16", "fp32")
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}

# harness run: flag -> the dotted --set key it sets (the flag wins over --set, like --method and --task)
RUN_FLAG_KEYS = {
    "student": "student.path",
    "teacher": "teacher.path",
    "steps": "trainer.steps",
    "lr": "trainer.lr",
    "device": "trainer.device",
    "dtype": "trainer.precision",
}


def normalise_dtype(value: str | None) -> str | None:
    """``bf16``, ``fp16``, ``fp32`` or ``auto`` (torch's names accepted); anything else is a one-line exit 2 naming --dtype."""
    if value is None:
        return None
    name = DTYPE_ALIASES.get(value.lower(), value.lower())
    if name not in DTYPES:
        raise typer.BadParameter(f"{value!r}: choose one of {', '.join(DTYPES)}", param_hint="--dtype")
    return name


def check_device_name(value: str | None) -> str | None:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (whether this host has it is checked where the device is used)."""
    if value is None:
        return None
    kind, _, index = value.partition(":")
    if value not in ("auto", "cpu") and (kind != "cuda" or (index and not index.isdigit())):
        raise typer.BadParameter(f"{value!r}: choose auto, cpu, cuda or cuda:N", param_hint="--device")
    return value


def run_flags_as_config(**flags: object) -> dict:
    """``harness run``'s model and trainer flags as a config layer (the same nesting their ``--set`` keys give)."""
    layer: dict = {}
    for name, value in flags.items():
        if value is None:
            continue
        section, key = RUN_FLAG_KEYS[name].split(".")
        layer.setdefault(section, {})[key] = str(value) if isinstance(value, Path) else value
    return layer


Student = Annotated[
    str | None, typer.Option(help="the student: a hub id (Qwen/Qwen3-1.7B) or a local model folder (= --set student.path=MODEL)")
]
Teacher = Annotated[
    str | None, typer.Option(help="the teacher: a hub id (Qwen/Qwen3-8B) or a local model folder (= --set teacher.path=MODEL)")
]
Steps = Annotated[int | None, typer.Option(min=1, help="optimizer steps (= --set trainer.steps=N)")]
LearningRate = Annotated[float | None, typer.Option("--lr", min=0, help="learning rate (= --set trainer.lr=X)")]
Device = Annotated[
    str | None,
    typer.Option(callback=check_device_name, help="auto, cpu, cuda or cuda:N (auto: cuda when torch sees one, else cpu)"),
]
Dtype = Annotated[
    str | None,
    typer.Option(callback=normalise_dtype, help="auto, bf16, fp16 or fp32 (auto: bf16 on a GPU that supports it, else fp32)"),
]
MaxNewTokens = Annotated[int | None, typer.Option(min=1, help="most generated tokens per answer (default: the task's max_new_tokens)")]
EnableThinking = Annotated[
    bool | None,
    typer.Option(
        "--enable-thinking/--no-enable-thinking",
        help="Qwen3 thinking mode: enable_thinking passed to the chat template (default: the template's own default)",
    ),
]
DataDir = Annotated[Path | None, typer.Option(help="local data root laid out as DIR/<task>/... (default: $HARNESS_DATA_DIR)")]
