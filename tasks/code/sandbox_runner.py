"""Test runner executed INSIDE the sandbox. The harness imports it only for its pure helpers; it runs nothing at import.

Usage inside the sandbox: ``python3 sandbox_runner.py job.json``. Trust model (DEVELOPERS.md, "Code grading"):
  - This process, the supervisor, is trusted. Model code runs only in a child process it forks before anything secret
    exists (evalplus, LiveCodeBench functional tests), or in one subprocess per test (LiveCodeBench stdin tests).
  - The job holds inputs, never expected outputs: the supervisor reports what the model code returned (tagged JSON,
    ``encode``) or printed for each input, and the HARNESS compares that with the ground truth. Forging the report
    cannot help without the expected outputs, which exist only on the host.
  - Reports are authenticated. Before model code runs, the supervisor makes itself non-dumpable (same-uid processes
    can then neither read its memory nor open its /proc fds), writes a fresh random key as the first stdout line and
    waits until the reader has drained the pipe. Every later record carries HMAC-SHA256(key, body). Model code may
    write into (or read from) the same pipe, but cannot produce a valid record; a lost record is a fail, never a pass.
  - Time limits are measured here (wall clock from sending an input until the child says the call returned; encoding
    the result gets the same allowance again) and enforced by killing the child: model code cannot stop this clock.

Wire format (stdout lines): first ``OPD-RUNNER-KEY <hex>``, then ``OPD-RUNNER-REC <hmac hex> <body>``, body being
``<header JSON>`` or ``<header JSON>\\t<payload>``.

Modes (``job["mode"]``):
  ``evalplus_truth``   run the trusted canonical solution in this process; per input: its encoded output and runtime.
  ``evalplus_check``   a candidate in a child, phase by phase (evalplus's per-input limits); per input: the child's
                       encoded output (or, past ``digest_over`` bytes, its SHA-256) and the time measured here; a phase
                       ends at the first exception, time-out or crash.
  ``lcb_functional``   the same for LiveCodeBench call-based tests.
  ``lcb_stdin``        one subprocess per test (``timeout`` each); per test: exit status and stdout (base64).
"""

import copy
import fcntl
import hashlib
import hmac
import io
import json
import math
import os
import select
import signal
import sys
import time

KEY_PREFIX = b"OPD-RUNNER-KEY "
RECORD_PREFIX = b"OPD-RUNNER-REC "
SEPARATOR = "\t"  # between a record's header JSON and its payload (json.dumps never writes a raw tab)
BIG_INT_BITS = 10_000  # larger ints travel as hex: the host's int/str digit limit does not apply to base 16
MAX_REPLY_BYTES = 256 << 20  # one answer of the child
MAX_STDOUT_BYTES = 16 << 20  # one stdin test's stdout
DRAIN_TIMEOUT_S = 10.0
FLUSH_BYTES = 1 << 20  # pending record bytes written at once
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Python 3.10+; spelled out for older interpreters)

# ----------------------------------------------------------------- value encoding (tagged JSON)


def _readers():
    """(base type, reader) for subclasses of builtins: the base type's own method reads the data, theirs never run."""
    return (
        (int, int.__int__),
        (float, float.__float__),
        (complex, lambda x: complex(complex.__complex__(x))),
        (str, str.__str__),
        (bytes, lambda x: bytes(memoryview(x))),
        (bytearray, lambda x: bytes(memoryview(x))),
        (list, lambda x: list(list.__iter__(x))),
        (tuple, lambda x: tuple(tuple.__iter__(x))),
        (dict, lambda x: dict(dict.items(x))),
        (frozenset, lambda x: frozenset(frozenset.__iter__(x))),
        (set, lambda x: set(set.__iter__(x))),
    )


_READERS = _readers()


def encode(x):
    """Tagged JSON of a value: builtins by exact type; other classes are opaque (equal to nothing on the host)."""
    t = type(x)
    if x is None or t is bool or t is str or t is float:
        return x
    if t is int:
        return x if x.bit_length() <= BIG_INT_BITS else {"__t": "int", "v": format(x, "x")}
    if t is list:
        return x if _plain_scalars(x) else [encode(v) for v in x]
    if t is tuple:
        return {"__t": "tuple", "v": [encode(v) for v in x]}
    if t is dict:
        return {"__t": "dict", "v": [[encode(k), encode(v)] for k, v in x.items()]}
    if t is set or t is frozenset:
        return {"__t": t.__name__, "v": [encode(v) for v in x]}
    if t is complex:
        return {"__t": "complex", "v": [x.real, x.imag]}
    if t is bytes or t is bytearray:
        return {"__t": "bytes", "v": x.hex()}
    np = sys.modules.get("numpy")
    if np is not None and issubclass(t, np.generic) and t.__module__ == "numpy":
        return encode(x.item())  # numpy scalars compare as Python numbers in evalplus
    for base, read in _READERS:
        if issubclass(t, base):  # issubclass on the type: a fake __class__ does not count
            return encode(read(x))
    return {"__t": "opaque", "v": f"{t.__module__}.{t.__qualname__}"}


