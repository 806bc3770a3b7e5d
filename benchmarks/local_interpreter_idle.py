"""What idle interpreter sessions cost on the local sandbox provider (the ``files`` transport): a rollout of N tool
episodes holds N sessions while the model writes each episode's next turn. Before, each session's supervisor polled its
control folder every 20 ms; now it sleeps on an inotify watch (re-reading it every 0.25 s).

Both supervisors run side by side in one invocation (the polling one is the current source with its watch switched off):
each way opens N sessions and runs a cell in each, then the machine's busy cores are read from ``/proc/stat`` over an
idle window, then a second cell runs in each session (its answer checked). Ways alternate their order round by round
after a warm-up round of each. Linux only; run it as root on a quiet machine (each session takes a uid).
Usage: ``python benchmarks/local_interpreter_idle.py [--sessions 200] [--idle 10] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import opd_harness.sandbox.interpreter as interp
from opd_harness import sandbox
from opd_harness.sandbox.interpreter import PythonInterpreter

WATCHED = interp._SUPERVISOR
POLLING = WATCHED.replace("watch, inode = watch_folder(ctl)  #", "watch, inode = None, None  #", 1)
WAYS = {"polling every 20 ms (before)": POLLING, "inotify watch (now)": WATCHED}


def busy_cores(seconds: float) -> float:
    """Cores busy (all processes, user + system) over the next ``seconds``, from /proc/stat."""

    def ticks() -> tuple[int, int]:
        values = [int(v) for v in open("/proc/stat").readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    t0, i0 = ticks()
    time.sleep(seconds)
    t1, i1 = ticks()
    cores = len([line for line in open("/proc/stat") if line.startswith("cpu") and line[3].isdigit()])
    return cores * (1 - (i1 - i0) / (t1 - t0))


def one_round(sb, supervisor: str, n: int, idle: float) -> tuple[float, float, float]:
    """(first cells s, busy cores while idle, second cells s) for ``n`` sessions under ``supervisor``."""
    interp._SUPERVISOR = supervisor
    sessions = [PythonInterpreter(sb) for _ in range(n)]
    try:
        with ThreadPoolExecutor(16) as pool:
            start = time.perf_counter()
            first = list(pool.map(lambda py: py.run_cell("x = 123 * 456\nprint(x)"), sessions))
            first_s = time.perf_counter() - start
            cores = busy_cores(idle)
            start = time.perf_counter()
            second = list(pool.map(lambda py: py.run_cell("print(x + 1)"), sessions))
            second_s = time.perf_counter() - start
    finally:
        for py in sessions:
            py.close()
    wrong = sum(r.output != "56088\n" for r in first) + sum(r.output != "56089\n" for r in second)
    if wrong:
        raise SystemExit(f"{wrong} of {2 * n} cells answered wrongly")
    return first_s, cores, second_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of the idle window")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    names = list(WAYS)
    seen: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    with sandbox.open_sandbox("local") as sb:
        for name in names:  # warm-up, not kept
            one_round(sb, WAYS[name], args.sessions, 1.0)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                seen[name].append(one_round(sb, WAYS[name], args.sessions, args.idle))
                print(f"round {r} {name}: first cells {seen[name][-1][0]:.1f} s, busy cores while idle "
                      f"{seen[name][-1][1]:.2f}, second cells {seen[name][-1][2]:.1f} s", flush=True)  # fmt: skip
    for name in names:
        first, cores, second = (statistics.median(v[i] for v in seen[name]) for i in range(3))
        print(f"{name}: {args.sessions} sessions, median busy cores while idle {cores:.2f}, first cells {first:.1f} s, "
              f"second cells {second:.1f} s (n={len(seen[name])})")  # fmt: skip


if __name__ == "__main__":
    main()
