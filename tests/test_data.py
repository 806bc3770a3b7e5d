"""``harness data fetch`` against a local fake Hugging Face hub, ``harness data check``, and where tests read data.

The fetch tests run the real CLI in a subprocess with ``HF_ENDPOINT`` pointing at :mod:`fake_hub` and the
offline switches removed, so the download goes through ``datasets`` / ``huggingface_hub`` over HTTP exactly
as a user's does.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub

from opd_harness.data import DataFetchError, download_url, fetch_need, needs_of
from opd_harness.registry import TASKS
from opd_harness.task import DataError

ROOT = Path(__file__).resolve().parents[1]


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def math500_rows(n: int) -> list[dict]:
    return [
        {"problem": f"What is {i}+1?", "solution": f"It is $\\boxed{{{i + 1}}}$.", "answer": str(i + 1), "subject": "Algebra",
         "level": 1, "unique_id": f"test/algebra/{i}.json"}
        for i in range(n)
    ]  # fmt: skip


def aime24_rows(n: int = 30) -> list[dict]:
    return [{"ID": f"2024-I-{i + 1}", "Problem": f"Find {i}.", "Solution": "...", "Answer": i} for i in range(n)]


def lcb_row(qid: str) -> dict:
    tests = json.dumps([{"input": "1\n", "output": "1\n", "testtype": "stdin"}])
    return {"question_title": qid, "question_content": "Echo the input.", "platform": "atcoder", "question_id": qid,
            "contest_id": "abc", "contest_date": "2024-01-01T00:00:00", "starter_code": "", "difficulty": "easy",
            "public_test_cases": tests, "private_test_cases": tests, "metadata": "{}"}  # fmt: skip


def parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


GSM8K_CARD = b"""---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
# gsm8k
"""


def gsm8k_rows(n: int) -> list[dict]:
    return [
        {"question": f"Tom has {i} apples and gets one more. How many?", "answer": f"{i}+1=<<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"}
        for i in range(n)
    ]


def hub_repos(math500: list[dict]) -> dict[str, dict[str, bytes]]:
    return {
        "openai/gsm8k": {  # a config ("main") declared in the dataset card, Parquet shards, two splits
            "README.md": GSM8K_CARD,
            "main/train-00000-of-00001.parquet": parquet(gsm8k_rows(7473)),
            "main/test-00000-of-00001.parquet": parquet(gsm8k_rows(1319)),
        },
        "HuggingFaceH4/MATH-500": {"README.md": b"# MATH-500\n", "test.jsonl": jsonl(math500)},
        "Maxwell-Jia/AIME_2024": {"aime_2024_problems.jsonl": jsonl(aime24_rows())},
        "livecodebench/code_generation_lite": {
            "README.md": b"# lcb\n",
            "test.jsonl": jsonl([lcb_row("a1"), lcb_row("a2")]),
            "test2.jsonl": jsonl([lcb_row("b1")]),
            "code_generation_lite.py": b"# a loading script, not copied\n",
        },
    }


# `harness data ...` is opd_harness.cli's `data` sub-app, which is opd_harness.data's typer app; `python -m opd_harness.data`
# runs that same app without importing the rest of the CLI (torch, transformers: ~10 s per process).
HARNESS_DATA = [sys.executable, "-m", "opd_harness.data"]


def harness_online(hub: FakeHub, home: Path, *args: str, cli: list[str] = HARNESS_DATA) -> subprocess.CompletedProcess:
    """``harness data ARGS`` in a subprocess that talks to ``hub`` as if it were huggingface.co (nothing offline)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HARNESS_DATA_DIR"))}
    env |= {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    return subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=300)


def local_problems(task: str, folder: Path, split: str = "test"):
    cls = TASKS.get(task)
    return cls(cls.Options(source="local")).load(split, data_dir=folder)


# --------------------------------------------------------------------------- fetch (online path, fake hub)


