"""EOPD — Entropy-aware OPD (arXiv 2603.07079), RECONSTRUCTED stand-in of docs/methods/stand-ins.md.

Reverse-KL OPD everywhere, plus forward KL where the teacher is uncertain:
L_t = RKL_t + 1[H_t > h]·FKL_t, with H_t = −Σ_v p_T log p_T from the full teacher distribution,
RKL_t the sampled-token OPD surrogate −ρ_t·(T_t − o_t) (verl form; docs/methods/opd.md, 'The loss'; value = the k1 estimate at ρ = 1) and
FKL_t = Σ_v p_T (log p_T − log p_S) over the vocabulary (or the teacher's top-k, renormalised).

Choosing h: it is not given by the paper's available text. Run a warm-up batch, read the logged
``teacher_entropy_p50/p90`` and set h to a high percentile (p80–p90 makes forward KL act on the
10–20% most uncertain teacher positions); report the value used. The soft-gate variant (a
third-party clean-room reading, not the paper) mixes L_t = (1−g_t)·RKL_t + g_t·FKL_t with
g_t = clamp(H_t / H_max, 0, 1).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from opd_harness.lazy import lazy_import
from opd_harness.method import HParams, MethodSpec, StudentOutputs
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.objectives import masked_mean, masked_sum
from opd_harness.trainers.objectives.common import old_logprobs
from opd_harness.trainers.objectives.gkd import entropy, kl, require_full, teacher_top_k

if TYPE_CHECKING:
    import torch
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")


class EOPDParams(HParams):
    entropy_threshold: float = Field(
        1.0, ge=0, description="h (nats): forward KL is added where teacher entropy H_t > h; set from a warm-up percentile"
    )
    gate: Literal["hard", "soft"] = Field(
        "hard", description="hard: RKL + 1[H>h]·FKL (paper reading); soft: (1−g)·RKL + g·FKL, g = clamp(H/H_max, 0, 1)"
    )
    entropy_max: float | None = Field(None, gt=0, description="H_max of the soft gate; None = log V (the maximum entropy)")
    rkl_estimator: Literal["sampled", "full"] = Field(
        "sampled", description="sampled-token OPD surrogate (verl form, default) or exact full-vocabulary reverse KL"
    )
    fkl_top_k: int = Field(0, ge=0, description="> 0: forward KL over the teacher's top-k tokens, renormalised; 0 = full vocabulary")


def entropy_gate(teacher_entropy: torch.Tensor, hp: EOPDParams, vocab: int) -> torch.Tensor:
    """g_t = 1[H_t > h] (hard) or clamp(H_t/H_max, 0, 1) (soft); detached."""
    if hp.gate == "hard":
        return (teacher_entropy > hp.entropy_threshold).to(teacher_entropy.dtype).detach()
    h_max = hp.entropy_max if hp.entropy_max is not None else math.log(vocab)
    return torch.clamp(teacher_entropy / max(h_max, 1e-12), 0.0, 1.0).detach()


def sampled_rkl_surrogate(student_logp: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """ℓ_t = −ρ_t·A_t, ρ = exp(s − o), A = sg(T − o): gradient of the sampled reverse KL (verl form, docs/methods/opd.md)."""
    advantage = (teacher_logp - old_logp).detach()
    return -torch.exp(student_logp - old_logp.detach()) * advantage


def eopd_vocabulary_terms(student_full: torch.Tensor, teacher_dist: torch.Tensor, hp: EOPDParams) -> torch.Tensor:
    """(..., 3) per position: teacher entropy H_t (detached), the exact reverse KL (0 unless ``rkl_estimator`` is full) and
    the forward KL FKL_t = Σ_v p_T (log p_T − log p_S) (over the teacher's top-k with ``fkl_top_k``)."""
    teacher_dist = teacher_dist.to(student_full.dtype).detach()
    h = entropy(teacher_dist)  # H_t = −Σ_v p_T log p_T, full distribution
    rkl = kl(student_full, teacher_dist) if hp.rkl_estimator == "full" else torch.zeros_like(h)  # Σ_v p_S (log p_S − log p_T)
    s_log, t_log = (student_full, teacher_dist) if hp.fkl_top_k == 0 else teacher_top_k(student_full, teacher_dist, hp.fkl_top_k)
    return torch.stack([h, rkl, kl(t_log, s_log)], dim=-1)


def eopd_per_token(batch: TensorBatch, student: StudentOutputs, hp: EOPDParams) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-position EOPD loss (B, T) and the detached per-position parts (H, gate, RKL, FKL)."""
    teacher_dist = require_full(batch, student, "eopd")
    terms = student.over_vocabulary(functools.partial(eopd_vocabulary_terms, hp=hp), teacher_dist)
    h, rkl, fkl = terms[..., 0].detach(), terms[..., 1], terms[..., 2]
    gate = entropy_gate(h, hp, teacher_dist.shape[-1])
    if hp.rkl_estimator != "full":
        rkl = sampled_rkl_surrogate(student.logprobs, old_logprobs(batch, student), batch.teacher_logprobs)
    per_token = rkl + gate * fkl if hp.gate == "hard" else (1.0 - gate) * rkl + gate * fkl
    return per_token, {"entropy": h, "gate": gate, "rkl": rkl.detach(), "fkl": fkl.detach()}


def eopd_objective(
    batch: TensorBatch, student: StudentOutputs, hp: EOPDParams, state: object = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean EOPD loss; logs teacher-entropy percentiles to help choose h."""
    mask = batch.loss_mask
    per_token, parts = eopd_per_token(batch, student, hp)
    loss = masked_sum(per_token, mask) / mask.sum().clamp(min=1.0)
    valid = mask > 0

    def mean(x: torch.Tensor) -> float:
        return float(masked_mean(torch.where(valid, x, torch.zeros_like(x)), mask))

    diagnostics = {
        "teacher_entropy": mean(parts["entropy"]),
        "gate_mean": mean(parts["gate"]),
        "rkl": mean(parts["rkl"]),
        "fkl": mean(parts["fkl"]),
        "tokens": float(mask.sum()),
    }
    if bool(valid.any()):
        q = torch.quantile(parts["entropy"][valid].float().cpu(), torch.tensor([0.5, 0.9]))
        diagnostics.update(teacher_entropy_p50=float(q[0]), teacher_entropy_p90=float(q[1]))
    return loss, diagnostics


def eopd_needs(hp: EOPDParams) -> frozenset[str]:
    """Teacher entropy and forward KL need both full distributions; the sampled RKL term needs T_t."""
    return frozenset({"teacher_dist", "student_full", "teacher_logprobs", "old_logprobs"})


EOPD_SPEC = MethodSpec(
    description="EOPD (stand-in): sampled-token OPD plus forward KL on positions where the teacher entropy exceeds h",
    objective=eopd_objective,  # type: ignore[arg-type]
    hparams=EOPDParams,
    needs=eopd_needs,  # type: ignore[arg-type]
    notes={
        "status": "RECONSTRUCTED from the abstract (docs/methods/stand-ins.md); official repo WLS04/EOPD not read",
        "loss": "token-mean of RKL_t + 1[H_t > h]·FKL_t; H_t from the full teacher distribution",
        "rkl": "sampled-token surrogate −exp(s − o)·sg(T − o) with o = trainer old log-probs (default); 'full' = exact reverse KL",
        "threshold": "h = 1.0 nats is a placeholder: set it to a high percentile (p80–p90) of the logged"
        " teacher entropy on a warm-up batch and report it",
        "soft_gate": "gate='soft' is a third-party variant, not the paper: (1−g)·RKL + g·FKL, "
        "g = clamp(H/H_max, 0, 1), H_max = log V by default",
        "fkl_top_k": "0 = full vocabulary; k > 0 = teacher's top-k renormalised (entropy still from the full distribution)",
    },
)
