"""Code tasks: HumanEval+ / MBPP+ (real files from the `benchmark_data` folder) and LiveCodeBench (project-written problems).

Docker tests are marked ``docker``; without a daemon or image they skip, unless ``HARNESS_REQUIRE_DOCKER=1``
where they fail (same rule as tests/test_sandbox.py).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import zlib

import pytest

from opd_harness import sandbox
from opd_harness.registry import TASKS
from opd_harness.task import DataError
from opd_harness.tasks.code.common import last_fenced_block
from opd_harness.tasks.code.livecodebench import decode_pickled_str, decode_private_tests

# the task classes as the registry names them (a task's name is its entry point's)
HumanEvalPlusTask, MbppPlusTask, LiveCodeBenchTask = (TASKS.get(name) for name in ("humaneval_plus", "mbpp_plus", "livecodebench"))

HE_FILE = f"humaneval_plus/{HumanEvalPlusTask.file_name}"
MBPP_FILE = f"mbpp_plus/{MbppPlusTask.file_name}"
from conftest import SANDBOX_IMAGE as IMAGE  # noqa: E402


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "code-cache"))


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nDone."


# ---------------------------------------------------------------- loading (no Docker)


def test_load_real_files(benchmark_data):
    data = benchmark_data(HE_FILE, MBPP_FILE)
    he = HumanEvalPlusTask().load(data_dir=data)
    mb = MbppPlusTask().load(data_dir=data)
    assert len(he) == 164 and len({p.id for p in he}) == 164
    assert len(mb) == 378 and len({p.id for p in mb}) == 378
    assert he[0].id == "HumanEval/0" and he[0].meta["entry_point"] == "has_close_elements"


def test_bad_row_names_file_line_field(tmp_path):
    folder = tmp_path / "humaneval_plus"
    folder.mkdir()
    good = {"task_id": "T/0", "prompt": "def f(x):\n", "entry_point": "f", "canonical_solution": "    return x\n",
            "base_input": [[1]], "plus_input": [], "atol": 0, "contract": ""}
    bad = dict(good, task_id="T/1", entry_point=3)
    (folder / "x.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=r"x\.jsonl:2: field 'entry_point'"):
        HumanEvalPlusTask().load(data_dir=tmp_path)


def test_extraction_and_unparsable_is_fail_without_sandbox(benchmark_data):
    assert last_fenced_block("a\n```python\nx = 1\n```\nb\n```\ny = 2\n```") == "y = 2"
    assert last_fenced_block("no fence") is None
    data = benchmark_data(HE_FILE)
    task = HumanEvalPlusTask(sandbox=object())  # never touched: parsing happens on the host, nothing runs
    p = task.load(data_dir=data)[0]
    s = task.grade_many([p], [fenced("def has_close_elements(:\n  pass")])[0]
    assert s.status == "fail" and "unparsable" in json.loads(s.details)["reason"]
    # a body-only completion (base model) is appended to the prompt
    assert task.extract_code(p, "    return True\n").startswith(p.meta["prompt"])


def test_sandbox_failure_is_error(benchmark_data):
    data = benchmark_data(HE_FILE)
    with sandbox.open_sandbox("docker", image=IMAGE, base_url="unix:///nonexistent/docker.sock", retries=0) as sb:
        task = HumanEvalPlusTask(sandbox=sb)
        p = task.load(data_dir=data)[0]
        s = task.grade_many([p], [fenced(p.solution)])[0]
    assert s.status == "error"


def test_private_tests_decoded_without_unpickling():
    tests = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    blob = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()
    assert decode_private_tests(blob) == tests
    assert decode_private_tests(json.dumps(tests)) == tests

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(ValueError, match="not allowed"):
        decode_pickled_str(pickle.dumps(Evil()))
    for proto in range(0, pickle.HIGHEST_PROTOCOL + 1):
        assert decode_pickled_str(pickle.dumps("héllo" * 100, protocol=proto)) == "héllo" * 100


def test_evalplus_rules_on_the_host():
    """checker.evalplus_match follows evalplus unsafe_execute (the comparison runs in the harness, not the sandbox)."""
    from opd_harness.tasks.code.checker import evalplus_match

    def ok(dataset, ep, out, exp, atol=0.0, inp=()):
        try:
            evalplus_match(dataset, ep, lambda: inp, out, exp, atol)
            return True
        except Exception:  # noqa: BLE001
            return False

    assert ok("humaneval", "f", [1, 2], [1, 2]) and not ok("humaneval", "f", (1, 2), [1, 2])  # tuples are not lists
    assert ok("humaneval", "f", 0.1 + 0.2, 0.3) and not ok("humaneval", "f", 0.31, 0.3)  # float: atol 1e-6 forced
    assert not ok("humaneval", "f", 1, 1.0000001, atol=1e-3)  # allclose only for equal types
    assert ok("humaneval", "f", True, 1)  # == semantics: True == 1
    assert ok("mbpp", "similar_elements", [3, 4], (4, 3)) and ok("mbpp", "are_equivalent", "anything", 1)
    assert ok("mbpp", "check_str", "a match object", True) and not ok("mbpp", "check_str", None, True)
    assert ok("humaneval", "find_zero", 1.0, 99.0, atol=1e-4, inp=([-1.0, 1.0],))  # a root passes whatever the expected
    assert not ok("humaneval", "find_zero", 2.0, 1.0, atol=1e-4, inp=([-1.0, 1.0],))
    assert not ok("humaneval", "f", float("nan"), float("nan"))  # as evalplus: NaN never matches


# ---------------------------------------------------------------- grading in Docker


def _sample(problems, ids):
    by_id = {p.id: p for p in problems}
    return [by_id[i] for i in ids]


@pytest.mark.docker
def test_humaneval_canonical_pass_wrong_fail_hang_timeout(docker_sb, benchmark_data):
    data = benchmark_data(HE_FILE)
    task = HumanEvalPlusTask(HumanEvalPlusTask.Options(min_time_limit=1.0), sandbox=docker_sb)
    ps = _sample(task.load(data_dir=data), ["HumanEval/0", "HumanEval/2", "HumanEval/32", "HumanEval/53", "HumanEval/150"])
    canon = [fenced(p.solution) for p in ps]
    body_only = [p.solution[len(p.meta["prompt"]):] for p in ps]  # completion-style (prompt + body)
    wrong = [fenced(f"def {p.meta['entry_point']}(*args):\n    return None") for p in ps[:2]]
    hang = [fenced(f"def {ps[0].meta['entry_point']}(*args):\n    while True:\n        pass")]
    scores = task.grade_many(ps + ps + ps[:2] + ps[:1], canon + body_only + wrong + hang)
    details = [json.loads(s.details) for s in scores]
    assert [s.status for s in scores[:10]] == ["pass"] * 10, details
    assert all(d["base"] == "pass" and d["plus"] == "pass" for d in details[:10])
    assert [s.status for s in scores[10:12]] == ["fail", "fail"]
    assert scores[12].status == "fail" and details[12]["base"] == "timeout", details[12]


@pytest.mark.docker
def test_mbpp_canonical_pass_and_wrong_fail(docker_sb, benchmark_data):
    data = benchmark_data(MBPP_FILE)
    task = MbppPlusTask(sandbox=docker_sb)
    ids = ["Mbpp/2", "Mbpp/124", "Mbpp/581", "Mbpp/793", "Mbpp/3"]
    ps = _sample(task.load(data_dir=data), ids)
    scores = task.grade_many(ps, [fenced(p.solution) for p in ps])
    assert [s.status for s in scores] == ["pass"] * 5, [s.details for s in scores]
    # base passes but plus fails: is_not_prime wrong for large inputs -> base pass, plus fail
    p = ps[4]
    cheat = fenced("def is_not_prime(n):\n    return n in (2, 10, 35, 37) and n != 2 and n != 37")
    s = task.grade_many([p], [cheat])[0]
    d = json.loads(s.details)
    assert s.status == "fail" and d["plus"] == "fail"
    base_task = MbppPlusTask(MbppPlusTask.Options(grade="base"), sandbox=docker_sb)
    base_task.load(data_dir=data)
    assert base_task.grade_many([p], [cheat])[0].status == ("pass" if d["base"] == "pass" else "fail")


@pytest.mark.docker
@pytest.mark.slow
def test_more_canonical_solutions(docker_sb, benchmark_data):
    data = benchmark_data(HE_FILE, MBPP_FILE)
    for cls, step in ((HumanEvalPlusTask, 8), (MbppPlusTask, 19)):
        task = cls(sandbox=docker_sb)
        ps = task.load(data_dir=data)[::step]
        scores = task.grade_many(ps, [fenced(p.solution) for p in ps])
        bad = [(p.id, s.details) for p, s in zip(ps, scores) if s.status != "pass"]
        assert not bad, bad


@pytest.mark.docker
def test_output_written_at_once_survives_a_slow_reader(docker_sb):
    """The runner writes its key line at once; a reader delayed past it must still get every byte (docker-py #3160)."""
    import sys
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from opd_harness.sandbox import ExecRequest

    request = ExecRequest(argv=["sh", "-c", "echo first; i=0; while [ $i -lt 100 ]; do echo line-$i; i=$((i+1)); done"])
    stop, interval = threading.Event(), sys.getswitchinterval()
    burners = [threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True) for _ in range(2)]
    sys.setswitchinterval(0.05)  # the reading thread now often starts after the program has written
    try:
        for b in burners:
            b.start()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: docker_sb.run(request), range(12)))
    finally:
        stop.set()
        sys.setswitchinterval(interval)
    bad = [(r.status, r.stdout[:40]) for r in results if not (r.success and r.stdout.count("\n") == 101)]
    assert not bad, bad


