"""``python -m opd_harness``: the ``harness`` command line."""

from opd_harness.cli import main

if __name__ == "__main__":
    main()