_PLAIN = frozenset((str, float, bool, type(None), int))


def _plain_scalars(items):
    """Whether every item is a str, float, bool, None or int of at most BIG_INT_BITS bits (exact types): such a list
    encodes as itself, so a million-element result is checked by C-level loops instead of one encode() call each."""
    kinds = set(map(type, items))
    if not kinds <= _PLAIN:
        return False
    if int not in kinds:
        return True
    ints = items if len(kinds) == 1 else [v for v in items if type(v) is int]
    return max(map(int.bit_length, ints)) <= BIG_INT_BITS


def dumps(value):
    """Compact ASCII JSON of ``encode(value)`` (NaN / Infinity allowed)."""
    return json.dumps(encode(value), allow_nan=True, separators=(",", ":"))


# ----------------------------------------------------------------- evalplus rules (shared with the host checker)


def mbpp_deserialize_inputs(task_id, inputs):
    """evalplus/data/mbpp.py: restore tuples, sets and complex numbers that JSON cannot represent."""
    n = int(str(task_id).split("/")[-1])
    if n in (2, 116, 132, 143, 222, 261, 273, 394, 399, 421, 424, 429, 470, 560, 579, 596, 616, 630, 726, 740, 744, 809):
        return [[tuple(lst) for lst in inp] for inp in inputs]
    if n in (63, 64, 70, 94, 120, 237, 272, 299, 400, 409, 417, 438, 473, 614, 780):
        return [[[tuple(lst) for lst in lst_lst] for lst_lst in inp] for inp in inputs]
    if n in (75, 413, 444, 753):
        return [[[tuple(lst) for lst in inp[0]]] + [inp[1]] for inp in inputs]
    if n in (106, 750):
        return [[inp[0]] + [tuple(inp[1])] for inp in inputs]
    if n == 115:
        return [[[set(item) if isinstance(item, list) and len(item) else {} for item in inp[0]]] for inp in inputs]
    if n == 124:
        return [(float(inp[0]), complex(inp[1])) for inp in inputs]
    if n in (250, 405, 446, 617, 720, 763, 808):
        return [[tuple(inp[0])] + [inp[1]] for inp in inputs]
    if n in (259, 401, 445):
        mod = [[[tuple(lst) for lst in lst_lst] for lst_lst in inp] for inp in inputs]
        return [[tuple(lst) for lst in inp] for inp in mod]
    if n == 278:
        mod = [[[tuple(item) if isinstance(item, list) else item for item in inp[0]]] for inp in inputs]
        return [[tuple(lst) for lst in inp] for inp in mod]
    if n == 307:
        return [[tuple(inp[0])] + [inp[1], inp[2]] for inp in inputs]
    if n == 722:
        return [[{k: tuple(v) for k, v in inp[0].items()}] + inp[1:] for inp in inputs]
    if n == 252:
        return [[complex(inp[0])] for inp in inputs]
    if n in (580, 615, 791):

        def all_tuples(x):
            return tuple(all_tuples(i) for i in x) if isinstance(x, list) else x

        return [all_tuples(inp) for inp in inputs]
    return inputs


def phase_inputs(dataset, task_id, inputs):
    """A phase's inputs as evalplus passes them (MBPP ones deserialised)."""
    return mbpp_deserialize_inputs(task_id, inputs) if dataset == "mbpp" else inputs


MBPP_OUTPUT_NOT_NONE_TASKS = ["check_str", "text_match_three", "text_starta_endb"]
MBPP_OUTPUT_SET_EQ_TASKS = [
    "similar_elements", "find_char_long", "common_in_nested_lists", "extract_singly",
    "larg_nnum", "intersection_array", "find_dissimilar", "Diff",
]


