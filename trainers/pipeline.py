"""What every executor shares: the run session (models, optimizer, resume, checkpoints, evaluation)
and the three phases of a training step — make a batch (generate, reward, behaviour log-probs,
teacher), learn, account. The loop (``opd_harness.trainers.loop``) and the executors only decide who runs which
phase when.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from opd_harness.backends import Backend, SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.evaluation import ShardRunner, ShardStage, describe_episodes, evaluate_task, grade_episodes, store_eval, summarize_episodes
from opd_harness.plan import load_plan_data
from opd_harness.registry import BACKENDS
from opd_harness.rollout import reference_trajectories, rollout
from opd_harness.store import Store
from opd_harness.timing import timed
from opd_harness.trajectory import TensorBatch, Trajectory, to_tensor_batch
from opd_harness.trainers.checkpoint import (TrainState, checkpoint_dir, load_checkpoint, publish_checkpoint, read_state, restore_scheduler,
                                             staging_dir, trainer_state, write_state)
from opd_harness.trainers.guards import enforce_finite, enforce_grade_error_rate, grade_error_count
from opd_harness.trainers.learner import behaviour_mismatch, old_logprobs_redundant, train_step
from opd_harness.trainers.perf import flop_params, step_perf
from opd_harness.teacher_signal import attach_head
from opd_harness.trainers.teacher import open_remote_teacher, score_teacher, teacher_label, wrap_hf_teacher
from opd_harness.trainers.warmup import describe_warmup, prepare_model, warmup_record

TEACHER_SUFFIX = ".teacher"


def step_seed(seed: int, step: int) -> int:
    """Prompts and sampling of step ``step`` depend only on (seed, step): exact resume, sync ≡ async lag 0."""
    return seed * 1_000_003 + step


def sample_problems(cfg, train_problems: list, step: int) -> list:
    rng = random.Random(step_seed(cfg.seed, step))
    return rng.sample(train_problems, min(cfg.trainer.prompts_per_step, len(train_problems)))


def make_batch(
    plan, student: Backend, teacher: Backend, problems: list, step: int, metrics: dict, scorer: HFBackend | None = None,
    *, check_errors: bool = True,
) -> tuple[TensorBatch, list[Trajectory]]:
    """Roll out (or take references), grade when the method needs rewards, and score with the teacher."""
    batch, trajectories = generate_batch(plan, student, problems, step, metrics, scorer, check_errors=check_errors)
    teacher_phase(plan, teacher, batch, metrics, step=step)
    return batch, trajectories


def generate_batch(
    plan, student: Backend, problems: list, step: int, metrics: dict, scorer: HFBackend | None = None, *, check_errors: bool = True
) -> tuple[TensorBatch, list[Trajectory]]:
    """The rollout role's half of :func:`make_batch`: sample (or take references), grade, and (when the
    method reads π_old) score the sampled tokens under the behaviour weights; no teacher. ``metrics["rows"]`` counts
    the samples; without ``check_errors`` the grading-error share is left to the caller (the loop checks whole batches).

    π_old is scored by ``scorer`` (:func:`open_behaviour_scorer`: the trainer's model holding the behaviour
    weights) when there is one, else by the engine ``student`` itself.
    """
    cfg, task, method, hparams = plan.config, plan.task, plan.method, plan.hparams
    needs = method.needs(hparams)
    with timed("generate", metrics):
        if method.on_policy:
            params = SamplingParams(
                temperature=cfg.trainer.temperature,
                top_p=cfg.trainer.top_p,
                max_new_tokens=cfg.trainer.max_new_tokens or task.options.max_new_tokens,
                n=cfg.trainer.samples_per_prompt,
                seed=step_seed(cfg.seed, step),
                top_logprobs=cfg.teacher.top_k if cfg.teacher.signal == "student_topk" else 0,
            )
            trajectories = rollout(student, task, problems, params)
        else:
            trajectories = reference_trajectories(task, problems, student.tokenizer)
    if "rewards" in needs:
        with timed("reward", metrics):
            by_id = {p.id: p for p in problems}
            scores = grade_episodes(task, [by_id[t.problem_id] for t in trajectories], trajectories, show_progress=False)
            for traj, score in zip(trajectories, scores, strict=True):
                traj.reward = score.reward_value  # an error grade gives no reward (NaN), never 0: objectives leave it out
            errors = grade_error_count([s.status for s in scores])
            graded = [s.value for s in scores if s.status != "error"]
            metrics.update(grade_errors=float(errors), reward_mean=sum(graded) / len(graded) if graded else float("nan"))
            if check_errors:
                enforce_grade_error_rate(errors, len(scores), cfg.trainer.max_grade_error_rate, step, task.name)
    metrics.update(episode_step_metrics(task, trajectories), rows=float(len(trajectories)))
    batch = to_tensor_batch(trajectories, student.pad_id)
    if scores_old_logprobs(plan):
        if scorer is not None and scorer.version != student.version:
            raise RuntimeError(f"the behaviour scorer holds weights version {scorer.version}, the rollout engine {student.version}")
        with timed("old_logprobs", metrics):
            batch.old_logprobs = behaviour_logprobs(scorer or student, batch)
        if cfg.trainer.behaviour_logprobs == "recompute":
            metrics.update(behaviour_mismatch(batch.behaviour_logprobs, batch.old_logprobs, batch.loss_mask))
    return batch, trajectories


def scores_old_logprobs(plan) -> bool:
    """Whether the rollout role scores π_old: the method reads it on its own samples and it is not the training
    forward's log-probs already (:func:`opd_harness.trainers.learner.old_logprobs_redundant`)."""
    needs_old = plan.method.on_policy and "old_logprobs" in plan.method.needs(plan.hparams)
    return needs_old and not old_logprobs_redundant(plan.config.trainer)


