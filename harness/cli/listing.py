"""``harness tasks`` and ``harness methods``: what is registered."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from opd_harness.jsonout import to_json
from opd_harness.registry import METHODS, TASKS

if TYPE_CHECKING:  # the config models and the task classes are imported by the commands that use them (start-up)
    pass


from opd_harness.cli._common import app, stdout, plain_text


@app.command(epilog="Example: harness tasks --json")
def tasks(json_: Annotated[bool, typer.Option("--json", help="machine-readable list")] = False) -> None:
    """List registered tasks."""
    described = [cls.describe() for _, cls in TASKS.items()]
    if json_:
        print(to_json(described))
        return
    for d in described:
        stdout.print(f"[bold]{d['name']}[/]  {plain_text(d['description'])}  (sandbox: {'yes' if d['needs_sandbox'] else 'no'})")
    for prefix in TASKS.prefixes():
        what, naming = TASKS.prefix_description(prefix)
        stdout.print(f"[bold]{prefix}:<name>[/]  a family of tasks: {plain_text(what)}" + (f"\n    {plain_text(naming)}" if naming else ""))


@app.command(epilog="Example: harness methods --json")
def methods(json_: Annotated[bool, typer.Option("--json", help="machine-readable list")] = False) -> None:
    """List registered training methods with their hyper-parameters and declared inputs."""
    described = [spec.describe() for _, spec in METHODS.items()]
    if json_:
        print(to_json(described))
        return
    for d in described:
        description = plain_text(d["description"])
        stdout.print(f"[bold]{d['name']}[/]  {description}\n    needs: {', '.join(d['inputs'])}; defaults: {d['defaults']}")


