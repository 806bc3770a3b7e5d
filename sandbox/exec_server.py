"""Exec server: PID 1 of every sandbox container (``python3 -I -S -c <this file>``); imports nothing of the project.

One ``docker exec`` costs ~100 ms of daemon and runc work on this machine, more than many graded programs take. So a
pooled container's runs are requests on this process's stdin / stdout (the container's attach stream, opened once)
instead of one exec each. So are a pooled session's runs (``keep`` set: step 3 is skipped, so files and background
processes stay for the session's next run, and the session's last request, its reset, cleans up). In another
session's container it only reaps orphans (nobody attaches; runs there are execs).
Per run it does what the one-exec shell wrapper of ``sandbox/docker/transport.py`` does for a session:
  1. unpack the request's tar into the work root; open stdin from its staged file and unlink that file;
  2. fork the program in its own process group (stdin, stdout and stderr its only open descriptors; out of memory, the
     kernel kills it first) and stream its stdout / stderr back as they arrive; kill the group at the time limit;
  3. kill every other process of the sandbox user (``kill(-1)`` spares PID 1 and this server) until none is left,
     empty /box, /tmp, /dev/shm and /dev/mqueue, and remove every System V IPC object;
  4. report the exit status (128 + N for death by signal N, 127 / 126 when the program cannot be started), the
     program's wall time and whether the clean-up succeeded.
This server is trusted; the programs it runs are not. It makes itself non-dumpable before serving, so a program (same
uid) can read neither its memory nor its descriptors (``/proc/<pid>/fd``): it cannot write into the reply stream. As
PID 1 of the container's PID namespace it receives from programs only the signals it handles (SIGCHLD: it reaps), so
they can neither kill nor stop it; if it dies anyway (the OOM killer) the host sees the stream end (status ``killed``).

Wire format. Requests (stdin): ``u32 header length, header JSON, u64 tar length, tar``; the header holds ``argv``,
``cwd``, ``stdin`` (a path, or /dev/null), ``timeout`` (seconds), ``env`` and optionally ``keep`` (skip the clean-up).
Replies (stdout), frames of ``kind byte, u32 length, data``: per run any number of ``O`` (stdout) and ``E`` (stderr)
chunks and one ``X`` with JSON ``[exit code, nanoseconds, clean status]`` (-1 under ``keep``: not cleaned), or one
``S`` (setup failed, with the reason).
A relay request's header holds ``relay`` (an abstract Unix socket name), ``timeout`` and ``max_bytes`` instead, and
its payload is sent to that socket as it is: what comes back until the listener closes travels as ``O`` frames, then
``X`` (exit code 0; 3 nobody listens; 1 the connection broke; 137 out of time). Pooled sessions' interpreters take
their cells this way: no process is started per cell.
"""

import ctypes
import io
import json
import os
import select
import signal
import socket
import stat
import struct
import sys
import tarfile
import time

ROOT = "/box"
WIPED = ("/box", "/tmp", "/dev/shm", "/dev/mqueue")
CHUNK = 1 << 16
CLEAN_ROUNDS = 50
EXITS = {}  # pid -> wait status of children reaped by the SIGCHLD handler (as PID 1, orphans are ours too)


def on_child(*_):
    """Reap every child that has exited (the program, and orphans reparented to PID 1)."""
    try:
        while True:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            EXITS[pid] = status
    except ChildProcessError:
        pass


def read_exact(n):
    """``n`` bytes of stdin, or exit when the host closed the stream."""
    parts, left = [], n
    while left:
        data = os.read(0, min(left, 1 << 20))
        if not data:
            os._exit(0)
        parts.append(data)
        left -= len(data)
    return b"".join(parts)


def send(kind, data=b""):
    """Write one reply frame to stdout."""
    view = memoryview(kind + struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(1, view) :]


def receive():
    """The next request: (header dict, tar bytes); blocks (a session container's server waits here for ever)."""
    (size,) = struct.unpack(">I", read_exact(4))
    header = json.loads(read_exact(size))
    (size,) = struct.unpack(">Q", read_exact(8))
    return header, read_exact(size) if size else b""


