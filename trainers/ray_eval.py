"""Sharded evaluation on Ray (``harness eval --executor ray --workers N``): the shards of an evaluation spread over N
evaluation worker actors.

Each worker loads its own copy of the backend and its own task instances (so its sandboxes, and a SWE-bench
task's instance images, are made by the Docker daemon of the node it runs on), and rolls out and grades whole
shards (``harness.evaluation.evaluate_shard``); the driver hands a shard to each idle worker, stages each finished
one and stores a task's results in one transaction. A worker that dies is restarted by Ray (``max_restarts``) and
the shard it held goes back to the queue: a shard is staged once, from the one attempt that finished, so none is
lost or counted twice. Samples depend only on (seed, shard), so the scores equal the in-process evaluation's.
Ray is imported here only, and this module only when the executor is ray.
"""

from __future__ import annotations

import os
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from rich.console import Console

from harness.backends import SamplingParams
from harness.evaluation import EvalWorkersFailed, EvalWorkerSpec, evaluate_shard
from harness.plan import make_task
from harness.registry import BACKENDS
from harness.store import SampleRow
from harness.task import Problem, Task, close_tasks
from trainers.pipeline import close_rollout_backend
from trainers.ray_executor import CLOSE_TIMEOUT_S, ActorRole, _setup_actor, ray_runtime

MAX_RESTARTS = 3  # Ray restarts a dead evaluation worker this often
PROBE_INTERVAL_S = 0.5  # how often a restarting worker is asked whether it is back
MAX_SHARD_ATTEMPTS = 3  # a shard whose worker died this often stops the evaluation (something kills every attempt)
WORKER_THREADS = 1  # torch threads (and Ray CPUs) per worker


class EvalWorker(ActorRole):
    """One evaluation worker: its own backend and task instances; rolls out and grades the shards it is handed."""

    def __init__(self, spec: EvalWorkerSpec, threads: int) -> None:
        _setup_actor(threads)
        self.spec, self.tasks, self.backend, self.failure = spec, {}, None, None
        try:  # a start-up failure (a missing model folder) is reported by ``ready`` as one line, not a creation traceback
            self.backend = BACKENDS.get(spec.backend).load(spec.model, **spec.backend_options)
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which stops the evaluation
            self.failure = f"{type(exc).__name__}: {exc}"

    def ready(self) -> str | None:  # type: ignore[override]
        """None once the backend is loaded, else why it could not be."""
        return self.failure

    def pid(self) -> int:
        return os.getpid()

    def _task(self, name: str) -> Task:
        """This worker's instance of task ``name`` (made, loaded and checked once, as the driver's was)."""
        if name not in self.tasks:
            task = make_task(name, self.spec.task_args)
            task.load("test", self.spec.data_dir)  # the same state the driver's instance has after loading
            task.check_ready()
            self.tasks[name] = task
        return self.tasks[name]

    def run_shard(self, task: str, problems: list[Problem], k: int, sampling: SamplingParams, index: int) -> list[SampleRow]:
        """Shard ``index``'s graded rows (its trajectories stay here: the driver stores rows only)."""
        rows, _ = evaluate_shard(self.backend, self._task(task), problems, k=k, sampling=sampling, index=index, show_progress=False)
        return rows

    def close(self) -> None:
        close_tasks(self.tasks.values())
        close_rollout_backend(self.backend)


