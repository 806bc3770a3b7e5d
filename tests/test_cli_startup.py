"""The CLI starts without loading torch: ``harness --help``, ``run --help``, ``tasks``, ``methods`` and ``leaderboard``
answer in well under a second (``benchmarks/cli_startup.py`` measures it); these tests hold which modules they load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "transformers", "tokenizers")
# what the listing commands used to import and no longer need: the run-config models (opd_harness.config builds ~40 pydantic
# models, with opd_harness.models.*), yaml, the math grader's process pool (pebble) and the backend models
UNUSED_BY_LISTINGS = ("opd_harness.config", "opd_harness.models.tiny", "opd_harness.models.shapes", "yaml", "pebble",
                      "opd_harness.backends")
# standard-library modules that task modules import only where they grade or run (a process or thread pool, an archive,
# a setup.cfg, a pickled test case) and the sandbox image builder's argument parser: listing the tasks loads none of them
STDLIB_UNUSED_BY_LISTINGS = ("multiprocessing", "concurrent.futures", "tarfile", "configparser", "pickletools", "argparse")
# `harness --help` alone builds no command's options: no pydantic, no task classes, no entry-point scan
UNUSED_BY_HELP = ("pydantic", "opd_harness.task", "importlib.metadata", "tomllib")
LISTINGS = [["--help"], ["run", "--help"], ["eval", "--help"], ["leaderboard", "--help"], ["tasks"], ["methods"], ["methods", "--json"]]


def modules_after(code: str, modules: tuple[str, ...] = HEAVY) -> list[str]:
    """Which of ``modules`` (default: torch, transformers, tokenizers) a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {modules!r} if m in sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def test_listing_commands_load_neither_torch_nor_transformers(tmp_path: Path):
    """The commands as typed, in a fresh interpreter: ``opd_harness.cli`` and what it imports, every task class (``tasks``)
    and every method's spec (``methods``: the objectives reach torch only when they compute) load no torch (about 2 s)
    and no transformers (6 s more); each command exits 0 with output."""
    from opd_harness.store import Store

    Store(tmp_path).close()
    assert modules_after(invoking([*LISTINGS, ["leaderboard", str(tmp_path)]])) == []


def invoking(commands: list[list[str]]) -> str:
    """Code that runs each command line of ``commands`` through ``opd_harness.cli.app`` and checks it exits 0 with output."""
    return (
        "from typer.testing import CliRunner\n"
        "from opd_harness.cli import app\n"
        f"for argv in {commands!r}:\n"
        "    result = CliRunner().invoke(app, argv)\n"
        "    assert result.exit_code == 0 and result.output.strip(), (argv, result.exit_code, result.output, result.exception)\n"
    )


def test_listing_commands_load_neither_the_config_models_nor_yaml_nor_the_grader_pool(tmp_path):
    """The same commands in a fresh interpreter leave the run-config models (``opd_harness.config``, 0.27 s of the 1 s
    they took, with ``opd_harness.models.*``), yaml, pebble and the backend models unloaded: the commands that run or
    validate something import them."""
    from opd_harness.store import Store

    Store(tmp_path).close()
    assert modules_after(invoking([*LISTINGS, ["leaderboard", str(tmp_path)]]), UNUSED_BY_LISTINGS) == []


def test_top_level_help_loads_no_pydantic_no_task_classes_and_scans_no_entry_points():
    """``harness --help`` lists the commands only: typer builds no command's options (so no pydantic), and neither the
    task classes nor ``importlib.metadata``/``tomllib`` (the registry imports them for its first lookup) are loaded."""
    assert modules_after(invoking([["--help"]]), UNUSED_BY_HELP) == []


def test_listing_commands_load_no_pools_archives_or_parsers_of_the_task_modules(tmp_path):
    """Importing every task class (``harness tasks``) leaves the standard library's process and thread pools, tarfile,
    configparser, pickletools and argparse unloaded: the task modules import them in the functions that use them."""
    from opd_harness.store import Store

    Store(tmp_path).close()
    assert modules_after(invoking([*LISTINGS, ["leaderboard", str(tmp_path)]]), STDLIB_UNUSED_BY_LISTINGS) == []
