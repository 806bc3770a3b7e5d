"""Where the task data lives: ``$HARNESS_DATA_DIR`` and the default ``./data`` (a module of its own so that ``harness data``'s
help names the variable without importing the task classes)."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "HARNESS_DATA_DIR"  # names the data root (DIR/<task>/...) when no argument or option does
DEFAULT_DATA_DIR = Path("data")  # the data root when nothing names one (where `harness data fetch` writes without --to)


def resolve_data_dir(argument: Path | str | None = None, option: Path | str | None = None) -> tuple[Path, str]:
    """(the data root, how it was chosen): the argument, else the option, else ``$HARNESS_DATA_DIR``, else ``./data``."""
    chosen = (("the data_dir argument", argument), ("options.data_dir", option), (f"${DATA_DIR_ENV}", os.environ.get(DATA_DIR_ENV)))
    for how, value in chosen:
        if value:
            return Path(value).expanduser(), how
    return DEFAULT_DATA_DIR, f"no data_dir argument, options.data_dir or ${DATA_DIR_ENV} set: the default ./{DEFAULT_DATA_DIR}"
