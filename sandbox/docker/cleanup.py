"""Ownership and clean-up: the owner label every container carries, the reaping of containers whose owner process is
gone, and the closing at exit of every sandbox not closed by its user."""

from __future__ import annotations

import atexit
import os
import socket
import threading
from pathlib import Path

import docker
import docker.errors

from opd_harness.sandbox import Sandbox

LABEL = "opd-harness.sandbox"
OWNER_LABEL = "opd-harness.sandbox.owner"


def _proc_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 (starttime); fields after "comm" start at 3


HOST = socket.gethostname()
OWNER = f"{HOST}:{os.getpid()}:{_proc_start_time(os.getpid()) or 0}"


def _owner_alive(owner: str) -> bool:
    """Whether the process named by an owner label is still running (unknown hosts count as alive)."""
    try:
        host, pid, start = owner.rsplit(":", 2)
        pid_i = int(pid)
    except ValueError:
        return False
    if host != HOST:
        return True  # another machine's run sharing this daemon: not ours to judge
    return _proc_start_time(pid_i) == start


def reap_leftovers(client=None, base_url: str | None = None, everything: bool = False) -> int:
    """Remove sandbox containers whose owner process is gone (or all of them with ``everything``).

    Returns:
        How many containers were removed.
    """
    client = client or make_client(base_url, 4)
    removed = 0
    for c in client.api.containers(all=True, filters={"label": f"{LABEL}=1"}):  # plain dicts: no per-container inspect race
        owner = (c.get("Labels") or {}).get(OWNER_LABEL, "")
        if everything or (owner != OWNER and not _owner_alive(owner)):
            try:
                client.api.remove_container(c["Id"], force=True, v=True)
                removed += 1
            except docker.errors.NotFound:
                pass  # another process reaped it first
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: removal already in progress
                    raise
    return removed


_reaped: set[str] = set()  # daemons reaped once by this process
_reaped_lock = threading.Lock()
# Every sandbox not yet closed, held strongly: a WeakSet lost sandboxes collected before exit (e.g. a
# command's local task freed when it returned) and so left their containers running.
_live: set[Sandbox] = set()


def reap_once(client, key: str) -> None:
    """Reap leftovers on the daemon ``key`` the first time this process connects to it (best effort)."""
    with _reaped_lock:
        if key in _reaped:
            return
        _reaped.add(key)
        try:
            reap_leftovers(client)
        except Exception:  # noqa: BLE001 - reaping is best effort
            pass


def hold_until_closed(sb: Sandbox) -> None:
    """Hold ``sb`` until it is closed; it is closed at interpreter exit if its user never does."""
    _live.add(sb)


def release(sb: Sandbox) -> None:
    """``sb`` was closed: no longer held for the exit."""
    _live.discard(sb)


@atexit.register
def _close_all() -> None:
    for sb in list(_live):
        try:
            sb.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


def make_client(base_url: str | None, pool: int, timeout_s: float = 600):
    if base_url:
        return docker.DockerClient(base_url=base_url, max_pool_size=pool, timeout=timeout_s)
    return docker.from_env(max_pool_size=pool, timeout=timeout_s)
