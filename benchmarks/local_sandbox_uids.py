"""What opening and closing sessions costs on the local sandbox provider beside many processes: a rollout of 256 tool
episodes opens and closes 256 sessions a step, each under its own uid, while other sessions (another worker's
rollout) keep thousands of processes on the machine. Taking or giving back a uid may scan /proc for the uid's
processes, and one scan reads every process's status. Before, every give scanned, and every take of a uid whose lock
file was not marked clean (the first take of each of the 4096 on a fresh machine); now a give skips the scan when every
run under the uid ended on its own in its PID namespace, and a take skips it when the lock file is new.

Both ways run side by side in one invocation ("before" is the current source with the two skips switched off): each
opens N sessions from a pool of threads, runs ``true`` in each and closes it, with B background processes (``sleep``)
standing in for the other rollout. Ways alternate their order round by round after a warm-up round of each. Linux, as
root, with PID namespaces (``unshare -p``); run it on a quiet machine.
Usage: ``python benchmarks/local_sandbox_uids.py [--sessions 256] [--background 2000] [--threads 16] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from opd_harness import sandbox
from opd_harness.sandbox import ExecRequest, local


def one_session(sb: local.LocalSandbox) -> None:
    """Open a session, run ``true`` in it, close it (the uid's take, one run and the give)."""
    s = sb.session()
    try:
        r = s.run(ExecRequest(argv=["true"]))
        assert r.success, r
    finally:
        s.close()


def drive(sb: local.LocalSandbox, sessions: int, threads: int, skips: bool) -> tuple[float, int]:
    """(seconds for ``sessions`` sessions over ``threads`` threads, /proc scans made); ``skips`` False is before."""
    scans: list[int] = []
    real_kill, real_quiet, real_open = local._kill_uid, local._UidUse.quiet, local._open_lock_file
    local._kill_uid = lambda uid, *a: scans.append(uid) or real_kill(uid, *a)
    if not skips:
        local._UidUse.quiet = lambda self: False
        local._open_lock_file = lambda path: (real_open(path)[0], False)
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda _: one_session(sb), range(sessions)))
        return time.perf_counter() - t0, len(scans)
    finally:
        local._kill_uid, local._UidUse.quiet, local._open_lock_file = real_kill, real_quiet, real_open


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--background", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    ways = {"scan on every give and first take (before)": False, "skips (now)": True}
    background = [subprocess.Popen(["sleep", "3600"]) for _ in range(args.background)]
    results: dict[str, list[tuple[float, int]]] = {w: [] for w in ways}
    try:
        with tempfile.TemporaryDirectory() as locks:
            local._UID_LOCK_DIR = Path(locks)  # fresh lock files: "before" scans on the first take of each uid
            with sandbox.open_sandbox("local", network_isolation="auto", max_parallel=args.threads) as sb:
                assert sb.root_mode and sb.pid_isolated, "run as root where `unshare -p` works"
                order = list(ways)
                for r in range(args.rounds + 1):
                    for way in order if r % 2 == 0 else order[::-1]:
                        for path in Path(locks).iterdir():  # each round starts from new lock files
                            path.unlink()
                        seconds, scans = drive(sb, args.sessions, args.threads, ways[way])
                        print(f"round {r}{' (warm-up)' if r == 0 else ''}: {way}: {seconds:.2f} s, {scans} scans", flush=True)
                        if r:
                            results[way].append((seconds, scans))
    finally:
        for p in background:
            p.kill()
            p.wait()
    print(f"\n{args.sessions} sessions over {args.threads} threads beside {args.background} processes, median of {args.rounds}:")
    for way, rows in results.items():
        print(f"  {way}: {statistics.median(s for s, _ in rows):.2f} s, {statistics.median(n for _, n in rows):.0f} scans")


if __name__ == "__main__":
    main()
