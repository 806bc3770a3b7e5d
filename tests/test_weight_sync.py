"""Weight transports (``trainer.weight_sync``): only loadable versions are published, in the rollout dtype; the collective
broadcast is bit for bit; a load the engine did not take is refused. The collective transport in a real run, on a two-node
cluster (bit for bit after every load, a worker killed and rejoining): tests/test_ray_cluster.py."""

import os
import shutil
import tempfile
import time

import pytest
import torch

from tests.test_ray_executor import run
from opd_harness.trainers.loop import Schedule
from opd_harness.trainers.pipeline import load_rollout_weights
from opd_harness.trainers.weight_sync import SyncGroup, WeightSyncError, buckets, checksum, layout_of, rollout_copy, state_bytes

ASYNC_EVERY_3 = ["--method", "opd", "--mode", "async", "--set", "trainer.steps=6", "--set", "trainer.sync_every=3",
                 "--set", "trainer.max_lag=3"]  # fmt: skip


def test_schedule_publishes_only_versions_a_worker_may_load():
    every3 = Schedule(9, max_lag=3, fixed_lag=None, sync_every=3)
    assert [v for v in range(10) if every3.publishes(v)] == [0, 3, 6, 9]
    assert Schedule(9, max_lag=1, fixed_lag=None, sync_every=3).period == 2  # max_lag forces a load every 2 versions
    assert all(Schedule(9, max_lag=0, fixed_lag=2, sync_every=3).publishes(v) for v in range(10))  # each version is used


def test_object_store_with_sync_every_3_publishes_every_third_version(tmp_path):
    started = time.perf_counter()
    metrics, _, _ = run(tmp_path, *ASYNC_EVERY_3)
    published = [s for s in sorted(metrics) if metrics[s]["sync_bytes"] > 0]
    assert published == [3, 6]
    assert all(metrics[s]["sync_seconds"] == 0 for s in metrics if s not in published)
    print(f"object_store sync_every=3: {time.perf_counter() - started:.1f}s")


class _Engine:
    """A rollout engine holding ``model``; ``stale`` keeps its old weights (a reload that silently did nothing)."""

    def __init__(self, model: torch.nn.Module, stale: bool) -> None:
        self.model, self.stale, self.version = model, stale, -1

    def load_weights(self, state_dict, version: int) -> None:
        if not self.stale:
            self.model.load_state_dict(state_dict)
        self.version = version


def test_a_stale_load_is_refused_and_a_true_one_passes():
    torch.manual_seed(0)
    learner, old = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    new = rollout_copy(learner.state_dict(), torch.float32)
    load_rollout_weights(_Engine(torch.nn.Linear(8, 8), stale=False), None, new, 1, checksum(new))
    with pytest.raises(WeightSyncError, match="did not take weights version 1"):
        load_rollout_weights(_Engine(old, stale=True), None, new, 1, checksum(new))


def test_a_tied_tensor_is_copied_counted_and_sent_once(tiny_model_factory):
    """The tiny student ties its embedding and output head (one tensor, two state-dict names): the rollout copy keeps
    them one tensor, its bytes are the parameter bytes in the rollout dtype, and the broadcast sends it once and rebuilds
    the second name from the first."""
    model = tiny_model_factory()
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # tied
    copy = rollout_copy(state, torch.bfloat16)
    assert copy["lm_head.weight"] is copy["model.embed_tokens.weight"] and copy["lm_head.weight"].dtype == torch.bfloat16
    parameter_bytes = sum(p.numel() * 2 for p in model.parameters())  # parameters(): a tied tensor once; bf16: 2 bytes
    assert state_bytes(copy) == parameter_bytes < sum(t.numel() * 2 for t in copy.values())
    layout = layout_of(copy)
    sources = {name: source for name, _, _, source in layout}
    assert sources["lm_head.weight"] == "lm_head.weight" and sources["model.embed_tokens.weight"] == "lm_head.weight"
    sent = [layout[i][0] for bucket in buckets(layout) for i in bucket]
    assert "model.embed_tokens.weight" not in sent and len(sent) == len(layout) - 1


def test_buckets_are_per_dtype_and_bounded():
    state = {"a": torch.zeros(10), "b": torch.zeros(10, dtype=torch.bfloat16), "c": torch.zeros(10), "d": torch.zeros(30)}
    layout = layout_of(state)
    groups = [[layout[i][0] for i in b] for b in buckets(layout, limit=80)]
    assert sorted(groups) == [["a", "c"], ["b"], ["d"]]  # fp32 a+c = 80 bytes fill one bucket; d (120 bytes) gets its own


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    temp_dir = tempfile.mkdtemp(prefix="opd-ray-")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20, _temp_dir=temp_dir,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), os.getcwd()])),
                                      "OMP_NUM_THREADS": "1"}})  # fmt: skip  (the actors import the code this test imports)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_collective_broadcast_is_bit_for_bit_on_two_receiver_processes(local_ray):
    """Rank 0 (a learner stand-in) and 2 rollout stand-ins, each its own Ray actor process, over gloo; several versions,
    mixed dtypes, buckets small enough that every version spans several."""
    ray = local_ray

    class Receiver:  # defined here: Ray ships it by value to the actor processes
        def join(self, address: str, port: int, rank: int, world: int) -> None:
            self.group = SyncGroup(address, port, rank, world, "cpu", 60, bucket_bytes=64 << 10)  # several buckets a version

        def receive(self, layout) -> dict:
            return self.group.receive(layout)

    class Sender(Receiver):
        def address(self) -> tuple[str, int]:
            from opd_harness.trainers.distributed import rendezvous_port

            return "127.0.0.1", rendezvous_port()

        def send(self, state: dict) -> int:
            return self.group.send(state)

    sender = ray.remote(Sender).options(num_cpus=0).remote()
    receivers = [ray.remote(Receiver).options(num_cpus=0).remote() for _ in range(2)]
    address, port = ray.get(sender.address.remote())
    ray.get([sender.join.remote(address, port, 0, 3)] + [r.join.remote(address, port, i, 3) for i, r in enumerate(receivers, 1)])
    for version in range(3):
        torch.manual_seed(version)
        embedding = torch.randn(5000)
        state = rollout_copy({"w": torch.randn(300, 200), "e": embedding, "head": embedding, "n": torch.arange(7)}, torch.bfloat16)
        layout = layout_of(state)
        got = [r.receive.remote(layout) for r in receivers]
        sent = ray.get(sender.send.remote(state))
        assert sent == state_bytes(state) == (60000 + 5000) * 2 + 7 * 8  # bytes in the rollout dtype (bf16; ints stay; tied once)
        for received in ray.get(got):
            assert set(received) == set(state)
            for name, tensor in state.items():
                assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)
            assert received["head"] is received["e"]  # the tied tensor, received once
