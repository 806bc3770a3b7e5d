"""Checking what an inference engine loaded: a hash of a few named tensors, the same on the learner and in the engine.

It lives beside the backends (not in ``trainers/``) because an engine that cannot hand its weights back (vLLM's model
lives in its worker processes) hashes them where they are, with this same function, and the rollout compares. The
trainers' weight transports (:mod:`opd_harness.trainers.weight_sync`) re-export these names.
"""

from __future__ import annotations

import hashlib

import torch

CHECKED_TENSORS = 4  # tensors the checksum covers: spread over the state dict (first, …, last)


class WeightSyncError(RuntimeError):
    """A rollout engine does not hold the weights it was sent (a stale or corrupt load): the run fails."""


def checked_names(names: list[str]) -> list[str]:
    """The names :func:`checksum` covers: ``CHECKED_TENSORS`` spread evenly over the sorted names."""
    ordered = sorted(names)
    if len(ordered) <= CHECKED_TENSORS:
        return ordered
    step = (len(ordered) - 1) / (CHECKED_TENSORS - 1)
    return sorted({ordered[round(i * step)] for i in range(CHECKED_TENSORS)})


def checksum(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None, every: bool = False) -> str:
    """A hash of the bytes of a few tensors of ``state`` (all of them with ``every``; in ``dtype`` for floating ones, when
    given): equal bit for bit or not."""
    digest = hashlib.sha256()
    for name in sorted(state) if every else checked_names(list(state)):
        t = state[name].detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        digest.update(name.encode())
        digest.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
