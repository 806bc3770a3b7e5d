"""Interpreter latency in Docker: a cell through the container's exec server (pooled session) vs a ``docker exec`` of
the client per cell (unpooled, today's path before issue 25), and an episode's open cost: a fresh container vs a pooled
one reset after the previous episode.

Both ways run side by side in one run: each is warmed up first (not measured), then the measurements alternate their
order round by round. Prints median and p90 per way and the ratio of medians. Needs a running Docker daemon and the
``opd-sandbox:bookworm`` image.
Usage: ``python benchmarks/interpreter_latency.py [--cells 60] [--episodes 12]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from opd_harness import sandbox
from opd_harness.sandbox.interpreter import PythonInterpreter

WAYS = ("unpooled: docker exec per cell, fresh container", "pooled: exec server relay, reset container")
CELL = "print(1)"
WARMUP = 3


def timed(call: Callable[[], None]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def alternate(ways: dict[str, Callable[[], None]], rounds: int, warmup: int = WARMUP) -> dict[str, list[float]]:
    """Seconds of each way's call per round: ``warmup`` calls of each first (not kept), then ``rounds`` rounds whose
    order alternates (round 0 in the given order, round 1 reversed, ...)."""
    names = list(ways)
    for name in names:
        for _ in range(warmup):
            ways[name]()
    seen: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            seen[name].append(timed(ways[name]))
    return seen


def summary(seconds: list[float]) -> tuple[float, float]:
    """(median, p90) in milliseconds."""
    ms = sorted(s * 1e3 for s in seconds)
    return statistics.median(ms), statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else ms[0]


def report(title: str, seen: dict[str, list[float]]) -> None:
    (old, new) = (summary(seen[w]) for w in WAYS)
    print(f"{title}: {WAYS[0]} median {old[0]:.1f} ms, p90 {old[1]:.1f} ms; {WAYS[1]} median {new[0]:.1f} ms, "
          f"p90 {new[1]:.1f} ms; ratio of medians {old[0] / new[0]:.1f}x (n={len(seen[WAYS[0]])} each)")


def cell_runner(py: PythonInterpreter) -> Callable[[], None]:
    def run() -> None:
        r = py.run_cell(CELL)
        assert (r.status, r.output) == ("ok", "1\n"), r

    return run


def episode_runner(sb, pooled: bool) -> Callable[[], None]:
    """One episode: open an interpreter, run its first cell (the session and supervisor start there), close it."""

    def run() -> None:
        with PythonInterpreter(sb, pooled=pooled) as py:
            cell_runner(py)()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=60, help="measured cells per way")
    parser.add_argument("--episodes", type=int, default=12, help="measured episodes per way")
    args = parser.parse_args()
    with sandbox.open_sandbox("docker", reap=False) as sb:
        with PythonInterpreter(sb, pooled=False) as old, PythonInterpreter(sb, pooled=True) as new:
            cells = alternate({WAYS[0]: cell_runner(old), WAYS[1]: cell_runner(new)}, args.cells)
        report(f"interpreter cell {CELL!r}", cells)
        episodes = alternate({WAYS[0]: episode_runner(sb, False), WAYS[1]: episode_runner(sb, True)}, args.episodes)
        report("episode open + first cell + close (fresh container vs pooled and reset)", episodes)
        print(f"provider stats: {sb.stats}")


if __name__ == "__main__":
    main()
