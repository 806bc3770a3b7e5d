"""``harness sandbox``: build the code sandbox's image, remove leftover containers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from opd_harness.errors import ConfigError

if TYPE_CHECKING:  # the config models and the task classes are imported by the commands that use them (start-up)
    pass


from opd_harness.cli._common import app, stdout, _fail


sandbox_app = typer.Typer(
    help="The code sandbox: build its Docker image, remove leftover containers.",
    epilog="Example: harness sandbox build",
    no_args_is_help=True,
)
app.add_typer(sandbox_app, name="sandbox")


@sandbox_app.command("build", epilog="Example: harness sandbox build --task swebench --data-dir data")
def sandbox_build(
    tag: Annotated[str, typer.Option(help="image tag")] = "opd-sandbox:bookworm",
    force: Annotated[bool, typer.Option("--force", help="rebuild the rootfs tarball and re-import even if the image exists")] = False,
    cache_dir: Annotated[Path, typer.Option(help="where the rootfs tarball is cached (git-ignored)")] = Path(".cache/sandbox"),
    task: Annotated[
        str | None, typer.Option(help="also build the images a task needs (a task with build_images(), e.g. one image per instance)")
    ] = None,
    data_dir: Annotated[Path | None, typer.Option(help="local data root laid out as DIR/<task>/... (with --task)")] = None,
    task_arg: Annotated[list[str] | None, typer.Option("--task-arg", help="task option TASK.KEY=VALUE, repeatable (with --task)")] = None,
) -> None:
    """Build the sandbox's Docker image from Debian packages (mmdebstrap + docker import; never docker pull); with
    --task, then the images that task needs (--force then rebuilds those, not the base image)."""
    from opd_harness.sandbox.build import BuildError, build_base_image

    try:
        info = build_base_image(tag=tag, cache_dir=cache_dir, force=force and task is None)
    except BuildError as exc:
        raise _fail(str(exc), 1) from None
    if info["built"]:
        s = info["seconds"]
        stdout.print(f"built {tag} ({info['image_id'][:19]}): rootfs {s['rootfs']:.1f}s, import {s['import']:.1f}s")
    else:
        stdout.print(f"{tag} exists ({info['image_id'][:19]}); --force rebuilds it")
    if task is not None:
        _build_task_images(task, data_dir, task_arg or [], force)


def _build_task_images(name: str, data_dir: Path | None, task_arg: list[str], force: bool) -> None:
    """``sandbox build --task NAME``: the task's own ``build_images`` with a progress bar; exit 1 if one failed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from opd_harness.config import deep_merge, parse_override
    from opd_harness.plan import make_task
    from opd_harness.task import Task

    task_args: dict = {}
    for item in task_arg:
        task_args = deep_merge(task_args, parse_override(item))
    if data_dir is not None:
        if not data_dir.is_dir():
            raise _fail(f"--data-dir {data_dir}: no such directory (it holds one folder per task: DIR/<task>/...)")
        task_args.setdefault(name, {})["data_dir"] = str(data_dir)
    try:
        task = make_task(name, task_args)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    if type(task).build_images is Task.build_images:  # the default builds nothing
        raise _fail(f"task {name!r} builds no images of its own (only the sandbox base image: `harness sandbox build`)")
    failed = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=stdout) as bar:
        job = bar.add_task(f"{name} images", total=None)

        def done(item: str, result) -> None:
            if isinstance(result, Exception):
                failed.append(item)
                bar.console.print(f"[red]failed[/] {item}: {result}")
            else:
                how = f"built in {result.seconds:.0f}s" if result.built else "cached"
                drops = ", ".join(f"{pin} ({why})" for pin, why in result.dropped.items()) or "none"
                bar.console.print(f"{item}: {result.tag} {how}; dropped pins: {drops}")
            bar.advance(job)

        try:
            results = task.build_images(force=force, on_start=lambda item: bar.update(job, description=f"{name}: {item}"), on_done=done)
        except (FileNotFoundError, ValueError) as exc:
            raise _fail(str(exc)) from None
        bar.update(job, total=len(results), description=f"{name} images")
    if failed:
        raise _fail(f"{len(failed)} image(s) failed to build: {', '.join(failed)}", 1)


@sandbox_app.command("cleanup", epilog="Example: harness sandbox cleanup")
def sandbox_cleanup(
    all_: Annotated[bool, typer.Option("--all", help="also containers of harness processes still running")] = False,
) -> None:
    """Remove sandbox containers left behind by crashed runs."""
    from opd_harness.sandbox.docker import reap_leftovers

    try:
        n = reap_leftovers(everything=all_)
    except Exception as exc:  # noqa: BLE001 - daemon down, SDK missing
        raise _fail(f"could not reach Docker: {exc}", 1) from None
    stdout.print(f"removed {n} sandbox container(s)")