def surface_area_oracle(base_edge, height):
    """evalplus _special_oracle.py, Mbpp/581."""
    slant_height = math.sqrt((base_edge / 2) ** 2 + height**2)
    return round(base_edge**2 + 4 * (base_edge * slant_height) / 2)


def digit_distance_oracle(num1, num2):
    """evalplus _special_oracle.py, Mbpp/558."""
    s1, s2 = str(num1), str(num2)
    width = max(len(s1), len(s2))
    return sum(abs(int(a) - int(b)) for a, b in zip(s1.zfill(width), s2.zfill(width)))


def poly(xs, x):
    """HumanEval/32's polynomial, for the find_zero oracle."""
    return sum(coeff * math.pow(x, i) for i, coeff in enumerate(xs))


# ----------------------------------------------------------------- in-process helpers


class swallow_io:
    """evalplus swallow_io: the program's print / input go to in-memory streams."""

    def __enter__(self):
        self.saved = sys.stdout, sys.stderr, sys.stdin
        sys.stdout, sys.stderr, sys.stdin = io.StringIO(), io.StringIO(), io.StringIO("")

    def __exit__(self, *exc):
        sys.stdout, sys.stderr, sys.stdin = self.saved


LCB_IMPORTS = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\nfrom heapq import *\n"
    "from bisect import *\nfrom copy import *\nfrom math import *\nfrom random import *\nfrom statistics import *\n"
    "from itertools import *\nfrom functools import *\nfrom operator import *\nfrom io import *\nfrom sys import *\n"
    "import json\nimport builtins\nimport typing\nfrom typing import *\nimport string\nimport re\nimport datetime\n"
    "import collections\nimport heapq\nimport bisect\nimport copy\nimport math\nimport random\nimport statistics\n"
    "import itertools\nimport functools\nimport operator\nimport io\nimport sys\nsys.setrecursionlimit(50000)\n"
)


# ----------------------------------------------------------------- the child (model code runs here)


