"""CLI start-up: wall time of ``harness --help``, ``run --help``, ``tasks``, ``methods`` and ``leaderboard ROOT`` for this tree and an
older one (default: the tree at git ref ``main``), measured side by side in one run: one warm-up of each, then the two
trees alternate which runs first in every round. Each command is ``python -m harness.cli ...`` run in the tree's root, so
that tree's ``harness`` is the one imported (both with this interpreter and its packages).

    python benchmarks/cli_startup.py [--before-ref main] [--rounds 5] [--root results] [--out FILE.json]

Prints the median seconds per command for each tree and the ratio before / after (above 1: this tree starts faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def export_tree(ref: str, into: Path) -> Path:
    """The files of ``ref`` (``git archive``, never a checkout or a stash) under ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(HERE), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def seconds(tree: Path, args: list[str]) -> float:
    """Wall time of one ``python -m harness.cli ARGS`` in ``tree`` (its output discarded; a failure raises)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=tree, capture_output=True, check=True)
    return time.perf_counter() - started


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
            from harness.store import Store

            root = Path(tmp) / "results"
            Store(root).close()
        commands = {
            "--help": ["--help"],
            "run --help": ["run", "--help"],
            "tasks": ["tasks"],
            "methods": ["methods"],
            "leaderboard": ["leaderboard", str(root.resolve())],
        }
        trees = {"before": before, "after": HERE}
        times: dict[str, dict[str, list[float]]] = {command: {side: [] for side in trees} for command in commands}
        for argv in commands.values():  # warm-up: the file cache holds both trees' modules
            for tree in trees.values():
                seconds(tree, argv)
        for round_ in range(args.rounds):
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for command, argv in commands.items():
                for side in order:
                    times[command][side].append(seconds(trees[side], argv))
    result = {
        command: {
            "before_s": statistics.median(sides["before"]),
            "after_s": statistics.median(sides["after"]),
            "ratio": statistics.median(sides["before"]) / statistics.median(sides["after"]),
        }
        for command, sides in times.items()
    }
    for command, r in result.items():
        print(f"harness {command}: before {r['before_s']:.2f}s, after {r['after_s']:.2f}s, ratio {r['ratio']:.1f}x")
    if args.out:
        args.out.write_text(json.dumps({"rounds": args.rounds, "before_ref": args.before_ref, "results": result}, indent=2) + "\n")


if __name__ == "__main__":
    main()
