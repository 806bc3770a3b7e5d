"""The CLI starts without loading torch: ``harness --help``, ``tasks`` and ``leaderboard`` answer in well under a second."""

from __future__ import annotations

import json
import subprocess
import sys


def test_importing_the_cli_loads_neither_torch_nor_transformers():
    """``harness --help``, ``tasks`` and ``leaderboard`` start in well under a second only while ``harness.cli`` and
    the task classes import no torch (about 2 s) or transformers (6 s more): a fresh interpreter checks sys.modules."""
    code = (
        "import json, sys, harness.cli\n"
        "from harness.registry import TASKS\n"
        "[cls for _, cls in TASKS.items()]\n"  # `harness tasks` loads every task class
        "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(result.stdout) == []
