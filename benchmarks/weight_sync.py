"""Seconds and bytes per weight sync, ``object_store`` vs ``collective`` (gloo), at three model sizes, on a two-node CPU Ray
cluster (the tests' ``tests/ray_cluster.py``: two ``ray start`` nodes on this machine, 2 fake GPUs each): one learner
stand-in (rank 0) on node a and one rollout stand-in on each node, so the object store serves one worker from its own
node and one across nodes.

Each sync does what the run does: the learner turns its fp32 master weights into one copy in the rollout dtype
(:func:`~opd_harness.trainers.weight_sync.rollout_copy`), then ``object_store`` leaves it in the object store and each
worker fetches it, ``collective`` broadcasts it in 64 MiB buckets (:class:`~opd_harness.trainers.weight_sync.SyncGroup`);
every worker then copies it into its own parameters (the engine's load). Timed from the driver: start to every worker
loaded. One warm-up of each transport per size is discarded; the order alternates every repeat.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/weight_sync.py --sizes 10e6,100e6,500e6 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from opd_harness.trainers.weight_sync import BUCKET_BYTES, SyncGroup, layout_of, rollout_copy, state_bytes

CHUNK = 16 << 20  # elements per tensor (a 4096 × 4096 matrix)
OBJECT_STORE_BYTES = 3 << 30  # per node: one 500M-parameter bf16 copy (1 GB), and room to spare


class Side:
    """A learner (fp32 master weights) or rollout (parameters in the rollout dtype) stand-in with ``params`` parameters."""

    def make(self, params: int, dtype: str, master: bool) -> int:
        sizes = [min(CHUNK, params - start) for start in range(0, params, CHUNK)]
        kind = torch.float32 if master else getattr(torch, dtype)
        self.state = {f"layer{i}.weight": torch.randn(n).to(kind) for i, n in enumerate(sizes)}
        self.dtype = getattr(torch, dtype)
        return sum(t.numel() for t in self.state.values())

    def address(self) -> tuple[str, int]:
        import ray

        from opd_harness.trainers.distributed import rendezvous_port

        return ray.util.get_node_ip_address(), rendezvous_port()

    def join(self, address: str, port: int, rank: int, world: int) -> None:
        self.group = SyncGroup(address, port, rank, world, "cpu", 600, BUCKET_BYTES)

    def publish(self) -> dict[str, torch.Tensor]:
        """object_store: the one copy in the rollout dtype (Ray puts the return value in the object store)."""
        return rollout_copy(self.state, self.dtype)

    def send(self) -> int:
        """collective: the copy in the rollout dtype, broadcast; its bytes."""
        return self.group.send(rollout_copy(self.state, self.dtype))

    def layout(self) -> list:
        return layout_of(rollout_copy(self.state, self.dtype))

    def load(self, weights: dict[str, torch.Tensor]) -> int:
        """Copy ``weights`` into the parameters (what an engine's load does); the bytes loaded."""
        for name, tensor in weights.items():
            self.state[name].copy_(tensor)
        return state_bytes(weights)

    def receive(self, layout: list) -> int:
        return self.load(self.group.receive(layout))

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def sync_once(ray, name: str, sender, receivers: list, layout: list) -> tuple[float, int]:
    """One sync by transport ``name``: (seconds until every receiver has loaded it, bytes per receiver)."""
    started = time.perf_counter()
    if name == "object_store":
        ref = sender.publish.remote()
        loaded = ray.get([r.load.remote(ref) for r in receivers])
        del ref
    else:
        got = [r.receive.remote(layout) for r in receivers]
        loaded = ray.get([sender.send.remote(), *got])[1:]
    seconds = time.perf_counter() - started
    assert len(set(loaded)) == 1, loaded
    return seconds, loaded[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10e6,100e6,500e6", help="parameter counts, comma-separated")
    parser.add_argument("--dtype", default="bfloat16", help="the rollout dtype weights are sent in")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs of each transport per size (after one warm-up)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import ray
    import ray_cluster

    ray_cluster.OBJECT_STORE_BYTES = OBJECT_STORE_BYTES
    cluster = ray_cluster.start_two_node_cluster()
    try:
        env = {"PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd()), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        ray.init(address=cluster.address, logging_level="ERROR", runtime_env={"env_vars": env})
        on = lambda node: ray.remote(Side).options(num_cpus=0, resources={node: 0.1})  # noqa: E731
        sender, receivers = on("node_a").remote(), [on("node_a").remote(), on("node_b").remote()]
        nodes = ray.get([a.node.remote() for a in (sender, *receivers)])
        assert nodes[2] != nodes[0] == nodes[1], nodes
        address, port = ray.get(sender.address.remote())
        ray.get([sender.join.remote(address, port, 0, 3), *(r.join.remote(address, port, i, 3) for i, r in enumerate(receivers, 1))])
        print(f"two-node cluster at {cluster.address}; rollout dtype {args.dtype}; {args.repeats} timed syncs per transport and size\n")
        print("| parameters | transport | bytes per sync | seconds per sync (median) | min–max | GB/s per worker |")
        print("|---|---|---|---|---|---|")
        for size in [int(float(s)) for s in args.sizes.split(",")]:
            ray.get([sender.make.remote(size, args.dtype, True), *(r.make.remote(size, args.dtype, False) for r in receivers)])
            layout = ray.get(sender.layout.remote())
            times: dict[str, list[float]] = {"object_store": [], "collective": []}
            nbytes = 0
            for rep in range(args.repeats + 1):  # rep 0 warms both up (discarded)
                order = ("object_store", "collective") if rep % 2 == 0 else ("collective", "object_store")
                for name in order:
                    seconds, nbytes = sync_once(ray, name, sender, receivers, layout)
                    if rep:
                        times[name].append(seconds)
            for name, seconds in times.items():
                median = statistics.median(seconds)
                print(f"| {size / 1e6:.0f}M | {name} | {nbytes / 1e6:.0f} MB | {median:.2f} | {min(seconds):.2f}–{max(seconds):.2f} | "
                      f"{nbytes / median / 1e9:.2f} |", flush=True)
        ray.shutdown()
    finally:
        left = cluster.stop()
        ray_cluster.remove_cluster_dir(cluster)
        if left:
            print(f"warning: processes of the benchmark cluster still alive: {left}", file=sys.stderr)


if __name__ == "__main__":
    main()
