"""Running untrusted code (Docker and local providers). Imports nothing else of this project.

Model-written code never runs on the host directly: it runs through a sandbox provider.

    from opd_harness import sandbox
    with sandbox.open_sandbox("docker", pool_size=4) as sb:
        r = sb.run(sandbox.ExecRequest(argv=["python3", "main.py"], files={"main.py": b"print(1)"}, timeout_s=5))
        r.status, r.exit_code, r.stdout          # "ok", 0, "1\\n"
        with sb.session() as s:                  # one container (or directory) for several commands
            s.write_files({"a.txt": b"x"})
            s.run(sandbox.ExecRequest(argv=["cat", "a.txt"]))

Providers are declared as entry points of the group ``opd_harness.sandboxes`` (the entry-point key is the name), the
built-ins in this project's pyproject.toml like any plug-in package's; ``provider_names()`` lists them, ``provider(name)``
loads one, ``@register_provider(name)`` adds one from code:
  - ``docker`` (:mod:`opd_harness.sandbox.docker`): containers from the locally built ``opd-sandbox:bookworm``
    image (``python -m opd_harness.sandbox.build``); network off, read-only root, non-root, all capabilities
    dropped, memory/CPU/process limits, a warm pool of containers. Use this one.
  - ``local`` (:mod:`opd_harness.sandbox.local`): a subprocess with rlimits in a temporary directory. It
    isolates much less than Docker; for machines without Docker.

Contract shared by every provider (limits are part of it):
  - Files: ``{path: bytes}``. Relative paths resolve against the run's working directory (the
    work root, or ``request.cwd``, or a session's current directory); a path that leaves the work
    root raises ``ValueError``. Files starting with ``#!`` are made executable.
  - Output: stdout and stderr are each kept up to ``request.max_output_bytes`` (default
    ``MAX_OUTPUT_BYTES`` = 1 MiB); the rest is read and discarded, and ``stdout_truncated`` /
    ``stderr_truncated`` say so. They are decoded as UTF-8 with undecodable bytes replaced.
  - ``read_file`` returns at most ``MAX_READ_FILE_BYTES`` (100 MiB); a larger file raises
    ``ValueError``, a missing one ``FileNotFoundError``.
  - Status (never raises for anything the program does):
      ``ok``       the program exited on its own; look at ``exit_code`` (0 = success).
      ``timeout``  it ran past ``timeout_s`` (wall clock) and was killed.
      ``oom``      it was killed for exceeding ``memory_mb``.
      ``killed``   it died from another signal (exit code 128+N, read as signal N like a shell does).
      ``error``    the sandbox itself failed (daemon down, container creation failed, ...), after a
                   bounded number of retries. An ``error`` is neither a pass nor a fail.
  - ``exit_code`` is the program's exit status, 128+N for death by signal N, ``None`` if unknown.
"""

from __future__ import annotations

import posixpath
import threading
import tomllib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import ClassVar, TypeVar

__all__ = [
    "MAX_OUTPUT_BYTES",
    "MAX_READ_FILE_BYTES",
    "ENTRY_POINT_GROUP",
    "STATUSES",
    "SandboxUnavailable",
    "ExecRequest",
    "ExecResult",
    "Sandbox",
    "Session",
    "declared_providers",
    "open_sandbox",
    "provider",
    "provider_names",
    "register_provider",
]

MAX_OUTPUT_BYTES = 1 << 20  # per stream, per run (default of ExecRequest.max_output_bytes)
MAX_READ_FILE_BYTES = 100 << 20  # Session.read_file
STATUSES = ("ok", "timeout", "oom", "killed", "error")


