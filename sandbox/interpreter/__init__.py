"""A persistent Python interpreter in one sandbox session, for multi-turn tool use (one per episode, its session
taken from a warm pool of reset sessions).

    from opd_harness import sandbox
    from opd_harness.sandbox.interpreter import PythonInterpreter
    with sandbox.open_sandbox("docker") as sb, PythonInterpreter(sb) as py:
        py.run_cell("import math\\nx = math.factorial(20)")
        py.run_cell("print(x % 1000)").output          # "0\\n"

Variables, imports and functions defined by one cell are visible to the next, like a Jupyter kernel.

Inside the session (network off; memory / CPU / process / disk limits from the constructor) two processes run:
  - the *supervisor* (stdlib only, never runs model code): receives a cell, hands it to the worker,
    reads the worker's output, enforces the timeout, restarts the worker when it dies, and after
    every cell ends every other process below it (it is their child subreaper, so orphans stay below it);
  - the *worker*: a Python process (forked from the supervisor, which has run no cell of another episode: no
    second interpreter start) whose ``__main__`` namespace lives across cells. Its stdout and
    stderr are one pipe (one line-buffered stream, restored before every cell), so the output keeps
    the order it was written in. Each cell runs in a process group of its own, led by the worker;
    when the cell ends the worker steps out of it and SIGKILLs it (a subprocess, a fork bomb), then
    the supervisor SIGKILLs whatever is left below it but the worker (what left the group: ``setsid``,
    ``setpgid``, a double fork), until nothing is.

How a cell reaches the supervisor (the *transport*), found out once per sandbox object, from the first
request of a session where no cell has run yet (so no cell can change it: once an ``exec`` supervisor
has answered in a sandbox, one found missing later is that interpreter's ``crash``, never a switch):
  - ``exec``: the supervisor runs detached (``setsid``) and listens on an abstract Unix socket (no
    file a cell could delete); each cell is handed over by ``Session.relay`` where the session can
    (a pooled Docker session: the container's exec server connects to the socket itself, no process
    is started; a few ms a cell), else by one ``Session.run`` of a tiny client that hands the cell over
    and prints the reply (an unpooled Docker session: one ``docker exec`` a cell). Used where a
    background process outlives the run that started it (Docker: the container lives on). Only
    peers of the same uid are served.
  - ``files``: where a run's processes all die when it ends (the local provider as root: each run has
    its own PID namespace), the supervisor is itself one long ``Session.run`` (a background thread)
    and cells travel as files in ``.opd-interp/`` of the work dir (``write_files`` / ``read_file``,
    the host polls for the reply; the supervisor sleeps on an inotify watch of the folder between cells). The supervisor
    exits when the host process goes away (its stdout pipe breaks).

Cell semantics:
  - output is what the cell prints (stdout and stderr interleaved), cut to ``max_output_chars`` with
    ``"\\n...[output truncated: N more characters]"``. With ``display_last_expr=True`` the repr of a
    final expression statement is printed too (Jupyter's convention; off by default, as in ReTool's
    script-style sandbox).
  - an exception (SyntaxError, KeyboardInterrupt, ``sys.exit(1)`` ...) → status ``ok``, ``raised=True``,
    the traceback (without the harness's frames) in ``output``; the state is kept. ``sys.exit()`` /
    ``sys.exit(0)`` just ends the cell (``raised=False``).
  - past ``timeout_s`` the cell is interrupted (SIGUSR1 raises, inside the cell, an exception that
    ``except Exception`` does not catch; Jupyter sends SIGINT) → status ``timeout``, state kept; a
    cell that does not stop within ~2 s (stuck in C code, or swallowing the interrupt) gets its
    worker killed and restarted: ``state_lost=True``.
  - the worker dies (``os._exit``, a signal, Docker's OOM kill at the memory limit; the local
    provider's address-space limit raises ``MemoryError`` instead) → status ``crash``,
    ``state_lost=True``, a fresh worker is ready for the next cell.
  - crashes and restarts (state lost) append a one-line note in brackets to ``output``; a timeout
    that kept the state adds nothing (the status says it; the caller words it for the model).
  - anything that breaks the sandbox itself (daemon down, session cannot be opened) → status ``error``
    with ``error`` set; ``run_cell`` never raises for it. The session is then discarded (state lost)
    and the next cell opens a fresh one.
  - processes a cell leaves running are killed when the cell ends (see above); threads it starts in the
    worker live on, and output they print between cells is discarded.
  - a cell that kills the supervisor (say from such a thread) → that interpreter's next cell is a
    ``crash`` with ``state_lost=True`` (not run); the one after gets a fresh session. Other interpreters
    of the sandbox are not affected.
  - disk: the work root holds at most ``disk_mb`` (Docker: a tmpfs volume of that size, so its files
    count against ``memory_mb`` too; the local provider does not enforce it); past it writes fail with
    ``OSError`` (ENOSPC) inside the cell, and the state is kept. On Docker ``/tmp`` and ``/dev/shm`` are
    separate tmpfs mounts of 64 MiB each; each file is capped at the provider's ``max_file_mb`` (64 MiB).
    (No request travels through the work root: a huge cell is handed over in parts of the client's argv.)
  - cells run in the session's work root (the files transport keeps ``.opd-interp/`` there); files
    persist across cells as they do in any session.

Sessions (``pooled``, default True): the session comes from the provider's pool of reset sessions and goes back on
``close()``. Docker resets the container first with its exec server's clean-up after a pooled run (every process of
the sandbox user killed, ``/box``, ``/tmp``, ``/dev/shm`` and ``/dev/mqueue`` emptied; a container it cannot clean is
removed), so the next episode sees no file, process or variable of this one; the local provider makes a fresh
directory either way. ``pooled=False``: a fresh container, removed on ``close()``. With ``ready_ahead`` (default, exec
transport only) ``close()`` returns at once and a background thread resets the session, then starts a supervisor (and
its fresh worker) in a reset pooled session for the next episode; a later pooled interpreter with the same limits takes
it (waiting for one being started, and checking it with a ping: one that died is closed and replaced by a start of its
own) instead of starting its own.
At most as many as the provider keeps idle sessions (``idle_session_cap``, 16 where it has none) are kept ready or starting
per sandbox; one nobody takes within an hour exits.

``close()`` destroys the session (or, pooled, resets it for the next episode; idempotent; also ``with``; a cell running meanwhile in another
thread ends as ``error``); a closed interpreter refuses cells (``RuntimeError``). An interpreter
dropped without ``close()`` is closed when it is garbage collected or at exit (``weakref.finalize``),
and the providers remove their sessions on ``Sandbox.close()``.
Each interpreter serialises its own cells with a lock; many interpreters run concurrently.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from opd_harness.sandbox import ExecRequest, Sandbox, Session

__all__ = ["CellResult", "PythonInterpreter", "CELL_STATUSES"]

CELL_STATUSES = ("ok", "timeout", "crash", "error")
CONTROL_DIR = ".opd-interp"  # files transport: requests and replies (in the session's work root)
_INTERRUPT_GRACE_S = 2.0  # after the timeout: how long the worker has to stop before it is killed
_SLACK_S = 15.0  # host-side wait beyond timeout_s + grace: worker restart, process start, transport
_START_TIMEOUT_S = 30.0
_PING_TIMEOUT_S = 10.0  # a ready supervisor taken from the pool answers a ping within this
_READY_IDLE_S = 3600.0  # a ready supervisor nobody takes within this exits (the one who takes it then starts its own)
_EXIT_WAIT_S = 2.0  # files transport: how long close waits for the supervisor to exit when asked
_SERVE_TIMEOUT_S = 7 * 24 * 3600.0  # files transport: the supervisor's run lasts the session
_ARGV_CHUNK = 100_000  # exec transport: a request travels in argv strings of this size (Linux caps one at 128 KiB)...
_ARGV_PAYLOAD_MAX = 1_000_000  # ...in one run up to this size (ARG_MAX is ~2 MB); larger ones are sent in parts first
_PART_CHARS = 400_000  # characters of a large request per part (escaped once more in the part's JSON)
_TRANSPORTS: weakref.WeakKeyDictionary[Sandbox, str] = weakref.WeakKeyDictionary()  # what worked per sandbox
_TRANSPORTS_LOCK = threading.Lock()

# ---------------------------------------------------------------- code that runs inside the sandbox
# Each is a stdlib-only script of this package, run as ``python -c <its source> ARGS...`` (see each file's docstring):
# the supervisor (worker.py's source is one of its arguments), the worker it starts, and the exec transport's client.
_HERE = Path(__file__).parent
_WORKER = (_HERE / "worker.py").read_text()
_SUPERVISOR = (_HERE / "supervisor.py").read_text()
_CLIENT = (_HERE / "client.py").read_text()


# ---------------------------------------------------------------- host side


@dataclass
class CellResult:
    """What one cell did. ``status``: ``ok`` (ran to the end or raised: ``raised``), ``timeout``, ``crash``, ``error``."""

    status: str
    output: str
    raised: bool = False
    truncated: bool = False
    state_lost: bool = False  # earlier variables are gone (the interpreter was restarted during this cell)
    duration_s: float = 0.0
    error: str | None = None  # status "error" only: what failed in the sandbox


class _Infra(Exception):
    """The sandbox failed (status ``error``)."""


class _Dead(Exception):
    """The supervisor or its session is gone (restart needed); ``status`` is what the cell gets."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Connection:
    """One session with a running supervisor, and the way to hand it requests."""

    def __init__(self, sandbox: Sandbox, session: Session, transport: str, idle_s: float = 60.0) -> None:
        self.sandbox, self.session, self.transport, self.idle_s = sandbox, session, transport, idle_s
        self.key = f"opd-interp-{uuid.uuid4().hex}"
        self.seq = 0
        self.answered = 0  # requests the supervisor answered: before the first, no cell has run in this session
        self.server_thread: threading.Thread | None = None
        self.server_result = None
        self.closed = False

    # -------------------------------------------------------- start

    def start(self) -> None:
        """Start the supervisor. Raises ``_Infra`` when it cannot start, ``_NoDaemon`` when detached processes die."""
        if self.transport == "exec":
            argv = [*_supervisor_argv(self.sandbox, self.session), "daemon", self.key, _WORKER, str(_INTERRUPT_GRACE_S), str(self.idle_s)]
            try:
                r = self.session.run(ExecRequest(argv=argv, timeout_s=_START_TIMEOUT_S, max_output_bytes=4096))
            except Exception as exc:  # noqa: BLE001
                raise _Infra(f"{type(exc).__name__}: {exc}") from exc
            if r.status != "ok" or r.exit_code != 0 or not r.stdout.startswith("READY"):
                raise _Infra(f"the interpreter did not start ({r.status}, exit {r.exit_code}): {(r.error or r.stderr or r.stdout)[-500:]}")
            return
        argv = [self.sandbox.python, "-I", "-S", "-c", _SUPERVISOR, "serve", CONTROL_DIR, _WORKER, str(_INTERRUPT_GRACE_S)]
        request = ExecRequest(argv=argv, timeout_s=_SERVE_TIMEOUT_S, max_output_bytes=4096)

        def serve() -> None:
            try:
                self.server_result = self.session.run(request)
            except Exception as exc:  # noqa: BLE001 - reported through server_result
                self.server_result = exc

        self.server_thread = threading.Thread(target=serve, name="opd-interp-serve", daemon=True)
        self.server_thread.start()
        if self._poll_file(f"{CONTROL_DIR}/ready", time.monotonic() + _START_TIMEOUT_S) is None:
            raise _Infra(f"the interpreter did not start: {self._server_story()}")

    def _server_story(self) -> str:
        r = self.server_result
        if r is None:
            return "no ready file after the start timeout"
        if isinstance(r, Exception):
            return f"{type(r).__name__}: {r}"
        return f"its run ended ({r.status}, exit {r.exit_code}): {(r.error or r.stderr)[-500:]}"

    def _poll_file(self, path: str, deadline: float, accept: Callable[[bytes], bool] = lambda raw: True) -> bytes | None:
        """Wait for a file the supervisor writes (and ``accept``s); None when its run ended or the deadline passed."""
        pause = 0.0005
        while True:
            ended = self.server_thread is not None and not self.server_thread.is_alive()
            try:
                raw = self.session.read_file(path)
                if accept(raw):
                    return raw
            except (OSError, ValueError):  # not there yet (or something a cell put in its place)
                pass
            except Exception as exc:  # noqa: BLE001 - SandboxUnavailable, a closed session
                raise _Infra(f"could not read the interpreter's reply: {type(exc).__name__}: {exc}") from exc
            if ended or time.monotonic() >= deadline:
                return None
            time.sleep(pause)
            pause = min(pause * 1.3, 0.01)

    # -------------------------------------------------------- requests

    def request(self, req: dict, wait_s: float) -> dict:
        """Send one request; the supervisor's reply. Raises ``_Dead`` / ``_Infra`` / ``_NoDaemon``."""
        payload = json.dumps(req)
        if self.transport == "exec":
            reply_max = max(8 * int(req.get("cap", 0)) + (1 << 16), 1 << 20)  # JSON escapes: up to 6 bytes a character
            if len(payload) <= _ARGV_PAYLOAD_MAX:
                return self._exec_request(payload, wait_s, reply_max)
            for i in range(0, len(payload), _PART_CHARS):  # (never through a file: the cell may have filled the disk)
                self._exec_request(json.dumps({"op": "part", "data": payload[i : i + _PART_CHARS]}), _START_TIMEOUT_S, 4096)
            return self._exec_request(json.dumps({"op": "parts"}), wait_s, reply_max)
        self.seq += 1
        files = {f"{CONTROL_DIR}/req.json": payload.encode(), f"{CONTROL_DIR}/go": str(self.seq).encode()}
        for attempt in range(3):
            try:
                self.session.write_files(files)
                break
            except FileNotFoundError:  # a file the cell's background work deleted while the provider walked the dir
                if attempt == 2:
                    raise _Infra("could not hand the cell over: the work dir kept changing") from None
            except Exception as exc:  # noqa: BLE001 - OSError, SandboxUnavailable, a closed session
                raise _Infra(f"could not hand the cell over: {type(exc).__name__}: {exc}") from exc
        raw = self._poll_file(f"{CONTROL_DIR}/out.json", time.monotonic() + wait_s, accept=self._answers(self.seq))
        if raw is None:
            if self.server_thread is not None and not self.server_thread.is_alive():
                self._check_session()
                raise _Dead("crash", f"the interpreter's supervisor ended: {self._server_story()}")
            raise _Dead("timeout", "the interpreter did not answer in time")
        return json.loads(raw)

    def _exec_request(self, payload: str, wait_s: float, reply_max: int) -> dict:
        """One request on the exec transport: a run of the client with ``payload`` (ASCII JSON) in its argv."""
        chunks = [payload[i : i + _ARGV_CHUNK] for i in range(0, len(payload), _ARGV_CHUNK)]
        argv = [self.sandbox.python, "-I", "-S", "-c", _CLIENT, self.key, *chunks]
        data = payload.encode()
        try:  # handed over by the provider where it can (no process per cell), else by a run of the client
            r = self.session.relay(self.key, len(data).to_bytes(4, "big") + data, wait_s, reply_max)
            no_server = ""  # what a relay nobody answered prints (the client prints NOSERVER)
            if r is None:
                r, no_server = self.session.run(ExecRequest(argv=argv, timeout_s=wait_s, max_output_bytes=reply_max)), "NOSERVER"
        except Exception as exc:  # noqa: BLE001 - a closed session or sandbox, a refused timeout
            raise _Infra(f"{type(exc).__name__}: {exc}") from exc
        if r.status == "ok" and r.exit_code == 3 and r.stdout == no_server:
            if self.answered == 0 and not _exec_confirmed(self.sandbox):
                raise _NoDaemon()  # no cell ever ran here: the provider ended the detached supervisor
            # A cell of this session killed it (e.g. from a thread, between cells): this episode's crash, nobody else's.
            raise _Dead("crash", "the interpreter's supervisor was gone (killed by an earlier cell?)")
        if r.exit_code == 0:  # (Docker reads the worker's OOM kill during the cell as status "oom" of this run)
            try:
                reply = json.loads(r.stdout)
            except ValueError:
                pass
            else:
                self.answered += 1
                _confirm_exec(self.sandbox)
                return reply
        if r.status == "error":
            raise _Infra(r.error or "the sandbox failed")
        if r.status == "timeout":
            raise _Dead("timeout", "the interpreter did not answer in time")
        raise _Dead("crash", f"the interpreter's connection broke ({r.status}, exit {r.exit_code}: {(r.error or r.stderr)[-300:]})")

    def _check_session(self) -> None:
        """Raise ``_Infra`` when the session itself is gone (closed, its sandbox closed, the provider failing)."""
        try:
            r = self.session.run(ExecRequest(argv=["true"], timeout_s=10))
        except Exception as exc:  # noqa: BLE001
            raise _Infra(f"the sandbox session is gone: {type(exc).__name__}: {exc}") from exc
        if r.status == "error":
            raise _Infra(f"the sandbox session is failing: {r.error}")

    @staticmethod
    def _answers(seq: int) -> Callable[[bytes], bool]:
        """Whether a reply file is the (complete) answer to request ``seq`` (not the previous one's)."""

        def accept(raw: bytes) -> bool:
            try:
                return json.loads(raw).get("seq") == seq
            except (ValueError, AttributeError):
                return False

        return accept

    def close(self) -> None:
        """Destroy the session (which ends the supervisor, the worker and everything they started). On the files
        transport the supervisor is asked to exit first: a session whose runs all ended on their own is given back
        without the provider's look for leftover processes (on the local provider a scan of /proc, costly beside
        hundreds of sessions); one that does not exit in time is ended by the session's close as before."""
        if self.closed:
            return
        self.closed = True
        if self.server_thread is not None and self.server_thread.is_alive() and self.server_thread is not threading.current_thread():
            try:
                self.seq += 1
                self.session.write_files({f"{CONTROL_DIR}/req.json": b'{"op": "exit"}', f"{CONTROL_DIR}/go": str(self.seq).encode()})
                self.server_thread.join(timeout=_EXIT_WAIT_S)
            except Exception:  # noqa: BLE001 - best effort: the session's close below ends it anyway
                pass
        try:
            self.session.close()
        except Exception:  # noqa: BLE001 - best effort: the provider reaps what is left
            pass
        if self.server_thread is not None and self.server_thread is not threading.current_thread():  # a finalizer runs anywhere
            self.server_thread.join(timeout=5.0)


