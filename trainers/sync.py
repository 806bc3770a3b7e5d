"""Synchronous pipeline: rollout(student) → teacher scoring → objective → AdamW step; checkpoint and
evaluate every N steps. The loop body reads like the method; every phase is timed into the metrics.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import torch
from rich.console import Console
from tqdm import tqdm

from harness.backends import SamplingParams
from harness.backends.hf import HFBackend
from harness.evaluation import evaluate_task, store_eval
from harness.registry import PIPELINES
from harness.rollout import reference_trajectories, rollout
from harness.store import Store
from harness.timing import timed
from harness.trajectory import TensorBatch, to_tensor_batch
from trainers.checkpoint import TrainState, checkpoint_dir, load_checkpoint, save_checkpoint
from trainers.learner import train_step
from trainers.warmup import prepare_model

TEACHER_SUFFIX = ".teacher"


class SyncPipeline:
    """The in-process synchronous pipeline (policy lag is always 0)."""

    name = "sync"

    def provides(self, task) -> frozenset[str]:
        """Inputs this pipeline can give an objective for ``task``."""
        inputs = {"behaviour_logprobs", "teacher_logprobs", "teacher_full", "student_full", "step_boundaries", "policy_lag", "reference_responses"}
        if task.provides_reward:
            inputs.add("rewards")
        return frozenset(inputs)

    def warnings(self, method, hparams, task) -> list[str]:
        if "policy_lag" in method.needs(hparams):
            return [f"method {method.name!r} uses policy lag, which is always 0 in sync mode (freshness weighting is inactive)"]
        return []

    def run(self, plan, store: Store, run_id: str, *, resume: bool = False, console: Console | None = None) -> None:
        run_sync(plan, store, run_id, resume=resume, console=console or Console(stderr=True))


PIPELINES.add("sync", SyncPipeline())


def _optimizer_factory(cfg):
    return lambda model: torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)


def _scheduler_factory(cfg):
    warmup = cfg.trainer.warmup_steps
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)


def run_sync(plan, store: Store, run_id: str, *, resume: bool, console: Console) -> None:
    """Train ``plan.method`` on ``plan.task`` and evaluate every checkpoint into ``store``."""
    cfg = plan.config
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    run_dir = store.run_dir(run_id)
    teacher_model, tokenizer, teacher_path = prepare_model(cfg.teacher, "teacher", plan.task, store.root)
    student_model, student_tok, _ = prepare_model(cfg.student, "student", plan.task, store.root)
    if student_tok.get_vocab() != tokenizer.get_vocab():
        raise ValueError("student and teacher tokenizers differ; per-token distillation needs a shared vocabulary")
    optimizer_factory, scheduler_factory = _optimizer_factory(cfg), _scheduler_factory(cfg)
    state = TrainState()
    method_state = plan.method.make_state(plan.hparams) if plan.method.make_state else None
    last = _last_checkpoint(store, run_id) if resume else None
    if last is not None:
        student_model, student_tok, optimizer, scheduler, state, extra = load_checkpoint(Path(last["path"]), optimizer_factory, scheduler_factory)
        if method_state is not None:
            method_state.load_state_dict(extra["method_state"])
        console.print(f"[bold]resuming[/] {run_id} from step {state.step} ({last['path']})")
    else:
        optimizer, scheduler = optimizer_factory(student_model), None
        scheduler = scheduler_factory(optimizer)
    store.delete_steps_after(run_id, state.step)
    student = HFBackend(student_model, student_tok, batch_size=cfg.trainer.generate_batch_size)
    student.version = state.step
    teacher = HFBackend(teacher_model, tokenizer, batch_size=cfg.trainer.generate_batch_size)
    teacher_model.requires_grad_(False)

    if cfg.eval.teacher:
        _evaluate(plan, store, run_id + TEACHER_SUFFIX, 0, teacher, console, label="teacher", model=teacher_path)
    if state.step == 0 and cfg.eval.before_training:
        _evaluate(plan, store, run_id, 0, student, console, label="student")
    elif state.step > 0:
        _evaluate(plan, store, run_id, state.step, student, console, label="student")  # finishes an interrupted eval

    estimator = getattr(plan.hparams, "estimator", None)
    console.print(f"training: method={plan.method.name}" + (f" estimator={estimator}" if estimator else "") + f", {cfg.trainer.steps} steps")
    train_problems = plan.task.load("train" if "train" in plan.task.splits else "test")
    bar = tqdm(range(state.step + 1, cfg.trainer.steps + 1), desc=f"train {plan.method.name}", initial=state.step, total=cfg.trainer.steps, dynamic_ncols=True)
    for step in bar:
        metrics = training_step(plan, student, teacher, optimizer, train_problems, step, method_state)
        scheduler.step()
        student.version = step
        state.step = step
        state.samples_seen += int(metrics["samples"])
        state.tokens_seen += int(metrics["model_tokens"])
        state.train_seconds += metrics["time_step_s"]
        metrics["lr"] = scheduler.get_last_lr()[0]
        store.log_step(run_id, step, metrics)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", kl=f"{metrics['teacher_kl']:.3f}" if "teacher_kl" in metrics else "-")
        if step % cfg.trainer.checkpoint_every == 0 or step == cfg.trainer.steps:
            extra = {"method_state": method_state.state_dict()} if method_state is not None else {}
            path = save_checkpoint(run_dir, state, student_model, student_tok, optimizer, scheduler, extra)
            store.add_checkpoint(run_id, step, path=str(path), samples_seen=state.samples_seen, train_seconds=state.train_seconds,
                                 metrics={"tokens_seen": state.tokens_seen})  # fmt: skip
            _evaluate(plan, store, run_id, step, student, console, label="student")
    bar.close()
    store.set_status(run_id, "done")


def training_step(plan, student: HFBackend, teacher: HFBackend, optimizer, train_problems: list, step: int, method_state=None) -> dict[str, float]:
    """One step: sample prompts, roll out (or take references), score with the teacher, update."""
    cfg, task, method, hparams = plan.config, plan.task, plan.method, plan.hparams
    needs = method.needs(hparams)
    metrics: dict[str, float] = {}
    started = time.perf_counter()
    rng = random.Random(cfg.seed * 1_000_003 + step)  # prompts depend only on (seed, step): exact resume
    problems = rng.sample(train_problems, min(cfg.trainer.prompts_per_step, len(train_problems)))
    with timed("generate", metrics):
        if method.on_policy:
            params = SamplingParams(
                temperature=cfg.trainer.temperature,
                top_p=cfg.trainer.top_p,
                max_new_tokens=cfg.trainer.max_new_tokens or task.options.max_new_tokens,
                n=cfg.trainer.samples_per_prompt,
                seed=cfg.seed * 1_000_003 + step,
            )
            trajectories = rollout(student, task, problems, params)
        else:
            trajectories = reference_trajectories(task, problems, student.tokenizer)
    if "rewards" in needs:
        with timed("reward", metrics):
            by_id = {p.id: p for p in problems}
            scores = task.grade_many([by_id[t.problem_id] for t in trajectories], [t.completion_text for t in trajectories])
            for traj, score in zip(trajectories, scores, strict=True):
                traj.reward = score.value
            metrics["reward_mean"] = sum(s.value for s in scores) / len(scores)
    batch = to_tensor_batch(trajectories, student.pad_id)
    known = batch.policy_version >= 0  # reference responses have no behaviour version
    batch.policy_lag = torch.where(known, student.version - batch.policy_version, 0).clamp(min=0)  # 0 in sync mode
    if needs & {"teacher_logprobs", "teacher_full"}:
        with timed("teacher", metrics):
            score_teacher(teacher, batch, full="teacher_full" in needs)
    with timed("train", metrics):
        metrics.update(train_step(student.model, optimizer, batch, method, hparams, method_state, grad_clip=cfg.trainer.grad_clip))
    metrics["time_step_s"] = time.perf_counter() - started
    lengths = batch.loss_mask.sum(-1)
    metrics.update(
        samples=float(len(trajectories)),
        model_tokens=float(lengths.sum()),
        response_length=float(lengths.mean()),
        samples_per_s=len(trajectories) / metrics["time_step_s"],
        tokens_per_s=float(lengths.sum()) / metrics["time_step_s"],
    )
    return metrics


@torch.no_grad()
def score_teacher(teacher: HFBackend, batch: TensorBatch, *, full: bool) -> None:
    """Fill the teacher's log-probs (and full distribution when asked) into ``batch``."""
    scores = teacher.score(batch.input_ids, batch.attention_mask, want=("logprobs", "full") if full else ("logprobs",))
    batch.teacher_logprobs = scores["logprobs"] * batch.loss_mask
    batch.teacher_full = scores.get("full")


