"""Vanilla on-policy distillation (docs/methods/opd.md): the student samples, the teacher scores.

Two per-token estimators of the reverse KL(π_θ ‖ π_T):
- ``sampled`` (Thinking Machines / Tinker): the sampled-token log-ratio k_t = q_t − T_t is a
  per-token reward; advantage A_t = −c_kl·k_t (detached); importance-sampling loss
  −Σ_t exp(s_t − q_t)·A_t, token-mean by default (Tinker's sum, which docs/methods/opd.md specifies, as
  ``aggregation: sum``; a run's ``method.json`` notes which one it used).
- ``full``: the exact per-token reverse KL Σ_v π_θ(v)(log π_θ(v) − log π_T(v)) over the whole
  vocabulary, differentiated directly (GKD-style, β = 1). Far lower variance at small batch sizes.
  With a top-k teacher signal (``teacher.signal=topk``, chosen automatically for a teacher that returns
  only top-k log-probs, e.g. one served over HTTP) the teacher's distribution is its top-k tokens plus
  one bucket for the rest of the vocabulary, and the KL is taken between these coarse-grained (k+1)-way
  distributions (opd_harness.teacher_signal).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from opd_harness.lazy import lazy_import
from opd_harness.method import HParams, MethodSpec, StudentOutputs
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.objectives import masked_mean, masked_sum

if TYPE_CHECKING:
    import torch
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")


class OPDParams(HParams):
    estimator: Literal["sampled", "full"] = Field("sampled", description="per-token reverse-KL estimator")
    kl_coef: float = Field(1.0, gt=0, description="c_kl: weight of the KL advantage")
    aggregation: Literal["token-mean", "sum"] = Field("token-mean", description="token-mean (verl) or sum (Tinker)")


def sampled_reverse_kl(behaviour_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k_t = (q_t − T_t)·m_t: the single-sample reverse-KL estimate on the sampled token."""
    return (behaviour_logp - teacher_logp) * mask


def full_reverse_kl(student_full: torch.Tensor, teacher_dist: torch.Tensor) -> torch.Tensor:
    """Exact per-position KL(π_θ ‖ π_T) = Σ_v π_θ(v)(log π_θ(v) − log π_T(v)); shape (B, T).

    A float32 log-softmax rounds a position's log-normaliser (≈ log V ≈ 12 at V = 151,936) once for all its V entries,
    so log π_θ and log π_T each carry a shared error of up to ~5e-7, and the sum above carries their difference: at
    V = 151,936 up to 3e-4 of a position's KL where the two distributions are close, 2e-6 of a batch's mean. The
    rounded distributions' total masses carry the same errors, so log(Σ π_T / Σ π_θ) = log1p(Σ_v (π_T(v) − π_θ(v)) / Σ π_θ)
    (summed as differences, which keeps its precision) removes them. It is 0 in exact arithmetic, so it has no gradient
    and is added detached: the gradient is the sum's."""
    log_t = teacher_dist.to(student_full.dtype)
    p = student_full.exp()
    kl = (p * (student_full - log_t)).sum(-1)
    with torch.no_grad():
        mass = p.detach()
        shift = torch.log1p(log_t.exp().sub_(mass).sum(-1) / mass.sum(-1))
    return kl + shift


def exact_reverse_kl(batch: TensorBatch, student: StudentOutputs) -> torch.Tensor:
    """Per-position KL(π_θ ‖ π_T) over the vocabulary, or over the top-k buckets of a top-k teacher signal; a clear error
    when a pipeline did not provide the distributions."""
    if not student.has_full or batch.teacher_dist is None:
        raise ValueError("estimator 'full' needs full student and teacher distributions")
    return student.over_vocabulary(full_reverse_kl, batch.teacher_dist)


def opd_objective(
    batch: TensorBatch, student: StudentOutputs, hp: OPDParams, state: object = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Vanilla OPD loss and diagnostics (teacher_kl = Σk/Σm, the logged reverse-KL estimate)."""
    mask = batch.loss_mask
    k = sampled_reverse_kl(batch.behaviour_logprobs, batch.teacher_logprobs, mask)
    diagnostics = {"teacher_kl": float(masked_mean(k, mask)), "tokens": float(mask.sum())}
    if hp.estimator == "full":
        per_token = hp.kl_coef * exact_reverse_kl(batch, student)
        diagnostics["teacher_kl_full"] = float(masked_mean(per_token.detach(), mask) / hp.kl_coef)
    else:
        advantage = (-hp.kl_coef * k).detach()  # reverse KL = log q − log T; the advantage is its negative
        ratio = torch.exp(student.logprobs - batch.behaviour_logprobs.detach())
        per_token = -ratio * advantage
        diagnostics["advantage_mean"] = float(masked_mean(advantage, mask))
    loss = masked_sum(per_token, mask) if hp.aggregation == "sum" else masked_mean(per_token, mask)
    return loss, diagnostics


def opd_needs(hp: OPDParams) -> frozenset[str]:
    base = {"teacher_logprobs", "behaviour_logprobs"}
    if hp.estimator != "full":
        return frozenset(base)
    return frozenset(base | {"teacher_dist", "student_full"})


AGGREGATION_NOTES = {
    "token-mean": "token-mean over the batch's valid tokens (verl-style; the default), NOT docs/methods/opd.md's Tinker sum "
    "over tokens (Tinker); aggregation=sum selects the sum",
    "sum": "sum over the batch's valid tokens, as docs/methods/opd.md (Tinker) specifies; the loss and gradient scale "
    "with the number of tokens per step",
}
ESTIMATOR_NOTES = {
    "sampled": "Tinker's importance-sampling loss −Σ exp(s − q)·A with A = −c_kl(q − T), ratio against the sampler "
    "log-probs q (docs/methods/opd.md)",
    "full": "exact full-vocabulary reverse KL(π_θ ‖ π_T) per position, differentiated directly (GKD-style, β = 1); "
    "not the sampled-token (Tinker) estimator. With a top-k teacher signal (teacher.signal topk or student_topk, the run's config "
    "says which) the KL is over those k tokens plus one bucket for the rest of the vocabulary: a lower bound on the "
    "full-vocabulary KL, equal to it when the top-k cover the vocabulary",
}


def opd_run_notes(hp: OPDParams) -> dict[str, str]:
    """The run's aggregation and estimator, and how each relates to docs/methods/opd.md, for ``method.json``."""
    return {"aggregation": AGGREGATION_NOTES[hp.aggregation], "estimator": ESTIMATOR_NOTES[hp.estimator]}


OPD_SPEC = MethodSpec(
    description=(
        "Vanilla on-policy distillation: per-token reverse-KL advantage with an importance-sampling loss "
        "(or the exact full-vocabulary reverse KL)"
    ),
    objective=opd_objective,  # type: ignore[arg-type]
    hparams=OPDParams,
    needs=opd_needs,  # type: ignore[arg-type]
    run_notes=opd_run_notes,  # type: ignore[arg-type]
    teacher_kinds=lambda hp: ("full", "topk", "student_topk"),
)