def stage(tar_bytes, header):
    """Unpack the inputs and open stdin (its staged file unlinked); the stdin descriptor."""
    if tar_bytes:
        with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tf:
            tf.extractall(ROOT)  # the host wrote this tar (relative paths under the work root only)
    fd = os.open(header["stdin"], os.O_RDONLY)
    if header["stdin"] != "/dev/null":
        os.unlink(header["stdin"])
    return fd


def spawn(header, stdin_fd):
    """Fork the program in its own process group; (pid, stdout read end, stderr read end)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only the program's three descriptors stay open
        try:
            os.setpgid(0, 0)
            os.dup2(stdin_fd, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.closerange(3, 1 << 16)
            try:
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write("1000")
            except OSError:
                pass
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores both; a program gets the default action
                signal.signal(sig, signal.SIG_DFL)
            env = dict(os.environ, **header["env"])
            os.execvpe(header["argv"][0], header["argv"], env)
        except FileNotFoundError as exc:
            os.write(2, f"sandbox: {exc}\n".encode())
            os._exit(127)
        except BaseException as exc:  # noqa: BLE001 - anything else: cannot execute
            os.write(2, f"sandbox: {exc}\n".encode())
            os._exit(126)
    os.close(out_w)
    os.close(err_w)
    os.close(stdin_fd)
    return pid, out_r, err_r


def wait_status(status):
    """Shell convention: the exit code, or 128 + N for death by signal N."""
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def pump(fd, kind, open_fds):
    """Forward what is readable on ``fd``; drop it from ``open_fds`` at end of file."""
    data = os.read(fd, CHUNK)
    if data:
        send(kind, data)
    else:
        open_fds.pop(fd)
        os.close(fd)


def supervise(pid, out_r, err_r, timeout):
    """Stream the program's output until it exits or its time is up; (exit code, nanoseconds, still-open pipes)."""
    started = time.monotonic_ns()
    deadline = time.monotonic() + timeout
    open_fds = {out_r: b"O", err_r: b"E"}
    pidfd = exit_fd(pid)
    while pid not in EXITS:
        left = deadline - time.monotonic()
        if left <= 0:
            kill_group(pid)
            while pid not in EXITS:
                time.sleep(0.001)  # the SIGCHLD handler records it
            break
        watch = list(open_fds) + ([pidfd] if pidfd is not None else [])
        ready, _, _ = select.select(watch, [], [], min(left, 0.05 if pidfd is None else left))
        for fd in ready:
            if fd in open_fds:
                pump(fd, open_fds[fd], open_fds)
    elapsed = time.monotonic_ns() - started
    if pidfd is not None:
        os.close(pidfd)
    return wait_status(EXITS.pop(pid)), elapsed, open_fds


def exit_fd(pid):
    """A descriptor readable once ``pid`` has exited (None without pidfd support: then the loop polls)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def others_alive():
    """Whether any process but this one (PID 1) is alive (zombies do not count)."""
    me = str(os.getpid())
    for name in os.listdir("/proc"):
        if not name.isdigit() or name in ("1", me):
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            return True
    return False


def kill_others():
    """SIGKILL every other process of the sandbox user until none is left (zombies are reaped); False if some survive."""
    for _ in range(CLEAN_ROUNDS):
        try:
            os.kill(-1, signal.SIGKILL)  # every process this user may signal but the caller (PID 1)
        except ProcessLookupError:
            pass
        if not others_alive():
            EXITS.clear()
            return True
        time.sleep(0.001)
    return False


def empty(path):
    """Remove everything under ``path`` (making directories writable where needed); True when nothing is left."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return True
    except PermissionError:
        os.chmod(path, 0o700)
        names = os.listdir(path)
    for name in names:
        full = os.path.join(path, name)
        try:
            mode = os.lstat(full).st_mode
            if stat.S_ISDIR(mode):
                if not stat.S_IMODE(mode) & 0o700 == 0o700:
                    os.chmod(full, stat.S_IMODE(mode) | 0o700)
                empty(full)
                os.rmdir(full)
            else:
                os.unlink(full)
        except OSError:
            pass
    return not os.listdir(path)


