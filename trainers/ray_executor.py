"""Ray executor (``--executor ray``): the roles of a run as Ray actors, on the schedule of the async pipeline.

Rollout actors (``trainer.layout.rollout.replicas`` of them, one per bundle of the rollout placement
group, each its own copy of the student behind its own engine) generate and grade batch b with the
weights of version r, every actor fed every version it needs (an object ref to the learner's snapshot; an
hf engine loads it directly, vLLM updates its engine in memory through its weight-transfer API and checks the
load, as in process); a driver thread per actor takes units (whole batches, or prompt groups with
``trainer.rollout_unit=group``, then several in flight per actor: a threaded actor) from one shared queue;
a teacher actor scores them; a learner actor (student, optimizer,
method state; learning rates from the driver's schedule), or W data-parallel learner ranks
(``trainer.layout.learner.replicas``, :mod:`opd_harness.trainers.distributed`), trains on it and returns each version's
weights as an object in the object store. The driver runs the very loop of the in-process
executor (``opd_harness.trainers.loop``: ``Schedule``, ``RolloutWorker``, ``drive``), so max_lag,
fixed_lag, sync_every and refreshes mean the same, and records through the same ``Session``. The driver holds no
model: the run's models are prepared (built, warmed up, cached) in a Ray task (:func:`prepare_remote`) and every actor
loads its own from those folders; the driver keeps the config, the paths, the counters and the learning-rate schedule.
At a checkpoint the learner writes it into the run folder (rank 0, or under FSDP2 each rank its optimizer shard) and
the driver renames the folder and records its path; evaluations run on evaluation workers that read each checkpoint
from its folder, the teacher's reference evaluation on the teacher actors. Sync mode is this schedule with max_lag 0.
Batches go from actor to actor as object refs; the driver only sees metrics. Ray is imported here only, and this
module only when the executor is ray.

Results match the in-process executor for the same seed: sampling for batch b depends only on
(seed, b, weights), not on the actor that runs it, every role runs torch with the run's thread count
(``threads``, default 1), and whenever the schedule is deterministic (``fixed_lag``, or ``max_lag`` 0)
so are the losses, with any number of rollout actors.

Devices: every actor takes its device from the GPUs Ray assigned it (``ray.get_gpu_ids()``, from its role's
``trainer.layout.<role>.num_gpus``): ``cuda`` (the first of them, as Ray's ``CUDA_VISIBLE_DEVICES`` numbers them) when it
has some, else ``cpu``; an actor given GPUs that its torch cannot see stops the run before training (exit 2, naming the
role's key). Models cross process boundaries as folders (the prepared models, the checkpoints: the run folder must be
visible at the same path on every node, checked before training) or CPU tensors (weight versions). Each actor's GPU ids
go into the run's placement.

Faults: a rollout actor that dies (its process killed) is restarted by Ray (``ROLLOUT_RESTARTS``); the
driver re-queues the units it had in flight (only those) and reloads its weights, so no step is lost or trained
twice. A call that takes longer than ``trainer.actor_timeout_s`` counts as a hung actor: a rollout or teacher actor is
killed for Ray to restart (and treated as dead), a learner rank fails the run; evaluation workers are bounded the same
way (:mod:`opd_harness.trainers.ray_eval`). A start-up or restart slower than
``trainer.actor_restart_timeout_s``, or a role whose node died, ends the run ``failed`` with one line naming the role
and the node (:class:`ActorLost`); ``--resume`` continues from the last checkpoint. Teacher actors
(``trainer.layout.teacher.replicas``) sit behind one chooser (:class:`TeacherActors`): each batch goes to the replica
with the fewest batches in flight, and one that dies is restarted by Ray while its batch is scored by another. An error
raised inside an actor (e.g. ``TeacherFailed``) reaches the driver as itself, not wrapped in Ray's ``RayTaskError``.
"""

from __future__ import annotations

import copy
import json
import secrets
import math
import os
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from types import ModuleType
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from opd_harness.errors import TrainingAborted
from opd_harness.registry import EVAL_EXECUTORS
from opd_harness.trajectory import TensorBatch, concat_batches
from opd_harness.task import close_tasks
from opd_harness.config import LAYOUT_ROLES, ConfigError, Layout, RoleLayout
from opd_harness.trainers.checkpoint import (OPTIMIZER_FILE, OPTIMIZER_SHARDS, load_optimizer_state, read_state, save_sharded_optimizer,
                                             set_rng_state, write_state)
from opd_harness.trainers.distributed import Shard, backend_for, collective_deadline, data_parallel, full_weights, join_group
from opd_harness.trainers.distributed import rendezvous_port
from opd_harness.registry import WEIGHT_SYNCS
from opd_harness.trainers.loop import MAX_ROLLOUT_LOSSES, LearnResult, Roles, RolloutLost, Unit, WeightBoard, batch_units, unit_problems
from opd_harness.trainers.weight_sync import (ABORT_GRACE_S, GroupHost, NotStaged, Published, WeightLayout, SyncGroup, checksum,
                                              engine_dtype, layout_of, rollout_copy, state_bytes)
from opd_harness.trainers.pipeline import (
    PreparedModels,
    Session,
    _optimizer_factory,
    close_rollout_backend,
    generate_batch,
    learn,
    load_rollout_weights,
    needs_teacher,
    open_behaviour_scorer,
    open_rollout_backend,
    prepare_models,
    response_lengths,
    sample_problems,
    teacher_phase,
)
from opd_harness.trainers.teacher import open_remote_teacher, output_head, wrap_hf_teacher
from opd_harness.trainers.warmup import load_prepared

# A local Ray started by the harness: no auth token file in ~/.ray (auth is on by default in Ray 2.60), no usage reporting.
RAY_ENV_DEFAULTS = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
OBJECT_STORE_BYTES = 512 * 2**20  # caps /dev/shm use of a local Ray
ROLES = 3  # rollout, teacher, learner
CLOSE_TIMEOUT_S = 60.0  # how long the actors get to release their tasks' sandboxes before they are killed
PLACEMENT_TIMEOUT_S = 60.0  # how long a role's placement group may take to be reserved before the layout is refused
PLACED_ROLES = tuple(role for role in LAYOUT_ROLES if role != "eval")  # roles every layout places (eval: only when it is given)
ROLLOUT_RESTARTS = MAX_ROLLOUT_LOSSES  # Ray restarts a dead rollout actor this often; the driver re-queues its batch
RESTART_TIMEOUT_S = 300.0  # default of trainer.actor_restart_timeout_s: how long a dead actor may take to come back
RAYLET_PROBE_S = 3.0  # how long a node's raylet may take to accept a connection before the node counts as lost
NODE_GRACE_S = 10.0  # after a learner rank fails: how long Ray may take to report its node dead before the failure is the rank's
TEACHER_RESTARTS = 3  # Ray restarts a dead teacher actor this often; its batch is scored by another replica meanwhile
# pack/spread are soft (best effort, never unschedulable for the strategy alone); strict_* are Ray's hard versions
STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}
LAYOUT_KEYS = {"CPU": "num_cpus", "GPU": "num_gpus"}


def import_ray() -> ModuleType:
    """Ray, with this project's environment defaults set first (variables already set win)."""
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import ray
    except ImportError:
        raise RuntimeError("--executor ray needs Ray, which is not installed; install it with: pip install 'opd-harness[ray]'") from None
    return ray


class LayoutError(ConfigError):
    """A layout the cluster cannot hold (exit 2), named by its role's key and the missing resource."""


def role_bundle(spec: RoleLayout) -> dict[str, float]:
    """One replica's Ray resource request: CPUs, GPUs and custom resources (zero amounts left out)."""
    bundle = {"CPU": spec.num_cpus, "GPU": spec.num_gpus, **spec.resources}
    return {name: amount for name, amount in bundle.items() if amount > 0}


def _layout_key(role: str, resource: str) -> str:
    return f"trainer.layout.{role}." + LAYOUT_KEYS.get(resource, f"resources.{resource}")


def placed_roles(layout: Layout) -> tuple[str, ...]:
    """The roles ``layout`` places: rollout, teacher and learner, and eval when the layout gives it (evaluation workers)."""
    return PLACED_ROLES + (("eval",) if layout.eval is not None else ())


def layout_shortfall(layout: Layout, nodes: list[dict]) -> str | None:
    """Why the alive nodes can never hold some role: no node holds one replica (key, resource, the most any node has),
    or too few nodes / no node big enough for its strict strategy; None when they can."""
    capacity = [node["Resources"] for node in nodes if node.get("Alive")]
    for role in placed_roles(layout):
        spec = getattr(layout, role)
        bundle = role_bundle(spec)
        for resource, amount in bundle.items():
            most = max((node.get(resource, 0.0) for node in capacity), default=0.0)
            if most < amount:
                return (f"{_layout_key(role, resource)}: a {role} replica asks for {amount:g} {resource}, but no node of the cluster "
                        f"has that much (the most on one node: {most:g})")  # fmt: skip
        holding = _nodes_holding(bundle, 1, capacity)
        if not holding:
            return f"trainer.layout.{role}: no single node of the cluster has all of {bundle} (one replica runs on one node)"
        strict = _strict_shortfall(spec, bundle, holding, capacity)
        if strict:
            return f"trainer.layout.{role}.strategy={strict}"
    return None


