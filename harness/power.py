"""What a design can resolve: the smallest effect a paired comparison over seeds detects, and the seeds an effect needs.

Two tests decide claims in :mod:`opd_harness.reproduce`, and each gets its power calculation here:

- the one-sided **paired t-test** over seeds (final Avg@k: each seed's Avg@k difference is one observation, so the
  test counts the spread between training runs as well as the evaluation's noise). A design with S paired seeds whose
  per-seed paired difference has standard deviation sd detects, at level alpha with the given power, the effect
  whose noncentral t power (S - 1 degrees of freedom, noncentrality effect / sd * sqrt(S)) reaches it: exact under
  normal differences, and at S = 5 about 22 % larger than the normal approximation ``(z(1 - alpha) + z(power)) * sd /
  sqrt(S)``. Below two seeds nothing is detectable;
- the **exact sign test** over seeds (throughput, step metrics, evaluation measurements): with per-seed differences
  normal with mean delta and standard deviation sd, a seed is "above" with probability q = Phi(delta / sd); the
  design detects delta when P(Bin(S, q) >= c) >= power, c the smallest count with an exact one-sided p below alpha.
  Below ``ceil(log2(1 / alpha))`` seeds no count reaches alpha and nothing is detectable.

The per-seed sd is an assumption the caller states (a measured prior), floored by the evaluation's own sampling
noise: two arms each scored on n problems x k samples at a pass rate near p differ by at least
``sqrt((p(1 - p) + p'(1 - p')) / (n k))`` from sampling alone (problems of equal difficulty, independent samples:
:func:`binomial_floor`).
"""

from __future__ import annotations

import math
from statistics import NormalDist

from scipy import optimize, stats

from opd_harness.gate import mcnemar_exact_p

_N = NormalDist()
EXACT_SIGN_TEST_MAX = 200  # seeds up to which the sign test's power is computed exactly (normal approximation above)


def z(q: float) -> float:
    """The standard normal quantile."""
    return _N.inv_cdf(q)


def binomial_floor(p: float, delta: float, n_problems: int, k: int) -> float:
    """SD of one seed's paired delta from evaluation sampling alone: arms at p and p + delta, n_problems x k samples."""
    q = min(max(p + delta, 0.0), 1.0)
    p = min(max(p, 0.0), 1.0)
    return math.sqrt((p * (1 - p) + q * (1 - q)) / (n_problems * k))


def t_test_power(effect_over_sd: float, seeds: int, alpha: float) -> float:
    """P(the one-sided paired t-test over ``seeds`` seeds rejects at ``alpha``) when the per-seed differences are normal
    with mean ``effect_over_sd`` standard deviations: the noncentral t distribution's tail above the critical value."""
    if seeds < 2:
        return 0.0  # one difference has no spread to test against
    df = seeds - 1
    return float(stats.nct.sf(stats.t.ppf(1 - alpha, df), df, effect_over_sd * math.sqrt(seeds)))


def mde_paired_mean(sd: float, seeds: int, alpha: float, power: float) -> float:
    """Smallest mean paired difference the one-sided paired t-test over ``seeds`` seeds detects at ``alpha`` with ``power``
    (exact under normal per-seed differences of standard deviation ``sd``; inf below two seeds)."""
    if seeds < 2:
        return math.inf
    if sd == 0:
        return 0.0
    return sd * optimize.brentq(lambda x: t_test_power(x, seeds, alpha) - power, 0.0, 1e4)


def seeds_paired_mean(sd: float, effect: float, alpha: float, power: float) -> int | None:
    """Seeds the paired t-test needs to detect ``effect``: the first count reaching ``power``, searched up from the normal
    approximation ``((z(1 - alpha) + z(power)) * sd / effect) ** 2`` (None when the effect is not positive)."""
    if effect <= 0:
        return None
    seeds = max(2, math.ceil(((z(1 - alpha) + z(power)) * sd / effect) ** 2))
    while t_test_power(effect / sd if sd > 0 else math.inf, seeds, alpha) < power:
        seeds += 1
    return seeds


def sign_test_critical(seeds: int, alpha: float) -> int | None:
    """The smallest number of seeds above the threshold whose exact one-sided p is below ``alpha`` (None: none is)."""
    for c in range(seeds + 1):
        if mcnemar_exact_p(c, seeds - c) < alpha:
            return c
    return None


def sign_test_power(seeds: int, q: float, alpha: float) -> float:
    """P(the exact sign test rejects at ``alpha``) when each seed is above the threshold with probability ``q``."""
    c = sign_test_critical(seeds, alpha)
    if c is None:
        return 0.0
    return math.fsum(math.comb(seeds, i) * q**i * (1 - q) ** (seeds - i) for i in range(c, seeds + 1))


def mde_sign_test(sd: float, seeds: int, alpha: float, power: float) -> float:
    """Smallest mean per-seed difference (normal, standard deviation ``sd``) the exact sign test detects with ``power``."""
    if sign_test_critical(seeds, alpha) is None:
        return math.inf
    low, high = 0.5, 1.0 - 1e-12
    if sign_test_power(seeds, high, alpha) < power:
        return math.inf
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if sign_test_power(seeds, mid, alpha) < power else (low, mid)
    return sd * z(high)


def seeds_sign_test(sd: float, effect: float, alpha: float, power: float) -> int | None:
    """Seeds the exact sign test needs to detect ``effect`` (the first count that reaches ``power``; None if not positive)."""
    if effect <= 0:
        return None
    q = _N.cdf(effect / sd) if sd > 0 else 1.0
    for seeds in range(1, EXACT_SIGN_TEST_MAX + 1):
        if sign_test_power(seeds, q, alpha) >= power:
            return seeds
    if q >= 1.0:
        return None
    # normal approximation of the binomial test of q against 1/2
    return math.ceil(((z(1 - alpha) * 0.5 + z(power) * math.sqrt(q * (1 - q))) / (q - 0.5)) ** 2)
