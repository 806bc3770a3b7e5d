"""Phase timing that lands in the same metrics dict that gets logged."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def timed(phase: str, metrics: dict[str, float]) -> Iterator[None]:
    """Add the wall seconds of the block to ``metrics[f"time_{phase}_s"]``."""
    started = time.perf_counter()
    try:
        yield
    finally:
        key = f"time_{phase}_s"
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - started
