"""IW-OPD baseline (Xie et al., arXiv 2606.22600) — APPROXIMATE STAND-IN, docs/methods/stand-ins.md.

The paper's exact formula could not be read. This stand-in keeps its idea: a token's weight decays
with the student–teacher discrepancy accumulated over its prefix, so late tokens reached through a
drifted prefix count less. c_t = Σ_{u<t} m_u [r_u]_+, w_t = exp(−c_t/λ), renormalised to a masked
mean of 1 per sequence; the loss is the same weighted token-mean OPD surrogate as AP-OPD.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from opd_harness.lazy import lazy_import
from opd_harness.method import MethodSpec, StudentOutputs
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.objectives.ap_opd import SurrogateParams, ap_opd_needs, penalty, sampled_log_ratio, weighted_opd_loss

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")
    F = lazy_import("torch.nn.functional")


class IWOPDParams(SurrogateParams):
    iw_lambda: float = Field(
        10.0, gt=0, description="λ_iw (nats, a temperature): w_t = exp(−c_t/λ); unknown in the paper, sweep {1, 10, 100}"
    )


def prefix_discrepancy(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """c_t = Σ_{u<t} m_u [r_u]_+ — the positive penalty accumulated strictly before t (detached)."""
    d = penalty(log_ratio, mask)
    return F.pad(torch.cumsum(d, -1)[..., :-1], (1, 0))  # exclusive prefix sum


def iw_weights(log_ratio: torch.Tensor, mask: torch.Tensor, lam: float = 10.0) -> torch.Tensor:
    """w_t = exp(−c_t/λ) / masked-mean_t exp(−c/λ), per sequence; detached and finite.

    The first valid token of a row has c = 0 (w = 1 before renormalising), so every non-empty row's
    mean is ≥ 1/n and the renormalisation never divides by zero; empty rows keep their raw weights.
    """
    raw = torch.exp(-prefix_discrepancy(log_ratio, mask) / lam)
    valid = mask > 0
    count = valid.sum(-1, keepdim=True)
    mean = torch.where(valid, raw, torch.zeros_like(raw)).sum(-1, keepdim=True) / count.clamp(min=1)
    return (raw / torch.where(count > 0, mean, torch.ones_like(mean))).detach()


def iw_opd_objective(
    batch: TensorBatch, student: StudentOutputs, hp: IWOPDParams, state: object = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean OPD surrogate −w·ρ·A with the prefix-discrepancy weights (approximate IW-OPD)."""
    old, r = sampled_log_ratio(batch, student)
    weights = iw_weights(r, batch.loss_mask, hp.iw_lambda)
    loss, diagnostics = weighted_opd_loss(batch, student, old, r, weights, hp)
    valid = batch.loss_mask > 0
    if bool(valid.any()):
        diagnostics.update(min_weight=float(weights[valid].min()), max_weight=float(weights[valid].max()))
    return loss, diagnostics


IW_OPD_SPEC = MethodSpec(
    description="IW-OPD baseline (APPROXIMATE stand-in): OPD with weights decaying in the prefix's accumulated discrepancy",
    objective=iw_opd_objective,  # type: ignore[arg-type]
    hparams=IWOPDParams,
    needs=ap_opd_needs,  # type: ignore[arg-type]
    notes={
        "status": "APPROXIMATE stand-in (docs/methods/stand-ins.md): the IW-OPD formula was not available; "
        "do not report as the paper's method",
        "weights": "c_t = Σ_{u<t} m_u [o_u − T_u]_+ (accumulates across tool segments), "
        "w_t = exp(−c_t/λ), renormalised to masked mean 1 per sequence",
        "iw_lambda": "λ_iw default 10 nats is a guess; sweep {1, 10, 100}",
        "removed_mass": "q is logged as for AP-OPD; it can be negative because renormalised weights exceed 1",
        "objective": "token-mean −w·ρ·A, A = T − o, ρ = exp(s − o), as ap_opd",
    },
)
