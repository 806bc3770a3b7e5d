"""Independent episode scheduling: a slow environment step holds up only its own episode, and (with a seed) every
episode's trajectory is the same whichever episodes share its generation calls, in whatever order, with whatever
environment timings, and however the problems are split into rollout calls."""

from __future__ import annotations

import random
import threading
import time

import pytest

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.backends.replay import ReplayBackend
from opd_harness.episode import Env, Observation, StepResult
from opd_harness.rollout import rollout
from opd_harness.task import Problem, Score, Task, TaskOptions


class TimedOptions(TaskOptions):
    turns: int = 3  # model turns before the environment says done
    problems: int = 6
    slow: dict[str, float] = {}  # "problem id:turn" -> seconds that step sleeps
    jitter_seed: int | None = None  # heavy-tailed random step times: 5 % of steps 20x slower
    base_s: float = 0.002


class TimedEnv(Env):
    """Answers every model turn with ``[obs N]``, sleeping as the options say; records when its steps ran and its close."""

    stop = ("#",)
    max_turns = 10

    def __init__(self, task: "TimedTask", problem: Problem, prompt: str) -> None:
        self.task, self.problem, self.prompt, self.n = task, problem, prompt, 0
        self.closed_at: float | None = None
        self.rng = random.Random(f"{task.options.jitter_seed}:{problem.id}")
        task.envs.append(self)

    def reset(self) -> str:
        return self.prompt

    def step_seconds(self) -> float:
        opts = self.task.options
        fixed = opts.slow.get(f"{self.problem.id}:{self.n}")
        if fixed is not None:
            return fixed
        if opts.jitter_seed is None:
            return 0.0
        return opts.base_s * (20 if self.rng.random() < 0.05 else 1)

    def step(self, model_text: str) -> StepResult:
        started = time.perf_counter()
        time.sleep(self.step_seconds())
        self.n += 1
        with self.task.lock:
            self.task.steps.append((self.problem.id, self.n, started, time.perf_counter()))
        if self.n >= self.task.options.turns:
            return StepResult(None, True)
        return StepResult(Observation(f"[obs {self.n}]", role="inline"), False)

    def close(self) -> None:
        self.closed_at = time.perf_counter()


class TimedTask(Task):
    name = "timed"
    description = "test task with chosen environment step times"
    Options = TimedOptions
    multi_turn = True

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.envs: list[TimedEnv] = []
        self.steps: list[tuple[str, int, float, float]] = []  # (problem id, step number, started, returned)
        self.lock = threading.Lock()

    def read_problems(self, split, data_dir):
        return [Problem(id=f"p{i}", question=f"Q{i}:", answer="x") for i in range(self.options.problems)]

    def env(self, problem, tokenizer) -> TimedEnv:
        return TimedEnv(self, problem, self.format_prompt(problem, tokenizer))

    def grade_many(self, problems, completions):
        return [Score("pass") for _ in completions]

    @property
    def grader(self):
        return ("timed", "1")


def test_a_fast_episode_finishes_all_its_turns_while_a_slow_step_still_runs():
    """p0's first step takes 1.5 s; p1's three turns (two more generations) are done and its environment closed before
    that step returns. (The lock-step loop made p1's second generation wait for p0's step.)"""
    task = TimedTask(TimedOptions(turns=3, problems=2, slow={"p0:0": 1.5}))
    replay = ReplayBackend({(task.name, p.id): [["a#", "b#", "c#"]] for p in task.load()})
    (slow, fast) = rollout(replay, task, task.load(), SamplingParams())
    assert [t.num_steps for t in (slow, fast)] == [3, 3]
    assert [t.metadata["episode"]["stop_reason"] for t in (slow, fast)] == ["done", "done"]
    slow_returned = next(end for pid, n, _, end in task.steps if (pid, n) == ("p0", 1))
    fast_done = next(end for pid, n, _, end in task.steps if (pid, n) == ("p1", 3))
    fast_env = next(e for e in task.envs if e.problem.id == "p1")
    assert fast_done < slow_returned and fast_env.closed_at < slow_returned  # closed as soon as it ended
    assert all(e.closed_at is not None for e in task.envs)


