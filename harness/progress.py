"""Progress reporting that suits where the output goes: a tqdm bar on a terminal, and in a log (a file, CI) a
short line every ``every_s`` seconds and one at the end, instead of a flood of carriage-return redraws."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator

from tqdm import tqdm

LOG_EVERY_S = 30.0


class LogProgress:
    """The part of tqdm's interface the harness uses (iterate, ``update``, ``set_postfix``, ``close``), written as lines."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        initial: int = 0,
        every_s: float = LOG_EVERY_S,
        file=None,
    ) -> None:
        self.iterable, self.desc, self.n, self.initial, self.every_s = iterable, desc, initial, initial, every_s
        self.total = total if total is not None else (len(iterable) + initial if hasattr(iterable, "__len__") else None)  # type: ignore[arg-type]
        self.file = file if file is not None else sys.stderr
        self.postfix = ""
        self.started = self.last = time.monotonic()
        self.closed = False
        self.shown: tuple | None = None  # (count, postfix) of the last line written

    def __iter__(self) -> Iterator:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.every_s:
            self.emit()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def emit(self) -> None:
        self.last = time.monotonic()
        done = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        elapsed = self.last - self.started
        if self.total is not None and self.initial < self.n < self.total:  # the rate of this session's steps
            done += f" after {elapsed:.0f}s, ~{elapsed / (self.n - self.initial) * (self.total - self.n):.0f}s left"
        else:
            done += f" after {elapsed:.0f}s"
        tail = f" ({self.postfix})" if self.postfix else ""
        print(f"{self.desc}: {done}{tail}", file=self.file, flush=True)
        self.shown = (self.n, self.postfix)

    def close(self) -> None:
        """The final line, unless the last one written already said the same (a last step slower than ``every_s``)."""
        if not self.closed:
            self.closed = True
            if self.shown != (self.n, self.postfix):
                self.emit()

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(iterable: Iterable | None = None, *, disable: bool = False, **kwargs):
    """A tqdm bar when stderr is a terminal, else :class:`LogProgress` lines; nothing at all when ``disable``."""
    if disable:
        return tqdm(iterable, disable=True, **kwargs)
    if sys.stderr.isatty():
        return tqdm(iterable, dynamic_ncols=True, **kwargs)
    return LogProgress(iterable, total=kwargs.get("total"), desc=kwargs.get("desc", ""), initial=kwargs.get("initial", 0))
