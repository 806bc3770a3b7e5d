# The lock-step episode loop as it was before independent scheduling (`git show main:harness/rollout.py` at e020b56: all
# live episodes generate, then all their environment steps run, then the next turn), kept only as the baseline of
# benchmarks/episode_scheduling.py. Not imported by harness/. The helpers it calls are today's opd_harness.rollout ones.
"""The lock-step turn loop of ``opd_harness.rollout.run_episodes`` before issue 25."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from opd_harness.backends import Backend, SamplingParams
from opd_harness.rollout import (
    DEFAULT_ENV_WORKERS,
    Episode,
    add_time,
    close_episode,
    context_limit,
    episode_key,
    fit_completion,
    generate,
    open_episode,
    step_episode,
)
from opd_harness.task import Problem, Task
from opd_harness.trajectory import Segment, Trajectory


def run_episodes(
    backend: Backend, task: Task, problems: list[Problem], params: SamplingParams, *, env_workers: int = DEFAULT_ENV_WORKERS
) -> list[Trajectory]:
    """The turn loop: open every episode, then generate for all live ones and step their environments, until none is live."""
    tokenizer = backend.tokenizer
    use_template = task.options.use_chat_template
    budgeted = getattr(backend, "counts_tokens", True)  # replayed turns are characters, not the model's tokens: no token budgets
    limit = context_limit(backend, task) if budgeted else None
    episodes = [
        Episode(problem, Trajectory(task=task.name, problem_id=problem.id, sample_index=s, prompt_ids=[]))
        for problem in problems
        for s in range(params.n)
    ]
    finished = False
    with ThreadPoolExecutor(max_workers=max(1, env_workers), thread_name_prefix="env") as pool:
        try:
            list(pool.map(lambda e: open_episode(e, task, tokenizer, limit), episodes))
            turn = 0
            while live := [e for e in episodes if e.live]:
                generate_turn(backend, live, params, turn, limit, fit=budgeted)
                list(pool.map(lambda e: step_episode(e, tokenizer, use_template, limit), [e for e in live if e.live]))
                turn += 1
            finished = True
        finally:  # interrupted (Ctrl-C, SIGTERM, a failed generation): close at once, no outcomes to wait for
            list(pool.map(lambda e: close_episode(e, collect=finished), episodes))
    return [e.traj for e in episodes]


def generate_turn(backend: Backend, live: list[Episode], params: SamplingParams, turn: int, limit: int | None, *, fit: bool = True) -> None:
    """One batched generation per distinct set of stop strings; each completion becomes the episode's next model segment
    (cut to the turn's token budget when ``fit``)."""
    groups: dict[tuple[str, ...], list[Episode]] = {}
    for episode in live:
        if episode.traj.num_steps >= episode.env.max_turns:
            episode.end("max_turns")
            continue
        room = None if limit is None else limit - len(episode.context)
        if room is not None and room <= 0:
            episode.end("context")
            continue
        groups.setdefault(tuple(dict.fromkeys((*params.stop, *episode.env.stop))), []).append(episode)
    for stop, group in groups.items():
        rooms = [params.max_new_tokens if limit is None else min(params.max_new_tokens, limit - len(e.context)) for e in group]
        turn_params = params.model_copy(
            update={"n": 1, "stop": stop, "max_new_tokens": max(rooms), "seed": None if params.seed is None else params.seed + turn}
        )
        started = time.perf_counter()
        completions = generate(backend, [e.context for e in group], turn_params, [episode_key(e, turn) for e in group])
        share = (time.perf_counter() - started) / len(group)
        for episode, completion, room in zip(group, completions, rooms, strict=True):
            if fit:
                completion = fit_completion(backend.tokenizer, completion, room)
            episode.traj.segments.append(
                Segment(
                    kind="model",
                    token_ids=completion.token_ids,
                    text=completion.text,
                    step=turn,
                    policy_version=backend.version,
                    behaviour_logprobs=completion.logprobs or None,  # a backend asked for none returns []: unknown, not wrong
                    finish_reason=completion.finish_reason,
                )
            )
            add_time(episode.traj, "generate_s", share)
