"""GKD (Agarwal et al., 2306.13649) as in current TRL ``GKDTrainer`` (docs/methods/gkd.md, VERIFIED).

Per position, with student/teacher log-distributions ls, lt (after temperature):
β = 0: KL(p_T ‖ p_S); β = 1: KL(p_S ‖ p_T); else the generalized JSD with the *arithmetic* mixture
log M = logsumexp(ls + log(1−β), lt + log β),  JSD_β = β·KL(p_T ‖ M) + (1−β)·KL(p_S ‖ M).
Reduction "batchmean": sum over the vocabulary and the kept (mask = 1) positions / #kept positions.
The student data fraction λ is a pipeline matter: the sync on-policy pipeline samples every batch
from the student, i.e. λ = 1.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from pydantic import Field

from opd_harness.lazy import lazy_import
from opd_harness.method import HParams, MethodSpec, StudentOutputs
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.objectives import masked_sum

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")
    F = lazy_import("torch.nn.functional")


class GKDParams(HParams):
    beta: float = Field(0.5, ge=0, le=1, description="β: 0 forward KL, 1 reverse KL, else generalized JSD (TRL default 0.5)")
    temperature: float = Field(1.0, gt=0, description="softmax temperature on both distributions (TRL default 0.9; 1.0 matches sampling)")
    top_k: int = Field(0, ge=0, description="> 0: restrict both distributions to the teacher's top-k tokens, renormalised")


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) = Σ_v p(v)(log p(v) − log q(v)) over the last dim, with 0·log 0 = 0 (NaN-free gradient)."""
    p = p_log.exp()
    diff = torch.where(p > 0, p_log - q_log, torch.zeros_like(p_log))
    return (p * diff).sum(-1)


def entropy(log_dist: torch.Tensor) -> torch.Tensor:
    """H = −Σ_v p(v) log p(v) over the last dim, with 0·log 0 = 0."""
    p = log_dist.exp()
    return -(p * torch.where(p > 0, log_dist, torch.zeros_like(log_dist))).sum(-1)


def with_temperature(log_dist: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(log p / τ) = log_softmax(logits / τ): the log-normaliser is a per-position shift."""
    return log_dist if temperature == 1.0 else F.log_softmax(log_dist / temperature, dim=-1)


def teacher_top_k(student_log: torch.Tensor, teacher_log: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both log-distributions restricted to the teacher's top-k tokens and renormalised; shapes (..., k)."""
    idx = teacher_log.topk(min(k, teacher_log.shape[-1]), dim=-1).indices
    s = student_log.gather(-1, idx)
    t = teacher_log.gather(-1, idx)
    return s - s.logsumexp(-1, keepdim=True), t - t.logsumexp(-1, keepdim=True)


def generalized_jsd(student_log: torch.Tensor, teacher_log: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-position TRL generalized JSD (β = 0 forward KL, β = 1 reverse KL); shape (...,)."""
    if beta == 0.0:
        return kl(teacher_log, student_log)  # KL(p_T ‖ p_S)
    if beta == 1.0:
        return kl(student_log, teacher_log)  # KL(p_S ‖ p_T)
    # log M = logsumexp(ls + log(1−β), lt + log β): arithmetic mixture M = (1−β)p_S + βp_T
    mixture = torch.logsumexp(torch.stack([student_log + math.log(1.0 - beta), teacher_log + math.log(beta)]), dim=0)
    return beta * kl(teacher_log, mixture) + (1.0 - beta) * kl(student_log, mixture)


def gkd_per_token(student_full: torch.Tensor, teacher_dist: torch.Tensor, hp: GKDParams) -> torch.Tensor:
    """Temperature, optional teacher top-k, then the generalized JSD at every position; (B, T)."""
    student_log = with_temperature(student_full, hp.temperature)
    teacher_log = with_temperature(teacher_dist.to(student_full.dtype), hp.temperature).detach()
    if hp.top_k > 0:
        student_log, teacher_log = teacher_top_k(student_log, teacher_log, hp.top_k)
    return generalized_jsd(student_log, teacher_log, hp.beta)


def require_full(batch: TensorBatch, student: StudentOutputs, method: str) -> torch.Tensor:
    """The teacher's full log-distribution when the student's was computed too (read through ``student.over_vocabulary``),
    or a clear error when the pipeline did not provide them."""
    if not student.has_full or batch.teacher_dist is None:
        raise ValueError(f"{method} needs full student and teacher distributions (student_full, teacher_dist)")
    return batch.teacher_dist


def gkd_objective(
    batch: TensorBatch, student: StudentOutputs, hp: GKDParams, state: object = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """GKD loss: generalized JSD summed over kept positions / number of kept positions ("batchmean")."""
    teacher_dist = require_full(batch, student, "gkd")
    mask = batch.loss_mask
    per_token = student.over_vocabulary(functools.partial(gkd_per_token, hp=hp), teacher_dist)
    loss = masked_sum(per_token, mask) / mask.sum().clamp(min=1.0)
    return loss, {"jsd": float(loss.detach()), "tokens": float(mask.sum())}


GKD_SPEC = MethodSpec(
    description="GKD (TRL GKDTrainer): generalized JSD with β between full student and teacher distributions on student samples",
    objective=gkd_objective,  # type: ignore[arg-type]
    hparams=GKDParams,
    needs=lambda hp: frozenset({"teacher_dist", "student_full"}),
    teacher_kinds=lambda hp: ("full", "topk", "student_topk"),
    notes={
        "teacher signal": "full: the exact distributions; topk / student_topk: the JSD (after temperature) of both distributions "
        "coarse-grained onto the k tokens plus one tail bucket (opd_harness.teacher_signal), not of the full ones",
        "status": "VERIFIED against current TRL generalized_jsd_loss (arithmetic mixture via logsumexp; β weights KL(p_T‖M))",
        "lambda": "student data fraction λ is a pipeline matter: sync on-policy sampling means λ = 1; seq_kd is not supported",
        "temperature": "default 1.0 (the student's sampling temperature); TRL's default is 0.9",
        "top_k": "0 = full vocabulary; k > 0 keeps the teacher's top-k tokens (from the full tensor) and renormalises both distributions",
        "reduction": "batchmean: Σ over vocabulary and kept positions / #kept positions; empty mask → 0",
    },
)
