"""Supervised fine-tuning on reference (dataset or teacher-generated) responses: −mean log π_θ(y_t)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from opd_harness.lazy import lazy_import
from opd_harness.method import HParams, MethodSpec, StudentOutputs
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.objectives import masked_mean

if TYPE_CHECKING:
    import torch
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")


class SFTParams(HParams):
    pass


def sft_objective(
    batch: TensorBatch, student: StudentOutputs, hp: SFTParams, state: object = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean negative log-likelihood of the reference response tokens."""
    nll = masked_mean(-student.logprobs, batch.loss_mask)
    return nll, {"nll": float(nll.detach()), "tokens": float(batch.loss_mask.sum())}


SFT_SPEC = MethodSpec(
    description="Supervised fine-tuning on the task's reference responses (token-mean NLL)",
    objective=sft_objective,  # type: ignore[arg-type]
    hparams=SFTParams,
    needs=lambda hp: frozenset({"reference_responses"}),
    on_policy=False,
)
