"""CLI start-up: wall and CPU time of ``harness --help``, ``run --help``, ``eval --help``, ``tasks``, ``methods``,
``methods --json``, ``leaderboard --help`` and ``leaderboard ROOT`` for this tree and an older one (default: the tree at
git ref ``main``), measured side by side in one run: one warm-up of each, then the two trees alternate which runs first
in every round. Each command is ``python -m opd_harness.cli ...`` run in the tree's root, so that tree's ``harness`` is the
one imported (both with this interpreter and its packages).

Both trees run with bytecode caches, as an installed package has them: each side's ``.pyc`` files go to a folder of
its own (``PYTHONPYCACHEPREFIX``; ``PYTHONDONTWRITEBYTECODE`` is dropped for the children), written by the warm-up.

    python benchmarks/cli_startup.py [--before-ref main] [--rounds 5] [--root results] [--out FILE.json]

Prints the median wall and CPU (user + system) seconds per command for each tree, the ratio before / after of the
wall medians (above 1: this tree starts faster), and the load average before and after the measurement. It also
times the framework's own floor, measured in the same rounds: a two-command typer app whose command has one ``--json``
flag and prints one line with rich (what any command of this CLI pays before ours runs: the interpreter, typer, rich,
and pydantic, which typer imports to convert a command's options).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
FLOOR = """
import typer
from rich.console import Console

app = typer.Typer(add_completion=False)


@app.command()
def methods(json_: bool = typer.Option(False, "--json")) -> None:
    Console().print("[bold]one[/] line")


@app.command()
def other() -> None:
    pass


app()
"""


def export_tree(ref: str, into: Path) -> Path:
    """The files of ``ref`` (``git archive``, never a checkout or a stash) under ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(HERE), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def child_env(pycache: Path) -> dict[str, str]:
    """The environment of a measured command: bytecode caches written to and read from ``pycache``."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPYCACHEPREFIX": str(pycache)}


def seconds(tree: Path, args: list[str], env: dict[str, str], command: list[str] | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of one ``python -m opd_harness.cli ARGS`` (or of ``command``) in ``tree`` (its output
    discarded; a failure raises)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    argv = command or [sys.executable, "-m", "opd_harness.cli", *args]
    subprocess.run(argv, cwd=tree, capture_output=True, check=True, env=env)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-ref", default="main")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--root", type=Path, default=None, help="a results root for `harness leaderboard` (default: an empty store)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = export_tree(args.before_ref, Path(tmp) / "before")
        root = args.root
        if root is None:
            from opd_harness.store import Store

            root = Path(tmp) / "results"
            Store(root).close()
        commands = {
            "--help": ["--help"],
            "run --help": ["run", "--help"],
            "eval --help": ["eval", "--help"],
            "tasks": ["tasks"],
            "methods": ["methods"],
            "methods --json": ["methods", "--json"],
            "leaderboard --help": ["leaderboard", "--help"],
            "leaderboard": ["leaderboard", str(root.resolve())],
        }
        trees = {"before": before, "after": HERE}
        envs = {side: child_env(Path(tmp) / f"pycache-{side}") for side in trees}
        times: dict[str, dict[str, list[tuple[float, float]]]] = {command: {side: [] for side in trees} for command in commands}
        for argv in commands.values():  # warm-up: the file cache holds both trees' modules, their .pyc files are written
            for side, tree in trees.items():
                seconds(tree, argv, envs[side])
        floor_argv = [sys.executable, "-c", FLOOR, "methods"]
        seconds(Path(tmp), [], envs["after"], floor_argv)
        floor: list[tuple[float, float]] = []
        load_before = os.getloadavg()
        for round_ in range(args.rounds):
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            floor.append(seconds(Path(tmp), [], envs["after"], floor_argv))
            for command, argv in commands.items():
                for side in order:
                    times[command][side].append(seconds(trees[side], argv, envs[side]))
        load_after = os.getloadavg()

    def median(samples: list[tuple[float, float]], which: int) -> float:
        return statistics.median(sample[which] for sample in samples)

    result = {
        command: {
            "before_s": median(sides["before"], 0),
            "after_s": median(sides["after"], 0),
            "before_cpu_s": median(sides["before"], 1),
            "after_cpu_s": median(sides["after"], 1),
            "ratio": median(sides["before"], 0) / median(sides["after"], 0),
        }
        for command, sides in times.items()
    }
    for command, r in result.items():
        print(
            f"harness {command}: before {r['before_s']:.2f}s (CPU {r['before_cpu_s']:.2f}s), "
            f"after {r['after_s']:.2f}s (CPU {r['after_cpu_s']:.2f}s), ratio {r['ratio']:.1f}x"
        )
    floor_s = {"wall_s": median(floor, 0), "cpu_s": median(floor, 1)}
    print(f"framework floor (typer + rich + pydantic, one flag): {floor_s['wall_s']:.2f}s (CPU {floor_s['cpu_s']:.2f}s)")
    loads = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after]}
    print(f"load average (1, 5, 15 min): {loads['before']} before, {loads['after']} after; {os.cpu_count()} cores")
    if args.out:
        report = {"rounds": args.rounds, "before_ref": args.before_ref, "load_average": loads, "floor": floor_s, "results": result}
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
