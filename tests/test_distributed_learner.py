"""The data-parallel learner step without Ray: 2 gloo ranks (processes) on one global batch give the losses, gradient
norms, diagnostics, method state and weights of 1 rank on the same batch, for token-mean, sequence-level and group methods."""

from __future__ import annotations

import time

import torch
import torch.multiprocessing as mp
import pytest

from harness.models.tiny import TinyArch, build_tiny_model
from harness.registry import METHODS
from harness.trajectory import TensorBatch
from trainers.distributed import Shard, data_parallel, join_group, leave_group, rendezvous_port, shard_bounds
from trainers.learner import train_step

RANKS_TIMEOUT_S = 120.0
VOCAB, ROWS, LENGTH, STEPS = 24, 5, 9, 3  # 5 rows over 2 ranks: uneven shards (3 + 2), a GRPO group split across them
METHODS_UNDER_TEST = {
    "opd": {},  # token-mean over the batch's tokens
    "opd_full": {"estimator": "full"},  # full distributions gathered
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
    teacher_full = torch.log_softmax(torch.randn(ROWS, LENGTH, VOCAB, generator=g), -1)
    ids = torch.randint(3, VOCAB, (ROWS, LENGTH), generator=g) * attention
    behaviour = (-torch.rand(ROWS, LENGTH, generator=g) * 3) * loss_mask
    return TensorBatch(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        step_index=torch.where(loss_mask > 0, (positions >= 6).long().expand(ROWS, -1), -1),
        behaviour_logprobs=behaviour,
        teacher_logprobs=teacher_full.gather(-1, ids[..., None])[..., 0] * loss_mask,
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]),
        policy_version=torch.zeros(ROWS, dtype=torch.long),
        group_ids=torch.tensor([0, 0, 1, 1, 1]),
        teacher_full=teacher_full,
        old_logprobs=behaviour.clone(),
        teacher_fresh_logprobs=None,
        policy_lag=torch.tensor([0, 1, 0, 2, 1]),
    )


def method_steps(name: str, shard: Shard | None) -> dict:
    """``STEPS`` optimizer steps of method ``name`` (one rank's part with a shard); metrics per step and the final weights."""
    torch.manual_seed(0)
    spec = METHODS.get(name.removesuffix("_full"))
    hparams = spec.hparams(**METHODS_UNDER_TEST[name])
    model = build_tiny_model(TinyArch(hidden=16, layers=1, heads=2, kv_heads=1, ffn=32), VOCAB, pad_id=0, eos_id=1, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = spec.make_state(hparams) if spec.make_state else None
    trained = data_parallel(model) if shard is not None else model
    metrics = [train_step(trained, optimizer, synthetic_batch(step), spec, hparams, state, grad_clip=0.05, shard=shard)
               for step in range(STEPS)]  # fmt: skip
    method_state = state.state_dict() if state is not None else None
    return {"metrics": metrics, "weights": {k: v.clone() for k, v in model.state_dict().items()}, "state": method_state}


def _rank(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    shard = Shard(rank, world)
    join_group("127.0.0.1", port, shard, "gloo")
    try:
        torch.save({name: method_steps(name, shard) for name in METHODS_UNDER_TEST}, f"{out}/rank{rank}.pt")
    finally:
        leave_group()


def test_shards_are_contiguous_and_cover_the_batch():
    assert [shard_bounds(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [shard_bounds(8, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert [shard_bounds(4, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def _close(a, b, tol: float = 1e-5) -> bool:
    return a == pytest.approx(b, abs=tol, rel=tol, nan_ok=True)


def test_two_ranks_give_the_update_of_one_rank(tmp_path):
    torch.set_num_threads(1)
    single = {name: method_steps(name, None) for name in METHODS_UNDER_TEST}
    ranks = mp.start_processes(_rank, args=(2, rendezvous_port(), str(tmp_path)), nprocs=2, join=False, start_method="fork")
    deadline = time.monotonic() + RANKS_TIMEOUT_S  # forked (imports inherited: ~2 s, not ~40 s); a hang fails, it never blocks CI
    while not ranks.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the 2 ranks did not finish in {RANKS_TIMEOUT_S:.0f}s")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name, expected in single.items():
        for rank in results:
            got = rank[name]
            for step, (want, have) in enumerate(zip(expected["metrics"], got["metrics"], strict=True)):
                assert set(want) == set(have), (name, step)
                assert have["loss"] != 0.0 and have["grad_norm"] > 0.05, (name, step, have)  # a real update, clipped
                bad = {k: (want[k], have[k]) for k in want if not k.startswith("time_") and not _close(want[k], have[k])}
                assert not bad, (name, step, bad)
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
