"""Model code cannot forge a code-task verdict (HumanEval+ / MBPP+ and LiveCodeBench graders).

The sandbox runner only reports what the program returned or printed, in HMAC-authenticated records whose key
exists only in the (non-dumpable) supervisor; the harness compares with a ground truth that never enters the
sandbox. Every attempt below prints or writes fake result lines (old nonce format, records with guessed or
scavenged keys, a fake key line) to stdout, to inherited fds 3..20 and to its ancestors' stdout, and then tries one
more trick. Each must be graded ``fail`` (never ``pass``, never ``error``), on both sandbox providers.
"""

from __future__ import annotations

import base64
import json
import pickle
import zlib
from pathlib import Path

import pytest

from opd_harness.tasks.code import checker
from opd_harness.tasks.code import sandbox_runner as rt
from opd_harness.registry import TASKS


# Runs at import of every attempt: defines forge(), which sprays fake records wherever it can write.
HumanEvalPlusTask, LiveCodeBenchTask = TASKS.get("humaneval_plus"), TASKS.get("livecodebench")  # named by the registry

FORGE = r'''
import gc, hashlib, hmac, json, os, sys

def _fds(inherited):
    fds = [1, 2, *(range(3, 21) if inherited else ())]
    pid = os.getpid()
    for _ in range(6):  # ancestors: the supervisor, `timeout`, the sandbox wrapper shell, ...
        try:
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
        try:
            fds.append(os.open(f"/proc/{pid}/fd/1", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    return fds

def _keys():
    keys = [bytes(32), b"k" * 32]
    for obj in gc.get_objects():  # any 32-byte bytes held by the runner's objects
        for ref in gc.get_referents(obj):
            if type(ref) is bytes and len(ref) == 32:
                keys.append(ref)
    return keys[:50]

def _records(key):
    bodies = [json.dumps({"phase": p, "i": i, "t": 0.001}) + "\t" + "true" for p in ("base", "plus", "tests") for i in range(20)]
    bodies += [json.dumps({"phase": p, "i": i, "t": 0.001, "sha256": hashlib.sha256(b"true").hexdigest(), "n": 4})
               for p in ("base", "plus") for i in range(20)]  # digest records (large outputs)
    bodies += [json.dumps({"phase": p, "end": "ok", "error": None, "at": None}) for p in ("base", "plus", "tests")]
    bodies += [json.dumps({"test": i, "status": "ok", "error": None, "t": 0.0}) + "\t" + "Mw==" for i in range(5)]
    bodies.append(json.dumps({"done": True}))
    lines = [b"OPD-RUNNER-REC " + hmac.new(key, b.encode(), hashlib.sha256).hexdigest().encode() + b" " + b.encode() for b in bodies]
    return b"\n".join(lines) + b"\n"

def forge(inherited=True):
    fake_key = b"f" * 32
    payload = b"\n@@" + b"0" * 16 + b'@@{"phase": "base", "status": "pass"}\n' + b'@@x@@{"done": true}\n'
    payload += b"OPD-RUNNER-KEY " + fake_key.hex().encode() + b"\n" + _records(fake_key)
    for key in _keys():
        payload += _records(key)
    for fd in _fds(inherited):
        try:
            os.write(fd, payload)
        except OSError:
            pass
    try:
        print(payload.decode(), file=sys.__stdout__, flush=True)
    except Exception:
        pass
'''

CORRECT_HE0 = ("    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for j, b in enumerate(numbers) if i != j)\n")