_COMPILE = ("import binascii,marshal,sys;"
            "sys.stdout.write(binascii.b2a_base64(marshal.dumps(compile(sys.argv[1],'<string>','exec'))).decode())")
_LOAD = "import binascii,marshal,sys;exec(marshal.loads(binascii.a2b_base64(sys.argv.pop(1))))"
_COMPILED: weakref.WeakKeyDictionary[Sandbox, str] = weakref.WeakKeyDictionary()  # per sandbox: the supervisor's code, or ""


def _supervisor_argv(sandbox: Sandbox, session: Session) -> list[str]:
    """How a session starts the supervisor (its arguments follow): its code compiled once per sandbox by the sandbox's own
    Python (marshal is per Python version) and loaded, so a start parses no source; its source where that failed."""
    with _TRANSPORTS_LOCK:
        code = _COMPILED.get(sandbox)
    if code is None:
        try:
            request = ExecRequest(argv=[sandbox.python, "-I", "-S", "-c", _COMPILE, _SUPERVISOR], timeout_s=_START_TIMEOUT_S,
                                  max_output_bytes=_ARGV_CHUNK)  # fmt: skip
            r = session.run(request)
            code = r.stdout.strip() if r.status == "ok" and r.exit_code == 0 and not r.stdout_truncated else ""
        except Exception:  # noqa: BLE001 - the start itself reports what is wrong with the session
            code = ""
        with _TRANSPORTS_LOCK:
            code = _COMPILED.setdefault(sandbox, code)
    return [sandbox.python, "-I", "-S", "-c", _LOAD, code] if code else [sandbox.python, "-I", "-S", "-c", _SUPERVISOR]


