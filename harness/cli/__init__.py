"""The ``harness`` command line, one module per command (``harness/cli/<command>.py``) on one Typer app (``_common``):
run, eval, serve, tasks, methods, leaderboard, gate, view, sweep, report, reproduce, export, import, sandbox, data. Options shared by
commands are defined once in :mod:`opd_harness.cli.options`."""

from __future__ import annotations

from opd_harness.cli._common import app, main, plain_help, plain_text
# each module registers its command(s) on ``app``, in the order ``harness --help`` lists them
from opd_harness.cli import run, evaluate, serve, listing, results, sweeps, transfer, sandbox  # noqa: F401
from opd_harness.data import data_app  # the `data` sub-app (harness data fetch / check) lives beside its code

app.add_typer(data_app, name="data")
plain_help(app)

__all__ = ["app", "main", "plain_text"]