BIG_ROWS = [  # outputs far over DIGEST_OVER (64 KiB) in the plus phase
    {"task_id": "Big/0", "prompt": "def ones(n):\n", "entry_point": "ones", "canonical_solution": "    return '1' * n\n",
     "base_input": [[10]], "plus_input": [[100_000], [200_000]], "atol": 0},
    {"task_id": "Big/1", "prompt": "def tenths(n):\n", "entry_point": "tenths",
     "canonical_solution": "    return [0.1 * i for i in range(n)]\n", "base_input": [[3]], "plus_input": [[20_000]], "atol": 0},
]


def test_large_outputs_compared_by_digest_keep_evalplus_rules(sb, tmp_path):
    """Large outputs travel as the supervisor's SHA-256; a wrong one still fails and float tolerance still applies."""
    from opd_harness.tasks.code.evalplus import DIGEST_OVER

    (tmp_path / "humaneval_plus").mkdir()
    (tmp_path / "humaneval_plus" / "big.jsonl").write_text("".join(json.dumps(r) + "\n" for r in BIG_ROWS))
    runs: list[tuple[str, int]] = []  # (candidate code, bytes of stdout) per grading run

    class Recording:
        python, pool_size = sb.python, 2

        def run(self, request):
            result = sb.run(request)
            job = json.loads(request.files["job.json"])
            if job["mode"] == "evalplus_check":
                runs.append((job["code"], len(result.stdout)))
            return result

    task = HumanEvalPlusTask(sandbox=Recording())
    ones, tenths = task.load(data_dir=tmp_path)
    cases = {
        "canonical ones": (ones, ones.solution, "pass"),
        "same length, last character wrong": (ones, "def ones(n):\n    return '1' * (n - 1) + ('2' if n > 50 else '1')\n", "fail"),
        "canonical tenths": (tenths, tenths.solution, "pass"),
        "other float rounding (i / 10)": (tenths, "def tenths(n):\n    return [i / 10 for i in range(n)]\n", "pass"),
        "off by 1e-3 on large inputs": (
            tenths,
            "def tenths(n):\n    return [0.1 * i + (1e-3 if n > 50 else 0) for i in range(n)]\n",
            "fail",
        ),
    }
    scores = task.grade_many([p for p, _, _ in cases.values()], [fenced(code) for _, code, _ in cases.values()])
    got = {name: (s.status, json.loads(s.details)) for name, s in zip(cases, scores)}
    assert {n: g[0] for n, g in got.items()} == {n: c[2] for n, c in cases.items()}, got
    assert got["same length, last character wrong"][1]["plus"] == "fail" and got["same length, last character wrong"][1]["base"] == "pass"
    shipped = {}
    for code, size in runs:
        shipped.setdefault(code, []).append(size)
    canonical = shipped[ones.solution]
    assert len(canonical) == 1 and canonical[0] < DIGEST_OVER < 200_000, canonical  # one run; the 200 KB output stayed inside
    assert len(shipped[cases["same length, last character wrong"][1]]) == 2  # a differing digest: graded again in full
    assert len(shipped[cases["other float rounding (i / 10)"][1]]) == 2
    assert task.truth("Big/0")["plus_outputs"] == [None, None]  # the in-memory truth holds digests, not 200 KB texts
    assert len(task.full_outputs("Big/0", "plus")[1]) == 200_002