@dataclass
class ExecRequest:
    """One program to run. Limits apply to the whole sandbox the program runs in."""

    argv: list[str]  # program and arguments; no shell unless you ask for one (["sh", "-c", "..."])
    files: dict[str, bytes] = field(default_factory=dict)  # written before the program starts
    stdin: bytes = b""
    timeout_s: float = 10.0  # wall clock
    memory_mb: int = 512  # RAM (docker: cgroup limit, no swap; local: address space)
    cpus: float = 1.0  # docker: CPU quota; local: CPU-seconds limit derived from timeout_s instead
    pids: int = 64  # processes + threads (docker: whole container; local: RLIMIT_NPROC of the run's uid)
    network: bool = False
    env: dict[str, str] = field(default_factory=dict)  # added to a minimal environment (PATH, HOME, LANG)
    cwd: str | None = None  # working directory, relative to the work root (or a session's current directory)
    max_output_bytes: int = MAX_OUTPUT_BYTES  # cap per stream

    def __post_init__(self) -> None:
        if isinstance(self.argv, str) or not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(f"argv must be a non-empty list of str, got {self.argv!r}")
        self.argv = list(self.argv)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.memory_mb < 16 or self.pids < 4 or not self.cpus > 0:
            raise ValueError(f"limits too small: memory_mb={self.memory_mb} (>=16) pids={self.pids} (>=4) cpus={self.cpus} (>0)")
        if not isinstance(self.stdin, bytes | bytearray):
            raise TypeError("stdin must be bytes")
        for path, data in self.files.items():
            if not isinstance(data, bytes | bytearray):
                raise TypeError(f"file {path!r}: content must be bytes")


@dataclass
class ExecResult:
    """What happened. ``status`` is one of ``STATUSES`` (see the module docstring)."""

    status: str
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float = 0.0  # wall clock of the program itself (not container start / file copy)
    error: str | None = None  # why, for status "error" (and a hint for "killed" / "oom")
    attempts: int = 1  # sandbox attempts made (> 1 after an infrastructure retry)

    @property
    def success(self) -> bool:
        """The program ran to completion and exited 0."""
        return self.status == "ok" and self.exit_code == 0

    @classmethod
    def failed(cls, message: str, attempts: int = 1) -> ExecResult:
        """A sandbox failure (status ``error``)."""
        return cls(status="error", error=message, attempts=attempts)


