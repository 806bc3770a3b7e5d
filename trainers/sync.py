"""Synchronous pipeline: rollout(student) → teacher scoring → objective → AdamW step; checkpoint and
evaluate every N steps. The loop body reads like the method; every phase is timed into the metrics.
"""

from __future__ import annotations

import time

from rich.console import Console
from tqdm import tqdm

from harness.registry import PIPELINES
from harness.store import Store
from trainers.pipeline import Session, add_rates, learn, make_batch, response_lengths, sample_problems

BASE_INPUTS = frozenset({"behaviour_logprobs", "teacher_logprobs", "teacher_full", "student_full", "step_boundaries", "policy_lag", "reference_responses"})


def provided_inputs(task) -> frozenset[str]:
    """Inputs the in-process pipelines can give an objective for ``task``."""
    return BASE_INPUTS | ({"rewards"} if task.provides_reward else set())


class SyncPipeline:
    """The in-process synchronous pipeline (policy lag is always 0)."""

    name = "sync"

    def provides(self, task) -> frozenset[str]:
        return provided_inputs(task)

    def warnings(self, method, hparams, task) -> list[str]:
        if "policy_lag" in method.needs(hparams):
            return [f"method {method.name!r} uses policy lag, which is always 0 in sync mode (freshness weighting is inactive)"]
        return []

    def run(self, plan, store: Store, run_id: str, *, resume: bool = False, console: Console | None = None) -> None:
        console = console or Console(stderr=True)
        if plan.config.trainer.executor == "ray":  # the async schedule with max_lag 0 is the synchronous one
            from trainers.ray_executor import run_ray

            run_ray(plan, store, run_id, resume=resume, console=console)
        else:
            run_sync(plan, store, run_id, resume=resume, console=console)


PIPELINES.add("sync", SyncPipeline())


def run_sync(plan, store: Store, run_id: str, *, resume: bool, console: Console) -> None:
    """Train ``plan.method`` on ``plan.task`` and evaluate every checkpoint into ``store``."""
    session = Session.open(plan, store, run_id, resume=resume, console=console)
    session.evaluate_start()
    steps = plan.config.trainer.steps
    bar = tqdm(range(session.state.step + 1, steps + 1), desc=f"train {plan.method.name}", initial=session.state.step, total=steps, dynamic_ncols=True)
    for step in bar:
        metrics: dict[str, float] = {}
        started = time.perf_counter()
        problems = sample_problems(plan.config, session.train_problems, step)
        batch, _ = make_batch(plan, session.student, session.teacher, problems, step, metrics)
        learn(plan, session.student.model, session.optimizer, batch, session.method_state, session.student.version, metrics)
        add_rates(metrics, response_lengths(batch), time.perf_counter() - started)
        session.record_step(step, metrics, metrics["time_step_s"])
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", kl=f"{metrics['teacher_kl']:.3f}" if "teacher_kl" in metrics else "-")
    bar.close()
    store.set_status(run_id, "done")