def test_an_interrupted_rollout_closes_every_environment_at_once_even_one_whose_step_runs():
    """Generation fails (Ctrl-C) while p0's 1.5 s step runs: every environment is closed, p0's before its step returns."""
    task = TimedTask(TimedOptions(turns=3, problems=2, slow={"p0:0": 1.5}))
    replay = ReplayBackend({(task.name, p.id): [["a#", "b#", "c#"]] for p in task.load()})
    calls = []

    def interrupted(prompts, params, keys=None):
        calls.append(keys)
        if len(calls) == 2:  # p1's second turn, p0's first step still running
            raise KeyboardInterrupt
        return ReplayBackend.generate(replay, prompts, params, keys=keys)

    replay.generate = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        rollout(replay, task, task.load(), SamplingParams())
    slow_env = next(e for e in task.envs if e.problem.id == "p0")
    slow_returned = next(end for pid, n, _, end in task.steps if (pid, n) == ("p0", 1))
    assert all(e.closed_at is not None for e in task.envs) and slow_env.closed_at < slow_returned


@pytest.fixture
def sampler(tiny_model_factory, char_tokenizer):
    return HFBackend(tiny_model_factory(seed=5), char_tokenizer, batch_size=16)


def tokens(trajectories) -> list[list[int]]:
    return [t.prompt_ids + t.response_ids for t in trajectories]


def logprobs(trajectory) -> list[float]:
    return [v for s in trajectory.model_segments for v in s.behaviour_logprobs]


def test_a_seeded_episode_is_the_same_alone_in_a_batch_reordered_split_or_under_heavy_tailed_timings(sampler):
    params = SamplingParams(temperature=1.0, max_new_tokens=3, n=2, seed=7)
    calm = TimedTask(TimedOptions(turns=2, problems=3))
    problems = calm.load()
    together = rollout(sampler, calm, problems, params)
    assert len({tuple(t) for t in tokens(together)}) == len(together)  # every episode (and sample) samples its own tokens
    by_key = {(t.problem_id, t.sample_index): t for t in together}

    alone = [t for p in problems for t in rollout(sampler, TimedTask(TimedOptions(turns=2)), [p], params, env_workers=1)]
    reordered = rollout(sampler, TimedTask(TimedOptions(turns=2)), problems[::-1], params)
    split = [t for part in (problems[:1], problems[1:]) for t in rollout(sampler, TimedTask(TimedOptions(turns=2)), part, params)]
    stormy = TimedTask(TimedOptions(turns=2, problems=3, jitter_seed=1, base_s=0.01, slow={"p1:0": 0.4, "p2:1": 0.3}))
    tailed = rollout(sampler, stormy, problems, params)
    small_batches = rollout(HFBackend(sampler.model, sampler.tokenizer, batch_size=1), TimedTask(TimedOptions(turns=2)), problems, params)
    for other in (alone, reordered, split, tailed, small_batches):
        assert tokens(other) == tokens([by_key[(t.problem_id, t.sample_index)] for t in other])
        for t in other:
            mine = by_key[(t.problem_id, t.sample_index)]
            assert logprobs(t) == pytest.approx(logprobs(mine), abs=1e-5)  # the logits may differ in the last bits by batch shape


def test_the_episodes_of_a_repeated_problem_sample_apart(sampler):
    """Two occurrences of one problem id in a rollout are two episodes, not one twice."""
    task = TimedTask(TimedOptions(turns=2, problems=1))
    (problem,) = task.load()
    first, second = rollout(sampler, task, [problem, problem], SamplingParams(temperature=1.0, max_new_tokens=6, seed=0))
    assert first.response_ids != second.response_ids


def test_hf_rows_sample_the_same_whatever_else_is_in_their_call(sampler):
    ids = [sampler.tokenizer(s, add_special_tokens=False)["input_ids"] for s in ("Q1:", "Q22:", "Q333:")]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, seed=0, seeds=(11, 12, 13))
    batch = sampler.generate(ids, params)
    alone = [sampler.generate([p], params.model_copy(update={"seeds": (s,)}))[0] for p, s in zip(ids, params.seeds)]
    assert [c.token_ids for c in batch] == [c.token_ids for c in alone]
    with pytest.raises(ValueError, match="seeds has 1 seeds for 3 prompts"):
        sampler.generate(ids, params.model_copy(update={"seeds": (1,)}))
