"""Rollout: drive a backend through task environments and collect trajectories.

One code path serves evaluation and training (so what is evaluated is what is trained on): both call
:func:`rollout`. Episodes are scheduled independently: each advances as soon as its own environment step
returns. The episodes whose step (or opening) has returned are generated together (one call per distinct set
of stop strings); the generator waits for more only while steps keep returning (a ``batch_window_s`` idle gap)
or until none is left running, so a slow step holds up only its own episode. Environment openings, steps and
closes run in a bounded thread pool. Every environment is closed, whatever happens (interrupts included); an
episode's environment is closed as soon as the episode ends. When a model generates (not a replay), each environment's
``prepare`` runs right after its opening, so what its first step needs (a container) starts during the first generation.

Determinism: with ``params.seed`` every turn of every episode samples with its own seed, :func:`turn_seed`
of (seed, task, problem id, its occurrence among equal ids, sample index, turn), passed to the backend as
``SamplingParams.seeds``. An episode's sampling therefore does not depend on which episodes share its
generation call, on their order, on how a batch is split into rollout calls, or on the environments' timing.

Per episode the trajectory records ``metadata["episode"]``: ``turns``, ``stop_reason`` (``done``,
``max_turns``, ``context`` or ``env_error``) and the environment's counters (``tool_calls``,
``invalid_tool_calls``, ``tool_errors``, ...), and ``timings``: ``generate_s`` (its share of each batched
generation), ``env_s`` and, once graded, ``grade_s``. An environment that raises is an infrastructure
failure of that episode (``metadata["env_error"]``), graded ``error``, never a fail.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from opd_harness.backends import Backend, Completion, SamplingParams
from opd_harness.episode import Env, Observation, render_observation
from opd_harness.task import Problem, Task
from opd_harness.trajectory import Segment, Trajectory

DEFAULT_ENV_WORKERS = 16  # concurrent environment steps (tool calls) across the live episodes
DEFAULT_BATCH_WINDOW_S = 0.01  # how long generation waits for another step to return before it starts without it


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (prompts carry their own template)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Episode:
    """A live episode: its environment, its trajectory so far, and the rollout's own counters."""

    problem: Problem
    traj: Trajectory
    occurrence: int = 0  # how many earlier episodes of this rollout share the problem id and sample index
    env: Env | None = None
    live: bool = True
    counters: dict[str, float] = field(default_factory=dict)

    @property
    def context(self) -> list[int]:
        return self.traj.prompt_ids + self.traj.response_ids

    @property
    def turn(self) -> int:
        """The model turn the episode generates next (0 first)."""
        return self.traj.num_steps

    def end(self, reason: str) -> None:
        self.live = False
        self.traj.metadata.setdefault("episode", {})["stop_reason"] = reason

    def fail(self, stage: str, exc: BaseException) -> None:
        self.traj.metadata["env_error"] = f"{stage}: {type(exc).__name__}: {exc}"
        self.end("env_error")


def rollout(
    backend: Backend,
    task: Task,
    problems: list[Problem],
    params: SamplingParams,
    *,
    env_workers: int = DEFAULT_ENV_WORKERS,
    batch_window_s: float = DEFAULT_BATCH_WINDOW_S,
) -> list[Trajectory]:
    """``params.n`` episodes per problem, ordered problem-major; returns ungraded trajectories.

    The single entry point of evaluation and training. A task that answers by scoring instead of generating
    (lm-eval's multiple-choice tasks) overrides ``Task.rollout(backend, problems, params)`` and is routed to it here."""
    own = task.rollout(backend, problems, params)
    if own is not None:
        return own
    return run_episodes(backend, task, problems, params, env_workers=env_workers, batch_window_s=batch_window_s)


