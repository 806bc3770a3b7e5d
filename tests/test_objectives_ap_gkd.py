"""AP-OPD (+ controls), IW-OPD stand-in, EOPD and GKD objectives on hand-computed tensors (docs/methods/gkd.md, ap-opd.md, stand-ins.md)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from opd_harness.registry import METHODS
from batches import make_batch
from opd_harness.method import StudentOutputs
from opd_harness.trainers.objectives.ap_opd import (
    APOPDParams,
    FixedWeightParams,
    MagCapParams,
    ap_opd_fixed_objective,
    ap_opd_magcap_objective,
    ap_opd_objective,
    ceil_fraction,
    detect_jumps,
    magnitude_cap_weights,
    make_blocks,
    pullback,
    pullback_weights,
    removed_mass,
)
from opd_harness.trainers.objectives.eopd import EOPDParams, eopd_objective
from opd_harness.trainers.objectives.gkd import GKDParams, generalized_jsd, gkd_objective
from opd_harness.trainers.objectives.iw_opd import IWOPDParams, iw_opd_objective, iw_weights
from opd_harness.trainers.objectives.opd import full_reverse_kl

TOL = 1e-6


def close(actual, expected, tol=TOL) -> bool:
    return torch.allclose(torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


# ---------------------------------------------------------------------------------------------------
# AP-OPD: worked examples §4.7 and §4.8

R1 = [[0.1, -0.2, 0.1, 0.4, 1.5, 1.7, 1.6, 0.2, 0.1, -0.5]]
R2 = [[-0.3, -0.1, 0.0, -0.2, 0.8, 1.2, 0.4, 1.6, 0.5, 0.7]]
ONES = [[1.0] * 10]


def test_worked_example_4_7_block_statistics():
    r = torch.tensor(R1[0], dtype=torch.float64)
    blocks = make_blocks(r.clamp(min=0), torch.ones(10), block=2)
    assert close(blocks.mean, [0.05, 0.25, 1.6, 0.9, 0.05])
    assert close(blocks.var, [0.005, 0.045, 0.02, 0.98, 0.005])
    delta = blocks.mean[1:] - blocks.mean[:-1]
    assert close(delta, [0.20, 1.35, -0.70, -0.85])
    se = torch.sqrt(blocks.var[:-1] / blocks.size[:-1] + blocks.var[1:] / blocks.size[1:])
    assert close(se, [0.158114, 0.180278, 0.707107, 0.701783])
    assert close(2 * se, [0.316228, 0.360555, 1.414214, 1.403567])
    assert detect_jumps(blocks, z=2.0, detector="z", alpha=0.05) == [1]


def test_worked_example_4_7_z_gate_weights():
    weights, jumps = pullback(torch.tensor(R1), torch.tensor(ONES), block=2, z=2.0)
    assert close(weights, [[1, 1, 1, 1, 0.15625, 0.15625, 1, 1, 1, 1]])
    assert jumps.tolist() == [1.0]


def test_worked_example_4_7_top_alpha():
    r, m = torch.tensor(R1), torch.tensor(ONES)
    # α = 0.05: C = 5, K = min(⌈0.25⌉, 2) = 1 → the same jump {1}
    assert close(pullback_weights(r, m, block=2, detector="topk", alpha=0.05), [[1, 1, 1, 1, 0.15625, 0.15625, 1, 1, 1, 1]])
    # α = 0.5: K = min(3, 2) = 2 → jumps {0, 1}; block 1 gets 0.05/0.25 = 0.2
    assert close(pullback_weights(r, m, block=2, detector="topk", alpha=0.5), [[1, 1, 0.2, 0.2, 0.15625, 0.15625, 1, 1, 1, 1]])
    # both detectors must agree under z_and_topk: only boundary 1 passes the z-gate
    assert close(pullback_weights(r, m, block=2, detector="z_and_topk", alpha=0.5), [[1, 1, 1, 1, 0.15625, 0.15625, 1, 1, 1, 1]])


def test_worked_example_4_7_weighted_advantage_through_the_loss():
    # T = −3, o = r − 3 so r = o − T; s = o makes ρ = 1: loss = −mean(w·A), ∂loss/∂s_t = −w_t·A_t / Σm
    r = torch.tensor(R1, dtype=torch.float64)
    teacher = torch.full_like(r, -3.0)
    batch = make_batch(ONES, r - 3.0, teacher, old=r - 3.0, dtype=torch.float64)
    s = (r - 3.0).clone().requires_grad_(True)
    loss, diag = ap_opd_objective(batch, StudentOutputs(s), APOPDParams(block=2))
    loss.backward()
    expected = [-0.1, 0.2, -0.1, -0.4, -0.234375, -0.265625, -1.6, -0.2, -0.1, 0.5]
    assert close(-s.grad * 10, [expected])
    assert loss.item() == pytest.approx(-sum(expected) / 10, abs=TOL)
    assert diag["jumps_per_seq"] == 1.0
    assert diag["mean_weight"] == pytest.approx((8 + 2 * 0.15625) / 10, abs=TOL)
    # q = Σ(1−w)d / Σd = (1 − 0.15625)·(1.5 + 1.7) / 5.7
    assert diag["removed_mass"] == pytest.approx(0.84375 * 3.2 / 5.7, abs=TOL)


def test_worked_example_4_8_zero_pre_jump_mean_and_partial_block():
    r = torch.tensor(R2[0], dtype=torch.float64)
    blocks = make_blocks(r.clamp(min=0), torch.ones(10), block=4)
    assert blocks.size.tolist() == [4.0, 4.0, 2.0]
    assert close(blocks.mean, [0.0, 1.0, 0.6])
    assert close(blocks.var, [0.0, 0.266667, 0.02])
    assert close(blocks.mean[1:] - blocks.mean[:-1], [1.0, -0.4])
    assert math.sqrt(blocks.var[0] / 4 + blocks.var[1] / 4) == pytest.approx(0.258199, abs=TOL)
    assert close(pullback_weights(torch.tensor(R2), torch.tensor(ONES), block=4), [[1, 1, 1, 1, 0, 0, 0, 0, 1, 1]])


def test_w_min_floor_is_off_by_default_and_applies_when_set():
    weights = pullback_weights(torch.tensor(R2), torch.tensor(ONES), block=4, w_min=0.1)
    assert close(weights, [[1, 1, 1, 1, 0.1, 0.1, 0.1, 0.1, 1, 1]])


def test_single_block_and_nonpositive_penalties_give_unit_weights():
    assert close(pullback_weights(torch.tensor(R1), torch.tensor(ONES)), [[1.0] * 10])  # n ≤ B: one block
    assert close(pullback_weights(-torch.tensor(R1).abs(), torch.tensor(ONES), block=2), [[1.0] * 10])  # D ≡ 0


def test_blocks_never_cross_a_mask_break():
    # Two assistant turns at 0..2 and 5..7 (tool tokens at 3, 4). The penalty rises only across the break.
    r = torch.tensor([[0.0, 0.0, 0.0, 9.0, 9.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1, 1, 0, 0, 1, 1, 1]])
    blocks = make_blocks(r[0].clamp(min=0), mask[0], block=2)
    assert blocks.size.tolist() == [2.0, 1.0, 2.0, 1.0]  # each run blocked on its own, short last block per run
    assert blocks.comparable.tolist() == [True, False, True]
    assert close(pullback_weights(r, mask, block=2, detector="topk", alpha=1.0), [[1.0] * 8])
    # the same valid values without the break do form a jump
    contiguous = pullback_weights(torch.tensor([[0.0, 0, 0, 5, 5, 5]]), torch.ones(1, 6), block=2, detector="topk", alpha=1.0)
    assert close(contiguous, [[1, 1, 0, 0, 0.5, 0.5]])  # D = [0, 2.5, 5]: both boundaries jump


def test_top_alpha_ties_go_to_the_lower_index_and_c_counts_option():
    r = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])  # D = [0, 1, 0, 1]: Δ = [1, −1, 1]
    m = torch.ones_like(r)
    assert close(pullback_weights(r, m, block=2, detector="topk", alpha=0.1), [[1, 1, 0, 0, 1, 1, 1, 1]])
    # α = 0.25: C = 4 blocks → K = min(1, 2) = 1; C = 3 boundaries → ⌈0.75⌉ = 1; α = 0.5: 2 vs 2
    r5 = torch.tensor(R1)
    assert pullback(r5, torch.tensor(ONES), block=2, detector="topk", alpha=0.25)[1].item() == 2  # ⌈1.25⌉ = 2
    assert pullback(r5, torch.tensor(ONES), block=2, detector="topk", alpha=0.25, counts_as="boundaries")[1].item() == 1  # ⌈1.0⌉
    assert ceil_fraction(0.1, 30) == 3 and ceil_fraction(0.05, 20) == 1 and ceil_fraction(0.05, 21) == 2


def test_partial_block_merge_option():
    d = torch.tensor([0.0, 0, 0, 0, 1, 1, 1, 1, 2], dtype=torch.float64)
    assert make_blocks(d, torch.ones(9), block=4).size.tolist() == [4.0, 4.0, 1.0]
    merged = make_blocks(d, torch.ones(9), block=4, partial="merge")
    assert merged.size.tolist() == [4.0, 5.0] and close(merged.mean, [0.0, 6.0 / 5])


def test_magnitude_cap_hand_example():
    # d of §4.7: D = [0.05, 0.25, 1.6, 0.9, 0.05], D̄ = 5.7/10 = 0.57
    r, m = torch.tensor(R1), torch.tensor(ONES)
    w, capped = magnitude_cap_weights(r, m, block=2, alpha=0.2)  # K = ⌈1⌉ = 1 → block 2 at 0.57/1.6
    assert close(w, [[1, 1, 1, 1, 0.35625, 0.35625, 1, 1, 1, 1]]) and capped.tolist() == [1.0]
    w, _ = magnitude_cap_weights(r, m, block=2, alpha=0.4)  # K = 2 → blocks 2 and 3 (0.57/0.9)
    assert close(w, [[1, 1, 1, 1, 0.35625, 0.35625, 0.57 / 0.9, 0.57 / 0.9, 1, 1]])
    w, capped = magnitude_cap_weights(r, m, block=2, alpha=1.0)  # K = min(5, 4 post-boundary blocks): min(1, ·) keeps small blocks at 1
    assert close(w, [[1, 1, 1, 1, 0.35625, 0.35625, 0.57 / 0.9, 0.57 / 0.9, 1, 1]]) and capped.tolist() == [4.0]
    batch = make_batch(ONES, R1, [[0.0] * 10], old=R1)
    _, diag = ap_opd_magcap_objective(batch, StudentOutputs(torch.tensor(R1)), MagCapParams(block=2, alpha=0.2))
    assert diag["capped_blocks_per_seq"] == 1.0 and diag["mean_weight"] == pytest.approx((8 + 2 * 0.35625) / 10, abs=TOL)


def test_fixed_weight_control_uses_the_detector_with_constant_weight():
    r, m = torch.tensor(R1), torch.tensor(ONES)
    w, jumps = pullback(r, m, block=2, fixed=0.3)
    assert close(w, [[1, 1, 1, 1, 0.3, 0.3, 1, 1, 1, 1]]) and jumps.tolist() == [1.0]
    w, _ = pullback(r, m, block=2, detector="topk", alpha=0.5, fixed=0.3)
    assert close(w, [[1, 1, 0.3, 0.3, 0.3, 0.3, 1, 1, 1, 1]])
    batch = make_batch(ONES, R1, [[0.0] * 10], old=R1)
    s = torch.tensor(R1, requires_grad=True)
    loss, diag = ap_opd_fixed_objective(batch, StudentOutputs(s), FixedWeightParams(block=2))
    expected = -sum(wt * (-rt) for wt, rt in zip([1, 1, 1, 1, 0.3, 0.3, 1, 1, 1, 1], R1[0])) / 10
    assert loss.item() == pytest.approx(expected, abs=TOL) and diag["jumps_per_seq"] == 1.0


def test_removed_mass_averages_over_responses_with_penalty():
    w = torch.tensor([[1.0, 0.5, 0.0], [0.2, 0.2, 0.2]])
    d = torch.tensor([[1.0, 2.0, 1.0], [0.0, 0.0, 0.0]])  # second response: no penalty mass → excluded
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    assert removed_mass(w, d, mask).item() == pytest.approx((0 + 1.0 + 1.0) / 4.0, abs=TOL)
    assert removed_mass(w, torch.zeros_like(d), mask).item() == 0.0


def test_ap_opd_student_equal_teacher_has_zero_advantage():
    logp = [[-0.7, -1.2, -0.1, -2.0, -0.3]]
    batch = make_batch([[1, 1, 1, 1, 0]], logp, logp)
    s = torch.tensor(logp, requires_grad=True)
    loss, diag = ap_opd_objective(batch, StudentOutputs(s), APOPDParams(block=2))
    loss.backward()
    assert loss.item() == 0.0 and diag["advantage_mean"] == 0.0 and diag["teacher_kl"] == 0.0
    assert torch.all(s.grad == 0)


def test_ap_opd_ppo_clip_option():
    # ratio e^{0.5} ≈ 1.65 > 1.28 with a positive advantage: the clipped branch has zero gradient
    batch = make_batch([[1.0]], [[-1.0]], [[-0.5]], old=[[-1.0]])
    s = torch.tensor([[-0.5]], requires_grad=True)
    loss, diag = ap_opd_objective(batch, StudentOutputs(s), APOPDParams(clip=True))
    loss.backward()
    assert loss.item() == pytest.approx(-1.28 * 0.5, abs=TOL) and s.grad.item() == 0.0 and diag["clip_fraction"] == 1.0


def test_ap_opd_ppo_clip_bounds_a_negative_advantage_by_the_dual_clip():
    # A = T − o = −0.5 and ρ = e^5 (a stale batch): the PPO clip alone leaves −ρA = 74;
    # the dual clip makes it c·|A| with no gradient
    batch = make_batch([[1.0]], [[-1.0]], [[-1.5]], old=[[-1.0]])
    for hp, expected in ((APOPDParams(clip=True), 3.0 * 0.5), (APOPDParams(clip=True, dual_clip=None), math.exp(5.0) * 0.5)):
        s = torch.tensor([[4.0]], requires_grad=True)
        loss, diag = ap_opd_objective(batch, StudentOutputs(s), hp)
        loss.backward()
        assert loss.item() == pytest.approx(expected, rel=1e-5)
        assert (s.grad.item() == 0.0) == bool(hp.dual_clip) and diag["dual_clip_fraction"] == float(bool(hp.dual_clip))


# ---------------------------------------------------------------------------------------------------
# IW-OPD stand-in


def test_iw_weights_hand_example():
    r = torch.tensor([[0.5, 9.0, -0.2, 1.0, 0.3]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0, 1.0]])  # the masked 9.0 never accumulates
    raw = torch.exp(-torch.tensor([0.0, 0.5, 0.5, 0.5, 1.5]))  # c_t = Σ_{u<t} m_u [r_u]_+, λ = 1
    expected = raw / raw[[0, 2, 3, 4]].mean()
    w = iw_weights(r, mask, lam=1.0)
    assert close(w[0], expected)
    assert w[0, [0, 2, 3, 4]].mean().item() == pytest.approx(1.0, abs=TOL)


def test_iw_opd_loss_uses_the_weights():
    r = torch.tensor([[0.5, -0.2, 1.0]])
    batch = make_batch([[1, 1, 1]], r, torch.zeros_like(r), old=r)
    loss, diag = iw_opd_objective(batch, StudentOutputs(r.clone()), IWOPDParams(iw_lambda=1.0))
    w = iw_weights(r, torch.ones_like(r), 1.0)
    assert loss.item() == pytest.approx(float(-(w * -r).mean()), abs=TOL)
    assert diag["mean_weight"] == pytest.approx(1.0, abs=TOL)


# ---------------------------------------------------------------------------------------------------
# GKD


P_S = [0.7, 0.2, 0.1]
P_T = [0.5, 0.4, 0.1]


def kl_hand(p, q) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def gkd_batch(p_s, p_t, mask):
    """One-row batch over len(p_s) positions from probability lists; returns (batch, logits leaf, student_full)."""
    teacher_dist = torch.tensor([p_t], dtype=torch.float64).log()
    logits = torch.tensor([p_s], dtype=torch.float64).log().requires_grad_(True)
    student_full = F.log_softmax(logits, -1)
    n = len(p_s)
    batch = make_batch([mask], [[0.0] * n], teacher_dist[..., 0], teacher_dist=teacher_dist, dtype=torch.float64)
    return batch, logits, student_full


@pytest.mark.parametrize(
    "beta, expected",
    [
        (0.0, kl_hand(P_T, P_S)),  # forward KL(p_T ‖ p_S)
        (1.0, kl_hand(P_S, P_T)),  # reverse KL(p_S ‖ p_T)
        (0.5, 0.0253622524205915),  # M = [0.6, 0.3, 0.1]: 0.5·0.0239120506 + 0.5·0.0268124543
        (0.3, 0.02184389897386365),  # M = 0.7·p_S + 0.3·p_T: 0.3·KL(p_T‖M) + 0.7·KL(p_S‖M)
    ],
)
def test_gkd_generalized_jsd_hand_values(beta, expected):
    batch, _, student_full = gkd_batch([P_S, P_T], [P_T, P_T], [1.0, 1.0])
    loss, diag = gkd_objective(batch, StudentOutputs(student_full[..., 0], full=student_full), GKDParams(beta=beta))
    assert loss.item() == pytest.approx(expected / 2, abs=TOL)  # second position: identical → 0; batchmean over 2
    assert diag["jsd"] == pytest.approx(expected / 2, abs=TOL)


def test_gkd_beta_one_matches_opd_full_reverse_kl():
    batch, _, student_full = gkd_batch([P_S], [P_T], [1.0])
    jsd = generalized_jsd(student_full, batch.teacher_dist, 1.0)
    assert close(jsd, full_reverse_kl(student_full, batch.teacher_dist))


def test_gkd_batchmean_over_kept_positions_only():
    batch, logits, student_full = gkd_batch([P_S, [0.1, 0.1, 0.8]], [P_T, P_T], [1.0, 0.0])
    loss, _ = gkd_objective(batch, StudentOutputs(student_full[..., 0], full=student_full), GKDParams(beta=0.0))
    loss.backward()
    assert loss.item() == pytest.approx(kl_hand(P_T, P_S), abs=TOL)
    assert torch.all(logits.grad[0, 1] == 0)


def test_gkd_temperature_and_top_k():
    batch, _, student_full = gkd_batch([P_S], [P_T], [1.0])
    loss, _ = gkd_objective(batch, StudentOutputs(student_full[..., 0], full=student_full), GKDParams(beta=1.0, temperature=2.0))
    def soft(p: list[float]) -> list[float]:  # softmax(log p / 2)
        return [x / sum(math.sqrt(y) for y in p) for x in (math.sqrt(y) for y in p)]

    assert loss.item() == pytest.approx(kl_hand(soft(P_S), soft(P_T)), abs=TOL)
    loss, _ = gkd_objective(batch, StudentOutputs(student_full[..., 0], full=student_full), GKDParams(beta=0.0, top_k=2))
    assert loss.item() == pytest.approx(kl_hand([5 / 9, 4 / 9], [7 / 9, 2 / 9]), abs=TOL)  # teacher's top-2 = tokens 0, 1


def test_gkd_needs_full_distributions():
    assert METHODS.get("gkd").needs(GKDParams()) == {"teacher_dist", "student_full"}
    with pytest.raises(ValueError, match="full student and teacher"):
        gkd_objective(make_batch([[1.0]], [[0.0]], [[0.0]]), StudentOutputs(torch.zeros(1, 1)), GKDParams())


# ---------------------------------------------------------------------------------------------------
# EOPD


def test_eopd_hard_gate_hand_example():
    # position 0: uniform teacher, H = log 3 ≈ 1.0986 > h = 1 → FKL added; position 1: peaked, H ≈ 0.394 → RKL only
    p_s, p_t = [[0.6, 0.3, 0.1], [0.8, 0.1, 0.1]], [[1 / 3, 1 / 3, 1 / 3], [0.9, 0.05, 0.05]]
    batch, logits, student_full = gkd_batch(p_s, p_t, [1.0, 1.0])
    s = student_full[..., 0]  # sampled token 0 at both positions; o = s (detached) so ρ = 1
    loss, diag = eopd_objective(batch, StudentOutputs(s, full=student_full), EOPDParams(entropy_threshold=1.0))
    rkl = [math.log(0.6) - math.log(1 / 3), math.log(0.8) - math.log(0.9)]  # value of −ρ(T − o) = o − T
    assert loss.item() == pytest.approx((rkl[0] + kl_hand(p_t[0], p_s[0]) + rkl[1]) / 2, abs=TOL)
    assert diag["gate_mean"] == 0.5
    h_peaked = -(0.9 * math.log(0.9) + 2 * 0.05 * math.log(0.05))
    assert diag["teacher_entropy"] == pytest.approx((math.log(3) + h_peaked) / 2, abs=TOL)


def test_eopd_soft_gate_mixes_reverse_and_forward():
    p_s, p_t = [[0.6, 0.3, 0.1]], [[1 / 3, 1 / 3, 1 / 3]]  # H = log V → g = 1: pure forward KL
    batch, _, student_full = gkd_batch(p_s, p_t, [1.0])
    loss, _ = eopd_objective(batch, StudentOutputs(student_full[..., 0], full=student_full), EOPDParams(gate="soft"))
    assert loss.item() == pytest.approx(kl_hand(p_t[0], p_s[0]), abs=TOL)
    loss, _ = eopd_objective(
        batch, StudentOutputs(student_full[..., 0], full=student_full), EOPDParams(gate="soft", entropy_max=2 * math.log(3))
    )
    assert loss.item() == pytest.approx(0.5 * (math.log(0.6) - math.log(1 / 3)) + 0.5 * kl_hand(p_t[0], p_s[0]), abs=TOL)


def test_student_equal_teacher_gives_zero_loss_for_gkd_and_eopd():
    probs = [[0.6, 0.3, 0.1], [1 / 3, 1 / 3, 1 / 3]]
    cases = [
        (GKDParams(beta=0.5), gkd_objective),
        (GKDParams(beta=0.0, top_k=2), gkd_objective),
        (EOPDParams(entropy_threshold=0.0), eopd_objective),
        (EOPDParams(gate="soft", rkl_estimator="full"), eopd_objective),
    ]
    for params, objective in cases:
        batch, logits, student_full = gkd_batch(probs, probs, [1.0, 1.0])
        loss, _ = objective(batch, StudentOutputs(student_full[..., 0], full=student_full), params)
        loss.backward()
        assert abs(loss.item()) < 1e-12 and logits.grad.abs().max().item() < 1e-12


# ---------------------------------------------------------------------------------------------------
# Properties: weights, masking, empty masks


ALL_METHODS = [
    ("ap_opd", APOPDParams(block=2)),
    ("ap_opd", APOPDParams(block=3, detector="topk", alpha=0.5, clip=True)),
    ("ap_opd_magcap", MagCapParams(block=2, alpha=0.5)),
    ("ap_opd_fixed", FixedWeightParams(block=2, detector="z_and_topk", aggregation="seq-mean")),
    ("iw_opd", IWOPDParams(iw_lambda=0.5)),
    ("eopd", EOPDParams(entropy_threshold=0.8)),
    ("eopd", EOPDParams(gate="soft", fkl_top_k=2, rkl_estimator="full")),
    ("gkd", GKDParams(beta=0.5, temperature=0.7)),
    ("gkd", GKDParams(beta=0.0, top_k=3)),
    ("gkd", GKDParams(beta=1.0)),
]


def random_inputs(seed: int, mask: torch.Tensor, vocab: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t = mask.shape
    return {
        "logits": torch.randn(b, t, vocab, generator=g, dtype=torch.float64) * 1.5,
        "teacher_logits": torch.randn(b, t, vocab, generator=g, dtype=torch.float64) * 1.5,
        "old_shift": torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3,
    }


def run_method(name: str, hp, mask: torch.Tensor, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Loss and d loss / d logits of a method on inputs built from logits (sampled token = 0)."""
    logits = inputs["logits"].clone().requires_grad_(True)
    student_full = F.log_softmax(logits, -1)
    teacher_dist = F.log_softmax(inputs["teacher_logits"], -1)
    s = student_full[..., 0]
    old = s.detach() + inputs["old_shift"]
    batch = make_batch(mask, old, teacher_dist[..., 0], teacher_dist=teacher_dist, old=old, dtype=torch.float64)
    loss, diag = METHODS.get(name).objective(batch, StudentOutputs(s, full=student_full), hp, None)
    loss.backward()
    return loss.detach(), logits.grad, diag