def task_error(ray: ModuleType, exc: Exception) -> Exception:
    """The exception a worker raised, as itself (e.g. a replay file's ValueError), not wrapped in Ray's traceback."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else RuntimeError(str(exc).strip().splitlines()[-1])


class RayShards:
    """The driver's side of the workers: a queue of shards, one in flight per worker, re-queued when its worker dies."""

    def __init__(self, ray: ModuleType, workers: list[Any], console: Console) -> None:
        self.ray, self.workers, self.console = ray, workers, console
        self.requeued = 0  # shards handed out again after their worker died

    def run(
        self, task: Task, shards: dict[int, list[Problem]], *, k: int, sampling: SamplingParams
    ) -> Iterator[tuple[int, list[SampleRow], list]]:
        ray = self.ray
        pending, idle, attempts = deque(shards), deque(self.workers), Counter()
        inflight: dict[Any, tuple[int, Any]] = {}  # shard call -> (shard, worker)
        probes: dict[Any, Any] = {}  # ``ready`` call -> a worker that died, until it is back
        try:
            while pending or inflight:
                while pending and idle:
                    index, worker = pending.popleft(), idle.popleft()
                    inflight[worker.run_shard.remote(task.name, shards[index], k, sampling, index)] = (index, worker)
                if not inflight and not probes:
                    raise EvalWorkersFailed(f"{task.name}: every evaluation worker died for good ({len(pending)} shards left)")
                (ref,), _ = ray.wait([*inflight, *probes], num_returns=1)
                if ref in probes:
                    self._probed(ref, probes, idle)
                    continue
                index, worker = inflight.pop(ref)
                try:
                    rows = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    raise task_error(ray, exc) from None
                except ray.exceptions.RayActorError as exc:  # the worker died (Ray restarts it): the shard goes back
                    attempts[index] += 1
                    if attempts[index] >= MAX_SHARD_ATTEMPTS:
                        raise EvalWorkersFailed(f"{task.name} shard {index}: its evaluation worker died {attempts[index]} times") from None
                    self.requeued += 1
                    self.console.print(f"[yellow]warning:[/] {task.name} shard {index}: evaluation worker died "
                                       f"({type(exc).__name__}); shard re-queued")  # fmt: skip
                    pending.appendleft(index)
                    probes[worker.ready.remote()] = worker
                    continue
                idle.append(worker)
                yield index, rows, []
        finally:
            for ref in inflight:  # interrupted: what is still running is dropped, not waited for
                try:
                    ray.cancel(ref, force=False)
                except Exception:  # noqa: BLE001 - the worker may be gone already; the workers are killed next
                    pass

    def _probed(self, ref: Any, probes: dict[Any, Any], idle: deque) -> None:
        """A dead worker's ``ready`` answered: back to work once restarted, probed again while restarting, dropped when
        Ray gave up on it (or it cannot load the model again)."""
        ray, worker = self.ray, probes.pop(ref)
        try:
            failure = ray.get(ref)
        except ray.exceptions.ActorDiedError:
            return
        except ray.exceptions.RayActorError:  # still restarting
            time.sleep(PROBE_INTERVAL_S)
            probes[worker.ready.remote()] = worker
            return
        if failure is None:
            idle.append(worker)


def start_workers(ray: ModuleType, spec: EvalWorkerSpec, count: int, console: Console) -> list[Any]:
    """``count`` workers spread over the cluster's nodes (Ray's SPREAD strategy), each restarted when it dies."""
    cls = ray.remote(EvalWorker).options(
        num_cpus=WORKER_THREADS, max_concurrency=1, max_restarts=MAX_RESTARTS, max_task_retries=0, scheduling_strategy="SPREAD"
    )
    workers = [cls.remote(spec, WORKER_THREADS) for _ in range(count)]
    failures = [f for f in ray.get([w.ready.remote() for w in workers]) if f]
    if failures:
        stop_workers(ray, workers, console)
        raise RuntimeError(f"an evaluation worker could not load --model {spec.model!r}: {failures[0]}")
    nodes = Counter(ray.get([w.node_id.remote() for w in workers]))
    console.print(f"ray eval: {count} workers on {len(nodes)} node(s): " + ", ".join(f"{n} on {node[:12]}" for node, n in nodes.items()))
    return workers


def stop_workers(ray: ModuleType, workers: list[Any], console: Console) -> None:
    """Close every worker's tasks and engine (their sandbox containers), then kill them."""
    try:
        ray.get([w.close.remote() for w in workers], timeout=CLOSE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - a dead or stuck worker must not keep the others alive
        console.print(f"[yellow]warning:[/] evaluation workers did not close cleanly ({type(exc).__name__}); killing them")
    for worker in workers:
        ray.kill(worker, no_restart=True)


class RayEvalExecutor:
    """``harness eval --executor ray``: a local Ray, or the cluster at ``address``; N workers for the command."""

    @contextmanager
    def open(self, spec: EvalWorkerSpec, *, workers: int, address: str | None, console: Console) -> Iterator[RayShards]:
        with ray_runtime(address, WORKER_THREADS, console, cpus=workers * WORKER_THREADS) as ray:
            started = start_workers(ray, spec, workers, console)
            try:
                yield RayShards(ray, started, console)
            finally:
                stop_workers(ray, started, console)


RAY_EVAL = RayEvalExecutor()
