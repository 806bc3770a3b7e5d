"""How a program runs in a container, with its two transports: a pooled run (and a pooled session's) is one request to the
container's resident exec server (``exec_server.py``, attached once); another session's run is one ``docker exec`` of a
shell wrapper. Both run under an outer wall-clock guard and classify the outcome (timeout, oom, killed or ok)."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

import docker
import docker.errors

from opd_harness.sandbox import ExecRequest, ExecResult, OutputBuffer, resolve_path, signal_status
from opd_harness.sandbox.docker.box import GID, UID, WORKDIR, Infra, Limits, oom_counter_path, posixpath_rel, read_oom_kills, tar_files
from opd_harness.sandbox.docker.frames import ServerStream, exec_frames, server_request

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
  { while [ "$n" -gt 0 ]; do printf %s "$1"; shift; n=$((n-1)); done; } | /usr/bin/base64 -d |
    /usr/bin/tar -x -f - -C /box 2>&4 || { printf '\n%s setup\n' "$m"; exit 0; }
  shift "$n"
fi
cd -- "$d" && exec 3<"$in" || { echo "sandbox: cannot enter $d or open stdin" >&4; printf '\n%s setup\n' "$m"; exit 0; }
[ "$in" = /dev/null ] || /usr/bin/rm -f -- "$in"
s0=$(/usr/bin/date +%s%N)
# the program (a `2>&4` on the next line would make sh print "Killed" into it)
/bin/sh -c 'exec 2>&4 4>&- 3<&-; exec /usr/bin/timeout -s KILL "$0" "$@"' "$t" "$@" <&3
rc=$?
s1=$(/usr/bin/date +%s%N)
printf '\n%s %s %s\n' "$m" "$rc" "$((s1-s0))"
"""
_KILL_ALL = "kill -9 -1 2>/dev/null; kill -9 -1 2>/dev/null; exit 0"
_CHUNK = 120_000  # base64 characters per argv string (Linux caps one at 128 KiB)
_ARGV_PAYLOAD_MAX = 768 << 10  # larger inputs go through put_archive


class Box:
    """One container and what the provider knows about it."""

    def __init__(self, container, limits: Limits) -> None:
        self.container = container
        self.limits = limits
        self.oom_path = oom_counter_path(container.id)
        self.server: ServerStream | None = None  # a pooled container's resident exec server, once started


class Host(Protocol):
    """What a run needs of its provider (a ``DockerSandbox``)."""

    grace_s: float

    @property
    def closed(self) -> bool: ...

    def client(self): ...

    def exec_plain(self, box: Box, argv: list[str]) -> int | None: ...


def execute(sb: Host, box: Box, request: ExecRequest, cwd: str, served: bool, keep: bool = False) -> tuple[ExecResult, bool]:
    """Stage inputs, run the program (and, if ``served`` without ``keep``, clean up); classify.

    A ``served`` run is one request to the container's resident exec server (a pooled run; a pooled session's run with
    ``keep``: its files and background processes stay); an unpooled session's run is one exec of the wrapper.

    Returns:
        (result, whether the container may be used again).
    Raises:
        Infra: a Docker call or the in-container setup failed.
    """
    workdir = resolve_path(WORKDIR, cwd, request.cwd) if request.cwd else cwd
    staged = {posixpath_rel(resolve_path(WORKDIR, workdir, p)): d for p, d in request.files.items()}
    stdin_path = "/dev/null"
    if request.stdin:
        name = f".opd-stdin-{uuid.uuid4().hex}"
        staged[name] = bytes(request.stdin)
        stdin_path = f"{WORKDIR}/{name}"
    if served:
        header = {"argv": request.argv, "cwd": workdir, "stdin": stdin_path, "timeout": request.timeout_s, "env": request.env, "keep": keep}
        return _execute_served(sb, box, request, header, tar_files(staged) if staged else b"")
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


def _under_guard(sb: Host, box: Box, request: ExecRequest, kill, read) -> _Watched:
    """Run ``read()`` (consuming the program's output) under the outer wall-clock guard, which calls ``kill()`` at
    ``timeout_s + grace_s``; the OOM-kill counter is read around it.

    Raises:
        _GuardKilled: the guard's kill broke the stream.
        Infra: a Docker call failed.
    """
    fired = threading.Event()

    def guard() -> None:
        fired.set()
        try:
            kill()
        except Exception:  # noqa: BLE001
            pass

    oom_before = read_oom_kills(box.oom_path)
    timer = threading.Timer(request.timeout_s + sb.grace_s, guard)
    timer.daemon = True
    t0 = time.perf_counter()
    timer.start()
    try:
        read()
    except (docker.errors.DockerException, OSError) as exc:
        if fired.is_set():
            raise _GuardKilled(time.perf_counter() - t0) from exc
        raise Infra(f"{type(exc).__name__}: {exc}") from exc
    finally:
        timer.cancel()
    return _Watched(time.perf_counter() - t0, oom_before, read_oom_kills(box.oom_path), fired.is_set())