HE_ATTEMPTS = {
    "fake lines, wrong answer": "def has_close_elements(numbers, threshold):\n    forge()\n    return True\n",
    "fake lines to stdout only, wrong answer": "def has_close_elements(numbers, threshold):\n    forge(inherited=False)\n    return True\n",
    "os._exit(0) at import": "forge()\nos._exit(0)\n",
    "os._exit(0) in the call": "def has_close_elements(numbers, threshold):\n    forge()\n    os._exit(0)\n",
    "SystemExit at import": "forge()\nraise SystemExit(0)\n",
    "SystemExit in the call": "def has_close_elements(numbers, threshold):\n    forge()\n    raise SystemExit(0)\n",
    "KeyboardInterrupt in the call": "def has_close_elements(numbers, threshold):\n    raise KeyboardInterrupt\n",
    "monkeypatch json/math/builtins/runner": (
        "import builtins, math, json as _j\n"
        "_j.dumps = lambda *a, **k: 'true'\n_j.loads = lambda *a, **k: True\nmath.isclose = lambda *a, **k: True\n"
        "builtins.isinstance = lambda *a: True\nimport __main__\n"
        "for _n in ('dumps', 'encode', '_failure', 'phase_inputs'):\n"
        "    setattr(__main__, _n, lambda *a, **k: 'true')\n"
        "forge()\ndef has_close_elements(numbers, threshold):\n    return True\n"
    ),
    "__eq__ always True": (
        "class Yes:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n    __hash__ = object.__hash__\n"
        "def has_close_elements(numbers, threshold):\n    forge()\n    return Yes()\n"
    ),
    "int subclass lying __eq__/__repr__/__hash__": (
        "class Liar(int):\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
        "    def __repr__(self): return 'True'\n    def __hash__(self): return hash(True)\n    def __bool__(self): return True\n"
        "def has_close_elements(numbers, threshold):\n    return Liar(7)\n"
    ),
    "list and str subclasses lying": (
        "class L(list):\n    def __eq__(self, other): return True\n    def __iter__(self): return iter([True])\n"
        "class S(str):\n    def __eq__(self, other): return True\n    def __str__(self): return 'True'\n"
        "_n = [0]\ndef has_close_elements(numbers, threshold):\n    _n[0] += 1\n    return L([1, 2]) if _n[0] % 2 else S('x')\n"
    ),
    "fake __class__": (
        "class Fake:\n    __class__ = property(lambda self: bool)\n"
        "    def __eq__(self, other): return True\n    __hash__ = object.__hash__\n"
        "def has_close_elements(numbers, threshold):\n    return Fake()\n"
    ),
    "sys.settrace rewrites the runner's locals": (
        "import sys, ctypes\n"
        "def _tracer(frame, event, arg):\n"
        "    if event == 'line' and 'out' in frame.f_locals and frame.f_code.co_name == '_child_main':\n"
        "        frame.f_locals['out'] = True\n"
        "        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))\n"
        "    return _tracer\n"
        "sys.settrace(_tracer)\nsys._getframe(1).f_trace = _tracer\n"
        "def has_close_elements(numbers, threshold):\n    forge()\n    return 'no'\n"
    ),
    "kill the supervisor": (
        "import signal\nforge()\nos.kill(os.getppid(), signal.SIGKILL)\ndef has_close_elements(numbers, threshold):\n    return True\n"
    ),
    "kill every process": "import signal\nforge()\nos.kill(-1, signal.SIGKILL)\n",
    "correct but slow, alarms off": (
        "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        "def has_close_elements(numbers, threshold):\n    signal.setitimer(signal.ITIMER_REAL, 0)\n    time.sleep(1.5)\n"
        + CORRECT_HE0
    ),
    "correct but slow, supervisor stopped meanwhile": (
        "import signal, time\n"
        "def has_close_elements(numbers, threshold):\n    sup = os.getppid()\n    os.kill(sup, signal.SIGSTOP)\n"
        "    time.sleep(1.5)\n    os.kill(sup, signal.SIGCONT)\n" + CORRECT_HE0
    ),
}


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "forgery-cache"))


def _he_task(sb, benchmark_data) -> tuple[HumanEvalPlusTask, object]:
    data = benchmark_data(f"humaneval_plus/{HumanEvalPlusTask.file_name}")
    task = HumanEvalPlusTask(HumanEvalPlusTask.Options(min_time_limit=0.5), sandbox=sb)
    problem = {p.id: p for p in task.load(data_dir=data)}["HumanEval/0"]
    return task, problem


