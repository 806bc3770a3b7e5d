"""f-OPD and its asynchronous baselines (docs/methods/f-opd.md) on hand-computed tensors and properties."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opd_harness.registry import METHODS
from batches import make_batch
from opd_harness.trajectory import TensorBatch
from opd_harness.method import StudentOutputs
from opd_harness.trainers.objectives.f_opd import (
    ClippedIWParams,
    FOPDParams,
    HardRefreshParams,
    AsyncOPDParams,
    LagOnlyParams,
    OPDKLParams,
    RefreshMonitor,
    async_opd_loss,
    async_stats,
    f_opd_objective,
    f_opd_terms,
    freshness,
    freshness_weights,
    lag_only_freshness,
    opd_async_objective,
    opd_clipped_iw_objective,
    opd_clipped_iw_terms,
    opd_hard_refresh_objective,
    opd_kl_objective,
    opd_kl_terms,
    opd_lag_only_objective,
    opd_lag_only_terms,
    plain_terms,
    refresh_due,
    rollout_drift,
    supervision_drift,
    trusted_tokens,
)

NAMES = ("f_opd", "opd_async", "opd_kl", "opd_clipped_iw", "opd_lag_only", "opd_hard_refresh")
OBJECTIVES = {
    "f_opd": (f_opd_objective, FOPDParams()),
    "opd_async": (opd_async_objective, AsyncOPDParams()),
    "opd_kl": (opd_kl_objective, OPDKLParams()),
    "opd_clipped_iw": (opd_clipped_iw_objective, ClippedIWParams()),
    "opd_lag_only": (opd_lag_only_objective, LagOnlyParams()),
    "opd_hard_refresh": (opd_hard_refresh_objective, HardRefreshParams()),
}


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------------------------------------
# §5.9 worked example

EXAMPLE = [  # (τ, D_roll, D_sup) → f, σ(f − 0.5), lag-only f, lag-only σ
    ((0, 0.00, 0.00), 1.0000, 0.6225, 1.0000, 0.6225),
    ((1, 0.05, 0.02), 0.4709, 0.4927, 0.5000, 0.5000),
    ((2, 0.20, 0.10), 0.2596, 0.4402, 0.3333, 0.4584),
    ((4, 0.60, 0.30), 0.0945, 0.4000, 0.2000, 0.4256),
]


def _example_inputs():
    lag = torch.tensor([row[0][0] for row in EXAMPLE])
    d_roll = torch.tensor([row[0][1] for row in EXAMPLE], dtype=torch.float64)
    d_sup = torch.tensor([row[0][2] for row in EXAMPLE], dtype=torch.float64)
    return lag, d_roll, d_sup


def test_worked_example_table():
    lag, d_roll, d_sup = _example_inputs()
    f = freshness(lag, d_roll, d_sup, alpha=1.0, beta=0.5)
    w = freshness_weights(f, xi=0.5)
    f_lag = lag_only_freshness(lag)
    w_lag = freshness_weights(f_lag, xi=0.5)
    for i, (_, f_exp, w_exp, f_lag_exp, w_lag_exp) in enumerate(EXAMPLE):
        assert f[i].item() == pytest.approx(f_exp, abs=1e-4)
        assert w[i].item() == pytest.approx(w_exp, abs=1e-4)
        assert f_lag[i].item() == pytest.approx(f_lag_exp, abs=1e-4)
        assert w_lag[i].item() == pytest.approx(w_lag_exp, abs=1e-4)
    assert f.mean().item() == pytest.approx(0.4562, abs=1e-4)
    assert not refresh_due(f.mean().item(), kappa_f=0.10)  # f̄ ≥ κ_f → no refresh
    monitor = RefreshMonitor(kappa_f=0.10)
    assert monitor.observe(f.mean().item()) is False and monitor.refreshes == 0


def test_worked_example_matches_formula_exactly():
    lag, d_roll, d_sup = _example_inputs()
    f = freshness(lag, d_roll, d_sup, alpha=1.0, beta=0.5)
    for i, ((tau, dr, ds), *_) in enumerate(EXAMPLE):
        expected = math.exp(-(1.0 * dr + 0.5 * ds)) / (tau + 1)
        assert f[i].item() == pytest.approx(expected, abs=1e-6)
        assert freshness_weights(f, 0.5)[i].item() == pytest.approx(sigmoid(expected - 0.5), abs=1e-6)
    assert f.mean().item() == pytest.approx(sum(math.exp(-(dr + 0.5 * ds)) / (t + 1) for (t, dr, ds), *_ in EXAMPLE) / 4, abs=1e-6)


@pytest.mark.parametrize("form", ["exp", "reciprocal", "product"])
def test_zero_drift_coefficients_reduce_to_lag_only(form):
    lag, d_roll, d_sup = _example_inputs()
    f = freshness(lag, d_roll, d_sup, alpha=0.0, beta=0.0, form=form)
    assert torch.allclose(f, 1.0 / (lag.double() + 1.0), atol=1e-6)
    assert torch.allclose(f, lag_only_freshness(lag).double(), atol=1e-6)


def test_alternative_forms_by_hand():
    f_rec = freshness(torch.tensor([2]), torch.tensor([0.2]), torch.tensor([0.4]), 1.0, 0.5, form="reciprocal")
    f_prod = freshness(torch.tensor([2]), torch.tensor([0.2]), torch.tensor([0.4]), 1.0, 0.5, form="product")
    assert f_rec.item() == pytest.approx(1 / (1 + 2 + 0.2 + 0.2), abs=1e-6)
    assert f_prod.item() == pytest.approx(1 / (3 * 1.4), abs=1e-6)
    with pytest.raises(ValueError, match="unknown freshness form"):
        freshness(torch.tensor([0]), torch.tensor([0.0]), torch.tensor([0.0]), form="linear")  # type: ignore[arg-type]


def test_negative_lag_is_an_error():
    with pytest.raises(ValueError, match="lag"):
        freshness(torch.tensor([-1]), torch.tensor([0.0]), torch.tensor([0.0]))
    batch = make_batch([[1]], [[-1.0]], [[-1.0]], lag=[-2])
    with pytest.raises(ValueError, match="lag"):
        f_opd_objective(batch, StudentOutputs(torch.tensor([[-1.0]])), FOPDParams())


def test_objective_with_zero_drift_coefficients_equals_lag_only_objective():
    batch = make_batch(
        [[1, 1, 0], [1, 1, 1]],
        [[-1.0, -0.2, 0.0], [-0.5, -2.0, -1.0]],
        [[-0.4, -0.9, 0.0], [-1.5, -0.1, -0.3]],
        lag=[0, 3],
        dtype=torch.float64,
    )
    values = torch.tensor([[-1.3, -0.4, 0.0], [-0.2, -2.5, -0.1]], dtype=torch.float64)
    results = []
    no_drift = FOPDParams(alpha=0.0, beta=0.0, anchor_coef=0.0, kappa_roll=100.0)  # and U^roll = all tokens
    for objective, hp in ((f_opd_objective, no_drift), (opd_lag_only_objective, LagOnlyParams())):
        s = values.clone().requires_grad_(True)
        loss, diag = objective(batch, StudentOutputs(s), hp)
        loss.backward()
        results.append((loss.item(), s.grad.clone(), diag["freshness_mean"]))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-12)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-12)
    assert results[0][2] == pytest.approx((1 + 1 / 4) / 2, abs=1e-12)


# ---------------------------------------------------------------------------------------------
# Drift estimators and token sets


def test_rollout_drift_by_hand():
    s = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    q = torch.tensor([[-1.5, -2.0, -3.0], [-9.0, -9.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    d = rollout_drift(s, q, mask)
    first = math.exp(0.5) * 0.5 - math.exp(0.5) + 1.0  # λ = 0.5; second token λ = 0 → 0
    assert d.tolist() == pytest.approx([first / 2, 0.0], abs=1e-6)


def test_rollout_drift_is_unbiased_kl_under_behaviour_samples():
    # behaviour q = (1/2, 1/4, 1/4): four equally weighted "samples" v0, v0, v1, v2 realise E_q exactly
    q_probs, p_probs = [0.5, 0.25, 0.25], [0.25, 0.25, 0.5]
    samples = [0, 0, 1, 2]
    q = torch.tensor([[math.log(q_probs[v]) for v in samples]], dtype=torch.float64)
    s = torch.tensor([[math.log(p_probs[v]) for v in samples]], dtype=torch.float64)
    kl = sum(p * math.log(p / qq) for p, qq in zip(p_probs, q_probs))
    assert rollout_drift(s, q, torch.ones_like(q)).item() == pytest.approx(kl, abs=1e-12)


def test_supervision_drift_is_k3_by_hand():
    stale = torch.tensor([[-1.0, -0.7, -5.0]])
    fresh = torch.tensor([[-1.2, -0.7, -0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    mu = 0.2  # T^stale − T^fresh on the first token
    assert supervision_drift(stale, fresh, mask).item() == pytest.approx((math.exp(mu) - mu - 1.0) / 2, abs=1e-6)
    assert supervision_drift(stale, None, mask).tolist() == [0.0]  # skipped ⇒ 0


def test_trusted_tokens_at_threshold():
    s = torch.tensor([[-1.0, -2.0, -1.0, -1.0, -3.0]])
    q = torch.tensor([[-1.5, -1.5, -1.75, -0.25, -3.0]])  # |s − q| = 0.5, 0.5, 0.75, 0.75, 0
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    assert trusted_tokens(s, q, mask, 0.5).tolist() == [[1.0, 1.0, 0.0, 0.0, 0.0]]  # ≤ κ inclusive; masked never trusted
    assert trusted_tokens(None, q, mask, 0.5).tolist() == mask.tolist()  # no fresh teacher ⇒ U^sup = valid tokens


# ---------------------------------------------------------------------------------------------
# The f-OPD objective against a plain-Python reference

MASK = [[1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 0, 0]]
S = [[-1.0, -0.6, -2.0, -7.0], [-3.0, -0.3, -1.1, -2.2], [-0.9, -1.4, -4.0, -4.0]]
Q = [[-1.1, -0.5, -2.2, -1.0], [-1.0, -1.1, -1.0, -2.0], [-1.0, -1.2, -1.0, -1.0]]
STALE = [[-0.5, -0.9, -1.0, -3.0], [-2.0, -0.2, -1.5, -0.4], [-0.3, -2.0, -1.0, -1.0]]
FRESH = [[-0.6, -0.9, -1.2, 0.0], [-9.0, -0.25, -2.2, -0.5], [-1.3, -0.8, -1.0, -1.0]]
LAG = [0, 2, 1]


def reference_f_opd(alpha=1.0, beta=0.5, xi=0.5, lam=0.1, kappa=0.5):
    """Loss, gradient and per-sample f of f-OPD, written out token by token."""
    per_sample, f_all, grads = [], [], [[0.0] * 4 for _ in MASK]
    for i, row in enumerate(MASK):
        valid = [t for t, m in enumerate(row) if m]
        lam_t = {t: S[i][t] - Q[i][t] for t in valid}
        d_roll = sum(math.exp(x) * x - math.exp(x) + 1 for x in lam_t.values()) / len(valid)
        mu = {t: STALE[i][t] - FRESH[i][t] for t in valid}
        d_sup = sum(math.exp(x) - x - 1 for x in mu.values()) / len(valid)
        f = math.exp(-(alpha * d_roll + beta * d_sup)) / (LAG[i] + 1)
        f_all.append(f)
        u_roll = [t for t in valid if abs(lam_t[t]) <= kappa]
        u_sup = [t for t in valid if abs(mu[t]) <= kappa]
        if not u_sup:
            continue
        w = sigmoid(f - xi)
        l_i = sum((S[i][t] - FRESH[i][t]) * S[i][t] for t in u_sup) / len(u_sup)
        r_i = sum(math.exp(Q[i][t] - S[i][t]) - (Q[i][t] - S[i][t]) - 1 for t in u_roll) / max(len(u_roll), 1)
        per_sample.append((i, w, l_i + lam * r_i, u_sup, u_roll))
    n = len(per_sample)
    for i, w, _, u_sup, u_roll in per_sample:
        for t in u_sup:
            grads[i][t] += w * (S[i][t] - FRESH[i][t]) / len(u_sup) / n
        for t in u_roll:
            grads[i][t] += w * lam * (1 - math.exp(Q[i][t] - S[i][t])) / len(u_roll) / n
    loss = sum(w * v for _, w, v, _, _ in per_sample) / n
    return loss, grads, f_all


def test_f_opd_objective_matches_reference():
    batch = make_batch(MASK, Q, STALE, fresh=FRESH, lag=LAG, dtype=torch.float64)
    s = torch.tensor(S, dtype=torch.float64, requires_grad=True)
    loss, diag = f_opd_objective(batch, StudentOutputs(s), FOPDParams())
    loss.backward()
    ref_loss, ref_grads, ref_f = reference_f_opd()
    assert loss.item() == pytest.approx(ref_loss, abs=1e-6)
    assert s.grad.tolist() == [pytest.approx(row, abs=1e-6) for row in ref_grads]
    assert diag["freshness_mean"] == pytest.approx(sum(ref_f) / 3, abs=1e-6)
    assert diag["weight_mean"] == pytest.approx(sum(sigmoid(f - 0.5) for f in ref_f) / 3, abs=1e-6)
    assert diag["excluded_samples"] == 1.0  # sample 2: |T^fresh − T^stale| = 1.0, 1.2 ⇒ empty U^sup
    # U^roll: sample 0 all 3, sample 1 {t2, t3} of 3 (|s − q| = 0.8 at t1), sample 2 both
    assert diag["trusted_roll_frac"] == pytest.approx((1 + 2 / 3 + 1) / 3, abs=1e-6)
    # U^sup (|T^stale − T^fresh| ≤ 0.5): sample 0 all 3, sample 1 {t1, t3} (0.7 at t2), sample 2 none
    assert diag["trusted_sup_frac"] == pytest.approx((1 + 2 / 3 + 0) / 3, abs=1e-6)
    assert diag["lag_mean"] == pytest.approx(1.0) and diag["lag_max"] == 2.0
    assert diag["refresh_signal"] == 0.0 and set(diag) >= {"d_roll_mean", "d_sup_mean", "anchor", "teacher_kl", "tokens"}


def test_f_opd_options_batch_mean_xi_and_renormalise():
    batch = make_batch(MASK, Q, STALE, fresh=FRESH, lag=LAG, dtype=torch.float64)
    stats = async_stats(batch, torch.tensor(S, dtype=torch.float64))
    _, _, ref_f = reference_f_opd()
    terms, f = f_opd_terms(stats, FOPDParams(xi="batch_mean"))
    f_bar = sum(ref_f) / 3
    assert terms.weights.tolist() == pytest.approx([sigmoid(x - f_bar) for x in ref_f], abs=1e-6)
    terms, _ = f_opd_terms(stats, FOPDParams(renormalise=True))
    assert terms.weights[terms.selected].mean().item() == pytest.approx(1.0, abs=1e-12)


def test_sync_case_is_plain_per_token_loss_times_sigmoid():
    # lag None, fresh None, s = q (behaviour = current): f = 1, anchor 0 with zero gradient, U^sup = all
    q = [[-1.0, -0.6, -2.0, -7.0], [-3.0, -0.3, -1.1, -2.2]]
    t = [[-0.4, -1.0, -1.5, -0.2], [-2.0, -0.6, -0.8, -0.1]]
    mask = [[1, 1, 1, 0], [0, 1, 1, 1]]
    batch = make_batch(mask, q, t, dtype=torch.float64)
    s = torch.tensor(q, dtype=torch.float64, requires_grad=True)
    loss, diag = f_opd_objective(batch, StudentOutputs(s), FOPDParams())
    loss.backward()
    m = torch.tensor(mask, dtype=torch.float64)
    tt = torch.tensor(t, dtype=torch.float64)
    s2 = torch.tensor(q, dtype=torch.float64, requires_grad=True)
    plain = (((s2 - tt).detach() * s2 * m).sum(-1) / m.sum(-1)).mean()  # mean_i mean_t sg(s − T)·s
    (sigmoid(1.0 - 0.5) * plain).backward()
    assert loss.item() == pytest.approx(sigmoid(0.5) * plain.item(), abs=1e-9)
    assert torch.allclose(s.grad, s2.grad, atol=1e-9)  # s2.grad already carries the σ(0.5) factor
    assert diag["freshness_mean"] == 1.0 and diag["d_sup_mean"] == 0.0 and diag["lag_max"] == 0.0


# ---------------------------------------------------------------------------------------------
# Baselines


def test_opd_kl_anchor_on_all_tokens_without_weights():
    batch = make_batch([[1, 1]], [[-1.0, -1.0]], [[-0.5, -2.0]], lag=[5])
    s = torch.tensor([[-0.2, -1.9]], requires_grad=True)  # |s − q| = 0.8, 0.9: f-OPD would trust neither
    loss, diag = opd_kl_objective(batch, StudentOutputs(s), OPDKLParams(anchor_coef=0.1))
    kl = ((-0.2 + 0.5) * -0.2 + (-1.9 + 2.0) * -1.9) / 2
    r = sum(math.exp(x) - x - 1 for x in (-1.0 + 0.2, -1.0 + 1.9)) / 2
    assert loss.item() == pytest.approx(kl + 0.1 * r, abs=1e-6)
    assert diag["anchor"] == pytest.approx(r, abs=1e-6) and diag["weight_mean"] == 1.0


def test_opd_async_is_the_bare_loss_on_a_hand_batch():
    # the paper's "Async OPD": mean_i mean_t sg(s − T)·s over all valid tokens, lag and drift ignored
    batch = make_batch(
        [[1, 1, 0], [0, 1, 1]], [[-1.0, -1.0, -1.0], [-0.5, -0.5, -3.0]], [[-0.5, -2.0, -0.1], [-1.0, -0.2, -1.0]], lag=[0, 7]
    )
    s = torch.tensor([[-0.2, -1.9, -4.0], [-0.3, -0.6, -2.0]], requires_grad=True)  # |s − q| > κ: f-OPD would filter
    loss, diag = opd_async_objective(batch, StudentOutputs(s), AsyncOPDParams())
    loss.backward()
    l0 = ((-0.2 + 0.5) * -0.2 + (-1.9 + 2.0) * -1.9) / 2
    l1 = ((-0.6 + 0.2) * -0.6 + (-2.0 + 1.0) * -2.0) / 2
    assert loss.item() == pytest.approx((l0 + l1) / 2, abs=1e-6)
    expected_grad = [[(-0.2 + 0.5) / 4, (-1.9 + 2.0) / 4, 0.0], [0.0, (-0.6 + 0.2) / 4, (-2.0 + 1.0) / 4]]
    assert s.grad.tolist() == [pytest.approx(row, abs=1e-6) for row in expected_grad]
    assert diag["weight_mean"] == 1.0 and diag["excluded_samples"] == 0.0  # "anchor" is still logged (KL to q), with λ = 0


@pytest.mark.parametrize("estimator", ["sampled", "full"])
def test_opd_async_equals_the_other_baselines_with_their_extras_off(estimator):
    # opd_kl with λ = 0 and opd_lag_only at one common lag with renormalised weights (all 1) are the same loss
    batch, student, _, _ = _full_case([3, 3, 3])
    loss, _ = opd_async_objective(batch, student, AsyncOPDParams(estimator=estimator))
    grad = torch.autograd.grad(loss, student.full, retain_graph=True)[0]
    for objective, hp in (
        (opd_kl_objective, OPDKLParams(anchor_coef=0.0, estimator=estimator)),
        (opd_lag_only_objective, LagOnlyParams(renormalise=True, estimator=estimator)),
    ):
        other, _ = objective(batch, student, hp)
        assert torch.allclose(loss, other, atol=1e-12)
        assert torch.allclose(grad, torch.autograd.grad(other, student.full, retain_graph=True)[0], atol=1e-12)


@pytest.mark.parametrize("estimator", ["sampled", "full"])
def test_opd_async_at_lag_zero_has_the_gradient_of_opd(estimator):
    # s = q and equal lengths: ∇ sg(s − T)·s = (q − T)∇s is Tinker's IS gradient at ratio 1; full: same exact KL
    batch, student, _, _ = _full_case([0, 0, 0])
    batch = dataclasses.replace(batch, behaviour_logprobs=student.logprobs.detach().clone())
    loss, _ = opd_async_objective(batch, student, AsyncOPDParams(estimator=estimator))
    opd = METHODS.get("opd")
    opd_loss, _ = opd.objective(batch, student, opd.hparams(estimator=estimator), None)
    grad = torch.autograd.grad(loss, student.full, retain_graph=True)[0]
    opd_grad = torch.autograd.grad(opd_loss, student.full, retain_graph=True)[0]
    assert torch.allclose(grad, opd_grad, atol=1e-12) and grad.abs().sum() > 0


def test_clipped_iw_caps_the_ratio():
    batch = make_batch([[1, 1, 0]], [[-1.0, -1.0, -1.0]], [[-2.0, -0.5, -0.5]], lag=[1])
    s = torch.tensor([[-0.2, -1.5, 3.0]], requires_grad=True)  # e^{s−q} = e^0.8 ≈ 2.23 → 2, e^−0.5
    loss, diag = opd_clipped_iw_objective(batch, StudentOutputs(s), ClippedIWParams(c_iw=2.0))
    loss.backward()
    iw = [2.0, math.exp(-0.5)]
    ratio = [-0.2 + 2.0, -1.5 + 0.5]
    assert loss.item() == pytest.approx((iw[0] * ratio[0] * -0.2 + iw[1] * ratio[1] * -1.5) / 2, abs=1e-6)
    assert s.grad.tolist()[0] == pytest.approx([iw[0] * ratio[0] / 2, iw[1] * ratio[1] / 2, 0.0], abs=1e-6)
    assert diag["iw_clip_fraction"] == pytest.approx(0.5)


def test_lag_only_weights_by_lag():
    batch = make_batch([[1], [1]], [[-1.0], [-1.0]], [[-2.0], [-2.0]], lag=[0, 3])
    s = torch.tensor([[-1.0], [-1.0]], requires_grad=True)
    loss, diag = opd_lag_only_objective(batch, StudentOutputs(s), LagOnlyParams())
    w = [sigmoid(1.0 - 0.5), sigmoid(0.25 - 0.5)]
    assert loss.item() == pytest.approx((w[0] + w[1]) * (1.0 * -1.0) / 2, abs=1e-6)
    assert diag["weight_mean"] == pytest.approx(sum(w) / 2, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# Refresh monitor


def test_refresh_monitor_state_round_trip_and_counts():
    monitor = RefreshMonitor(rule="freshness", kappa_f=0.10)
    signals = [monitor.observe(f) for f in (0.5, 0.05, 0.3, 0.01)]
    assert signals == [False, True, False, True] and monitor.refreshes == 2 and monitor.last_refresh_step == 4
    restored = RefreshMonitor(rule="freshness", kappa_f=0.10)
    restored.load_state_dict(monitor.state_dict())
    assert restored.state_dict() == monitor.state_dict() == {"rule": "freshness", "steps": 4, "refreshes": 2, "last_refresh_step": 4}
    with pytest.raises(ValueError, match="refresh rule"):
        RefreshMonitor(rule="periodic").load_state_dict(monitor.state_dict())


def test_coverage_reading_also_triggers_on_trusted_fractions():
    assert not refresh_due(0.5, 0.3, 0.9, rule="freshness")
    assert refresh_due(0.5, 0.3, 0.9, rule="freshness_or_coverage", kappa_cov=0.5)
    assert refresh_due(0.5, 0.9, 0.4, rule="freshness_or_coverage", kappa_cov=0.5)
    assert not refresh_due(0.5, 0.9, 0.9, rule="freshness_or_coverage", kappa_cov=0.5)


def test_hard_refresh_every_h_steps_through_the_objective():
    spec = METHODS.get("opd_hard_refresh")
    hp = HardRefreshParams(refresh_every=3)
    state = spec.make_state(hp)
    batch = make_batch([[1, 1]], [[-1.0, -0.5]], [[-1.5, -0.3]], lag=[1])
    signals = []
    for step in range(1, 10):
        _, diag = opd_hard_refresh_objective(batch, StudentOutputs(torch.tensor([[-1.0, -0.5]])), hp, state)
        signals.append(diag["refresh_signal"])
        if step == 5:  # checkpoint/resume mid-run keeps the schedule
            resumed = spec.make_state(hp)
            resumed.load_state_dict(state.state_dict())
            state = resumed
    assert signals == [0, 0, 1, 0, 0, 1, 0, 0, 1]
    assert diag["refresh_events"] == 3.0 and state.steps == 9
    _, diag = opd_hard_refresh_objective(batch, StudentOutputs(torch.tensor([[-1.0, -0.5]])), hp, None)
    assert diag["refresh_signal"] == 0.0  # no monitor ⇒ no step count ⇒ no signal


def test_f_opd_signals_refresh_when_batch_is_stale():
    spec = METHODS.get("f_opd")
    hp = FOPDParams()
    state = spec.make_state(hp)
    batch = make_batch([[1, 1]], [[-1.0, -0.5]], [[-1.5, -0.3]], lag=[20])  # f = 1/21 < κ_f
    _, diag = f_opd_objective(batch, StudentOutputs(torch.tensor([[-1.0, -0.5]])), hp, state)
    assert diag["refresh_signal"] == 1.0 and diag["refresh_events"] == 1.0 and state.refreshes == 1
    batch.policy_lag = torch.tensor([0])
    _, diag = f_opd_objective(batch, StudentOutputs(torch.tensor([[-1.0, -0.5]])), hp, state)
    assert diag["refresh_signal"] == 0.0 and state.refreshes == 1 and state.steps == 2


# ---------------------------------------------------------------------------------------------
# Registration


def test_methods_are_registered_with_declared_inputs():
    for name in NAMES:
        spec = METHODS.get(name)
        described = spec.describe()
        assert set(described["inputs"]) == {"teacher_logprobs", "behaviour_logprobs", "policy_lag"}
        assert described["modes"] == ["sync", "async"]
        assert spec.objective is OBJECTIVES[name][0]
    assert METHODS.get("f_opd").describe()["stateful"] and METHODS.get("opd_hard_refresh").describe()["stateful"]
    assert "exp" in METHODS.get("f_opd").notes["freshness_form"]


# ---------------------------------------------------------------------------------------------
# Gradients: gradcheck with the detached terms held fixed


def _terms_for(name, stats):
    if name == "f_opd":
        return f_opd_terms(stats, FOPDParams())[0]
    if name == "opd_kl":
        return opd_kl_terms(stats, OPDKLParams())
    if name == "opd_clipped_iw":
        return opd_clipped_iw_terms(stats, ClippedIWParams())
    if name == "opd_lag_only":
        return opd_lag_only_terms(stats, LagOnlyParams())[0]
    return plain_terms(stats)


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_each_loss(name):
    batch = make_batch(MASK, Q, STALE, fresh=FRESH, lag=LAG, dtype=torch.float64)
    s0 = torch.tensor(S, dtype=torch.float64)
    terms = _terms_for(name, async_stats(batch, s0))
    s = s0.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: async_opd_loss(x, terms), (s,), eps=1e-6, atol=1e-6)
    # and the registered objective's gradient at s0 is exactly that function's gradient
    objective, hp = OBJECTIVES[name]
    loss, _ = objective(batch, StudentOutputs(s), hp, None)
    (grad,) = torch.autograd.grad(loss, s)
    (expected,) = torch.autograd.grad(async_opd_loss(s, terms), s)
    assert torch.allclose(grad, expected, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Properties

finite = st.floats(min_value=0.0, max_value=20.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(
    lag=st.integers(0, 1000),
    d_roll=finite,
    d_sup=st.floats(0.0, 10.0),
    alpha=st.floats(0.0, 2.0),
    beta=st.floats(0.0, 2.0),
    form=st.sampled_from(["exp", "reciprocal", "product"]),
)
def test_freshness_in_unit_interval_and_decreasing_in_lag(lag, d_roll, d_sup, alpha, beta, form):
    lags = torch.tensor([lag, lag + 1])
    f = freshness(lags, torch.tensor([d_roll] * 2), torch.tensor([d_sup] * 2), alpha, beta, form=form)
    assert torch.isfinite(f).all() and (f > 0).all() and (f <= 1).all()
    assert f[1] < f[0]


@settings(max_examples=100, deadline=None)
@given(
    lags=st.lists(st.integers(0, 50), min_size=1, max_size=8),
    d_roll=st.lists(finite, min_size=8, max_size=8),
    xi=st.one_of(st.floats(0.0, 1.0), st.just("batch_mean")),
)
def test_weights_strictly_between_zero_and_one(lags, d_roll, xi):
    n = len(lags)
    f = freshness(torch.tensor(lags), torch.tensor(d_roll[:n]), torch.zeros(n))
    w = freshness_weights(f, xi)
    assert ((w > 0) & (w < 1)).all() and not w.requires_grad


def _random_inputs(seed: int, b: int, t: int, empty: bool = False):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, t) if empty else (torch.rand(b, t, generator=g) < 0.6).double()
    values = [-3.0 * torch.rand(b, t, generator=g, dtype=torch.float64) for _ in range(4)]  # s, q, stale, fresh
    lag = torch.randint(0, 5, (b,), generator=g)
    return mask.double(), values, lag


def _batch_from(mask, q, stale, fresh, lag) -> TensorBatch:
    return make_batch(mask, q, stale, fresh=fresh, lag=lag, dtype=torch.float64)


def _loss_and_grad(name, batch, s_values):
    objective, hp = OBJECTIVES[name]
    s = s_values.clone().requires_grad_(True)
    loss, diag = objective(batch, StudentOutputs(s), hp, None)
    loss.backward()
    return loss.detach(), s.grad, diag


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 4), t=st.integers(1, 6), name=st.sampled_from(NAMES), scale=st.floats(1.0, 50.0))
def test_masked_positions_never_change_loss_or_gradient(seed, b, t, name, scale):
    mask, (s, q, stale, fresh), lag = _random_inputs(seed, b, t)
    off = mask == 0
    g = torch.Generator().manual_seed(seed + 1)
    perturbed = [torch.where(off, x - scale * torch.rand(b, t, generator=g, dtype=torch.float64), x) for x in (s, q, stale, fresh)]
    loss_a, grad_a, diag_a = _loss_and_grad(name, _batch_from(mask, q, stale, fresh, lag), s)
    ps, pq, pstale, pfresh = perturbed
    loss_b, grad_b, diag_b = _loss_and_grad(name, _batch_from(mask, pq, pstale, pfresh, lag), ps)
    assert torch.allclose(loss_a, loss_b, atol=1e-12)
    assert torch.allclose(grad_a, grad_b, atol=1e-12)
    assert (grad_a[off] == 0).all()
    assert diag_a == pytest.approx(diag_b, abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 4), t=st.integers(1, 6), name=st.sampled_from(NAMES), fresh=st.booleans())
def test_empty_masks_give_zero_loss_without_nan(seed, b, t, name, fresh):
    mask, (s, q, stale, tf), lag = _random_inputs(seed, b, t, empty=True)
    loss, grad, diag = _loss_and_grad(name, _batch_from(mask, q, stale, tf if fresh else None, lag), s * 30.0)
    assert loss.item() == 0.0 and (grad == 0).all()
    assert all(math.isfinite(v) for v in diag.values())
    assert diag["excluded_samples"] == float(b)


# ----------------------------------------------------------------------------------------------
# estimator "full": the exact per-position reverse KL inside the async methods' weighting


def _full_case(lag):
    torch.manual_seed(0)
    b, t, v = 3, 4, 5
    student_full = torch.log_softmax(torch.randn(b, t, v, dtype=torch.float64), -1).requires_grad_(True)
    teacher_dist = torch.log_softmax(torch.randn(b, t, v, dtype=torch.float64), -1)
    tokens = torch.randint(0, v, (b, t))
    student_logp = student_full.gather(-1, tokens[..., None]).squeeze(-1)
    mask = [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    behaviour = (student_logp.detach() - 0.1).tolist()
    teacher = teacher_dist.gather(-1, tokens[..., None]).squeeze(-1).tolist()
    batch = make_batch(mask, behaviour, teacher, teacher_dist=teacher_dist, lag=lag, dtype=torch.float64)
    return batch, StudentOutputs(logprobs=student_logp, full=student_full), student_full, teacher_dist


def test_full_estimator_lag_only_is_sigmoid_weighted_exact_kl():
    batch, student, student_full, teacher_dist = _full_case([0, 2, 5])
    spec = METHODS.get("opd_lag_only")
    loss, _ = spec.objective(batch, student, spec.hparams(estimator="full"), None)
    kl = (student_full.exp() * (student_full - teacher_dist)).sum(-1).mean(-1)  # per-sample mean over 4 tokens
    w = torch.sigmoid(1.0 / (torch.tensor([0.0, 2.0, 5.0], dtype=torch.float64) + 1.0) - 0.5)
    assert torch.allclose(loss, (w * kl).mean(), atol=1e-12)
    loss.backward()
    assert student_full.grad is not None and torch.isfinite(student_full.grad).all()


def test_full_estimator_hard_refresh_at_lag_zero_equals_opd_full_on_equal_lengths():
    batch, student, _, _ = _full_case([0, 0, 0])
    hard = METHODS.get("opd_hard_refresh")
    opd = METHODS.get("opd")
    loss_hard, _ = hard.objective(batch, student, hard.hparams(estimator="full"), None)
    loss_opd, _ = opd.objective(batch, student, opd.hparams(estimator="full"), None)
    assert torch.allclose(loss_hard, loss_opd, atol=1e-12)  # equal lengths: per-sample-then-batch mean = token mean


def test_full_estimator_declares_full_distributions_and_refuses_without_them():
    spec = METHODS.get("f_opd")
    assert {"teacher_dist", "student_full"} <= spec.needs(spec.hparams(estimator="full"))
    assert "teacher_dist" not in spec.needs(spec.hparams())
    batch, student, _, _ = _full_case([1, 1, 1])
    with pytest.raises(ValueError, match="full"):
        spec.objective(batch, StudentOutputs(logprobs=student.logprobs), spec.hparams(estimator="full"), None)