def _docker_call(call):
    """``call()``, with a Docker or socket failure raised as ``Infra`` (worth a retry)."""
    try:
        return call()
    except (docker.errors.DockerException, OSError) as exc:
        raise Infra(f"{type(exc).__name__}: {exc}") from exc


def relay(sb: Host, box: Box, name: str, data: bytes, timeout_s: float, max_bytes: int) -> ExecResult:
    """Hand ``data`` to the abstract Unix socket ``name`` in the container through its exec server, no process started;
    the answer is ``stdout`` (exit code 0; 3 when nobody listens; a time-out is status ``timeout``).

    Raises:
        Infra: a Docker call failed.
    """
    request = ExecRequest(argv=["relay"], timeout_s=timeout_s, max_output_bytes=max_bytes)  # (the host side's bookkeeping)
    header = {"relay": name, "timeout": timeout_s, "max_bytes": max_bytes}
    return _execute_served(sb, box, request, header, data)[0]


def _execute_served(sb: Host, box: Box, request: ExecRequest, header: dict, payload: bytes) -> tuple[ExecResult, bool]:
    """One request to the container's exec server (attached on the container's first run); with ``keep`` in the header
    the server does not clean up after it (the container is reusable only after a request without)."""
    cap = request.max_output_bytes
    out, err = OutputBuffer(cap), OutputBuffer(cap)
    ends: list[tuple[bytes, bytes]] = []
    if box.server is None:
        box.server = _docker_call(lambda: ServerStream(sb.client().api, box.container.id))
    server = box.server

    def read() -> None:
        server.send(server_request(header, payload))
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
                raise Infra(f"exec server: unexpected frame {kind!r}")

    try:
        seen = _under_guard(sb, box, request, box.container.kill, read)
    except _GuardKilled as exc:
        return ExecResult(status="timeout", duration_s=exc.seconds, error="killed by the outer guard"), False
    end = ends[0] if ends else None
    if end is not None and end[0] == b"S":
        raise Infra(f"staging inputs failed in the container: {end[1].decode(errors='replace')[-500:]}")
    result = ExecResult(status="ok", stdout=out.text(), stderr=err.text(), stdout_truncated=out.truncated,
                        stderr_truncated=err.truncated, duration_s=seen.wall)
    if seen.guard_fired:
        result.status, result.error = "timeout", f"killed by the outer guard at {request.timeout_s + sb.grace_s:.1f}s"
        return result, False
    if end is None and sb.closed:  # close() removed the container under the run
        raise Infra("the sandbox was closed during the run")
    if end is None:  # the server died (it ignores programs' signals: the OOM killer, or a crash)
        why = server.stderr.text()[-300:]
        result.status, result.error = "killed", f"the sandbox's exec server died during the run{': ' + why if why else ''}"
        return result, False
    exit_code, nanos, clean = json.loads(end[1])
    _classify(result, request, int(exit_code), int(nanos), seen.oom_before, seen.oom_after)
    return result, clean == 0


def _execute_wrapped(sb: Host, box: Box, request: ExecRequest, workdir: str, staged: dict[str, bytes],
                     stdin_path: str) -> ExecResult:
    """One exec of the wrapper (a session's run: no clean-up, the container is kept)."""
    api = sb.client().api
    payload = base64.b64encode(tar_files(staged)).decode() if staged else ""
    chunks = [payload[i : i + _CHUNK] for i in range(0, len(payload), _CHUNK)]
    mark = f"OPD-SANDBOX-{uuid.uuid4().hex}"
    cap = request.max_output_bytes
    out, err, tail = OutputBuffer(cap), OutputBuffer(cap), bytearray()
    if len(payload) > _ARGV_PAYLOAD_MAX:
        if not _docker_call(lambda: box.container.put_archive(WORKDIR, tar_files(staged))):
            raise Infra("put_archive returned False")
        chunks = []
    argv = ["/bin/sh", "-c", _WRAP, "sh", mark, workdir, stdin_path, f"{request.timeout_s:.3f}", str(len(chunks))]
    exec_id = _docker_call(lambda: api.exec_create(box.container.id, [*argv, *chunks, *request.argv], user=f"{UID}:{GID}",
                                                   environment=request.env or None)["Id"])  # fmt: skip

    def read() -> None:
        nonlocal tail
        for stream, data in exec_frames(api, exec_id):
            if stream == 1:
                out.add(data)
                tail += data
                del tail[:-512]
            else:
                err.add(data)

    try:
        seen = _under_guard(sb, box, request, lambda: sb.exec_plain(box, ["sh", "-c", _KILL_ALL]), read)
    except _GuardKilled as exc:
        return ExecResult(status="timeout", duration_s=exc.seconds, error="killed by the outer guard")
    key = b"\n" + mark.encode() + b" "
    at = tail.rfind(key)
    fields = tail[at + len(key) : -1].decode().split() if at >= 0 and tail.endswith(b"\n") else []
    if fields[:1] == ["setup"]:
        raise Infra(f"staging inputs failed in the container: {err.text()[-500:]}")
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
    if len(fields) != 2 and sb.closed:  # close() removed the container under the run
        raise Infra("the sandbox was closed during the run")
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