def run_episodes(
    backend: Backend,
    task: Task,
    problems: list[Problem],
    params: SamplingParams,
    *,
    env_workers: int = DEFAULT_ENV_WORKERS,
    batch_window_s: float = DEFAULT_BATCH_WINDOW_S,
) -> list[Trajectory]:
    """The episode scheduler: open every episode, then, until none is live or running, generate for the episodes whose
    opening or step has returned and hand each one's turn to its environment, without waiting for the others."""
    tokenizer = backend.tokenizer
    use_template = task.options.use_chat_template
    budgeted = getattr(backend, "counts_tokens", True)  # replayed turns are characters, not the model's tokens: no token budgets
    limit = context_limit(backend, task) if budgeted else None
    prepare = generates(backend)
    episodes = new_episodes(task, problems, params.n)
    closes: dict[int, Future] = {}  # episode index -> its close, submitted when the episode ended
    finished = False
    pool = ThreadPoolExecutor(max_workers=max(1, env_workers), thread_name_prefix="env")
    try:
        running: dict[Future, int] = {pool.submit(open_episode, e, task, tokenizer, limit, prepare): i for i, e in enumerate(episodes)}
        while running:
            ready = returned(running, batch_window_s)
            live = [i for i in ready if episodes[i].live]
            generate_ready(backend, [episodes[i] for i in live], params, limit, fit=budgeted)
            for i in ready:
                if episodes[i].live:
                    running[pool.submit(step_episode, episodes[i], tokenizer, use_template, limit)] = i
                else:
                    closes[i] = pool.submit(close_episode, episodes[i])
        for future in closes.values():
            future.result()
        finished = True
    finally:
        if not finished:  # interrupted (Ctrl-C, SIGTERM, a failed generation): close at once, no outcomes to wait for
            pool.shutdown(wait=False, cancel_futures=True)  # no queued opening or step starts any more
            close_interrupted(episodes, closes)
        pool.shutdown(wait=True)
    return [e.traj for e in episodes]


def new_episodes(task: Task, problems: list[Problem], n: int) -> list[Episode]:
    """``n`` episodes per problem, problem-major; a problem id met again counts as a further occurrence (its own seeds)."""
    seen: Counter[str] = Counter()
    episodes = []
    for problem in problems:
        occurrence = seen[problem.id]
        seen[problem.id] += 1
        for s in range(n):
            traj = Trajectory(task=task.name, problem_id=problem.id, sample_index=s, prompt_ids=[])
            episodes.append(Episode(problem, traj, occurrence=occurrence))
    return episodes


def returned(running: dict[Future, int], window_s: float) -> list[int]:
    """The episodes (indices, ascending) whose opening or step has returned: wait for the first, then take more for as
    long as another returns within ``window_s`` of the last and some are still running. A worker's exception is raised."""
    done, pending = wait(running, return_when=FIRST_COMPLETED)
    while pending:
        more, pending = wait(pending, timeout=window_s, return_when=FIRST_COMPLETED)
        if not more:
            break
        done |= more
    for future in done:
        future.result()
    return sorted(running.pop(future) for future in done)


def close_interrupted(episodes: list[Episode], closes: dict[int, Future]) -> None:
    """Close, concurrently and without collecting outcomes, every environment whose close has not started (a cancelled
    one included; steps still running are not waited for: closing their environment is what stops them)."""
    todo = [e for i, e in enumerate(episodes) if i not in closes or closes[i].cancel()]
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), DEFAULT_ENV_WORKERS)), thread_name_prefix="env-close") as closer:
        list(closer.map(lambda e: close_episode(e, collect=False), todo))


def turn_seed(seed: int, episode: Episode) -> int:
    """The sampling seed of an episode's next turn: a 31-bit hash (as ``derive_seed``'s, what servers accept) of (seed,
    task, problem id, occurrence, sample, turn), stable across runs, platforms and batch compositions."""
    t = episode.traj
    key = f"{seed}:{t.task}:{t.problem_id}:{episode.occurrence}:{t.sample_index}:{episode.turn}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % (2**31 - 1)


def context_limit(backend: Backend, task: Task) -> int | None:
    """The most tokens a context may hold: the task's ``max_context_tokens`` and the model's own limit, whichever is smaller."""
    limits = [getattr(task.options, "max_context_tokens", None), getattr(backend, "max_context", None)]
    known = [int(x) for x in limits if x]
    return min(known) if known else None


class ContextOverflow(ValueError):
    """An episode's opening context leaves no room for the model's first token: the model was never asked."""


def generates(backend: Backend) -> bool:
    """Whether the backend's turns take a model's time (environments then ``prepare`` during the first generation); one
    that serves stored turns (replay) answers at once, and a stored prediction may need no sandbox at all."""
    return not getattr(backend, "needs_episode_keys", False)


