"""The CLI starts without loading torch: ``harness --help``, ``run --help``, ``tasks``, ``methods`` and ``leaderboard``
answer in well under a second."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "transformers", "tokenizers")


def modules_after(code: str) -> list[str]:
    """The heavy modules (torch, transformers, tokenizers) a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def test_listing_commands_load_neither_torch_nor_transformers(tmp_path: Path):
    """The commands as typed, in a fresh interpreter: ``harness.cli`` and what it imports, every task class (``tasks``)
    and every method's spec (``methods``: the objectives reach torch only when they compute) load no torch (about 2 s)
    and no transformers (6 s more); each command exits 0 with output."""
    from harness.store import Store

    Store(tmp_path).close()
    commands = [["--help"], ["run", "--help"], ["eval", "--help"], ["tasks"], ["methods"], ["methods", "--json"]]
    commands.append(["leaderboard", str(tmp_path)])
    code = (
        "from typer.testing import CliRunner\n"
        "from harness.cli import app\n"
        f"for argv in {commands!r}:\n"
        "    result = CliRunner().invoke(app, argv)\n"
        "    assert result.exit_code == 0 and result.output.strip(), (argv, result.exit_code, result.output, result.exception)\n"
    )
    assert modules_after(code) == []