# ---------------------------------------------------------------- LiveCodeBench


def _lcb_row(qid, content, public, private, func_name=None, starter="", date="2024-01-10T00:00:00", encode=True):
    private_text = json.dumps(private)
    if encode:
        private_text = base64.b64encode(zlib.compress(pickle.dumps(private_text))).decode()
    return {
        "question_title": qid, "question_content": content, "platform": "atcoder" if func_name is None else "leetcode",
        "question_id": qid, "contest_id": "c1", "contest_date": date, "starter_code": starter, "difficulty": "easy",
        "public_test_cases": json.dumps(public), "private_test_cases": private_text,
        "metadata": json.dumps({"func_name": func_name} if func_name else {}),
    }


@pytest.fixture
def lcb_dir(tmp_path):
    folder = tmp_path / "livecodebench"
    folder.mkdir()
    stdin = _lcb_row(
        "abc001_a",
        "Read two integers and print their sum.",
        [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}],
        [
            {"input": "10 -4\n", "output": "6\n", "testtype": "stdin"},
            {"input": "1000000000 1000000000\n", "output": "2000000000\n", "testtype": "stdin"},
        ],
    )
    functional = _lcb_row(
        "lc1", "Return the indices of two numbers adding up to target.",
        [{"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"}],
        [{"input": "[3,2,4]\n6", "output": "[1, 2]", "testtype": "functional"}],
        func_name="twoSum", starter="class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        ",
        date="2024-06-01T00:00:00",
    )
    (folder / "test.jsonl").write_text(json.dumps(stdin) + "\n")
    (folder / "test2.jsonl").write_text(json.dumps(functional) + "\n")
    return tmp_path


