"""The base of every task that runs model output in a sandbox: one sandbox per task, opened on first use.

The task opens it lazily from its options (``sandbox``: the provider, ``sandbox_options``: its arguments) or grades
through one it was given (:meth:`SandboxedTask.use_sandbox`, not closed by the task); ``close`` removes what it
opened. ``check_ready`` turns a sandbox that cannot run here into :class:`TaskNotReady` before any episode starts.
"""

from __future__ import annotations

import threading
from typing import Any

from pydantic import Field

from opd_harness.task import Task, TaskNotReady, TaskOptions


class SandboxOptions(TaskOptions):
    """Options of a sandboxed task: which provider and how it is opened."""

    sandbox: str = Field("docker", description="sandbox provider (docker; local isolates much less)")
    sandbox_options: dict[str, Any] = Field(default_factory=dict, description="options for sandbox.open_sandbox")


class SandboxedTask(Task):
    """A task graded by running code in a sandbox it opens lazily (or one given with :meth:`use_sandbox`)."""

    needs_sandbox = True
    Options = SandboxOptions

    def __init__(self, options: TaskOptions | None = None, sandbox=None) -> None:
        super().__init__(options)
        self._sandbox = sandbox
        self._owns_sandbox = False
        self._sb_lock = threading.Lock()

    def use_sandbox(self, sb) -> None:
        """Grade through ``sb`` (not closed by this task)."""
        self._sandbox, self._owns_sandbox = sb, False

    @property
    def sandbox(self):
        with self._sb_lock:
            if self._sandbox is None:
                from opd_harness import sandbox as sandbox_pkg

                opts: SandboxOptions = self.options  # type: ignore[assignment]
                self._sandbox = sandbox_pkg.open_sandbox(opts.sandbox, **opts.sandbox_options)
                self._owns_sandbox = True
            return self._sandbox

    def close(self) -> None:
        """Close the sandbox if this task opened it (removing its containers); the next grading opens a new one."""
        with self._sb_lock:
            sb, owned = self._sandbox, self._owns_sandbox
            self._sandbox, self._owns_sandbox = None, False
        if sb is not None and owned:
            sb.close()

    def check_ready(self) -> None:
        """Raise ``TaskNotReady`` when the sandbox cannot run here (bad options, Docker daemon down, image not built)."""
        from opd_harness import sandbox as sandbox_pkg

        try:
            sb = self.sandbox
        except (KeyError, TypeError, ValueError) as exc:  # unknown provider or option, bad option value
            raise TaskNotReady(f"{self.name}: task option sandbox / sandbox_options: {exc}") from None
        try:
            sb.check_ready()
        except sandbox_pkg.SandboxUnavailable as exc:
            raise TaskNotReady(f"{self.name}: {exc}") from None
