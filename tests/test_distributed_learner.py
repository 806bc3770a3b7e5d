"""The data-parallel learner step without Ray: 2 gloo ranks (processes) on one global batch give the losses, gradient
norms, diagnostics, method state and weights of 1 rank on the same batch, for token-mean, sequence-level and group methods,
with DDP and with FSDP2; an FSDP2 checkpoint (full state, read by rank 0) resumes on one rank."""

from __future__ import annotations

import copy
import time

import torch
import torch.multiprocessing as mp
import pytest

from opd_harness.models.tiny import TinyArch, build_tiny_model
from opd_harness.registry import METHODS
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.distributed import (Shard, data_parallel, full_state, full_weights, join_group, leave_group, rendezvous_port,
                                              shard_bounds)
from opd_harness.trainers.learner import train_step
from opd_harness.trainers.loop import state_snapshot
from test_chunked_vocab import CASES as FULL_CASES

RANKS_TIMEOUT_S = 300.0  # 2 forked ranks, 8 method runs (DDP and FSDP2): ~60 s at load 10, longer on a busier machine
VOCAB, ROWS, LENGTH, STEPS = 24, 5, 9, 3  # 5 rows over 2 ranks: uneven shards (3 + 2), a GRPO group split across them
METHODS_UNDER_TEST = {
    "opd": {},  # token-mean over the batch's tokens
    "opd_full": {"estimator": "full"},  # full distributions gathered
    "opd_full_chunked": {"estimator": "full"},  # the same chunked (trainer.vocab_chunk): each rank's map, its outputs gathered
    "f_opd": {},  # per-sample means, then the mean over selected samples; refresh monitor state
    "grpo": {},  # group-normalised rewards (group 1 spans both ranks), PPO-clip token-mean
    "saf_opd": {},  # schedule state advanced from the batch's KL
}