class Child:
    """A forked worker that runs model code on request; the supervisor times and kills it."""

    def __init__(self):
        cmd_r, cmd_w = os.pipe()
        rep_r, rep_w = os.pipe()
        try:  # 1 MiB instead of 64 KiB: a 100 MB answer then costs 100 wake-ups of this process, not 1600
            fcntl.fcntl(rep_r, F_SETPIPE_SZ, 1 << 20)
        except OSError:
            pass
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - runs in the child
            for fd in os.listdir("/proc/self/fd"):
                if int(fd) > 2 and int(fd) not in (cmd_r, rep_w):
                    try:
                        os.close(int(fd))
                    except OSError:
                        pass
            exit_now = os._exit  # bound before model code runs (it may replace os._exit)
            try:
                _child_main(cmd_r, rep_w)
            finally:
                exit_now(1)  # never return into the supervisor's code
        os.close(cmd_r)
        os.close(rep_w)
        os.set_blocking(cmd_w, False)  # a child that stops reading cannot block the supervisor past a deadline
        self.cmd, self.rep, self.buf = cmd_w, rep_r, bytearray()
        self.alive = True

    def send(self, obj, deadline):
        """Write one command line; False when the child did not take it before the deadline."""
        data = memoryview((json.dumps(obj, allow_nan=True) + "\n").encode())
        while data:
            try:
                data = data[os.write(self.cmd, data) :]
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([], [self.cmd], [], left)[1]:
                    return False
            except OSError:  # the child is gone: the next read reports it
                return True
        return True

    def read_line(self, deadline, before_wait=None):
        """The child's next reply line (bytes, no newline); "timeout", "exited" or "too large".

        A line that arrives after the deadline is a time-out too (this process may have been stopped meanwhile).
        ``before_wait`` is called before this process waits for the child (the reporter writes its pending records).
        """
        scanned = 0  # bytes of buf already known to hold no newline (a 100 MB answer is not rescanned per chunk)
        while True:
            at = self.buf.find(b"\n", scanned)
            if at >= 0 and time.monotonic() > deadline:
                return "timeout"
            if at >= 0:
                line = bytes(self.buf[:at])
                del self.buf[: at + 1]
                return line
            scanned = len(self.buf)
            if len(self.buf) > MAX_REPLY_BYTES:
                return "too large"
            if before_wait is not None:
                before_wait()
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([self.rep], [], [], left)
            if not ready:
                return "timeout"
            chunk = os.read(self.rep, 1 << 20)
            if not chunk:
                return "exited"
            self.buf += chunk

    def request(self, obj, deadline):
        """Send one command; (reply line or failure word, seconds measured here)."""
        started = time.monotonic()
        reply = self.read_line(deadline) if self.send(obj, deadline) else "timeout"
        return reply, time.monotonic() - started

    def kill(self):
        """SIGKILL the child's process group and the child; reap it; its exit description."""
        if not self.alive:
            return ""
        self.alive = False
        for target in (lambda: os.killpg(self.pid, signal.SIGKILL), lambda: os.kill(self.pid, signal.SIGKILL)):
            try:
                target()
            except OSError:
                pass
        try:
            _, status = os.waitpid(self.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            return ""
        return f"exit {code}" if code >= 0 else f"signal {-code}"


def _child_main(cmd_fd, rep_fd):  # pragma: no cover - runs in the child
    """Serve load / call commands until the pipe closes; model code is trusted with nothing."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # under memory pressure the kernel kills this process, not the supervisor
    except OSError:
        pass
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    sys.stdin = io.StringIO("")
    reader = os.fdopen(cmd_fd, "rb", buffering=1 << 16)
    state = {}

    def reply(text):
        data = (text + "\n").encode("ascii", "replace")
        while data:
            data = data[os.write(rep_fd, data) :]

    for raw in reader:
        cmd = json.loads(raw)
        if cmd["op"] == "load":
            reply(_answer(lambda: _loaded(cmd, state)))
            continue
        for arg in cmd["args"]:  # one phase: call after call, up to the first exception
            text = _answer(lambda: _call(state, arg, reply))
            reply(text)
            if text[:1] == "-":
                break
    os._exit(0)


def _answer(work):  # pragma: no cover - runs in the child
    """``work()`` (a reply text) or, when model code raised anything, ``-`` and the error as JSON."""
    try:
        return work()
    except BaseException as exc:  # noqa: BLE001 - model code may raise anything, SystemExit included
        try:
            return "-" + json.dumps(f"{type(exc).__name__}: {exc}"[:500])
        except BaseException:  # noqa: BLE001 - a str() that raises
            return "-" + json.dumps(type(exc).__name__)


def _loaded(cmd, state):  # pragma: no cover - runs in the child
    state["fn"] = _load(cmd)
    state.update(_parsers(cmd))
    return "+"


def _call(state, arg, reply):  # pragma: no cover - runs in the child
    """One call of the loaded function: ``=`` as soon as it returns (its time stops there), then ``+`` and its answer."""
    args = state["parse"](arg) if "parse" in state else arg
    with swallow_io():
        out = state["fn"](*args)
    reply("=")  # encoding the result gets its own allowance
    if state.get("tuple_as_list") and isinstance(out, tuple):  # lcb_runner: a tuple result compares as a list
        out = list(tuple.__iter__(out))
    return "+" + dumps(out)


def _load(cmd):  # pragma: no cover - runs in the child
    """Exec the model code and return the callable named by the command."""
    glb = {"__name__": cmd.get("module_name", "__main__")}
    with swallow_io():
        exec(cmd.get("prelude", "") + cmd["code"], glb)
    name = cmd["entry_point"]
    solution = glb.get("Solution")
    if cmd.get("solution_class") and isinstance(solution, type):
        return getattr(solution(), name)
    return glb[name]


def _parsers(cmd):  # pragma: no cover - runs in the child
    """How the child turns a call's JSON argument into positional arguments."""
    if cmd["kind"] == "evalplus":
        dataset, task_id = cmd["dataset"], cmd["task_id"]
        return {"parse": lambda arg: phase_inputs(dataset, task_id, [arg])[0]}
    return {"parse": lambda arg: [json.loads(line) for line in arg.split("\n") if line.strip()], "tuple_as_list": True}


# ----------------------------------------------------------------- supervisor output


class Reporter:
    """Writes the key line, then HMAC-authenticated records, to a private copy of stdout."""

    def __init__(self):
        self.fd = os.dup(1)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1)  # print() of trusted canonical code must not reach the report
        os.dup2(null, 0)
        sys.stdin = io.StringIO("")
        self.key = None
        self.pending, self.pending_bytes = [], 0  # records not yet written (one write for many small records)

    def start(self):
        """Make this process non-dumpable, send a fresh key and wait until the reader has taken it."""
        import ctypes
        import fcntl
        import stat
        import termios

        if not stat.S_ISFIFO(os.fstat(self.fd).st_mode):
            raise SystemExit("sandbox_runner: stdout must be a pipe")
        if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
            raise SystemExit(f"sandbox_runner: prctl(PR_SET_DUMPABLE) failed: errno {ctypes.get_errno()}")
        self.key = os.urandom(32)
        self._write(KEY_PREFIX + self.key.hex().encode() + b"\n")
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        pending = bytearray(4)
        while True:
            fcntl.ioctl(self.fd, termios.FIONREAD, pending)
            if int.from_bytes(pending, sys.byteorder) == 0:
                return
            if time.monotonic() > deadline:
                raise SystemExit("sandbox_runner: the reader did not drain stdout")
            time.sleep(0.0005)

    def record(self, header, payload=None):
        body = json.dumps(header, allow_nan=True, separators=(",", ":"))
        if payload is not None:
            body += SEPARATOR + payload
        data = body.encode("ascii", "backslashreplace")
        mac = hmac.new(self.key, data, hashlib.sha256).hexdigest().encode()
        self.pending.append(RECORD_PREFIX + mac + b" " + data + b"\n")
        self.pending_bytes += len(data)
        if self.pending_bytes > FLUSH_BYTES:
            self.flush()

    def flush(self):
        """Write the pending records (before waiting on the child, and at the end)."""
        if self.pending:
            self._write(b"".join(self.pending))
            self.pending, self.pending_bytes = [], 0

    def _write(self, data):
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]


