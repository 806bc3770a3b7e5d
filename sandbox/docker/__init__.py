"""Docker provider: every program runs in a locked-down container from a locally built image.

Each container (``DockerSandbox`` options in brackets):
  - image ``opd-sandbox:bookworm`` [``image``], built by ``python -m sandbox.build`` (never pulled);
  - no network (``network_mode=none``; only ``lo`` exists) unless a request sets ``network=True``;
  - read-only root file system; a writable anonymous volume at ``/box`` (the work root, removed
    with the container) and a tmpfs at ``/tmp`` [``tmpfs_mb``, default 64]; ``/dev/shm`` is
    Docker's (64 MiB). ``/box`` lives on the daemon's disk with no total quota, except in a session
    opened with ``disk_mb``: there it is a tmpfs-backed volume of that size (a write past it fails
    with ENOSPC; tmpfs pages count against the container's memory limit). Each file written is
    capped at ``max_file_mb`` [64] (RLIMIT_FSIZE: the write fails with EFBIG, or SIGXFSZ kills the
    program: status ``killed``);
  - user 65534:65534, all capabilities dropped, ``no-new-privileges``;
  - cgroup limits from the request: memory (swap off), CPU quota, pids (every process and thread
    in the container, including the sandbox's own: the exec server (PID 1), and in a session's run
    the wrapper and `timeout`);
  - labels ``opd-harness.sandbox=1`` and ``opd-harness.sandbox.owner=<host>:<pid>:<start time>``:
    containers whose owner process is gone (a crashed run) are removed when the next process first
    connects, and every container of this process is removed by ``close()`` (idle, busy and session
    containers alike) or, for a sandbox never closed, at exit (``atexit``: open sandboxes are held by
    strong references until closed, so one dropped without ``close()`` is still cleaned up).
  - ``check_ready()`` says, before any run, whether the daemon answers and the image exists
    (``SandboxUnavailable`` naming the command that fixes it).

Runs:
  - The timeout is enforced inside the container (the program's process group is killed with
    SIGKILL) and by an outer wall-clock guard at ``timeout_s + grace_s`` [``grace_s``, 2] that
    kills the whole container.
  - ``oom`` is read from the container's cgroup OOM-kill counter when the host exposes it,
    otherwise from exit status 137 before the timeout.
  - Each Docker API round trip costs ~50-100 ms, so every container's PID 1 is an exec server
    (``exec_server.py``; non-dumpable, so programs can neither read its memory nor write into its
    reply stream; as PID 1 it gets no signal from them but SIGCHLD) and a pooled run is one request
    on its attach stream (opened once per container): inputs and the program's output travel there.
    A session's run is one ``docker exec`` of a shell wrapper (inputs under 768 KiB travel in its
    argv; larger ones by ``put_archive``).
  - A warm pool holds at most ``pool_size`` [4] containers and runs at most ``pool_size`` programs
    at once (``run`` blocks for a free slot; safe from many threads). After each run every process
    of the sandbox user is killed and ``/box``, ``/tmp``, ``/dev/shm`` and ``/dev/mqueue`` are
    emptied; a container that cannot be cleaned, hit the outer guard, or failed is thrown away.
    A program cannot kill the exec server (``kill -1`` spares PID 1); should it die anyway (the OOM
    killer), the run is ``killed`` and the container thrown away. ``prewarm`` [0] containers are
    started when the sandbox opens.
  - Infrastructure failures (daemon unreachable, create/exec errors) are retried ``retries`` [2]
    times with a growing delay [``retry_delay_s``, 0.5], then returned as status ``error``.
  - Sessions get their own container (not counted in the pool), removed by ``Session.close``.
Not covered: SysV IPC objects left by a program in a pooled container are not removed.
"""

from __future__ import annotations

import atexit
import base64
import io
import json
import os
import socket
import struct
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors
import requests
from docker.types import DriverConfig, LogConfig, Mount, Ulimit

from sandbox import (
    MAX_READ_FILE_BYTES,
    ExecRequest,
    ExecResult,
    OutputBuffer,
    Sandbox,
    SandboxUnavailable,
    Session,
    resolve_path,
    signal_status,
)

DEFAULT_IMAGE = "opd-sandbox:bookworm"
LABEL = "opd-harness.sandbox"
OWNER_LABEL = "opd-harness.sandbox.owner"
WORKDIR = "/box"
UID = GID = 65534
_ENV = {"HOME": "/tmp", "LANG": "C.UTF-8", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}

