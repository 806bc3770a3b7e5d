"""Evaluation protocols: named sets of sampling settings, new-token budgets, sample counts and the chat template's
thinking switch, kept as data (``protocols.yaml`` beside this module, each with its source) and applied by
``harness eval --protocol NAME``. A protocol's ``families`` give rules for a family of tasks: a task joins one by its
``protocol_family`` option (declared by the task, never matched on its name here). Explicit flags win over a protocol."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from opd_harness.errors import ConfigError

SETTINGS = ("temperature", "top_p", "top_k", "presence_penalty", "max_new_tokens", "k", "enable_thinking")


class Settings(BaseModel):
    """What a protocol (or one of its families) sets; None leaves the task's default or the flag's default."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    max_new_tokens: int | None = Field(None, ge=1)
    k: int | None = Field(None, ge=1)
    enable_thinking: bool | None = None


class Protocol(Settings):
    """A named protocol: its settings, per-family settings that replace them for a task of that family, and its source."""

    name: str = ""
    source: str
    description: str = ""
    families: dict[str, Settings] = Field(default_factory=dict)
    reproduces: str = Field("", description="where the published scores it should reproduce are listed")

    def for_family(self, family: str | None) -> dict[str, Any]:
        """The settings for a task of ``family`` (the protocol's, its family's rule over them), unset ones left out."""
        base = self.model_dump(include=set(SETTINGS), exclude_none=True)
        rule = self.families.get(family) if family else None
        return {**base, **(rule.model_dump(exclude_none=True) if rule else {})}


@cache
def protocols() -> dict[str, Protocol]:
    """Every protocol of ``protocols.yaml``, by name."""
    data = yaml.safe_load((Path(__file__).parent / "protocols.yaml").read_text())
    try:
        return {name: Protocol.model_validate({**spec, "name": name}) for name, spec in data.items()}
    except ValidationError as exc:  # a broken shipped file: a bug, said plainly
        raise RuntimeError(f"harness/protocols/protocols.yaml: {exc}") from None


def get_protocol(name: str) -> Protocol:
    """The protocol ``name``; a ConfigError naming --protocol and the known ones otherwise."""
    known = protocols()
    if name not in known:
        raise ConfigError(f"--protocol {name!r}: unknown; choose one of {', '.join(known)}")
    return known[name]


def resolve(protocol: Protocol | None, family: str | None, flags: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """One task's settings: ``defaults`` (the flags' defaults and the task's own k and max_new_tokens), then the protocol's
    values for the task's family, then every flag given explicitly (not None)."""
    chosen = dict(defaults)
    if protocol is not None:
        chosen.update(protocol.for_family(family))
    chosen.update({key: value for key, value in flags.items() if value is not None})
    return chosen