def _nodes_holding(bundle: dict[str, float], copies: int, capacity: list[dict[str, float]]) -> int:
    """How many nodes have room for ``copies`` of ``bundle`` (total resources, not what is free now)."""
    return sum(all(node.get(r, 0.0) >= copies * a for r, a in bundle.items()) for node in capacity)


def _strict_shortfall(spec: RoleLayout, bundle: dict[str, float], holding: int, capacity: list[dict[str, float]]) -> str | None:
    """Why a strict strategy can never be reserved on these nodes, ``holding`` of which hold one replica (too few for
    strict_spread, none big enough for strict_pack), or None."""
    if spec.strategy == "strict_spread" and spec.replicas > holding:
        return f"strict_spread: {spec.replicas} replicas need as many nodes, but only {holding} can hold one {bundle}"
    if spec.strategy == "strict_pack" and not _nodes_holding(bundle, spec.replicas, capacity):
        return f"strict_pack: no single node of the cluster can hold all {spec.replicas} replicas of {bundle}"
    return None


def local_cpus(layout: Layout | None, threads: int) -> int:
    """Logical CPUs of a local Ray: one per role thread, or what the layout's placed roles ask for, whichever is more."""
    if layout is None:
        return ROLES * threads
    asked = sum(getattr(layout, role).num_cpus * getattr(layout, role).replicas for role in placed_roles(layout))
    return max(ROLES * threads, math.ceil(asked))


def reserve_layout(ray: ModuleType, layout: Layout, timeout_s: float | None = None) -> dict[str, Any]:
    """One placement group per placed role (one bundle per replica, its strategy), reserved or :class:`LayoutError`.

    The per-node capacity is checked first, so a resource no node has is named at once; then each group must be
    reserved within ``timeout_s`` (the roles together may not fit). Nothing stays reserved on failure."""
    timeout_s = PLACEMENT_TIMEOUT_S if timeout_s is None else timeout_s
    shortfall = layout_shortfall(layout, ray.nodes())
    if shortfall:
        raise LayoutError(shortfall)
    from ray.util.placement_group import placement_group

    groups: dict[str, Any] = {}
    try:
        for role in placed_roles(layout):
            spec = getattr(layout, role)
            bundle = role_bundle(spec)
            groups[role] = placement_group([bundle] * spec.replicas, strategy=STRATEGIES[spec.strategy])
            if not groups[role].wait(timeout_seconds=timeout_s):
                free = {k: v for k, v in ray.available_resources().items() if k in bundle}
                raise LayoutError(f"trainer.layout.{role}: the cluster cannot hold {spec.replicas} × {bundle} beside the roles "
                                  f"placed before it within {timeout_s:g}s (free now: {free})")  # fmt: skip
    except BaseException:
        release_layout(ray, groups)
        raise
    return groups


def release_layout(ray: ModuleType, groups: dict[str, Any]) -> None:
    """Remove the run's placement groups (their actors are gone or go with them)."""
    from ray.util.placement_group import remove_placement_group

    for group in groups.values():
        try:
            remove_placement_group(group)
        except Exception:  # noqa: BLE001 - the cluster may be gone already; the others are still removed
            pass


def placement_options(layout: Layout | None, groups: dict[str, Any], role: str, bundle: int = 0) -> dict[str, Any]:
    """Actor options of replica ``bundle`` of ``role``: its layout's resources inside that bundle of the role's
    placement group (none without a layout)."""
    if layout is None or role not in groups:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    spec = getattr(layout, role)
    return {
        "num_cpus": spec.num_cpus,
        "num_gpus": spec.num_gpus,
        "resources": dict(spec.resources),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=groups[role], placement_group_bundle_index=bundle),
    }


@contextmanager
def ray_runtime(address: str | None, threads: int, console: Console, cpus: int | None = None) -> Iterator[ModuleType]:
    """Join Ray for a run: one already initialised (left running), the cluster at ``address``, or a new local one."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    if address:
        console.print(f"executor: ray cluster at {address}")
        ray.init(address=address)
    else:
        cpus = cpus or ROLES * threads
        console.print(f"executor: local ray ({cpus} CPUs)")
        ray.init(num_cpus=cpus, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _setup_actor(threads: int) -> None:
    """An actor process computes with the run's torch thread count (so results match in process) and quiet libraries."""
    torch.set_num_threads(threads)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.logging.set_verbosity_error()


def _plan(config: dict) -> Any:
    """Re-resolve the run's plan inside an actor from its JSON config (registries load in this process)."""
    from opd_harness.config import RunConfig
    from opd_harness.plan import plan_run

    return plan_run(RunConfig.model_validate(config))


class DeviceUnavailable(ConfigError):
    """An actor was given GPUs (its role's ``num_gpus``) that its torch cannot see: the run stops before training (exit 2)."""


def assigned_device() -> tuple[str, list[str]]:
    """This actor's torch device and the GPU ids Ray assigned it: ``cuda`` when it has some (Ray's ``CUDA_VISIBLE_DEVICES``
    makes the first of them ``cuda:0``; vLLM finds them the same way), else ``cpu``."""
    import ray

    if not ray.is_initialized():  # built outside Ray (a test, a tool): no GPUs assigned, and no local Ray started by asking
        return "cpu", []
    ids = [str(i) for i in ray.get_gpu_ids()]
    return ("cuda" if ids else "cpu"), ids


class ActorRole:
    """What every actor answers: ``ready`` returns once the constructor (imports, plan, models) is done (None, or why the
    actor cannot work: GPUs its torch cannot see); ``close`` releases what the actor's own plan holds (task sandboxes, an
    inference engine) before it is killed. ``gpu_key`` is the setting that gave the actor its GPUs (named when it fails)."""

    role = "actor"
    device = "cpu"
    gpu_ids: list[str] = []
    device_failure: str | None = None

    @property
    def gpu_key(self) -> str:
        return f"trainer.layout.{self.role}.num_gpus"

    def take_device(self) -> bool:
        """Take the device Ray assigned (:func:`assigned_device`); False, with ``device_failure`` saying why in one line,
        when Ray gave this actor GPUs that its torch cannot see (never a silent CPU run)."""
        self.device, self.gpu_ids = assigned_device()
        if self.gpu_ids and not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            self.device_failure = (
                f"{self.gpu_key}: Ray gave the {self.role} actor GPU {','.join(self.gpu_ids)} on node {self.node_id()[:12]}, but "
                f"torch there sees no CUDA device (torch {torch.__version__}, CUDA_VISIBLE_DEVICES={visible!r}); install a CUDA "
                "build of torch on that node, or ask for no GPUs"
            )
        return self.device_failure is None

    def ready(self) -> str | None:
        return self.device_failure

    def sees_run_folder(self, folder: str, token: str) -> str | None:
        """None when this actor sees the driver's ``token`` in the run folder ``folder``, else why not (one line)."""
        return run_folder_problem(folder, token, self.role)

    def devices(self) -> list[str]:
        """The GPU ids Ray assigned this actor (empty on the CPU)."""
        return list(self.gpu_ids)

    def pid(self) -> int:
        """This actor's process id (tests kill it to check restarts)."""
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this actor runs on (hex id, as ``ray.nodes()`` reports it)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        plan = getattr(self, "plan", None)
        if plan is not None:
            close_tasks([plan.task, *plan.eval_tasks])
        close_rollout_backend(getattr(self, "backend", None))


