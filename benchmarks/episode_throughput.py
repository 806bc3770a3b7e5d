"""Agentic rollout throughput: all live episodes batched per turn with concurrent tool calls, vs one episode at a time.

Two workloads, each measured both ways side by side in one run (episodes per second and their ratio). Both ways
are warmed up first (imports, the sandbox image and interpreters, the model's first forward passes), untimed, and
then measured ``--rounds`` times in alternating order (one at a time first in odd rounds, batched first in even
ones), so neither side absorbs the warm-up or always runs on a cooler machine; the ratio is of the mean rates:
  - ``retool:math500`` with replayed completions (a scripted agent: two tool calls that compute something, then
    the answer), so only the environment (sandbox) cost is measured;
  - ``arith_tool`` with a tiny model warmed up on tool traces (generation and tool calls both count).

Usage: ``python benchmarks/episode_throughput.py [--problems 32] [--rounds 2] [--sandbox docker|local] [--data-dir DIR]``
(``retool:math500`` needs ``math500/test.jsonl`` in the data folder, ``$HARNESS_DATA_DIR`` by default; the
warmed-up model is cached under ``--cache``). Docker needs a running daemon and the sandbox image.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.backends.replay import ReplayBackend
from opd_harness.config import ModelSpec
from opd_harness.models.tiny import TinyArch
from opd_harness.plan import make_task
from opd_harness.rollout import run_episodes
from opd_harness.trainers.warmup import prepare_model

WORK = "import math\nx = sum(math.isqrt(i) for i in range(200_000))\nprint(x)"


def rollout_rate(backend, task, problems: list, params: SamplingParams, *, one_at_a_time: bool) -> float:
    """Episodes per second: one batched rollout (16 concurrent tool calls), or each episode alone (no concurrency)."""
    started = time.perf_counter()
    if one_at_a_time:
        episodes = [t for p in problems for t in run_episodes(backend, task, [p], params, env_workers=1)]
    else:
        episodes = run_episodes(backend, task, problems, params, env_workers=16)
    elapsed = time.perf_counter() - started
    errors = [t.metadata["env_error"] for t in episodes if "env_error" in t.metadata]
    if errors:
        raise SystemExit(f"{len(errors)} episodes failed in the sandbox, e.g. {errors[0]}")
    return len(episodes) / elapsed


WARMUP_PROBLEMS = 16  # enough for the batched side to start all 16 concurrent tool workers once


def compare(label: str, backend, task, problems: list, params: SamplingParams, rounds: int) -> None:
    """Warm both ways up (untimed), then measure them ``rounds`` times in alternating order; print the rates and their ratio."""
    warmup = problems[:WARMUP_PROBLEMS]
    for one_at_a_time in (True, False):
        rollout_rate(backend, task, warmup, params, one_at_a_time=one_at_a_time)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for round_index in range(rounds):
        order = (True, False) if round_index % 2 == 0 else (False, True)
        for one_at_a_time in order:
            rates[one_at_a_time].append(rollout_rate(backend, task, problems, params, one_at_a_time=one_at_a_time))
    sequential, batched = statistics.mean(rates[True]), statistics.mean(rates[False])
    per_round = ", ".join(f"{b / s:.2f}x" for s, b in zip(rates[True], rates[False]))
    print(f"{label:<34} one at a time {sequential:7.2f} ep/s   batched+concurrent {batched:7.2f} ep/s   ratio {batched / sequential:5.2f}x"
          f"   (per round, alternating order: {per_round})")  # fmt: skip


def replay_workload(args) -> None:
    task = make_task("retool:math500", {"retool:math500": {"sandbox": args.sandbox, "limit": args.problems}})
    with task:
        problems = task.load("test", data_dir=args.data_dir)
        fmt = task.tool_format
        turns = [fmt.call_text(WORK), fmt.call_text("print(x % 97)"), "<answer>\\boxed{0}</answer>"]
        replay = ReplayBackend({(task.name, p.id): [turns] for p in problems})
        compare(f"retool:math500 replay ({len(problems)} ep)", replay, task, problems, SamplingParams(), args.rounds)


def model_workload(args) -> None:
    task = make_task("arith_tool", {"arith_tool": {"sandbox": args.sandbox, "n_train": 2000, "n_test": args.problems}})
    with task:
        spec = ModelSpec(
            arch=TinyArch(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256), sft_steps=args.sft_steps, sft_batch_size=32, seed=0
        )
        model, tokenizer, _ = prepare_model(spec, "bench", task, task.load("train"), Path(args.cache))
        backend = HFBackend(model, tokenizer, batch_size=64)
        problems = task.load("test")
        params = SamplingParams(temperature=0.0, max_new_tokens=task.options.max_new_tokens, seed=0)
        compare(f"arith_tool tiny model ({len(problems)} ep)", backend, task, problems, params, args.rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="measurements of each way after the warm-up, in alternating order")
    parser.add_argument("--sandbox", default="docker", choices=["docker", "local"])
    parser.add_argument("--data-dir", type=Path, default=None, help="benchmark data folder (default: $HARNESS_DATA_DIR)")
    parser.add_argument(
        "--cache", default=os.path.expanduser("~/.cache/opd-harness/bench"), help="where the warmed-up tiny model is cached"
    )
    parser.add_argument("--sft-steps", type=int, default=400, help="SFT steps of the tiny model on tool traces")
    parser.add_argument("--skip-replay", action="store_true", help="only the tiny-model workload (no math500 data needed)")
    args = parser.parse_args()
    if not args.skip_replay:
        replay_workload(args)
    model_workload(args)


if __name__ == "__main__":
    main()
