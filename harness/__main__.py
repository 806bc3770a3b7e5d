"""``python -m harness``: the ``harness`` command line."""

from harness.cli import main

if __name__ == "__main__":
    main()