masks = st.integers(1, 3).flatmap(
    lambda b: st.integers(1, 9).flatmap(lambda t: st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b))
)


@settings(max_examples=40, deadline=None)
@given(
    mask=masks,
    seed=st.integers(0, 10_000),
    block=st.integers(1, 4),
    detector=st.sampled_from(["z", "topk", "z_and_topk"]),
    alpha=st.floats(0.01, 1.0),
    scale=st.floats(0.0, 20.0),
)
def test_ap_weights_are_in_unit_interval_and_finite(mask, seed, block, detector, alpha, scale):
    m = torch.tensor(mask, dtype=torch.float32)
    r = torch.randn(m.shape, generator=torch.Generator().manual_seed(seed)) * scale
    ap = pullback_weights(r, m, block, 2.0, detector, alpha)
    capped = magnitude_cap_weights(r, m, block, alpha)[0]
    fixed = pullback(r, m, block, 2.0, detector, alpha, fixed=0.3)[0]
    for w in (ap, capped, fixed):
        assert w.shape == r.shape and torch.isfinite(w).all() and (w >= 0).all() and (w <= 1).all()


@settings(max_examples=40, deadline=None)
@given(mask=masks, seed=st.integers(0, 10_000), scale=st.floats(0.0, 1000.0), lam=st.floats(0.01, 100.0))
def test_iw_weights_are_finite_with_masked_mean_one(mask, seed, scale, lam):
    m = torch.tensor(mask, dtype=torch.float32)
    r = torch.randn(m.shape, generator=torch.Generator().manual_seed(seed)) * scale
    w = iw_weights(r, m, lam)
    assert torch.isfinite(w).all() and (w >= 0).all()
    for row in range(m.shape[0]):
        if m[row].sum() > 0:
            assert w[row][m[row] > 0].mean().item() == pytest.approx(1.0, abs=1e-5)


