"""Tests for opd_harness.metrics, with hand-computed expectations."""

from itertools import combinations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opd_harness.metrics import (
    PairedResult,
    avg_at_k,
    bootstrap_ci,
    maj_at_k,
    mean_pass_at_k,
    paired_bootstrap,
    pass_at_k,
    summarize,
)


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of k-subsets of n samples (first c correct) with at least one correct."""
    subsets = list(combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_1_is_fraction_correct():
    for n, c in [(1, 0), (1, 1), (10, 3), (16, 16), (64, 7)]:
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_hand_value():
    # n=4, c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)


def test_mean_pass_at_k():
    # problem 0: n=4,c=2,k=2 -> 5/6; problem 1: c=0 -> 0
    assert mean_pass_at_k([[1, 0, 1, 0], [0, 0, 0, 0]], 2) == pytest.approx(5 / 12)


def test_avg_at_k_uses_first_k_samples():
    scores = [[1, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0]]
    # first 2: means 0.5, 0.0, 1.0 -> 0.5
    assert avg_at_k(scores, 2) == pytest.approx(0.5)
    # all 4: 0.75, 0.5, 0.5 -> 7/12
    assert avg_at_k(scores, 4) == pytest.approx(7 / 12)


def test_maj_at_k_tie_and_none():
    answers = [
        ["7", "8", None, "8", "7"],  # first 4: 7 x1, 8 x2 -> "8" (sample 1)
        ["3", "4", "4", "3", "9"],  # tie 3 vs 4 -> "3" wins (seen first, sample 0)
        [None, None, None, None, "1"],  # no votes in first 4 -> 0
    ]
    correct = [
        [0, 1, 0, 1, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1],
    ]
    assert maj_at_k(answers, correct, 4) == pytest.approx(1 / 3)
    # With k=1 only the first answer counts: problem 0 -> "7" wrong, 1 -> "3" wrong.
    assert maj_at_k(answers, correct, 1) == 0.0


def test_bootstrap_ci_contains_mean_and_narrows():
    small = [1, 0] * 10
    large = [1, 0] * 500
    lo_s, hi_s = bootstrap_ci(small)
    lo_l, hi_l = bootstrap_ci(large)
    assert lo_s <= 0.5 <= hi_s
    assert lo_l <= 0.5 <= hi_l
    assert hi_l - lo_l < hi_s - lo_s


def test_bootstrap_ci_deterministic_and_edge_cases():
    vals = [0.1, 0.9, 0.4, 0.7, 0.3]
    assert bootstrap_ci(vals, seed=3) == bootstrap_ci(vals, seed=3)
    assert bootstrap_ci([0.42]) == (0.42, 0.42)
    assert bootstrap_ci([0.5] * 10) == (0.5, 0.5)


def test_paired_bootstrap_detects_clear_improvement():
    a = [0.0] * 40 + [1.0] * 10
    b = [1.0] * 45 + [0.0] * 5
    r = paired_bootstrap(a, b)
    assert isinstance(r, PairedResult)
    assert (r.mean_a, r.mean_b, r.n) == (0.2, 0.9, 50)
    assert r.delta == pytest.approx(0.7)
    assert 0 < r.ci_low <= r.delta <= r.ci_high
    assert r.p_value < 0.05
    assert paired_bootstrap(a, b, seed=1) == paired_bootstrap(a, b, seed=1)


def test_paired_bootstrap_null_on_identical_inputs():
    a = [0.0, 1.0, 0.5, 1.0, 0.0, 0.25]
    r = paired_bootstrap(a, a)
    assert r.delta == 0.0
    assert (r.ci_low, r.ci_high) == (0.0, 0.0)
    assert r.p_value == 1.0


def test_summarize():
    scores = [[1, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0]]
    s = summarize(scores, 2, n_resamples=2_000)
    assert (s.k, s.n_problems, s.n_samples) == (2, 3, 12)
    assert s.avg_at_k == pytest.approx(0.5)
    assert s.ci_low <= s.avg_at_k <= s.ci_high
    # pass@2 with n=4: c=3 -> 1, c=2 -> 5/6, c=2 -> 5/6
    assert s.pass_at_k == pytest.approx((1 + 5 / 6 + 5 / 6) / 3)
    assert s.to_dict()["avg_at_k"] == s.avg_at_k


@pytest.mark.parametrize(
    "call",
    [
        lambda: avg_at_k([], 1),
        lambda: avg_at_k([[1, 0], [1]], 2),
        lambda: pass_at_k(3, 1, 4),
        lambda: pass_at_k(3, 4, 1),
        lambda: pass_at_k(3, 1, 0),
        lambda: mean_pass_at_k([[1, 0.5]], 1),
        lambda: maj_at_k([["a"]], [[1], [0]], 1),
        lambda: maj_at_k([["a"]], [[1, 0]], 2),
        lambda: bootstrap_ci([]),
        lambda: bootstrap_ci([1, 0], confidence=1.0),
        lambda: paired_bootstrap([1, 0], [1]),
        lambda: summarize([[1]], 2),
    ],
)
def test_errors_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_error_names_problem_index():
    with pytest.raises(ValueError, match="problem 1"):
        avg_at_k([[1, 0], [1]], 2)


nck = st.integers(1, 40).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))
)


@given(nck)
def test_pass_at_k_in_unit_interval(t):
    n, c, k = t
    assert 0.0 <= pass_at_k(n, c, k) <= 1.0


@given(nck)
def test_pass_at_k_monotone_in_k_and_c(t):
    n, c, k = t
    p = pass_at_k(n, c, k)
    if k < n:
        assert pass_at_k(n, c, k + 1) >= p - 1e-12
    if c < n:
        assert pass_at_k(n, c + 1, k) >= p - 1e-12
