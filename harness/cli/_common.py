"""What every ``harness`` command shares: the Typer app, the consoles, errors, task lifecycle, clean shutdown, the entry point."""

from __future__ import annotations

import functools
import inspect
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from opd_harness.errors import ConfigError

if TYPE_CHECKING:  # the config models and the task classes are imported by the commands that use them (start-up)
    from opd_harness.config import RunConfig
    from opd_harness.task import Task

app = typer.Typer(
    help="Benchmark harness for on-policy distillation of language models.",
    epilog="Example: harness run --preset cpu-demo (then: harness leaderboard)",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=160)
stdout = Console() if sys.stdout.isatty() else Console(width=160)  # pipes get full-width tables


def _quiet_libraries() -> None:
    """Silence transformers/hub progress bars and warnings; the harness draws its own."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def _fail(message: str, code: int = 2) -> typer.Exit:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # escaped: "opd-harness[ray]" is not markup
    return typer.Exit(code)


def open_interval(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Callable[[float | None], float | None]:
    """An option callback refusing a value outside the interval (typer's ``min``/``max`` bounds are closed only): exit 2 naming the flag."""

    def check(value: float | None) -> float | None:
        below = value is not None and (value <= low if low_open else value < low)
        above = value is not None and (value >= high if high_open else value > high)
        if below or above:
            raise typer.BadParameter(f"{value} is not in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}")
        return value

    return check


def plain_text(text: str) -> str:
    """Docstring text as a terminal shows it: RST inline literals (````x````) as ``x``, a paragraph's line breaks as spaces."""
    return re.sub(r"(?<!\n)\n(?!\n)", " ", re.sub(r"``(.+?)``", r"\1", text, flags=re.DOTALL))


def plain_help(typer_app: typer.Typer) -> None:
    """Show the help of ``typer_app``, of its commands and of its sub-apps as ``plain_text`` (docstrings included)."""
    if isinstance(typer_app.info.help, str):
        typer_app.info.help = plain_text(typer_app.info.help)
    for info in typer_app.registered_commands:
        info.help = plain_text(info.help or inspect.getdoc(info.callback) or "")
    for group in typer_app.registered_groups:
        plain_help(group.typer_instance)


# ---- task lifecycle and clean shutdown (readiness before anything is written; sandboxes closed however a command ends)


_tasks_to_close: list[Task] = []  # tasks of the running command, closed when it ends (see ``_closes_tasks``)


def _closes_tasks(command: Callable) -> Callable:
    """Command decorator: close the tasks given to ``_prepare_tasks`` (their sandbox containers) however the command ends."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        finally:
            tasks, _tasks_to_close[:] = list(_tasks_to_close), []
            if tasks:
                from opd_harness.task import close_tasks

                close_tasks(tasks)

    return wrapper


def _prepare_tasks(tasks: list[Task]) -> None:
    """Have ``tasks`` closed when the command ends, and check each can run here (e.g. its sandbox image is built):
    exit 2 with what to do, before any run row or output exists."""
    from opd_harness.task import TaskNotReady

    _tasks_to_close.extend(tasks)
    try:
        for task in tasks:
            task.check_ready()
    except TaskNotReady as exc:
        raise _fail(str(exc)) from None


def _check_executor(plan) -> None:
    """Exit 2 before any run row exists when the run's executor refuses it (e.g. a layout the Ray cluster cannot hold)."""
    from opd_harness.registry import EXECUTORS

    try:
        EXECUTORS.get(plan.config.trainer.executor).check(plan, console)
    except ConfigError as exc:
        raise _fail(str(exc)) from None


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that it unwinds like Ctrl-C: ``finally`` blocks close sandboxes, runs end interrupted."""


_terminated = False


def _raise_terminated(signum: int, frame) -> None:
    global _terminated
    _terminated = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM during the shutdown kills at once
    raise Terminated(f"terminated by signal {signum}")


def check_data_dir(data_dir: Path | None) -> None:
    """``--data-dir`` names an existing folder; the command hands it to the tasks (ahead of ``HARNESS_DATA_DIR``)."""
    if data_dir is not None and not data_dir.is_dir():
        raise ConfigError(f"--data-dir {data_dir}: no such directory (it holds one folder per task: DIR/<task>/...)")


def config_with_data_dir(cfg: RunConfig, data_dir: Path | None) -> RunConfig:
    """``harness run --data-dir``: the data root of every task of the run whose ``task_args`` name none, put in the
    config (stored with the run, so Ray actors and ``--resume`` read the same folder); an explicit option still wins."""
    if data_dir is None:
        return cfg
    names = dict.fromkeys([cfg.task, *cfg.eval.tasks])
    task_args = {**cfg.task_args, **{name: {"data_dir": str(data_dir), **cfg.task_args.get(name, {})} for name in names}}
    return cfg.model_copy(update={"task_args": task_args})


def tasks_with_data_dir(tasks: list, data_dir: Path | None) -> None:
    """``harness run --resume --data-dir``: the data root of each task of the resumed plan whose options name none."""
    for task in tasks if data_dir is not None else ():
        if not task.options.data_dir:
            task.options = task.options.model_copy(update={"data_dir": str(data_dir)})



def _show_version(value: bool) -> None:
    """``harness --version``: the installed package's version."""
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"opd-harness {version('opd-harness')}")
        except PackageNotFoundError:
            print("opd-harness (not installed as a package)")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True, help="print the version and exit")] = False,
) -> None:
    """Benchmark harness for on-policy distillation of language models."""


def main() -> None:
    """Entry point. SIGTERM shuts down cleanly (see ``Terminated``) and exits 143 (128 + SIGTERM)."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        app()
    except SystemExit:
        if _terminated:
            console.print("[bold red]terminated[/] by SIGTERM")
            raise SystemExit(128 + signal.SIGTERM) from None
        raise

