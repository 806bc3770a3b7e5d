"""A session: a dedicated container where commands run in turn (each one a ``docker exec`` of the wrapper, or with
``served`` a request to its exec server), or a pooled one: a container of the provider's session pool whose commands are
requests to its exec server and which is reset and returned to that pool on ``close``."""

from __future__ import annotations

import io
import tarfile
import threading
from collections.abc import Mapping
from typing import Protocol

import docker.errors

from opd_harness.sandbox import MAX_READ_FILE_BYTES, ExecRequest, ExecResult, SandboxUnavailable, Session, resolve_path
from opd_harness.sandbox.docker.box import WORKDIR, Infra, posixpath_rel, tar_files
from opd_harness.sandbox.docker.transport import Box, Host, execute, relay


class SessionHost(Host, Protocol):
    """What a session needs of its provider (a ``DockerSandbox``)."""

    def check_timeout(self, request: ExecRequest) -> None: ...

    def remove_box(self, box: Box) -> None: ...

    def recycle_session_box(self, box: Box) -> None: ...

    def forget_session(self, session: DockerSession) -> None: ...


class DockerSession(Session):
    """A dedicated container; see ``Session``. Commands run one at a time (a lock serialises them).

    ``served``: runs are requests to the container's exec server (files and background processes kept between them)
    instead of a ``docker exec`` each. ``pooled`` (implies ``served``): ``close`` hands the container back to the
    provider, which resets it (every process of the sandbox user killed, the work root and /tmp emptied) before another
    session may take it; otherwise ``close`` removes it."""

    def __init__(self, sb: SessionHost, box: Box, pooled: bool = False, served: bool = False) -> None:
        super().__init__(WORKDIR)
        self._sb, self._box, self.pooled, self.served = sb, box, pooled, served or pooled
        self._lock = threading.Lock()
        self._closed = False

    @property
    def container_id(self) -> str:
        return self._box.container.id

    def _is_dir(self, path: str) -> bool:
        return self._sb.exec_plain(self._box, ["test", "-d", path]) == 0

    def run(self, request: ExecRequest) -> ExecResult:
        self._sb.check_timeout(request)
        with self._lock:
            if self._closed:
                raise RuntimeError("session is closed")
            try:
                result, _ = execute(self._sb, self._box, request, self._cwd, served=self.served, keep=True)
                return result
            except Infra as exc:
                return ExecResult.failed(str(exc))

    def relay(self, name: str, data: bytes, timeout_s: float, max_bytes: int) -> ExecResult | None:
        """Through the container's exec server (served sessions only; None otherwise); see ``Session.relay``."""
        if not self.served:
            return None
        self._sb.check_timeout(ExecRequest(argv=["relay"], timeout_s=timeout_s))
        with self._lock:
            if self._closed:
                raise RuntimeError("session is closed")
            try:
                return relay(self._sb, self._box, name, data, timeout_s, max_bytes)
            except Infra as exc:
                return ExecResult.failed(str(exc))

    def write_files(self, files: Mapping[str, bytes]) -> None:
        staged = {posixpath_rel(resolve_path(WORKDIR, self._cwd, p)): d for p, d in files.items()}
        if not staged:
            return
        try:
            ok = self._box.container.put_archive(WORKDIR, tar_files(staged))
        except docker.errors.DockerException as exc:
            raise SandboxUnavailable(f"write_files failed: {exc}") from exc
        if not ok:
            raise SandboxUnavailable("write_files failed: put_archive returned False")

    def read_file(self, path: str, max_bytes: int = MAX_READ_FILE_BYTES) -> bytes:
        full = resolve_path(WORKDIR, self._cwd, path)
        try:
            stream, stat = self._box.container.get_archive(full)
        except docker.errors.NotFound as exc:
            raise FileNotFoundError(full) from exc
        except docker.errors.DockerException as exc:
            raise SandboxUnavailable(f"read_file failed: {exc}") from exc
        if stat.get("size", 0) > max_bytes:
            raise ValueError(f"{full} is {stat['size']} bytes, over the {max_bytes}-byte limit")
        if stat.get("mode", 0) & (1 << 31):  # Go's os.ModeDir
            raise IsADirectoryError(full)
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream)), mode="r") as tf:
            member = tf.next()
            if member is None or not member.isfile():
                raise FileNotFoundError(f"{full} is not a regular file")
            return tf.extractfile(member).read()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.pooled and self._lock.acquire(blocking=False):  # no run in flight: reset and reuse the container
                try:
                    self._sb.recycle_session_box(self._box)
                finally:
                    self._lock.release()
            else:  # (a run in flight ends as an error: its container is removed under it)
                self._sb.remove_box(self._box)
        self._sb.forget_session(self)