class RolloutActor(ActorRole):
    """Rollout role: the run's rollout backend, loaded from the student's folder (which the actor's node must see) on the
    actor's device, as the in-process rollout loads it; generates (and grades) batch b with weights r. Beside a non-hf
    engine the trainer's model, loaded from the same folder, recomputes π_old (``trainer.behaviour_logprobs=recompute``)."""

    role = "rollout"

    def __init__(self, config: dict, student_path: str, train_problems: list, threads: int) -> None:
        _setup_actor(threads)
        self.plan, self.train_problems = _plan(config), train_problems
        if not self.take_device():
            return
        self.backend = open_rollout_backend(self.plan, student_path, device=self.device)
        self.scorer = open_behaviour_scorer(self.plan, self.backend, student_path, device=self.device)

    def load_weights(self, weights: dict[str, torch.Tensor] | None, version: int, expected: str | None = None) -> None:
        """Load ``weights`` (None: the copy the ``collective`` transport staged for ``version``), checked against ``expected``;
        :class:`NotStaged` when this actor never received that broadcast (restarted since)."""
        if weights is None:
            staged = getattr(self, "staged", {})
            if version not in staged:
                raise NotStaged(f"rollout actor has no staged weights version {version} (restarted since it was broadcast)")
            weights = staged[version]
        load_rollout_weights(self.backend, self.scorer, weights, version, expected)

    def loaded_checksum(self) -> str:
        """A hash of every tensor the rollout engine holds (tests compare it with the learner's, bit for bit)."""
        return checksum(self.backend.model.state_dict(), every=True)

    def weights_dtype(self) -> str:
        """The rollout engine's parameter dtype (what weights are sent in)."""
        return str(engine_dtype(self.backend)).removeprefix("torch.")

    def sync_join(self, address: str, port: int, rank: int, world: int, timeout_s: float, generation: int = 1) -> int:
        """Join generation ``generation`` of the ``collective`` transport's group as ``rank`` (rank 0 is the learner's
        rank 0), leaving the one before; the versions staged so far stay."""
        leave_group(self)
        self.staged = getattr(self, "staged", {})
        self.sync_group = SyncGroup(address, port, rank, world, self.device, timeout_s)
        self.generation = generation
        return generation

    def sync_generation(self) -> int:
        """The weight group this actor is in (0: none, e.g. restarted since the group formed)."""
        return getattr(self, "generation", 0) if getattr(self, "sync_group", None) is not None else 0

    def receive_weights(self, version: int, layout: WeightLayout, keep: int) -> int:
        """Receive version ``version``'s broadcast and stage it until it is loaded (at most ``keep`` versions stay staged);
        returns ``version``. A broadcast that fails (a peer lost) leaves the group: the driver forms a new one."""
        try:
            self.staged[version] = self.sync_group.receive(layout)
        except Exception:
            leave_group(self)
            raise
        for old in [v for v in self.staged if v <= version - keep]:
            del self.staged[old]
        return version

    def generate(self, unit: Unit, version: int) -> tuple[TensorBatch, dict[str, float]]:
        """Unit ``unit`` (its share of batch ``unit.index``'s prompts) from the loaded weights, which must be ``version``
        (:class:`RolloutLost` if this actor was restarted since they were loaded); each episode's sampling is seeded by
        (seed, batch, problem, sample) only, so a unit's samples do not depend on the other units or the actor."""
        if self.backend.version != version:
            raise RolloutLost(f"rollout actor holds weights version {self.backend.version}, not {version} (restarted)")
        metrics: dict[str, float] = {}
        problems = unit_problems(sample_problems(self.plan.config, self.train_problems, unit.index), unit)
        batch, _ = generate_batch(self.plan, self.backend, problems, unit.index, metrics, self.scorer, check_errors=False)
        return batch, metrics


class TeacherActor(ActorRole):
    """Teacher role: holds the teacher (an hf teacher loaded from its prepared folder ``teacher_path``, else
    ``teacher.backend``'s engine or client, opened here), fills its log-probs (or distributions) into batches, and runs the
    shards of the teacher's reference evaluation (``eval.teacher``)."""

    role = "teacher"

    def __init__(self, config: dict, teacher_path: str | None, student_path: str, threads: int) -> None:
        _setup_actor(threads)
        self.plan, self.tasks = _plan(config), {}
        if not self.take_device():
            return
        spec = self.plan.config.teacher
        if teacher_path is not None:
            model, tokenizer = load_prepared(spec, teacher_path, self.plan.config.trainer.enable_thinking)
            trainer = self.plan.config.trainer
            options = {"device": self.device, "score_tokens": trainer.forward_tokens, "score_chunk": trainer.vocab_chunk,
                       **spec.backend_options}  # fmt: skip
            self.backend = wrap_hf_teacher(model, tokenizer, trainer.generate_batch_size, options)
        else:
            self.backend = open_remote_teacher(spec, student_path)

    def score(self, batch: TensorBatch, metrics: dict[str, float], index: int | None = None) -> tuple[TensorBatch, dict[str, float]]:
        teacher_phase(self.plan, self.backend, batch, metrics, step=index)
        return batch, metrics

    def output_head(self) -> torch.nn.Module | None:
        """A frozen CPU copy of the teacher's output head (what the learner applies to a full signal's states); None from an
        actor that could not take its device (the run then stops on its ``ready`` line, not in the learner's constructor)."""
        return head_copy(self.backend) if self.device_failure is None else None

    def run_shard(self, task: str, problems: list, k: int, sampling: Any, index: int, version: int | None = None) -> list:
        """Shard ``index`` of the teacher's reference evaluation on ``task``: its graded rows (as an evaluation worker's)."""
        from opd_harness.evaluation import evaluate_shard
        from opd_harness.plan import make_task

        if task not in self.tasks:
            made = make_task(task, self.plan.config.task_args)
            made.load("test", None)  # the data folder as the run's tasks find it (task_args, $HARNESS_DATA_DIR)
            made.check_ready()
            self.tasks[task] = made
        rows, _ = evaluate_shard(self.backend, self.tasks[task], problems, k=k, sampling=sampling, index=index, show_progress=False)
        return rows

    def close(self) -> None:
        close_tasks(self.tasks.values())
        super().close()