# A session's run is one `docker exec` of this wrapper (each exec costs ~50-100 ms here, put_archive as much):
#   args: MARK WORKDIR STDIN TIMEOUT NCHUNKS CHUNK... ARGV...
#   1. small inputs arrive as base64 tar chunks in argv and are piped into tar in /box (large ones were
#      put_archive'd before); 2. stdin is opened from its staged file, which is unlinked before the
#      program starts; 3. the program runs under `timeout -s KILL` (its own process group);
#   4. a trailer line "\nMARK <exit code> <nanoseconds>" ends stdout (or "MARK setup").
# Tools are called by absolute path and IFS is reset, so request.env (PATH, IFS) cannot break it.
# Pooled runs go to the container's resident exec server instead (exec_server.py), which also cleans up.
_WRAP = r"""
unset IFS; exec 4>&2 2>/dev/null  # fd 4: the program's stderr; the wrapper's own messages ("Killed") are dropped
m=$1 d=$2 in=$3 t=$4 n=$5; shift 5
if [ "$n" -gt 0 ]; then  # the chunks go through a pipe (a subshell: the shift below drops them here)
  { while [ "$n" -gt 0 ]; do printf %s "$1"; shift; n=$((n-1)); done; } | /usr/bin/base64 -d | /usr/bin/tar -x -f - -C /box 2>&4 || { printf '\n%s setup\n' "$m"; exit 0; }
  shift "$n"
fi
cd -- "$d" && exec 3<"$in" || { echo "sandbox: cannot enter $d or open stdin" >&4; printf '\n%s setup\n' "$m"; exit 0; }
[ "$in" = /dev/null ] || /usr/bin/rm -f -- "$in"
s0=$(/usr/bin/date +%s%N)
/bin/sh -c 'exec 2>&4 4>&- 3<&-; exec /usr/bin/timeout -s KILL "$0" "$@"' "$t" "$@" <&3  # (a `2>&4` here would make sh print "Killed" into it)
rc=$?
s1=$(/usr/bin/date +%s%N)
printf '\n%s %s %s\n' "$m" "$rc" "$((s1-s0))"
"""
_SERVER = (Path(__file__).parent.parent / "exec_server.py").read_text()
_KILL_ALL = "kill -9 -1 2>/dev/null; kill -9 -1 2>/dev/null; exit 0"
_CHUNK = 120_000  # base64 characters per argv string (Linux caps one at 128 KiB)
_ARGV_PAYLOAD_MAX = 768 << 10  # larger inputs go through put_archive


@dataclass(frozen=True)
class _Limits:
    memory_mb: int
    cpus: float
    pids: int
    network: bool
    disk_mb: int | None = None  # sessions only: the work root is then a tmpfs volume of this size

    @classmethod
    def of(cls, r: ExecRequest) -> _Limits:
        return cls(r.memory_mb, r.cpus, r.pids, r.network)


class _Infra(Exception):
    """An infrastructure failure worth a retry."""


class _NoRetry(Exception):
    """An infrastructure failure a retry cannot fix (e.g. the image is missing)."""


# ---------------------------------------------------------------- ownership, reaping


def _proc_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 (starttime); fields after "comm" start at 3


_HOST = socket.gethostname()
_OWNER = f"{_HOST}:{os.getpid()}:{_proc_start_time(os.getpid()) or 0}"


def _owner_alive(owner: str) -> bool:
    """Whether the process named by an owner label is still running (unknown hosts count as alive)."""
    try:
        host, pid, start = owner.rsplit(":", 2)
        pid_i = int(pid)
    except ValueError:
        return False
    if host != _HOST:
        return True  # another machine's run sharing this daemon: not ours to judge
    return _proc_start_time(pid_i) == start


def reap_leftovers(client=None, base_url: str | None = None, everything: bool = False) -> int:
    """Remove sandbox containers whose owner process is gone (or all of them with ``everything``).

    Returns:
        How many containers were removed.
    """
    client = client or _make_client(base_url, 4)
    removed = 0
    for c in client.api.containers(all=True, filters={"label": f"{LABEL}=1"}):  # plain dicts: no per-container inspect race
        owner = (c.get("Labels") or {}).get(OWNER_LABEL, "")
        if everything or (owner != _OWNER and not _owner_alive(owner)):
            try:
                client.api.remove_container(c["Id"], force=True, v=True)
                removed += 1
            except docker.errors.NotFound:
                pass  # another process reaped it first
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: removal already in progress
                    raise
    return removed


_reaped: set[str] = set()
_reaped_lock = threading.Lock()
# Every sandbox not yet closed, held strongly: a WeakSet lost sandboxes collected before exit (e.g. a
# command's local task freed when it returned) and so left their containers running.
_live: set[DockerSandbox] = set()


@atexit.register
def _close_all() -> None:
    for sb in list(_live):
        try:
            sb.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


def build_command(image: str) -> str:
    """The command that builds ``image`` (shown when it is missing)."""
    return "harness sandbox build" + ("" if image == DEFAULT_IMAGE else f" --tag {image}")