# ----------------------------------------------------------------- modes


def evalplus_truth(job, out, child=None):
    """Run the trusted canonical solution; per input its encoded output and runtime (evalplus trusted_exec)."""
    glb = {}
    exec(job["code"], glb)
    fn = glb[job["entry_point"]]
    not_none = job["dataset"] == "mbpp" and job["entry_point"] in MBPP_OUTPUT_NOT_NONE_TASKS
    for phase in ("base", "plus"):
        for i, inp in enumerate(phase_inputs(job["dataset"], job["task_id"], job[phase + "_input"])):
            inp = copy.deepcopy(inp)
            start = time.time()
            value = fn(*inp)
            elapsed = time.time() - start
            out.record({"phase": phase, "i": i, "t": elapsed}, dumps(value is not None if not_none else value))
        out.record({"phase": phase, "end": "ok"})


def run_calls(job, out, child, load):
    """Load the code in the child, then call it on each phase's inputs under the per-input limits and phase walls.

    A phase's inputs go to the child in one command and it calls the function on them one after the other (no round
    trip per input), answering ``=`` when a call returns and then the encoded result. The clock is this process's:
    input i's time runs from reading answer i-1 (or sending the phase) until its ``=`` line; the answer gets the same
    limit again; past either the child is killed. Per input a record ``{phase, i, t}`` with the child's answer as
    payload. An answer longer than ``job["digest_over"]`` bytes (when set) is reported as ``{phase, i, t, sha256, n}``
    without payload: its SHA-256, computed here, so that 100+ MB outputs (HumanEval/15, /130) never cross the pipe.
    Per phase an end record ``{phase, end, error, at}`` (``end``: ok, load, exception, timeout, exited, protocol, too
    large). Model code sees a phase's later inputs early; they are not secret (the expected outputs never come here).
    """
    phases, digest_over = job["phases"], job.get("digest_over")
    deadline = time.monotonic() + phases[0]["wall"]  # evalplus counts loading inside the first phase's wall
    reply, elapsed = child.request(load, min(deadline, time.monotonic() + job.get("load_limit", math.inf)))
    if reply != b"+":
        out.record({"phase": phases[0]["name"], "end": "load", "error": _failure(reply, child), "at": None, "t": elapsed})
        return
    for k, phase in enumerate(phases):
        name, limits = phase["name"], phase["limits"]
        if k:
            deadline = time.monotonic() + phase["wall"]
        end, error, at = "ok", None, None
        sent = not phase["inputs"] or child.send({"op": "calls", "args": phase["inputs"]}, deadline)
        mark = time.monotonic()
        for i in range(len(phase["inputs"])):
            reply = child.read_line(min(mark + limits[i], deadline), out.flush) if sent else "timeout"
            elapsed = time.monotonic() - mark
            if reply == b"=":  # returned within the limit; the answer (encoded result) may take as long again
                reply = child.read_line(min(time.monotonic() + limits[i], deadline), out.flush)
            mark = time.monotonic()
            if isinstance(reply, bytes) and reply[:1] == b"+" and reply.isascii():
                answer = memoryview(reply)[1:]
                if digest_over is not None and len(answer) > digest_over:  # the host compares digests of large outputs
                    out.record({"phase": name, "i": i, "t": elapsed, "sha256": hashlib.sha256(answer).hexdigest(), "n": len(answer)})
                else:
                    out.record({"phase": name, "i": i, "t": elapsed}, bytes(answer).decode())
                continue
            end = "exception" if isinstance(reply, bytes) and reply[:1] == b"-" else reply if isinstance(reply, str) else "protocol"
            error, at = _failure(reply, child), i
            break
        out.record({"phase": name, "end": end, "error": error, "at": at})
        if end != "ok":
            return