@settings(max_examples=15, deadline=None)
@given(mask=masks, seed=st.integers(0, 10_000))
def test_masked_positions_never_change_loss_or_gradient(mask, seed):
    m = torch.tensor(mask, dtype=torch.float64)
    base = random_inputs(seed, m)
    noise = random_inputs(seed + 1, m)
    hidden = (m == 0)
    perturbed = {k: torch.where(hidden.reshape(hidden.shape + (1,) * (v.dim() - 2)), noise[k] * 5, v) for k, v in base.items()}
    for name, hp in ALL_METHODS:
        loss_a, grad_a, _ = run_method(name, hp, m, base)
        loss_b, grad_b, _ = run_method(name, hp, m, perturbed)
        assert torch.isfinite(loss_a) and loss_a.item() == pytest.approx(loss_b.item(), abs=1e-9), name
        assert torch.allclose(grad_a, grad_b, atol=1e-12), name
        assert torch.all(grad_a[hidden] == 0), name


@pytest.mark.parametrize("name, hp", ALL_METHODS)
def test_empty_mask_gives_zero_loss_without_nan(name, hp):
    m = torch.zeros(2, 5, dtype=torch.float64)
    loss, grad, diag = run_method(name, hp, m, random_inputs(0, m))
    assert loss.item() == 0.0 and torch.all(grad == 0)
    assert all(math.isfinite(v) for v in diag.values()), diag


