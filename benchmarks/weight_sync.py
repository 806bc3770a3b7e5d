"""Seconds and bytes per weight sync, ``object_store`` vs ``collective`` (gloo), at three model sizes, alternated after a
warm-up, on a local Ray: one sender actor (the learner's rank 0) and ``--receivers`` receiver actors (rollout workers).

    PYTHONPATH=. python benchmarks/weight_sync.py --sizes 10e6,100e6,500e6 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from opd_harness.trainers.weight_sync import SyncGroup, state_bytes


class Side:
    """A learner or rollout stand-in: a state of ``params`` fp32 parameters in 16 Mi-element tensors."""

    def make(self, params: int) -> int:
        chunk = 16 << 20
        self.state = {f"p{i}": torch.randn(min(chunk, params - i * chunk)) for i in range((params + chunk - 1) // chunk)}
        return state_bytes(self.state)

    def join(self, address: str, port: int, rank: int, world: int) -> None:
        self.group = SyncGroup(address, port, rank, world, "cpu", 600)

    def address(self) -> tuple[str, int]:
        from opd_harness.trainers.distributed import rendezvous_port

        return "127.0.0.1", rendezvous_port()

    def copy(self) -> dict:
        return {k: v.clone() for k, v in self.state.items()}  # object_store: the one published copy

    def load(self, weights: dict) -> int:
        return state_bytes(weights)

    def send(self) -> int:
        return self.group.send(self.state)

    def receive(self, layout) -> int:
        return state_bytes(self.group.receive(layout))


def main() -> None:
    import ray

    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10e6,100e6,500e6")
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=5 << 30,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}})  # fmt: skip
    remote = ray.remote(Side).options(num_cpus=0)
    sender, receivers = remote.remote(), [remote.remote() for _ in range(args.receivers)]
    address, port = ray.get(sender.address.remote())
    world = args.receivers + 1
    ray.get([sender.join.remote(address, port, 0, world)] + [r.join.remote(address, port, i, world) for i, r in enumerate(receivers, 1)])
    print("| params | transport | bytes/sync | seconds/sync (mean of repeats) |\n|---|---|---|---|")
    for size in [int(float(s)) for s in args.sizes.split(",")]:
        nbytes = ray.get(sender.make.remote(size))
        layout = [(f"p{i}", (min(16 << 20, size - i * (16 << 20)),), "float32") for i in range((size + (16 << 20) - 1) // (16 << 20))]
        times: dict[str, list[float]] = {"object_store": [], "collective": []}
        for rep in range(args.repeats + 1):  # rep 0 warms up
            for name in ("object_store", "collective"):  # alternated
                started = time.perf_counter()
                if name == "object_store":
                    ref = sender.copy.remote()
                    ray.get([r.load.remote(ref) for r in receivers])
                    del ref
                else:
                    got = [r.receive.remote(layout) for r in receivers]
                    ray.get([sender.send.remote(), *got])
                if rep:
                    times[name].append(time.perf_counter() - started)
        for name, seconds in times.items():
            print(f"| {size / 1e6:.0f}M | {name} | {nbytes / 2**20:.0f} MiB | {sum(seconds) / len(seconds):.2f} |", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
