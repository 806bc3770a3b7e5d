"""The interpreter's supervisor (see ``opd_harness.sandbox.interpreter``): ``python -I -S -c <this file> MODE KEY WORKER_SOURCE GRACE
[IDLE]``.

MODE ``daemon``: fork a detached copy that listens on the abstract socket ``"\\0KEY"``, print ``READY <pid>`` once it
does, exit; it exits when nobody connects within IDLE seconds (60) of its start. MODE ``serve``: stay in the
foreground and take requests from the files of the folder KEY (``req.json`` and ``go``), answering in ``out.json``.
Either way it runs the worker (WORKER_SOURCE in a child forked from it, set up as ``python -c`` runs it: no second
interpreter start per episode), hands it cells, reads their output, enforces the timeout
(the worker gets GRACE seconds to stop after the interrupt), restarts it when it dies and ends every other process
below it after each cell. Stdlib only; it never runs model code.
"""

import codecs
import ctypes
import json
import os
import select
import signal
import socket
import struct
import sys
import time

WORKER = ""  # the worker's source, set by main() from argv
GRACE = 2.0  # seconds a cell has to stop after its interrupt, set by main() from argv
SWEEP_ROUNDS = 500  # ~1 ms apart: a process forking while it is swept is caught in a later round
CHILDREN_FILES = False  # whether /proc has /proc/PID/task/TID/children files, set by main()


