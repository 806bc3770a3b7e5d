"""A data-parallel learner step: W ranks in one torch.distributed process group, the model wrapped in DDP or sharded
with FSDP2 (``trainer.layout.learner.sharding``).

Each rank runs the student's forward and backward on its contiguous shard of the global batch's rows (the
costly part), then :func:`gather_rows` assembles the global student log-probs (and full distribution, entropy)
on every rank, so the method's objective runs on the whole batch on every rank: token-mean and sequence-level
normalisations, GRPO groups, batch means and method state (SAF schedule, f-OPD refresh signal, AP-OPD
statistics) are the global ones, identical on every rank, with no per-method code. Backward sends each rank its
own rows' gradient, scaled by W so that DDP's averaging all-reduce (FSDP2's averaging reduce-scatter) leaves every
rank the gradient of the global loss (FSDP2: its shard of it); gradient clipping (``clip_grad_norm_`` after the
reduction, over DTensors under FSDP2) then sees the global norm, and one optimizer step on W ranks is the step of
one rank on the same batch (up to float summation order).

FSDP2 shards parameters, gradients and optimizer state (dim 0 of each, per decoder layer); it all-gathers a layer's
parameters for its forward and backward. Every rank must so make the same sequence of forward calls whatever its rows
(DDP also broadcasts buffers in each forward): the learner's length buckets are padded to the largest rank's count
(:func:`opd_harness.trainers.learner.paired_bucketed`). It does not shard the activations beyond DDP's row split, nor the objective.

The objective's inputs are global on every rank: for a method that reads the student's full distribution
(B×T×V) that tensor is gathered whole, so data parallelism shards the model's activations, not the objective's.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

GROUP_TIMEOUT_S = 300.0  # a collective that waits longer fails (trainer.collective_timeout_s's default)


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


class CollectiveTimeout(RuntimeError):
    """A collective of the learner's group did not complete in time: a rank hangs, died unnoticed, or made other calls."""


@contextlib.contextmanager
def collective_deadline(timeout_s: float) -> Iterator[None]:
    """Run the block; a collective in it that timed out (gloo's "Timed out waiting …", NCCL's watchdog timeout) is raised
    as :class:`CollectiveTimeout` with one line naming the limit (``trainer.collective_timeout_s``); other errors unchanged."""
    try:
        yield
    except RuntimeError as exc:  # torch.distributed's errors (DistBackendError, ...) are RuntimeErrors
        if isinstance(exc, CollectiveTimeout) or not re.search(r"timed out|timeout", str(exc), re.IGNORECASE):
            raise
        raise CollectiveTimeout(f"a collective did not complete within trainer.collective_timeout_s={timeout_s:g}s") from exc


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


def data_parallel(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharding: str = "ddp"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``model`` made data-parallel over the joined group, and the optimizer that trains it.

    ``ddp``: wrapped in DDP (rank 0's weights are broadcast), ``optimizer`` unchanged. ``fsdp2``: sharded in place with
    :func:`fully_shard` (:func:`shard_fully`) and a new optimizer of the same kind over the shards, holding its part of
    ``optimizer``'s state (every rank must start from the same weights and state: they are shipped from one copy)."""
    if sharding == "fsdp2":
        return shard_fully(model, optimizer)
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None), optimizer


def shard_fully(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """FSDP2: each decoder layer (the model's ``_no_split_modules``) and then the root sharded over the group (dim 0 of every
    parameter, as DTensors); the optimizer rebuilt over those parameters with ``optimizer``'s groups and state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # keyed by parameter names, which survive the sharding; a fresh optimizer stays fresh (reading or loading a state first
    # takes a zero step to make one, which would count as Adam's step 1)
    by_name = get_optimizer_state_dict(model, optimizer) if optimizer.state else None
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    # the root (embeddings, final norm, output head) stays unsharded from its forward to the end of the backward (FSDP2's
    # default for a root, stated here because chunked_student_outputs relies on it): trainer.vocab_chunk's chunks call the
    # output head outside the forward, in the forward and again in the backward's recompute, on the gathered weight, whose
    # gradient the root's post-backward reduce-scatters once with the rest
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    if len(groups) != 1:
        raise ValueError(f"fsdp2 rebuilds the learner's optimizer from one parameter group, not {len(groups)}")
    sharded = type(optimizer)(model.parameters())
    sharded.param_groups[0].update(groups[0])  # every hyperparameter as it was (some, like AdamW's, are not constructor arguments)
    if by_name is not None:
        set_optimizer_state_dict(model, sharded, by_name, options=StateDictOptions(full_state_dict=True))
    return model, sharded


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharding: str) -> dict[str, dict]:
    """The unsharded weights and optimizer state (the optimizer's own ``state_dict`` layout, parameters numbered in order).

    ``ddp``: this rank's (identical) copies. ``fsdp2``: a collective, every rank must call it; rank 0 gets the full
    tensors on the CPU, the other ranks empty dicts. Some tensors may be the live ones (Ray copies a result when it returns)."""
    module = getattr(model, "module", model)  # DDP's wrapped model
    if sharding != "fsdp2":
        return {"model": module.state_dict(), "optimizer": optimizer.state_dict()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    if not optimizer.state:  # fresh (no step yet): nothing sharded to gather, and reading it would take a zero step first
        return {"model": weights, "optimizer": optimizer.state_dict() if weights else {}}
    by_name = get_optimizer_state_dict(model, optimizer, options=options)
    return {"model": weights, "optimizer": numbered_optimizer_state(by_name) if weights else {}}


def numbered_optimizer_state(by_name: dict) -> dict:
    """An optimizer state dict keyed by parameter names (torch.distributed.checkpoint's) in ``Optimizer.state_dict``'s
    layout: parameters numbered 0, 1, … in their groups' order."""
    numbers: dict[str, int] = {}
    groups = [{**group, "params": [numbers.setdefault(name, len(numbers)) for name in group["params"]]}
              for group in by_name["param_groups"]]  # fmt: skip
    return {"state": {numbers[name]: state for name, state in by_name["state"].items()}, "param_groups": groups}


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An unsharded copy of an FSDP2 model's weights: a collective; rank 0 gets them on the CPU, the others an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def leave_group() -> None:
    """Destroy this process's group, if it has one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
