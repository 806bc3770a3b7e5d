"""SWE-bench agent step latency and episode wall time, each side by side in one run (warm-up excluded, order alternated).

1. One agent command through our env (persistent cwd and exports) as a request to the container's exec server (today's
   path) vs as one ``docker exec`` of the session wrapper (the path before) vs mini-swe-agent's way
   (``subprocess.run(["docker", "exec", ...])``, a fresh shell per command), on the same instance image, same commands.
2. A scripted episode (``--turns`` model turns, each taking ``--think-s`` of a stand-in model) through the rollout, with
   the container started during the first generation (``Env.prepare``, today) vs on the first command (before).

    PYTHONPATH=. python benchmarks/agent_step_latency.py --data-dir DATA [--instance ID] [--rounds 10] [--episodes 3]
        [--think-s 2] [--out FILE.json]

Needs a running Docker daemon; builds the instance image if it is missing (``harness sandbox build --task swebench``).
Prints medians per command, the ratios docker exec / exec server and mini-swe-agent style / exec server (above 1: the
exec server is faster), and the episodes' median wall times and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from opd_harness.backends import Completion, SamplingParams
from opd_harness.backends.replay import char_id_table, char_ids
from opd_harness.models.tiny import build_char_tokenizer
from opd_harness.plan import load_problems
from opd_harness.registry import TASKS
from opd_harness.rollout import rollout
from opd_harness.tasks.agentic.shell_env import AgentLimits
from opd_harness.tasks.swebench.agent import SUBMIT, SwebenchAgentEnv
from opd_harness.tasks.swebench.session import open_session_on
from opd_harness.tasks.swebench.task import AGENT_WORKDIR, SwebenchOptions, SwebenchTask

# What agents typically run on a SWE-bench repository: look around, read, search, run Python, diff.
COMMANDS = {
    "ls": "ls",
    "cat_head": "git ls-files | head -n 1 | xargs head -n 40",
    "grep": "grep -rn 'def ' --include=*.py . | head -n 20",
    "python": "python -c 'import sys; print(sys.version)'",
    "git_status": "git status --short | head",
}
LIMITS = AgentLimits(1000, 3600.0, 60.0, 3, 10_000)
SIDES = ("exec_server", "docker_exec", "mini_swe_agent")


def timed(fn) -> float:
    """Wall seconds of one call of ``fn()``."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def mini_swe_agent_exec(container_id: str, command: str, timeout_s: float) -> str:
    """mini-swe-agent's ``DockerEnvironment.execute``: ``docker exec -w CWD`` with ``bash -lc`` in a fresh shell."""
    done = subprocess.run(
        ["docker", "exec", "-w", AGENT_WORKDIR, container_id, "bash", "-lc", command], capture_output=True, text=True, timeout=timeout_s
    )
    return done.stdout + done.stderr


def agent_env(task: SwebenchTask, row: dict, served: bool) -> SwebenchAgentEnv:
    image = task.ensure_image(row).tag
    opener = lambda: open_session_on(image, memory_mb=task.opts.memory_mb, max_command_s=task.opts.command_timeout_s, served=served)  # noqa: E731
    return SwebenchAgentEnv("", opener, workdir=AGENT_WORKDIR, limits=LIMITS)


def measure_commands(task: SwebenchTask, problem, rounds: int) -> dict:
    """Open one container per path, then time each command on every side, ``rounds`` times after one warm-up round,
    the sides' order rotating every round."""
    served, wrapped = agent_env(task, problem.meta, True), agent_env(task, problem.meta, False)
    try:
        start_s = timed(lambda: served.execute("true"))  # the first command opens the container
        wrapped.execute("true")
        container_id = served.session()._inner.container_id
        run = {
            "exec_server": lambda command: served.execute(command),
            "docker_exec": lambda command: wrapped.execute(command),
            "mini_swe_agent": lambda command: mini_swe_agent_exec(container_id, command, 60.0),
        }
        times: dict[str, dict[str, list[float]]] = {side: {name: [] for name in COMMANDS} for side in SIDES}
        for r in range(rounds + 1):
            order = SIDES[r % 3 :] + SIDES[: r % 3]
            for name, command in COMMANDS.items():
                for side in order:
                    took = timed(lambda side=side, command=command: run[side](command))
                    if r:  # round 0 is the warm-up
                        times[side][name].append(took)
        diff_s = timed(served.outcome)
    finally:
        served.close()
        wrapped.close()
    medians = {side: statistics.median([t for ts in times[side].values() for t in ts]) for side in SIDES}
    return {
        "container_start_s": round(start_s, 2),
        "git_diff_s": round(diff_s, 3),
        "per_command_ms": {name: {side: round(1000 * statistics.median(times[side][name]), 1) for side in SIDES} for name in COMMANDS},
        "median_ms": {side: round(1000 * m, 1) for side, m in medians.items()},
        "ratio_docker_exec_over_exec_server": round(medians["docker_exec"] / medians["exec_server"], 2),
        "ratio_mini_swe_agent_over_exec_server": round(medians["mini_swe_agent"] / medians["exec_server"], 2),
    }