# ---------------------------------------------------------------------------------------------------
# Gradients (float64 gradcheck)


@pytest.mark.parametrize("name, hp", ALL_METHODS)
def test_gradcheck_wrt_student_logits(name, hp):
    m = torch.tensor([[1.0, 1, 1, 0, 1, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.float64)
    inputs = random_inputs(3, m)
    teacher_dist = F.log_softmax(inputs["teacher_logits"], -1)
    old = F.log_softmax(inputs["logits"], -1)[..., 0] + inputs["old_shift"]
    batch = make_batch(m, old, teacher_dist[..., 0], teacher_dist=teacher_dist, old=old, dtype=torch.float64)
    objective = METHODS.get(name).objective

    def loss_of(logits):
        student_full = F.log_softmax(logits, -1)
        return objective(batch, StudentOutputs(student_full[..., 0], full=student_full), hp, None)[0]

    assert torch.autograd.gradcheck(loss_of, (inputs["logits"].clone().requires_grad_(True),), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("name, hp", [(n, h) for n, h in ALL_METHODS if n in {"ap_opd", "ap_opd_magcap", "ap_opd_fixed", "iw_opd"}])
def test_gradcheck_wrt_student_logprobs(name, hp):
    g = torch.Generator().manual_seed(7)
    m = torch.tensor([[1.0, 1, 1, 1, 0, 1, 1]], dtype=torch.float64)
    old = -torch.rand(1, 7, generator=g, dtype=torch.float64) * 3
    teacher = -torch.rand(1, 7, generator=g, dtype=torch.float64) * 3
    batch = make_batch(m, old, teacher, old=old, dtype=torch.float64)
    s = (old + torch.randn(1, 7, generator=g, dtype=torch.float64) * 0.05).requires_grad_(True)
    objective = METHODS.get(name).objective
    assert torch.autograd.gradcheck(lambda x: objective(batch, StudentOutputs(x), hp, None)[0], (s,), eps=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# Registration


@pytest.mark.parametrize("name", ["ap_opd", "ap_opd_magcap", "ap_opd_fixed", "iw_opd", "eopd", "gkd"])
def test_methods_are_registered_and_describe_themselves(name):
    info = METHODS.get(name).describe()
    assert info["name"] == name and info["notes"] and info["inputs"]