def open_episode(episode: Episode, task: Task, tokenizer, limit: int | None = None, prepare: bool = False) -> None:
    """Create the environment and take its opening context, then (``prepare``) let it start what its first step needs
    while the model generates; a failure, or an opening context that does not fit the budget, ends the episode as an
    ``error`` (not measured), never as the model's fail."""
    started = time.perf_counter()
    try:
        episode.env = task.env(episode.problem, tokenizer)
        prompt = episode.env.reset()
        episode.traj.prompt_text = prompt
        episode.traj.prompt_ids = encode(tokenizer, prompt)
        if limit is not None and len(episode.traj.prompt_ids) >= limit:
            raise ContextOverflow(
                f"the opening context is {len(episode.traj.prompt_ids)} tokens, the context budget {limit} "
                "(the smaller of the model's positions and the task's max_context_tokens); raise the model's context or shorten the prompt"
            )
        if prepare:
            episode.env.prepare()
    except Exception as exc:  # noqa: BLE001 - one broken environment must not take the batch down
        episode.fail("reset", exc)
    add_time(episode.traj, "env_s", time.perf_counter() - started)


def generate_ready(backend: Backend, ready: list[Episode], params: SamplingParams, limit: int | None, *, fit: bool = True) -> None:
    """One batched generation per distinct set of stop strings for the ready episodes (each at its own turn, with its own
    seed); each completion becomes the episode's next model segment (cut to its token budget when ``fit``). An episode at
    its ``max_turns`` or out of context room ends instead."""
    groups: dict[tuple[str, ...], list[Episode]] = {}
    for episode in ready:
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
        seeds = None if params.seed is None else tuple(turn_seed(params.seed, e) for e in group)
        turn_params = params.model_copy(update={"n": 1, "stop": stop, "max_new_tokens": max(rooms), "seeds": seeds})
        started = time.perf_counter()
        completions = generate(backend, [e.context for e in group], turn_params, [episode_key(e, e.turn) for e in group])
        share = (time.perf_counter() - started) / len(group)
        for episode, completion, room in zip(group, completions, rooms, strict=True):
            if fit:
                completion = fit_completion(backend.tokenizer, completion, room)
            episode.traj.segments.append(
                Segment(
                    kind="model",
                    token_ids=completion.token_ids,
                    text=completion.text,
                    step=episode.turn,
                    policy_version=backend.version,
                    behaviour_logprobs=completion.logprobs or None,  # a backend asked for none returns []: unknown, not wrong
                    finish_reason=completion.finish_reason,
                    top_ids=completion.top_ids,
                )
            )
            add_time(episode.traj, "generate_s", share)


def generate(
    backend: Backend, contexts: list[list[int]], params: SamplingParams, keys: list[tuple[str, str, int, int]]
) -> list[Completion]:
    """``backend.generate``; a backend that serves stored turns (replay) also gets each episode's (task, id, sample, turn)."""
    if getattr(backend, "needs_episode_keys", False):
        return backend.generate(contexts, params, keys=keys)
    return backend.generate(contexts, params)


def episode_key(episode: Episode, turn: int) -> tuple[str, str, int, int]:
    return (episode.traj.task, episode.traj.problem_id, episode.traj.sample_index, turn)


def fit_completion(tokenizer, completion: Completion, room: int) -> Completion:
    """Cut a completion that would overrun its episode's context budget (finish reason ``length``)."""
    if len(completion.token_ids) <= room:
        return completion
    ids = completion.token_ids[:room]
    return Completion(
        ids,
        completion.logprobs[:room],
        tokenizer.decode(ids, skip_special_tokens=True),
        "length",
        completion.prompt_index,
        completion.sample_index,
        top_ids=completion.top_ids[:room] if completion.top_ids is not None else None,
    )


