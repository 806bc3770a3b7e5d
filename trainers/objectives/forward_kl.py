"""Teacher-weighted forward KL (AsyncOPD, arXiv 2606.24143, its ``forward_kl`` loss mode): at every position of a student
sample the exact KL(π_T ‖ π_θ) = Σ_v π_T(v)(log π_T(v) − log π_θ(v)), differentiated directly.

The expectation is over the teacher's distribution, not the student's: a stale sample changes only which prefixes are
visited, never the weight of a term, which is why AsyncOPD finds it tolerant of stale rollouts where the
student-weighted reverse KL is not. With a top-k teacher signal (``teacher.signal=topk`` or ``student_topk``) both
distributions are coarse-grained onto the same k tokens plus one tail bucket (:mod:`opd_harness.teacher_signal`) and the KL
is taken between the (k + 1)-way distributions; AsyncOPD's sparse mode sums over the k tokens only (no tail term).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from opd_harness.lazy import lazy_import
from opd_harness.method import HParams, MethodSpec, StudentOutputs
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.objectives import masked_mean, masked_sum
from opd_harness.trainers.objectives.gkd import kl

if TYPE_CHECKING:
    import torch
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")


class ForwardKLParams(HParams):
    kl_coef: float = Field(1.0, gt=0, description="c: weight of the per-position forward KL")
    aggregation: Literal["token-mean", "sum"] = Field("token-mean", description="token-mean over the batch's valid tokens, or sum")


def position_forward_kl(student_log: torch.Tensor, teacher_log: torch.Tensor) -> torch.Tensor:
    """KL(π_T ‖ π_θ) at each position (…,) from the two log-distributions (last dim: vocabulary, or k + 1 buckets)."""
    return kl(teacher_log.detach(), student_log)


def forward_kl_objective(
    batch: TensorBatch, student: StudentOutputs, hp: ForwardKLParams, state: object = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """c · KL(π_T ‖ π_θ) per valid token, token-mean (or summed) over the batch."""
    if not student.has_full or batch.teacher_dist is None:
        raise ValueError("opd_forward_kl needs the student's and the teacher's distributions (student_full, teacher_dist)")
    mask = batch.loss_mask
    per_token = hp.kl_coef * student.over_vocabulary(position_forward_kl, batch.teacher_dist)
    loss = masked_sum(per_token, mask) if hp.aggregation == "sum" else masked_mean(per_token, mask)
    sampled = masked_mean((batch.behaviour_logprobs - batch.teacher_logprobs) * mask, mask)  # opd's sampled reverse-KL estimate
    return loss, {
        "forward_kl": float(masked_mean(per_token.detach(), mask) / hp.kl_coef),
        "teacher_kl": float(sampled),
        "tokens": float(mask.sum()),
    }


FORWARD_KL_SPEC = MethodSpec(
    description="Teacher-weighted forward KL(π_T ‖ π_θ) at every position of student samples, full or top-k teacher signal (AsyncOPD)",
    objective=forward_kl_objective,  # type: ignore[arg-type]
    hparams=ForwardKLParams,
    needs=lambda hp: frozenset({"teacher_dist", "student_full", "teacher_logprobs", "behaviour_logprobs"}),
    teacher_kinds=lambda hp: ("full", "topk", "student_topk"),
    notes={
        "source": "AsyncOPD (arXiv 2606.24143, furiosa-ai/async-opd loss mode forward_kl): teacher-weighted forward KL on student "
        "rollouts, reported robust to stale rollouts",
        "teacher signal": "full: exact over the vocabulary; topk / student_topk: over the k tokens plus one tail bucket "
        "(AsyncOPD's sparse mode has no tail term)",
        "reduction": "token-mean over the batch's valid tokens (aggregation=sum: summed); no importance ratio, no lag weighting",
    },
)
