"""OPD with the sampled reverse-KL signal recomputed under the current student (AsyncOPD, arXiv 2606.24143: its
``policy_gradient_kl`` loss with ``pg_online_advantage``, which beat PPO-clip, decoupled PPO and M2PO on stale rollouts).

``opd``'s sampled estimator takes its per-token reward from the behaviour policy that sampled the token,
A_t = −c(q_t − T_t), and weights it by the importance ratio ρ_t = exp(s_t − q_t). On a stale sample q is an old
student, so the expected gradient is E_q[ρ(T − q)∇s] = −∇KL(π_θ ‖ π_T) + (a term pulling π_θ back towards q). Here the
reward is recomputed at update time from the current student's log-prob of the same token,

    A_t = −c · (sg(s_t) − T_t),     loss = −Σ_t m_t · ρ_t · A_t / Σ_t m_t,     ρ_t = exp(s_t − q_t),

so that E_{y∼q}[ρ_t A_t ∇s_t] = −c · E_{y∼π_θ}[(log π_θ − log π_T)∇ log π_θ] = −c · ∇KL(π_θ ‖ π_T) at every prefix: the
exact gradient of the current reverse KL, whatever the lag. ρ is the one place the behaviour log-probs still enter.
AsyncOPD's code puts the same ρ·A inside a PPO clip (``clip_eps``; its default ε = 0.2), which trades that bias for
bounded steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from opd_harness.lazy import lazy_import
from opd_harness.method import HParams, MethodSpec, StudentOutputs
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.objectives import masked_mean, masked_sum
from opd_harness.trainers.objectives.common import ppo_clip_per_token

if TYPE_CHECKING:
    import torch
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")

LOG_RATIO_CLAMP = 20.0  # |s − q| bound inside the ratio's exponential (as f_opd and verl)


class RecomputeParams(HParams):
    kl_coef: float = Field(1.0, gt=0, description="c: weight of the recomputed reverse-KL advantage")
    ratio_cap: float | None = Field(
        None, gt=0, description="cap of the importance ratio exp(s − q) (truncated IS); none: the plain ratio, unbiased"
    )
    clip_eps: float | None = Field(
        None, gt=0, lt=1, description="ε of AsyncOPD's PPO clip, max(−ρA, −clip(ρ, 1 − ε, 1 + ε)A) per token; none: no clip"
    )
    aggregation: Literal["token-mean", "sum"] = Field("token-mean", description="token-mean over the batch's valid tokens, or sum")


def recomputed_advantage(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, kl_coef: float = 1.0) -> torch.Tensor:
    """A_t = −c·(sg(s_t) − T_t)·m_t: the sampled reverse-KL reward under the current student (detached)."""
    return (-kl_coef * (student_logp.detach() - teacher_logp) * mask).detach()


def importance_ratio(student_logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float | None = None) -> torch.Tensor:
    """ρ_t = exp(s_t − q_t) with gradient through s (log-ratio clamped to ±20; capped at ``cap`` with no gradient above it)."""
    ratio = torch.exp(torch.clamp(student_logp - behaviour_logp.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return ratio if cap is None else torch.clamp(ratio, max=cap)


def clip_binds(ratio: torch.Tensor, advantage: torch.Tensor, eps: float) -> torch.Tensor:
    """1 where the clip takes the token's gradient away (ρ > 1 + ε with A > 0, or ρ < 1 − ε with A < 0), else 0."""
    ratio = ratio.detach()
    return (((ratio > 1.0 + eps) & (advantage > 0)) | ((ratio < 1.0 - eps) & (advantage < 0))).to(ratio.dtype)


def recompute_objective(
    batch: TensorBatch, student: StudentOutputs, hp: RecomputeParams, state: object = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """−ρ_t·A_t per valid token with A recomputed from the current student; token-mean (or summed) over the batch."""
    mask = batch.loss_mask
    s = student.logprobs
    advantage = recomputed_advantage(s, batch.teacher_logprobs, mask, hp.kl_coef)
    ratio = importance_ratio(s, batch.behaviour_logprobs, hp.ratio_cap)
    if hp.clip_eps is None:
        per_token = -ratio * advantage
    else:
        per_token = ppo_clip_per_token(ratio, advantage, clip_low=hp.clip_eps, clip_high=hp.clip_eps)
    loss = masked_sum(per_token, mask) if hp.aggregation == "sum" else masked_mean(per_token, mask)
    stale = masked_mean((batch.behaviour_logprobs - batch.teacher_logprobs) * mask, mask)
    diagnostics = {} if hp.clip_eps is None else {"clip_fraction": float(masked_mean(clip_binds(ratio, advantage, hp.clip_eps), mask))}
    return loss, diagnostics | {
        "teacher_kl": float(stale),  # Σ(q − T)/Σm on the sampled tokens, as opd logs it
        "teacher_kl_current": float(masked_mean((s.detach() - batch.teacher_logprobs) * mask, mask)),  # Σ(s − T)/Σm
        "ratio_mean": float(masked_mean(ratio.detach(), mask)),
        "ratio_max": float(torch.where(mask > 0, ratio.detach(), torch.zeros_like(ratio)).max()) if mask.numel() else 0.0,
        "advantage_mean": float(masked_mean(advantage, mask)),
        "tokens": float(mask.sum()),
    }


OPD_RECOMPUTE_SPEC = MethodSpec(
    description="OPD with the sampled reverse-KL reward recomputed under the current student, importance-weighted towards "
    "the behaviour policy (AsyncOPD's recompute baseline)",
    objective=recompute_objective,  # type: ignore[arg-type]
    hparams=RecomputeParams,
    needs=lambda hp: frozenset({"teacher_logprobs", "behaviour_logprobs"}),
    notes={
        "source": "AsyncOPD (arXiv 2606.24143; furiosa-ai/async-opd policy_gradient_kl with pg_online_advantage): recomputing the "
        "reverse-KL signal under the current student beat PPO-clip / decoupled PPO / M2PO on stale rollouts",
        "advantage": "A_t = −c(sg(s_t) − T_t): the current student's log-prob of the sampled token, not the behaviour's q_t (opd)",
        "ratio": "ρ_t = exp(s_t − q_t), unclipped by default (unbiased); clip_eps: AsyncOPD's PPO clip (its default ε = 0.2, "
        "biased), ratio_cap: truncated IS",
        "reduction": "token-mean over the batch's valid tokens (aggregation=sum: summed)",
    },
)