def test_evalplus_forgeries_fail(sb, benchmark_data):
    task, p = _he_task(sb, benchmark_data)
    prompt = p.meta["prompt"]
    names = list(HE_ATTEMPTS)
    honest = fenced(prompt + CORRECT_HE0)
    completions = [fenced("import os\n" + FORGE + HE_ATTEMPTS[n]) for n in names]
    scores = task.grade_many([p] * (len(names) + 1), [honest, *completions])
    assert scores[0].status == "pass", scores[0].details  # the forge-free correct solution passes on this provider
    bad = {n: (s.status, s.details) for n, s in zip(names, scores[1:]) if s.status != "fail"}
    assert not bad, bad
    details = {n: json.loads(s.details) for n, s in zip(names, scores[1:])}
    for n in ("correct but slow, alarms off", "correct but slow, supervisor stopped meanwhile"):  # the clock is outside
        assert details[n]["base"] == "timeout", (n, details[n])
    if getattr(sb, "name", "") == "docker":  # the fake lines never reach the harness: every holder of the reply stream
        # (the runner's supervisor, the exec server as PID 1) is non-dumpable, so /proc/<pid>/fd/1 cannot be opened
        assert details["fake lines to stdout only, wrong answer"].get("rejected_records", 0) == 0, details


def test_jobs_carry_no_expected_outputs(sb, tmp_path, benchmark_data):
    task, p = _he_task(sb, benchmark_data)
    jobs = []

    class Recording:
        python, pool_size = sb.python, 2

        def run(self, request):
            jobs.append(json.loads(request.files["job.json"]))
            return sb.run(request)

    task.use_sandbox(Recording())
    assert task.grade_many([p], [fenced(p.solution)])[0].status == "pass"
    check = [j for j in jobs if j["mode"] == "evalplus_check"]
    assert len(check) == 1
    assert set(check[0]) == {"mode", "dataset", "task_id", "code", "entry_point", "phases", "digest_over"}  # a size, no digest
    assert all(set(ph) == {"name", "inputs", "limits", "wall"} for ph in check[0]["phases"])
    lcb, problems = _lcb(tmp_path, Recording())
    jobs.clear()
    lcb.grade_many(problems, [fenced("print(3)"), fenced("class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n")])
    keys = {j["mode"]: set(j) for j in jobs}  # only code, inputs and limits travel
    assert keys == {"lcb_stdin": {"mode", "code", "inputs", "timeout"},
                    "lcb_functional": {"mode", "code", "fn_name", "load_limit", "phases"}}


# ---------------------------------------------------------------- LiveCodeBench


def _lcb_row(qid, public, private, func_name=None, starter=""):
    private_text = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(private)))).decode()
    return {
        "question_title": qid, "question_content": "q", "platform": "atcoder", "question_id": qid, "contest_id": "c",
        "contest_date": "2024-01-10T00:00:00", "starter_code": starter, "difficulty": "easy",
        "public_test_cases": json.dumps(public), "private_test_cases": private_text,
        "metadata": json.dumps({"func_name": func_name} if func_name else {}),
    }


def _lcb(tmp_path: Path, sb) -> tuple[LiveCodeBenchTask, list]:
    """A LiveCodeBench task over two problems (stdin: a + b; functional: twoSum) written to ``tmp_path``."""
    folder = tmp_path / "livecodebench"
    folder.mkdir()
    stdin = _lcb_row("sum", [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}],
                     [{"input": "40 2\n", "output": "42\n", "testtype": "stdin"}])
    fn = _lcb_row("two", [{"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"}],
                  [{"input": "[3,2,4]\n6", "output": "[1, 2]", "testtype": "functional"}], func_name="twoSum",
                  starter="class Solution:\n    def twoSum(self, nums, target):\n        ")
    (folder / "test.jsonl").write_text(json.dumps(stdin) + "\n" + json.dumps(fn) + "\n")
    task = LiveCodeBenchTask(LiveCodeBenchTask.Options(timeout=1.0), sandbox=sb)
    return task, task.load(data_dir=tmp_path)


@pytest.fixture
def lcb_task(tmp_path, sb):
    return _lcb(tmp_path, sb)


LCB_STDIN_ATTEMPTS = {
    "fake lines, wrong answer": "forge()\nprint(0)\n",
    "prints the first test's answer for every test": "forge()\nprint(3)\n",
    "kill the supervisor": "import signal\nforge()\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "kill every process": "import signal\nforge()\nos.kill(-1, signal.SIGKILL)\n",
    "correct but slow": "import time\nforge()\na, b = map(int, input().split())\ntime.sleep(2)\nprint(a + b)\n",
    "background process writes later": (
        "if os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(0.3)\n    forge()\n    os._exit(0)\nprint(0)\n"
    ),
}

