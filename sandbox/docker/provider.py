"""The Docker provider and its warm pool: containers are created locked down, kept per limits, reused after the exec
server cleaned them, and removed on ``close()`` (see the package docstring for the guarantees)."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import docker.errors
import requests
from docker.types import DriverConfig, LogConfig, Mount, Ulimit

from opd_harness.sandbox import ExecRequest, ExecResult, Sandbox, SandboxUnavailable
from opd_harness.sandbox.docker.box import GID, UID, WORKDIR, Infra, Limits, NoRetry
from opd_harness.sandbox.docker.cleanup import LABEL, OWNER, OWNER_LABEL, hold_until_closed, make_client, reap_once, release
from opd_harness.sandbox.docker.session import DockerSession
from opd_harness.sandbox.docker.transport import Box, execute

DEFAULT_IMAGE = "opd-sandbox:bookworm"
_ENV = {"HOME": "/tmp", "LANG": "C.UTF-8", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
_SERVER = (Path(__file__).parent.parent / "exec_server.py").read_text()  # PID 1 of every container


def build_command(image: str) -> str:
    """The command that builds ``image`` (shown when it is missing)."""
    return "harness sandbox build" + ("" if image == DEFAULT_IMAGE else f" --tag {image}")


def _work_mount(disk_mb: int | None) -> Mount:
    """The work root: an anonymous volume on the daemon's disk, or with ``disk_mb`` one backed by a tmpfs of that size
    (a full one fails writes with ENOSPC; unlike a plain tmpfs mount, ``put_archive`` / ``get_archive`` reach it)."""
    if disk_mb is None:
        return Mount(target=WORKDIR, source=None, type="volume")
    options = {"type": "tmpfs", "device": "tmpfs", "o": f"size={disk_mb}m,uid={UID},gid={GID},mode=0755,nosuid,nodev"}
    return Mount(target=WORKDIR, source=None, type="volume", driver_config=DriverConfig("local", options))


DEFAULT_SESSION_POOL = 16  # idle reset sessions kept (and prewarmed) at least, when session_pool follows the peak


class DockerSandbox(Sandbox):
    """Docker provider (see the package docstring, ``opd_harness.sandbox.docker``, for the isolation and the limits).

    Args:
        image: image tag to run (built by ``python -m opd_harness.sandbox.build``).
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
        session_pool: most reset session containers kept idle for ``session(pooled=True)``; None (default): as many as
            the most pooled sessions open at once so far, at least 16 (a rollout's episodes hold their sessions across
            their turns, so a step's sessions all go back to the pool and the next step creates no container).
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
        session_pool: int | None = None,
    ) -> None:
        if pool_size < 1:
            raise ValueError("pool_size must be >= 1")
        if session_pool is not None and (isinstance(session_pool, bool) or not isinstance(session_pool, int) or session_pool < 0):
            raise ValueError(f"session_pool must be an int >= 0 or None (as many as were open at once), got {session_pool!r}")
        self.image, self.pool_size, self.base_url = image, pool_size, base_url
        self.retries, self.retry_delay_s, self.grace_s = retries, retry_delay_s, grace_s
        self.tmpfs_mb, self.max_file_mb, self.reap, self.http_timeout_s = tmpfs_mb, max_file_mb, reap, http_timeout_s
        self._client_obj = None
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(pool_size)
        self._idle: dict[Limits, list[Box]] = {}
        self._count = 0  # containers in the pool, idle + busy
        self._busy: set[Box] = set()  # pooled containers running a program now (removed by close())
        self._sessions: set[DockerSession] = set()  # open sessions (strong: each is closed by close())
        self._resetting: set[Box] = set()  # closed pooled sessions' containers being reset (removed by close())
        self.session_pool = session_pool
        self._pooled_open = 0  # pooled sessions open now...
        self._pooled_peak = 0  # ...and the most open at once so far (the idle cap when session_pool is None)
        self._idle_sessions: dict[Limits, list[Box]] = {}  # reset containers of closed pooled sessions
        self._closed = False
        self._stats_lock = threading.Lock()
        self.stats = {"created": 0, "reused": 0, "discarded": 0, "retries": 0, "sessions_reused": 0, "sessions_discarded": 0,
                      "sessions_prewarmed": 0}
        hold_until_closed(self)
        if prewarm:
            self.prewarm(prewarm)

    # ------------------------------------------------------------ infrastructure

    @property
    def closed(self) -> bool:
        """``close()`` has been called (runs in flight then end as ``error``)."""
        return self._closed

    def client(self):
        """The Docker client, made on first use (which also reaps leftovers of dead owners, once per daemon)."""
        if self._client_obj is None:
            with self._lock:
                if self._client_obj is None:
                    try:
                        client = make_client(self.base_url, 2 * self.pool_size + 8, self.http_timeout_s)
                    except docker.errors.DockerException as exc:
                        raise Infra(f"Docker daemon unreachable: {exc}") from exc
                    key = self.base_url or os.environ.get("DOCKER_HOST", "default")
                    if self.reap:
                        reap_once(client, key)
                    self._client_obj = client
        return self._client_obj

    def check_ready(self) -> None:
        """Raise ``SandboxUnavailable`` saying what to do when the daemon does not answer or the image is not built."""
        where = self.base_url or os.environ.get("DOCKER_HOST") or "the local socket"
        try:
            client = self.client()
            client.api.ping()
        except (Infra, docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
            cause = exc.__cause__ if isinstance(exc, Infra) and exc.__cause__ else exc
            raise SandboxUnavailable(
                f"Docker daemon unreachable at {where} ({cause}); start it (`dockerd &` or `systemctl start docker`) or set DOCKER_HOST"
            ) from None
        try:
            client.images.get(self.image)
        except docker.errors.ImageNotFound:
            raise SandboxUnavailable(f"sandbox image {self.image!r} not found; build it with `{build_command(self.image)}`") from None
        except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
            raise SandboxUnavailable(f"could not inspect sandbox image {self.image!r} at {where}: {exc}") from None

    def _create(self, limits: Limits) -> Box:
        client = self.client()
        kwargs = dict(
            command=["python3", "-I", "-S", "-c", _SERVER],  # PID 1: reaps orphans; serves a pooled container's runs
            stdin_open=True,  # the server's request stream (it waits on it for ever where nobody attaches)
            log_config=LogConfig(type=LogConfig.types.NONE),  # replies travel by attach only, never into a log file
            labels={LABEL: "1", OWNER_LABEL: OWNER},
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
            how = f"`{build_command(self.image)}` (or `python -m opd_harness.sandbox.build`)"
            raise NoRetry(f"image {self.image!r} not found; build it with {how} ({exc})") from exc
        except (docker.errors.DockerException, OSError) as exc:
            if container is not None:
                self.remove_box(Box(container, limits))
            raise Infra(f"container creation failed: {exc}") from exc
        self._bump("created")
        return Box(container, limits)

    def remove_box(self, box: Box) -> None:
        try:
            box.container.remove(force=True, v=True)
        except Exception:  # noqa: BLE001 - already gone, or the daemon is down: reaped later
            pass
        if box.server is not None:
            box.server.close()

    def exec_plain(self, box: Box, argv: list[str]) -> int | None:
        """Run a short command in the container; its exit code (None when it could not be run)."""
        try:
            api = self.client().api
            exec_id = api.exec_create(box.container.id, argv, user=f"{UID}:{GID}")["Id"]
            api.exec_start(exec_id)
            return api.exec_inspect(exec_id)["ExitCode"]
        except Exception:  # noqa: BLE001
            return None

    # ------------------------------------------------------------ pool

    def prewarm(self, n: int | None = None, request: ExecRequest | None = None) -> int:
        """Start up to ``n`` (default ``pool_size``) idle containers for ``request``'s limits; returns how many."""
        limits = Limits.of(request or ExecRequest(argv=["true"]))
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
            self.remove_box(box)
        return made

    def _checkout(self, limits: Limits) -> Box:
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
            self.remove_box(victim)
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

    def _checkin(self, box: Box, reusable: bool) -> None:
        with self._lock:
            self._busy.discard(box)
            if reusable and not self._closed:  # the run's wrapper already cleaned the container
                self._idle.setdefault(box.limits, []).append(box)
                return
            self._count -= 1
        self._bump("discarded")
        self.remove_box(box)

    def _bump(self, key: str, by: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += by

    # ------------------------------------------------------------ running

    def run(self, request: ExecRequest) -> ExecResult:
        """Run ``request`` in a pooled container; blocks while ``pool_size`` runs are in flight."""
        self.check_timeout(request)
        limits = Limits.of(request)
        with self._slots:
            return self._with_retries(lambda: self._run_once(request, limits))

    def check_timeout(self, request: ExecRequest) -> None:
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
            except NoRetry as exc:
                return ExecResult.failed(str(exc), attempts=i + 1)
            except Infra as exc:
                errors.append(str(exc))
                if self._closed:  # no retry into a closed pool
                    break
        return ExecResult.failed(f"sandbox failed after {len(errors)} attempts: {errors[-1]}", attempts=len(errors))

    def _run_once(self, request: ExecRequest, limits: Limits) -> ExecResult:
        box = self._checkout(limits)
        reusable = False
        try:
            result, reusable = execute(self, box, request, WORKDIR, served=True)
            return result
        finally:
            self._checkin(box, reusable)

    def session(self, memory_mb: int = 512, cpus: float = 1.0, pids: int = 64, network: bool = False,
                disk_mb: int | None = None, pooled: bool = False, served: bool = False) -> DockerSession:
        """A dedicated container for several commands (not part of the pool); with ``disk_mb`` its work root is a tmpfs
        volume of that size (held in memory: its files count against ``memory_mb``).

        ``pooled``: the container may be one a closed pooled session left (reset: every process of the sandbox user
        killed, the work root, /tmp, /dev/shm and /dev/mqueue emptied), runs are requests to its exec server instead of
        a ``docker exec`` each, and ``close`` resets it and keeps it for the next (up to :meth:`idle_session_cap` idle).
        ``served`` (implied by ``pooled``): runs are requests to the container's exec server (no process per run but the
        program; files and background processes stay), the container is still removed on ``close``.

        Raises:
            SandboxUnavailable: the container could not be created after the retries.
            ValueError: ``disk_mb`` is not a positive number of MiB.
        """
        if self._closed:
            raise RuntimeError("sandbox is closed")
        if disk_mb is not None and (isinstance(disk_mb, bool) or not isinstance(disk_mb, int) or disk_mb < 1):
            raise ValueError(f"disk_mb must be a positive int (MiB) or None, got {disk_mb!r}")
        limits = Limits(memory_mb, cpus, pids, network, disk_mb)
        box = (self._idle_session_box(limits) if pooled else None) or self._create_session_box(limits)
        s = DockerSession(self, box, pooled, served)
        with self._lock:
            closed = self._closed
            if not closed:
                self._sessions.add(s)
                if pooled:
                    self._pooled_open += 1
                    self._pooled_peak = max(self._pooled_peak, self._pooled_open)
        if closed:  # close() ran while the container was starting
            s.close()
            raise RuntimeError("sandbox is closed")
        return s

    def _create_session_box(self, limits: Limits) -> Box:
        """A new container for a session, with the retries. Raises ``SandboxUnavailable``."""
        errors = []
        for i in range(self.retries + 1):
            if i:
                time.sleep(self.retry_delay_s * i)
            try:
                return self._create(limits)
            except NoRetry as exc:
                raise SandboxUnavailable(str(exc)) from exc
            except Infra as exc:
                errors.append(str(exc))
        raise SandboxUnavailable(f"could not create a session container: {errors[-1]}")

    def prewarm_sessions(self, n: int, memory_mb: int = 512, cpus: float = 1.0, pids: int = 64, network: bool = False,
                         disk_mb: int | None = None) -> int:
        """Start up to ``n`` idle session containers with these limits (at most :meth:`idle_session_cap` idle in all), in
        parallel, for ``session(pooled=True)`` to hand out; returns how many were added. Failures are not raised: a
        pooled session that finds none idle starts its own."""
        limits = Limits(memory_mb, cpus, pids, network, disk_mb)
        with self._lock:
            n = min(n, self._idle_cap() - sum(map(len, self._idle_sessions.values()))) if not self._closed else 0
        if n <= 0:
            return 0
        with ThreadPoolExecutor(min(n, 8)) as ex:
            futures = [ex.submit(self._create, limits) for _ in range(n)]
        made, late = 0, []
        for f in futures:
            if f.exception() is not None:
                continue
            with self._lock:
                idle = self._idle_sessions.setdefault(limits, [])
                if not self._closed and sum(map(len, self._idle_sessions.values())) < self._idle_cap():
                    idle.append(f.result())
                    made += 1
                    continue
            late.append(f.result())  # closed (or filled by closing sessions) meanwhile: not kept
        for box in late:
            self.remove_box(box)
        self._bump("sessions_prewarmed", made)
        return made

    def _idle_session_box(self, limits: Limits) -> Box | None:
        """A reset container of a closed pooled session with these limits, if one is idle."""
        with self._lock:
            boxes = self._idle_sessions.get(limits)
            if not boxes:
                return None
            self._bump("sessions_reused")
            return boxes.pop()

    def recycle_session_box(self, box: Box) -> None:
        """Reset a closed pooled session's container and keep it idle (or remove it: the reset failed, the idle
        sessions are full, the sandbox is closed). The reset is the exec server's clean-up after a pooled run."""
        reusable = False
        with self._lock:
            resetting = not self._closed
            if resetting:
                self._resetting.add(box)  # close() removes it under the reset (which then fails)
        if resetting:
            try:
                result, reusable = execute(self, box, ExecRequest(argv=["true"], timeout_s=10.0), WORKDIR, served=True)
                reusable = reusable and result.status == "ok"
            except Infra:
                reusable = False
        with self._lock:
            self._resetting.discard(box)
            idle = self._idle_sessions.setdefault(box.limits, [])
            if reusable and not self._closed and sum(map(len, self._idle_sessions.values())) < self._idle_cap():
                idle.append(box)
                return
        self._bump("sessions_discarded")
        self.remove_box(box)

    def forget_session(self, session: DockerSession) -> None:
        """A session closed itself: ``close()`` need not close it."""
        with self._lock:
            if session in self._sessions and session.pooled:
                self._pooled_open -= 1
            self._sessions.discard(session)

    def idle_session_cap(self) -> int:
        """Most reset session containers kept idle: ``session_pool``, or (None) the most pooled sessions open at once, ≥ 16."""
        with self._lock:
            return self._idle_cap()

    def _idle_cap(self) -> int:
        """:meth:`idle_session_cap` with the lock held."""
        return self.session_pool if self.session_pool is not None else max(DEFAULT_SESSION_POOL, self._pooled_peak)

    def close(self) -> None:
        """Remove every container: idle ones, open sessions, and busy ones (their runs end as ``error``)."""
        with self._lock:
            self._closed = True
            boxes = [b for lst in self._idle.values() for b in lst]
            self._idle.clear()
            self._count -= len(boxes)
            boxes += [b for lst in self._idle_sessions.values() for b in lst]
            self._idle_sessions.clear()
            busy = list(self._busy) + list(self._resetting)  # checked in (and counted down) by their runs; resets fail
            sessions = list(self._sessions)
        jobs = [lambda b=b: self.remove_box(b) for b in boxes + busy] + [s.close for s in sessions]
        try:
            with ThreadPoolExecutor(min(8, len(jobs) or 1)) as ex:
                list(ex.map(lambda job: job(), jobs))
        except RuntimeError:  # at interpreter exit new threads are refused: remove one by one
            for job in jobs:
                job()
        release(self)
