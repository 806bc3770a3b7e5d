"""A two-node Ray cluster on this machine for tests: ``ray start --head`` with the custom resource ``node_a`` and a
second ``ray start --address`` with ``node_b`` (2 CPUs and 2 fake GPUs each: Ray hands out their ids, torch sees none),
each our own process group, stopped by its ids (never ``ray stop``,
which stops every Ray on the machine) and checked to leave no process behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
OBJECT_STORE_BYTES = 256 * 2**20  # per node: caps /dev/shm use
START_TIMEOUT_S = 90.0
# the prefix Ray puts on a line it forwards from a worker's stdout/stderr: "(EvalWorker pid=1579)", "(pid=12, ip=10.0.0.2)",
# "(raylet)", in colour or not
RAY_FORWARDED = re.compile(r"^\s*(?:\x1b\[[0-9;]*m)?\((?:raylet|(?:[\w.<>-]+ )?pid=\d+)(?:, ip=[\d.]+)?\)")


def free_port() -> int:
    """A TCP port no one listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def driver_output(output: str) -> str:
    """``output`` without the lines Ray forwarded from its workers: what the harness itself printed. A worker's own noise
    (Python's multiprocessing resource tracker printing a KeyError traceback when it is relaunched, say) is not a
    traceback of the command under test."""
    return "\n".join(line for line in output.splitlines() if not RAY_FORWARDED.match(line))


def _ray_cli() -> list[str]:
    """``ray`` of this interpreter (the venv's script's shebang may point elsewhere)."""
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; sys.exit(main())"]


NODE_GPUS = 2  # fake GPUs each node declares (ray start --num-gpus): a layout's num_gpus is placed, and ids assigned


def _node_args(temp_dir: str, resource: str) -> list[str]:
    """Flags of one node: its own temp dir, custom resource, 2 CPUs, 2 fake GPUs and free ports (other Rays may run here)."""
    return [
        "--block",
        "--num-cpus=2",
        f"--num-gpus={NODE_GPUS}",
        f"--resources={json.dumps({resource: 1})}",
        f"--temp-dir={temp_dir}",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        "--disable-usage-stats",
    ]


def processes_of(marker: str, groups: set[int]) -> list[int]:
    """Pids of live processes in one of ``groups`` (process groups or sessions: each node's ``ray start`` leads its own
    session, and Ray puts every worker process, an actor's too, in a process group of its own inside it) or whose command
    line names ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        if int(fields[2]) in groups or int(fields[3]) in groups or marker in cmdline:
            found.append(int(entry.name))
    return found


@dataclass
class TwoNodeCluster:
    """The running cluster: its address and the node ids of ``node_a`` and ``node_b``."""

    root: str
    address: str = ""
    node_ids: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self) -> "TwoNodeCluster":
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        env = {**os.environ, **RAY_ENV}
        head = [*_ray_cli(), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                *_node_args(f"{self.root}/a", "node_a")]  # fmt: skip
        self._spawn(head, env, "a")
        self._wait_nodes(1)
        worker = [*_ray_cli(), "start", f"--address={self.address}", "--node-ip-address=127.0.0.1", *_node_args(f"{self.root}/b", "node_b")]
        self._spawn(worker, env, "b")
        self._wait_nodes(2)
        return self

    def _spawn(self, cmd: list[str], env: dict, name: str) -> None:
        log = open(f"{self.root}/{name}.log", "wb")  # noqa: SIM115 - closed with the process's output
        self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def _wait_nodes(self, count: int) -> None:
        """Until ``count`` nodes are alive (asked through a short-lived driver process)."""
        probe = (
            "import json, ray; ray.init(address=%r, logging_level='ERROR'); "
            "print(json.dumps({r: n['NodeID'] for n in ray.nodes() if n['Alive'] for r in n['Resources'] if r.startswith('node_')}))"
        ) % self.address
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"ray start exited with {proc.returncode}; see {self.root}/*.log")
            try:
                env = {**os.environ, **RAY_ENV}
                out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=30)
            except subprocess.TimeoutExpired:
                continue
            if out.returncode == 0:
                found = [line for line in out.stdout.splitlines() if line.startswith("{")]  # Ray may print lines of its own
                if not found:
                    continue
                self.node_ids = json.loads(found[-1])
                if len(self.node_ids) >= count:
                    return
            time.sleep(1)
        raise RuntimeError(f"the test cluster did not reach {count} nodes in {START_TIMEOUT_S:.0f}s")

    def kill_node(self, name: str) -> None:
        """SIGKILL every process of node ``name`` (``b``: the worker node started second), as when a machine is lost."""
        index = "ab".index(name)
        for pid in processes_of(f"{self.root}/{name}", {self.procs[index].pid}):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs[index].wait(timeout=10)

    def stop(self) -> list[int]:
        """SIGTERM each node's process group, SIGKILL what is left; returns the pids still alive afterwards (none)."""
        groups = {proc.pid for proc in self.procs}
        for sig, wait in ((signal.SIGTERM, 8.0), (signal.SIGKILL, 5.0)):
            for pid in processes_of(self.root, groups):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while processes_of(self.root, groups) and time.monotonic() < deadline:
                for proc in self.procs:
                    proc.poll()  # reap our children
                time.sleep(0.2)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        return processes_of(self.root, groups)


def start_two_node_cluster() -> TwoNodeCluster:
    """A started cluster under a fresh short temp dir (Ray's socket paths must stay under 108 characters)."""
    cluster = TwoNodeCluster(tempfile.mkdtemp(prefix="opdrc-", dir="/tmp"))
    try:
        return cluster.start()
    except BaseException:
        cluster.stop()
        raise


def remove_cluster_dir(cluster: TwoNodeCluster) -> None:
    shutil.rmtree(cluster.root, ignore_errors=True)
