"""Episodes per second with heavy-tailed environment steps: independent episode scheduling vs the lock-step turn loop.

A synthetic multi-turn task whose environment steps take ``--step-ms`` each, except 5 % of them (``--slow-share``)
that take 20× as long (``--slow-factor``), drawn per (episode, turn) from a fixed seed so both sides meet the same
steps. Generation is a stand-in batched engine (``--call-ms`` per generate call plus ``--row-ms`` per row, as a GPU
engine whose call costs about the same for 1 or 64 rows), so the ratio measures the scheduling, not a model; the
independent side pays for its smaller, more frequent generate calls. ``--backend tiny`` generates with a tiny HF
model on the CPU instead (real sampling; 1 thread).

Both sides are ``opd_harness.rollout.run_episodes`` (independent, today's) and ``benchmarks/episode_scheduling_before.py``
(a copy of the lock-step loop before issue 25), on the same episodes and the same thread pool size. Each is warmed up
(untimed), then measured ``--rounds`` times in alternating order (lock-step first in even rounds); printed are the mean
episodes/s per side with the most the step times alone allow it (lock-step: the sum of each turn's slowest step;
independent: the slowest episode's steps), their ratio and the per-round ratios.

Usage: ``PYTHONPATH=. python benchmarks/episode_scheduling.py [--episodes 64] [--turns 8] [--step-ms 50] [--rounds 4]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from opd_harness.backends import Completion, SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.episode import Env, Observation, StepResult
from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model
from opd_harness.rollout import run_episodes
from opd_harness.task import Problem, Score, Task, TaskOptions

sys.path.insert(0, str(Path(__file__).parent))
import episode_scheduling_before as before  # noqa: E402


class TailOptions(TaskOptions):
    turns: int = 8
    step_s: float = 0.05
    slow_share: float = 0.05
    slow_factor: float = 20.0
    seed: int = 0


def step_seconds(opts: TailOptions, problem_id: str, turn: int) -> float:
    """The step time of one (episode, turn): ``step_s``, or ``slow_factor`` times it for a ``slow_share`` of them."""
    slow = random.Random(f"{opts.seed}:{problem_id}:{turn}").random() < opts.slow_share
    return opts.step_s * (opts.slow_factor if slow else 1.0)


def floors(opts: TailOptions, problems: list[Problem]) -> dict[str, float]:
    """Each side's least possible rollout time from the steps alone: lock-step waits for each turn's slowest step,
    independent episodes only for the slowest episode's own steps."""
    times = [[step_seconds(opts, p.id, t) for t in range(opts.turns)] for p in problems]
    return {"lock-step": sum(max(col) for col in zip(*times)), "independent": max(sum(row) for row in times)}


class TailEnv(Env):
    """``turns`` model turns, each answered after a step time drawn from the heavy-tailed distribution."""

    stop = ("#",)

    def __init__(self, options: TailOptions, problem: Problem) -> None:
        self.options, self.problem, self.n = options, problem, 0
        self.max_turns = options.turns

    def reset(self) -> str:
        return self.problem.question

    def step(self, model_text: str) -> StepResult:
        opts = self.options
        time.sleep(step_seconds(opts, self.problem.id, self.n))
        self.n += 1
        return StepResult(None if self.n >= opts.turns else Observation(f"[{self.n}]", role="inline"), self.n >= opts.turns)


class TailTask(Task):
    name = "heavy_tail"
    description = "synthetic multi-turn task with heavy-tailed environment step times"
    Options = TailOptions
    multi_turn = True

    def read_problems(self, split, data_dir):
        raise NotImplementedError  # problems are made by the benchmark

    def env(self, problem, tokenizer) -> TailEnv:
        return TailEnv(self.options, problem)

    def grade_many(self, problems, completions):
        return [Score("pass") for _ in completions]

    @property
    def grader(self):
        return ("heavy_tail", "1")


class StandInEngine:
    """A batched engine's cost without a model: each generate call sleeps ``call_s + row_s × rows`` and answers ``x#``."""

    counts_tokens = True
    version = 0

    def __init__(self, call_s: float, row_s: float) -> None:
        self.tokenizer = build_char_tokenizer()
        self.call_s, self.row_s = call_s, row_s
        self.calls = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.calls += 1
        time.sleep(self.call_s + self.row_s * len(prompts))
        ids = self.tokenizer("x#", add_special_tokens=False)["input_ids"]
        return [Completion(list(ids), [0.0] * len(ids), "x#", "stop", p, 0) for p in range(len(prompts))]


