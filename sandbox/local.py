"""Local provider: a subprocess with rlimits in a fresh temporary directory.

**It isolates much less than Docker.** Use it only where Docker is unavailable, for code you would
almost trust. What it does:
  - a new session (process group) per run, killed as a group at the timeout;
  - started as root: each run (and each session) runs under its own unprivileged uid/gid, taken
    from ``run_as`` [65533] downwards (``uid_count`` [4096] of them, above Debian's UID_MAX 60000; an flock under
    ``/run/opd-sandbox-local`` keeps concurrent processes from sharing one). Root-only files are then
    unreadable, RLIMIT_NPROC counts only that run's processes, and after the run every process
    of that uid is killed, even one that left the process group with ``setsid``;
  - rlimits: CPU seconds (``timeout_s`` + 1, then SIGXCPU, read as ``timeout``), address space
    (``memory_mb``; Python raises ``MemoryError``, read as ``oom`` from stderr), processes and
    threads (``pids``, RLIMIT_NPROC), file size (``max_file_mb`` [64]), no core dumps;
  - a fresh temporary directory per run (``box/`` is the working directory, ``tmp/`` is
    ``TMPDIR`` and ``HOME``), removed afterwards;
  - a scrubbed environment: only ``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` plus ``request.env``;
  - namespaces via ``unshare`` when the OS allows them (root, or unprivileged user namespaces):
    a new network namespace (no network: only a down ``lo``) and a new PID namespace, where a
    small init forks the program and, when it exits, the kernel kills everything it left behind;
    ``kill(-1)`` then reaches nothing outside the run. Without them ``network_isolated`` /
    ``pid_isolated`` are False and a warning says the network is reachable.
What it does not do: hide the host file system (the program reads every world-readable file, and
paths in results are host paths; ``/proc`` lists the host's processes), limit CPU share (``cpus``
is ignored), bound a session's disk use (``disk_mb`` is ignored; only each file is capped, at
``max_file_mb``), or bound resident memory the way a cgroup does (address space is not RSS; programs
that reserve much virtual memory fail early). Not started as root and without namespaces, it
cannot drop privileges, and a program can signal every process of the user running the harness.
``python`` is this interpreter (``sys.executable``, so the venv's packages are importable) when the
run's uid can execute it, else the system ``python3``.
"""

from __future__ import annotations

import fcntl
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

from opd_harness.sandbox import (
    MAX_READ_FILE_BYTES,
    ExecRequest,
    ExecResult,
    OutputBuffer,
    Sandbox,
    Session,
    resolve_path,
    signal_status,
)

# Runs between unshare and the program. In a new PID namespace it is PID 1: it forks the program,
# waits for it and exits with its status (128+N for signal N); the kernel then kills every other
# process left in the namespace. The child sets the rlimits, drops root and execs the program.
# Its settings travel as one argv word of NAME=VALUE pairs (no json: importing it took half the shim's ~35 ms of CPU,
# paid once per run). ``uid``/``gid`` appear only when a uid was taken; RLIMIT_X=SOFT,HARD sets a limit.
_SHIM = """
import os, resource, sys, warnings  # everything execvp needs, imported before dropping root
cfg = dict(item.split("=", 1) for item in sys.argv[1].split())

def program():
    for name, value in cfg.items():
        if name.startswith("RLIMIT_"):
            resource.setrlimit(getattr(resource, name), tuple(int(v) for v in value.split(",")))
    if "uid" in cfg:
        os.setgroups([])
        os.setgid(int(cfg["gid"]))
        os.setuid(int(cfg["uid"]))
    os.umask(0o022)
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    except OSError as exc:
        os.write(2, f"sandbox: cannot run {sys.argv[2]!r}: {exc}\\n".encode())
        os._exit(126 if os.path.exists(sys.argv[2]) else 127)

if os.getpid() != 1:
    program()
child = os.fork()
if child == 0:
    program()
while True:
    pid, status = os.wait()
    if pid == child:
        code = os.waitstatus_to_exitcode(status)
        os._exit(128 - code if code < 0 else code)
"""
_OOM_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
_PATH = "/usr/local/bin:/usr/bin:/bin"
_CLEAN = b"clean"  # a uid lock file's content when its last holder left no process of that uid behind
_UID_LOCK_DIR = Path("/run/opd-sandbox-local" if os.path.isdir("/run") else tempfile.gettempdir() + "/opd-sandbox-local")  # root only