class LearnerActor(ActorRole):
    """Learner role: student, optimizer and method state; one optimizer step per batch at the driver's learning rates.

    Each rank loads the student itself, on its device: from the prepared folder ``student_path``, or with ``checkpoint``
    (a resumed run) from that checkpoint folder, optimizer, method state and RNG included. One of ``world`` data-parallel
    ranks when ``world`` > 1: after :meth:`join` every rank trains its shard of each global batch in one torch.distributed
    group (:mod:`opd_harness.trainers.distributed`); all ranks then hold the same weights, optimizer and method state. With
    ``sharding`` fsdp2 each rank holds a shard of them, and reading the weights is a collective: the driver calls every
    rank, rank 0 returns the full tensors. Checkpoints are written here (:meth:`write_checkpoint`), never by the driver."""

    role = "learner"

    def __init__(
        self, config: dict, student_path: str, checkpoint: str | None, threads: int, rank: int = 0, world: int = 1,
        teacher_head: torch.nn.Module | None = None,
    ) -> None:  # fmt: skip
        _setup_actor(threads)
        self.plan = _plan(config)
        self.rank = rank
        if not self.take_device():
            return
        self.model, self.tokenizer, self.optimizer, self.method_state = load_learner(self.plan, student_path, checkpoint, self.device)
        self.teacher_head = teacher_head.to(self.device) if teacher_head is not None else None  # the full signal's output head
        self.shard = Shard(rank, world) if world > 1 else None
        layout = self.plan.config.trainer.layout
        self.sharding = layout.learner.sharding if layout is not None and world > 1 else "ddp"
        self.trained = self.model  # the DDP wrapper once the rank has joined its group (FSDP2 shards the model in place)
        self.timeout_s = self.plan.config.trainer.collective_timeout_s  # the group's: a collective waiting longer fails the step

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's node address and a free port on it: where the group's ranks meet."""
        import ray

        return ray.util.get_node_ip_address(), rendezvous_port()

    def join(self, address: str, port: int) -> str:
        """Join the learner ranks' process group at ``address:port`` and wrap the model in DDP (or shard it with FSDP2,
        the optimizer rebuilt over the shards); returns the backend."""
        backend = backend_for(self.model)
        with collective_deadline(self.timeout_s):
            join_group(address, port, self.shard, backend, timeout_s=self.timeout_s)
            self.trained, self.optimizer = data_parallel(self.model, self.optimizer, self.sharding)
        return backend

    def pid(self) -> int:
        return os.getpid()

    def train(self, version: int, lrs: list[float], *parts: TensorBatch) -> LearnResult:
        """Train at learner version ``version`` with the learning rates of the driver's schedule (its ``Session`` steps it),
        on the batch made of ``parts`` (its units in group order; Ray resolves each ref)."""
        batch = concat_batches(list(parts))
        if self.shard is not None and batch.shape[0] < self.shard.world:
            raise ValueError(f"a batch of {batch.shape[0]} samples cannot be split over trainer.layout.learner.replicas="
                             f"{self.shard.world} ranks (each needs at least one)")  # fmt: skip
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        metrics: dict[str, float] = {}
        with collective_deadline(self.timeout_s):  # the driver names this rank and the step (RayLearner._failure_line)
            learn(self.plan, self.trained, self.optimizer, batch, self.method_state, version, metrics, shard=self.shard,
                  teacher_head=self.teacher_head)  # fmt: skip
        return LearnResult(metrics, batch.policy_lag.tolist(), response_lengths(batch))

    def rollout_weights(self, dtype: str) -> dict[str, torch.Tensor]:
        """One CPU copy of the full weights in the rollout dtype (fsdp2: every rank must be called; the others get {})."""
        with collective_deadline(self.timeout_s):
            state = full_weights(self.model) if self.sharding == "fsdp2" else self.model.state_dict()
        return rollout_copy(state, getattr(torch, dtype)) if state else {}

    def publish_weights(self, dtype: str) -> tuple[dict[str, torch.Tensor], tuple[str, int]]:
        """``object_store``: the copy (left in the object store) and its (checksum, bytes)."""
        weights = self.rollout_weights(dtype)
        return weights, (checksum(weights), state_bytes(weights))

    def weight_layout(self, dtype: str) -> WeightLayout:
        """``collective``: names, shapes and dtypes of the broadcast, in its order."""
        return layout_of(self.rollout_weights(dtype))

    def sync_host(self, address: str, port: int, world: int, timeout_s: float) -> None:
        """``collective``: host a new weight group (not the learners' data-parallel group) at ``address:port``, leaving the
        one before, and join it as rank 0 in the background (:class:`GroupHost`): this returns at once, so the driver can
        :meth:`sync_abort` the forming group when a member is lost; :meth:`sync_formed` says how it ended."""
        leave_group(self)
        self.sync_pending = GroupHost(address, port, world, self.device, timeout_s)

    def sync_formed(self, wait_s: float) -> str | None:
        """None once rank 0 is in the group hosted last, or why it is not (a member lost: the driver forms another)."""
        pending = getattr(self, "sync_pending", None)
        if pending is None:
            return "no weight group is being formed"
        done, error = pending.formed(wait_s)
        if not done:
            return f"rank 0 did not join within {wait_s:g}s"
        if error is None:
            self.sync_group = pending.group
        return error

    def sync_abort(self) -> None:
        """Stop the forming group's store: the members still joining fail at once (a member was lost)."""
        pending = getattr(self, "sync_pending", None)
        if pending is not None:
            pending.abort()

    def broadcast_weights(self, dtype: str, version: int, keep: int) -> tuple[str, int, str | None]:
        """``collective``: broadcast the weights in the rollout dtype to the rollout actors; (checksum, bytes, None), or
        why the broadcast failed (a rollout actor lost: the group is left, the driver forms another and sends again).
        The copy is kept while the weight board may hand out ``version`` (``keep`` versions), for a restarted actor."""
        weights = self.rollout_weights(dtype)
        if not weights:  # an fsdp2 rank other than 0: it only took part in the gather
            return "", 0, None
        self.kept = {v: w for v, w in getattr(self, "kept", {}).items() if v > version - keep}
        self.kept[version] = weights
        try:
            return checksum(weights), self.sync_group.send(weights), None
        except Exception as exc:  # noqa: BLE001 - a peer lost mid-broadcast; the learner is fine
            leave_group(self)
            return checksum(weights), 0, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"

    def staged_copy(self, version: int) -> dict[str, torch.Tensor]:
        """``collective``: the kept copy of weights ``version``, for a rollout actor restarted since its broadcast."""
        return self.kept[version]

    def write_checkpoint(self, folder: str, small: dict) -> None:
        """Write this learner's checkpoint into ``folder`` (the driver renames it into place): rank 0 writes the model and
        tokenizer, ``trainer_state.pt`` (``small``, the method state, its RNG) and, unsharded, ``optimizer.pt``; under
        fsdp2 every rank must be called: the full weights are gathered onto rank 0 (the model files), and each rank
        writes its own shard of the optimizer state (torch.distributed.checkpoint, ``optimizer/``)."""
        folder_path = Path(folder)
        extra = {"method_state": self.method_state.state_dict()} if self.method_state is not None else {}
        with collective_deadline(self.timeout_s):
            if self.sharding == "fsdp2":
                weights = full_weights(self.model)
                save_sharded_optimizer(folder_path / OPTIMIZER_SHARDS, self.model, self.optimizer)
                if self.rank == 0:
                    self.model.save_pretrained(str(folder_path), state_dict=weights)
            elif self.rank == 0:
                self.model.save_pretrained(str(folder_path))
                torch.save(self.optimizer.state_dict(), folder_path / OPTIMIZER_FILE)
        if self.rank == 0:
            self.tokenizer.save_pretrained(str(folder_path))
            write_state(folder_path, {**small, "extra": extra})

    def sees_run_folder(self, folder: str, token: str) -> str | None:
        """Whether this rank can read the driver's token in the run folder and write there (it writes checkpoints)."""
        problem = run_folder_problem(folder, token, self.role + (f" rank {self.rank}" if getattr(self, "shard", None) else ""))
        if problem is None:
            try:
                probe = Path(folder) / f".write-probe-{os.getpid()}"
                probe.write_text(token)
                probe.unlink()
            except OSError as exc:
                problem = f"the run folder {folder} is not writable from node {self.node_id()[:12]} (learner: {exc.strerror})"
        return problem


def leave_group(actor: Any) -> None:
    """Close the actor's ``collective`` weight group, if it is in one (its peers' calls then fail at once), and the store
    of the one it hosts (the learner's rank 0)."""
    group = getattr(actor, "sync_group", None)
    actor.sync_group = None
    if group is not None:
        group.close()
    pending = getattr(actor, "sync_pending", None)
    actor.sync_pending = None
    if pending is not None:
        pending.abort()


def _succeeded(ray: ModuleType, ref: Any) -> bool:
    """Whether a finished call returned (rather than raised, or its actor died)."""
    try:
        ray.get(ref)
    except Exception:  # noqa: BLE001 - any failure counts
        return False
    return True


def ray_get(ray: ModuleType, refs: Any, **options: Any) -> Any:
    """``ray.get``, with an error raised inside an actor re-raised as itself (its type and message, one line for
    the user) instead of Ray's ``RayTaskError`` wrapping its remote traceback."""
    try:
        return ray.get(refs, **options)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, Exception):  # a task that failed on a dead actor's result carries that actor's error
            raise exc.cause from None
        raise


class ActorLost(TrainingAborted):
    """A rollout or teacher actor that did not come back within ``trainer.actor_restart_timeout_s``, or a role whose node
    died: the run stops ``failed`` with one line naming the role and its node; its last checkpoint resumes."""


def resume_hint(session: Session | None) -> str:
    """Where the run continues from, and the command: ``continue from its last checkpoint (step N) with: harness run --resume …``."""
    if session is None:
        return ""
    checkpoints = session.store.checkpoints(session.run_id)
    last = f"its last checkpoint (step {checkpoints[-1]['step']})" if checkpoints else "the start (no checkpoint yet)"
    return f"; continue from {last} with: harness run --resume {session.run_id} --out {session.store.root}"


