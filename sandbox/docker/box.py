"""What every part of the Docker provider knows of a container: its work root and user, its limits, the errors worth a
retry, inputs packed as a tar, and its cgroup OOM-kill counter."""

from __future__ import annotations

import io
import os
import tarfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from opd_harness.sandbox import ExecRequest

WORKDIR = "/box"
UID = GID = 65534


@dataclass(frozen=True)
class Limits:
    memory_mb: int
    cpus: float
    pids: int
    network: bool
    disk_mb: int | None = None  # sessions only: the work root is then a tmpfs volume of this size

    @classmethod
    def of(cls, r: ExecRequest) -> Limits:
        return cls(r.memory_mb, r.cpus, r.pids, r.network)


class Infra(Exception):
    """An infrastructure failure worth a retry."""


class NoRetry(Exception):
    """An infrastructure failure a retry cannot fix (e.g. the image is missing)."""


def tar_files(files: Mapping[str, bytes]) -> bytes:
    """A tar of ``{relative path: bytes}`` (and parent directories) owned by the sandbox user."""
    buf = io.BytesIO()
    now = time.time()
    dirs: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for rel, data in files.items():
            parts = rel.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    ti = tarfile.TarInfo(d)
                    ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = tarfile.DIRTYPE, 0o755, UID, GID, now
                    tf.addfile(ti)
            ti = tarfile.TarInfo(rel)
            ti.size, ti.uid, ti.gid, ti.mtime = len(data), UID, GID, now
            ti.mode = 0o755 if data[:2] == b"#!" else 0o644
            tf.addfile(ti, io.BytesIO(bytes(data)))
    return buf.getvalue()


def oom_counter_path(container_id: str) -> Path | None:
    for p in (
        f"/sys/fs/cgroup/memory/docker/{container_id}/memory.oom_control",  # v1, cgroupfs driver
        f"/sys/fs/cgroup/memory/system.slice/docker-{container_id}.scope/memory.oom_control",  # v1, systemd
        f"/sys/fs/cgroup/docker/{container_id}/memory.events",  # v2, cgroupfs
        f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/memory.events",  # v2, systemd
    ):
        if os.path.exists(p):
            return Path(p)
    return None


def read_oom_kills(path: Path | None) -> int | None:
    if path is None:
        return None
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def posixpath_rel(abs_path: str) -> str:
    """``/box/a/b`` → ``a/b`` (tar member names are relative to the work root)."""
    return abs_path[len(WORKDIR) + 1 :]