class _NoDaemon(Exception):
    """A process detached in one run did not survive it: this provider needs the files transport."""


def _exec_confirmed(sandbox: Sandbox) -> bool:
    """Whether a supervisor on the exec transport has answered in this sandbox (so its detached processes live on)."""
    with _TRANSPORTS_LOCK:
        return _TRANSPORTS.get(sandbox) == "exec"


def _confirm_exec(sandbox: Sandbox) -> None:
    """Record that the exec transport works here: from now on a missing supervisor is a crash, never a switch to files."""
    with _TRANSPORTS_LOCK:
        _TRANSPORTS.setdefault(sandbox, "exec")


class _Holder:
    """The current connection, reachable from the finalizer without keeping the interpreter alive."""

    def __init__(self) -> None:
        self.conn: _Connection | None = None

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


class _ReadyPool:
    """Started supervisors in freshly reset pooled sessions, per limits, waiting for the next episode of one sandbox."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.ready: dict[tuple, list[_Connection]] = {}
        self.pending: dict[tuple, int] = {}  # starts in flight

    def count(self, key: tuple) -> int:
        """Ready supervisors with these limits now."""
        with self.cond:
            return len(self.ready.get(key, ()))

    def reserve(self, key: tuple, cap: int) -> bool:
        """Claim a place for one more start (False when ready + starting already fill ``cap``)."""
        with self.cond:
            if sum(map(len, self.ready.values())) + sum(self.pending.values()) >= cap:
                return False
            self.pending[key] = self.pending.get(key, 0) + 1
            return True

    def settle(self, key: tuple, conn: _Connection | None) -> None:
        """A reserved start ended: its connection (None when it failed) becomes ready."""
        with self.cond:
            self.pending[key] -= 1
            if conn is not None:
                self.ready.setdefault(key, []).append(conn)
            self.cond.notify_all()

    def take(self, key: tuple, wait_s: float) -> _Connection | None:
        """A ready connection, waiting up to ``wait_s`` for one being started; None when there is none."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while not self.ready.get(key) and self.pending.get(key, 0) > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            conns = self.ready.get(key)
            return conns.pop() if conns else None