def needs_behaviour_scorer(plan, engine: Backend) -> bool:
    """Whether the rollout role needs the trainer's model beside its engine to recompute π_old: it scores π_old
    (:func:`scores_old_logprobs`), ``trainer.behaviour_logprobs`` is ``recompute`` and the engine is not the trainer's
    own model class (hf)."""
    return scores_old_logprobs(plan) and plan.config.trainer.behaviour_logprobs == "recompute" and not isinstance(engine, HFBackend)


def open_behaviour_scorer(plan, engine: Backend, student_path: str, *, device: str = "cpu") -> HFBackend | None:
    """The trainer's model beside a non-hf engine, fed the same weight versions, that recomputes π_old (docs/methods/opd.md's
    ``o``) under the behaviour weights; None when the engine's own scores are used (:func:`needs_behaviour_scorer`).

    It is loaded from the student's folder; like the engine it holds no weights version yet (-1) until the loop pushes one.
    """
    if not needs_behaviour_scorer(plan, engine):
        return None
    options = {"batch_size": plan.config.trainer.generate_batch_size, "device": device, "score_tokens": plan.config.trainer.forward_tokens}
    scorer = HFBackend.load(student_path, **options)
    scorer.version = -1
    return scorer


def load_rollout_weights(engine: Backend, scorer: HFBackend | None, weights: dict[str, torch.Tensor], version: int,
                         expected: str | None = None) -> None:  # fmt: skip
    """Push weights ``version`` to the rollout engine and to its behaviour scorer, if it has one, and check each against the
    learner's checksum ``expected`` (:func:`opd_harness.trainers.weight_sync.check_loaded`: a stale or corrupt load fails the run)."""
    from opd_harness.trainers.weight_sync import check_loaded

    engine.load_weights(weights, version)
    check_loaded(engine, expected, version)
    if scorer is not None:
        scorer.load_weights(weights, version)
        check_loaded(scorer, expected, version)


def episode_step_metrics(task, trajectories: list[Trajectory]) -> dict[str, float]:
    """Agentic measurements of a step's episodes (turns, tool calls, invalid tool rate, the task's episode flags
    when it has them), with the same definitions as evaluation's."""
    return summarize_episodes([t.metadata.get("episode", {}) for t in trajectories], task.episode_flags)


