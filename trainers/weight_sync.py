"""Weight transports (``trainer.weight_sync``): how a learner version reaches the rollout workers.

Every transport moves one copy per version, in the rollout engine's parameter dtype, and only for versions a worker
will load (:meth:`opd_harness.trainers.loop.Schedule.publishes`). What the loop's :class:`~opd_harness.trainers.loop.WeightBoard` holds is a
:class:`Published`: the payload a rollout loads (a state dict in process, an object ref, or nothing when the weights
were already broadcast), the learner's checksum of a few tensors, and the bytes moved. After every load the rollout
checks its engine against that checksum (:func:`check_loaded`) and refuses a stale or corrupt load.

Built-ins (entry-point group ``opd_harness.weight_syncs``):

- ``object_store``: the learner's copy is handed over by reference (Ray's object store, or the process's memory);
  each worker fetches it when it loads.
- ``collective``: a torch.distributed group of the learner's rank 0 and the rollout actors (its own group, apart from
  the learners' data-parallel one; gloo on CPU, NCCL on CUDA); each published version is broadcast in flat buckets per
  dtype from rank 0 to every rollout actor, which keeps it staged until it loads it. Ray only.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from opd_harness.backends.weight_check import CHECKED_TENSORS, WeightSyncError, checked_names, checksum

__all__ = ["CHECKED_TENSORS", "WeightSyncError", "checked_names", "checksum"]  # re-exported: the engines' side of the check

BUCKET_BYTES = 64 << 20  # flat broadcast buckets of at most 64 MiB (a larger tensor gets its own)
JOIN_GRACE_S = 30.0  # beyond the group's timeout: how long the learner's join may take to give up on a member that is gone
ABORT_GRACE_S = 10.0  # after a forming group's store is stopped: how long its members may take to give up their join


class NotStaged(Exception):
    """A rollout actor asked to load a broadcast version it never received (restarted since): load it from
    :attr:`Published.recover` instead."""


@dataclass(frozen=True)
class Published:
    """One published version: what the rollout loads, the learner's checksum of it and the bytes it weighs."""

    payload: Any  # a state dict, an object ref to one, or None (already staged on every worker by a broadcast)
    checksum: str
    nbytes: int
    recover: Callable[[], Any] | None = None  # collective: a ref to the learner's copy, for a worker that missed the broadcast


