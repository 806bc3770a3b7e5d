"""GRPO (docs/methods/opd.md and grpo.md): group-normalised outcome rewards broadcast to every model token, then the
verl PPO-clip surrogate with asymmetric clip (DAPO "clip-higher": ε_lo = 0.2, ε_hi = 0.28), token-mean.

SOD and SAF-OPD fuse their OPD advantage with this GRPO advantage, so the token broadcast and the
clip hyper-parameters live here and are imported by them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, field_validator

from opd_harness.lazy import lazy_import
from opd_harness.method import HParams, MethodSpec, StudentOutputs
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.objectives import masked_mean
from opd_harness.trainers.objectives.common import clipped_surrogate, graded, graded_reward_mean, grpo_advantages, old_logprobs

if TYPE_CHECKING:
    import torch
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")

DUAL_CLIP = 3.0  # verl's clip_ratio_c default (Ye et al. 2020)


def check_dual_clip(value: float | None) -> float | None:
    """The dual-clip bound c: None or 0 (off), else above 1 (below 1 it would cut into the ordinary clip range)."""
    if value is not None and value != 0 and value <= 1.0:
        raise ValueError(f"dual_clip must be null or 0 (off) or greater than 1, got {value}")
    return value


class ClipParams(HParams):
    """PPO-clip ratios shared by GRPO, SOD and SAF-OPD (verl's asymmetric clip and its dual clip)."""

    clip_low: float = Field(0.2, ge=0, lt=1, description="ε_lo: ratio clipped below at 1 − ε_lo")
    clip_high: float = Field(0.28, ge=0, description="ε_hi: ratio clipped above at 1 + ε_hi")
    dual_clip: float | None = Field(
        DUAL_CLIP, description="c: for A < 0 the token loss is at most c·|A| (verl's clip_ratio_c, Ye et al. 2020); null or 0 disables it"
    )

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip_above_one(cls, value: float | None) -> float | None:
        return check_dual_clip(value)


class GroupParams(HParams):
    """The group baseline's guard, shared by GRPO, SOD and SAF-OPD."""

    allow_single_sample: bool = Field(
        False, description="allow trainer.samples_per_prompt = 1, where the group-centred advantage is the raw reward (no baseline)"
    )


class GRPOParams(ClipParams, GroupParams):
    pass


DUAL_CLIP_NOTE = (
    "dual_clip c = 3.0 (verl's clip_ratio_c): for A < 0 the token loss is min(PPO-clip loss, c·|A|), so a stale or "
    "mismatched batch (ρ ≫ 1 under policy lag or an engine's log-probs) cannot give an unbounded loss or gradient; at lag 0 "
    "with recomputed π_old ρ = 1 and it never acts; null or 0 disables it"
)

GRPO_GROUP_SIZE = 8  # docs/methods/saf-opd.md: the GRPO training config of SAF-OPD's paper, n = 8 rollouts per prompt


def grpo_sequence_advantages(batch: TensorBatch, coef: float = 1.0) -> torch.Tensor:
    """g·A^grpo_b, shape (B,); 0 for a sample without a reward (NaN: grading error). With g = 0 (pure OPD) rewards are not read."""
    if coef == 0.0:
        return torch.zeros(batch.loss_mask.shape[0], dtype=batch.loss_mask.dtype)
    return coef * grpo_advantages(batch.rewards, batch.group_ids).to(batch.loss_mask.dtype)  # (R − mean_g R)/(std_g R + 1e-6)


def grpo_token_advantages(batch: TensorBatch, coef: float = 1.0) -> torch.Tensor:
    """g·A^grpo_b·m_t, shape (B, T): the sequence advantage broadcast to the model tokens."""
    return grpo_sequence_advantages(batch, coef)[:, None] * batch.loss_mask  # A^grpo_{b,t} = A^grpo_b · m_{b,t}


def grpo_objective(
    batch: TensorBatch, student: StudentOutputs, hp: GRPOParams, state: object = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate on the broadcast GRPO advantage; ρ_t = exp(s_t − o_t), token-mean over graded samples.

    A sample whose grading errored (NaN reward) has nothing to learn from here: its tokens leave the loss
    and the token-mean, so it changes nothing for the others.
    """
    has_reward = graded(batch.rewards)
    mask = batch.loss_mask * has_reward[:, None].to(batch.loss_mask.dtype)
    old = old_logprobs(batch, student)
    per_sequence = grpo_sequence_advantages(batch)
    advantages = grpo_token_advantages(batch).to(old.dtype)
    loss, diagnostics = clipped_surrogate(
        student.logprobs, old, advantages, mask, clip_low=hp.clip_low, clip_high=hp.clip_high, dual_clip=hp.dual_clip
    )
    scored = per_sequence[has_reward] if has_reward.any() else per_sequence.new_zeros(1)
    diagnostics.update(
        reward_mean=graded_reward_mean(batch.rewards),
        advantage_mean=float(scored.mean()),  # per graded sequence, before broadcasting
        advantage_std=float(scored.std(unbiased=False)),  # population std: defined for B = 1
        token_advantage_mean=float(masked_mean(advantages, mask)),
        tokens=float(mask.sum()),
    )
    return loss, diagnostics


def grpo_needs(hp: GRPOParams) -> frozenset[str]:
    return frozenset({"rewards", "behaviour_logprobs", "old_logprobs"})


GRPO_SPEC = MethodSpec(
    description="GRPO: group-normalised outcome rewards with the asymmetric PPO-clip surrogate (token-mean)",
    objective=grpo_objective,  # type: ignore[arg-type]
    hparams=GRPOParams,
    needs=grpo_needs,  # type: ignore[arg-type]
    group_size=GRPO_GROUP_SIZE,
    notes={
        "samples_per_prompt": "default 8 per prompt (the GRPO config of the SAF-OPD paper); 1 is refused unless allow_single_sample",
        "ratio": "ρ = exp(s − o) against o recomputed by the trainer's model under the behaviour weights (π_old; "
        "trainer.behaviour_logprobs=recompute, the default); 1 at lag 0, off 1 in async runs with policy lag; with =engine, o is the "
        "rollout engine's scores and ρ is off 1 at lag 0 by the engine/trainer mismatch",
        "dual_clip": DUAL_CLIP_NOTE,
    },
)
