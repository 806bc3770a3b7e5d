"""Run configuration: pydantic models, YAML presets, ``--config`` files and dotted ``--set`` overrides.

Precedence: built-in defaults < preset < config file < ``--set`` < explicit CLI flags. Every
error names the offending key and what is allowed.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from harness.models.tiny import TinyArch


class ConfigError(ValueError):
    """A bad configuration value; the CLI prints it and exits with code 2."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(Strict):
    """Either a pretrained model (``path``: local dir or hub id) or a tiny model built from ``arch``."""

    path: str | None = Field(None, description="local directory or Hugging Face hub id")
    arch: TinyArch | None = Field(None, description="build a tiny Qwen3 model from this shape")
    sft_steps: int = Field(0, ge=0, description="supervised warm-up steps on the training task's reference solutions")
    sft_lr: float = Field(3e-3, gt=0)
    sft_batch_size: int = Field(64, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        if (self.path is None) == (self.arch is None):
            raise ValueError("give exactly one of 'path' (a pretrained model) or 'arch' (a tiny model to build)")
        return self


class TrainerConfig(Strict):
    mode: Literal["sync"] = Field("sync", description="pipeline: sync (async is planned)")
    steps: int = Field(400, ge=1, description="optimizer steps")
    prompts_per_step: int = Field(64, ge=1)
    samples_per_prompt: int = Field(1, ge=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up")
    grad_clip: float = Field(1.0, ge=0, description="max gradient norm; 0 disables")
    checkpoint_every: int = Field(100, ge=1)
    temperature: float = Field(1.0, gt=0, description="rollout sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int | None = Field(None, ge=1, description="default: the task's max_new_tokens")
    generate_batch_size: int = Field(256, ge=1)


class EvalConfig(Strict):
    tasks: list[str] = Field(default_factory=lambda: ["arith"])
    k: int | None = Field(None, ge=1, description="samples per problem (default: the task's k)")
    limit: int | None = Field(None, ge=1, description="evaluate the first N problems of each task")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    before_training: bool = Field(True, description="evaluate the initial student as checkpoint 0")
    teacher: bool = Field(True, description="evaluate the teacher once, as a reference row")
    n_resamples: int = Field(10_000, ge=100, description="bootstrap resamples for confidence intervals")
    seed: int = 0


class RunConfig(Strict):
    method: str = "opd"
    task: str = "arith"
    seed: int = 0
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: all cores)")
    student: ModelSpec = Field(default_factory=lambda: ModelSpec(arch=TinyArch(hidden=128, layers=2), sft_steps=300, seed=1))
    teacher: ModelSpec = Field(default_factory=lambda: ModelSpec(arch=TinyArch(hidden=192, layers=3, ffn=384), sft_steps=800))
    method_args: dict[str, dict[str, Any]] = Field(default_factory=dict, description="hyper-parameters by method name")
    task_args: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per-task options, by task name")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)


PRESETS = ("smoke", "cpu-demo")


def load_preset(name: str) -> dict:
    """The YAML of a built-in preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}")
    text = resources.files("harness.presets").joinpath(f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}


def load_yaml_file(path: Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def deep_merge(base: dict, update: dict) -> dict:
    """Recursive dict merge; ``update`` wins."""
    out = dict(base)
    for key, value in update.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_override(item: str) -> dict:
    """``a.b.c=value`` → nested dict; the value is parsed as YAML (numbers, lists, booleans)."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. trainer.lr=1e-5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    for part in reversed(key.split(".")):
        value = {part: value}
    return value  # type: ignore[return-value]


def format_validation_error(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """One line per error: the dotted key, the problem, and for unknown keys the allowed ones."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        key = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "(top level)"
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, err["loc"][:-1])
            lines.append(f"unknown key {key!r}; allowed here: {', '.join(allowed)}")
        else:
            lines.append(f"{key}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def _allowed_keys(model: type[BaseModel], path: tuple) -> list[str]:
    current: Any = model
    for part in path:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = _model_of(field.annotation)
    return sorted(getattr(current, "model_fields", {}))


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def build_config(*, preset: str | None = None, config_file: Path | None = None, overrides: list[str] = (), cli: dict | None = None) -> RunConfig:
    """Merge the layers and validate; raises :class:`ConfigError` naming the bad key."""
    data: dict = {}
    if preset:
        data = deep_merge(data, load_preset(preset))
    if config_file:
        data = deep_merge(data, load_yaml_file(config_file))
    for item in overrides:
        data = deep_merge(data, parse_override(item))
    data = deep_merge(data, {k: v for k, v in (cli or {}).items() if v is not None})
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, RunConfig)) from None
