"""Tool-demo training step, environment side: the sandbox cost of one step of ``--preset tool-demo`` four ways.

A step of the preset rolls out 16 prompts x 4 samples = 64 ``arith_tool`` episodes with 16 concurrent environment
workers (``env_workers``). Here a scripted agent (the problem's reference episode replayed: one tool call, then the
answer) stands in for the model, each of its turns taking ``--generate-s`` seconds (a sleep: the model's turn, during
which a background start has the CPU to itself, unlike in a run on busy cores), so only what the environment adds to a
step is timed, on a fresh sandbox per way:
  - ``fresh``: a new container per episode, removed when it ends (``pooled=False``; the path of the ~17 s/step
    figure in issue 25);
  - ``pooled``: pooled reset sessions as they were before pool prewarming (``session_pool`` 8, nothing started
    ahead): the first step starts its containers, and every step discards the sessions beyond 8 and starts them again;
  - ``prewarmed``: ``session_pool`` 16 (the default) and ``prewarm_sessions`` 16 (opt-in) started before the
    first step (in a run ``check_ready`` starts them in the background while the models load), each episode starting
    its interpreter's supervisor on its first cell (``ready_ahead=False``);
  - ``ready``: as ``prewarmed``, with ``ready_ahead`` (the default): a closed interpreter's reset session gets the next
    episode's supervisor in the background, so a later episode's first cell finds it running.
Each way runs ``--steps`` consecutive steps (new problems each) on its sandbox; the first step and the mean of the
later ones are printed. All four are warmed up first (one untimed step each: image, imports), then measured
``--rounds`` times in rotating order. Docker needs a running daemon and the sandbox image.

Usage: ``PYTHONPATH=. python benchmarks/tool_demo_step.py [--steps 3] [--rounds 2] [--generate-s 0.3] [--ways prewarmed,ready]``
"""

from __future__ import annotations

import argparse
import statistics
import time

from opd_harness.backends import SamplingParams
from opd_harness.backends.replay import ReplayBackend
from opd_harness.plan import make_task
from opd_harness.rollout import run_episodes
from opd_harness.sandbox.interpreter import PythonInterpreter

PROMPTS, SAMPLES, WORKERS = 16, 4, 16  # the tool-demo preset's step (trainer.prompts_per_step, samples_per_prompt)
WAYS = ("fresh", "pooled", "prewarmed", "ready")


def open_task(way: str):
    """The preset's task on a new Docker sandbox, set up the way ``way`` says."""
    session_pool = 8 if way == "pooled" else 16
    options = {"n_train": 2000, "n_test": 100, "prewarm_sessions": WORKERS, "sandbox_options": {"session_pool": session_pool}}
    task = make_task("arith_tool", {"arith_tool": options})
    if way != "ready":
        opts = task.options
        task.open_interpreter = lambda: PythonInterpreter(  # type: ignore[method-assign]
            task.sandbox, memory_mb=opts.memory_mb, disk_mb=opts.disk_mb, max_output_chars=opts.max_output_chars,
            pooled=way != "fresh", ready_ahead=False,
        )
    return task


class SlowReplay(ReplayBackend):
    """The scripted agent, each generation call taking ``generate_s`` seconds (the model's turn)."""

    def __init__(self, episodes: dict, generate_s: float) -> None:
        super().__init__(episodes)
        self.generate_s = generate_s

    def generate(self, prompts, params, keys=None):
        time.sleep(self.generate_s)
        return super().generate(prompts, params, keys)


def step_seconds(task, problems: list, replay: ReplayBackend) -> float:
    """Wall time of one step's 64 episodes; fails on any sandbox error."""
    started = time.perf_counter()
    episodes = run_episodes(replay, task, problems, SamplingParams(n=SAMPLES), env_workers=WORKERS)
    elapsed = time.perf_counter() - started
    errors = [t.metadata["env_error"] for t in episodes if "env_error" in t.metadata]
    if errors:
        raise SystemExit(f"{len(errors)} episodes failed in the sandbox, e.g. {errors[0]}")
    return elapsed


def measure(way: str, steps: int, generate_s: float) -> tuple[float, list[float]]:
    """(prewarm seconds, each step's seconds) of ``steps`` consecutive steps on a new sandbox."""
    task = open_task(way)
    with task:
        problems = task.load("train")
        replay = SlowReplay({(task.name, p.id): [[t["model"] for t in p.meta["reference_turns"]]] * SAMPLES for p in problems}, generate_s)
        prewarm_s = 0.0
        if way in ("prewarmed", "ready"):
            started = time.perf_counter()
            task.open_interpreter().prewarm(task.options.prewarm_sessions)
            prewarm_s = time.perf_counter() - started
        times = [step_seconds(task, problems[i * PROMPTS : (i + 1) * PROMPTS], replay) for i in range(steps)]
    return prewarm_s, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="consecutive steps per way and round")
    parser.add_argument("--rounds", type=int, default=2, help="measurements of each way after the warm-up, in rotating order")
    parser.add_argument("--generate-s", type=float, default=0.3, help="seconds each of the scripted agent's turns takes")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated subset of {', '.join(WAYS)}")
    args = parser.parse_args()
    ways = tuple(w for w in WAYS if w in args.ways.split(","))
    if not ways or set(args.ways.split(",")) - set(WAYS):
        parser.error(f"--ways: choose from {', '.join(WAYS)}, got {args.ways!r}")
    base = "fresh" if "fresh" in ways else ways[0]
    for way in ways:
        measure(way, 1, args.generate_s)
    results: dict[str, list[tuple[float, list[float]]]] = {w: [] for w in ways}
    for r in range(args.rounds):
        for way in ways[r % len(ways) :] + ways[: r % len(ways)]:
            results[way].append(measure(way, args.steps, args.generate_s))
            prewarm_s, times = results[way][-1]
            print(f"round {r + 1} {way:<10} prewarm {prewarm_s:5.2f} s  steps " + " ".join(f"{t:6.2f}" for t in times) + " s", flush=True)
    first = {w: statistics.mean(t[0] for _, t in results[w]) for w in ways}
    later = {w: statistics.mean(x for _, t in results[w] for x in t[1:]) if args.steps > 1 else float("nan") for w in ways}
    for way in ways:
        prewarm = statistics.mean(p for p, _ in results[way])
        print(f"{way:<10} first step {first[way]:6.2f} s   later steps {later[way]:6.2f} s   prewarm {prewarm:5.2f} s"
              f"   (first {first[base] / first[way]:4.1f}x, later {later[base] / later[way]:4.1f}x vs {base})")  # fmt: skip


if __name__ == "__main__":
    main()