def test_lcb_load_filters(lcb_dir):
    ps = LiveCodeBenchTask().load(data_dir=lcb_dir)
    assert [p.id for p in ps] == ["abc001_a", "lc1"]
    assert ps[0].meta["n_private"] == 2 and ps[0].meta["inputs"][2] == "1000000000 1000000000\n"
    assert [p.id for p in LiveCodeBenchTask(LiveCodeBenchTask.Options(release_version="release_v1")).load(data_dir=lcb_dir)] == ["abc001_a"]
    assert [p.id for p in LiveCodeBenchTask(LiveCodeBenchTask.Options(release_version="v2")).load(data_dir=lcb_dir)] == ["lc1"]
    assert [p.id for p in LiveCodeBenchTask(LiveCodeBenchTask.Options(start_date="2024-03-01")).load(data_dir=lcb_dir)] == ["lc1"]
    assert [p.id for p in LiveCodeBenchTask(LiveCodeBenchTask.Options(end_date="2024-03-01")).load(data_dir=lcb_dir)] == ["abc001_a"]


@pytest.mark.docker
def test_lcb_stdin_and_functional_grading(lcb_dir, docker_sb):
    task = LiveCodeBenchTask(LiveCodeBenchTask.Options(timeout=2.0), sandbox=docker_sb)
    stdin_p, fn_p = task.load(data_dir=lcb_dir)
    good_stdin = fenced("a, b = map(int, input().split())\nprint(a + b)")
    overflow = fenced("a, b = map(int, input().split())\nprint(min(a + b, 10**9))")  # fails a private test
    good_fn = fenced(
        "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
        "        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n"
        "                return (seen[target - x], i)\n            seen[x] = i\n"
    )
    wrong_fn = fenced("class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n")
    hang_fn = fenced("class Solution:\n    def twoSum(self, nums, target):\n        while True: pass\n")
    problems = [stdin_p, stdin_p, stdin_p, fn_p, fn_p, fn_p, fn_p]
    completions = [good_stdin, overflow, "print(1)  # no code block", good_fn, wrong_fn, hang_fn, fenced("class Solution(:")]
    scores = task.grade_many(problems, completions)
    details = [json.loads(s.details) for s in scores]
    assert [s.status for s in scores] == ["pass", "fail", "fail", "pass", "fail", "fail", "fail"], details
    assert details[1]["failed_test"] == 2  # the private test with the large sum
    assert details[4]["failed_test"] == 1 and details[5]["result"] == "timeout"


def test_flat_lists_encode_as_themselves_with_the_same_json():
    """The runner's fast path for lists of plain scalars: same JSON as encoding each item, subclasses and huge ints excluded."""
    from opd_harness.tasks.code import sandbox_runner as rt

    class Int(int):
        pass

    def per_item(x):
        return [per_item(v) for v in x] if type(x) is list else rt.encode(x)

    flat = [[1, 2, 3], [1.5, "a", None, True, -0.0, float("nan")], [1, 2.0], [True, 1], []]
    not_flat = [[2**20000, 1], [1.0, 2**20000], [Int(3)], ["x", Int(2)], [[1]], [(1, 2)], [{1: 2}]]
    for x in flat + not_flat:
        assert rt.dumps(x) == json.dumps(per_item(x), allow_nan=True, separators=(",", ":")), x
    assert all(rt.encode(x) is x for x in flat)  # no per-item copy
    assert not any(rt.encode(x) is x for x in not_flat)