class Session(ABC):
    """A persistent sandbox (a container, or a directory) where commands run in turn.

    Files and the current directory persist across ``run`` calls; each command is its own process,
    so a ``cd`` inside a command does not carry over (use ``chdir`` or ``request.cwd``). The
    memory / CPU / process / network limits are fixed when the session opens; those fields of the
    requests run in it are ignored (``timeout_s``, ``env``, ``stdin``, ``files`` and ``cwd`` apply).
    """

    workdir: str  # the work root (absolute path inside the sandbox)

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self._cwd = workdir

    @property
    def cwd(self) -> str:
        """The current directory (absolute path inside the sandbox)."""
        return self._cwd

    def chdir(self, path: str) -> None:
        """Change the current directory (relative to the current one, or absolute under the work root).

        Raises:
            ValueError: the path leaves the work root.
            FileNotFoundError: it is not a directory.
        """
        target = resolve_path(self.workdir, self._cwd, path)
        if not self._is_dir(target):
            raise FileNotFoundError(f"not a directory in the sandbox: {target}")
        self._cwd = target

    @abstractmethod
    def _is_dir(self, path: str) -> bool: ...

    @abstractmethod
    def run(self, request: ExecRequest) -> ExecResult:
        """Run one command in the session (in ``request.cwd`` resolved against ``cwd``)."""

    @abstractmethod
    def write_files(self, files: Mapping[str, bytes]) -> None:
        """Write files (paths relative to ``cwd``). Raises ``ValueError`` for a path outside the work root."""

    @abstractmethod
    def read_file(self, path: str, max_bytes: int = MAX_READ_FILE_BYTES) -> bytes:
        """Read one file. Raises ``FileNotFoundError``, or ``ValueError`` when larger than ``max_bytes``."""

    @abstractmethod
    def close(self) -> None:
        """Destroy the session (container or directory). Idempotent."""

    def relay(self, name: str, data: bytes, timeout_s: float, max_bytes: int) -> ExecResult | None:
        """Send ``data`` to the abstract Unix socket ``name`` that a process of this session listens on; what it answers
        until it closes the connection is ``stdout`` (exit code 0; 3: nobody listens). None where the session cannot
        (the caller then runs a client program instead); a pooled Docker session does it without starting a process."""
        return None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Sandbox(ABC):
    """A provider instance: a context manager that runs requests and opens sessions.

    Lifecycle: ``open_sandbox`` → any number of ``run`` (thread-safe) and ``session`` → ``close``
    (also at interpreter exit). ``python`` is the interpreter to put in ``argv`` for Python code.
    """

    name: ClassVar[str] = ""  # set by the registry: the provider's entry-point key (or register_provider's name)
    python: str = "python3"

    @abstractmethod
    def run(self, request: ExecRequest) -> ExecResult:
        """Run one program in a fresh (or cleaned) sandbox. Never raises for the program's behaviour."""

    @abstractmethod
    def session(self, memory_mb: int = 512, cpus: float = 1.0, pids: int = 64, network: bool = False,
                disk_mb: int | None = None, pooled: bool = False) -> Session:
        """Open a persistent session with these limits (``disk_mb``: the most its work root may hold, None for no
        limit of its own; each provider says how, or whether, it enforces it). ``pooled``: the provider may hand out a
        warm one that an earlier session used, reset so that nothing of that session is visible (files, processes).

        Raises:
            SandboxUnavailable: the sandbox could not be created (after retries).
        """

    def prewarm_sessions(self, n: int, memory_mb: int = 512, cpus: float = 1.0, pids: int = 64, network: bool = False,
                         disk_mb: int | None = None) -> int:
        """Make up to ``n`` sessions with these limits ready for ``session(pooled=True)`` ahead of use; returns how many.
        Providers that keep no warm sessions make none (the default)."""
        return 0

    @abstractmethod
    def close(self) -> None:
        """Release every resource (idle containers, open sessions). Idempotent."""

    def check_ready(self) -> None:
        """Raise ``SandboxUnavailable`` saying what to do when this sandbox cannot run programs here (daemon down,
        image not built); callers check before a run instead of learning it from a column of ``error`` results."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SandboxUnavailable(RuntimeError):
    """The sandbox itself could not be created or reached (for APIs that cannot return a status)."""


# ---------------------------------------------------------------- registry

ENTRY_POINT_GROUP = "opd_harness.sandboxes"  # where providers are declared; the built-ins in this project's pyproject.toml
PROJECT = "opd-harness"  # this project's distribution name (its source checkout's pyproject.toml is read directly)
S = TypeVar("S", bound=type[Sandbox])
_providers: dict[str, type[Sandbox]] = {}  # loaded from an entry point or added by register_provider
_providers_lock = threading.RLock()


def _source_tree_entry_points(pyproject: Path = Path(__file__).resolve().parent.parent / "pyproject.toml") -> list[EntryPoint] | None:
    """The providers this project's pyproject.toml declares when the code runs from a source checkout; None otherwise."""
    if not pyproject.is_file():
        return None
    project = tomllib.loads(pyproject.read_text()).get("project", {})
    if project.get("name") != PROJECT:
        return None
    declared = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
    return [EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP) for name, value in declared.items()]


def _of_this_project(ep: EntryPoint) -> bool:
    dist = getattr(ep, "dist", None)
    return dist is not None and (dist.name or "").lower().replace("_", "-") == PROJECT