def _storage_key(t: torch.Tensor) -> tuple:
    """What makes two entries of a state dict one tensor (tied weights: the embedding and the output head)."""
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def rollout_copy(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``state`` with its floating tensors in ``dtype`` (one copy, never two); tied entries (one
    tensor under two names) stay one tensor object, so they are copied, pickled and counted once."""
    copies: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, value in state.items():
        key = _storage_key(value)
        if key not in copies:
            copies[key] = value.detach().to("cpu", dtype if value.is_floating_point() else value.dtype, copy=True)
        out[name] = copies[key]
    return out


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors of ``state`` (a tied tensor counts once)."""
    unique = {_storage_key(t): t for t in state.values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def engine_dtype(engine: Any) -> torch.dtype:
    """The rollout engine's parameter dtype: what weights are sent in (its ``param_dtype``, else its model's, else fp32)."""
    dtype = getattr(engine, "param_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    model = getattr(engine, "model", None)
    if isinstance(model, torch.nn.Module):
        return next(model.parameters()).dtype
    return torch.float32


def check_loaded(engine: Any, expected: str | None, version: int) -> None:
    """Refuse (:class:`WeightSyncError`) an engine whose loaded weights do not hash to the learner's ``expected`` checksum.
    An engine whose model lives elsewhere (vLLM's, in its workers) verifies its own load and reports the checksum of
    the weights it verified as ``loaded_checksum``; that is compared here. An engine with neither is not checked."""
    if expected is None:
        return
    model, reported = getattr(engine, "model", None), getattr(engine, "loaded_checksum", None)
    if isinstance(reported, str):
        found = reported
    elif isinstance(model, torch.nn.Module):
        found = checksum(model.state_dict())
    else:
        return
    if found != expected:
        raise WeightSyncError(f"rollout engine {type(engine).__name__} did not take weights version {version}: its weights hash to "
                              f"{found}, the learner's to {expected} (a stale or corrupt load); refusing it")  # fmt: skip


# ---- the collective's buckets ---------------------------------------------------------------------------------------


WeightLayout = list[tuple[str, tuple[int, ...], str, str]]  # (name, shape, dtype name, source) in broadcast order


def layout_of(state: dict[str, torch.Tensor]) -> WeightLayout:
    """The broadcast's layout: each entry's name, shape and dtype, and its source, the first name holding the same tensor
    (itself, or the tensor a tied entry shares: only sources are sent, a tied entry is rebuilt from its source)."""
    first: dict[tuple, str] = {}
    layout = []
    for name, value in sorted(state.items()):
        source = first.setdefault(_storage_key(value), name)
        layout.append((name, tuple(value.shape), str(value.dtype).removeprefix("torch."), source))
    return layout


def buckets(layout: WeightLayout, limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices into ``layout`` grouped into flat buckets: one dtype each, at most ``limit`` bytes (or one larger tensor);
    tied entries (whose source is another name) are in none: they are not sent."""
    out: list[list[int]] = []
    open_: dict[str, tuple[list[int], int]] = {}
    for i, (name, shape, dtype, source) in enumerate(layout):
        if source != name:
            continue
        size = torch.Size(shape).numel() * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        bucket, used = open_.get(dtype, ([], 0))
        if bucket and used + size > limit:
            out.append(bucket)
            bucket, used = [], 0
        open_[dtype] = (bucket + [i], used + size)
    out.extend(bucket for bucket, _ in open_.values() if bucket)
    return out


class SyncGroup:
    """One side of the collective transport's process group (rank 0: the learner; 1…n: the rollout actors), created
    without touching the default group (the learners' own)."""

    def __init__(self, address: str, port: int, rank: int, world: int, device: str, timeout_s: float,
                 bucket_bytes: int = BUCKET_BYTES, master: bool | None = None) -> None:  # fmt: skip
        """``master`` (default: rank 0) hosts the rendezvous store; False for a rank 0 whose store a :class:`GroupHost` holds."""
        from torch import distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(address, port, world, is_master=rank == 0 if master is None else master, timeout=timeout)
        if device.startswith("cuda"):  # not run: no GPU here
            self.group = dist.ProcessGroupNCCL(self.store, rank, world, dist.ProcessGroupNCCL.Options())
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, world, timeout)
        self.rank, self.device, self.bucket_bytes = rank, device, bucket_bytes

    def close(self) -> None:
        """Leave the group for good: its connections close, so a peer blocked in a broadcast fails at once instead of
        waiting out the timeout (gloo's abort leaves them open)."""
        try:
            self.group.shutdown()
        except Exception:  # noqa: BLE001 - a broken group may refuse; dropping it still closes its sockets
            pass
        del self.group

    def send(self, state: dict[str, torch.Tensor]) -> int:
        """Rank 0: broadcast ``state`` (already in the rollout dtype) bucket by bucket; returns the bytes sent."""
        layout = layout_of(state)
        for bucket in buckets(layout, self.bucket_bytes):
            flat = torch.cat([state[layout[i][0]].reshape(-1) for i in bucket]).to(self.device)
            self.group.broadcast(flat, 0).wait()
        return state_bytes(state)

    def receive(self, layout: WeightLayout) -> dict[str, torch.Tensor]:
        """Ranks 1…n: the state rank 0 broadcasts, laid out as ``layout``."""
        state: dict[str, torch.Tensor] = {}
        for bucket in buckets(layout, self.bucket_bytes):
            dtype = getattr(torch, layout[bucket[0]][2])
            sizes = [torch.Size(layout[i][1]).numel() for i in bucket]
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            self.group.broadcast(flat, 0).wait()
            for i, part in zip(bucket, flat.split(sizes), strict=True):
                state[layout[i][0]] = part.view(layout[i][1]).cpu()
        for name, _, _, source in layout:
            state[name] = state[source]  # a tied entry: the very tensor of its source
        return state


class GroupHost:
    """Rank 0's side of forming a weight group without blocking its actor: the rendezvous store's server is held here
    alone, rank 0 joins in a thread over a client connection of its own, and :meth:`abort` stops the server, so that every
    member still forming the group (rank 0 included) fails at once instead of waiting out the timeout for a member that
    was lost."""

    def __init__(self, address: str, port: int, world: int, device: str, timeout_s: float) -> None:
        from torch import distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.server: Any = dist.TCPStore(address, port, world, is_master=True, wait_for_workers=False, timeout=timeout)
        self.group: SyncGroup | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._form, args=(address, port, world, device, timeout_s), daemon=True)
        self.thread.start()

    def _form(self, address: str, port: int, world: int, device: str, timeout_s: float) -> None:
        try:
            self.group = SyncGroup(address, port, 0, world, device, timeout_s, master=False)
        except Exception as exc:  # noqa: BLE001 - reported by formed(): the driver forms another group
            self.error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"

    def formed(self, wait_s: float) -> tuple[bool, str | None]:
        """(done, why it failed or None), after waiting up to ``wait_s`` for rank 0's join."""
        self.thread.join(wait_s)
        return not self.thread.is_alive(), self.error

    def abort(self) -> None:
        """Stop the store's server (the last reference to it): members blocked in their join fail at once."""
        self.server = None


# ---- the plug-ins ---------------------------------------------------------------------------------------------------


class ObjectStoreSync:
    """``object_store``: one copy per loaded version, handed over by reference; each worker fetches it when it loads."""

    collective = False

    def connect(self, learner: Any) -> None:
        """Nothing to set up: the object store is there."""

    def publish(self, learner: Any, version: int) -> Published:
        """Ray: the learner's rank 0 leaves its copy in the object store; the driver takes only (checksum, bytes)."""
        refs = learner.on_ranks("publish_weights", learner.dtype, returns=2)
        digest, nbytes = learner._get([meta for _, meta in refs], f"publishing weights {version}")[0]
        return Published(refs[0][0], digest, nbytes)  # rank 0's copy stays in the object store (fsdp2's others are empty)


class CollectiveSync:
    """``collective``: bucketed broadcast from the learner's rank 0 to every rollout actor at each loaded version (Ray only).

    A rollout actor that is restarted (it died or hung) leaves the group: before the next broadcast every member joins
    a new one (a new generation), and a broadcast that fails because a member was lost meanwhile is sent again once the
    group is formed anew. A member lost while a group forms stops the forming (:class:`GroupHost`): the others give up at
    once and the group is formed again once the lost one is back. A restarted actor never received the versions
    broadcast before it came back: it loads them from the learner's copy (:attr:`Published.recover`; the learner keeps
    the versions the weight board holds)."""

    collective = True
    attempts = 4  # broadcasts of one version at most: the first, then one after each regroup

    def connect(self, learner: Any) -> None:
        """Form the group: learner rank 0 (rank 0, it hosts the store) and the rollout actors (ranks 1…n); formed anew
        (after the lost member is back) when a member is lost while joining."""
        learner.generation = 0
        if not any(self.regroup(learner) for _ in range(self.attempts)):
            raise WeightSyncError(f"the rollout actors could not form the collective weight group in {self.attempts} attempts "
                                  f"(last: {(learner.sync_failures or ['a rollout actor was lost'])[-1]})")  # fmt: skip
        learner.layout = learner._get(learner.on_ranks("weight_layout", learner.dtype), "reading the weight layout")[0]

    def regroup(self, learner: Any) -> bool:
        """Every member joins a new group (generation + 1) at a new address; False if a rollout actor was lost meanwhile.
        A member lost (dead, hung, or its join failed) while the group forms stops the learner's store at once, so the
        others give up their join now, not after the timeout, and are not taken for hung; the lost one is restarted
        (:meth:`RayLearner.settle`) before the next attempt."""
        world, timeout_s = len(learner.rollouts) + 1, learner.faults.call_s or 300.0
        learner.generation += 1
        address, port = learner._get([learner.actor.rendezvous.remote()], "finding the weight group's address")[0]
        learner._get([learner.actor.sync_host.remote(address, port, world, timeout_s)], "hosting the weight group")
        joins = [actor.sync_join.remote(address, port, rank, world, timeout_s, learner.generation)
                 for rank, actor in enumerate(learner.rollouts, 1)]  # fmt: skip
        joined = learner.settle(joins, "joining the weight group", abort=lambda: learner.actor.sync_abort.remote())
        lost = any(answer is None for answer in joined)
        if lost:
            learner._get([learner.actor.sync_abort.remote()], "leaving the weight group")
        failure = learner._get([learner.actor.sync_formed.remote(timeout_s + JOIN_GRACE_S)], "forming the weight group",
                               wait_s=timeout_s + 2 * JOIN_GRACE_S)[0]  # fmt: skip
        if failure is not None and not lost:
            learner.sync_failures.append(f"learner: {failure}")
        return not lost and failure is None

    def publish(self, learner: Any, version: int) -> Published:
        """Broadcast ``version`` from learner rank 0 to every rollout actor, which stages it until it loads it."""
        failure = None
        for _ in range(self.attempts):
            generations = learner.settle([actor.sync_generation.remote() for actor in learner.rollouts], "checking the weight group")
            if any(g != learner.generation for g in generations) and not self.regroup(learner):
                continue  # a rollout actor restarted: it left the group
            sent = learner.on_ranks("broadcast_weights", learner.dtype, version, learner.keep)
            received = [actor.receive_weights.remote(version, learner.layout, learner.keep) for actor in learner.rollouts]
            answers = learner.settle(received, f"receiving weights {version}")
            digest, nbytes, failure = learner._get(sent, f"broadcasting weights {version}")[0]
            if failure is None and all(answer is not None for answer in answers):
                actor = learner.actor
                return Published(None, digest, nbytes, recover=lambda: actor.staged_copy.remote(version))
        raise WeightSyncError(f"weights version {version} did not reach the rollout actors in {self.attempts} broadcasts "
                              f"(last: {failure or (learner.sync_failures or ['a rollout actor was lost'])[-1]})")  # fmt: skip


OBJECT_STORE = ObjectStoreSync()
COLLECTIVE = CollectiveSync()
