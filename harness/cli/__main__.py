"""``python -m opd_harness.cli``: the ``harness`` command."""

from opd_harness.cli import main

main()