@dataclass
class Faults:
    """How the driver side of the actors treats a hung call, a slow restart and a lost node.

    ``call_s`` bounds every call to a rollout, teacher or learner actor (``trainer.actor_timeout_s``; None: unbounded),
    ``restart_s`` a dead actor's restart (``trainer.actor_restart_timeout_s``). ``placement`` (role → node id, filled when
    the actors are ready) names the node of a role that is lost; ``session`` gives the resume line."""

    call_s: float | None = None
    restart_s: float = RESTART_TIMEOUT_S
    placement: dict[str, Any] = field(default_factory=dict)
    session: Session | None = None
    call_key: str = "trainer.actor_timeout_s"  # the settings a line names when a bound is passed (harness eval: its flags)
    restart_key: str = "trainer.actor_restart_timeout_s"

    def dead_node(self, ray: ModuleType, role: str, grace_s: float = 0.0) -> str | None:
        """The node of ``role`` if it is dead (:func:`dead_nodes`; waiting up to ``grace_s``), else None."""
        node = self.placement.get(role)
        if not isinstance(node, str):
            return None
        deadline = time.monotonic() + grace_s
        while True:
            if node in dead_nodes(ray, {node}):
                return node
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.5)

    def any_dead(self, ray: ModuleType, grace_s: float = 0.0) -> tuple[str, str] | None:
        """(role, node) of the first role of the placement whose node Ray reports dead (waiting up to ``grace_s``), or None."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = dead_nodes(ray, {node for node in self.placement.values() if isinstance(node, str)})
            found = next(((role, node) for role, node in self.placement.items() if isinstance(node, str) and node in dead), None)
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(0.5)

    def lost(self, role: str, node: str | None, what: str) -> ActorLost:
        """The one-line error of a lost ``role`` (``what`` happened to it) on ``node``."""
        where = f"node {node} died" if node else f"on node {self.placement.get(role) or 'unknown'}"
        return ActorLost(f"{role} {what}; {where}" + resume_hint(self.session))

    def check_node(self, ray: ModuleType, role: str, exc: BaseException | None = None) -> None:
        """:class:`ActorLost` if ``role``'s node died (given a moment when ``exc`` is one of Ray's lost-node errors)."""
        grace = NODE_GRACE_S if isinstance(exc, (*_object_lost(ray), ray.exceptions.ActorUnavailableError)) else 0.0
        node = self.dead_node(ray, role, grace)
        if node is not None:
            raise self.lost(role, node, f"was lost ({type(exc).__name__ if exc is not None else 'node died'})") from None


def dead_nodes(ray: ModuleType, nodes: set[str]) -> set[str]:
    """Which of ``nodes`` are dead: Ray reports them so, or their raylet does not accept a connection (Ray marks a node dead
    only after its health checks fail, tens of seconds after the machine is gone)."""
    dead = set()
    for info in ray.nodes():
        node = info.get("NodeID")
        if node not in nodes:
            continue
        if not info.get("Alive"):
            dead.add(node)
            continue
        try:
            socket.create_connection((info["NodeManagerAddress"], int(info["NodeManagerPort"])), timeout=RAYLET_PROBE_S).close()
        except (OSError, KeyError, ValueError):
            dead.add(node)
    return dead


def _object_lost(ray: ModuleType) -> tuple[type, ...]:
    """Ray's errors of objects on a lost node (OwnerDiedError & co. are ObjectLostErrors): they may come before Ray has
    marked the node dead."""
    return (ray.exceptions.ObjectLostError, ray.exceptions.NodeDiedError)


class RayRollout:
    """Driver side of one rollout actor (and the teacher actors), for a ``RolloutWorker``: loads weights by ref,
    returns batch refs; a dead actor (Ray restarts it) is :class:`RolloutLost`, and its weights are reloaded. A call
    that exceeds ``faults.call_s`` means the actor hung: it is killed once for Ray to restart, then treated as dead."""

    def __init__(self, ray: ModuleType, plan, actor: Any, teacher: Any, board: WeightBoard, name: str = "rollout",
                 faults: Faults | None = None) -> None:  # fmt: skip
        self.ray, self.actor, self.teacher, self.board = ray, actor, teacher, board
        self.score = needs_teacher(plan)
        self.version = -1
        self.name, self.faults = name, faults or Faults()
        self.kills = 0  # hangs this driver side killed the actor for (each kill once, whichever of its calls saw it)
        self.recovered = 0  # versions loaded from the learner's copy after a restart (``collective``)
        self._lock = threading.Lock()

    def load(self, version: int) -> None:
        """Load ``version`` and wait for it: the actor runs several units at once, so a later call is not ordered after it.
        An actor restarted since a ``collective`` broadcast loads that version from the learner's copy instead."""
        kills, published = self.kills, self.board.get(version)
        what = f"loading weights {version}"
        try:
            self._get(self.actor.load_weights.remote(published.payload, version, published.checksum), what, kills)
        except NotStaged:
            if published.recover is None:
                raise
            self._get(self.actor.load_weights.remote(published.recover(), version, published.checksum), what, kills)
            self.recovered += 1
        self.version = version

    def hung(self, kills: int) -> None:
        """Kill the actor for Ray to restart, unless a hang seen since ``kills`` (this side's count then) killed it already."""
        with self._lock:
            if self.kills == kills:  # the first call to see the hang kills it; the others wait for the same restart
                self.kills += 1
                self.ray.kill(self.actor, no_restart=False)

    def make(self, unit: Unit) -> tuple[Any, dict[str, float]]:
        kills = self.kills
        batch, metrics = self.actor.generate.options(num_returns=2).remote(unit, self.version)
        metrics = self._get(metrics, f"batch {unit.index}" + (f" (group {unit.group})" if unit.groups > 1 else ""), kills)
        return self.teacher.score(batch, metrics, unit.index) if self.score else (batch, metrics)

    def _get(self, ref: Any, what: str, kills: int = 0) -> Any:
        """The result of a call to the actor; :class:`RolloutLost` (weights to reload) if it was restarted, died or hung
        (``kills``: the driver's kill count when the call was sent, so a hang is killed once)."""
        ray = self.ray
        try:
            return ray_get(ray, ref, timeout=self.faults.call_s)
        except RolloutLost:
            self.version = -1  # restarted before this call: it holds the initial weights, reload before the next one
            raise
        except ray.exceptions.GetTimeoutError:
            self.version = -1
            self.hung(kills)
            self.faults.check_node(ray, self.name)
            await_restart(ray, self.actor, f"a {self.name} actor hung with {what} (no answer within {self.faults.call_s:g}s)",
                          ROLLOUT_RESTARTS, self.faults, self.name)  # fmt: skip
            raise RolloutLost(f"{self.name} actor hung with {what} in flight; killed and restarted") from None
        except ray.exceptions.RayActorError as exc:
            self.version = -1  # died with the call in flight; once restarted it needs weights again
            self.faults.check_node(ray, self.name, exc)
            await_restart(ray, self.actor, f"a {self.name} actor died with {what}", ROLLOUT_RESTARTS, self.faults, self.name)
            raise RolloutLost(f"{self.name} actor lost with {what} in flight: {type(exc).__name__}") from exc
        except _object_lost(ray) as exc:  # its weights or batch were on a node that died: name that node
            found = self.faults.any_dead(ray, NODE_GRACE_S)
            if found is not None:
                raise self.faults.lost(found[0], found[1], f"was lost ({type(exc).__name__} with {what})") from None
            raise self.faults.lost(self.name, None, f"lost an object it needed for {what} ({type(exc).__name__})") from None


def await_restart(ray: ModuleType, actor: Any, what: str, restarts: int, faults: Faults | None = None, role: str = "actor") -> None:
    """Block until Ray has restarted ``actor`` (calls fail fast while it restarts); :class:`ActorLost` (one line, naming
    ``role`` and its node) if it is not back within ``faults.restart_s``, its node died, or it stays dead."""
    faults = faults or Faults()
    deadline = time.monotonic() + faults.restart_s
    while True:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise ray.exceptions.GetTimeoutError("restart deadline")
            ray.get(actor.ready.remote(), timeout=left)
            return
        except ray.exceptions.GetTimeoutError:  # the restart (imports, plan, model) or its placement takes too long
            faults.check_node(ray, role)
            limit = f"trainer.actor_restart_timeout_s={faults.restart_s:g}s"
            raise faults.lost(role, None, f"did not come back within {limit} ({what})") from None
        except ray.exceptions.ActorUnavailableError:  # restarting
            faults.check_node(ray, role)
            time.sleep(0.5)
        except ray.exceptions.RayActorError:  # dead for good: its restarts are used up
            faults.check_node(ray, role)
            raise faults.lost(role, None, f"was not restarted by Ray (at most {restarts} restarts; {what})") from None