def _make_client(base_url: str | None, pool: int, timeout_s: float = 600):
    if base_url:
        return docker.DockerClient(base_url=base_url, max_pool_size=pool, timeout=timeout_s)
    return docker.from_env(max_pool_size=pool, timeout=timeout_s)


def _tar(files: Mapping[str, bytes]) -> bytes:
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


def _work_mount(disk_mb: int | None) -> Mount:
    """The work root: an anonymous volume on the daemon's disk, or with ``disk_mb`` one backed by a tmpfs of that size
    (a full one fails writes with ENOSPC; unlike a plain tmpfs mount, ``put_archive`` / ``get_archive`` reach it)."""
    if disk_mb is None:
        return Mount(target=WORKDIR, source=None, type="volume")
    options = {"type": "tmpfs", "device": "tmpfs", "o": f"size={disk_mb}m,uid={UID},gid={GID},mode=0755,nosuid,nodev"}
    return Mount(target=WORKDIR, source=None, type="volume", driver_config=DriverConfig("local", options))


def _oom_counter_path(container_id: str) -> Path | None:
    for p in (
        f"/sys/fs/cgroup/memory/docker/{container_id}/memory.oom_control",  # v1, cgroupfs driver
        f"/sys/fs/cgroup/memory/system.slice/docker-{container_id}.scope/memory.oom_control",  # v1, systemd
        f"/sys/fs/cgroup/docker/{container_id}/memory.events",  # v2, cgroupfs
        f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/memory.events",  # v2, systemd
    ):
        if os.path.exists(p):
            return Path(p)
    return None


def _read_oom_kills(path: Path | None) -> int | None:
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


class _Box:
    """One container and what the provider knows about it."""

    def __init__(self, container, limits: _Limits) -> None:
        self.container = container
        self.limits = limits
        self.oom_path = _oom_counter_path(container.id)
        self.server: _ServerStream | None = None  # a pooled container's resident exec server, once started