def _exception(reply):
    try:
        return str(json.loads(reply[1:]))[:500] if reply[:1] == b"-" else "malformed answer"
    except ValueError:
        return "malformed answer"


def _failure(reply, child):
    """A readable reason for a failed command (killing the child after a time-out)."""
    if isinstance(reply, bytes):
        return _exception(reply) if reply[:1] == b"-" else "malformed answer (not '+' ASCII JSON or '-' error)"
    if reply == "timeout":
        child.kill()
        return "time limit"
    if reply == "exited":
        return f"the program ended ({child.kill() or 'exit'})"
    return "answer too large"


def evalplus_check(job, out, child):
    """A candidate over the job's phases (each ``{name, inputs, limits, wall}``), evalplus inputs deserialised in the child."""
    load = {"op": "load", "kind": "evalplus", "code": job["code"], "entry_point": job["entry_point"],
            "dataset": job["dataset"], "task_id": job["task_id"]}
    run_calls(job, out, child, load)


def lcb_functional(job, out, child):
    """LiveCodeBench call-based tests: ``Solution().<fn_name>`` (or a top-level function) on JSON-lines arguments."""
    load = {"op": "load", "kind": "lcb", "code": job["code"], "prelude": LCB_IMPORTS, "entry_point": job["fn_name"],
            "solution_class": True, "module_name": "solution"}
    run_calls(job, out, child, load)


def lcb_stdin(job, out, child=None):
    """Run ``solution.py`` once per test; report exit status and stdout, stop at the first crash or time-out."""
    import base64  # imported by this mode only: every run pays the runner's start-up

    with open("solution.py", "w") as f:
        f.write(job["code"])
    for i, inp in enumerate(job["inputs"]):
        status, stdout, error, elapsed = _run_program(inp.encode(), job["timeout"])
        out.record({"test": i, "status": status, "error": error, "t": elapsed}, base64.b64encode(stdout).decode())
        if status != "ok":
            break
    out.record({"end": "done"})


def _run_program(stdin, timeout):
    """(status, stdout bytes, error, seconds) of one run of solution.py in its own session."""
    import subprocess  # see lcb_stdin

    started = time.monotonic()
    try:
        proc = subprocess.Popen([sys.executable, "solution.py"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        return "fail", b"", f"cannot start the program: {exc}", 0.0
    try:
        stdout, stderr = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", b"", "time limit", time.monotonic() - started
    finally:
        _killpg(proc)  # also whatever it left running in its session
    elapsed = time.monotonic() - started
    if len(stdout) > MAX_STDOUT_BYTES:
        return "fail", b"", f"more than {MAX_STDOUT_BYTES} bytes of output", elapsed
    if proc.returncode != 0:
        return "fail", stdout, f"exit {proc.returncode}: {stderr.decode(errors='replace')[-400:]}", elapsed
    return "ok", stdout, None, elapsed


def _killpg(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()


MODES = {"evalplus_truth": evalplus_truth, "evalplus_check": evalplus_check, "lcb_functional": lcb_functional, "lcb_stdin": lcb_stdin}
CHILD_MODES = ("evalplus_check", "lcb_functional")


def main():
    try:
        sys.set_int_max_str_digits(0)
    except AttributeError:  # pragma: no cover
        pass
    with open(sys.argv[1]) as f:
        job = json.load(f)
    os.remove(sys.argv[1])
    if job.get("mode") not in MODES:
        raise SystemExit(f"sandbox_runner: unknown mode {job.get('mode')!r}")
    child = Child() if job["mode"] in CHILD_MODES else None  # forked before the key exists: its memory never holds it
    out = Reporter()
    try:
        out.start()
        MODES[job["mode"]](job, out, child)
    finally:
        if child is not None:
            child.kill()
        out.flush()
    out.record({"done": True})
    out.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
