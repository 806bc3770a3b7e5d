"""The interpreter's worker (see ``opd_harness.sandbox.interpreter``): ``python -c <this file> CELL_FD DONE_FD SUP_PGID``.

Reads length-prefixed JSON cells from CELL_FD, runs them in a persistent ``__main__`` namespace, writes one JSON line
per cell to DONE_FD. SIGUSR1 interrupts a cell. Stdlib only; it runs inside the sandbox, and the cells with it.
Its own frames are told from the cells' by their file name ``<string>`` (it runs as ``-c``).
"""

import ast
import io
import json
import linecache
import os
import signal
import struct
import sys
import time
import traceback
import types

ME = os.getpid()  # the worker; a process a cell forks sees another pid
in_cell = False  # a cell is running (SIGUSR1 interrupts only then)


class CellInterrupted(BaseException):
    """Raised by SIGUSR1 (the cell ran past its timeout); not an Exception, so `except Exception` lets it through."""


def on_usr1(signum, frame):
    if os.getpid() != ME:
        os._exit(1)  # a process the cell forked: ended with the cell
    if in_cell:
        raise CellInterrupted()


def fresh_stream():
    return io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True)


def read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            os._exit(0)
        buf += chunk
    return buf


def reap():
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def end_cell_processes(sup_pgid):
    """SIGKILL what the cell started: the worker steps out into the supervisor's process group, then kills its own."""
    try:
        os.setpgid(0, sup_pgid)
    except OSError:
        return  # the cell moved the worker to another session: nothing to step into
    try:
        os.killpg(ME, signal.SIGKILL)
    except OSError:
        return  # the group is empty
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # reap them, so they stop counting against the process limit
        try:
            if os.waitpid(-ME, os.WNOHANG)[0] == 0:
                time.sleep(0.001)
        except ChildProcessError:
            break


def show(exc, stream):
    if isinstance(exc, SyntaxError):
        lines = traceback.format_exception_only(type(exc), exc)
    else:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":  # the worker's own frames
            tb = tb.tb_next
        lines = traceback.format_exception(type(exc), exc, tb)
    stream.write("".join(lines))


def main():
    global in_cell
    cell_fd, done_fd, sup_pgid = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    os.set_inheritable(cell_fd, False)
    os.set_inheritable(done_fd, False)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # the memory limit's OOM killer picks the worker, not the supervisor
    except OSError:
        pass
    signal.signal(signal.SIGUSR1, on_usr1)
    out_fd = os.dup(1)  # a copy, to restore fds 1 and 2 should a cell close them
    stream = fresh_stream()
    main_module = types.ModuleType("__main__")
    main_module.__builtins__ = __builtins__
    sys.modules["__main__"] = main_module
    ns = main_module.__dict__
    sys.argv = [""]
    count = 0
    while True:
        reap()
        n = struct.unpack(">I", read_exact(cell_fd, 4))[0]
        msg = json.loads(read_exact(cell_fd, n))
        reap()  # processes the supervisor swept after the last cell: no zombies left counting against the process limit
        count += 1
        name = f"<cell {count}>"
        src = msg["code"]
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        raised = interrupted = False
        for fd in (1, 2):
            os.dup2(out_fd, fd)
        if stream.closed:
            stream = fresh_stream()
        sys.stdout = sys.stderr = stream  # every cell's output is captured, whatever the last one did to them
        try:
            os.setpgid(0, 0)  # the cell's own process group (led by the worker), ended with the cell
        except OSError:
            pass
        try:
            try:
                tree = ast.parse(src, name)
                last = None
                if msg.get("display") and tree.body and isinstance(tree.body[-1], ast.Expr):
                    last = compile(ast.Expression(tree.body.pop().value), name, "eval")
                body = compile(tree, name, "exec")
                in_cell = True
                exec(body, ns)
                if last is not None:
                    value = eval(last, ns)
                    if value is not None:
                        print(repr(value))
            finally:
                in_cell = False
                if os.getpid() != ME:
                    os._exit(0)  # a process the cell forked ran to the end of the cell: it must not act as the worker
        except CellInterrupted:
            interrupted = True
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raised = True
                show(exc, stream)
        except BaseException as exc:
            raised = True
            try:
                show(exc, stream)
            except BaseException:
                pass
        if os.getpid() != ME:
            os._exit(1)
        for s in (sys.stdout, sys.stderr, stream):
            try:
                s.flush()
            except BaseException:
                pass
        end_cell_processes(sup_pgid)
        reap()
        os.write(done_fd, json.dumps({"raised": raised, "interrupted": interrupted}).encode() + b"\n")


if __name__ == "__main__":
    main()