class DockerSandbox(Sandbox):
    """Docker provider (see the module docstring for the isolation and the limits).

    Args:
        image: image tag to run (built by ``python -m sandbox.build``).
        pool_size: most containers kept and most programs running at once.
        prewarm: containers (with default request limits) started when the sandbox opens.
        base_url: Docker daemon URL (default: ``DOCKER_HOST`` or the local socket).
        retries: extra attempts after an infrastructure failure.
        retry_delay_s: delay before the first retry (grows linearly).
        grace_s: the outer guard fires at ``timeout_s + grace_s``.
        tmpfs_mb: size of ``/tmp``.
        max_file_mb: largest file a program may write (RLIMIT_FSIZE; past it the program gets SIGXFSZ).
        http_timeout_s: read timeout of Docker API calls; ``timeout_s + grace_s`` must stay below it.
        reap: remove leftovers of dead owners when first connecting.
    """

    python = "python3"

    def __init__(
        self,
        image: str = DEFAULT_IMAGE,
        pool_size: int = 4,
        prewarm: int = 0,
        base_url: str | None = None,
        retries: int = 2,
        retry_delay_s: float = 0.5,
        grace_s: float = 2.0,
        tmpfs_mb: int = 64,
        max_file_mb: int = 64,
        reap: bool = True,
        http_timeout_s: float = 600.0,
    ) -> None:
        if pool_size < 1:
            raise ValueError("pool_size must be >= 1")
        self.image, self.pool_size, self.base_url = image, pool_size, base_url
        self.retries, self.retry_delay_s, self.grace_s = retries, retry_delay_s, grace_s
        self.tmpfs_mb, self.max_file_mb, self.reap, self.http_timeout_s = tmpfs_mb, max_file_mb, reap, http_timeout_s
        self._client_obj = None
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(pool_size)
        self._idle: dict[_Limits, list[_Box]] = {}
        self._count = 0  # containers in the pool, idle + busy
        self._busy: set[_Box] = set()  # pooled containers running a program now (removed by close())
        self._sessions: set[DockerSession] = set()  # open sessions (strong: each is closed by close())
        self._closed = False
        self._stats_lock = threading.Lock()
        self.stats = {"created": 0, "reused": 0, "discarded": 0, "retries": 0}
        _live.add(self)
        if prewarm:
            self.prewarm(prewarm)

    # ------------------------------------------------------------ infrastructure

    def _client(self):
        if self._client_obj is None:
            with self._lock:
                if self._client_obj is None:
                    try:
                        client = _make_client(self.base_url, 2 * self.pool_size + 8, self.http_timeout_s)
                    except docker.errors.DockerException as exc:
                        raise _Infra(f"Docker daemon unreachable: {exc}") from exc
                    key = self.base_url or os.environ.get("DOCKER_HOST", "default")
                    with _reaped_lock:
                        if self.reap and key not in _reaped:
                            _reaped.add(key)
                            try:
                                reap_leftovers(client)
                            except Exception:  # noqa: BLE001 - reaping is best effort
                                pass
                    self._client_obj = client
        return self._client_obj

    def check_ready(self) -> None:
        """Raise ``SandboxUnavailable`` saying what to do when the daemon does not answer or the image is not built."""
        where = self.base_url or os.environ.get("DOCKER_HOST") or "the local socket"
        try:
            client = self._client()
            client.api.ping()
        except (_Infra, docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
            cause = exc.__cause__ if isinstance(exc, _Infra) and exc.__cause__ else exc
            raise SandboxUnavailable(
                f"Docker daemon unreachable at {where} ({cause}); start it (`dockerd &` or `systemctl start docker`) or set DOCKER_HOST"
            ) from None
        try:
            client.images.get(self.image)
        except docker.errors.ImageNotFound:
            raise SandboxUnavailable(f"sandbox image {self.image!r} not found; build it with `{build_command(self.image)}`") from None
        except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
            raise SandboxUnavailable(f"could not inspect sandbox image {self.image!r} at {where}: {exc}") from None

    def _create(self, limits: _Limits) -> _Box:
        client = self._client()
        kwargs = dict(
            command=["python3", "-I", "-S", "-c", _SERVER],  # PID 1: reaps orphans; serves a pooled container's runs
            stdin_open=True,  # the server's request stream (it waits on it for ever where nobody attaches)
            log_config=LogConfig(type=LogConfig.types.NONE),  # replies travel by attach only, never into a log file
            labels={LABEL: "1", OWNER_LABEL: _OWNER},
            user=f"{UID}:{GID}",
            working_dir=WORKDIR,
            environment=_ENV,
            read_only=True,
            mounts=[_work_mount(limits.disk_mb)],
            tmpfs={"/tmp": f"rw,exec,nosuid,nodev,size={self.tmpfs_mb}m,mode=1777"},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mem_limit=f"{limits.memory_mb}m",
            memswap_limit=f"{limits.memory_mb}m",
            nano_cpus=int(limits.cpus * 1e9),
            pids_limit=limits.pids,
            hostname="sandbox",
            ulimits=[Ulimit(name="fsize", soft=self.max_file_mb << 20, hard=self.max_file_mb << 20), Ulimit(name="core", soft=0, hard=0)],
        )
        if not limits.network:
            kwargs.update(network_disabled=True, network_mode="none")
        container = None
        try:  # create + start, never `containers.run`: that would try to pull a missing image
            container = client.containers.create(self.image, **kwargs)
            container.start()
        except docker.errors.ImageNotFound as exc:
            how = f"`{build_command(self.image)}` (or `python -m sandbox.build`)"
            raise _NoRetry(f"image {self.image!r} not found; build it with {how} ({exc})") from exc
        except (docker.errors.DockerException, OSError) as exc:
            if container is not None:
                self._remove(_Box(container, limits))
            raise _Infra(f"container creation failed: {exc}") from exc
        self._bump("created")
        return _Box(container, limits)

    def _remove(self, box: _Box) -> None:
        try:
            box.container.remove(force=True, v=True)
        except Exception:  # noqa: BLE001 - already gone, or the daemon is down: reaped later
            pass
        if box.server is not None:
            box.server.close()

    def _exec_plain(self, box: _Box, argv: list[str]) -> int | None:
        """Run a short command in the container; its exit code (None when it could not be run)."""
        try:
            api = self._client().api
            exec_id = api.exec_create(box.container.id, argv, user=f"{UID}:{GID}")["Id"]
            api.exec_start(exec_id)
            return api.exec_inspect(exec_id)["ExitCode"]
        except Exception:  # noqa: BLE001
            return None

    # ------------------------------------------------------------ pool

    def prewarm(self, n: int | None = None, request: ExecRequest | None = None) -> int:
        """Start up to ``n`` (default ``pool_size``) idle containers for ``request``'s limits; returns how many."""
        limits = _Limits.of(request or ExecRequest(argv=["true"]))
        with self._lock:
            n = min(n if n is not None else self.pool_size, self.pool_size - self._count)
            self._count += max(n, 0)
        if n <= 0:
            return 0
        with ThreadPoolExecutor(n) as ex:
            futures = [ex.submit(self._create, limits) for _ in range(n)]
        made, late = 0, []
        for f in futures:
            with self._lock:
                if f.exception() is None and not self._closed:
                    self._idle.setdefault(limits, []).append(f.result())
                    made += 1
                else:
                    self._count -= 1
                    if f.exception() is None:
                        late.append(f.result())  # closed while starting: not kept
        for box in late:
            self._remove(box)
        return made

    def _checkout(self, limits: _Limits) -> _Box:
        victim = None
        with self._lock:
            if self._closed:
                raise RuntimeError("sandbox is closed")
            boxes = self._idle.get(limits)
            if boxes:
                self._bump("reused")
                box = boxes.pop()
                self._busy.add(box)
                return box
            if self._count >= self.pool_size:  # full: evict an idle container with other limits
                for other in self._idle.values():
                    if other:
                        victim = other.pop()
                        break
                self._count -= 1
            self._count += 1
        if victim is not None:
            self._remove(victim)
        try:
            box = self._create(limits)
        except BaseException:
            with self._lock:
                self._count -= 1
            raise
        with self._lock:
            closed = self._closed
            if not closed:
                self._busy.add(box)
        if closed:  # close() ran while the container was starting
            self._checkin(box, False)
            raise RuntimeError("sandbox is closed")
        return box

    def _checkin(self, box: _Box, reusable: bool) -> None:
        with self._lock:
            self._busy.discard(box)
            if reusable and not self._closed:  # the run's wrapper already cleaned the container
                self._idle.setdefault(box.limits, []).append(box)
                return
            self._count -= 1
        self._bump("discarded")
        self._remove(box)

    def _bump(self, key: str) -> None:
        with self._stats_lock:
            self.stats[key] += 1

    # ------------------------------------------------------------ running

    def run(self, request: ExecRequest) -> ExecResult:
        """Run ``request`` in a pooled container; blocks while ``pool_size`` runs are in flight."""
        self._check_timeout(request)
        limits = _Limits.of(request)
        with self._slots:
            return self._with_retries(lambda: self._run_once(request, limits))

    def _check_timeout(self, request: ExecRequest) -> None:
        if request.timeout_s + self.grace_s >= self.http_timeout_s:
            raise ValueError(f"timeout_s {request.timeout_s} too long for http_timeout_s {self.http_timeout_s}")

    def _with_retries(self, attempt) -> ExecResult:
        errors = []
        for i in range(self.retries + 1):
            if i:
                self._bump("retries")
                time.sleep(self.retry_delay_s * i)
            try:
                result = attempt()
                result.attempts = i + 1
                return result
            except _NoRetry as exc:
                return ExecResult.failed(str(exc), attempts=i + 1)
            except _Infra as exc:
                errors.append(str(exc))
                if self._closed:  # no retry into a closed pool
                    break
        return ExecResult.failed(f"sandbox failed after {len(errors)} attempts: {errors[-1]}", attempts=len(errors))

    def _run_once(self, request: ExecRequest, limits: _Limits) -> ExecResult:
        box = self._checkout(limits)
        reusable = False
        try:
            result, reusable = _execute(self, box, request, WORKDIR, pooled=True)
            return result
        finally:
            self._checkin(box, reusable)

    def session(self, memory_mb: int = 512, cpus: float = 1.0, pids: int = 64, network: bool = False,
                disk_mb: int | None = None) -> DockerSession:
        """A dedicated container for several commands (not part of the pool); with ``disk_mb`` its work root is a tmpfs
        volume of that size (held in memory: its files count against ``memory_mb``).

        Raises:
            SandboxUnavailable: the container could not be created after the retries.
            ValueError: ``disk_mb`` is not a positive number of MiB.
        """
        if self._closed:
            raise RuntimeError("sandbox is closed")
        if disk_mb is not None and (isinstance(disk_mb, bool) or not isinstance(disk_mb, int) or disk_mb < 1):
            raise ValueError(f"disk_mb must be a positive int (MiB) or None, got {disk_mb!r}")
        limits = _Limits(memory_mb, cpus, pids, network, disk_mb)
        errors = []
        for i in range(self.retries + 1):
            if i:
                time.sleep(self.retry_delay_s * i)
            try:
                box = self._create(limits)
                break
            except _NoRetry as exc:
                raise SandboxUnavailable(str(exc)) from exc
            except _Infra as exc:
                errors.append(str(exc))
        else:
            raise SandboxUnavailable(f"could not create a session container: {errors[-1]}")
        s = DockerSession(self, box)
        with self._lock:
            closed = self._closed
            if not closed:
                self._sessions.add(s)
        if closed:  # close() ran while the container was starting
            s.close()
            raise RuntimeError("sandbox is closed")
        return s

    def close(self) -> None:
        """Remove every container: idle ones, open sessions, and busy ones (their runs end as ``error``)."""
        with self._lock:
            self._closed = True
            boxes = [b for lst in self._idle.values() for b in lst]
            self._idle.clear()
            self._count -= len(boxes)
            busy = list(self._busy)  # checked in (and counted down) by their runs
            sessions = list(self._sessions)
        jobs = [lambda b=b: self._remove(b) for b in boxes + busy] + [s.close for s in sessions]
        try:
            with ThreadPoolExecutor(min(8, len(jobs) or 1)) as ex:
                list(ex.map(lambda job: job(), jobs))
        except RuntimeError:  # at interpreter exit new threads are refused: remove one by one
            for job in jobs:
                job()
        _live.discard(self)


def _execute(sb: DockerSandbox, box: _Box, request: ExecRequest, cwd: str, pooled: bool) -> tuple[ExecResult, bool]:
    """Stage inputs, run the program (and, if ``pooled``, clean up); classify.

    A pooled run is one request to the container's resident exec server; a session's run is one exec of the wrapper.

    Returns:
        (result, whether the container may be used again).
    Raises:
        _Infra: a Docker call or the in-container setup failed.
    """
    workdir = resolve_path(WORKDIR, cwd, request.cwd) if request.cwd else cwd
    staged = {posixpath_rel(resolve_path(WORKDIR, workdir, p)): d for p, d in request.files.items()}
    stdin_path = "/dev/null"
    if request.stdin:
        name = f".opd-stdin-{uuid.uuid4().hex}"
        staged[name] = bytes(request.stdin)
        stdin_path = f"{WORKDIR}/{name}"
    if pooled:
        return _execute_served(sb, box, request, workdir, staged, stdin_path)
    return _execute_wrapped(sb, box, request, workdir, staged, stdin_path), True


@dataclass
class _Watched:
    """What :func:`_under_guard` saw of a program's run."""

    wall: float  # seconds the output stream was read
    oom_before: int | None
    oom_after: int | None
    guard_fired: bool


class _GuardKilled(Exception):
    """The outer guard's kill broke the output stream: a time-out, not an infrastructure failure."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"killed by the outer guard after {seconds:.1f}s")
        self.seconds = seconds


def _under_guard(sb: DockerSandbox, box: _Box, request: ExecRequest, kill, read) -> _Watched:
    """Run ``read()`` (consuming the program's output) under the outer wall-clock guard, which calls ``kill()`` at
    ``timeout_s + grace_s``; the OOM-kill counter is read around it.

    Raises:
        _GuardKilled: the guard's kill broke the stream.
        _Infra: a Docker call failed.
    """
    fired = threading.Event()

    def guard() -> None:
        fired.set()
        try:
            kill()
        except Exception:  # noqa: BLE001
            pass

    oom_before = _read_oom_kills(box.oom_path)
    timer = threading.Timer(request.timeout_s + sb.grace_s, guard)
    timer.daemon = True
    t0 = time.perf_counter()
    timer.start()
    try:
        read()
    except (docker.errors.DockerException, OSError) as exc:
        if fired.is_set():
            raise _GuardKilled(time.perf_counter() - t0) from exc
        raise _Infra(f"{type(exc).__name__}: {exc}") from exc
    finally:
        timer.cancel()
    return _Watched(time.perf_counter() - t0, oom_before, _read_oom_kills(box.oom_path), fired.is_set())


def _docker_call(call):
    """``call()``, with a Docker or socket failure raised as ``_Infra`` (worth a retry)."""
    try:
        return call()
    except (docker.errors.DockerException, OSError) as exc:
        raise _Infra(f"{type(exc).__name__}: {exc}") from exc


def _execute_served(sb: DockerSandbox, box: _Box, request: ExecRequest, workdir: str, staged: dict[str, bytes],
                    stdin_path: str) -> tuple[ExecResult, bool]:
    """One run through the container's exec server (attached on the container's first run)."""
    cap = request.max_output_bytes
    out, err = OutputBuffer(cap), OutputBuffer(cap)
    header = {"argv": request.argv, "cwd": workdir, "stdin": stdin_path, "timeout": request.timeout_s, "env": request.env}
    ends: list[tuple[bytes, bytes]] = []
    if box.server is None:
        box.server = _docker_call(lambda: _ServerStream(sb._client().api, box.container.id))
    server = box.server

    def read() -> None:
        server.send(_server_request(header, _tar(staged) if staged else b""))
        while not ends:
            frame = server.frame()
            if frame is None:
                return
            kind, data = frame
            if kind == b"O":
                out.add(data)
            elif kind == b"E":
                err.add(data)
            elif kind in (b"X", b"S"):
                ends.append(frame)
            else:
                raise _Infra(f"exec server: unexpected frame {kind!r}")

    try:
        seen = _under_guard(sb, box, request, box.container.kill, read)
    except _GuardKilled as exc:
        return ExecResult(status="timeout", duration_s=exc.seconds, error="killed by the outer guard"), False
    end = ends[0] if ends else None
    if end is not None and end[0] == b"S":
        raise _Infra(f"staging inputs failed in the container: {end[1].decode(errors='replace')[-500:]}")
    result = ExecResult(status="ok", stdout=out.text(), stderr=err.text(), stdout_truncated=out.truncated,
                        stderr_truncated=err.truncated, duration_s=seen.wall)
    if seen.guard_fired:
        result.status, result.error = "timeout", f"killed by the outer guard at {request.timeout_s + sb.grace_s:.1f}s"
        return result, False
    if end is None and sb._closed:  # close() removed the container under the run
        raise _Infra("the sandbox was closed during the run")
    if end is None:  # the server died (it ignores programs' signals: the OOM killer, or a crash)
        why = server.stderr.text()[-300:]
        result.status, result.error = "killed", f"the sandbox's exec server died during the run{': ' + why if why else ''}"
        return result, False
    exit_code, nanos, clean = json.loads(end[1])
    _classify(result, request, int(exit_code), int(nanos), seen.oom_before, seen.oom_after)
    return result, clean == 0


def _server_request(header: dict, tar: bytes) -> bytes:
    """One request on the exec server's stdin (see ``exec_server.py``)."""
    head = json.dumps(header).encode()
    return struct.pack(">I", len(head)) + head + struct.pack(">Q", len(tar)) + tar


def _execute_wrapped(sb: DockerSandbox, box: _Box, request: ExecRequest, workdir: str, staged: dict[str, bytes],
                     stdin_path: str) -> ExecResult:
    """One exec of the wrapper (a session's run: no clean-up, the container is kept)."""
    api = sb._client().api
    payload = base64.b64encode(_tar(staged)).decode() if staged else ""
    chunks = [payload[i : i + _CHUNK] for i in range(0, len(payload), _CHUNK)]
    mark = f"OPD-SANDBOX-{uuid.uuid4().hex}"
    cap = request.max_output_bytes
    out, err, tail = OutputBuffer(cap), OutputBuffer(cap), bytearray()
    if len(payload) > _ARGV_PAYLOAD_MAX:
        if not _docker_call(lambda: box.container.put_archive(WORKDIR, _tar(staged))):
            raise _Infra("put_archive returned False")
        chunks = []
    argv = ["/bin/sh", "-c", _WRAP, "sh", mark, workdir, stdin_path, f"{request.timeout_s:.3f}", str(len(chunks))]
    exec_id = _docker_call(lambda: api.exec_create(box.container.id, [*argv, *chunks, *request.argv], user=f"{UID}:{GID}",
                                                   environment=request.env or None)["Id"])  # fmt: skip

    def read() -> None:
        nonlocal tail
        for stream, data in _exec_frames(api, exec_id):
            if stream == 1:
                out.add(data)
                tail += data
                del tail[:-512]
            else:
                err.add(data)

    try:
        seen = _under_guard(sb, box, request, lambda: sb._exec_plain(box, ["sh", "-c", _KILL_ALL]), read)
    except _GuardKilled as exc:
        return ExecResult(status="timeout", duration_s=exc.seconds, error="killed by the outer guard")
    key = b"\n" + mark.encode() + b" "
    at = tail.rfind(key)
    fields = tail[at + len(key) : -1].decode().split() if at >= 0 and tail.endswith(b"\n") else []
    if fields[:1] == ["setup"]:
        raise _Infra(f"staging inputs failed in the container: {err.text()[-500:]}")
    program_len = out.kept + out.dropped - (len(tail) - at if fields else 0)
    result = ExecResult(
        status="ok",
        stdout=b"".join(out.chunks)[: min(cap, program_len)].decode("utf-8", errors="replace"),
        stderr=err.text(),
        stdout_truncated=program_len > cap,
        stderr_truncated=err.truncated,
        duration_s=seen.wall,
    )
    if seen.guard_fired:
        result.status, result.error = "timeout", f"killed by the outer guard at {request.timeout_s + sb.grace_s:.1f}s"
        return result
    if len(fields) != 2 and sb._closed:  # close() removed the container under the run
        raise _Infra("the sandbox was closed during the run")
    if len(fields) != 2:  # the wrapper itself was killed (the program signalled every process it could)
        result.status, result.error = "killed", "the sandbox wrapper was killed by the program"
        return result
    _classify(result, request, int(fields[0]), int(fields[1]), seen.oom_before, seen.oom_after)
    return result


def _classify(result: ExecResult, request: ExecRequest, exit_code: int, nanos: int, oom_before: int | None,
              oom_after: int | None) -> None:
    """Set the exit code, the program's own wall time and the status (timeout, oom, killed or ok)."""
    result.exit_code, result.duration_s = exit_code, nanos / 1e9
    oom_known = oom_before is not None and oom_after is not None
    if exit_code == 137 and result.duration_s >= request.timeout_s:
        result.status = "timeout"
    elif oom_known and oom_after > oom_before:
        result.status, result.error = "oom", f"memory limit {request.memory_mb} MB exceeded (cgroup OOM kill)"
    elif exit_code == 137 and not oom_known:
        result.status, result.error = "oom", "SIGKILL before the timeout: read as the OOM killer (no cgroup counter on this host)"
    else:
        result.status = signal_status(exit_code)


class _ServerStream:
    """The stdin and stdout of a pooled container's exec server (its PID 1, ``exec_server.py``), attached once."""

    def __init__(self, api, container_id: str) -> None:
        self._res = api._post(api._url("/containers/{0}/attach", container_id), headers={"Connection": "Upgrade", "Upgrade": "tcp"},
                              params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}, stream=True)
        try:
            api._raise_for_status(self._res)
            sock = api._get_raw_response_socket(self._res)
            api._disable_socket_timeout(sock)
            self._sock = getattr(sock, "_sock", sock)
        except BaseException:
            self.close()
            raise
        self._frames = _demux(self._res)
        self._buf = bytearray()
        self.stderr = OutputBuffer(4096)  # what the server itself wrote there (a traceback if it crashed)

    def send(self, data: bytes) -> None:
        self._sock.sendall(data)

    def frame(self) -> tuple[bytes, bytes] | None:
        """The server's next reply frame (kind, data), or None when its stream ended."""
        while True:
            if len(self._buf) >= 5:
                size = struct.unpack(">I", self._buf[1:5])[0]
                if len(self._buf) >= 5 + size:
                    kind, data = bytes(self._buf[:1]), bytes(self._buf[5 : 5 + size])
                    del self._buf[: 5 + size]
                    return kind, data
            stream, data = next(self._frames, (0, b""))
            if stream == 0:
                return None
            if stream == 1:
                self._buf += data
            else:
                self.stderr.add(data)

    def close(self) -> None:
        """Shut the connection down (a run blocked reading it wakes up) and close it."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._res.close()
        except Exception:  # noqa: BLE001
            pass


def _exec_frames(api, exec_id: str) -> Iterator[tuple[int, bytes]]:
    """Start an exec and yield its (stream, data) frames (1 stdout, 2 stderr) until it ends (see :func:`_demux`)."""
    res = api._post_json(api._url("/exec/{0}/start", exec_id), headers={"Connection": "Upgrade", "Upgrade": "tcp"},
                         data={"Tty": False, "Detach": False}, stream=True)
    try:
        api._raise_for_status(res)
        api._disable_socket_timeout(api._get_raw_response_socket(res))
        yield from _demux(res)
    finally:
        res.close()


def _demux(res) -> Iterator[tuple[int, bytes]]:
    """The (stream, data) frames (1 stdout, 2 stderr) of an upgraded exec or attach response, until it ends.

    docker-py's own demultiplexer (``exec_start(stream=True, demux=True)``) reads the raw socket underneath
    http.client's buffered reader, so output that arrived together with the response headers is skipped and the
    frames lose their alignment ("ValueError: 56 is not a valid stream", docker-py #3160; seen here under load when
    a program writes at once). This reads the frames through that buffered reader instead (docker 7.2 internals).

    Raises:
        _Infra: the stream is not a valid multiplexed stream.
    """
    reader = res.raw._fp.fp  # the buffered reader http.client parsed the headers with
    while True:
        header = reader.read(8)
        if len(header) < 8:
            return
        stream, size = struct.unpack(">BxxxL", header)
        if stream not in (1, 2):
            raise _Infra(f"docker stream out of frame alignment (stream id {stream})")
        data = reader.read(size)
        if data:
            yield stream, data
        if len(data) < size:
            return


def posixpath_rel(abs_path: str) -> str:
    """``/box/a/b`` → ``a/b`` (tar member names are relative to the work root)."""
    return abs_path[len(WORKDIR) + 1 :]


class DockerSession(Session):
    """A dedicated container; see ``Session``. Commands run one at a time (a lock serialises them)."""

    def __init__(self, sb: DockerSandbox, box: _Box) -> None:
        super().__init__(WORKDIR)
        self._sb, self._box = sb, box
        self._lock = threading.Lock()
        self._closed = False

    @property
    def container_id(self) -> str:
        return self._box.container.id

    def _is_dir(self, path: str) -> bool:
        return self._sb._exec_plain(self._box, ["test", "-d", path]) == 0

    def run(self, request: ExecRequest) -> ExecResult:
        self._sb._check_timeout(request)
        with self._lock:
            if self._closed:
                raise RuntimeError("session is closed")
            try:
                result, _ = _execute(self._sb, self._box, request, self._cwd, pooled=False)
                return result
            except _Infra as exc:
                return ExecResult.failed(str(exc))

    def write_files(self, files: Mapping[str, bytes]) -> None:
        staged = {posixpath_rel(resolve_path(WORKDIR, self._cwd, p)): d for p, d in files.items()}
        if not staged:
            return
        try:
            ok = self._box.container.put_archive(WORKDIR, _tar(staged))
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
            self._sb._remove(self._box)
        with self._sb._lock:
            self._sb._sessions.discard(self)