def synthetic_batch(seed: int) -> TensorBatch:
    """A right-padded global batch with every input the methods above read (teacher scores, rewards, groups, lags)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 7, 8, 5, 9])
    positions = torch.arange(LENGTH)
    attention = (positions < lengths[:, None]).long()
    loss_mask = ((positions >= 3) & (positions < lengths[:, None])).float()
    teacher_dist = torch.log_softmax(torch.randn(ROWS, LENGTH, VOCAB, generator=g), -1)
    ids = torch.randint(3, VOCAB, (ROWS, LENGTH), generator=g) * attention
    behaviour = (-torch.rand(ROWS, LENGTH, generator=g) * 3) * loss_mask
    return TensorBatch(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        step_index=torch.where(loss_mask > 0, (positions >= 6).long().expand(ROWS, -1), -1),
        behaviour_logprobs=behaviour,
        teacher_logprobs=teacher_dist.gather(-1, ids[..., None])[..., 0] * loss_mask,
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]),
        policy_version=torch.zeros(ROWS, dtype=torch.long),
        group_ids=torch.tensor([0, 0, 1, 1, 1]),
        teacher_dist=teacher_dist,
        old_logprobs=behaviour.clone(),
        teacher_fresh_logprobs=None,
        policy_lag=torch.tensor([0, 1, 0, 2, 1]),
    )


SHARDINGS = ("ddp", "fsdp2")
FSDP2_METHODS = ("opd", "opd_full", "f_opd")  # token-mean, full distributions, sequence-level + state: FSDP2 changes only the model
VOCAB_CHUNK = 3  # positions per chunk: divides neither T = 9 nor the 8 predicted positions
CHECKPOINT_AFTER = STEPS - 1  # the FSDP2 ranks' full state after this many steps resumes on one rank for the last step


def tiny_student() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_tiny_model(TinyArch(hidden=16, layers=2, heads=2, kv_heads=1, ffn=32), VOCAB, pad_id=0, eos_id=1, seed=3)
    # eps 1e-6, not 1e-8: Adam turns an element's near-zero gradient, whose sign is float summation noise, into an update of
    # up to lr; with 1e-8 f_opd's 2-rank weights differed from one rank's by 1.3e-5 (one graph or per-bucket alike), 2e-7 now
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-6)


def method_steps(name: str, shard: Shard | None, sharding: str = "ddp", start: dict | None = None) -> dict:
    """``STEPS`` optimizer steps of method ``name`` (one rank's part with a shard), or the steps after a checkpoint
    ``start``; metrics per step, the final (full) weights and method state, and the checkpoint after ``CHECKPOINT_AFTER``."""
    torch.manual_seed(0)
    spec = METHODS.get(name.removesuffix("_chunked").removesuffix("_full"))
    hparams = spec.hparams(**METHODS_UNDER_TEST[name])
    model, optimizer = tiny_student()
    state = spec.make_state(hparams) if spec.make_state else None
    if start is not None:
        model.load_state_dict(start["model"])
        optimizer.load_state_dict(start["optimizer"])
        if state is not None:
            state.load_state_dict(start["method_state"])
    trained, optimizer = data_parallel(model, optimizer, sharding) if shard is not None else (model, optimizer)
    metrics, checkpoint = [], None
    for step in range(CHECKPOINT_AFTER if start is not None else 0, STEPS):
        if step == CHECKPOINT_AFTER and start is None:
            checkpoint = full_state(trained, optimizer, sharding) if shard is not None else None
            checkpoint = checkpoint and copy.deepcopy({**checkpoint, "method_state": state.state_dict() if state is not None else None})
        metrics.append(train_step(trained, optimizer, synthetic_batch(step), spec, hparams, state, grad_clip=0.05, shard=shard,
                                  vocab_chunk=VOCAB_CHUNK if name.endswith("_chunked") else 0))
    method_state = state.state_dict() if state is not None else None
    weights = full_weights(trained) if shard is not None and sharding == "fsdp2" else state_snapshot(model)
    return {"metrics": metrics, "weights": weights, "state": method_state, "checkpoint": checkpoint}


def _rank(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    shard = Shard(rank, world)
    join_group("127.0.0.1", port, shard, "gloo")
    try:
        results = {(name, "ddp"): method_steps(name, shard) for name in METHODS_UNDER_TEST}
        results |= {(name, "fsdp2"): method_steps(name, shard, "fsdp2") for name in FSDP2_METHODS}
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        leave_group()


def test_shards_are_contiguous_and_cover_the_batch():
    assert [shard_bounds(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [shard_bounds(8, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert [shard_bounds(4, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def _close(a, b, tol: float = 1e-5) -> bool:
    return a == pytest.approx(b, abs=tol, rel=tol, nan_ok=True)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Each of 2 gloo ranks' results of every method under DDP (and of ``FSDP2_METHODS`` under FSDP2)."""
    torch.set_num_threads(1)
    tmp_path = tmp_path_factory.mktemp("ranks")
    ranks = mp.start_processes(_rank, args=(2, rendezvous_port(), str(tmp_path)), nprocs=2, join=False, start_method="fork")
    deadline = time.monotonic() + RANKS_TIMEOUT_S  # forked (imports inherited: ~2 s, not ~40 s); a hang fails, it never blocks CI
    while not ranks.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the 2 ranks did not finish in {RANKS_TIMEOUT_S:.0f}s")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def single() -> dict[str, dict]:
    torch.set_num_threads(1)
    return {name: method_steps(name, None) for name in METHODS_UNDER_TEST if not name.endswith("_chunked")}


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_two_ranks_give_the_update_of_one_rank(two_ranks, single, sharding):
    names = METHODS_UNDER_TEST if sharding == "ddp" else FSDP2_METHODS
    for name in names:
        expected = single[name.removesuffix("_chunked")]  # a chunked DDP run against the unchunked single rank
        for rank, results in enumerate(two_ranks):
            got = results[name, sharding]
            for step, (want, have) in enumerate(zip(expected["metrics"], got["metrics"], strict=True)):
                assert set(want) == set(have), (name, step)
                assert have["loss"] != 0.0 and have["grad_norm"] > 0.05, (name, step, have)  # a real update, clipped
                bad = {k: (want[k], have[k]) for k in want if not k.startswith("time_") and not _close(want[k], have[k])}
                assert not bad, (name, step, bad)
            if sharding == "fsdp2" and rank > 0:  # full weights are gathered to rank 0 only
                assert got["weights"] == {} and got["checkpoint"]["model"] == {}
            else:
                assert expected["weights"].keys() == got["weights"].keys()
                for key, weight in expected["weights"].items():
                    assert torch.allclose(got["weights"][key], weight, atol=1e-5, rtol=1e-5), (name, key)
            assert _same_state(got["state"], expected["state"]), (name, got["state"], expected["state"])


def _same_state(a, b) -> bool:
    """Method states equal up to float rounding (nested dicts and lists of numbers)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return _close(a, b)
    return a == b


@pytest.mark.slow
def test_an_fsdp2_checkpoint_resumes_on_one_rank(two_ranks, single):
    """Rank 0's full state after step 2 of 2 FSDP2 ranks, loaded into a plain model and optimizer (W = 1, the driver's
    checkpoint), trains step 3 with the uninterrupted run's loss and weights."""
    for name in FSDP2_METHODS:
        checkpoint = two_ranks[0][name, "fsdp2"]["checkpoint"]
        assert sorted(checkpoint["optimizer"]["state"]) == list(range(len(checkpoint["optimizer"]["state"])))
        resumed = method_steps(name, None, start=checkpoint)
        want = single[name]
        assert len(resumed["metrics"]) == STEPS - CHECKPOINT_AFTER
        assert _close(resumed["metrics"][0]["loss"], want["metrics"][CHECKPOINT_AFTER]["loss"]), name
        for key, weight in want["weights"].items():
            assert torch.allclose(resumed["weights"][key], weight, atol=1e-5, rtol=1e-5), (name, key)
        assert _same_state(resumed["state"], want["state"]), name