@pytest.mark.slow
def test_fetch_downloads_into_the_layout_the_tasks_read(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with FakeHub(hub_repos(math500_rows(500))) as hub:
        cli = [sys.executable, "-m", "opd_harness.cli", "data"]  # the user's command, once
        result = harness_online(hub, tmp_path / "hf", "fetch", "math500", "aime24", "gsm8k", "livecodebench", "--to", str(data), cli=cli)
        requests = list(hub.requests)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(str(p.relative_to(data)) for p in data.rglob("*") if p.is_file()) == [
        "aime24/test.jsonl", "gsm8k/test.jsonl", "gsm8k/train.jsonl", "livecodebench/test.jsonl", "livecodebench/test2.jsonl",
        "math500/test.jsonl",
    ]  # fmt: skip  (no staging folder, no loading script left behind)
    math500 = local_problems("math500", data)
    assert len(math500) == 500 and math500[3].id == "test/algebra/3.json" and math500[3].answer == "4"
    aime = local_problems("aime24", data)  # the hub's ID/Problem/Answer columns, rewritten in the local layout
    assert [(p.id, p.answer) for p in aime[:2]] == [("2024-I-1", "0"), ("2024-I-2", "1")]
    assert [p.id for p in local_problems("livecodebench", data)] == ["a1", "a2", "b1"]
    gsm8k = local_problems("gsm8k", data, "train")
    assert len(gsm8k) == 7473 and gsm8k[4].answer == "5" and len(local_problems("gsm8k", data, "test")) == 1319
    assert any(r.startswith("GET /datasets/HuggingFaceH4/MATH-500/resolve/") for r in requests)  # really over HTTP
    assert any(r.startswith("GET /datasets/livecodebench/code_generation_lite/resolve/") and "test2.jsonl" in r for r in requests)
    check = harness_online(hub, tmp_path / "hf", "check", str(data), "math500", "aime24", "gsm8k", "livecodebench")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "5 ok, 0 missing, 0 invalid" in check.stdout


@pytest.mark.slow
def test_fetch_of_a_bad_copy_writes_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "math500").mkdir(parents=True)
    with FakeHub(hub_repos(math500_rows(499))) as hub:  # one problem short of MATH-500
        short = harness_online(hub, tmp_path / "hf", "fetch", "math500", "--to", str(data))
    assert short.returncode == 1
    assert "499 problems, expected 500" in short.stdout and "nothing of them was written" in short.stdout
    bad = math500_rows(500)
    bad[6]["answer"] = None
    with FakeHub(hub_repos(bad)) as hub:
        invalid = harness_online(hub, tmp_path / "hf", "fetch", "math500", "--to", str(data))
    assert invalid.returncode == 1
    assert (
        "invalid: math500 [test]: the download from" in invalid.stdout and "math500/test.jsonl:7: field 'answer': is null" in invalid.stdout
    )
    assert list(data.rglob("*")) == [data / "math500"]  # no file, no staging folder
    with FakeHub({}) as hub:  # the hub does not have it (and datasets has no cached copy): an error, and no folder is made
        unreachable = harness_online(hub, tmp_path / "hf-empty", "fetch", "math500", "--to", str(tmp_path / "new"))  # no cache
    assert (
        unreachable.returncode == 1 and "error: math500 [test]: download from hf:HuggingFaceH4/MATH-500[test] failed" in unreachable.stdout
    )
    assert not (tmp_path / "new").exists()


