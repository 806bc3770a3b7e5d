"""Tests for opd_harness.tasks.math_grading (math-verify grader in a pebble process pool)."""

from __future__ import annotations

import os
import threading
import time
from typing import Iterator

import pytest

from opd_harness.tasks.math_grading import (
    GRADER_NAME,
    MathGrade,
    MathGrader,
    default_grader,
    extract_boxed,
    extract_last_number,
    grade_answer,
    grader_version,
)

# 9^(9^9) against 9^387420489: SymPy grinds on it for far longer than any timeout.
SLOW_COMPLETION = "so the answer is \\boxed{9^{9^{9}}}"
SLOW_GOLD = "9^{387420489}"


def _crash(completion: str, gold: str, *, fallbacks: tuple[str, ...] = ()) -> MathGrade:
    """Test hook: kill the worker process outright."""
    os._exit(3)


@pytest.fixture(scope="module")
def grader() -> Iterator[MathGrader]:
    """One pool shared by the pool tests (start-up is the slow part)."""
    with MathGrader(workers=2) as g:
        yield g


# --------------------------------------------------------------------------- extraction


def test_extract_boxed_nested() -> None:
    assert extract_boxed("so \\boxed{\\frac{1}{\\sqrt{2}}} done") == "\\frac{1}{\\sqrt{2}}"


def test_extract_boxed_takes_last() -> None:
    assert extract_boxed("\\boxed{1} then \\boxed{2}, finally \\boxed{ 3 }") == "3"


def test_extract_boxed_fbox_and_escaped_braces() -> None:
    assert extract_boxed("\\fbox{42}") == "42"
    assert extract_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"


def test_extract_boxed_missing_or_unbalanced() -> None:
    assert extract_boxed("the answer is 7") is None
    assert extract_boxed("\\boxed{1} and then \\boxed{\\frac{1}{2}") is None
    assert extract_boxed("") is None


def test_extract_last_number() -> None:
    assert extract_last_number("we get 3 apples, then 1,250.5 pears") == "1250.5"
    assert extract_last_number("x = -4") == "-4"
    assert extract_last_number("no digits") is None


# --------------------------------------------------------------------------- grade_answer


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("25", "025"),
        ("025", "25"),
        ("27", "27.0"),
        ("0.5", "\\frac{1}{2}"),
        ("\\frac12", "0.5"),
        ("1/\\sqrt2", "\\sqrt2/2"),
        ("\\frac{1}{\\sqrt{2}}", "$\\frac{\\sqrt{2}}{2}$"),
        ("1+x^2", "x^2+1"),
    ],
)
def test_grade_answer_pass(pred: str, gold: str) -> None:
    g = grade_answer(f"Work... so the answer is $\\boxed{{{pred}}}$.", gold)
    assert g.status == "pass", g
    assert g.extracted == pred


@pytest.mark.parametrize(("pred", "gold"), [("3", "4"), ("\\frac{1}{3}", "0.5"), ("1/0", "3")])
def test_grade_answer_fail(pred: str, gold: str) -> None:
    g = grade_answer(f"\\boxed{{{pred}}}", gold)
    assert g.status == "fail", g


def test_no_boxed_is_fail_not_error() -> None:
    g = grade_answer("I think it is 25.", "25")
    assert g == MathGrade("fail", None, g.detail)
    assert "no answer found" in g.detail


def test_last_number_fallback() -> None:
    g = grade_answer("I think it is 25.", "25", fallbacks=("boxed", "last_number"))
    assert (g.status, g.extracted) == ("pass", "25")


def test_bad_gold_or_fallback_is_error() -> None:
    assert grade_answer("\\boxed{1}", "").status == "error"
    g = grade_answer("\\boxed{1}", "1", fallbacks=("nonsense",))
    assert g.status == "error" and "unknown fallback" in g.detail


def test_internal_math_verify_timeout_is_error() -> None:
    t0 = time.monotonic()
    g = grade_answer(SLOW_COMPLETION, SLOW_GOLD, mv_timeout_s=1)
    assert g.status == "error" and "timeout" in g.detail, g
    assert time.monotonic() - t0 < 5


def test_grade_answer_in_thread() -> None:
    out: list[MathGrade] = []
    t = threading.Thread(target=lambda: out.append(grade_answer("\\boxed{0.5}", "\\frac{1}{2}")))
    t.start()
    t.join(30)
    assert out and out[0].status == "pass", out


# --------------------------------------------------------------------------- MathGrader


def test_grader_metadata() -> None:
    assert GRADER_NAME == "math-verify"
    assert grader_version().startswith("math-verify==")
    assert default_grader() is default_grader()


def test_grade_many_order_preserved(grader: MathGrader) -> None:
    items: list[tuple[str, str]] = []
    expected: list[tuple[str, str | None]] = []
    for i in range(50):
        if i % 3 == 0:
            items.append((f"answer \\boxed{{{i}}}", f"{i}.0"))
            expected.append(("pass", str(i)))
        elif i % 3 == 1:
            items.append((f"answer \\boxed{{{i + 1}}}", str(i)))
            expected.append(("fail", str(i + 1)))
        else:
            items.append((f"answer is {i}", str(i)))
            expected.append(("fail", None))
    got = grader.grade_many(items)
    assert [(g.status, g.extracted) for g in got] == expected


def test_timeout_is_error_and_pool_survives(grader: MathGrader) -> None:
    t0 = time.monotonic()
    got = grader.grade_many([(SLOW_COMPLETION, SLOW_GOLD), ("\\boxed{2}", "2")], timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert got[0] == MathGrade("error", "9^{9^{9}}", "timeout after 1s")
    assert got[1].status == "pass"
    assert elapsed < 15, elapsed  # the slow item alone would run for hours; under load a pool restart took 3.2 s of it
    again = grader.grade_many([("\\boxed{3}", "3"), ("\\boxed{4}", "3")])
    assert [g.status for g in again] == ["pass", "fail"]


def test_crashed_worker_is_error_and_pool_survives(grader: MathGrader) -> None:
    got = grader.grade_many([("\\boxed{5}", "5")], _fn=_crash)
    assert got[0].status == "error" and "crashed" in got[0].detail, got
    assert got[0].extracted == "5"
    assert grader.grade_many([("\\boxed{5}", "5")])[0].status == "pass"


def test_grade_many_from_non_main_thread() -> None:
    out: list[list[MathGrade]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with MathGrader(workers=1) as g:  # pool created and used off the main thread
                out.append(g.grade_many([("\\boxed{\\frac12}", "0.5"), ("\\boxed{1}", "2")]))
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive() and not errors, errors
    assert [g.status for g in out[0]] == ["pass", "fail"]


def test_close_and_reuse() -> None:
    g = MathGrader(workers=1)
    assert g.grade_many([]) == []
    assert g.grade_many([("\\boxed{1}", "1")])[0].status == "pass"
    g.close()
    g.close()  # idempotent
    assert g.grade_many([("\\boxed{1}", "1")])[0].status == "pass"  # lazily restarted
    g.close()