@torch.no_grad()
def behaviour_logprobs(backend: Backend, batch: TensorBatch) -> torch.Tensor:
    """o_t (docs/methods/opd.md and grpo.md): log-probs of the sampled tokens scored by ``backend`` under the weights that generated
    them, on exactly the padded layout the learner scores. With the trainer's model (an hf engine, or the behaviour
    scorer beside another engine) the importance ratio exp(s − o) is exactly 1 at lag 0; with another engine's
    scores (``trainer.behaviour_logprobs=engine``) it is off 1 by the engine/trainer mismatch."""
    scores = backend.score(batch.input_ids, batch.attention_mask, want=("logprobs",))
    return scores["logprobs"].float().cpu() * batch.loss_mask


def run_device(device: str) -> str:
    """``trainer.device`` as a torch device name: ``auto`` is cuda where torch sees one, else cpu (validated at config time)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def driver_device(trainer) -> str:
    """Where the session (this process) keeps its models: ``trainer.device`` (under ``--executor ray`` the session holds
    none, :meth:`Session.open_remote`; ``cpu`` is returned there for completeness)."""
    return "cpu" if trainer.executor == "ray" else run_device(trainer.device)


def open_rollout_backend(plan, student_path: str, *, device: str = "cpu") -> Backend:
    """The rollout role's inference engine, ``trainer.rollout_backend``, with no weights version yet (-1).

    The engine (hf, or e.g. vLLM on a GPU) is loaded from the student's folder, in process or in a Ray actor; the loop pushes
    the learner's weights through ``load_weights(state, version)`` before the first batch. An hf-family engine runs on
    ``device`` (the in-process executor passes ``trainer.device``; a Ray actor, the device Ray assigned it).
    """
    cfg = plan.config.trainer
    cls = BACKENDS.get(cfg.rollout_backend)
    options = dict(cfg.rollout_backend_options)
    if issubclass(cls, HFBackend):  # hf and the engines built on it (hf_static)
        options.setdefault("batch_size", cfg.generate_batch_size)
        options.setdefault("device", device)
        if cls is HFBackend:  # its π_old scoring (async with a lag) runs on length-sorted row groups, as the learner's forward
            options.setdefault("score_tokens", cfg.forward_tokens)
    backend = cls.load(student_path, **options)
    if cfg.enable_thinking is not None:  # the engine loaded its own tokenizer from the folder
        from opd_harness.models.hub import set_thinking

        set_thinking(backend.tokenizer, cfg.enable_thinking)
    backend.version = -1
    if cfg.rollout_backend not in CONCURRENT_ENGINES:
        serialize_calls(backend)
    return backend


CONCURRENT_ENGINES = frozenset({"hf", "openai"})  # engines whose generate/score may be called from several threads at once


def serialize_calls(backend: Backend) -> None:
    """Make ``backend``'s generate and score take turns (one lock): a worker streaming prompt groups calls its engine from
    several threads, and an engine such as vLLM's offline ``LLM`` is not safe for that (environment steps still overlap)."""
    lock = threading.Lock()
    for name in ("generate", "score"):
        call = getattr(backend, name, None)
        if call is not None:
            setattr(backend, name, _locked(call, lock))


def _locked(call: Callable, lock: threading.Lock) -> Callable:
    def locked(*args, **kwargs):
        with lock:
            return call(*args, **kwargs)

    return locked


def close_rollout_backend(backend: Backend | None) -> None:
    """Stop an engine that owns a process or a GPU (vLLM's ``close``); backends without one hold nothing to release."""
    close = getattr(backend, "close", None)
    if close is not None:
        close()


def needs_teacher(plan) -> bool:
    """Whether the method reads teacher log-probs or distributions (otherwise the teacher never runs)."""
    return bool(plan.method.needs(plan.hparams) & {"teacher_logprobs", "teacher_dist"})


