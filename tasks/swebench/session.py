"""A sandbox session on an instance image, for agents: the repository is the working directory."""

from __future__ import annotations

from collections.abc import Mapping

from opd_harness import sandbox
from opd_harness.sandbox import ExecRequest, ExecResult, Session


class InstanceSession(Session):
    """A :class:`sandbox.Session` in a fresh container of an instance image that also closes its sandbox.

    The working directory is ``/box``, which holds the repository; ``/testbed`` links to it, so SWE-bench's
    commands (``cd /testbed``) work. ``python``/``pip``/``pytest`` are the instance venv's. Network off."""

    def __init__(self, sb: sandbox.Sandbox, inner: Session, image: str) -> None:
        super().__init__(inner.workdir)
        self._sb, self._inner, self.image = sb, inner, image

    @property
    def cwd(self) -> str:
        return self._inner.cwd

    def chdir(self, path: str) -> None:
        self._inner.chdir(path)

    def _is_dir(self, path: str) -> bool:
        return self._inner._is_dir(path)

    def run(self, request: ExecRequest) -> ExecResult:
        return self._inner.run(request)

    def write_files(self, files: Mapping[str, bytes]) -> None:
        self._inner.write_files(files)

    def read_file(self, path: str, max_bytes: int = sandbox.MAX_READ_FILE_BYTES) -> bytes:
        return self._inner.read_file(path, max_bytes)

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._sb.close()


def open_session_on(
    image: str, *, memory_mb: int = 4096, cpus: float = 2.0, pids: int = 1024, tmpfs_mb: int = 1024, max_command_s: float = 1800.0,
    served: bool = False,
) -> InstanceSession:
    """A session in a fresh container of an instance ``image`` (network off); closing it closes its sandbox. Its commands
    are each a ``docker exec``, or with ``served`` requests to the container's exec server (a command past its limit is
    killed by the server, the session stays; only a server that does not answer ``grace_s`` later is taken down with
    its container)."""
    sb = sandbox.open_sandbox("docker", image=image, tmpfs_mb=tmpfs_mb, http_timeout_s=max_command_s + 120, grace_s=5.0)
    try:
        inner = sb.session(memory_mb=memory_mb, cpus=cpus, pids=pids, network=False, served=served)
    except BaseException:
        sb.close()
        raise
    return InstanceSession(sb, inner, image)
