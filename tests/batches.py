"""Hand-written TensorBatch objects for objective tests (response-only tensors, no model)."""

from __future__ import annotations

import torch

from opd_harness.trajectory import TensorBatch


def make_batch(mask, behaviour, teacher, teacher_dist=None, old=None, *, fresh=None, lag=None, dtype=torch.float32) -> TensorBatch:
    """A (B, T) batch from nested lists; optional trainer log-probs, fresh teacher scores and lags."""
    mask = torch.as_tensor(mask, dtype=dtype)
    b, t = mask.shape
    return TensorBatch(
        input_ids=torch.zeros((b, t), dtype=torch.long),
        attention_mask=torch.ones((b, t), dtype=torch.long),
        loss_mask=mask,
        step_index=torch.zeros((b, t), dtype=torch.long),
        behaviour_logprobs=torch.as_tensor(behaviour, dtype=dtype),
        teacher_logprobs=torch.as_tensor(teacher, dtype=dtype),
        rewards=torch.full((b,), float("nan")),
        policy_version=torch.zeros(b, dtype=torch.long),
        group_ids=torch.arange(b),
        teacher_dist=teacher_dist,
        old_logprobs=None if old is None else torch.as_tensor(old, dtype=dtype),
        teacher_fresh_logprobs=None if fresh is None else torch.as_tensor(fresh, dtype=dtype),
        policy_lag=None if lag is None else torch.as_tensor(lag, dtype=torch.long),
    )