# Rows of real lengths: every rank cuts its own rows into length buckets (trainer.forward_tokens), and the ranks get
# different numbers of buckets; every rank must still make the same forward calls (DDP broadcasts buffers in each forward,
# FSDP2 all-gathers in each forward and backward), or the collectives stop pairing: a hang (gloo DDP) or an abort (FSDP2).
# Every case but "opd_one_graph" runs the backward one bucket at a time (trainer.bucket_backward, gradient caching), every
# registered method among them (at its defaults, and each full-distribution configuration chunked); the reference is one
# rank with one graph over the step, unchunked.
LONG_ROWS, LONG_STEPS, LONG_FORWARD_TOKENS, LONG_CHUNK = 8, 2, 500, 64
LONG_GROUP_TIMEOUT_S = 60.0  # a collective that does not pair fails the ranks within this, never hangs CI
LONG_RANKS_TIMEOUT_S = 480.0
LONG_CASES = {  # name: (method, hparams, vocab_chunk, activation checkpointing, bucket_backward)
    "opd": ("opd", {}, 0, False, True),
    "opd_one_graph": ("opd", {}, 0, False, False),
    "opd_checkpointed": ("opd", {}, 0, True, True),
    "opd_full": ("opd", {"estimator": "full"}, 0, False, True),
    "opd_full_chunked": ("opd", {"estimator": "full"}, LONG_CHUNK, False, True),
    "opd_full_chunked_checkpointed": ("opd", {"estimator": "full"}, LONG_CHUNK, True, True),
    **{name: (name, {}, 0, False, True) for name in METHODS.names() if not name.startswith("_") and name != "opd"},
    **{f"{name}_chunked_{i}": (name, args, LONG_CHUNK, False, True) for i, (name, args) in enumerate(FULL_CASES)},
}
LONG_WORLDS = (2, 4)


def reference_key(case: str) -> tuple[str, str]:
    """The one-rank, one-graph, unchunked run ``case`` is compared with: its method and hyper-parameters."""
    method, args = LONG_CASES[case][:2]
    return method, repr(sorted(args.items()))


def long_batch(seed: int) -> TensorBatch:
    """A global batch of ``LONG_ROWS`` rows whose lengths are drawn from 20–400 tokens (prompt: the first 10)."""
    g = torch.Generator().manual_seed(3 + seed)  # seeds whose lengths give the ranks different bucket counts
    lengths = torch.randint(20, 401, (LONG_ROWS,), generator=g)
    width = int(lengths.max())
    positions = torch.arange(width)
    attention = (positions < lengths[:, None]).long()
    loss_mask = ((positions >= 10) & (positions < lengths[:, None])).float()
    teacher_dist = torch.log_softmax(torch.randn(LONG_ROWS, width, VOCAB, generator=g), -1)
    ids = torch.randint(3, VOCAB, (LONG_ROWS, width), generator=g) * attention
    behaviour = (-torch.rand(LONG_ROWS, width, generator=g) * 3) * loss_mask
    return TensorBatch(
        input_ids=ids, attention_mask=attention, loss_mask=loss_mask,
        step_index=torch.where(loss_mask > 0, 0, -1), behaviour_logprobs=behaviour,
        teacher_logprobs=teacher_dist.gather(-1, ids[..., None])[..., 0] * loss_mask,
        rewards=torch.arange(LONG_ROWS).remainder(2).float(), policy_version=torch.zeros(LONG_ROWS, dtype=torch.long),
        group_ids=torch.arange(LONG_ROWS) // 2, teacher_dist=teacher_dist, old_logprobs=behaviour.clone(), teacher_fresh_logprobs=None,
        policy_lag=torch.zeros(LONG_ROWS, dtype=torch.long),
    )  # fmt: skip


