"""SWE-bench agent step latency: one agent command through our env (persistent cwd and exports, the sandbox's
hardened exec) vs mini-swe-agent's way (``subprocess.run(["docker", "exec", ...])``, a fresh shell per command), on
the same container, with the same commands, measured side by side in one run; plus the container start (the first
command of an episode) and the final ``git diff``.

    PYTHONPATH=. python benchmarks/agent_step_latency.py --data-dir DATA [--instance ID] [--rounds 10] [--out FILE.json]

Needs a running Docker daemon; builds the instance image if it is missing (``harness sandbox build --task swebench``).
Prints medians per command and the ratio mini-swe-agent-style / ours (above 1: ours is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from harness.plan import load_problems
from tasks.agentic.shell_env import AgentLimits
from tasks.swebench.agent import SwebenchAgentEnv
from tasks.swebench.task import AGENT_WORKDIR, SwebenchOptions, SwebenchTask

# What agents typically run on a SWE-bench repository: look around, read, search, run Python, diff.
COMMANDS = {
    "ls": "ls",
    "cat_head": "git ls-files | head -n 1 | xargs head -n 40",
    "grep": "grep -rn 'def ' --include=*.py . | head -n 20",
    "python": "python -c 'import sys; print(sys.version)'",
    "git_status": "git status --short | head",
}


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


def measure(task: SwebenchTask, problem, rounds: int) -> dict:
    """Open an episode's container, then time each command ``rounds`` times both ways, interleaved."""
    row = problem.meta
    image = task.ensure_image(row).tag
    env = SwebenchAgentEnv("", lambda: task.open_session(row), workdir=AGENT_WORKDIR, limits=AgentLimits(1000, 3600.0, 60.0, 3, 10_000))
    try:
        start_s = timed(lambda: env.execute("true"))  # the first command opens the container
        container_id = env.session()._inner.container_id
        ours: dict[str, list[float]] = {name: [] for name in COMMANDS}
        theirs: dict[str, list[float]] = {name: [] for name in COMMANDS}
        for _ in range(rounds):
            for name, command in COMMANDS.items():
                ours[name].append(timed(lambda command=command: env.execute(command)))
                theirs[name].append(timed(lambda command=command: mini_swe_agent_exec(container_id, command, 60.0)))
        diff_s = timed(env.outcome)
    finally:
        env.close()
    per_command = {
        name: {
            "ours_ms": round(1000 * statistics.median(ours[name]), 1),
            "mini_swe_agent_ms": round(1000 * statistics.median(theirs[name]), 1),
        }
        for name in COMMANDS
    }
    all_ours = [t for ts in ours.values() for t in ts]
    all_theirs = [t for ts in theirs.values() for t in ts]
    return {
        "instance": problem.id,
        "image": image,
        "container_start_s": round(start_s, 2),
        "git_diff_s": round(diff_s, 3),
        "per_command": per_command,
        "ours_median_ms": round(1000 * statistics.median(all_ours), 1),
        "mini_swe_agent_median_ms": round(1000 * statistics.median(all_theirs), 1),
        "ratio_mini_swe_agent_over_ours": round(statistics.median(all_theirs) / statistics.median(all_ours), 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--instance", default="django__django-11880", help="an instance with a snapshot")
    parser.add_argument("--cache-dir", default=".cache/swebench")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, help="write the result as JSON")
    args = parser.parse_args(argv)
    task = SwebenchTask(SwebenchOptions(data_dir=str(args.data_dir), instances=args.instance, cache_dir=args.cache_dir))
    (problem,) = load_problems(task, task.training_split())
    result = measure(task, problem, args.rounds)
    for name, row in result["per_command"].items():
        print(f"{name:11s} ours {row['ours_ms']:7.1f} ms   mini-swe-agent style {row['mini_swe_agent_ms']:7.1f} ms")
    print(f"container start (first command) {result['container_start_s']} s; final git diff {result['git_diff_s']} s")
    print(
        f"median step: ours {result['ours_median_ms']} ms, mini-swe-agent style {result['mini_swe_agent_median_ms']} ms, "
        f"ratio {result['ratio_mini_swe_agent_over_ours']}x"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