class TeacherActors:
    """The run's teacher actors behind one chooser, shared by the rollout workers' threads: a batch goes to the replica
    with the fewest batches in flight; a replica that dies (Ray restarts it) or hangs (a call past ``faults.call_s``:
    killed for Ray to restart) has its batch scored by another, or by itself once back when every replica is down. An
    error raised in a teacher (``TeacherFailed``) stops the run as before."""

    def __init__(self, ray: ModuleType, actors: list[Any], faults: Faults | None = None) -> None:
        self.ray, self.actors = ray, actors
        self.faults = faults or Faults()
        self.names = replica_names("teacher", len(actors))
        self.inflight = [0] * len(actors)
        self.failovers = 0  # batches re-sent after their replica died
        self.kills = [0] * len(actors)  # hangs each replica was killed for
        self._lock = threading.Lock()

    def _claim(self, exclude: set[int]) -> int:
        with self._lock:
            free = [i for i in range(len(self.actors)) if i not in exclude]
            replica = min(free, key=lambda i: (self.inflight[i], i))
            self.inflight[replica] += 1
            return replica

    def score(self, batch: Any, metrics: dict[str, float], index: int) -> tuple[Any, dict[str, float]]:
        """Batch ``index`` (a ref) scored on some replica: (scored batch ref, metrics with the teacher's timing)."""
        ray, died = self.ray, set()
        while True:
            replica = self._claim(died)
            kills = self.kills[replica]
            scored, out = self.actors[replica].score.options(num_returns=2).remote(batch, metrics, index)
            try:
                return scored, ray_get(ray, out, timeout=self.faults.call_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                if isinstance(exc, ray.exceptions.GetTimeoutError):
                    with self._lock:
                        if self.kills[replica] == kills:  # hung: killed once, for Ray to restart
                            self.kills[replica] += 1
                            ray.kill(self.actors[replica], no_restart=False)
                self.faults.check_node(ray, self.names[replica], None if isinstance(exc, ray.exceptions.GetTimeoutError) else exc)
                died.add(replica)
                with self._lock:
                    self.failovers += 1
                if len(died) == len(self.actors):  # every replica is down: wait for this one to come back
                    await_restart(ray, self.actors[replica], f"a teacher actor {'hung' if kills != self.kills[replica] else 'died'} "
                                  f"with batch {index}", TEACHER_RESTARTS, self.faults, self.names[replica])  # fmt: skip
                    died.clear()
            finally:
                with self._lock:
                    self.inflight[replica] -= 1


class LearnerRankFailed(TrainingAborted):
    """A learner rank died (or its step failed): the run stops ``failed``; its last checkpoint resumes onto any number of ranks."""


class RayLearner:
    """Driver side of the learner ranks, for ``drive``: every rank trains each batch (by ref); weights as refs and the
    state pulled into the session come from rank 0. A rank that fails kills the others (they would wait for it in
    their collectives) and stops the run with :class:`LearnerRankFailed`."""

    def __init__(self, ray: ModuleType, ranks: list[Any], session: Session, sharding: str = "ddp", faults: Faults | None = None,
                 weight_sync: str = "object_store") -> None:  # fmt: skip
        self.ray, self.ranks, self.session = ray, ranks, session
        self.faults = faults or Faults(session=session)
        self.sharding = sharding
        self.sharded = sharding == "fsdp2" and len(ranks) > 1  # weights and state are then read from every rank at once
        self.killed = False
        self.sync = WEIGHT_SYNCS.get(weight_sync)
        self.rollouts: list[Any] = []  # the rollout actors weights go to (set by ``connect``)
        self.sides: list[RayRollout] = []  # their driver sides (set by the executor): a hang is killed once, by whoever sees it
        self.dtype, self.layout, self.keep, self.generation = "float32", [], 1, 0
        self.sync_failures: list[str] = []  # why weight-sync calls of the rollout actors failed (the last in an error)

    def connect(self, rollouts: list[Any], keep: int) -> None:
        """Learn the rollout dtype and let the transport set itself up (the ``collective`` group) before the first publish."""
        self.rollouts, self.keep = rollouts, keep
        self.dtype = self._get([rollouts[0].weights_dtype.remote()], "reading the rollout dtype")[0] if rollouts else "float32"
        self.sync.connect(self)

    def publish(self, version: int) -> Published:
        """Send weights ``version`` by the run's transport (``trainer.weight_sync``)."""
        return self.sync.publish(self, version)

    def settle(self, refs: list[Any], doing: str, abort: Any = None) -> list[Any]:
        """Each rollout actor's answer to a weight-sync call (``refs[i]``: actor i's), or None for one that failed (its group
        broke: it is alive), died or hung past ``trainer.actor_timeout_s`` (killed for Ray to restart); returns once the
        lost ones are back (:func:`await_restart`: :class:`ActorLost` naming the role and node if one is not). ``abort``
        (forming a group) is called at the first failure or at the timeout, so that the members still waiting for the lost
        one give up (within ``ABORT_GRACE_S``) instead of being taken for hung."""
        ray, names = self.ray, replica_names("rollout", len(self.rollouts))
        kills = [side.kills for side in self.sides]
        done = self._answered(refs, abort)
        answers: list[Any] = []
        for i, ref in enumerate(refs):
            try:
                if ref not in done:
                    raise ray.exceptions.GetTimeoutError(doing)
                answers.append(ray_get(ray, ref))
                continue
            except ray.exceptions.GetTimeoutError:
                self.sides[i].hung(kills[i]) if self.sides else ray.kill(self.rollouts[i], no_restart=False)
                what, exc = f"a {names[i]} actor hung while {doing}", None
            except ray.exceptions.RayActorError as error:
                what, exc = f"a {names[i]} actor died while {doing}", error
            except Exception as error:  # noqa: BLE001 - raised inside the actor (its group broke because a peer was lost): alive
                self.sync_failures.append(f"{names[i]}: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}")
                answers.append(None)
                continue
            self.sync_failures.append(what)
            self.faults.check_node(ray, names[i], exc)
            await_restart(ray, self.rollouts[i], what, ROLLOUT_RESTARTS, self.faults, names[i])
            answers.append(None)
        return answers

    def _answered(self, refs: list[Any], abort: Any = None) -> set[Any]:
        """The refs answered within ``trainer.actor_timeout_s`` (all of them at once without ``abort``); with ``abort``,
        called once at the first failed answer or at the timeout, then ``ABORT_GRACE_S`` more for the rest."""
        ray, call_s = self.ray, self.faults.call_s
        if abort is None:
            return set(ray.wait(refs, num_returns=len(refs), timeout=call_s)[0])
        deadline, pending, done, aborted = (time.monotonic() + call_s if call_s else None), list(refs), set(), False
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            done.update(ready)
            failed = bool(ready) and not _succeeded(ray, ready[0])
            if (failed or not ready) and not aborted:
                abort()
                aborted, deadline = True, time.monotonic() + ABORT_GRACE_S if not ready else deadline
            elif not ready:
                break
        return done

    def on_ranks(self, method: str, *args: Any, returns: int = 1) -> list[Any]:
        """Call ``method`` on rank 0, or on every rank under fsdp2 (a gather); the refs, rank 0's first."""
        readers = self.ranks if self.sharded else [self.actor]
        return [getattr(rank, method).options(num_returns=returns).remote(*args) for rank in readers]

    @property
    def actor(self) -> Any:
        return self.ranks[0]

    def train(self, parts: list[Any], version: int) -> LearnResult:
        lrs = [group["lr"] for group in self.session.optimizer.param_groups]  # set by the session's scheduler
        return self._get([rank.train.remote(version, lrs, *parts) for rank in self.ranks], f"step {version + 1}")[0]

    def form_group(self) -> tuple[str, str]:
        """The ranks join one process group at rank 0's node address and a free port there; (backend, address:port)."""
        address, port = self._get([self.actor.rendezvous.remote()], "finding the group's address")[0]
        backends = self._get([rank.join.remote(address, port) for rank in self.ranks], "joining the group")
        return backends[0], f"{address}:{port}"

    def checkpoint(self, folder: Path, small: dict) -> None:
        """The learner writes the checkpoint into ``folder`` (rank 0, or every rank under fsdp2); nothing comes back here."""
        readers = self.ranks if self.sharded else [self.actor]
        self._get([rank.write_checkpoint.remote(str(folder), small) for rank in readers], "writing its checkpoint")

    def _get(self, refs: list[Any], doing: str, first: int = 0, wait_s: float | None = None) -> list[Any]:
        """Every rank's result (``refs``: ranks ``first``, ``first`` + 1, …), or :class:`LearnerRankFailed` as soon as one rank
        fails (a dead rank named before one whose collective failed because of it) or takes longer than ``wait_s``
        (default ``trainer.actor_timeout_s``)."""
        ray, pending, failures = self.ray, list(refs), {}
        wait_s = self.faults.call_s if wait_s is None else wait_s
        while pending and not failures:
            done, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not done:  # hung (e.g. a collective or a device that never returns): the run cannot go on without it
                self.kill()
                rank = first + refs.index(pending[0])
                limit = f"trainer.actor_timeout_s={self.faults.call_s:g}s" if wait_s == self.faults.call_s else f"{wait_s:g}s"
                raise LearnerRankFailed(f"learner rank {rank} of {len(self.ranks)} hung while {doing} (no answer within {limit})"
                                        + resume_hint(self.session)) from None  # fmt: skip
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - any rank's failure stops the run, reported below
                    failures[first + refs.index(ref)] = exc
        if failures:
            if pending:  # the others fail soon after, or wait for the failed rank forever
                for ref in ray.wait(pending, num_returns=len(pending), timeout=2.0)[0]:
                    try:
                        ray.get(ref)
                    except Exception as exc:  # noqa: BLE001
                        failures[first + refs.index(ref)] = exc
            self.kill()
            lost = (*_object_lost(ray), ray.exceptions.RayActorError)  # a rank whose node died: the node is what failed
            for rank, exc in sorted(failures.items()):
                grace = NODE_GRACE_S if isinstance(exc, lost) or isinstance(getattr(exc, "cause", None), lost) else 0.0
                if (node := self.faults.dead_node(ray, self.rank_name(rank), grace)) is not None:
                    raise self.faults.lost(f"learner rank {rank} of {len(self.ranks)}", node, f"was lost while {doing}") from None
            raise LearnerRankFailed(self._failure_line(ray, failures, doing)) from None
        return ray.get(refs)

    def rank_name(self, rank: int) -> str:
        """Rank ``rank``'s key in the run's placement."""
        return "learner" if len(self.ranks) == 1 else f"learner_rank_{rank}"

    def _failure_line(self, ray: ModuleType, failures: dict[int, Exception], doing: str) -> str:
        died = {i: e for i, e in failures.items() if isinstance(e, ray.exceptions.RayActorError)}
        rank, exc = min((died or failures).items())
        cause = getattr(exc, "cause", None) or exc  # a task's own exception, inside Ray's RayTaskError
        what = "died" if rank in died else f"failed ({type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[-1][:300]})"
        return f"learner rank {rank} of {len(self.ranks)} {what} while {doing}" + resume_hint(self.session)

    def kill(self) -> None:
        """Stop every rank now (they hold no sandboxes: the learner's plan only trains)."""
        for rank in self.ranks:
            self.ray.kill(rank)
        self.killed = True


def replicas_of(plan, role: str) -> int:
    """Actors of ``role`` in the run: ``trainer.layout.<role>.replicas`` (1 without a layout)."""
    layout = plan.config.trainer.layout
    return getattr(layout, role).replicas if layout is not None else 1


def replica_names(role: str, replicas: int) -> list[str]:
    """Placement keys of a role's replicas: the role itself for one, ``role.0``, ``role.1``, … for more."""
    return [role] if replicas == 1 else [f"{role}.{i}" for i in range(replicas)]


def start_actors(
    ray: ModuleType, plan, session: Session, threads: int, groups: dict[str, Any] | None = None
) -> tuple[list, list, list, tuple]:
    """(rollout actors, teacher actors, learner ranks, pinned), seeded with the session's current models and optimizer state, each
    in its role's placement group when the run has a layout (replica or rank i in bundle i). ``pinned`` holds the
    object refs a restarted rollout or teacher actor is constructed from again: the caller keeps it for as long as the actors live
    (Ray frees a ``ray.put`` object once no ref to it is left, and a restart would then fail)."""
    config = plan.config.model_dump(mode="json")
    layout, groups = plan.config.trainer.layout, groups or {}

    def remote(cls: type, role: str, bundle: int = 0, concurrency: int = 1, **options: Any) -> Any:  # one call at a time, in order
        return ray.remote(cls).options(max_concurrency=concurrency, **options, **placement_options(layout, groups, role, bundle))

    problems = ray.put(session.train_problems)
    units = batch_units(plan, len(session.train_problems))  # a worker's units in flight, plus one for ready/pid/close
    rollouts = [
        remote(RolloutActor, "rollout", i, concurrency=units + 1 if units > 1 else 1, max_restarts=ROLLOUT_RESTARTS).remote(
            config, session.student_path, problems, threads
        )
        for i in range(replicas_of(plan, "rollout"))
    ]
    teacher_path = session.teacher_path if plan.config.teacher.backend == "hf" else None  # else reopened from teacher.path
    scorers = [
        remote(TeacherActor, "teacher", i, max_restarts=TEACHER_RESTARTS).remote(config, teacher_path, session.student_path, threads)
        for i in range(replicas_of(plan, "teacher"))
    ]
    world = layout.learner.replicas if layout is not None else 1
    # the full signal's output head, from the teacher actor to the learners (the driver passes the reference on, never the head)
    head = scorers[0].output_head.remote() if plan.config.teacher.signal == "full" else None
    resumed = session.weights_path if session.state.step > 0 else None
    learners = [remote(LearnerActor, "learner", rank).remote(config, session.student_path, resumed, threads, rank, world, head)
                for rank in range(world)]  # fmt: skip
    return rollouts, scorers, learners, (problems,)


def load_learner(plan, student_path: str, checkpoint: str | None, device: str) -> tuple:
    """(model, tokenizer, optimizer, method state) of a learner rank on ``device``: the prepared student with a fresh
    optimizer, or checkpoint ``checkpoint`` whole (weights, optimizer, method state, and this process's RNG)."""
    from opd_harness.models.tiny import load_model_and_tokenizer

    cfg = plan.config
    if checkpoint is None:
        model, tokenizer = load_prepared(cfg.student, student_path, cfg.trainer.enable_thinking)
    else:
        model, tokenizer = load_model_and_tokenizer(checkpoint)
    model.to(device)  # before the optimizer is built (fused AdamW on CUDA) or its state loaded
    if cfg.trainer.activation_checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = _optimizer_factory(cfg)(model)
    method_state = plan.method.make_state(plan.hparams) if plan.method.make_state else None
    if checkpoint is not None:
        payload = read_state(Path(checkpoint))
        load_optimizer_state(Path(checkpoint), payload, model, optimizer)
        set_rng_state(payload["rng"])
        if method_state is not None:
            method_state.load_state_dict(payload["extra"]["method_state"])
    return model, tokenizer, optimizer, method_state


def run_folder_problem(folder: str, token: str, role: str) -> str | None:
    """Why this process (``role``) cannot use the run folder ``folder``: it does not see the driver's ``token`` there (not
    the same shared filesystem at the same path); None when it does."""
    import ray

    marker = Path(folder) / RUN_FOLDER_TOKEN
    try:
        seen = marker.read_text()
    except OSError:
        seen = None
    if seen == token:
        return None
    node = ray.get_runtime_context().get_node_id()[:12] if ray.is_initialized() else socket.gethostname()
    return (f"the run folder {folder} is not visible from node {node} ({role}): on a cluster --out must be a filesystem "
            "every node mounts at the same path (docs/guides/cluster.md#the-run-folder)")  # fmt: skip


RUN_FOLDER_TOKEN = ".driver-token"  # written by the driver into the run folder; actors that write or read checkpoints must see it


class RunFolderUnavailable(ConfigError):
    """An actor that writes or reads checkpoints does not see the run folder (exit 2, before training)."""


def check_run_folder(ray: ModuleType, actors: list[Any], run_folder: tuple[str, str], call_s: float | None, who: str) -> None:
    """:class:`RunFolderUnavailable` (exit 2, before training) when one of ``actors`` (``who``) does not see the run folder
    (``run_folder``: folder, token) or does not answer within ``trainer.actor_timeout_s`` (``call_s``)."""
    try:
        answers = ray.get([actor.sees_run_folder.remote(*run_folder) for actor in actors], timeout=call_s)
    except ray.exceptions.GetTimeoutError:  # e.g. a shared filesystem that hangs instead of failing
        answers = [f"{who} did not answer within trainer.actor_timeout_s={call_s:g}s when it checked the run folder "
                   f"{run_folder[0]} (a shared filesystem that hangs?)"]  # fmt: skip
    problem = next((p for p in answers if p), None)
    if problem:
        raise RunFolderUnavailable(problem)


def mark_run_folder(session: Session) -> tuple[str, str]:
    """(run folder, token): a fresh token written into the run folder, which the learner ranks and evaluation workers
    must read back (:func:`run_folder_problem`)."""
    folder = session.store.run_dir(session.run_id)
    folder.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    (folder / RUN_FOLDER_TOKEN).write_text(token)
    return str(folder), token


def prepare_remote(ray: ModuleType, plan, root: Path) -> PreparedModels:
    """The run's models prepared (built, warmed up, cached under ``root``, or located) in a Ray task, not in the driver:
    only their folders come back. The task takes no CPU of the layout's reservations (it runs before the actors start)."""
    task = ray.remote(num_cpus=0, max_retries=0)(_prepare_in_task)
    return ray_get(ray, task.remote(plan.config.model_dump(mode="json"), plan.train_problems, str(root), plan.config.threads or 1))


def _prepare_in_task(config: dict, problems: list, root: str, threads: int) -> PreparedModels:
    _setup_actor(threads)
    plan = _plan(config)
    plan.train_problems = problems
    return prepare_models(plan, Path(root))


def head_copy(teacher: Any) -> torch.nn.Module | None:
    """A CPU copy of the in-process teacher's output head, frozen (what a learner actor applies to a full signal's states)."""
    head = output_head(teacher)
    return copy.deepcopy(head).cpu().requires_grad_(False) if head is not None else None


def wait_ready(ray: ModuleType, actors: list, names: list[str], console: Console, placement: dict[str, Any], learner: RayLearner,
               run_folder: tuple[str, str] | None = None) -> None:
    """Block until every actor is constructed (start-up is not training time) and the learner ranks have formed their
    group; record the node each one (``names``; ``learner``: rank 0) runs on, and ``learner_rank_<i>`` when there are
    several, and under ``gpus`` each one's assigned GPU ids. :class:`DeviceUnavailable` (naming the role's key) when an
    actor was given GPUs its torch cannot see, before the learner group forms."""
    started = time.perf_counter()
    ranks = learner.ranks[1:]
    every = [*actors, *ranks]
    keys = [*names, *(f"learner_rank_{i}" for i in range(1, len(learner.ranks)))]
    failures = await_started(ray, every, keys, learner.faults)
    call_s = learner.faults.call_s
    placement.update(zip(names, ray.get([actor.node_id.remote() for actor in actors], timeout=call_s), strict=True))
    placement.setdefault("gpus", {}).update(zip(keys, ray.get([actor.devices.remote() for actor in every], timeout=call_s), strict=True))
    if len(learner.ranks) > 1:
        nodes = ray.get([rank.node_id.remote() for rank in learner.ranks], timeout=call_s)
        placement.update({f"learner_rank_{i}": node for i, node in enumerate(nodes)})
    console.print("ray placement: " + ", ".join(f"{role} on node {node[:12]}" + gpu_note(placement, role)
                                                for role, node in placement.items() if isinstance(node, str)))  # fmt: skip
    failure = next((f for f in failures if isinstance(f, str)), None)
    if failure:
        raise DeviceUnavailable(failure)
    if run_folder is not None:  # every rank writes (fsdp2) or rank 0 does; all must see it to resume after a failover too
        check_run_folder(ray, learner.ranks, run_folder, call_s, "the learner")
    if len(learner.ranks) > 1:
        backend, rendezvous = learner.form_group()
        console.print(f"learner: {len(learner.ranks)} data-parallel ranks ({learner.sharding}, {backend}, rendezvous {rendezvous})")
    console.print(f"ray actors ready ({', '.join(names)}); waited {time.perf_counter() - started:.1f}s after the step-0 evaluation")


def await_started(ray: ModuleType, actors: list[Any], keys: list[str], faults: "Faults") -> list[str | None]:
    """Each actor's ``ready`` answer once all are constructed; :class:`ActorLost` (one line naming the role and its node)
    for the first that is not within ``trainer.actor_restart_timeout_s`` (a start-up that hangs: imports, a model, a
    placement that never comes)."""
    refs = [actor.ready.remote() for actor in actors]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=faults.restart_s)
    if pending:
        i = refs.index(pending[0])
        node = actor_node(ray, actors[i])
        where = f"on node {node}" if node else "not placed on any node"
        raise ActorLost(f"{keys[i]} did not start within {faults.restart_key}={faults.restart_s:g}s ({where})"
                        + resume_hint(faults.session))  # fmt: skip
    return ray_get(ray, refs)