def step_episode(episode: Episode, tokenizer, use_template: bool, limit: int | None) -> None:
    """Hand the episode's last model turn to its environment and append the observation as environment tokens.

    An observation that does not fit the context budget with room for another token cannot be put back into
    the context: it counts as an invalid tool call and ends the episode (``stop_reason`` ``context``). An
    environment that says ``done`` ends the episode whatever its last observation (``done``; one that does not
    fit is left out, and is no overflow: the model would never have read it)."""
    started = time.perf_counter()
    try:
        result = episode.env.step(episode.traj.segments[-1].text)
        observation = None if result.observation is None else observation_segment(result.observation, tokenizer, use_template)
    except Exception as exc:  # noqa: BLE001 - an environment failure is this episode's infrastructure error
        episode.fail("step", exc)
        return
    finally:
        add_time(episode.traj, "env_s", time.perf_counter() - started)
    fits = observation is None or limit is None or len(episode.context) + len(observation.token_ids) < limit
    if observation is not None and fits:
        episode.traj.segments.append(observation)
    if result.done:
        episode.end("done")
    elif not fits:
        episode.counters["context_overflows"] = episode.counters.get("context_overflows", 0) + 1
        episode.end("context")


def observation_segment(observation: Observation, tokenizer, use_template: bool) -> Segment:
    """The environment tokens of an observation, rendered in the role the model expects."""
    text = render_observation(observation, tokenizer, use_template)
    return Segment(kind="env", token_ids=encode(tokenizer, text), text=text)


def close_episode(episode: Episode, *, collect: bool = True) -> None:
    """Record the episode's counters and (when ``collect``) its outcome, then close its environment. A failure to
    collect the outcome is the episode's infrastructure error (graded ``error``); a failure to close is recorded;
    neither is raised. An interrupted rollout does not collect: an outcome may wait on a command still running."""
    stats = episode.traj.metadata.setdefault("episode", {})
    stats["turns"] = episode.traj.num_steps
    stats.setdefault("stop_reason", "done" if not episode.live else "interrupted")
    overflows = episode.counters.get("context_overflows", 0)
    if overflows:
        stats["context_overflows"] = overflows
    if episode.env is None:
        return
    try:
        stats.update(episode.env.metrics())
        if collect:
            episode.traj.metadata["outcome"] = episode.env.outcome()
    except Exception as exc:  # noqa: BLE001 - e.g. the sandbox died before the agent's patch could be read
        episode.traj.metadata["env_error"] = f"outcome: {type(exc).__name__}: {exc}"
    finally:
        if overflows:
            stats["invalid_tool_calls"] = stats.get("invalid_tool_calls", 0) + overflows
        try:
            episode.env.close()
        except Exception as exc:  # noqa: BLE001 - the other environments must still be closed
            episode.traj.metadata["close_error"] = f"{type(exc).__name__}: {exc}"


def add_time(traj: Trajectory, name: str, seconds: float) -> None:
    traj.timings[name] = traj.timings.get(name, 0.0) + seconds


def reference_trajectories(task: Task, problems: list[Problem], tokenizer) -> list[Trajectory]:
    """Teacher-forced trajectories from each problem's reference (for SFT).

    A multi-turn reference (``problem.meta["reference_turns"]``: ``[{"model": text, "observation": {"content",
    "role", "raw"} or null}, ...]``) becomes model segments (one step each) interleaved with the observations,
    rendered exactly as a live episode would render them; otherwise ``problem.solution`` is one model turn."""
    use_template = task.options.use_chat_template
    out = []
    for problem in problems:
        turns = problem.meta.get("reference_turns") or ([{"model": problem.solution}] if problem.solution is not None else None)
        if not turns:
            raise ValueError(f"{task.name} problem {problem.id} has no reference solution to train on")
        env = task.env(problem, tokenizer)
        try:
            prompt = env.reset()
        finally:
            env.close()
        segments: list[Segment] = []
        for step, turn in enumerate(turns):
            ids = encode(tokenizer, turn["model"]) + ([tokenizer.eos_token_id] if step == len(turns) - 1 else [])
            segments.append(Segment(kind="model", token_ids=ids, text=turn["model"], step=step))
            if turn.get("observation") and step < len(turns) - 1:
                segments.append(observation_segment(Observation(**turn["observation"]), tokenizer, use_template))
        out.append(
            Trajectory(
                task=task.name,
                problem_id=problem.id,
                sample_index=0,
                prompt_ids=encode(tokenizer, prompt),
                prompt_text=prompt,
                segments=segments,
            )
        )
    return out
