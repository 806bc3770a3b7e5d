"""A data-parallel learner step: W ranks in one torch.distributed process group, the model wrapped in DDP.

Each rank runs the student's forward and backward on its contiguous shard of the global batch's rows (the
costly part), then :func:`gather_rows` assembles the global student log-probs (and full distribution, entropy)
on every rank, so the method's objective runs on the whole batch on every rank: token-mean and sequence-level
normalisations, GRPO groups, batch means and method state (SAF schedule, f-OPD refresh signal, AP-OPD
statistics) are the global ones, identical on every rank, with no per-method code. Backward sends each rank its
own rows' gradient, scaled by W so that DDP's averaging all-reduce leaves every rank the gradient of the global
loss; gradient clipping (``clip_grad_norm_`` after the all-reduce) then sees the global norm, and one optimizer
step on W ranks is the step of one rank on the same batch (up to float summation order).

The objective's inputs are global on every rank: for a method that reads the student's full distribution
(B×T×V) that tensor is gathered whole, so data parallelism shards the model's activations, not the objective's.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

GROUP_TIMEOUT_S = 1800.0  # a collective that waits longer fails (the driver stops a run whose rank died long before)


@dataclass(frozen=True)
class Shard:
    """This process's rank in a data-parallel group of ``world`` ranks."""

    rank: int
    world: int

    def bounds(self, total: int) -> tuple[int, int]:
        """[start, stop) of this rank's contiguous rows out of ``total``: sizes differ by at most one, lower ranks first."""
        return shard_bounds(total, self.rank, self.world)


def shard_bounds(total: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [start, stop) of rank ``rank`` when ``total`` rows are split into ``world`` contiguous shards."""
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class _GatherRows(torch.autograd.Function):
    """All ranks' row shards concatenated in rank order; backward returns this rank's rows of the (identical) global
    gradient, times W, which DDP's mean over ranks turns back into the sum."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, total: int, rank: int, world: int) -> torch.Tensor:  # type: ignore[override]
        sizes = [shard_bounds(total, r, world) for r in range(world)]
        longest = max(stop - start for start, stop in sizes)
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[: local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(pieces, padded.contiguous())
        ctx.bounds, ctx.world = sizes[rank], world
        return torch.cat([piece[: stop - start] for piece, (start, stop) in zip(pieces, sizes, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        start, stop = ctx.bounds
        return grad[start:stop] * ctx.world, None, None, None


def gather_rows(local: torch.Tensor, shard: Shard | None, total: int) -> torch.Tensor:
    """The global tensor from every rank's rows (differentiable, see :class:`_GatherRows`); ``local`` itself without a group."""
    if shard is None or shard.world == 1:
        return local
    return _GatherRows.apply(local, total, shard.rank, shard.world)


def local_rows(tensor: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """This rank's rows of a global (B, …) tensor."""
    if shard is None:
        return tensor
    start, stop = shard.bounds(tensor.shape[0])
    return tensor[start:stop]


def rendezvous_port() -> int:
    """A TCP port free on this node now, for the group's store (rank 0 binds it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def backend_for(model: torch.nn.Module) -> str:
    """NCCL for a model on CUDA, gloo on CPU."""
    return "nccl" if next(model.parameters()).is_cuda else "gloo"


def join_group(address: str, port: int, shard: Shard, backend: str, timeout_s: float = GROUP_TIMEOUT_S) -> None:
    """Join the ``shard.world``-rank process group whose rank 0 listens at ``address:port`` (blocks until all have joined)."""
    dist.init_process_group(
        backend, init_method=f"tcp://{address}:{port}", rank=shard.rank, world_size=shard.world, timeout=timedelta(seconds=timeout_s)
    )


def data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` wrapped in DDP over the joined group (rank 0's weights are broadcast; every rank starts from the same copy)."""
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


def leave_group() -> None:
    """Destroy this process's group, if it has one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