def actor_node(ray: ModuleType, actor: Any) -> str | None:
    """The node Ray placed ``actor`` on (hex id, from its actor table entry; set once it is scheduled, while its
    constructor runs), or None while it is not placed."""
    try:
        from ray._private.state import actors as actor_table

        node = ((actor_table(actor_id=actor._actor_id.hex()) or {}).get("Address") or {}).get("NodeID")
        return node if node and node.strip("f0") else None  # Ray's nil id is all f
    except Exception:  # noqa: BLE001 - a private API: the line then says the node is unknown
        return None


def gpu_note(placement: dict[str, Any], role: str) -> str:
    """`` (GPU 0,1)`` for a role the placement records GPUs for, else nothing."""
    ids = (placement.get("gpus") or {}).get("learner" if role == "learner_rank_0" else role)
    return f" (GPU {','.join(ids)})" if ids else ""


def write_placement(session: Session, placement: dict[str, Any]) -> None:
    """The run's placement (role → node, ``gpus``: role → GPU ids) as ``placement.json`` in its folder, as soon as the
    actors are up: a run that stops before its first checkpoint (a device it cannot use, a lost node) still shows it."""
    path = session.store.run_dir(session.run_id) / "placement.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(placement, indent=1, sort_keys=True))


def checkpoint_evaluation(
    ray: ModuleType, plan, session: Session, groups: dict[str, Any], placement: dict[str, Any], console: Console
) -> AbstractContextManager[None]:
    """The run's checkpoint evaluations on evaluation workers of the eval executor of the same name
    (``opd_harness.trainers.ray_eval``, found through the registry): the ``trainer.layout.eval`` workers in the eval role's
    placement group, or without one a single worker where Ray puts it (the driver holds no model to evaluate)."""
    return EVAL_EXECUTORS.get(plan.config.trainer.executor).for_run(ray, plan, session, groups, placement, console)


