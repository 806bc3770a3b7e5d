"""Sharded evaluation on Ray (``harness eval --executor ray --workers N``): the shards of an evaluation spread over N
evaluation worker actors.

Each worker loads its own copy of the backend and its own task instances (so its sandboxes, and a SWE-bench
task's instance images, are made by the Docker daemon of the node it runs on), and rolls out and grades whole
shards (``opd_harness.evaluation.evaluate_shard``); the driver hands a shard to each idle worker, stages each finished
one and stores a task's results in one transaction. A worker that dies is restarted by Ray (``max_restarts``) and
the shard it held goes back to the queue: a shard is staged once, from the one attempt that finished, so none is
lost or counted twice. Samples depend only on (seed, shard), so the scores equal the in-process evaluation's.

A training run's checkpoint evaluations use the same workers and queue (:meth:`RayEvalExecutor.for_run`):
``trainer.layout.eval.replicas`` workers in the eval role's placement group (one worker where Ray puts it without
``trainer.layout.eval``), each loading the student from its folder; before a checkpoint is evaluated every worker reads
its weights from the checkpoint's folder (the driver holds no model) and a worker that does not hold them (restarted by
Ray since) refuses the shard, which is re-queued while the weights are loaded again. Ray is imported here only, and
this module only when the executor is ray.

Faults in a training run (the run's :class:`~opd_harness.trainers.ray_executor.Faults`): every call to a worker is bounded
by ``trainer.actor_timeout_s``: a worker that does not answer a shard (or a checkpoint's load) in time counts as hung, is
killed for Ray to restart and its shard re-queued, like a dead one; a start-up or restart past
``trainer.actor_restart_timeout_s``, or a worker whose node died, ends the run ``failed`` with one line naming the worker
(``eval``, ``eval.0``, …; ``teacher…`` for the teacher's reference evaluation) and its node. Asking a worker for its node
(at start-up and after each restart) is bounded and handled the same way. ``harness eval``'s own workers have no such
bounds by default (a shard of agent episodes may take hours: a dead one is restarted and its shard re-queued, a hung one
waits); ``--actor-timeout`` / ``--actor-restart-timeout`` give them the same handling, the eval failing (its shards kept
staged) where a run would.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from rich.console import Console

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.evaluation import EvalWorkersFailed, EvalWorkerSpec, evaluate_shard
from opd_harness.plan import make_task
from opd_harness.registry import BACKENDS
from opd_harness.store import SampleRow
from opd_harness.task import Problem, Task, close_tasks
from opd_harness.trainers.pipeline import close_rollout_backend
from opd_harness.trainers.ray_executor import (
    CLOSE_TIMEOUT_S,
    RESTART_TIMEOUT_S,
    ActorLost,
    ActorRole,
    DeviceUnavailable,
    Faults,
    _setup_actor,
    actor_node,
    await_started,
    dead_nodes,
    placement_options,
    ray_get,
    ray_runtime,
    replica_names,
    resume_hint,
)

MAX_RESTARTS = 3  # Ray restarts a dead evaluation worker this often
PROBE_INTERVAL_S = 0.5  # how often a restarting worker is asked whether it is back
MAX_SHARD_ATTEMPTS = 3  # a shard whose worker died this often stops the evaluation (something kills every attempt)
WORKER_THREADS = 1  # torch threads (and Ray CPUs) per worker


class StaleWeights(RuntimeError):
    """An evaluation worker asked for a checkpoint's shard does not hold that checkpoint's weights (Ray restarted it)."""


class EvalWorker(ActorRole):
    """One evaluation worker: its own backend and task instances; rolls out and grades the shards it is handed.

    It loads ``spec.model`` on ``spec.backend`` (a training run's: the student's folder, then each checkpoint's weights
    from its folder, :meth:`load_checkpoint`). An hf-family
    backend runs on the device Ray assigned the worker (``cuda`` with GPUs, unless ``--backend-option device=`` says
    otherwise); vLLM finds its GPUs through ``CUDA_VISIBLE_DEVICES``, which Ray sets. ``gpu_key`` is the setting that
    asked for the GPUs (``--gpus-per-worker``, or ``trainer.layout.eval.num_gpus`` in a training run)."""

    role = "eval"

    def __init__(self, spec: EvalWorkerSpec, threads: int, gpu_key: str = "--gpus-per-worker") -> None:
        _setup_actor(threads)
        self.spec, self.tasks, self.backend, self.failure, self._gpu_key = spec, {}, None, None, gpu_key
        if not self.take_device():
            return
        try:  # a start-up failure (a missing model folder) is reported by ``ready`` as one line, not a creation traceback
            cls = BACKENDS.get(spec.backend)
            options = {"device": self.device, **spec.backend_options} if issubclass(cls, HFBackend) else spec.backend_options
            self.backend = cls.load(spec.model, **options)
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which stops the evaluation
            self.failure = f"{type(exc).__name__}: {exc}"

    def load_checkpoint(self, path: str, version: int) -> None:
        """Hold the weights of checkpoint ``version``, read from its folder ``path`` (a training run's evaluation workers)."""
        from opd_harness.models.tiny import load_model_and_tokenizer

        model, _ = load_model_and_tokenizer(path)
        self.backend.load_weights(model.state_dict(), version)

    @property
    def gpu_key(self) -> str:
        return self._gpu_key

    def ready(self) -> str | None:
        """None once the backend is loaded, else why it could not be."""
        return self.device_failure or self.failure

    def device_problem(self) -> str | None:
        """Why this worker cannot use the GPUs Ray gave it, or None."""
        return self.device_failure

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

    def run_shard(
        self, task: str, problems: list[Problem], k: int, sampling: SamplingParams, index: int, version: int | None = None
    ) -> list[SampleRow]:
        """Shard ``index``'s graded rows (its trajectories stay here: the driver stores rows only); with ``version``, only
        from that checkpoint's weights (:class:`StaleWeights` otherwise)."""
        if version is not None and self.backend.version != version:
            raise StaleWeights(f"evaluation worker holds weights version {self.backend.version}, not {version} (restarted)")
        try:
            rows, _ = evaluate_shard(self.backend, self._task(task), problems, k=k, sampling=sampling, index=index, show_progress=False)
        finally:
            if self.spec.sandbox_per_shard and task in self.tasks and self.tasks[task].needs_sandbox:
                self.tasks[task].close()  # its containers go now; the next shard opens the sandbox again
        return rows

    def close(self) -> None:
        close_tasks(self.tasks.values())
        close_rollout_backend(self.backend)


def task_error(ray: ModuleType, exc: Exception) -> Exception:
    """The exception a worker raised, as itself (e.g. a replay file's ValueError), not wrapped in Ray's traceback."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else RuntimeError(str(exc).strip().splitlines()[-1])


class RayShards:
    """The driver's side of the workers: a queue of shards, one in flight per worker, re-queued when its worker dies.

    With ``faults`` (a training run's: :class:`Faults`), a call unanswered past ``faults.call_s`` (``trainer.actor_timeout_s``)
    means its worker hung: it is killed for Ray to restart and its shard re-queued; a worker not back within
    ``faults.restart_s`` (``trainer.actor_restart_timeout_s``), or one whose node died, raises :class:`ActorLost` naming it
    (``names``: the run's placement keys) and its node; the same bounds hold when a worker is asked for its node. Without
    (``harness eval``, unless given ``--actor-timeout``), calls are unbounded; outside a training run the queue's own
    failures raise :class:`EvalWorkersFailed`.

    With ``max_sandboxes``, a shard of a sandboxed task goes to an idle worker only on a node where fewer than that many
    of its shards are in flight; the workers close such a task's sandbox after each shard (``sandbox_per_shard``), so
    at most ``max_sandboxes`` of these workers hold a sandbox open on one node at once. ``peak_sandboxes`` counts, per
    node, the most shards of a sandboxed task in flight there at once (bounded or not)."""

    def __init__(
        self, ray: ModuleType, workers: list[Any], console: Console, max_sandboxes: int | None = None, *,
        faults: Faults | None = None, names: list[str] | None = None,
    ) -> None:  # fmt: skip
        self.ray, self.workers, self.console, self.max_sandboxes = ray, workers, console, max_sandboxes
        self.faults = faults
        self.call_s = faults.call_s if faults is not None else None  # None: unbounded
        self.restart_s = faults.restart_s if faults is not None else None
        self.names = dict(zip(map(id, workers), names or replica_names("eval", len(workers)), strict=True))  # id(worker) -> name
        self.requeued = 0  # shards handed out again after their worker died (or lost its checkpoint's weights)
        self.kills = 0  # workers killed (for Ray to restart) because a call to them hung
        self.weights: tuple[str, int] | None = None  # (folder, version) every worker must hold: a run's checkpoint
        self.node_of: dict[int, str | None] = dict.fromkeys(map(id, workers))  # id(worker) -> node (None: not known yet)
        self.down: dict[int, float] = {}  # id(worker) -> when it was found dead or hung (its restart is bounded from then)
        self.peak_sandboxes: Counter = Counter()  # node -> most sandboxed shards in flight there at once
        self._locate(workers)

    def fatal(self, line: str) -> Exception:
        """The error that stops the evaluation: in a training run (``faults.session``) :class:`ActorLost` (the run fails,
        with its resume line), else :class:`EvalWorkersFailed` (``harness eval`` keeps the staged shards and prints its
        resume line)."""
        if self.faults is None or self.faults.session is None:
            return EvalWorkersFailed(line)
        return ActorLost(line + resume_hint(self.faults.session))

    def lost(self, worker: Any, what: str) -> Exception:
        """:meth:`fatal` for ``worker`` (``what`` happened to it), naming it and its node (and that the node died, if so)."""
        node = self.node_of[id(worker)] or actor_node(self.ray, worker)  # not asked yet: where Ray placed it
        if node is None:
            where = "not placed on any node"
        else:
            where = f"node {node} died" if node in dead_nodes(self.ray, {node}) else f"on node {node}"
        return self.fatal(f"{self.names[id(worker)]} {what}; {where}")

    def hung(self, worker: Any) -> None:
        """Kill a worker whose call went unanswered past ``trainer.actor_timeout_s``, for Ray to restart (as if it died)."""
        self.kills += 1
        self.ray.kill(worker, no_restart=False)
        self.down.setdefault(id(worker), time.monotonic())

    def died(self, worker: Any, what: str) -> None:
        """A call to ``worker`` failed because it died (Ray restarts it): :meth:`lost` in a training run when its node died
        (``what`` happened to it), else its restart is bounded from now."""
        node = self.node_of[id(worker)]
        if self.faults is not None and node is not None and node in dead_nodes(self.ray, {node}):
            raise self.lost(worker, what) from None
        self.down.setdefault(id(worker), time.monotonic())

    def _locate(self, workers: list[Any]) -> list[Any]:
        """Ask each of ``workers`` for its node (into ``node_of``; a restarted worker may run elsewhere), bounded as a
        shard call is (:meth:`ask_each`). Returns the workers that answered (not those Ray gave up on)."""
        answers = self.ask_each(workers, "node_id", "its node")
        self.node_of.update(answers)
        return [worker for worker in workers if id(worker) in answers]

    def ask_each(self, workers: list[Any], method: str, what: str) -> dict[int, Any]:
        """Call the argument-free ``method`` on each of ``workers`` (asking for ``what``): {id(worker): answer}, bounded
        as a shard call is: a worker silent past ``call_s`` is killed for Ray to restart (:meth:`hung`), one that died is
        waited for, and each is asked again once back; a restart past ``restart_s``, or a worker whose node died, raises
        :meth:`lost`."""
        ray, answers = self.ray, {}
        asks: dict[Any, Any] = {}  # call -> worker
        sent: dict[Any, float] = {}  # call -> when it was sent
        probes: dict[Any, Any] = {}  # ``ready`` call -> a worker that died or hung, until it is back

        def ask(worker: Any) -> None:
            ref = getattr(worker, method).remote()
            asks[ref], sent[ref] = worker, time.monotonic()

        for worker in workers:
            ask(worker)
        while asks or probes:
            done, _ = ray.wait([*asks, *probes], num_returns=1, timeout=self._next_deadline(sent, probes))
            for ref in self._overdue(sent, probes, done):
                sent.pop(ref)
                self.hung(worker := asks.pop(ref))
                probes[worker.ready.remote()] = worker
            if not done:
                continue
            (ref,) = done
            if ref in probes:
                if (back := self._probed(ref, probes)) is not None:
                    ask(back)
                continue
            worker = asks.pop(ref)
            sent.pop(ref)
            try:
                answers[id(worker)] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self.died(worker, f"was lost while asked for {what} ({type(exc).__name__})")
                probes[worker.ready.remote()] = worker
        return answers

    def placement(self) -> list[str | None]:
        """Each worker's node, in order (None for one Ray gave up on before it answered)."""
        return [self.node_of[id(worker)] for worker in self.workers]

    def spread_line(self) -> str:
        """``ray eval: N workers on M node(s): n on <node>, …`` for the console."""
        nodes = Counter(self.placement())
        return f"ray eval: {len(self.workers)} workers on {len(nodes)} node(s): " + ", ".join(
            f"{n} on {(node or 'unknown')[:12]}" for node, n in nodes.items())  # fmt: skip

    def _next_worker(self, idle: deque, open_on: Counter | None) -> Any:
        """An idle worker to hand the next shard to (for a sandboxed task under ``max_sandboxes``, one on a node where
        fewer are in flight), or None."""
        for worker in idle:
            if open_on is None or self.max_sandboxes is None or open_on[self.node_of[id(worker)]] < self.max_sandboxes:
                idle.remove(worker)
                return worker
        return None

    def load(self, path: str, version: int) -> None:
        """Every worker holds checkpoint ``version``'s weights (read from its folder ``path``) before its next shard; one Ray
        is restarting (or gave up on) is passed over: it refuses its next shard (:class:`StaleWeights`) and is loaded again then."""
        self.weights = (path, version)
        calls = [worker.load_checkpoint.remote(path, version) for worker in self.workers]
        done, _ = self.ray.wait(calls, num_returns=len(calls), timeout=self.call_s)
        for worker, call in zip(self.workers, calls, strict=True):
            if call not in done:  # hung: killed for Ray to restart; its next shard fails, is re-queued, and it loads again once back
                self.hung(worker)
                continue
            try:
                ray_get(self.ray, call)
            except self.ray.exceptions.RayActorError:
                pass

    def run(
        self, task: Task, shards: dict[int, list[Problem]], *, k: int, sampling: SamplingParams
    ) -> Iterator[tuple[int, list[SampleRow], list]]:
        ray = self.ray
        pending, idle, attempts = deque(shards), deque(self.workers), Counter()
        inflight: dict[Any, tuple[int, Any]] = {}  # shard call -> (shard, worker)
        sent: dict[Any, float] = {}  # shard call -> when it was sent (``trainer.actor_timeout_s`` counts from then)
        probes: dict[Any, Any] = {}  # ``ready`` call -> a worker that died or hung, until it is back
        for worker in self.workers:  # hung or dead in an earlier evaluation (or a checkpoint's load) and not back yet
            if id(worker) in self.down:
                idle.remove(worker)
                probes[worker.ready.remote()] = worker
        open_on: Counter | None = Counter() if task.needs_sandbox else None  # node -> this task's shards in flight there
        try:
            while pending or inflight:
                while pending and (worker := self._next_worker(idle, open_on)) is not None:
                    index = pending.popleft()
                    version = self.weights[1] if self.weights is not None else None
                    call = worker.run_shard.remote(task.name, shards[index], k, sampling, index, version)
                    inflight[call], sent[call] = (index, worker), time.monotonic()
                    if open_on is not None:
                        node = self.node_of[id(worker)]
                        open_on[node] += 1
                        self.peak_sandboxes[node] = max(self.peak_sandboxes[node], open_on[node])
                if not inflight and not probes:
                    raise self.fatal(f"{task.name}: every evaluation worker died for good ({len(pending)} shards left)")
                done, _ = ray.wait([*inflight, *probes], num_returns=1, timeout=self._next_deadline(sent, probes))
                for ref in self._overdue(sent, probes, done):  # a shard's worker hung (a restart past its limit raised)
                    index, worker = inflight.pop(ref)
                    sent.pop(ref)
                    if open_on is not None:
                        open_on[self.node_of[id(worker)]] -= 1
                    self.hung(worker)
                    self._requeue(task, index, attempts, pending, f"{self.names[id(worker)]} hung (no answer within "
                                  f"{self.faults.call_key}={self.call_s:g}s; killed for Ray to restart)")  # fmt: skip
                    probes[worker.ready.remote()] = worker
                if not done:
                    continue
                (ref,) = done
                if ref in probes:
                    if (back := self._probed(ref, probes)) is not None and self._locate([back]):  # restarted, maybe elsewhere
                        if self.weights is not None:  # restarted: it holds the student's first weights, not the checkpoint's
                            back.load_checkpoint.remote(*self.weights)
                        idle.append(back)
                    continue
                index, worker = inflight.pop(ref)
                sent.pop(ref)
                if open_on is not None:  # finished or lost: its worker closed its sandbox (a killed one's are reaped on restart)
                    open_on[self.node_of[id(worker)]] -= 1
                try:
                    rows = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    error = task_error(ray, exc)
                    if not isinstance(error, StaleWeights) or self.weights is None:
                        raise error from None
                    self._requeue(task, index, attempts, pending, "lost its checkpoint's weights (restarted)")
                    worker.load_checkpoint.remote(*self.weights)  # runs before its next shard (one call at a time, in order)
                    idle.append(worker)
                    continue
                except ray.exceptions.RayActorError as exc:  # the worker died (Ray restarts it): the shard goes back
                    self.died(worker, f"was lost with {task.name} shard {index} ({type(exc).__name__})")
                    self._requeue(task, index, attempts, pending, f"died ({type(exc).__name__})")
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

    def _next_deadline(self, sent: dict[Any, float], probes: dict[Any, Any]) -> float | None:
        """Seconds until the first shard call passes ``call_s`` or the first restarting worker passes ``restart_s`` (None:
        no bound, wait for the next answer)."""
        deadlines = [at + self.call_s for at in sent.values()] if self.call_s is not None else []
        if self.restart_s is not None:
            deadlines += [self.down[id(worker)] + self.restart_s for worker in probes.values() if id(worker) in self.down]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _overdue(self, sent: dict[Any, float], probes: dict[Any, Any], done: list[Any]) -> list[Any]:
        """The shard calls past ``call_s`` (not among ``done``, answered just now); raises :meth:`lost` for a worker whose
        restart is past ``restart_s``."""
        now = time.monotonic()
        late = [ref for ref, worker in probes.items()
                if self.restart_s is not None and now - self.down.get(id(worker), now) >= self.restart_s]  # fmt: skip
        for ref in self._unanswered(late, done):
            raise self.lost(probes[ref], f"did not come back within {self.faults.restart_key}={self.restart_s:g}s "
                            "(restarted after it died or hung)")  # fmt: skip
        return self._unanswered([ref for ref, at in sent.items() if self.call_s is not None and now - at >= self.call_s], done)

    def _unanswered(self, refs: list[Any], done: list[Any]) -> list[Any]:
        """Those of ``refs`` neither among ``done`` nor answered by now (one that answered while the driver was busy
        elsewhere, e.g. asking a restarted worker for its node, is not late)."""
        refs = [ref for ref in refs if ref not in done]
        if not refs:
            return []
        answered, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        return [ref for ref in refs if ref not in answered]

    def _probed(self, ref: Any, probes: dict[Any, Any]) -> Any:
        """A dead worker's ``ready`` answered: the worker once restarted, None (probed again) while restarting, None and
        dropped when Ray gave up on it (or it cannot load the model again)."""
        ray, worker = self.ray, probes.pop(ref)
        try:
            failure = ray.get(ref)
        except ray.exceptions.ActorDiedError:
            self.down.pop(id(worker), None)
            return None
        except ray.exceptions.RayActorError:  # still restarting
            time.sleep(PROBE_INTERVAL_S)
            probes[worker.ready.remote()] = worker
            return None
        self.down.pop(id(worker), None)
        return worker if failure is None else None

    def _requeue(self, task: Task, index: int, attempts: Counter, pending: deque, what: str) -> None:
        """Shard ``index`` (its worker ``what``) back to the front of the queue, or :class:`EvalWorkersFailed` when that
        happened to it :data:`MAX_SHARD_ATTEMPTS` times (something kills every attempt)."""
        attempts[index] += 1
        if attempts[index] >= MAX_SHARD_ATTEMPTS:
            raise self.fatal(f"{task.name} shard {index}: its evaluation worker {what} {attempts[index]} times") from None
        self.requeued += 1
        self.console.print(f"[yellow]warning:[/] {task.name} shard {index}: evaluation worker {what}; shard re-queued")
        pending.appendleft(index)


def spread(index: int, gpus: float = 0.0) -> dict[str, Any]:
    """Placement of ``harness eval``'s workers: one CPU and ``gpus`` GPUs (``--gpus-per-worker``) each, spread over the
    cluster's nodes (Ray's SPREAD strategy)."""
    return {"num_cpus": WORKER_THREADS, "num_gpus": gpus, "scheduling_strategy": "SPREAD"}


def start_workers(
    ray: ModuleType, spec: EvalWorkerSpec, count: int, console: Console, *, threads: int = WORKER_THREADS,
    placed: Callable[[int], dict[str, Any]] = spread, gpu_key: str = "--gpus-per-worker", faults: Faults | None = None,
) -> list[Any]:
    """``count`` workers, worker i placed by ``placed(i)``, each restarted when it dies. :class:`DeviceUnavailable`
    (naming ``gpu_key``) when a worker was given GPUs its torch cannot see; with ``faults`` (a training run's),
    :class:`ActorLost` naming the worker and its node when one has not started within ``trainer.actor_restart_timeout_s``."""
    workers = [
        ray.remote(EvalWorker).options(max_concurrency=1, max_restarts=MAX_RESTARTS, max_task_retries=0, **placed(i))
        .remote(spec, threads, gpu_key)
        for i in range(count)
    ]  # fmt: skip
    try:
        answers = ray.get([w.ready.remote() for w in workers]) if faults is None else await_started(
            ray, workers, replica_names("eval", count), faults)  # fmt: skip
    except BaseException:
        stop_workers(ray, workers, console)
        raise
    failures = [f for f in answers if f]
    if failures:
        device = next((p for p in ray.get([w.device_problem.remote() for w in workers]) if p), None)
        stop_workers(ray, workers, console)
        if device:
            raise DeviceUnavailable(device)
        raise RuntimeError(f"an evaluation worker could not load --model {spec.model!r}: {failures[0]}")
    return workers


def stop_workers(ray: ModuleType, workers: list[Any], console: Console) -> None:
    """Close every worker's tasks and engine (their sandbox containers), then kill them."""
    try:
        ray.get([w.close.remote() for w in workers], timeout=CLOSE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - a dead or stuck worker must not keep the others alive
        console.print(f"[yellow]warning:[/] evaluation workers did not close cleanly ({type(exc).__name__}); killing them")
    for worker in workers:
        ray.kill(worker, no_restart=True)


class CheckpointShards:
    """A training run's checkpoint evaluations on its evaluation workers (``Session.shard_runner``): every worker reads the
    student's weights at a step from that step's folder once, then that step's shards run on them."""

    def __init__(self, ray: ModuleType, shards: RayShards) -> None:
        self.ray, self.shards = ray, shards

    def __call__(self, path: str, step: int) -> RayShards:
        if self.shards.weights != (path, step):
            self.shards.load(path, step)
        return self.shards


def eval_faults(actor_timeout: float | None, actor_restart_timeout: float | None) -> Faults | None:
    """``harness eval``'s bounds on its workers: None (unbounded: a shard of agent episodes may take hours) unless
    ``--actor-timeout`` (each shard call) or ``--actor-restart-timeout`` (each start-up and restart; 300 s when only
    ``--actor-timeout`` is given) is; its lines name those flags."""
    if actor_timeout is None and actor_restart_timeout is None:
        return None
    restart_s = RESTART_TIMEOUT_S if actor_restart_timeout is None else actor_restart_timeout
    return Faults(actor_timeout, restart_s, call_key="--actor-timeout", restart_key="--actor-restart-timeout")


class RayEvalExecutor:
    """``harness eval --executor ray``: a local Ray, or the cluster at ``address``; N workers for the command. A training
    run's evaluation workers (``trainer.layout.eval``) come from :meth:`for_run`."""

    @contextmanager
    def open(
        self, spec: EvalWorkerSpec, *, workers: int, address: str | None, console: Console, max_sandboxes: int | None = None,
        gpus_per_worker: float = 0.0, actor_timeout: float | None = None, actor_restart_timeout: float | None = None,
    ) -> Iterator[RayShards]:
        """``workers`` evaluation workers, each asking Ray for ``gpus_per_worker`` GPUs (``--gpus-per-worker``). With
        ``actor_timeout`` or ``actor_restart_timeout`` (``--actor-timeout``, ``--actor-restart-timeout``) they are watched as a
        training run's are (:func:`eval_faults`); a start-up past its bound is :class:`EvalWorkersFailed`."""
        spec = dataclasses.replace(spec, sandbox_per_shard=max_sandboxes is not None)
        faults = eval_faults(actor_timeout, actor_restart_timeout)
        with ray_runtime(address, WORKER_THREADS, console, cpus=workers * WORKER_THREADS) as ray:
            try:
                started = start_workers(ray, spec, workers, console, placed=lambda i: spread(i, gpus_per_worker), faults=faults)
            except ActorLost as exc:  # no run to fail: the eval's own infrastructure error
                raise EvalWorkersFailed(str(exc)) from None
            try:
                shards = RayShards(ray, started, console, max_sandboxes, faults=faults)
                console.print(shards.spread_line())
                yield shards
            finally:
                stop_workers(ray, started, console)

    def shards(self, ray: ModuleType, actors: list[Any], console: Console, faults: Faults | None = None,
               names: list[str] | None = None) -> RayShards:  # fmt: skip
        """A shard queue over actors that already run (a training run's teacher actors, for its reference evaluation,
        named ``names`` and bounded by the run's ``faults``)."""
        return RayShards(ray, actors, console, faults=faults, names=names)

    @contextmanager
    def for_run(
        self, ray: ModuleType, plan, session, groups: dict[str, Any], placement: dict[str, Any], console: Console
    ) -> Iterator[None]:
        """``trainer.layout.eval.replicas`` workers, worker i in bundle i of the eval role's placement group (without
        ``trainer.layout.eval``: one worker asking for no CPU, where Ray puts it), each loading the student from its folder,
        with the run's eval tasks; the session's checkpoint evaluations run their shards there while the run lasts, each
        worker reading a checkpoint's weights from its folder. Their nodes go into ``placement`` as ``eval`` (``eval.0``,
        ``eval.1``, … for several), their GPU ids under ``gpus``. A worker that does not see the run folder stops the run
        (exit 2, before training)."""
        from opd_harness.trainers.ray_executor import RUN_FOLDER_TOKEN, check_run_folder

        cfg, layout = plan.config, plan.config.trainer.layout
        placed_eval = layout is not None and layout.eval is not None
        bound = layout.eval.max_sandboxes if placed_eval else None
        options = {"batch_size": cfg.trainer.generate_batch_size}  # the student as the run prepared it (its chat template too)
        if cfg.student.path is not None and cfg.trainer.enable_thinking is not None:
            options["enable_thinking"] = cfg.trainer.enable_thinking
        spec = EvalWorkerSpec("hf", session.student_path, options, cfg.task_args, sandbox_per_shard=bound is not None)
        if placed_eval:
            placed, replicas = (lambda i: placement_options(layout, groups, "eval", i)), layout.eval.replicas
        else:
            placed, replicas = (lambda i: {"num_cpus": 0}), 1
        faults = Faults(cfg.trainer.actor_timeout_s, cfg.trainer.actor_restart_timeout_s, placement, session)
        workers = start_workers(ray, spec, replicas, console, threads=cfg.threads or 1, placed=placed,
                                gpu_key="trainer.layout.eval.num_gpus", faults=faults)  # fmt: skip
        try:
            folder = session.store.run_dir(session.run_id)
            token = (folder / RUN_FOLDER_TOKEN).read_text()
            check_run_folder(ray, workers, (str(folder), token), faults.call_s, "an evaluation worker")
            names = replica_names("eval", len(workers))
            shards = RayShards(ray, workers, console, bound, faults=faults, names=names)
            console.print(shards.spread_line())
            placement.update(zip(names, shards.placement(), strict=True))
            if placed_eval:  # the unplaced worker asks for no GPU: nothing to record
                gpus = placement.setdefault("gpus", {})
                devices = shards.ask_each(workers, "devices", "its GPUs")  # bounded: a hung worker restarted, a lost one named
                gpus.update((name, devices.get(id(w))) for name, w in zip(names, workers, strict=True))
            session.shard_runner = CheckpointShards(ray, shards)
            yield
        finally:
            session.shard_runner = None
            stop_workers(ray, workers, console)


RAY_EVAL = RayEvalExecutor()
