"""What one cell of the tool-use interpreter costs on the local sandbox provider beside many processes. After every
cell the interpreter's supervisor looks for processes the cell left running. It read the status of every process in
/proc, and the local provider's runs see the host's /proc: beside another worker's rollout (thousands of processes)
that was ~100 ms of CPU a cell, more than the cell. Now it follows the ``children`` files down from itself.

Both ways run side by side in one invocation ("before" is the current supervisor with its ``children`` walk switched
off, so it scans every process as it did): each opens N interpreters from a pool of threads, runs C cells in each and
closes it, with B background processes (``sleep``) standing in for the other rollout. It reports the CPU time of the
sandbox processes (the supervisors, their workers and the provider's launchers: ``RUSAGE_CHILDREN``) and of this
process per cell, and the wall time. Ways alternate their order round by round after a warm-up round of each.
Linux, as root (the local provider's uids and PID namespaces); run it on a quiet machine.
Usage: ``python benchmarks/interpreter_cells.py [--sessions 64] [--cells 4] [--background 2000] [--threads 8] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import opd_harness.sandbox.interpreter as interp
from opd_harness import sandbox
from opd_harness.sandbox.interpreter import PythonInterpreter

WALK = "CHILDREN_FILES = has_children_files()"


def supervisor_source(walk: bool) -> str:
    """The supervisor's source, with its ``children`` walk on (now) or off (before: a scan of every process)."""
    assert WALK in interp._SUPERVISOR, "the supervisor no longer decides its walk where this benchmark expects"
    return interp._SUPERVISOR if walk else interp._SUPERVISOR.replace(WALK, "CHILDREN_FILES = False")


def episode(sb, cells: int, i: int) -> None:
    """One interpreter: ``cells`` small cells (a tool call's arithmetic), each checked."""
    with PythonInterpreter(sb) as py:
        for c in range(cells):
            out = py.run_cell(f"x = {i} * {c} + 17\nprint(x)")
            assert out.status == "ok" and out.output.strip() == str(i * c + 17), out


def drive(sb, sessions: int, cells: int, threads: int, walk: bool) -> tuple[float, float, float]:
    """(wall seconds, sandbox CPU ms a cell, this process's CPU ms a cell) for ``sessions`` interpreters."""
    real = interp._SUPERVISOR
    interp._SUPERVISOR = supervisor_source(walk)
    try:
        r0, s0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda i: episode(sb, cells, i), range(sessions)))
        r1, s1, t1 = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    finally:
        interp._SUPERVISOR = real
    n = sessions * cells
    child = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / n * 1e3
    own = (s1.ru_utime + s1.ru_stime - s0.ru_utime - s0.ru_stime) / n * 1e3
    return t1 - t0, child, own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--cells", type=int, default=4)
    ap.add_argument("--background", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    background = [subprocess.Popen(["sleep", "3600"]) for _ in range(args.background)]
    results: dict[str, list[tuple[float, float, float]]] = {"before": [], "now": []}
    try:
        with sandbox.open_sandbox("local") as sb:
            for walk in (False, True):  # warm-up of each way (transport probe, page cache)
                drive(sb, max(4, args.threads), args.cells, args.threads, walk)
            for r in range(args.rounds):
                for name in ("before", "now") if r % 2 == 0 else ("now", "before"):
                    results[name].append(drive(sb, args.sessions, args.cells, args.threads, name == "now"))
                    wall, child, own = results[name][-1]
                    print(f"round {r + 1} {name}: {wall:.1f} s, sandbox CPU {child:.1f} ms a cell, this process {own:.1f} ms a cell")
    finally:
        for p in background:
            p.kill()
        for p in background:
            p.wait()
    n = args.sessions * args.cells
    print(f"\n{args.sessions} interpreters x {args.cells} cells ({n} cells) beside {args.background} processes, {args.threads} threads")
    for name, rows in results.items():
        walls, childs, owns = zip(*rows)
        print(
            f"{name:>6}: wall {statistics.median(walls):.1f} s ({statistics.median(walls) / n * 1e3:.0f} ms a cell), sandbox CPU"
            f" {statistics.median(childs):.1f} ms a cell, this process {statistics.median(owns):.1f} ms a cell (medians of {len(rows)})"
        )


if __name__ == "__main__":
    main()