def teacher_phase(plan, teacher: Backend, batch: TensorBatch, metrics: dict, step: int | None = None) -> None:
    """The teacher role's half of :func:`make_batch`: score ``batch`` in place when the method needs it, as the signal the
    plan chose (``teacher.signal``, resolved); a teacher failure stops the run (TeacherFailed)."""
    if needs_teacher(plan):
        spec = plan.config.teacher
        with timed("teacher", metrics):
            score_teacher(teacher, batch, kind=spec.signal, top_k=spec.top_k, dtype=spec.signal_dtype, retries=spec.step_retries,
                          step=step)  # fmt: skip


def learn(
    plan, model, optimizer, batch: TensorBatch, method_state, learner_version: int, metrics: dict, shard=None, teacher_head=None,
    rescore: Callable[[TensorBatch], torch.Tensor] | None = None,
) -> None:
    """One optimizer step (one rank's part of it with a data-parallel ``shard``); policy lag = learner version − behaviour
    version, per sample. ``teacher_head``: the teacher's output head, for a ``full`` signal that arrived without it.
    ``rescore``: the teacher's log-probs of the batch's sampled tokens scored now (T^fresh), for a method that declares
    ``teacher_fresh_logprobs``."""
    batch.teacher_dist = attach_head(batch.teacher_dist, teacher_head)
    if "teacher_fresh_logprobs" in plan.method.needs(plan.hparams):
        if rescore is None:
            raise RuntimeError(f"method {plan.method.name!r} needs the teacher re-scored at update time, and this learner cannot")
        with timed("rescore", metrics):
            batch.teacher_fresh_logprobs = rescore(batch)
    known = batch.policy_version >= 0  # reference responses have no behaviour version
    batch.policy_lag = torch.where(known, learner_version - batch.policy_version, 0).clamp(min=0)
    metrics["lag_mean"] = float(batch.policy_lag.float().mean())
    metrics["lag_max"] = float(batch.policy_lag.max())
    metrics.update(staleness_metrics(batch.policy_version, batch.newest_version, learner_version))
    trainer, started = plan.config.trainer, time.perf_counter()
    with timed("train", metrics):
        metrics.update(
            train_step(
                model, optimizer, batch, plan.method, plan.hparams, method_state, grad_clip=trainer.grad_clip, shard=shard,
                precision=trainer.precision, vocab_chunk=trainer.vocab_chunk, forward_tokens=trainer.forward_tokens,
                bucket_backward=trainer.bucket_backward, graph_memory_gib=trainer.graph_memory_gib,
            )
        )
    metrics.update(learner_perf(model, batch, time.perf_counter() - started, shard))


def staleness_metrics(oldest: torch.Tensor, newest: torch.Tensor | None, learner_version: int) -> dict[str, float]:
    """verl's per-trajectory off-policy accounting over the rows with a known version (none: no metrics), each as
    ``_mean``/``_max``/``_min``: ``trajectory_spans`` = newest − oldest + 1 (policy versions a trajectory's tokens came from),
    ``trajectory_staleness`` = learner version − newest, ``trajectory_staleness_worst`` = learner version − oldest (the lag).
    Trackers get them under verl's keys, ``training/off_policy/<name>/<stat>`` (:func:`opd_harness.tracking.step_key`)."""
    newest = oldest if newest is None else newest
    known = (oldest >= 0) & (newest >= 0)
    if not bool(known.any()):
        return {}
    oldest, newest = oldest[known].double(), newest[known].double()
    values = {
        "trajectory_spans": newest - oldest + 1,
        "trajectory_staleness": learner_version - newest,
        "trajectory_staleness_worst": learner_version - oldest,
    }
    return {
        f"{name}_{stat}": float(getattr(v, stat)())
        for name, v in values.items()
        for stat in ("mean", "max", "min")
    }