def _last_checkpoint(store: Store, run_id: str) -> dict | None:
    """The newest checkpoint recorded in the store whose folder is complete on disk."""
    for ckpt in reversed(store.checkpoints(run_id)):
        if ckpt["path"] and Path(ckpt["path"]).exists():
            return ckpt
    return None


def _evaluate(plan, store: Store, run_id: str, step: int, backend: HFBackend, console: Console, *, label: str, model: str | None = None) -> None:
    """Evaluate on every configured eval task that has no stored result yet for (run, step)."""
    cfg = plan.config
    if model is not None and store.get_run(run_id) is None:
        store.create_run(run_id, kind="eval", config={"eval": cfg.eval.model_dump(), "model": model}, task=",".join(cfg.eval.tasks), model=model)
    for task in plan.eval_tasks:
        if store.has_eval(run_id, step, task.name):
            continue
        k = cfg.eval.k or task.options.k
        problems = task.load("test")[: cfg.eval.limit] if cfg.eval.limit else task.load("test")
        sampling = SamplingParams(temperature=cfg.eval.temperature, top_p=cfg.eval.top_p, max_new_tokens=task.options.max_new_tokens, seed=cfg.eval.seed)
        result = evaluate_task(backend, task, problems, k=k, sampling=sampling, n_resamples=cfg.eval.n_resamples)
        store_eval(store, run_id, step, result)
        s = result.summary
        console.print(
            f"  eval {label:<7} step {step:>5} {task.name}: Avg@{k} = {s['avg_at_k']:.3f} "
            f"[{s['ci_low']:.3f}, {s['ci_high']:.3f}] over {s['n_problems']} problems, {s['n_errors']} errors ({s['seconds']:.1f}s)"
        )
    if model is not None:
        store.set_status(run_id, "done")