def killpg(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def become_subreaper():
    """Orphans below us (a cell's double-forked or setsid process) become our children, not PID 1's: the sweep finds them."""
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def proc_status(entry):
    """(pids as /proc numbers them, ppid there, state) of one /proc entry, None when it is gone."""
    try:
        with open(f"/proc/{entry}/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return [int(n) for n in fields[b"NSpid"].split()], int(fields[b"PPid"]), fields[b"State"].strip()[:1]
    except (OSError, KeyError, ValueError):
        return None


def has_children_files():
    """Whether /proc lists each thread's children (``/proc/PID/task/TID/children``, CONFIG_PROC_CHILDREN)."""
    try:
        return any(os.path.exists(f"/proc/self/task/{tid}/children") for tid in os.listdir("/proc/self/task"))
    except OSError:
        return False


def child_entries(pid):
    """The /proc entries of ``pid``'s children: those of every thread of it (a child belongs to the thread that forked it)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []  # gone
    kids = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids.extend(kid.decode() for kid in f.read().split())
        except OSError:
            pass  # that thread (or the process) ended
    return kids


def descendants():
    """Every process below this one: [(pid, whether it is our child, whether it is a zombie)], pids in our own namespace.

    /proc may belong to an outer PID namespace (the local provider's runs, where it lists every process of the host):
    the tree is walked in its numbers and each pid translated through NSpid (the entry at our namespace's depth). The
    walk follows the ``children`` files down from us, so it reads only our subtree (a few files, not the status of
    every process on the machine: ~100 ms of CPU a cell beside 2,000 processes); without them it scans every process."""
    me = proc_status("self")
    if me is None:
        return []
    depth, root = len(me[0]) - 1, me[0][0]
    if not CHILDREN_FILES:
        return scan_descendants(depth, root)
    found, stack, seen = [], [str(root)], {str(root)}
    while stack:
        for kid in child_entries(stack.pop()):
            if kid in seen:
                continue
            seen.add(kid)
            st = proc_status(kid)
            if st is not None and len(st[0]) > depth:
                found.append(below(st, depth, root))
                stack.append(kid)
    return found


def below(st, depth, root):
    """One process below us as ``descendants`` lists it, from its ``proc_status``."""
    nspids, ppid, state = st
    return nspids[depth], ppid == root, state in (b"Z", b"X")


def scan_descendants(depth, root):
    """``descendants`` from the status of every process in /proc (where there are no ``children`` files)."""
    kids = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_status(name)
            if st is not None and len(st[0]) > depth:
                kids.setdefault(st[1], []).append(st)
    found, stack = [], [root]
    while stack:
        for st in kids.get(stack.pop(), ()):
            found.append(below(st, depth, root))
            stack.append(st[0][0])
    return found


def sweep(keep):
    """SIGKILL every process below us but the worker ``keep`` (what the cell started, in its process group or not),
    reaping those that became our children; False when some were still alive after every round. Done after two rounds
    in a row find none alive: a ``children`` file is exact only for a tree that does not change while it is read."""
    clear = 0
    for _ in range(SWEEP_ROUNDS):
        found = [d for d in descendants() if d[0] != keep]
        for pid, ours, zombie in found:
            if not zombie:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if ours:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        clear = clear + 1 if not any(not zombie for _, _, zombie in found) else 0
        if clear == 2:
            return True
        time.sleep(0.001)
    return False


class Forked:
    """A forked worker's process, with the part of ``subprocess.Popen``'s interface the supervisor uses."""

    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    def _record(self, status):
        self.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

    def poll(self):
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (a sweep): gone, its status unknown
                self.returncode = 0
            else:
                if pid:
                    self._record(status)
        return self.returncode

    def wait(self):
        while self.returncode is None:
            try:
                self._record(os.waitpid(self.pid, 0)[1])
            except ChildProcessError:
                self.returncode = 0
            except InterruptedError:
                continue
        return self.returncode

    def kill(self):
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


def run_forked_worker(null, w_out, r_cell, w_done, pgid):
    """In the forked child: become ``python -c WORKER CELL_FD DONE_FD SUP_PGID`` without starting a new interpreter (the
    supervisor has run no cell when it starts its episode's worker; after a crash only this episode's): its own process
    group, stdin /dev/null, stdout and stderr the output pipe, no other descriptor but the two pipes; ``site`` and the
    current directory on ``sys.path``, as ``python -c`` has them and the supervisor (``-I -S``) has not. Never returns."""
    try:
        os.setpgrp()
        os.dup2(null, 0)
        os.dup2(w_out, 1)
        os.dup2(w_out, 2)
        low, high = sorted((r_cell, w_done))
        os.closerange(3, low)
        os.closerange(low + 1, high)
        os.closerange(high + 1, os.sysconf("SC_OPEN_MAX"))
        import site

        site.main()
        sys.path.insert(0, "")
        sys.argv = ["-c", str(r_cell), str(w_done), str(pgid)]
        exec(compile(WORKER, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except BaseException:  # noqa: BLE001 - the child must never return into the supervisor's code
        os._exit(1)
    os._exit(0)


class Worker:
    def __init__(self):
        r_cell, self.w_cell = os.pipe()
        self.r_done, w_done = os.pipe()
        self.r_out, w_out = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            pgid = os.getpgrp()
            pid = os.fork()
            if pid == 0:
                run_forked_worker(null, w_out, r_cell, w_done, pgid)
            self.proc = Forked(pid)
        except BaseException:
            for fd in (self.w_cell, self.r_done, self.r_out):
                os.close(fd)
            raise
        finally:
            for fd in (r_cell, w_done, w_out, null):
                os.close(fd)
        os.set_blocking(self.r_out, False)
        self.cells = 0

    def alive(self):
        return self.proc.poll() is None

    def kill(self):
        killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        for fd in (self.w_cell, self.r_done, self.r_out):
            try:
                os.close(fd)
            except OSError:
                pass

    def drain(self, sink):
        """Read what is in the output pipe now; False once every writer has closed it."""
        while True:
            try:
                data = os.read(self.r_out, 65536)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            if sink is not None:
                sink.add(data)


class Capture:
    def __init__(self, cap):
        self.cap, self.kept, self.total = cap, [], 0
        self.size = 0
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, data):
        text = self.dec.decode(data)
        self.total += len(text)
        if self.size < self.cap:
            piece = text[: self.cap - self.size]
            self.kept.append(piece)
            self.size += len(piece)

    def finish(self):
        self.add(b"")
        tail = self.dec.decode(b"", final=True)
        self.total += len(tail)
        if self.size < self.cap:
            self.kept.append(tail[: self.cap - self.size])
        return "".join(self.kept)


def describe(code):
    if code is None:
        return "the process vanished"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    return f"exit code {code}"


worker = None  # the current Worker


def fresh_worker():
    global worker
    worker = Worker()


def run_cell(req):
    """Run one cell; the reply dict."""
    global worker
    lost, notes = False, []
    if worker is None or not worker.alive():
        if worker is not None:
            lost = worker.cells > 0
            code = worker.proc.returncode
            worker.kill()
            notes.append(f"the Python process had died between cells ({describe(code)}); variables from earlier cells are lost")
        worker = None
        sweep(None)
        fresh_worker()
    w = worker
    w.drain(None)  # stray output of background threads between cells
    out = Capture(int(req["cap"]))
    payload = json.dumps({"code": req["code"], "display": bool(req.get("display"))}).encode()
    t0 = time.monotonic()
    status, raised, done = "ok", False, None
    try:
        os.write(w.w_cell, struct.pack(">I", len(payload)))
        view = memoryview(payload)
        while view:
            view = view[os.write(w.w_cell, view):]
    except OSError:
        pass  # the worker died: seen below
    w.cells += 1
    deadline, phase, buf, crashed = t0 + float(req["timeout"]), 0, b"", None
    while True:
        now = time.monotonic()
        if now >= deadline:
            if phase == 0:
                status = "timeout"
            if phase < 2:
                try:
                    os.kill(w.proc.pid, signal.SIGUSR1)  # interrupts the cell; the worker then ends what it started
                except OSError:
                    pass
                phase += 1
                deadline = now + (0.5 if phase == 1 else GRACE - 0.5)
            else:
                w.kill()
                crashed = "interrupt ignored"
                break
        ready, _, _ = select.select([w.r_out, w.r_done], [], [], max(0.0, min(0.1, deadline - now)))
        if w.r_out in ready:
            w.drain(out)
        if w.r_done in ready:
            try:
                data = os.read(w.r_done, 4096)
            except OSError:
                data = b""
            if data:
                buf += data
                if buf.endswith(b"\n"):
                    done = json.loads(buf.splitlines()[-1])
                    break
        if (w.r_done in ready and not data) or not w.alive():
            w.proc.wait()
            crashed = describe(w.proc.returncode)
            w.drain(out)
            w.kill()
            break
    duration = time.monotonic() - t0
    if not sweep(w.proc.pid if done is not None else None):
        notes.append("some processes the cell started could not be ended")
    if done is not None:
        w.drain(out)
        raised = bool(done.get("raised"))
        w.drain(out)
    else:
        lost = True
        if status == "timeout":
            notes.append("the cell did not stop when interrupted; the Python process was restarted, variables from earlier cells are lost")
        else:
            status = "crash"
            notes.append(f"the Python process died ({crashed}); variables from earlier cells are lost")
        worker = None
        try:
            fresh_worker()
        except OSError as exc:
            notes.append(f"could not restart it yet: {exc}")
    return {"status": status, "raised": raised, "output": out.finish(), "total_chars": out.total, "state_lost": lost,
            "notes": notes, "duration_s": duration}


parts = []  # a large request, sent in pieces ("part") before the request that runs it ("parts")


def handle(raw):
    req = json.loads(raw)
    if req.get("op") == "ping":
        return {"status": "pong"}
    if req.get("op") == "exit":  # the host closes the session: end cleanly, so that nothing is left to look for
        return {"status": "exit"}
    if req.get("op") == "part":
        parts.append(req["data"])
        return {"status": "part"}
    if req.get("op") == "parts":
        req = json.loads("".join(parts))
        parts.clear()
    return run_cell(req)


def serve_socket(srv, idle_s):
    srv.settimeout(idle_s)  # nobody connects in time: the host lost us (e.g. it fell back to files)
    while True:
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            break
        srv.settimeout(None)
        with conn:
            try:
                uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
                if uid != os.getuid():
                    continue  # abstract sockets have no permissions: only our own user may hand us cells
                conn.settimeout(30.0)  # a request arrives at once (a cell holding a connection open cannot block us)
                n = struct.unpack(">I", recv_exact(conn, 4))[0]
                raw = recv_exact(conn, n)
                conn.settimeout(None)
                reply = handle(raw)
                conn.sendall(json.dumps(reply).encode())
            except (OSError, ValueError, struct.error):
                pass


def recv_exact(conn, n):
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise OSError("client went away")
        buf += chunk
    return buf


IN_CLOSE_WRITE, IN_MOVED_TO = 0x8, 0x80  # inotify events: a file written and closed, or renamed into the folder
WATCH_RECHECK_S = 0.25  # with a watch, `go` is also re-read this often (a cell may have replaced the folder)


def watch_folder(ctl):
    """(an inotify descriptor that becomes readable when a file in ``ctl`` is written or renamed into it, the folder's
    inode), or (None, None) where inotify is unavailable (the loop then polls)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, AttributeError):
        return None, None
    if fd < 0:
        return None, None
    inode = folder_inode(ctl)
    if inode is None or libc.inotify_add_watch(fd, os.fsencode(ctl), IN_CLOSE_WRITE | IN_MOVED_TO) < 0:
        os.close(fd)
        return None, None
    return fd, inode


def folder_inode(ctl):
    """The folder's inode; None while it is missing (a cell's thread may delete it at any time)."""
    try:
        return os.stat(ctl).st_ino
    except OSError:
        return None


def wait_for_write(fd, timeout):
    """Block until the watched folder changes or ``timeout`` passes; consume the events."""
    if select.select([fd], [], [], max(0.0, timeout))[0]:
        try:
            while os.read(fd, 65536):
                pass
        except OSError:  # BlockingIOError: drained
            pass


def serve_files(ctl):
    os.makedirs(ctl, exist_ok=True)
    for name in os.listdir(ctl):
        try:
            os.unlink(os.path.join(ctl, name))
        except OSError:
            pass
    # Fixed names, never deleted here: the host's write_files may be walking the directory at any time.
    # The host writes req.json, then go (the request's number); we answer in out.json (tmp + rename). Between requests
    # we sleep in select() on an inotify watch of the folder (no CPU while the episode's model writes its next turn:
    # hundreds of idle sessions polling every 20 ms took ~0.8 of a core), re-reading `go` at least every
    # WATCH_RECHECK_S; without inotify, by polling.
    watch, inode = watch_folder(ctl)  # before `ready`: a request written after it is seen
    with open(os.path.join(ctl, "ready"), "w") as f:
        f.write(str(os.getpid()))
    seq, idle, beat = 1, 0.0005, time.monotonic()
    while True:
        try:
            with open(os.path.join(ctl, "go"), "rb") as f:
                ready = f.read().strip() == str(seq).encode()
        except OSError:
            ready = False
        if not ready:
            now = time.monotonic()
            if now - beat > 1.0:
                beat = now
                try:
                    os.write(1, b".")  # the host is gone when this pipe breaks
                except OSError:
                    return
            if watch is not None:
                wait_for_write(watch, min(WATCH_RECHECK_S, beat + 1.0 - now))
            else:
                time.sleep(idle)
                idle = min(idle * 1.25, 0.02)
            continue
        try:
            with open(os.path.join(ctl, "req.json"), "rb") as f:
                reply = handle(f.read())
        except (OSError, ValueError) as exc:
            reply = {"status": "error", "error": f"bad request file: {exc}"}
        reply["seq"] = seq
        os.makedirs(ctl, exist_ok=True)
        tmp = os.path.join(ctl, "out.json.tmp")
        with open(tmp, "w") as f:
            json.dump(reply, f)
        os.replace(tmp, os.path.join(ctl, "out.json"))
        if reply["status"] == "exit":
            return
        seq, idle = seq + 1, 0.0005
        if watch is not None and folder_inode(ctl) not in (inode, None):  # a cell replaced the folder: watch the new one
            os.close(watch)
            watch, inode = watch_folder(ctl)


def main():
    global WORKER, GRACE, CHILDREN_FILES
    mode, key, WORKER = sys.argv[1], sys.argv[2], sys.argv[3]
    CHILDREN_FILES = has_children_files()
    GRACE = float(sys.argv[4])
    idle_s = float(sys.argv[5]) if len(sys.argv) > 5 else 60.0
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    if mode == "daemon":
        r, w = os.pipe()
        if os.fork() > 0:
            os.close(w)
            msg = os.read(r, 100).decode()
            sys.stdout.write(msg)
            sys.exit(0 if msg.startswith("READY") else 1)
        os.close(r)
        os.setsid()
        become_subreaper()
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind("\0" + key)
        srv.listen(8)
        fresh_worker()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.write(w, f"READY {os.getpid()}".encode())
        os.close(w)
        try:
            serve_socket(srv, idle_s)
        finally:
            if worker is not None:
                worker.kill()
    else:
        try:
            os.setsid()  # the workers' session: a worker steps back into our process group between cells
        except OSError:
            pass
        become_subreaper()
        fresh_worker()
        try:
            serve_files(os.path.abspath(key))  # absolute: a cell may delete and the host recreate the work dir
        finally:
            if worker is not None:
                worker.kill()


if __name__ == "__main__":
    main()