class _UidUse:
    """The runs under one taken uid: how many are going, and whether any ended other than on its own (killed)."""

    def __init__(self) -> None:
        self.running, self.killed = 0, False
        self._lock = threading.Lock()  # a session's serving run and its cells end on different threads

    def started(self) -> None:
        with self._lock:
            self.running += 1

    def ended(self, alone: bool) -> None:
        with self._lock:
            self.running -= 1
            self.killed |= not alone

    def quiet(self) -> bool:
        """No run going and none killed: every process the uid had lived in a PID namespace that has been reaped."""
        with self._lock:
            return self.running == 0 and not self.killed


def _open_lock_file(path: Path) -> tuple[int, bool]:
    """(an fd of the uid lock file at ``path``, whether this call created it)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), True
    except FileExistsError:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o600), False


def _probe_unshare(root: bool) -> tuple[list[str], bool, bool]:
    """(unshare flags, network namespace works, PID namespace works) on this machine."""
    if shutil.which("unshare") is None:
        return [], False, False
    user = [] if root else ["-r"]  # as root, no user namespace: it could not setuid to an unmapped uid
    for net, pid in ((True, True), (True, False), (False, True)):
        flags = [*user, *(["-n"] if net else []), *(["-p", "-f", "--kill-child"] if pid else [])]
        try:
            if subprocess.run(["unshare", *flags, "true"], capture_output=True, timeout=10).returncode == 0:
                return flags, net, pid
        except (OSError, subprocess.SubprocessError):
            continue
    return [], False, False


class LocalSandbox(Sandbox):
    """Local provider (see the module docstring; weaker isolation than Docker).

    Args:
        run_as: uid (and gid) to drop to when started as root; ``None`` keeps the current user.
        uid_count: how many uids, from ``run_as`` down, runs and sessions may take (one each while it lasts, shared by
            every process on the machine): a rollout of 256 tool episodes holds 256 interpreter sessions at once, so
            two such runs side by side need more than 512.
        network_isolation: ``"auto"`` (a network namespace when it works, else a warning), ``True``
            (require it: ``RuntimeError`` otherwise) or ``False`` (never).
        max_parallel: most runs at once (default: CPU count).
        max_file_mb: RLIMIT_FSIZE for files the program writes.
        base_dir: where the temporary directories go (default: the system temp dir).
    """

    python = sys.executable

    def __init__(
        self,
        run_as: int | None = 65533,
        uid_count: int = 4096,
        network_isolation: bool | str = "auto",
        max_parallel: int | None = None,
        max_file_mb: int = 64,
        base_dir: str | None = None,
    ) -> None:
        self.root_mode = os.geteuid() == 0 and run_as is not None
        # Root: each run / session gets its own uid (run_as, run_as - 1, ...), so RLIMIT_NPROC is
        # per run and every process left behind (even after setsid) can be found and killed.
        self._uid_range = list(range(run_as, run_as - uid_count, -1)) if self.root_mode else []
        self._uid_next = os.getpid() % max(uid_count, 1)  # spread processes over the range
        self._uid_lock = threading.Lock()
        self._uid_files: dict[int, int] = {}  # uid -> fd holding its lock
        self._uid_use: dict[int, _UidUse] = {}  # uid -> its runs since it was taken
        self.max_file_mb, self.base_dir = max_file_mb, base_dir
        flags, self.network_isolated, self.pid_isolated = _probe_unshare(self.root_mode)
        if not network_isolation:
            self.network_isolated = False
        self._user_flags = [f for f in flags if f == "-r"]
        self._pid_flags = ["-p", "-f", "--kill-child"] if self.pid_isolated else []
        if network_isolation is True and not self.network_isolated:
            raise RuntimeError("network isolation required but `unshare -n` does not work here")
        if network_isolation == "auto" and not self.network_isolated:
            warnings.warn("local sandbox: no network namespace available; programs can reach the network", stacklevel=2)
        if self.root_mode and not _reachable(sys.executable, run_as):
            self.python = shutil.which("python3", path=_PATH) or "python3"  # this interpreter is private to root
        self._slots = threading.BoundedSemaphore(max_parallel or os.cpu_count() or 1)
        self._sessions: set[LocalSession] = set()
        self._closed = False

    # ------------------------------------------------------------ uids and directories

    def _take_uid(self) -> int | None:
        """A uid no other run (in any process on this machine) is using: held by an flock. Its processes are looked for
        (and killed) unless none can be left: its lock file is new (no holder since the lock directory was made, at boot
        under /run) or its last holder gave it back empty (the file then says ``clean``); a holder that crashed may have
        left some behind. The look is a scan of /proc, costly beside hundreds of sessions."""
        if not self.root_mode:
            return None
        _UID_LOCK_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self._uid_lock:
            n = len(self._uid_range)
            for k in range(n):
                uid = self._uid_range[(self._uid_next + k) % n]
                fd, new = _open_lock_file(_UID_LOCK_DIR / str(uid))
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._uid_next = (self._uid_next + k + 1) % n  # round robin: leftover zombies get time to be reaped
                self._uid_files[uid] = fd
                self._uid_use[uid] = _UidUse()
                break
            else:
                raise OSError(f"local sandbox: all {n} uids are in use (too many runs or sessions)")
        clean = new or os.pread(fd, 16, 0) == _CLEAN
        os.ftruncate(fd, 0)  # held: a crash from here on leaves the file without the mark
        if not clean:
            _kill_uid(uid)  # outside the lock: other sessions open meanwhile
        return uid

    def _give_uid(self, uid: int | None) -> None:
        """Give ``uid`` back, killing what its runs left. With PID namespaces a run that ended on its own left nothing
        (its namespace's processes are reaped before the run's ``unshare`` returns), so when every run since the take
        did, /proc is not scanned; otherwise (a run timed out or is still going, or no namespaces) it is."""
        if uid is None:
            return
        with self._uid_lock:
            use = self._uid_use.pop(uid, None)
        emptied = True if self.pid_isolated and use is not None and use.quiet() else _kill_uid(uid)
        with self._uid_lock:
            fd = self._uid_files.pop(uid, None)
        if fd is not None:
            if emptied:
                os.pwrite(fd, _CLEAN, 0)  # the next holder need not look for this uid's processes
            os.close(fd)  # releases the flock

    def _make_root(self, uid: int | None) -> Path:
        root = Path(tempfile.mkdtemp(prefix="opd-sandbox-", dir=self.base_dir))
        (root / "box").mkdir()
        (root / "tmp").mkdir()
        _own(root, uid)
        return root

    def _write(self, root: Path, cwd: str, files: Mapping[str, bytes], uid: int | None) -> None:
        for rel, data in files.items():
            full = resolve_path("/box", cwd, rel)
            target = root / full.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(bytes(data))
            target.chmod(0o755 if data[:2] == b"#!" else 0o644)
        if files:
            _own(root / "box", uid)

    # ------------------------------------------------------------ running

    def run(self, request: ExecRequest) -> ExecResult:
        """Run ``request`` in a fresh temporary directory (removed afterwards)."""
        if self._closed:
            raise RuntimeError("sandbox is closed")
        with self._slots:
            try:
                uid = self._take_uid()
                root = self._make_root(uid)
            except OSError as exc:
                return ExecResult.failed(f"could not prepare the local sandbox: {exc}")
            try:
                return self._execute(root, "/box", request, request, uid)
            except OSError as exc:
                return ExecResult.failed(f"local sandbox failed: {exc}")
            finally:
                self._give_uid(uid)  # kills whatever the run left behind
                _rmtree(root)

    def _execute(self, root: Path, cwd: str, request: ExecRequest, limits: ExecRequest, uid: int | None) -> ExecResult:
        workdir = resolve_path("/box", cwd, request.cwd) if request.cwd else cwd
        self._write(root, workdir, request.files, uid)
        run_dir = root / workdir.lstrip("/")
        if not run_dir.is_dir():
            return ExecResult(status="ok", exit_code=125, stderr=f"sandbox: no directory {workdir}\n")
        cpu = math.ceil(request.timeout_s) + 1
        nproc = limits.pids if uid is not None else limits.pids + uid_tasks(os.getuid())[1]
        rlimits = {
            "RLIMIT_CPU": (cpu, cpu + 1),
            "RLIMIT_AS": (limits.memory_mb << 20,) * 2,
            "RLIMIT_NPROC": (nproc, nproc),
            "RLIMIT_FSIZE": (self.max_file_mb << 20,) * 2,
            "RLIMIT_CORE": (0, 0),
        }
        ids = [f"uid={uid}", f"gid={uid}"] if uid is not None else []
        cfg = " ".join([*(f"{name}={soft},{hard}" for name, (soft, hard) in rlimits.items()), *ids])
        env = {"PATH": _PATH, "HOME": str(root / "tmp"), "TMPDIR": str(root / "tmp"), "LANG": "C.UTF-8", **request.env}
        flags = [*self._user_flags, *(["-n"] if self.network_isolated and not limits.network else []), *self._pid_flags]
        prefix = ["unshare", *flags] if flags else []
        argv = [*prefix, sys.executable, "-I", "-S", "-c", _SHIM, cfg, *request.argv]
        out, err = OutputBuffer(request.max_output_bytes), OutputBuffer(request.max_output_bytes)
        use = self._uid_use.get(uid) if uid is not None else None
        if use is not None:  # counted before the process exists: a give meanwhile must not take the uid for quiet
            use.started()
        t0 = time.perf_counter()
        try:
            proc = subprocess.Popen(
                argv, cwd=run_dir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, close_fds=True,
            )
        except OSError as exc:
            if use is not None:
                use.ended(alone=True)  # nothing started
            return ExecResult.failed(f"could not start the process: {exc}")
        timed_out = True  # until _communicate says otherwise (an exception on the way counts as a kill)
        try:
            timed_out = _communicate(proc, bytes(request.stdin), t0 + request.timeout_s, out, err)
        finally:
            if use is not None:  # unshare ended on its own (not killed: rc >= 0): its namespace is empty
                use.ended(alone=not timed_out and proc.poll() is not None and proc.returncode >= 0)
        duration = time.perf_counter() - t0
        _killpg(proc.pid)  # whatever is left of the group
        if timed_out and uid is not None:
            _kill_uid(uid)  # a session keeps its background processes, except after a timeout
        rc = proc.returncode
        exit_code = 128 - rc if rc < 0 else rc  # the PID-namespace shim already reports 128+N
        result = ExecResult(
            status="ok",
            exit_code=exit_code,
            stdout=out.text(),
            stderr=err.text(),
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            duration_s=duration,
        )
        tail = b"".join(err.chunks)[-4096:]
        if timed_out or exit_code == 128 + signal.SIGXCPU:
            result.status = "timeout"
        elif exit_code != 0 and any(m in tail for m in _OOM_MARKERS):
            result.status, result.error = "oom", f"address-space limit {limits.memory_mb} MB hit"
        else:
            result.status = signal_status(exit_code)
        return result

    def session(self, memory_mb: int = 512, cpus: float = 1.0, pids: int = 64, network: bool = False,
                disk_mb: int | None = None, pooled: bool = False) -> LocalSession:
        """A temporary directory (and, as root, a uid) kept until ``close``; commands run one at a time (``disk_mb`` is
        not enforced: the directory is on the host's disk; ``pooled`` changes nothing: a new directory is as cheap)."""
        if self._closed:
            raise RuntimeError("sandbox is closed")
        limits = ExecRequest(argv=["true"], memory_mb=memory_mb, cpus=cpus, pids=pids, network=network)
        uid = self._take_uid()
        s = LocalSession(self, self._make_root(uid), limits, uid)
        self._sessions.add(s)
        return s

    def close(self) -> None:
        self._closed = True
        for s in list(self._sessions):
            s.close()


def _own(path: Path, uid: int | None) -> None:
    if uid is None:
        return
    os.chown(path, uid, uid)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def _rmtree(path: Path) -> None:
    def fix(func, p, _exc):  # a run may have made its own directories unwritable
        try:
            os.chmod(os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)


def uid_tasks(uid: int) -> tuple[list[int], int]:
    """(pids of ``uid``'s live processes, its tasks (threads, zombies included) as RLIMIT_NPROC counts them)."""
    live, total = [], 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:  # /proc/<pid> belongs to the process's effective uid, or to root when it is not dumpable: only those two
            if entry.stat(follow_symlinks=False).st_uid not in (uid, 0):  # can be uid's (reading status is the cost)
                continue
            text = Path(entry.path, "status").read_text()
        except OSError:
            continue
        if _status_field(text, "Uid").split()[:1] != [str(uid)]:
            continue
        total += int(_status_field(text, "Threads") or "1")
        if not _status_field(text, "State").startswith(("Z", "X")):
            live.append(int(entry.name))
    return live, total


def _status_field(text: str, name: str) -> str:
    """The value of ``name:`` in a /proc/<pid>/status text ('' when absent), found without splitting every line."""
    start = text.find(f"\n{name}:")
    if start < 0:
        return ""
    start += len(name) + 2
    end = text.find("\n", start)
    return text[start : end if end >= 0 else len(text)].strip()


def _kill_uid(uid: int, wait_s: float = 2.0) -> bool:
    """SIGKILL every process of ``uid`` (a per-run uid) until none is alive, for at most ``wait_s``; whether none is."""
    end = time.monotonic() + wait_s
    while True:
        live, _ = uid_tasks(uid)
        if not live:
            return True
        if time.monotonic() > end:
            return False
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)


