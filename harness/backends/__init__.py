"""Inference backends: one sampling-parameter type and one completion type shared by all.

A backend generates completions for token-id prompts and scores given sequences (per-token
log-probs, optionally entropy, top-k and full distributions). Concrete backends register in
``opd_harness.registry.BACKENDS`` (entry points ``opd_harness.backends``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # annotations only: importing the backend types (as the CLI does) does not load torch
    import torch

SCORE_FIELDS = ("logprobs", "entropy", "topk", "full", "hidden", "at_ids")


def as_bool(value) -> bool:
    """A boolean backend option that may arrive as a string from the command line."""
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in {"1", "true", "yes", "on"}:
            return True
        if lowered in {"0", "false", "no", "off"}:
            return False
        raise ValueError(f"expected a boolean, got {value!r}")
    return bool(value)


def derive_seed(seed: int, prompt_index: int) -> int:
    """A 31-bit seed per (seed, prompt) pair; stable across runs and platforms."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def prompt_seed(params: "SamplingParams", prompt_index: int) -> int | None:
    """The sampling seed of one prompt of a ``generate`` call: ``params.seeds[prompt_index]`` when the caller gave one
    per prompt, else derived from (``params.seed``, prompt index); None when unseeded. Sample ``s`` uses it plus ``s``."""
    if params.seeds is not None:
        return params.seeds[prompt_index]
    return None if params.seed is None else derive_seed(params.seed, prompt_index)


# temperature bounds that engines share: vLLM refuses above 2 (SamplingParams._verify_args) and silently raises a
# positive value below 0.01 to it; a smaller positive temperature also overflows the logits of a plain softmax
MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 0.01


class SamplingParams(BaseModel):
    """Sampling settings, normalised once for every backend."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="sample from the k most likely tokens only, before top-p (0: off)")
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="OpenAI's presence penalty: subtracted once from the logit of every token already "
        "generated (0: off); only backends with ``presence_penalty = True`` apply it (vllm, openai); the others refuse it",
    )
    max_new_tokens: int = Field(64, ge=1)
    n: int = Field(1, ge=1, description="samples per prompt")
    stop: tuple[str, ...] = ()
    top_logprobs: int = Field(
        0, ge=0, description="per generated token, also the ids of the k most likely tokens of the untempered distribution "
        "(Completion.top_ids; the student_topk teacher signal scores the teacher on them)",
    )
    seed: int | None = None
    seeds: tuple[int, ...] | None = Field(
        None, description="one seed per prompt, in place of the ones derived from ``seed`` (the rollout seeds each episode's turn)"
    )

    @model_validator(mode="after")
    def _seeds_need_a_seed(self) -> "SamplingParams":
        if self.seeds is not None and self.seed is None:
            raise ValueError("seeds (one per prompt) are given without seed; set seed too (the run's seed they derive from)")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Completion:
    """One sampled continuation; ``token_ids`` include the EOS token when generation stopped on it."""

    token_ids: list[int]
    logprobs: list[float]  # log π(token) under the model's untempered distribution; [] when the backend gave none
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_index: int
    sample_index: int
    timings: dict[str, float] = field(default_factory=dict)
    top_ids: list[list[int]] | None = None  # SamplingParams.top_logprobs = k: per token the k most likely ids, most likely first


@runtime_checkable
class Backend(Protocol):
    """What rollout and training need from an inference engine."""

    tokenizer: object
    version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``params.n`` completions per prompt, ordered prompt-major."""

    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, want: tuple[str, ...] = ("logprobs",), top_k: int = 0
    ) -> dict[str, torch.Tensor]:
        """Per-position tensors aligned with ``input_ids`` (position t scores token t given its prefix)."""


@runtime_checkable
class RolloutEngine(Backend, Protocol):
    """A backend that can be a training run's rollout role: built by ``load`` from the student's folder,
    then fed the learner's weights. ``version`` is the policy version of the loaded weights (-1: none yet)."""

    @classmethod
    def load(cls, model: str, **options) -> "RolloutEngine":
        """Start the engine on a model folder (or hub id)."""

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Replace the weights by ``state_dict`` (Hugging Face parameter names) and set ``version``."""