def test_unknown_task_or_one_without_files_is_a_usage_error(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for task, message in (("math5000", "unknown tasks 'math5000'"), ("arith", "'arith' reads no data files")):
        result = subprocess.run([*HARNESS_DATA, "fetch", task, "--to", str(tmp_path)],
                                capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
        assert result.returncode == 2 and message in " ".join(result.stderr.split()), result.stderr
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- release assets (plain HTTP download)


def gz(rows: list[dict]) -> tuple[bytes, str]:
    """(gzipped JSON lines, SHA-256 of the content)."""
    content = jsonl(rows)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as f:
        f.write(content)
    return buf.getvalue(), hashlib.sha256(content).hexdigest()


def evalplus_row(i: int) -> dict:
    return {"task_id": f"HumanEval/{i}", "prompt": "def f(x):\n", "entry_point": "f", "canonical_solution": "    return x\n",
            "base_input": [[1]], "plus_input": [[2]], "atol": 0, "contract": ""}  # fmt: skip


def test_release_asset_is_downloaded_checked_and_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cls = TASKS.get("humaneval_plus")
    asset, content_sha = gz([evalplus_row(i) for i in range(3)])
    with FakeHub({}, urls={"/evalplus/HumanEvalPlus.jsonl.gz": asset}) as hub:
        monkeypatch.setattr(cls, "release_url", f"{hub.endpoint}/evalplus/HumanEvalPlus.jsonl.gz")
        monkeypatch.setattr(cls, "content_sha256", content_sha)
        monkeypatch.setattr(cls, "expected_rows", 3)
        result = fetch_need(tmp_path, needs_of("humaneval_plus")[0])
        assert result.status == "ok" and result.rows == 3
        assert [p.id for p in local_problems("humaneval_plus", tmp_path)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
        assert fetch_need(tmp_path, needs_of("humaneval_plus")[0]).detail.startswith("already present")
        monkeypatch.setattr(cls, "content_sha256", "0" * 64)  # another release than the declared one
        with pytest.raises(DataFetchError, match="content SHA-256 .*expected 0000"):
            fetch_need(tmp_path / "other", needs_of("humaneval_plus")[0])
        assert not (tmp_path / "other" / "humaneval_plus").exists()
        with pytest.raises(Exception, match="404"):
            download_url(f"{hub.endpoint}/evalplus/missing.gz", tmp_path / "x.gz")


# --------------------------------------------------------------------------- check


def harness_check(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), NO_COLOR="1")
    return subprocess.run([*HARNESS_DATA, "check", *args], capture_output=True, text=True, env=env, timeout=120)


def test_check_reports_present_missing_and_invalid(tmp_path: Path) -> None:
    (tmp_path / "math500").mkdir()
    (tmp_path / "math500" / "test.jsonl").write_bytes(jsonl(math500_rows(500)))
    (tmp_path / "notes").mkdir()
    everything = harness_check(str(tmp_path))
    out = " ".join(everything.stdout.split())
    assert everything.returncode == 0, everything.stdout + everything.stderr  # missing tasks are reported, not an error
    assert "math500 │ test │ ok │ 500" in out and "aime24 │ test │ missing" in out and "not read by any task: notes" in out
    assert "harness data fetch aime24" in out
    named = harness_check(str(tmp_path), "math500", "aime24")
    assert named.returncode == 1 and "1 ok, 1 missing, 0 invalid" in named.stdout  # asked for aime24, not there

    rows = math500_rows(500)
    rows[41] = {k: v for k, v in rows[41].items() if k != "problem"}
    (tmp_path / "math500" / "test.jsonl").write_bytes(jsonl(rows))
    invalid = harness_check(str(tmp_path))
    assert invalid.returncode == 1
    assert f"invalid: math500 [test]: DataError: {tmp_path}/math500/test.jsonl:42: field 'problem': missing" in invalid.stdout
    (tmp_path / "math500" / "test.jsonl").write_bytes(jsonl(math500_rows(20)))
    short = harness_check(str(tmp_path), "math500")
    assert short.returncode == 1 and "20 problems, expected 500" in short.stdout
    assert harness_check(str(tmp_path / "nowhere")).returncode == 2


def test_every_task_that_reads_files_declares_them() -> None:
    for name in ("math500", "aime24", "aime25", "amc23", "olympiadbench", "minerva", "gsm8k", "dapo_math",
                 "humaneval_plus", "mbpp_plus", "livecodebench"):  # fmt: skip
        needs = needs_of(name)
        assert needs and {n.split for n in needs} == set(TASKS.get(name).splits), name
        assert all(n.task == name and all(f.startswith(f"{name}/") for f in n.files) for n in needs)
    assert needs_of("arith") == ()


def test_hub_rows_in_the_local_layout_load_like_the_local_copies() -> None:
    """The converters of hub copies whose columns differ from the local files (AIME24, AMC23, Minerva, DAPO)."""
    from opd_harness.tasks.math.benchmarks import amc23_hub_to_local, minerva_hub_to_local, without_exact_repeats

    amc = list(amc23_hub_to_local([{"question": "Q", "answer": 27.0}, {"question": "R", "answer": -1.0, "id": 9}]))
    minerva = list(minerva_hub_to_local([{"question": "Q", "answer": "6 \\mathrm{~m}"}]))
    for task, rows in (("amc23", amc), ("minerva", minerva)):
        cls = TASKS.get(task)
        problems = cls().build_problems(enumerate(rows, start=1), cls.local_layout, "fetched")
        assert problems, task
    amc_problems = TASKS.get("amc23")().build_problems(enumerate(amc, start=1), TASKS.get("amc23").local_layout, "x")
    assert [(p.id, p.answer) for p in amc_problems] == [("0", "27"), ("9", "-1")]
    assert (
        TASKS.get("minerva")().build_problems(enumerate(minerva, 1), TASKS.get("minerva").local_layout, "x")[0].answer == "6 \\mathrm{~m}"
    )
    row = {"prompt": [{"role": "user", "content": "Q"}], "reward_model": {"ground_truth": "2"}, "extra_info": {"index": 1}}
    assert list(without_exact_repeats([row, dict(row), row | {"extra_info": {"index": 2}}])) == [row, row | {"extra_info": {"index": 2}}]
    with pytest.raises(DataError):  # a converted row is still validated by the loader
        TASKS.get("amc23")().build_problems(enumerate(amc23_hub_to_local([{"answer": 1}]), 1), TASKS.get("amc23").local_layout, "x")


# --------------------------------------------------------------------------- where tests read benchmark files


def run_data_test(data_dir: Path, require: bool) -> subprocess.CompletedProcess:
    """One test that reads benchmark files, in a pytest subprocess with the data folder set to ``data_dir``."""
    env = {k: v for k, v in os.environ.items() if k != "HARNESS_REQUIRE_DATA"} | {
        "HARNESS_DATA_DIR": str(data_dir),
        "PYTHONPATH": str(ROOT),
    }
    if require:
        env["HARNESS_REQUIRE_DATA"] = "1"
    test = "tests/test_code_tasks.py::test_load_real_files"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)  # fmt: skip


@pytest.mark.slow
def test_data_tests_skip_with_the_reason_or_fail_when_data_is_required(tmp_path: Path) -> None:
    skipped = run_data_test(tmp_path, require=False)
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout
    assert f"benchmark data missing in HARNESS_DATA_DIR={tmp_path}: humaneval_plus/HumanEvalPlus-v0.1.10.jsonl.gz" in skipped.stdout
    assert f"harness data fetch humaneval_plus mbpp_plus --to {tmp_path}" in skipped.stdout
    failed = run_data_test(tmp_path, require=True)
    assert failed.returncode == 1 and "1 failed" in failed.stdout and "HARNESS_REQUIRE_DATA=1 but benchmark data missing" in failed.stdout


def test_the_cli_has_the_data_commands() -> None:
    from typer.testing import CliRunner

    from opd_harness.cli import app

    result = CliRunner().invoke(app, ["data", "--help"])
    assert result.exit_code == 0 and "fetch" in result.output and "check" in result.output


def test_a_hub_fetch_without_datasets_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(
        DataFetchError, match=r"download from hf:HuggingFaceH4/MATH-500\[test\] failed: ImportError: .*opd-harness\[lmeval\]"
    ) as info:
        fetch_need(tmp_path, needs_of("math500")[0])
    assert info.value.status == "error" and list(tmp_path.iterdir()) == []


def test_a_skip_for_missing_data_names_harness_data_dir_and_the_fetch_command(tmp_path):
    from conftest import missing_data_reason

    unset = missing_data_reason(["math500/test.jsonl"], tmp_path / "shared" / "data", None)
    assert unset == (
        "benchmark data missing (HARNESS_DATA_DIR is not set): math500/test.jsonl; fetch with `harness data fetch math500 --to DIR`, "
        "then set HARNESS_DATA_DIR=DIR (the folder harness run/eval --data-dir DIR reads)"
    )
    assert "shared" not in unset
    given = missing_data_reason(["aime24/test.jsonl", "math500/test.jsonl"], tmp_path, str(tmp_path))
    assert given == (
        f"benchmark data missing in HARNESS_DATA_DIR={tmp_path}: aime24/test.jsonl, math500/test.jsonl; "
        f"fetch with `harness data fetch aime24 math500 --to {tmp_path}`"
    )