def _reachable(path: str, uid: int) -> bool:
    """Whether ``uid`` (with no supplementary groups, gid == uid) can execute ``path`` and every link on the way."""

    def ok(p: Path, bit: int) -> bool:
        st = p.stat()
        if st.st_uid == uid:
            return bool(st.st_mode & (bit << 6))
        if st.st_gid == uid:
            return bool(st.st_mode & (bit << 3))
        return bool(st.st_mode & bit)

    try:
        for p in {Path(path).absolute(), Path(path).resolve()}:
            if not ok(p, 1) or not all(ok(d, 1) for d in p.parents):
                return False
    except OSError:
        return False
    return True


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _communicate(proc: subprocess.Popen, stdin: bytes, deadline: float, out: OutputBuffer, err: OutputBuffer) -> bool:
    """Feed stdin, read capped output, enforce the wall-clock deadline. Returns whether it timed out."""
    sel = selectors.DefaultSelector()
    for stream, buf in ((proc.stdout, out), (proc.stderr, err)):
        os.set_blocking(stream.fileno(), False)
        sel.register(stream, selectors.EVENT_READ, buf)
    if stdin:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, None)
    else:
        proc.stdin.close()
    view, timed_out, exited_at = memoryview(stdin), False, None
    while sel.get_map():
        now = time.perf_counter()
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now > exited_at + 0.5:
            break  # the program is done; only escaped descendants still hold the pipes
        if now >= deadline:
            timed_out = proc.poll() is None
            _killpg(proc.pid)
            deadline = float("inf")
            exited_at = exited_at or now
        for key, _ in sel.select(timeout=min(0.05, max(0.0, deadline - now))):
            if key.data is None:  # stdin
                try:
                    n = os.write(key.fd, view[:65536])
                    view = view[n:]
                except (BrokenPipeError, BlockingIOError) as exc:
                    if isinstance(exc, BlockingIOError):
                        continue
                    view = view[:0]
                if not view:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                continue
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if chunk:
                key.data.add(chunk)
            else:
                sel.unregister(key.fileobj)
    for key in list(sel.get_map().values()):
        sel.unregister(key.fileobj)
    sel.close()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        try:
            stream.close()
        except OSError:
            pass
    if proc.poll() is None:
        remaining = deadline - time.perf_counter()
        try:
            proc.wait(timeout=max(0.0, remaining) if remaining != float("inf") else None)
        except subprocess.TimeoutExpired:
            timed_out = True
            _killpg(proc.pid)
            proc.wait()
    return timed_out