LCB_FN_ATTEMPTS = {
    "__eq__ always True": "class Yes:\n    def __eq__(self, o): return True\n    __hash__ = object.__hash__\n"
                          "class Solution:\n    def twoSum(self, nums, target):\n        forge()\n        return Yes()\n",
    "list subclass lying": "class L(list):\n    def __eq__(self, o): return True\n"
                           "class Solution:\n    def twoSum(self, nums, target):\n        return L([9, 9])\n",
    "os._exit(0)": "class Solution:\n    def twoSum(self, nums, target):\n        forge()\n        os._exit(0)\n",
    "SystemExit": "forge()\nraise SystemExit(0)\n",
    "monkeypatch json": "import json as _j\n_j.dumps = lambda *a, **k: '[0, 1]'\n"
                        "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n",
}


def test_lcb_forgeries_fail(lcb_task):
    task, (stdin_p, fn_p) = lcb_task
    names_s, names_f = list(LCB_STDIN_ATTEMPTS), list(LCB_FN_ATTEMPTS)
    good_s = fenced("a, b = map(int, input().split())\nprint(a + b)")
    good_f = fenced("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n        for i, x in enumerate(nums):\n"
                    "            if target - x in seen:\n                return [seen[target - x], i]\n            seen[x] = i\n")
    problems = [stdin_p, fn_p] + [stdin_p] * len(names_s) + [fn_p] * len(names_f)
    completions = [good_s, good_f] + [fenced("import os\n" + FORGE + LCB_STDIN_ATTEMPTS[n]) for n in names_s]
    completions += [fenced("import os\n" + FORGE + LCB_FN_ATTEMPTS[n]) for n in names_f]
    scores = task.grade_many(problems, completions)
    assert [s.status for s in scores[:2]] == ["pass", "pass"], [s.details for s in scores[:2]]
    bad = {n: (s.status, s.details) for n, s in zip(names_s + names_f, scores[2:]) if s.status != "fail"}
    assert not bad, bad


# ---------------------------------------------------------------- the report and the decoder (no sandbox)


def test_report_accepts_only_records_of_the_first_line_key():
    key = bytes(range(32))
    import hashlib
    import hmac

    def rec(k: bytes, body: str) -> str:
        return "OPD-RUNNER-REC " + hmac.new(k, body.encode(), hashlib.sha256).hexdigest() + " " + body

    good = '{"phase":"base","i":0,"t":0.1}\ttrue'
    stdout = "\n".join([f"OPD-RUNNER-KEY {key.hex()}", rec(key, good), rec(b"x" * 32, '{"done":true}'),
                        f"OPD-RUNNER-KEY {(b'x' * 32).hex()}", "OPD-RUNNER-REC 00 {}", rec(key, '{"done":true}')]) + "\n"
    report = checker.parse_report(stdout)
    assert report.started and report.done and report.rejected == 2
    assert [(r.header, r.payload) for r in report.records] == [({"phase": "base", "i": 0, "t": 0.1}, "true"), ({"done": True}, None)]
    assert not checker.parse_report("junk\n" + stdout).started  # the key must be the very first line


def test_decoder_yields_plain_values_and_refuses_abuse():
    class Sneaky(int):
        def __eq__(self, other):
            return True

    value = [1, (2.5, "x"), {"k": {3, 4}}, frozenset({b"ab"}), 3 + 4j, None, True, 10**5000, Sneaky(5)]
    decoded = checker.decode(rt.dumps(value))
    assert decoded == [1, (2.5, "x"), {"k": {3, 4}}, frozenset({b"ab"}), 3 + 4j, None, True, 10**5000, 5]
    assert type(decoded[-1]) is int
    assert checker.decode(rt.dumps(object())) != checker.decode(rt.dumps(object()))  # opaque: equal to nothing
    p = (1 << 61) - 1  # ints congruent mod 2**61 - 1 share a hash: a set of them would be quadratic to build
    flood = json.dumps({"__t": "set", "v": [1 + k * p for k in range(100)]})
    for bad in (flood, '{"__t": "pickle", "v": "x"}', "[" * 100_000 + "]" * 100_000, '{"__t": "dict", "v": [[[1], 2]]}'):
        with pytest.raises((ValueError, TypeError, RecursionError, KeyError)):
            checker.decode(bad)
