"""OPD objectives: pure functions of a :class:`~opd_harness.trajectory.TensorBatch` and the current
student's log-probs, returning ``(loss, diagnostics)``. Each method is a :class:`opd_harness.method.MethodSpec`,
declared as an entry point of ``opd_harness.methods`` (``name = "module:SPEC"``; the entry point's name is the
spec's name) that declares the inputs it needs; this package holds the helpers objectives share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opd_harness.lazy import lazy_import

if TYPE_CHECKING:
    import torch
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask``; 0 (not NaN) for an empty mask."""
    return masked_sum(values, mask) / mask.sum().clamp(min=1.0)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` over ``mask`` (zeros elsewhere, so masked NaN-free values never leak)."""
    return torch.where(mask > 0, values, torch.zeros_like(values)).sum()