class LocalSession(Session):
    """A temporary directory; see ``Session``."""

    def __init__(self, sb: LocalSandbox, root: Path, limits: ExecRequest, uid: int | None) -> None:
        super().__init__("/box")
        self._sb, self._root, self._limits, self._uid = sb, root, limits, uid
        self._lock = threading.Lock()
        self._closed = False

    @property
    def host_path(self) -> Path:
        """Where the work root lives on the host."""
        return self._root / "box"

    def _host(self, sandbox_path: str) -> Path:
        return self._root / sandbox_path.lstrip("/")

    def _is_dir(self, path: str) -> bool:
        return self._host(path).is_dir()

    def run(self, request: ExecRequest) -> ExecResult:
        with self._lock:
            if self._closed:
                raise RuntimeError("session is closed")
            try:
                return self._sb._execute(self._root, self._cwd, request, self._limits, self._uid)
            except OSError as exc:
                return ExecResult.failed(f"local sandbox failed: {exc}")

    def write_files(self, files: Mapping[str, bytes]) -> None:
        if self._closed:  # writing would recreate the removed directory, and nobody would remove it again
            raise RuntimeError("session is closed")
        self._sb._write(self._root, self._cwd, files, self._uid)

    def read_file(self, path: str, max_bytes: int = MAX_READ_FILE_BYTES) -> bytes:
        target = self._host(resolve_path("/box", self._cwd, path))
        real = target.resolve()
        if not real.is_relative_to(self._host("/box").resolve()):
            raise ValueError(f"{path!r} points outside the work directory")
        if not real.exists():
            raise FileNotFoundError(path)
        if real.stat().st_size > max_bytes:
            raise ValueError(f"{path} is {real.stat().st_size} bytes, over the {max_bytes}-byte limit")
        return real.read_bytes()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sb._give_uid(self._uid)
            _rmtree(self._root)
            self._sb._sessions.discard(self)
