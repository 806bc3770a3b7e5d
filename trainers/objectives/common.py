"""Building blocks shared by the objectives (docs/methods/opd.md and grpo.md): OPD and GRPO advantages, the clipped
surrogate, the k3 KL estimator and masked reductions. Pure tensor functions, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from opd_harness.lazy import lazy_import
from opd_harness.method import StudentOutputs
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.objectives import masked_mean, masked_sum

if TYPE_CHECKING:
    import torch
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")

Aggregation = Literal["token-mean", "sum"]


def old_logprobs(batch: TensorBatch, student: StudentOutputs) -> torch.Tensor:
    """o_t: trainer-recomputed log-probs before the update; equals s_t (detached) in a one-update sync step."""
    return batch.old_logprobs if batch.old_logprobs is not None else student.logprobs.detach()


def opd_advantage(old_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A^opd_t = (T_t − o_t)·m_t: teacher minus student log-prob of the sampled token (detached)."""
    return ((teacher_logp - old_logp) * mask).detach()


def graded(rewards: torch.Tensor) -> torch.Tensor:
    """(B,) bool: which trajectories have a reward; NaN marks a grading error (or no reward at all)."""
    return ~torch.isnan(rewards)


def graded_reward_mean(rewards: torch.Tensor) -> float:
    """Mean reward over the graded trajectories (NaN when none is graded): errors are not zeros."""
    return float(torch.nanmean(rewards.float())) if rewards.numel() else float("nan")


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(R_b − mean_g R) / (std_g R + eps) with the unbiased std; a group of size 1 gets mean 0, std 1.

    A NaN reward (grading error) gets advantage 0 and is left out of its group's mean and std; a larger
    group left with a single graded member has no baseline, so that member gets 0 too.
    """
    out = torch.zeros_like(rewards, dtype=torch.float32)
    has_reward = graded(rewards)
    for g in group_ids.unique():
        members = group_ids == g
        scored = members & has_reward
        r = rewards[scored].float()
        if int(members.sum()) == 1:
            out[scored] = r  # mean 0, std 1 (verl convention for a group of size 1)
        elif r.numel() >= 2:
            out[scored] = (r - r.mean()) / (r.std(unbiased=True) + eps)
    return out


def ppo_clip_per_token(
    ratio: torch.Tensor, advantages: torch.Tensor, *, clip_low: float, clip_high: float, dual_clip: float | None = None
) -> torch.Tensor:
    """ℓ_t = −min(ρA, clip(ρ, 1−ε_lo, 1+ε_hi)A), and for A < 0 at most c·|A| when ``dual_clip`` c is set (Ye et al. 2020).

    Without the dual clip a negative advantage with a huge ratio (a stale batch, an engine/trainer mismatch)
    has an unbounded loss and gradient; with it the token's loss is the constant c·|A| beyond ρ = c (verl's
    ``clip_ratio_c``). ``dual_clip`` None or 0 disables it.
    """
    clipped = -torch.minimum(ratio * advantages, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages)
    if not dual_clip:
        return clipped
    bounded = torch.minimum(clipped, -dual_clip * advantages)
    return torch.where(advantages < 0, bounded, clipped)


def dual_clipped(ratio: torch.Tensor, advantages: torch.Tensor, dual_clip: float | None) -> torch.Tensor:
    """(B, T) bool: the tokens the dual clip bounds (A < 0 and ρ > c); all False when it is off."""
    if not dual_clip:
        return torch.zeros_like(ratio, dtype=torch.bool)
    return (advantages < 0) & (ratio > dual_clip)


def clipped_surrogate(
    student_logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    aggregation: Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss (:func:`ppo_clip_per_token`, ρ = exp(s − o)), token-mean by default, with its diagnostics."""
    ratio = torch.exp(student_logp - old_logp.detach())
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = ppo_clip_per_token(ratio, advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    loss = masked_sum(per_token, mask) if aggregation == "sum" else masked_mean(per_token, mask)
    clip_frac = masked_mean((unclipped != clipped).float(), mask)
    dual_frac = masked_mean(dual_clipped(ratio.detach(), advantages, dual_clip).float(), mask)
    deviation = torch.where(mask > 0, (ratio.detach() - 1.0).abs(), torch.zeros_like(ratio))
    return loss, {
        "clip_fraction": float(clip_frac),
        "dual_clip_fraction": float(dual_frac),
        "ratio_mean": float(masked_mean(ratio.detach(), mask)),
        "ratio_max_dev": float(deviation.max()) if deviation.numel() else 0.0,
    }


def k3(log_p_model: torch.Tensor, log_p_ref: torch.Tensor) -> torch.Tensor:
    """verl ``low_var_kl``: Δ = clamp(ref − model, ±20), clamp(e^Δ − Δ − 1, ±10); estimates KL(model‖ref)."""
    delta = torch.clamp(log_p_ref - log_p_model, -20.0, 20.0)
    return torch.clamp(torch.exp(delta) - delta - 1.0, -10.0, 10.0)