def remove_ipc():
    """Remove every System V message queue, semaphore set and shared memory segment (the container's IPC namespace is
    its own: all are the sandbox user's); True when none is left."""
    libc = ctypes.CDLL(None, use_errno=True)
    left = False
    for kind, remove in (("msg", libc.msgctl), ("sem", libc.semctl), ("shm", libc.shmctl)):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                ids = [int(line.split()[1]) for line in f.read().splitlines()[1:] if line.strip()]
        except (OSError, ValueError, IndexError):
            continue
        for ipc_id in ids:
            args = (ipc_id, 0, 0) if kind == "sem" else (ipc_id, 0, None)  # IPC_RMID = 0
            left = remove(*args) != 0 or left
    return not left


def clean():
    """0 when every other process is gone and the work folders and System V IPC objects are empty; 1 processes
    survived; 2 files or IPC objects did."""
    if not kill_others():
        return 1
    os.chdir("/")
    ok = remove_ipc()
    for path in WIPED:
        if os.path.isdir(path):
            try:
                ok = empty(path) and ok
            except OSError:
                ok = False
    return 0 if ok else 2


def drain(open_fds, writers_dead):
    """Forward what is left in the program's pipes: up to end of file when every writer is dead, else what is there."""
    while open_fds:
        ready, _, _ = select.select(list(open_fds), [], [], None if writers_dead else 0)
        if not ready:
            break
        for fd in ready:
            pump(fd, open_fds[fd], open_fds)
    for fd in open_fds:
        os.close(fd)


def relay(name, data, timeout, max_bytes):
    """Send ``data`` to the abstract Unix socket ``name`` and forward its answer (``O`` frames, at most ``max_bytes``)
    until the listener closes the connection; (exit code: 0, 3 nobody listens, 1 the connection broke, 137 the time
    ran out; nanoseconds). The listener is a program of the sandbox user: nothing it sends is read but as bytes."""
    started = time.monotonic_ns()
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    code, left = 0, max_bytes
    try:
        sock.settimeout(timeout)
        try:
            sock.connect("\0" + name)
        except OSError:
            return 3, time.monotonic_ns() - started
        sock.sendall(data)
        while True:
            sock.settimeout(max(deadline - time.monotonic(), 0.0001))
            chunk = sock.recv(CHUNK)
            if not chunk:
                break
            if left > 0:
                send(b"O", chunk[:left])
                left -= len(chunk)
    except socket.timeout:
        code = 137
    except OSError:
        code = 1
    finally:
        sock.close()
    return code, time.monotonic_ns() - started


def serve_one(header, tar_bytes):
    """Run one request and send its frames."""
    if "relay" in header:  # a pooled session's hand-over to its own listener: no program, no clean-up
        code, nanos = relay(header["relay"], tar_bytes, float(header["timeout"]), int(header["max_bytes"]))
        send(b"X", json.dumps([code, nanos, -1]).encode())
        return
    keep = bool(header.get("keep"))
    try:
        os.chdir(ROOT)
        stdin_fd = stage(tar_bytes, header)
        os.chdir(header["cwd"])  # the program inherits it
    except Exception as exc:  # noqa: BLE001 - bad input staging is an infrastructure failure on the host
        send(b"S", f"{type(exc).__name__}: {exc}".encode())
        if not keep:
            clean()
        return
    EXITS.clear()  # statuses of orphans reaped since: none is the program's (a reused pid would end its wait at once)
    pid, out_r, err_r = spawn(header, stdin_fd)
    code, nanos, open_fds = supervise(pid, out_r, err_r, float(header["timeout"]))
    status = -1 if keep else clean()
    drain(open_fds, writers_dead=status not in (1, -1))  # kept background processes may hold the pipes open
    send(b"X", json.dumps([code, nanos, status]).encode())


def main():
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
        sys.stderr.write(f"exec server: prctl(PR_SET_DUMPABLE) failed: errno {ctypes.get_errno()}\n")
        os._exit(1)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # no handler: as PID 1 a program's SIGINT is then dropped
    signal.signal(signal.SIGCHLD, on_child)
    while True:
        header, tar_bytes = receive()
        serve_one(header, tar_bytes)


if __name__ == "__main__":
    main()
