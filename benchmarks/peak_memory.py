"""The peak resident memory of one piece of work in this process, as the memory benchmarks and tests measure it (Linux).

The peak is ``VmHWM`` of ``/proc/self/status``, restarted from the current RSS just before the work
(``/proc/self/clear_refs``), minus that RSS. Not ``ru_maxrss``: Linux carries it over an exec from the parent, so a process
started by a large one (a test suite) would begin at the parent's peak and under-report.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def status_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak since start or the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_rise(work: Callable[[], T]) -> tuple[T, int]:
    """``work()``'s result and the most its run held above the RSS before it, in bytes."""
    before = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak-RSS mark (VmHWM) restarts from the current RSS
    result = work()
    return result, status_bytes("VmHWM") - before