def rank_bucket_counts(batch: TensorBatch, world: int) -> list[int]:
    """Length buckets each of ``world`` ranks cuts its own rows into at ``LONG_FORWARD_TOKENS``."""
    from opd_harness.backends.hf import length_buckets

    lengths = batch.attention_mask.sum(-1).tolist()
    return [len(length_buckets(lengths[slice(*shard_bounds(LONG_ROWS, r, world))], LONG_FORWARD_TOKENS)) for r in range(world)]


def long_steps(name: str, shard: Shard | None, sharding: str = "ddp", reference: bool = False) -> dict:
    """``LONG_STEPS`` steps of case ``name`` on :func:`long_batch` (one rank's part with a shard): metrics, full weights and
    method state. ``reference``: the case's method and hyper-parameters with one graph, unchunked, no checkpointing."""
    torch.manual_seed(0)
    method, options, vocab_chunk, checkpointed, bucket_backward = LONG_CASES[name]
    if reference:
        vocab_chunk, checkpointed, bucket_backward = 0, False, False
    spec = METHODS.get(method)
    hparams = spec.hparams(**options)
    state = spec.make_state(hparams) if spec.make_state else None
    model, optimizer = tiny_student()
    if checkpointed:
        model.gradient_checkpointing_enable()
    trained, optimizer = data_parallel(model, optimizer, sharding) if shard is not None else (model, optimizer)
    metrics = [train_step(trained, optimizer, long_batch(step), spec, hparams, state, grad_clip=0.02, shard=shard, vocab_chunk=vocab_chunk,
                          forward_tokens=LONG_FORWARD_TOKENS, bucket_backward=bucket_backward) for step in range(LONG_STEPS)]  # fmt: skip
    weights = full_weights(trained) if shard is not None and sharding == "fsdp2" else state_snapshot(model)
    return {"metrics": metrics, "weights": weights, "state": state.state_dict() if state is not None else None}