def _origin(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{ep.name} = {ep.value} (from {dist.name} {dist.version})" if dist is not None else f"{ep.name} = {ep.value} (from {PROJECT})"


def declared_providers() -> dict[str, EntryPoint]:
    """Every provider declared in the entry-point group ``opd_harness.sandboxes``, by name: this project's (from its
    source checkout's pyproject.toml when there is one, so a stale install cannot hide a built-in) and every other
    installed package's.

    Raises:
        KeyError: one name declared twice with different values (the message names both).
    """
    installed = list(entry_points(group=ENTRY_POINT_GROUP))
    source = _source_tree_entry_points()
    if source is not None:
        installed = source + [ep for ep in installed if not _of_this_project(ep)]
    declared: dict[str, EntryPoint] = {}
    for ep in installed:
        first = declared.setdefault(ep.name, ep)
        if first.value != ep.value:
            raise KeyError(f"duplicate sandbox provider {ep.name!r}: {_origin(first)} and {_origin(ep)}")
    return declared


def _add(name: str, cls: type[Sandbox]) -> None:
    """Record ``cls`` as provider ``name`` and set its ``name``; a different class under a taken name is refused."""
    with _providers_lock:
        existing = _providers.get(name)
        if existing is not None and existing is not cls:
            raise KeyError(f"duplicate sandbox provider {name!r}: already {existing.__module__}.{existing.__qualname__}")
        own = cls.__dict__.get("name")
        if own and own != name:
            raise KeyError(f"sandbox provider {cls.__module__}.{cls.__qualname__} says its name is {own!r}, registered as {name!r}")
        cls.name = name
        _providers[name] = cls


def register_provider(name: str) -> Callable[[S], S]:
    """Class decorator: register a ``Sandbox`` subclass as provider ``name`` from code (plug-in packages declare an
    entry point instead); a name already taken, or declared by an entry point for another class, is refused."""

    def decorate(cls: S) -> S:
        ep = declared_providers().get(name)
        if ep is not None and ep.value != f"{cls.__module__}:{cls.__qualname__}":
            raise KeyError(f"duplicate sandbox provider {name!r}: declared as {_origin(ep)}")
        _add(name, cls)
        return cls

    return decorate


def provider_names() -> list[str]:
    """Every provider name: declared by an entry point (the built-ins among them) or registered from code."""
    with _providers_lock:
        return sorted(set(declared_providers()) | set(_providers))


def provider(name: str) -> type[Sandbox]:
    """The provider class called ``name``, its entry point loaded on first use.

    Raises:
        KeyError: unknown provider (the message lists the valid ones).
    """
    with _providers_lock:
        if name in _providers:
            return _providers[name]
        ep = declared_providers().get(name)
        if ep is None:
            raise KeyError(f"unknown sandbox provider {name!r}; valid: {', '.join(provider_names())}")
        _add(name, ep.load())
        return _providers[name]


def open_sandbox(name: str = "docker", **options) -> Sandbox:
    """Create a provider instance; ``options`` go to its constructor (see the provider's docstring).

    Creating a sandbox does not contact Docker: a daemon that is down shows up as runs with status
    ``error``.

    Raises:
        KeyError: unknown provider (the message lists the valid ones).
    """
    return provider(name)(**options)


# ---------------------------------------------------------------- helpers shared by providers


def resolve_path(root: str, cwd: str, path: str) -> str:
    """Absolute, normalised ``path`` (relative to ``cwd``) that must stay inside ``root``.

    Raises:
        ValueError: the path is empty or leaves ``root``.
    """
    if not path or "\0" in path:
        raise ValueError(f"bad sandbox path {path!r}")
    full = posixpath.normpath(posixpath.join(cwd, path))
    if full != root and not full.startswith(root.rstrip("/") + "/"):
        raise ValueError(f"path {path!r} leaves the sandbox work directory {root}")
    return full


class OutputBuffer:
    """Keeps the first ``cap`` bytes of a stream and counts the rest."""

    __slots__ = ("cap", "chunks", "kept", "dropped")

    def __init__(self, cap: int) -> None:
        self.cap, self.chunks, self.kept, self.dropped = cap, [], 0, 0

    def add(self, data: bytes) -> None:
        room = self.cap - self.kept
        if room > 0:
            self.chunks.append(data[:room])
            self.kept += min(room, len(data))
        self.dropped += max(0, len(data) - max(room, 0))

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


def signal_status(exit_code: int | None) -> str:
    """``killed`` for 128+N (death by signal N, shell convention), else ``ok``."""
    return "killed" if exit_code is not None and 128 < exit_code <= 128 + 64 else "ok"