def learner_perf(model, batch: TensorBatch, seconds: float, shard=None) -> dict[str, float]:
    """This rank's learner tokens/s (every position it ran forward and backward) and MFU on a device in the peak table."""
    from opd_harness.trainers.distributed import local_rows

    inner = getattr(model, "module", model)  # DDP's wrapped model
    param = next(inner.parameters())
    name = torch.cuda.get_device_name(param.device) if param.is_cuda else None
    return step_perf(flop_params(inner), int(local_rows(batch.attention_mask, shard).sum()), seconds, name)


def response_lengths(batch: TensorBatch) -> torch.Tensor:
    """Trained (loss-masked) tokens per sample: all the rate metrics need from a batch."""
    return batch.loss_mask.sum(-1)


def add_rates(metrics: dict, lengths: torch.Tensor, seconds: float) -> None:
    """Samples, tokens and their rates over ``seconds`` of step time (``lengths``: :func:`response_lengths`)."""
    metrics.update(
        time_step_s=seconds,
        samples=float(lengths.numel()),
        model_tokens=float(lengths.sum()),
        response_length=float(lengths.mean()),
        samples_per_s=lengths.numel() / seconds if seconds > 0 else 0.0,
        tokens_per_s=float(lengths.sum()) / seconds if seconds > 0 else 0.0,
    )


def _optimizer_factory(cfg):
    """AdamW over the student's (float32) parameters; PyTorch's fused kernel when they are on CUDA."""
    return lambda model: torch.optim.AdamW(
        model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay, fused=True if _on_cuda(model) else None
    )


def _on_cuda(model) -> bool:
    return next(model.parameters()).is_cuda


def _scheduler_factory(cfg):
    warmup = cfg.trainer.warmup_steps
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)


def schedule_optimizer(cfg) -> torch.optim.Optimizer:
    """What the driver of a run whose learner is elsewhere (``--executor ray``) keeps instead of the optimizer: one group at
    ``trainer.lr`` over an empty parameter, for the learning-rate schedule alone (its rates go to the learner each step)."""
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(0))], lr=cfg.trainer.lr)


@dataclass(frozen=True)
class PreparedModels:
    """Where a run's models are, prepared outside the driver (``--executor ray``): the student's folder, and the hf
    teacher's (None for a teacher another backend opens from ``teacher.path``)."""

    student_path: str
    teacher_path: str | None


def prepare_models(plan, root: Path) -> PreparedModels:
    """Build, warm up or locate the run's student and hf teacher (:func:`prepare_model`, cached under ``root``) and check
    that they share a vocabulary; only their folders are returned (an executor runs this where the models may live)."""
    cfg = plan.config
    teacher_path, vocab = None, None
    if cfg.teacher.backend == "hf":
        _, tokenizer, teacher_path = prepare_model(cfg.teacher, "teacher", plan.task, plan.train_problems, root,
                                                   enable_thinking=cfg.trainer.enable_thinking)  # fmt: skip
        vocab = tokenizer.get_vocab()
    _, student_tok, student_path = prepare_model(cfg.student, "student", plan.task, plan.train_problems, root,
                                                 enable_thinking=cfg.trainer.enable_thinking)  # fmt: skip
    if vocab is not None and student_tok.get_vocab() != vocab:
        raise ValueError("student and teacher tokenizers differ; per-token distillation needs a shared vocabulary")
    return PreparedModels(student_path, teacher_path)

def record_warmups(store: Store, run_id: str, console: Console, paths: dict[str, str | None]) -> dict[str, dict]:
    """Store and print what the warm-ups of the run's models did and reached (``warmup.json`` in the run folder, the run
    row's ``warmup``); a model with no record (pretrained, or not warmed up) is left out."""
    records = {role: rec for role, path in paths.items() if path is not None and (rec := warmup_record(path)) is not None}
    if records:
        store.set_warmup(run_id, records)
        (store.run_dir(run_id) / "warmup.json").write_text(json.dumps(records, indent=2, sort_keys=True))
    for role, rec in records.items():
        console.print(f"{role} warm-up: {describe_warmup(rec)}", highlight=False)
    return records