_READY: weakref.WeakKeyDictionary[Sandbox, _ReadyPool] = weakref.WeakKeyDictionary()


def _ready_pool(sandbox: Sandbox) -> _ReadyPool:
    """The sandbox's pool of ready supervisors."""
    with _TRANSPORTS_LOCK:
        pool = _READY.get(sandbox)
        if pool is None:
            pool = _READY[sandbox] = _ReadyPool()
        return pool


def _ready_cap(sandbox: Sandbox) -> int:
    """Most supervisors kept ready or starting: as many as the provider keeps idle sessions (16 where it cannot say)."""
    cap = getattr(sandbox, "idle_session_cap", None)
    return int(cap()) if callable(cap) else 16


def _start_ready(sandbox: Sandbox, key: tuple, pool: _ReadyPool, closing: _Connection | None = None) -> None:
    """Reset ``closing`` (a closed interpreter's pooled session: the provider's clean-up, then idle), open a pooled (reset)
    session with limits ``key``, start a supervisor in it and put it in ``pool``; a failure only leaves the pool without
    it (whoever needs one starts their own)."""
    if closing is not None:
        closing.close()
    conn = None
    try:
        memory_mb, cpus, pids, disk_mb = key
        session = sandbox.session(memory_mb=memory_mb, cpus=cpus, pids=pids, network=False, disk_mb=disk_mb, pooled=True)
        conn = _Connection(sandbox, session, "exec", idle_s=_READY_IDLE_S)
        conn.start()
    except Exception:  # noqa: BLE001 - a closed sandbox, a container that could not start
        if conn is not None:
            conn.close()
        conn = None
    pool.settle(key, conn)


