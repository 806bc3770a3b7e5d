"""Scoring metrics for benchmark runs: avg@k, pass@k, maj@k and bootstrap intervals.

Scores are given per problem as lists of per-sample values. A sample's status is
tri-state (pass / fail / error); these functions take float 0/1 scores only, so the
caller must drop (or otherwise resolve) errored samples before calling them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# Upper bound on elements in one resample index matrix (chunk rows x problems).
_MAX_CHUNK_ELEMS = 4_000_000


def _first_k(scores_per_problem: Sequence[Sequence[float]], k: int) -> np.ndarray:
    """Return a (problems, k) array of the first k samples; validates k and sample counts."""
    if len(scores_per_problem) == 0:
        raise ValueError("no problems given")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    for i, s in enumerate(scores_per_problem):
        if len(s) < k:
            raise ValueError(f"problem {i} has {len(s)} samples, fewer than k={k}")
    return np.asarray([list(s[:k]) for s in scores_per_problem], dtype=float)


def per_problem_avg_at_k(scores_per_problem: Sequence[Sequence[float]], k: int) -> np.ndarray:
    """Mean of the first k samples of each problem; the unit that bootstraps resample."""
    return _first_k(scores_per_problem, k).mean(axis=1)


def avg_at_k(scores_per_problem: Sequence[Sequence[float]], k: int) -> float:
    """Mean over the first k samples of each problem, then mean over problems.

    Raises ValueError on empty input or when a problem has fewer than k samples.
    """
    return float(per_problem_avg_at_k(scores_per_problem, k).mean())


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate 1 - C(n-c,k)/C(n,k) from n samples with c correct.

    Uses the numerically stable product form of Chen et al. (2021).
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(scores_per_problem: Sequence[Sequence[float]], k: int) -> float:
    """Mean over problems of unbiased pass@k, using all n samples of each problem."""
    if len(scores_per_problem) == 0:
        raise ValueError("no problems given")
    vals = []
    for i, s in enumerate(scores_per_problem):
        arr = np.asarray(s, dtype=float)
        if not np.all((arr == 0) | (arr == 1)):
            raise ValueError(f"problem {i} has non-binary scores")
        if len(arr) < k:
            raise ValueError(f"problem {i} has {len(arr)} samples, fewer than k={k}")
        vals.append(pass_at_k(len(arr), int(arr.sum()), k))
    return float(np.mean(vals))


def maj_at_k(
    answers_per_problem: Sequence[Sequence[str | None]],
    correct_per_problem: Sequence[Sequence[float]],
    k: int,
) -> float:
    """Majority-vote accuracy over the first k extracted answers of each problem.

    None answers are ignored; ties go to the answer seen first. A problem scores the
    correctness of the first sample carrying the majority answer (0 if all are None).
    """
    if len(answers_per_problem) != len(correct_per_problem):
        raise ValueError("answers and correctness cover different numbers of problems")
    correct = _first_k(correct_per_problem, k)
    total = 0.0
    for i, answers in enumerate(answers_per_problem):
        if len(answers) < k:
            raise ValueError(f"problem {i} has {len(answers)} answers, fewer than k={k}")
        votes = Counter(a for a in answers[:k] if a is not None)
        if not votes:
            continue
        # Counter preserves insertion order, and max() keeps the first maximal item.
        winner = max(votes, key=lambda a: votes[a])
        total += correct[i, list(answers[:k]).index(winner)]
    return float(total / len(answers_per_problem))


def resampled_means(values: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """Means of n_resamples bootstrap resamples of values, built in bounded-memory chunks."""
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    rng = np.random.default_rng(seed)
    n = len(values)
    chunk = max(1, _MAX_CHUNK_ELEMS // n)
    out = np.empty(n_resamples)
    for start in range(0, n_resamples, chunk):
        stop = min(start + chunk, n_resamples)
        idx = rng.integers(0, n, size=(stop - start, n))
        out[start:stop] = values[idx].mean(axis=1)
    return out


def _check_confidence(confidence: float) -> float:
    """Validate a confidence level and return the lower tail probability alpha/2."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return (1.0 - confidence) / 2.0


def bootstrap_ci(
    per_problem_values: Sequence[float],
    n_resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean, resampling problems with replacement."""
    vals = np.asarray(per_problem_values, dtype=float)
    if vals.size == 0:
        raise ValueError("no problems given")
    tail = _check_confidence(confidence)
    if vals.size == 1:
        return float(vals[0]), float(vals[0])
    lo, hi = np.quantile(resampled_means(vals, n_resamples, seed), [tail, 1.0 - tail])
    return float(lo), float(hi)


@dataclass(frozen=True)
class PairedResult:
    """Paired bootstrap comparison of system B against system A on the same problems."""

    mean_a: float
    mean_b: float
    delta: float  # mean_b - mean_a
    ci_low: float
    ci_high: float
    p_value: float  # min(1, 2 * min(P(delta* <= 0), P(delta* >= 0)))
    n: int


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    n_resamples: int = 10_000,
    seed: int = 0,
    confidence: float = 0.95,
) -> PairedResult:
    """Paired bootstrap over problems of delta = mean(b) - mean(a), as in the AP-OPD paper.

    a and b hold per-problem values for the same problems in the same order; both are
    resampled with the same indices. p_value is two-sided: 2 * min(P(delta* <= 0),
    P(delta* >= 0)) over resampled deltas, capped at 1.
    """
    va, vb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if va.shape != vb.shape:
        raise ValueError(f"length mismatch: {va.size} vs {vb.size} problems")
    if va.size == 0:
        raise ValueError("no problems given")
    tail = _check_confidence(confidence)
    diffs = vb - va
    deltas = resampled_means(diffs, n_resamples, seed)
    lo, hi = np.quantile(deltas, [tail, 1.0 - tail])
    p = min(1.0, 2.0 * min(np.mean(deltas <= 0), np.mean(deltas >= 0)))
    return PairedResult(
        mean_a=float(va.mean()),
        mean_b=float(vb.mean()),
        delta=float(diffs.mean()),
        ci_low=float(lo),
        ci_high=float(hi),
        p_value=float(p),
        n=int(va.size),
    )


@dataclass(frozen=True)
class Summary:
    """Headline numbers for one run at a given k."""

    k: int
    n_problems: int
    n_samples: int  # total scored samples across all problems
    avg_at_k: float
    ci_low: float
    ci_high: float
    pass_at_k: float  # mean unbiased pass@k over all samples

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON reports."""
        return asdict(self)


def summarize(
    scores_per_problem: Sequence[Sequence[float]],
    k: int,
    n_resamples: int = 10_000,
    seed: int = 0,
) -> Summary:
    """avg@k with a bootstrap CI over problems, plus mean unbiased pass@k."""
    per_problem = per_problem_avg_at_k(scores_per_problem, k)
    lo, hi = bootstrap_ci(per_problem, n_resamples=n_resamples, seed=seed)
    return Summary(
        k=k,
        n_problems=len(scores_per_problem),
        n_samples=sum(len(s) for s in scores_per_problem),
        avg_at_k=float(per_problem.mean()),
        ci_low=lo,
        ci_high=hi,
        pass_at_k=mean_pass_at_k(scores_per_problem, k),
    )