def _long_rank(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    shard = Shard(rank, world)
    join_group("127.0.0.1", port, shard, "gloo", timeout_s=LONG_GROUP_TIMEOUT_S)
    try:
        results = {(name, sharding): long_steps(name, shard, sharding) for sharding in SHARDINGS for name in LONG_CASES}
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        leave_group()


def run_ranks(target, world: int, out, timeout_s: float) -> None:
    """``target(rank, world, port, out)`` on ``world`` forked processes; fails the test (killing them) past ``timeout_s``."""
    ranks = mp.start_processes(target, args=(world, rendezvous_port(), str(out)), nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + timeout_s
    while not ranks.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the {world} ranks did not finish in {timeout_s:.0f}s")


@pytest.fixture(scope="module", params=LONG_WORLDS)
def long_ranks(request, tmp_path_factory) -> tuple[int, list[dict]]:
    """(W, each of W gloo ranks' results of every ``LONG_CASES`` case under DDP and FSDP2)."""
    world = request.param
    torch.set_num_threads(1)
    tmp_path = tmp_path_factory.mktemp(f"long{world}")
    run_ranks(_long_rank, world, tmp_path, LONG_RANKS_TIMEOUT_S)
    return world, [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def long_single() -> dict[tuple[str, str], dict]:
    """One rank, one graph over the step: each case's reference (:func:`reference_key`)."""
    torch.set_num_threads(1)
    firsts = {reference_key(name): name for name in reversed(LONG_CASES)}
    return {key: long_steps(name, None, reference=True) for key, name in firsts.items()}


def test_the_long_batches_give_ranks_different_bucket_counts():
    """Else the comparison below would pass on the old code too: at every step and W some rank cuts more buckets than another."""
    for world in LONG_WORLDS:
        for step in range(LONG_STEPS):
            counts = rank_bucket_counts(long_batch(step), world)
            assert len(set(counts)) > 1, (world, step, counts)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_ranks_with_different_bucket_counts_give_the_update_of_one_rank(long_ranks, long_single, sharding):
    """2 and 4 ranks, DDP and FSDP2, every method bucketed (its backward per bucket; opd also with one graph), full
    distributions chunked (with and without activation checkpointing): the losses, gradient norms, diagnostics, method
    state and weights of one rank with one graph, unchunked, on the same global batches."""
    world, ranks = long_ranks
    for name in LONG_CASES:
        expected = long_single[reference_key(name)]
        for rank, results in enumerate(ranks):
            got = results[name, sharding]
            for step, (want, have) in enumerate(zip(expected["metrics"], got["metrics"], strict=True)):
                assert set(want) == set(have), (name, step)
                clipped = 0.02 if LONG_CASES[name][0] == "opd" else 0.0  # opd's updates are clipped; others' may be smaller
                assert have["loss"] != 0.0 and have["grad_norm"] > clipped, (name, step, have)  # a real update
                bad = {k: (want[k], have[k]) for k in want if not k.startswith("time_") and not _close(want[k], have[k])}
                assert not bad, (world, name, rank, step, bad)
            assert _same_state(got["state"], expected["state"]), (name, got["state"], expected["state"])
            if sharding == "fsdp2" and rank > 0:  # full weights are gathered to rank 0 only
                assert got["weights"] == {}
                continue
            assert expected["weights"].keys() == got["weights"].keys()
            for key, weight in expected["weights"].items():
                assert torch.allclose(got["weights"][key], weight, atol=1e-5, rtol=1e-5), (world, name, rank, key)


TIMEOUT_S = 5.0  # trainer.collective_timeout_s of the test below


def _skipping_rank(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 trains a step; rank 1 joins and wraps its model (DDP's own collectives) but skips the step, as a hung rank."""
    from pathlib import Path

    from opd_harness.trainers.distributed import CollectiveTimeout, collective_deadline

    torch.set_num_threads(1)
    shard, report = Shard(rank, world), Path(out) / "rank0.txt"
    join_group("127.0.0.1", port, shard, "gloo", timeout_s=TIMEOUT_S)
    try:
        spec = METHODS.get("opd")
        model, optimizer = data_parallel(*tiny_student())
        if rank == 0:
            try:
                with collective_deadline(TIMEOUT_S):
                    train_step(model, optimizer, synthetic_batch(0), spec, spec.hparams(), None, shard=shard)
                report.write_text("completed")
            except CollectiveTimeout as exc:
                report.write_text(f"{type(exc).__name__}: {exc}")
        else:
            deadline = time.monotonic() + 6 * TIMEOUT_S
            while not report.exists() and time.monotonic() < deadline:  # alive (its connections open) until rank 0 gave up
                time.sleep(0.2)
    finally:
        leave_group()


class _FakeRay:
    class exceptions:  # noqa: N801 - mirrors ray.exceptions
        class RayActorError(Exception):
            pass


def test_a_collective_timeout_fails_the_step_in_one_line_naming_the_rank_and_the_step(tmp_path):
    """A rank that never enters the step's collectives: the other one gives up after trainer.collective_timeout_s, and the
    driver's line names that rank, the step and the checkpoint to resume from."""
    from types import SimpleNamespace

    from opd_harness.trainers.distributed import CollectiveTimeout
    from opd_harness.trainers.ray_executor import RayLearner

    started = time.monotonic()
    run_ranks(_skipping_rank, 2, tmp_path, 12 * TIMEOUT_S)
    assert time.monotonic() - started < 10 * TIMEOUT_S
    message = (tmp_path / "rank0.txt").read_text()
    assert message == f"CollectiveTimeout: a collective did not complete within trainer.collective_timeout_s={TIMEOUT_S:g}s"
    store = SimpleNamespace(root=tmp_path, checkpoints=lambda run_id: [{"step": 2}])
    learner = RayLearner(_FakeRay(), ["a0", "a1"], SimpleNamespace(run_id="r1", store=store))
    line = learner._failure_line(_FakeRay, {0: CollectiveTimeout(message.partition(": ")[2])}, "step 3")
    assert line == (f"learner rank 0 of 2 failed (CollectiveTimeout: a collective did not complete within trainer.collective_timeout_s=5s) "
                    f"while step 3; continue from its last checkpoint (step 2) with: harness run --resume r1 --out {tmp_path}")  # fmt: skip