class PythonInterpreter:
    """A persistent Python interpreter in one sandbox session (one per episode); see the module docstring.

    Args:
        sandbox: an open provider (``sandbox.open_sandbox(...)``); the session opens on the first cell.
        memory_mb, cpus, pids: the session's limits (the supervisor and the worker share them).
        disk_mb: the most the episode's work dir may hold (Docker: a tmpfs of that size, counted against
            ``memory_mb``; past it writes fail with ENOSPC); not enforced by the local provider.
        max_output_chars: most characters of output kept per cell.
        display_last_expr: print the repr of a final expression statement, as Jupyter does.
        pooled: take the session from the provider's pool of reset sessions and give it back on ``close`` (Docker: a
            warm container whose cells go through its exec server, not a ``docker exec`` each); False: a fresh one.
        ready_ahead: (pooled, exec transport) on ``close`` start the next episode's supervisor in the just reset session
            in the background, so that the next pooled interpreter with these limits starts with a ready one.
    """

    def __init__(
        self,
        sandbox: Sandbox,
        *,
        memory_mb: int = 512,
        cpus: float = 1.0,
        pids: int = 64,
        disk_mb: int = 256,
        max_output_chars: int = 4096,
        display_last_expr: bool = False,
        pooled: bool = True,
        ready_ahead: bool = True,
    ) -> None:
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars must be >= 1, got {max_output_chars}")
        if isinstance(disk_mb, bool) or not isinstance(disk_mb, int) or disk_mb < 1:
            raise ValueError(f"disk_mb must be a positive int (MiB), got {disk_mb!r}")
        ExecRequest(argv=["true"], memory_mb=memory_mb, cpus=cpus, pids=pids)  # validates the limits
        self.sandbox = sandbox
        self.memory_mb, self.cpus, self.pids, self.disk_mb = memory_mb, cpus, pids, disk_mb
        self.max_output_chars, self.display_last_expr, self.pooled = max_output_chars, display_last_expr, pooled
        self.ready_ahead = ready_ahead
        self._lock = threading.Lock()
        self._holder = _Holder()
        self._finalizer = weakref.finalize(self, self._holder.close)
        self._closed = False

    @property
    def transport(self) -> str | None:
        """``exec`` or ``files`` once the session is open (see the module docstring), else None."""
        conn = self._holder.conn
        return conn.transport if conn is not None else None

    @property
    def session(self) -> Session | None:
        """The open session (None before the first cell and after a restart or ``close``)."""
        conn = self._holder.conn
        return conn.session if conn is not None else None

    def prewarm(self, n: int) -> int:
        """Have the provider start ``n`` sessions with this interpreter's limits for later pooled interpreters (none when
        ``pooled=False``); returns how many it started. This interpreter's own session still opens on its first cell."""
        if not self.pooled:
            return 0
        return self.sandbox.prewarm_sessions(n, memory_mb=self.memory_mb, cpus=self.cpus, pids=self.pids, network=False,
                                             disk_mb=self.disk_mb)

    def run_cell(self, code: str, timeout_s: float = 10.0) -> CellResult:
        """Run one cell; never raises for what the code does or for a sandbox failure (status ``error``).

        Raises:
            RuntimeError: the interpreter is closed.
            TypeError / ValueError: ``code`` is not a str, ``timeout_s`` is not > 0.
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        with self._lock:
            if self._closed:
                raise RuntimeError("this PythonInterpreter is closed; make a new one")
            t0 = time.perf_counter()
            result = self._run(code, timeout_s)
            if self._closed:  # close() from another thread destroyed the session under the cell
                self._holder.close()  # (or ran before this cell's new session was recorded)
                result = CellResult(status="error", output="", state_lost=True, error="the interpreter was closed while the cell ran")
            if result.status == "error" or not result.duration_s:
                result.duration_s = time.perf_counter() - t0
            return result

    def _run(self, code: str, timeout_s: float) -> CellResult:
        had_session = self._holder.conn is not None
        req = {"op": "cell", "code": code, "timeout": timeout_s, "cap": self.max_output_chars, "display": self.display_last_expr}
        wait_s = timeout_s + _INTERRUPT_GRACE_S + _SLACK_S
        try:
            try:
                reply = self._connect().request(req, wait_s)
            except _NoDaemon:  # detached processes die with their run here: use the files transport
                self._drop()
                with _TRANSPORTS_LOCK:
                    _TRANSPORTS.setdefault(self.sandbox, "files")  # (unless another interpreter's supervisor answered meanwhile)
                reply = self._connect().request(req, wait_s)
        except _Infra as exc:
            self._drop()
            return CellResult(status="error", output="", state_lost=had_session, error=str(exc))
        except _Dead as exc:
            self._drop()
            note = f"{exc}; the interpreter was restarted and variables from earlier cells are lost"
            return CellResult(status=exc.status, output=f"[{note}]", state_lost=True)
        if reply.get("status") not in ("ok", "timeout", "crash"):
            self._drop()
            return CellResult(status="error", output="", state_lost=had_session, error=str(reply.get("error") or reply))
        return self._result(reply)

    def _result(self, reply: dict) -> CellResult:
        """A supervisor's reply as a ``CellResult``: output cut to ``max_output_chars``, notes appended."""
        text, total = reply.get("output", "")[: self.max_output_chars], int(reply.get("total_chars", 0))
        truncated = total > len(text)
        if truncated:
            text += f"\n...[output truncated: {total - len(text)} more characters]"
        status, state_lost = reply["status"], bool(reply.get("state_lost"))
        for note in reply.get("notes") or []:  # (a timeout that kept the state has none: the status says it)
            text += ("\n" if text and not text.endswith("\n") else "") + f"[{note}]"
        return CellResult(
            status=status,
            output=text,
            raised=bool(reply.get("raised")),
            truncated=truncated,
            state_lost=state_lost,
            duration_s=float(reply.get("duration_s", 0.0)),
        )

    def _connect(self) -> _Connection:
        """The open connection, or a new session with a started supervisor. Raises ``_Infra``."""
        if self._holder.conn is not None:
            return self._holder.conn
        ready = self._take_ready()
        if ready is not None:
            return ready
        with _TRANSPORTS_LOCK:
            transport = _TRANSPORTS.get(self.sandbox, "exec")
        try:
            session = self.sandbox.session(memory_mb=self.memory_mb, cpus=self.cpus, pids=self.pids, network=False, disk_mb=self.disk_mb,
                                           pooled=self.pooled)
        except Exception as exc:  # noqa: BLE001 - SandboxUnavailable, a closed sandbox, a daemon error...
            raise _Infra(f"could not open a sandbox session: {type(exc).__name__}: {exc}") from exc
        if self._closed:  # close() ran meanwhile: this session must not outlive it
            session.close()
            raise _Infra("the interpreter was closed")
        conn = _Connection(self.sandbox, session, transport)
        self._holder.conn = conn
        try:
            conn.start()
        except Exception as exc:
            self._drop()
            if isinstance(exc, _Infra):
                raise
            raise _Infra(f"the interpreter did not start: {type(exc).__name__}: {exc}") from exc
        return conn

    @property
    def _limits(self) -> tuple:
        return (self.memory_mb, self.cpus, self.pids, self.disk_mb)

    def _take_ready(self) -> _Connection | None:
        """A supervisor started ahead in a reset pooled session (see ``ready_ahead``) that answers a ping, if any."""
        if not self.pooled or not _exec_confirmed(self.sandbox) or getattr(self.sandbox, "closed", False):
            return None
        conn = _ready_pool(self.sandbox).take(self._limits, _START_TIMEOUT_S)
        if conn is None:
            return None
        try:
            if conn.request({"op": "ping"}, _PING_TIMEOUT_S).get("status") != "pong":
                raise _Dead("crash", "no pong")
        except (_Dead, _Infra, _NoDaemon):  # it died meanwhile (or the sandbox is closing): start one as before
            conn.close()
            return None
        if self._closed:
            conn.close()
            raise _Infra("the interpreter was closed")
        self._holder.conn = conn
        return conn

    def _drop(self) -> None:
        """Destroy the current session (its state is lost); the next cell opens a new one."""
        self._holder.close()

    def close(self) -> None:
        """Destroy the session and refuse further cells (a cell running in another thread ends as ``error``). Idempotent.

        With ``ready_ahead`` (pooled, exec transport, no cell in flight) the session's reset and the next episode's
        supervisor start run in one background thread, so ``close`` returns at once; a pooled interpreter opened
        meanwhile with these limits waits for that start (the reset session is never handed out before its reset)."""
        self._closed = True  # not under the lock: a cell in flight ends (as an error) instead of delaying this
        conn = self._holder.conn
        ahead = self.ready_ahead and self.pooled and conn is not None and conn.transport == "exec" and not self._lock.locked()
        pool = _ready_pool(self.sandbox) if ahead and not getattr(self.sandbox, "closed", False) else None
        if pool is not None and pool.reserve(self._limits, _ready_cap(self.sandbox)):
            self._holder.conn = None  # reset in the background, before the start it is reserved for
            args = (self.sandbox, self._limits, pool, conn)
            threading.Thread(target=_start_ready, args=args, name="opd-interp-ready", daemon=True).start()
        self._finalizer()

    def __enter__(self) -> PythonInterpreter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