@dataclass
class Session:
    """A training run in progress: models, optimizer, counters, and the store it reports to.

    Opened with ``prepare`` (``--executor ray``) it holds no model: ``student`` and ``teacher`` are None (an openai
    teacher's client excepted), ``optimizer`` only carries the learning-rate schedule (:func:`schedule_optimizer`), the
    learner writes the checkpoints and evaluations run on the executor's workers (``shard_runner``, ``teacher_runner``)."""

    plan: object
    store: Store
    run_id: str
    console: Console
    student: HFBackend
    teacher: Backend  # HFBackend in-process, or teacher.backend's (a served teacher, vLLM)
    teacher_path: str
    student_path: str
    optimizer: torch.optim.Optimizer
    scheduler: object
    state: TrainState
    method_state: object | None
    train_problems: list = field(default_factory=list)
    # the student's shards at a step run there (Ray eval workers), given the folder of that step's weights
    shard_runner: Callable[[str, int], ShardRunner] | None = None
    teacher_runner: ShardRunner | None = None  # the teacher's reference evaluation runs there (Ray teacher actors)
    weights_path: str | None = None  # the folder holding the student's current weights: the resumed or last checkpoint

    @property
    def holds_models(self) -> bool:
        """Whether this process trains the student (in process) rather than a learner elsewhere."""
        return self.student is not None

    @classmethod
    def open(cls, plan, store: Store, run_id: str, *, resume: bool, console: Console, threads: int | None = None,
             prepare: Callable[[object, Path], PreparedModels] | None = None) -> "Session":  # fmt: skip
        """Build or load the models (resuming from the last checkpoint when asked); the run's data is loaded
        onto the plan once (``harness run`` has already done it, a sweep's run does it here). With ``prepare`` (an
        executor whose actors hold the models) no model is built here: see :meth:`open_remote`."""
        cfg = plan.config
        torch.set_num_threads(threads or cfg.threads or os.cpu_count() or 1)
        if plan.train_problems is None:
            load_plan_data(plan)
        if prepare is not None:
            return cls.open_remote(plan, store, run_id, resume=resume, console=console, prepared=prepare(plan, store.root))
        local_teacher = cfg.teacher.backend == "hf"
        if local_teacher:
            teacher_model, tokenizer, teacher_path = prepare_model(
                cfg.teacher, "teacher", plan.task, plan.train_problems, store.root, enable_thinking=cfg.trainer.enable_thinking
            )
        student_model, student_tok, student_path = prepare_model(
            cfg.student, "student", plan.task, plan.train_problems, store.root, enable_thinking=cfg.trainer.enable_thinking
        )
        record_warmups(store, run_id, console, {"teacher": teacher_path if local_teacher else None, "student": student_path})
        device = driver_device(cfg.trainer)
        student_model.to(device)  # before the optimizer is built (fused AdamW on CUDA) or a checkpoint's state loaded into it
        if cfg.trainer.activation_checkpointing:
            student_model.gradient_checkpointing_enable()
        if local_teacher and student_tok.get_vocab() != tokenizer.get_vocab():
            raise ValueError("student and teacher tokenizers differ; per-token distillation needs a shared vocabulary")
        optimizer_factory, scheduler_factory = _optimizer_factory(cfg), _scheduler_factory(cfg)
        state = TrainState()
        method_state = plan.method.make_state(plan.hparams) if plan.method.make_state else None
        last = _last_checkpoint(store, run_id) if resume else None
        if last is not None:
            student_model, student_tok, optimizer, scheduler, state, extra = load_checkpoint(
                Path(last["path"]), optimizer_factory, scheduler_factory, device=device
            )
            if method_state is not None:
                method_state.load_state_dict(extra["method_state"])
            console.print(f"[bold]resuming[/] {run_id} from step {state.step} ({last['path']})")
        else:
            optimizer = optimizer_factory(student_model)
            scheduler = scheduler_factory(optimizer)
        store.delete_steps_after(run_id, state.step)
        student = HFBackend(student_model, student_tok, batch_size=cfg.trainer.generate_batch_size, device=device)
        student.version = state.step
        if local_teacher:
            options = {"device": device, "score_chunk": cfg.trainer.vocab_chunk, "score_tokens": cfg.trainer.forward_tokens,
                       **cfg.teacher.backend_options}  # fmt: skip
            teacher = wrap_hf_teacher(teacher_model, tokenizer, cfg.trainer.generate_batch_size, options)
        else:  # served or loaded elsewhere; it shares the student's vocabulary (the student's tokenizer encodes for it)
            teacher, teacher_path = open_remote_teacher(cfg.teacher, student_path), teacher_label(cfg.teacher, None)
        return cls(
            plan,
            store,
            run_id,
            console,
            student,
            teacher,
            teacher_path,
            student_path,
            optimizer,
            scheduler,
            state,
            method_state,
            plan.train_problems,
            weights_path=last["path"] if last is not None else student_path,
        )

    @classmethod
    def open_remote(cls, plan, store: Store, run_id: str, *, resume: bool, console: Console, prepared: PreparedModels) -> "Session":
        """The session of a run whose models live in actors: paths, counters and the learning-rate schedule (restored
        from the last checkpoint's ``trainer_state.pt`` when resuming; the learner loads its weights and optimizer)."""
        cfg = plan.config
        record_warmups(store, run_id, console, {"teacher": prepared.teacher_path, "student": prepared.student_path})
        optimizer, scheduler_factory = schedule_optimizer(cfg), _scheduler_factory(cfg)
        state, scheduler = TrainState(), None
        last = _last_checkpoint(store, run_id) if resume else None
        if last is not None:
            payload = read_state(Path(last["path"]))
            state, scheduler = TrainState(**payload["state"]), restore_scheduler(optimizer, scheduler_factory, payload["scheduler"])
            console.print(f"[bold]resuming[/] {run_id} from step {state.step} ({last['path']})")
        store.delete_steps_after(run_id, state.step)
        teacher = open_remote_teacher(cfg.teacher, prepared.student_path) if cfg.teacher.backend == "openai" else None  # a client
        teacher_path = prepared.teacher_path or teacher_label(cfg.teacher, None)
        return cls(plan, store, run_id, console, None, teacher, teacher_path, prepared.student_path, optimizer,
                   scheduler or scheduler_factory(optimizer), state, None, plan.train_problems,
                   weights_path=last["path"] if last is not None else prepared.student_path)  # fmt: skip

    def evaluate_start(self) -> None:
        """Teacher reference row, the student before training, or a checkpoint whose eval was interrupted."""
        cfg = self.plan.config
        if cfg.eval.teacher:
            self.evaluate(self.run_id + TEACHER_SUFFIX, 0, self.teacher, label="teacher", model=self.teacher_path)
        if self.state.step > 0 or cfg.eval.before_training:
            self.evaluate(self.run_id, self.state.step, self.student, label="student")
        estimator = getattr(self.plan.hparams, "estimator", None)
        mode = cfg.trainer.mode
        self.console.print(
            f"training: method={self.plan.method.name}"
            + (f" estimator={estimator}" if estimator else "")
            + f", mode={mode}, {cfg.trainer.steps} steps"
        )

    def record_step(
        self,
        step: int,
        metrics: dict,
        train_seconds: float,
        checkpoint_metrics: dict | None = None,
        write_checkpoint: Callable[[Path, dict], None] | None = None,
    ) -> bool:
        """Count the step, log it, and checkpoint + evaluate when due; returns True if it checkpointed.

        ``write_checkpoint(folder, small)`` writes the checkpoint's model, optimizer and ``trainer_state.pt`` (``small``:
        counters and schedule, :func:`trainer_state`) into ``folder``: the process that holds the weights does (a Ray
        learner); by default this session writes its own (:meth:`write_own_checkpoint`). This process then renames the
        folder into place and records its path only.
        """
        cfg = self.plan.config
        self.scheduler.step()
        if self.student is not None:
            self.student.version = step
        self.state.step = step
        self.state.samples_seen += int(metrics["samples"])
        self.state.tokens_seen += int(metrics["model_tokens"])
        self.state.train_seconds += train_seconds
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.store.log_step(self.run_id, step, metrics)
        if warning := enforce_finite(metrics, step, self.plan.method.name, cfg.trainer.on_nonfinite):  # raises under "stop", once recorded
            self.console.print(f"[yellow]warning:[/] {warning}")
        if step % cfg.trainer.checkpoint_every and step != cfg.trainer.steps:
            return False
        target = checkpoint_dir(self.store.run_dir(self.run_id), step)
        staged = staging_dir(target)
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        (write_checkpoint or self.write_own_checkpoint)(staged, trainer_state(self.state, self.scheduler.state_dict()))
        path = publish_checkpoint(staged, target)
        self.weights_path = str(path)
        self.store.add_checkpoint(
            self.run_id, step, path=str(path), samples_seen=self.state.samples_seen, train_seconds=self.state.train_seconds,
            metrics={"tokens_seen": self.state.tokens_seen, **(checkpoint_metrics or {})},
        )  # fmt: skip
        self.evaluate(self.run_id, step, self.student, label="student")
        return True

    def write_own_checkpoint(self, folder: Path, small: dict) -> None:
        """Write this session's student, tokenizer, optimizer and method state (in process) into ``folder``."""
        from opd_harness.models.tiny import save_model_and_tokenizer
        from opd_harness.trainers.checkpoint import OPTIMIZER_FILE

        save_model_and_tokenizer(self.student.model, self.student.tokenizer, folder)
        torch.save(self.optimizer.state_dict(), Path(folder) / OPTIMIZER_FILE)
        extra = {"method_state": self.method_state.state_dict()} if self.method_state is not None else {}
        write_state(folder, {**small, "extra": extra})

    def evaluate(self, run_id: str, step: int, backend: HFBackend, *, label: str, model: str | None = None) -> None:
        """Evaluate on every configured eval task that has no stored result yet for (run, step)."""
        cfg, store = self.plan.config, self.store
        if model is not None and store.get_run(run_id) is None:
            store.create_run(
                run_id, kind="eval", config={"eval": cfg.eval.model_dump(), "model": model}, task=",".join(cfg.eval.tasks), model=model
            )
        for task in self.plan.eval_tasks:
            if store.has_eval(run_id, step, task.name):
                continue
            k = cfg.eval.k or task.options.k
            problems = self.plan.eval_problems[task.name]
            sampling = SamplingParams(
                temperature=cfg.eval.temperature, top_p=cfg.eval.top_p, max_new_tokens=task.options.max_new_tokens, seed=cfg.eval.seed
            )
            stage = ShardStage.of_run(store, run_id, step)  # a killed run's resume reuses finished shards
            if label == "teacher":
                runner = self.teacher_runner
            else:
                runner = self.shard_runner(self.weights_path, step) if self.shard_runner is not None else None
            result = evaluate_task(backend, task, problems, k=k, sampling=sampling, n_resamples=cfg.eval.n_resamples, stage=stage,
                                   shard_size=cfg.eval.shard_size, runner=runner)  # fmt: skip
            store_eval(store, run_id, step, result)
            stage.clear(task.name)
            s = result.summary
            self.console.print(
                f"  eval {label:<7} step {step:>5} {task.name}: Avg@{k} = {s['avg_at_k']:.3f} "
                f"[{s['ci_low']:.3f}, {s['ci_high']:.3f}] over {s['n_problems']} problems, {s['n_errors']} errors ({s['seconds']:.1f}s)"
                + (f"; {line}" if (line := describe_episodes(s)) else "")
            )
        if model is not None:
            store.set_status(run_id, "done")


def _last_checkpoint(store: Store, run_id: str) -> dict | None:
    """The newest checkpoint recorded in the store whose folder is complete on disk."""
    for ckpt in reversed(store.checkpoints(run_id)):
        if ckpt["path"] and Path(ckpt["path"]).exists():
            return ckpt
    return None
