"""Options shared by the ``harness`` commands, defined once so a flag means the same everywhere, and the ``--set`` key
(or backend option) each one stands for. Imports nothing heavy: ``harness --help`` stays free of torch."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from opd_harness.errors import ConfigError

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
    "temperature": "trainer.temperature",
    "top_p": "trainer.top_p",
    "enable_thinking": "trainer.enable_thinking",
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


def check_positive_temperature(value: float | None) -> float | None:
    """A rollout temperature above 0 (a run samples; greedy rollouts are not a run setting): exit 2 naming --temperature."""
    if value is not None and not value > 0:
        raise typer.BadParameter(f"{value} is not above 0")
    return value


def check_top_p(value: float | None) -> float | None:
    """A nucleus mass in (0, 1]; anything else is a one-line exit 2 naming --top-p."""
    if value is not None and not 0 < value <= 1:
        raise typer.BadParameter(f"{value} is not in (0, 1]")
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


def backend_options(backend_cls: type, items: list[str] | None, *, device: str | None, dtype: str | None,
                    enable_thinking: bool | None = None) -> dict:  # fmt: skip
    """The ``--backend-option KEY=VALUE`` items (values read as YAML: "8" -> 8, URLs stay strings) with --device, --dtype
    and --enable-thinking as the backend options they stand for (the flag wins), checked before anything loads: a
    malformed item, an option the backend does not take, an unknown dtype, or a CUDA device this host lacks is a
    ConfigError naming the flag. One function, so the flags mean the same in ``harness eval`` and ``harness gate``."""
    import yaml

    from opd_harness.config import device_unavailable, load_options
    from opd_harness.models.hub import dtype_name

    out: dict = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--backend-option {item!r}: expected KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value) if value else value
    flags = {"device": ("--device", device), "dtype": ("--dtype", dtype), "enable_thinking": ("--enable-thinking", enable_thinking)}
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
ResultsRoot = Annotated[Path, typer.Option(help="results root")]
RunTemperature = Annotated[
    float | None,
    typer.Option(callback=check_positive_temperature, help="rollout sampling temperature, > 0 (= --set trainer.temperature=X)"),
]
RunTopP = Annotated[
    float | None, typer.Option(callback=check_top_p, help="rollout nucleus sampling, in (0, 1] (= --set trainer.top_p=X)")
]
RunEnableThinking = Annotated[
    bool | None,
    typer.Option(
        "--enable-thinking/--no-enable-thinking",
        help="Qwen3 thinking mode: enable_thinking passed to the pretrained student's and teacher's chat templates "
        "(= --set trainer.enable_thinking=true|false; default: the template's own default)",
    ),
]
Temperature = Annotated[
    float | None, typer.Option(min=0, help="sampling temperature, 0 = greedy (default 1.0, or the --protocol's)")
]
TopP = Annotated[
    float | None, typer.Option(callback=check_top_p, help="nucleus sampling, in (0, 1] (default 1.0, or the --protocol's)")
]
TopK = Annotated[
    int | None,
    typer.Option(min=0, help="sample from the K most likely tokens only, before top-p; 0 = off (default 0, or the --protocol's)"),
]
PresencePenalty = Annotated[
    float | None,
    typer.Option(min=-2, max=2, help="OpenAI's presence penalty (vllm and openai backends; default 0, or the --protocol's)"),
]
Protocol = Annotated[
    str | None,
    typer.Option(help="evaluation protocol setting sampling, max new tokens, k and thinking together: qwen3-thinking, "
                 "qwen3-non-thinking, greedy (docs/protocols.md); explicit flags override its values"),
]
OutputPath = Annotated[
    Path | None,
    typer.Option(help="also write results_<timestamp>.json and samples_<task>_<timestamp>.jsonl here (lm-eval's names; the "
                 "numbers equal the store's)"),
]