def tiny_backend() -> HFBackend:
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyArch(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128), len(tok), pad_id=tok.pad_token_id,
                             eos_id=tok.eos_token_id, seed=0)  # fmt: skip
    return HFBackend(model, tok, batch_size=64)


SIDES = {"lock-step": before.run_episodes, "independent": run_episodes}


def rate(side: str, backend, task: Task, problems: list[Problem], params: SamplingParams, workers: int) -> tuple[float, int]:
    """Episodes per second of one rollout on ``side``, and its generate calls."""
    calls = getattr(backend, "calls", 0)
    started = time.perf_counter()
    trajectories = SIDES[side](backend, task, problems, params, env_workers=workers)
    elapsed = time.perf_counter() - started
    assert all(t.metadata["episode"]["stop_reason"] in {"done", "max_turns", "context"} for t in trajectories)
    return len(trajectories) / elapsed, getattr(backend, "calls", 0) - calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=50.0, help="an ordinary environment step")
    parser.add_argument("--slow-share", type=float, default=0.05, help="share of steps that are slow")
    parser.add_argument("--slow-factor", type=float, default=20.0, help="how much slower a slow step is")
    parser.add_argument("--workers", type=int, default=64, help="concurrent environment steps (the rollout's env_workers)")
    parser.add_argument("--backend", choices=["stand-in", "tiny"], default="stand-in")
    parser.add_argument("--call-ms", type=float, default=20.0, help="stand-in engine: cost of one generate call")
    parser.add_argument("--row-ms", type=float, default=0.2, help="stand-in engine: cost per row of a call")
    parser.add_argument("--rounds", type=int, default=4, help="measurements per side after the warm-up, in alternating order")
    args = parser.parse_args()
    backend = StandInEngine(args.call_ms / 1e3, args.row_ms / 1e3) if args.backend == "stand-in" else tiny_backend()
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=0)
    names = list(SIDES)

    def task_for(round_index: int) -> TailTask:  # each round its own slow steps, the same for both sides
        return TailTask(TailOptions(turns=args.turns, step_s=args.step_ms / 1e3, slow_share=args.slow_share,
                                    slow_factor=args.slow_factor, seed=round_index))  # fmt: skip

    problems = [Problem(id=f"e{i}", question=f"Q{i}:", answer="") for i in range(args.episodes)]
    for side in names:  # warm-up, untimed
        rate(side, backend, task_for(-1), problems[:8], params, args.workers)
    rates: dict[str, list[float]] = {side: [] for side in names}
    calls: dict[str, list[int]] = {side: [] for side in names}
    floor: dict[str, list[float]] = {side: [] for side in names}
    for r in range(args.rounds):
        for side, seconds in floors(task_for(r).options, problems).items():
            floor[side].append(len(problems) / seconds)
        for side in names if r % 2 == 0 else names[::-1]:
            value, n_calls = rate(side, backend, task_for(r), problems, params, args.workers)
            rates[side].append(value)
            calls[side].append(n_calls)
    old, new = statistics.mean(rates["lock-step"]), statistics.mean(rates["independent"])
    per_round = ", ".join(f"{b / a:.2f}x" for a, b in zip(rates["lock-step"], rates["independent"]))
    print(f"{args.episodes} episodes x {args.turns} turns, steps {args.step_ms:g} ms ({args.slow_share:.0%} x{args.slow_factor:g}), "
          f"{args.workers} env workers, backend {args.backend}")  # fmt: skip
    for side in names:
        counted = f"   generate calls per rollout {statistics.mean(calls[side]):6.1f}" if args.backend == "stand-in" else ""
        print(f"  {side:<12} {statistics.mean(rates[side]):7.2f} episodes/s (at most {statistics.mean(floor[side]):6.2f} from the "
              f"step times alone){counted}")  # fmt: skip
    print(f"  ratio independent / lock-step {new / old:.2f}x   (per round, alternating order: {per_round})")


if __name__ == "__main__":
    main()