class RayExecutor:
    """Roles as Ray actors (rollout, teacher-scorer, learner) on a local Ray or the cluster at ``trainer.ray_address``,
    placed by ``trainer.layout`` when given. Ray is one per process, and so are the run's placement groups (``groups``)."""

    def __init__(self) -> None:
        self.groups: dict[str, Any] = {}

    def check(self, plan, console: Console) -> None:
        """Before anything is written: join Ray and reserve the layout once (released again), or :class:`LayoutError`."""
        if "teacher_fresh_logprobs" in plan.method.needs(plan.hparams):
            raise ConfigError(f"method_args.{plan.method.name}.rescore_teacher: the ray executor's learner holds no teacher; "
                              "use --executor inprocess")  # fmt: skip
        layout = plan.config.trainer.layout
        if layout is None:
            return
        with self._join(plan, console) as ray:
            release_layout(ray, reserve_layout(ray, layout))

    def prepare(self):
        """The run's models are prepared in a Ray task (:func:`prepare_remote`): the driver keeps their folders only."""
        return lambda plan, root: prepare_remote(import_ray(), plan, root)

    def _join(self, plan, console: Console):
        trainer, threads = plan.config.trainer, plan.config.threads or 1
        return ray_runtime(trainer.ray_address, threads, console, local_cpus(trainer.layout, threads))

    @contextmanager
    def runtime(self, plan, console: Console) -> Iterator[None]:
        """Ray for the run, with the layout's placement groups reserved until it ends (also when it fails)."""
        layout = plan.config.trainer.layout
        with self._join(plan, console) as ray:
            self.groups = reserve_layout(ray, layout) if layout is not None else {}
            try:
                yield
            finally:
                release_layout(ray, self.groups)
                self.groups = {}

    @contextmanager
    def roles(self, plan, session: Session, board: WeightBoard, console: Console) -> Iterator[Roles]:
        ray = import_ray()
        run_folder = mark_run_folder(session)
        rollouts, scorers, learners, pinned = start_actors(ray, plan, session, plan.config.threads or 1, self.groups)  # during step-0 eval
        trainer = plan.config.trainer
        placement: dict[str, Any] = {}
        faults = Faults(trainer.actor_timeout_s, trainer.actor_restart_timeout_s, placement, session)
        if session.teacher is None:  # the teacher's reference evaluation runs on the teacher actors, which hold it
            session.teacher_runner = LazyShards(EVAL_EXECUTORS.get(plan.config.trainer.executor).shards, ray, scorers, console, faults)
        actors = [*rollouts, *scorers, learners[0]]
        names = [*replica_names("rollout", len(rollouts)), *replica_names("teacher", len(scorers)), "learner"]
        sharding = trainer.layout.learner.sharding if trainer.layout is not None else "ddp"
        ray_learner = RayLearner(ray, learners, session, sharding, faults, trainer.weight_sync)
        teachers = TeacherActors(ray, scorers, faults)

        def ready() -> None:
            try:
                wait_ready(ray, actors, names, console, placement, ray_learner, run_folder)
                ray_learner.connect(rollouts, board.keep)
            finally:
                write_placement(session, placement)

        try:
            with checkpoint_evaluation(ray, plan, session, self.groups, placement, console), warnings.catch_warnings():
                # the session's optimizer mirrors the learner's, so only its scheduler steps
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before", category=UserWarning)
                ray_learner.sides = [RayRollout(ray, plan, rollout, teachers, board, name, faults)
                                     for rollout, name in zip(rollouts, names, strict=False)]  # fmt: skip
                yield Roles(
                    ray_learner.sides,
                    ray_learner,
                    ready=ready,
                    placement=placement,
                )  # fmt: skip
        finally:
            every = [*rollouts, *scorers, *([] if ray_learner.killed else learners)]  # killed learner ranks have nothing to close
            try:  # a kill skips the actors' exit hooks: their sandbox containers and engines are released first
                ray.get([actor.close.remote() for actor in every], timeout=CLOSE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a dead or stuck actor must not keep the others alive
                console.print(f"[yellow]warning:[/] ray actors did not close cleanly ({type(exc).__name__}: {exc}); killing them")
            for actor in every:
                ray.kill(actor)
            del pinned  # the rollout and teacher actors' constructor arguments, kept alive for their restarts until here


class LazyShards:
    """A shard runner over the teacher ``actors`` made by ``make(ray, actors, console, faults, names)`` (the eval
    executor's) when first used: their node ids are asked for then, once they are up (within ``faults.restart_s``, else
    :class:`ActorLost`); one that cannot work (GPUs its torch cannot see) stops the run. Its calls are bounded by
    ``faults`` as every other call to an actor."""

    def __init__(self, make: Any, ray: ModuleType, actors: list, console: Console, faults: Faults | None = None) -> None:
        self.make, self.ray, self.actors, self.console, self.shards = make, ray, actors, console, None
        self.faults, self.names = faults or Faults(), replica_names("teacher", len(actors))

    def run(self, task, shards, *, k: int, sampling):
        if self.shards is None:
            failure = next((f for f in await_started(self.ray, self.actors, self.names, self.faults) if f), None)
            if failure:
                raise DeviceUnavailable(failure)
            self.shards = self.make(self.ray, self.actors, self.console, self.faults, self.names)
        return self.shards.run(task, shards, k=k, sampling=sampling)


RAY_EXECUTOR = RayExecutor()