class ThinkingModel:
    """A stand-in model: says the scripted turns in order, each generation taking ``think_s``."""

    counts_tokens = False

    def __init__(self, turns: list[str], think_s: float) -> None:
        self.turns, self.think_s, self.calls = turns, think_s, 0
        self.tokenizer = build_char_tokenizer()
        self._ids = char_id_table(self.tokenizer)
        self.version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        time.sleep(self.think_s)
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        return [Completion(char_ids(self._ids, text), [0.0] * len(text), text, "stop", i, 0) for i in range(len(prompts))]


class StartOnFirstCommand(SwebenchTask):
    """The path before: the episode's container starts on its first command (no ``prepare``)."""

    def env(self, problem, tokenizer) -> SwebenchAgentEnv:
        env = super().env(problem, tokenizer)
        env.prepare = lambda: None  # type: ignore[method-assign]
        return env


def measure_episodes(options: SwebenchOptions, problem, rounds: int, turns: int, think_s: float) -> dict:
    """One scripted episode per rollout (``turns`` - 1 commands, then the submission), overlapped start vs start on the
    first command, ``rounds`` pairs after one warm-up pair, the order alternating."""
    script = [f"```bash\n{command}\n```" for command in list(COMMANDS.values())[: turns - 1]] + [f"```bash\necho {SUBMIT}\n```"]
    tasks = {"overlapped": SwebenchTask(options), "start_on_first_command": StartOnFirstCommand(options)}
    walls: dict[str, list[float]] = {name: [] for name in tasks}
    for r in range(rounds + 1):
        for name in list(tasks)[:: 1 if r % 2 else -1]:
            model = ThinkingModel(script, think_s)
            trajs: list = []
            took = timed(lambda name=name, model=model: trajs.extend(rollout(model, tasks[name], [problem], SamplingParams())))
            (traj,) = trajs
            assert "env_error" not in traj.metadata and traj.num_steps == len(script), traj.metadata
            if r:
                walls[name].append(took)
    medians = {name: statistics.median(ws) for name, ws in walls.items()}
    return {
        "turns": len(script),
        "think_s": think_s,
        "wall_s": {name: [round(w, 2) for w in ws] for name, ws in walls.items()},
        "median_wall_s": {name: round(m, 2) for name, m in medians.items()},
        "ratio_start_on_first_command_over_overlapped": round(medians["start_on_first_command"] / medians["overlapped"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--instance", default="django__django-11880", help="an instance with a snapshot")
    parser.add_argument("--cache-dir", default=".cache/swebench")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds of the commands")
    parser.add_argument("--episodes", type=int, default=3, help="timed pairs of episodes (0: skip the episode measurement)")
    parser.add_argument("--turns", type=int, default=4, help="model turns per episode (the last submits)")
    parser.add_argument("--think-s", type=float, default=2.0, help="seconds the stand-in model takes per generation")
    parser.add_argument("--out", type=Path, help="write the result as JSON")
    args = parser.parse_args(argv)
    if not 2 <= args.turns <= len(COMMANDS) + 1:
        parser.error(f"--turns must be between 2 and {len(COMMANDS) + 1}, got {args.turns}")
    TASKS.get("swebench")  # names the task class
    options = SwebenchOptions(data_dir=str(args.data_dir), instances=args.instance, cache_dir=args.cache_dir)
    task = SwebenchTask(options)
    (problem,) = load_problems(task, task.training_split())
    image = task.ensure_image(problem.meta).tag
    commands = measure_commands(task, problem, args.rounds)
    result = {"instance": problem.id, "image": image, "commands": commands}
    for name, row in commands["per_command_ms"].items():
        print(f"{name:11s} " + "   ".join(f"{side} {row[side]:7.1f} ms" for side in SIDES))
    print(f"container start (first command) {commands['container_start_s']} s; final git diff {commands['git_diff_s']} s")
    print(
        "median command: " + ", ".join(f"{side} {commands['median_ms'][side]} ms" for side in SIDES)
        + f"; docker exec / exec server {commands['ratio_docker_exec_over_exec_server']}x,"
        f" mini-swe-agent style / exec server {commands['ratio_mini_swe_agent_over_exec_server']}x"
    )
    if args.episodes:
        episodes = result["episodes"] = measure_episodes(options, problem, args.episodes, args.turns, args.think_s)
        print(
            f"episode ({episodes['turns']} turns, {args.think_s:g} s per generation): median wall "
            + ", ".join(f"{name} {s} s" for name, s in episodes["median_wall_s"].items())
            + f"; start on first command / overlapped {episodes['ratio_start_on_first_command_over_overlapped']}x"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
