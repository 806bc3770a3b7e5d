"""Rollout: drive a backend through task environments and collect trajectories.

One code path serves evaluation and training (so what is evaluated is what is trained on). All
live episodes are batched together each turn; a single-turn task finishes after one turn.
"""

from __future__ import annotations

import time

from harness.backends import Backend, SamplingParams
from harness.trajectory import Segment, Trajectory


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (prompts carry their own template)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def rollout(backend: Backend, task, problems: list, params: SamplingParams, *, max_turns: int = 1) -> list[Trajectory]:
    """``params.n`` episodes per problem, ordered problem-major; returns ungraded trajectories."""
    tokenizer = backend.tokenizer
    one_sample = params.model_copy(update={"n": 1})
    episodes = []
    for problem in problems:
        for sample_index in range(params.n):
            env = task.env(problem, tokenizer)
            prompt = env.reset()
            traj = Trajectory(task=task.name, problem_id=problem.id, sample_index=sample_index, prompt_ids=encode(tokenizer, prompt), prompt_text=prompt)
            episodes.append((env, traj))
    live = list(range(len(episodes)))
    for turn in range(max_turns):
        if not live:
            break
        contexts = [episodes[i][1].prompt_ids + episodes[i][1].response_ids for i in live]
        seed = None if params.seed is None else params.seed + turn
        started = time.perf_counter()
        params_turn = one_sample.model_copy(update={"seed": seed})
        if getattr(backend, "needs_episode_keys", False):  # e.g. replay: serves stored completions by episode key
            keys = [(episodes[i][1].task, episodes[i][1].problem_id, episodes[i][1].sample_index) for i in live]
            completions = backend.generate(contexts, params_turn, keys=keys)
        else:
            completions = backend.generate(contexts, params_turn)
        per_episode = (time.perf_counter() - started) / max(len(live), 1)
        still_live = []
        for i, completion in zip(live, completions, strict=True):
            env, traj = episodes[i]
            traj.segments.append(
                Segment(
                    kind="model",
                    token_ids=completion.token_ids,
                    text=completion.text,
                    step=turn,
                    policy_version=backend.version,
                    behaviour_logprobs=completion.logprobs,
                    finish_reason=completion.finish_reason,
                )
            )
            traj.timings["generate_s"] = traj.timings.get("generate_s", 0.0) + per_episode
            observation, done = env.step(completion.text)
            if observation:
                traj.segments.append(Segment(kind="env", token_ids=encode(tokenizer, observation), text=observation))
            if not done:
                still_live.append(i)
        live = still_live
    return [traj for _, traj in episodes]


def reference_trajectories(task, problems: list, tokenizer) -> list[Trajectory]:
    """Teacher-forced trajectories from each problem's reference solution (for SFT)."""
    out = []
    for problem in problems:
        if problem.solution is None:
            raise ValueError(f"{task.name} problem {problem.id} has no reference solution to train on")
        prompt = task.env(problem, tokenizer).reset()
        response = encode(tokenizer, problem.solution) + [tokenizer.eos_token_id]
        out.append(
            Trajectory(
                task=task.name,
                problem_id=problem.id,
                sample_index=0,
                prompt_ids=encode(tokenizer, prompt),
                prompt_text=prompt,
                segments=[Segment(kind="model", token_ids=response, text=problem.solution, step=0)],
            )
        )
    return out
