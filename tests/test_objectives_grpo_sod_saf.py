"""GRPO, SOD and SAF-OPD objectives: worked examples computed by hand (docs/methods/sod.md, saf-opd.md) (abs tol 1e-6),
hand-computed GRPO advantages, property tests (bounds, masking, empty batches) and gradchecks."""

import copy
import io
import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opd_harness.registry import METHODS
from opd_harness.trajectory import TensorBatch
from opd_harness.method import StudentOutputs
from opd_harness.trainers.objectives.common import grpo_advantages, opd_advantage
from opd_harness.trainers.objectives.grpo import GRPOParams, grpo_needs, grpo_objective, grpo_sequence_advantages
from opd_harness.trainers.objectives.saf import (
    SAFParams,
    Schedule,
    compress,
    saf_advantages,
    saf_needs,
    saf_objective,
    saf_opd_advantage,
    sparsify,
)
from opd_harness.trainers.objectives.sod import (
    SODParams,
    sod_advantages,
    sod_needs,
    sod_objective,
    step_divergences,
    step_spans,
    step_weights,
    weights_from_divergences,
)

TOL = 1e-6
F64 = torch.float64


def t(values, dtype=F64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def assert_close(actual: torch.Tensor, expected, atol: float = TOL) -> None:
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0)


def make_batch(mask, old, teacher, *, rewards=None, groups=None, behaviour=None, step_index=None, dtype=F64) -> TensorBatch:
    """A TensorBatch over (B, L) positions; ``old`` becomes batch.old_logprobs (fixed π_old)."""
    mask = torch.as_tensor(mask, dtype=dtype)
    b, length = mask.shape
    old = torch.as_tensor(old, dtype=dtype)
    return TensorBatch(
        input_ids=torch.zeros((b, length), dtype=torch.long),
        attention_mask=torch.ones((b, length), dtype=torch.long),
        loss_mask=mask,
        step_index=torch.zeros((b, length), dtype=torch.long) if step_index is None else torch.as_tensor(step_index),
        behaviour_logprobs=old.clone() if behaviour is None else torch.as_tensor(behaviour, dtype=dtype),
        teacher_logprobs=torch.as_tensor(teacher, dtype=dtype),
        rewards=torch.full((b,), float("nan")) if rewards is None else torch.as_tensor(rewards, dtype=torch.float32),
        policy_version=torch.zeros(b, dtype=torch.long),
        group_ids=torch.arange(b) if groups is None else torch.as_tensor(groups),
        old_logprobs=old,
    )


def run(objective, batch, s, hp, state=None):
    """(loss, grad wrt s, diagnostics) of one objective call."""
    s = s.clone().requires_grad_(True)
    loss, diagnostics = objective(batch, StudentOutputs(s), hp, state)
    loss.backward()
    return loss.detach(), s.grad, diagnostics


# ---------------------------------------------------------------------------------------------- GRPO


def test_grpo_advantages_hand_computed_with_singleton_and_constant_groups():
    # group 0: [1, 0, 0] → mean 1/3, unbiased std sqrt(1/3); group 1: singleton → A = R; group 2: constant → 0
    batch = make_batch(torch.ones(6, 1), torch.zeros(6, 1), torch.zeros(6, 1), rewards=[1, 0, 0, 0.5, 1, 1], groups=[0, 0, 0, 1, 2, 2])
    std = math.sqrt(1 / 3) + 1e-6
    expected = [(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, 0.5, 0.0, 0.0]
    assert grpo_sequence_advantages(batch).tolist() == pytest.approx(expected, abs=TOL)
    assert grpo_sequence_advantages(batch, coef=0.0).tolist() == [0.0] * 6


def test_grpo_loss_and_gradient_are_token_mean_of_broadcast_advantage():
    mask = [[1, 1, 0], [1, 0, 0], [0, 1, 1]]
    old = [[-1.0, -0.5, -2.0], [-0.3, -1.0, -1.0], [-0.7, -0.2, -0.9]]
    batch = make_batch(mask, old, torch.zeros(3, 3), rewards=[1.0, 0.0, 0.0], groups=[0, 0, 0])
    a = grpo_sequence_advantages(batch).double()
    loss, grad, diag = run(grpo_objective, batch, t(old), GRPOParams())  # s = o ⇒ ρ = 1
    n_tokens = (a * t(mask).sum(1)).sum()
    assert loss.item() == pytest.approx(-(n_tokens / 5).item(), abs=TOL)  # −Σ m·A / Σ m
    assert_close(grad, -a[:, None] * t(mask) / 5)
    assert diag["reward_mean"] == pytest.approx(1 / 3)
    assert diag["advantage_mean"] == pytest.approx(0.0, abs=TOL)
    assert diag["clip_fraction"] == 0.0


def test_grpo_clip_is_asymmetric():
    # positive advantage: ρ = 1.25 lies inside 1 + ε_hi = 1.28 (gradient flows), ρ = 1.3 is clipped (no gradient)
    batch = make_batch([[1, 1]], [[-1.0, -1.0]], [[0.0, 0.0]], rewards=[1.0], groups=[0])
    s = t([[-1.0 + math.log(1.25), -1.0 + math.log(1.3)]])
    _, grad, diag = run(grpo_objective, batch, s, GRPOParams())
    assert grad[0, 0].item() == pytest.approx(-1.25 / 2) and grad[0, 1].item() == 0.0
    assert diag["clip_fraction"] == pytest.approx(0.5)


def dual_clip_case(advantage_sign: float, log_ratios: list[float]) -> tuple[TensorBatch, torch.Tensor, float]:
    """One sequence of tokens whose ratios are exp(log_ratios), with A^grpo of ``advantage_sign`` (a group [1, 0]
    gives the first sample A = +1/(√0.5 + 1e-6), the second the negative of it); (batch, s, |A|)."""
    n = len(log_ratios)
    old = torch.full((2, n), -1.0)
    batch = make_batch(torch.stack([torch.ones(n), torch.zeros(n)] if advantage_sign > 0 else [torch.zeros(n), torch.ones(n)]),
                       old, torch.zeros(2, n), rewards=[1.0, 0.0], groups=[0, 0])  # fmt: skip
    magnitude = float(grpo_sequence_advantages(batch)[0])
    s = old + t([log_ratios, log_ratios])
    return batch, s, magnitude


@pytest.mark.parametrize(
    ("objective", "hp"), [(grpo_objective, GRPOParams()), (sod_objective, SODParams(c_opd=0.0)), (saf_objective, SAFParams(opd_coef=0.0))]
)
def test_dual_clip_bounds_a_negative_advantage_with_a_huge_ratio(objective, hp):
    # A < 0 and ρ = e^5 ≈ 148 (a stale batch): without the bound the loss would be ρ·|A|, growing with ρ, and so would its gradient
    batch, s, magnitude = dual_clip_case(-1.0, [5.0])
    state = hp_state(objective, hp)
    loss, grad, diag = run(objective, batch, s, hp, state)
    assert hp.dual_clip == 3.0
    assert loss.item() == pytest.approx(3.0 * magnitude, abs=TOL)  # c·|A|, one token in the mean
    assert torch.all(grad == 0)
    assert diag["dual_clip_fraction"] == 1.0
    off = hp.model_copy(update={"dual_clip": None})
    loss_off, grad_off, _ = run(objective, batch, s, off, hp_state(objective, off))
    assert loss_off.item() == pytest.approx(math.exp(5.0) * magnitude, rel=1e-9)  # what the bound removes
    assert grad_off[1, 0].item() == pytest.approx(math.exp(5.0) * magnitude, rel=1e-9)


def hp_state(objective, hp):
    """A fresh schedule for SAF-OPD (its objective needs one), None for the others."""
    return METHODS.get("saf_opd").make_state(hp) if objective is saf_objective else None


@pytest.mark.parametrize(("sign", "log_ratios"), [(1.0, [5.0, 0.1, -0.5]), (-1.0, [0.1, -0.5, math.log(2.9)])])
def test_dual_clip_leaves_positive_advantages_and_ratios_below_c_unchanged(sign, log_ratios):
    batch, s, _ = dual_clip_case(sign, log_ratios)
    loss_on, grad_on, diag = run(grpo_objective, batch, s, GRPOParams())
    loss_off, grad_off, _ = run(grpo_objective, batch, s, GRPOParams(dual_clip=0))
    assert loss_on.item() == loss_off.item() and torch.equal(grad_on, grad_off)
    assert diag["dual_clip_fraction"] == 0.0


@pytest.mark.parametrize("value", [0.5, 1.0, -3.0])
def test_dual_clip_must_be_above_one_or_off(value):
    with pytest.raises(ValueError, match="dual_clip must be null or 0"):
        GRPOParams(dual_clip=value)
    assert GRPOParams(dual_clip=0).dual_clip == 0 and GRPOParams(dual_clip=None).dual_clip is None


# ----------------------------------------------------------------------------------- SOD (§2.7)

SOD_M = [[1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1]]
SOD_O = [[-0.5, -0.2, -0.8, 0, 0, -1.0, -2.0, -0.6, 0, -0.1, -0.3, -0.2]]
SOD_T = [[-0.3, -0.4, -0.5, 0, 0, -0.2, -0.4, -3.0, 0, -0.2, -0.2, -0.3]]
SOD_W2 = 0.1458339


def test_sod_worked_example_steps_divergences_weights():
    mask, o, teacher = t(SOD_M), t(SOD_O), t(SOD_T)
    assert step_spans(mask) == [[(0, 3), (5, 8), (9, 12)]]
    d, present, _ = step_divergences(o, teacher, mask)
    assert d[0].tolist() == pytest.approx([0.233333, 1.600000, 0.100000], abs=TOL)
    per_step = weights_from_divergences(d, present, eps=1e-6, delta=0.2)
    assert per_step[0].tolist() == pytest.approx([1.0, SOD_W2, 1.2], abs=TOL)
    w = step_weights(o, teacher, mask, eps=1e-6, delta=0.2)
    assert w[0].tolist() == pytest.approx([1, 1, 1, 0, 0, SOD_W2, SOD_W2, SOD_W2, 0, 1.2, 1.2, 1.2], abs=TOL)
    assert opd_advantage(o, teacher, mask)[0].tolist() == pytest.approx([0.2, -0.2, 0.3, 0, 0, 0.8, 1.6, -2.4, 0, -0.1, 0.1, -0.1], abs=TOL)


def test_sod_worked_example_fused_advantage_and_loss():
    expected = [0.7, 0.3, 0.8, 0, 0, 0.616667, 0.733334, 0.149999, 0, 0.38, 0.62, 0.38]
    fused = sod_advantages(t([0.5]), t(SOD_O), t(SOD_T), t(SOD_M), eps=1e-6, delta=0.2, c_opd=1.0)
    assert fused[0].tolist() == pytest.approx(expected, abs=TOL)
    batch = make_batch(SOD_M, SOD_O, SOD_T, rewards=[0.5])  # singleton group ⇒ A^grpo = R = 0.5
    loss, grad, diag = run(sod_objective, batch, t(SOD_O), SODParams())
    assert loss.item() == pytest.approx(-sum(expected) / 9, abs=TOL)
    assert grad[0].tolist() == pytest.approx([-a / 9 for a in expected], abs=TOL)
    assert diag["step_div_first"] == pytest.approx(0.233333, abs=TOL)
    assert diag["step_div_last"] == pytest.approx(0.1, abs=TOL)
    assert diag["steps_per_seq"] == 3.0
    assert diag["frac_steps_w_lt_half"] == pytest.approx(1 / 3)
    assert diag["step_weight_mean"] == pytest.approx((1 + SOD_W2 + 1.2) / 3, abs=TOL)
    assert diag["d1_zero_sequences"] == 0.0


def test_sod_edge_cases_single_step_recovery_and_zero_first_step():
    # single step ⇒ w = 1 (plain OPD); a later step with d_k = 0 ⇒ capped at 1 + δ
    w = step_weights(t([[-1.0, -2.0, 0.0]]), t([[-0.5, -1.0, 0.0]]), t([[1, 1, 0]]))
    assert w.tolist() == [[1.0, 1.0, 0.0]]
    w = step_weights(t([[-1.0, 0.0, -0.3]]), t([[-0.5, 0.0, -0.3]]), t([[1, 0, 1]]), delta=0.2)
    assert_close(w, [[1.0, 0.0, 1.2]])
    # d_1 = 0 and d_2 > 0 ⇒ w_2 = ε/(d_2+ε) ≈ 0, flagged
    batch = make_batch([[1, 0, 1]], [[-1.0, 0.0, -1.0]], [[-1.0, 0.0, -2.0]], rewards=[1.0])
    w = step_weights(batch.old_logprobs, batch.teacher_logprobs, batch.loss_mask)
    assert w[0, 2].item() == pytest.approx(1e-6 / (1.0 + 1e-6))
    _, _, diag = run(sod_objective, batch, batch.old_logprobs, SODParams())
    assert diag["d1_zero_sequences"] == 1.0


def test_sod_recursive_rule_clips_the_carried_product():
    d, present = t([[1.0, 0.0, 1.0]]), torch.ones(1, 3, dtype=torch.bool)
    assert weights_from_divergences(d, present, 1e-6, 0.2, "telescoped")[0].tolist() == pytest.approx([1.0, 1.2, 1.0])
    recursive = weights_from_divergences(d, present, 1e-6, 0.2, "recursive")[0].tolist()
    assert recursive == pytest.approx([1.0, 1.2, 1.2 * 1e-6 / (1 + 1e-6)])


def test_sod_step_index_option_splits_adjacent_turns():
    mask, step_index = t([[1, 1, 1, 1]]), torch.tensor([[0, 0, 1, 1]])
    assert step_spans(mask) == [[(0, 4)]]
    assert step_spans(mask, step_index) == [[(0, 2), (2, 4)]]


# ------------------------------------------------------------------------------ SAF stages 1+2 (§3.7)

SAF_O = [[-0.5, -2.5, -0.75, -0.25, -3.5, -0.25, -1.0, -0.125, -1.0, -4.0]]
SAF_T = [[-0.625, -0.5, -0.5, -0.25, -0.5, -1.75, -1.25, -0.0625, -0.5, -1.0]]
SAF_M = [[1, 1, 1, 1, 1, 1, 1, 1, 1, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_saf_worked_example_sparsify_and_compress(dtype):
    mask = t(SAF_M, dtype)
    a = opd_advantage(t(SAF_O, dtype), t(SAF_T, dtype), mask)
    assert a[0].tolist() == [-0.125, 2.0, 0.25, 0.0, 3.0, -1.5, -0.25, 0.0625, 0.5, 0.0]
    keep = sparsify(a, mask, 20)  # τ = 1.7: the −1.5 token is dropped
    assert keep[0].tolist() == [0, 1, 0, 0, 1, 0, 0, 0, 0, 0]
    compressed = compress(a, keep, 0.1)
    assert compressed[0].tolist() == pytest.approx([0, 0.0964028, 0, 0, 0.0995055, 0, 0, 0, 0, 0], abs=TOL)
    assert abs(compressed[0, 1].item() - 0.1) > 1e-3  # not the c·tanh(a/c) form
    keep50 = sparsify(a, mask, 50)  # τ = median = 0.25; ties at 0.25 kept
    assert torch.nonzero(keep50[0]).flatten().tolist() == [1, 2, 4, 5, 6, 8]
    opd_adv, keep_default = saf_opd_advantage(t(SAF_O, dtype), t(SAF_T, dtype), mask, SAFParams())
    assert torch.equal(keep_default, keep) and torch.allclose(opd_adv, compressed)


def test_sparsify_identity_outside_open_range_and_small_sequences():
    a, mask = t([[0.3, -2.0, 0.1], [5.0, 0.0, 0.0], [1.0, 2.0, 3.0]]), t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    for k in (0, 100):
        assert torch.equal(sparsify(a, mask, k), mask)
    keep = sparsify(a, mask, 20)
    assert keep.tolist() == [[0, 1, 0], [1, 0, 0], [0, 0, 0]]  # n = 1 keeps its token; n = 0 keeps nothing


def test_saf_fusion_formula():
    grpo, opd, mask = t([0.5, -1.0]), t([[0.1, 0.0], [0.0, -0.2]]), t([[1, 0], [1, 1]])
    fused = saf_advantages(grpo, opd, mask, warmup_scale=0.5, anneal_coef=0.8, opd_coef=1.0, grpo_coef=2.0)
    assert_close(fused, [[1.0 + 0.04, 0.0], [-2.0, -2.0 - 0.08]])


# ------------------------------------------------------------------------------- SAF schedule (§3.8)

TABLE_KL = [1.00, 0.95, 0.85, 0.79, 0.70]
TABLE = [(0.1, 1.0), (0.2, 1.0), (0.3, 1.0), (0.4, 1.0), (0.5, 1.0), (0.5, 0.8), (0.5, 0.6), (0.5, 0.4), (0.5, 0.2), (0.5, 0.0)]


def table_schedule() -> Schedule:
    return Schedule(warmup_steps=10, kl_drop_delta=0.2, anneal=True, anneal_min=0.0, anneal_steps=5)


def kl_at(step: int) -> float:
    return TABLE_KL[step - 1] if step <= len(TABLE_KL) else 0.6


def flat(pairs) -> list[float]:
    return [x for pair in pairs for x in pair]


def run_schedule(schedule: Schedule, steps: range) -> list[tuple[float, float]]:
    out = []
    for s in steps:
        out.append(schedule.advance())
        schedule.record_kl(kl_at(s))
    return out


def test_schedule_reproduces_worked_table():
    schedule = table_schedule()
    got = run_schedule(schedule, range(1, 11))
    assert [g[0] for g in got] == pytest.approx([e[0] for e in TABLE], abs=TOL)
    assert [g[1] for g in got] == pytest.approx([e[1] for e in TABLE], abs=TOL)
    assert [g[0] * g[1] for g in got[:6]] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.4], abs=TOL)
    assert schedule.kl_0 == 1.0 and schedule.warmup_done and schedule.early_stopped and schedule.warmup_end_step == 5


@pytest.mark.parametrize("split", [3, 6])  # middle of warm-up, middle of annealing
def test_schedule_state_dict_round_trip_continues_identically(split):
    original = table_schedule()
    run_schedule(original, range(1, split + 1))
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)  # what the checkpoint does
    buffer.seek(0)
    restored = table_schedule()
    restored.load_state_dict(torch.load(buffer, weights_only=False))
    assert restored.state_dict() == original.state_dict()
    rest = range(split + 1, 11)
    continued = run_schedule(restored, rest)
    assert continued == run_schedule(original, rest)  # bit-identical continuation
    assert flat(continued) == pytest.approx(flat(TABLE[split:]), abs=TOL)
    assert restored.state_dict() == original.state_dict()
    restarted = run_schedule(table_schedule(), rest)  # without the state the schedule restarts
    assert flat(restarted) != pytest.approx(flat(TABLE[split:]), abs=TOL)


def test_schedule_natural_end_horizon_and_disabled_warmup():
    natural = Schedule(warmup_steps=3, kl_drop_delta=0.0, anneal_steps=2)
    got = [natural.advance() for _ in range(5)]
    assert flat(got) == pytest.approx(flat([(1 / 3, 1.0), (2 / 3, 1.0), (1.0, 1.0), (1.0, 0.5), (1.0, 0.0)]))
    assert not natural.early_stopped
    remaining = table_schedule()
    remaining.anneal_total_steps = 15  # R = max(1, 15 − 5) = 10
    coefs = [c for _, c in run_schedule(remaining, range(1, 8))]
    assert coefs == pytest.approx([1.0] * 5 + [0.9, 0.8])
    code = Schedule.from_params(SAFParams(warmup=False, anneal_steps=4))  # code: anneal from step 1
    assert flat(code.advance() for _ in range(3)) == pytest.approx([1.0, 1.0, 1.0, 0.75, 1.0, 0.5])
    readme = Schedule.from_params(SAFParams(warmup_steps=0, anneal_without_warmup=False))
    assert [readme.advance() for _ in range(3)] == [(1.0, 1.0)] * 3
    floor = Schedule(warmup_steps=0, anneal_min=0.25, anneal_steps=1)
    assert [floor.advance()[1] for _ in range(3)] == pytest.approx([1.0, 0.25, 0.25])


def test_saf_objective_advances_schedule_and_records_kl():
    batch = make_batch([[1, 1, 0]], [[-1.0, -0.5, -3.0]], [[-1.5, -0.25, -0.1]], rewards=[1.0])
    hp = SAFParams(warmup_steps=4)
    state = METHODS.get("saf_opd").make_state(hp)
    _, _, diag = run(saf_objective, batch, batch.old_logprobs, hp, state)
    delta = t([-0.5, 0.25])  # T − s on the two valid tokens
    expected_kl = float((delta.exp() - delta - 1).mean())
    assert diag["warmup_scale"] == 0.25 and diag["anneal_coef"] == 1.0 and diag["warmup_done"] == 0.0
    assert diag["kl"] == pytest.approx(expected_kl) and state.last_kl == pytest.approx(expected_kl)
    assert diag["kl_drop"] == 0.0 and diag["keep_fraction"] == pytest.approx(0.5)  # top-20% of 2 tokens keeps 1
    _, _, diag = run(saf_objective, batch, batch.old_logprobs, hp, state)
    assert diag["warmup_scale"] == 0.5 and state.kl_0 == pytest.approx(expected_kl)
    with pytest.raises(TypeError, match="Schedule"):
        saf_objective(batch, StudentOutputs(batch.old_logprobs), hp, None)


# ------------------------------------------------------------------------------ shared properties

METHOD_CASES = {
    "grpo": (grpo_objective, GRPOParams()),
    "sod": (sod_objective, SODParams()),
    "saf_opd": (saf_objective, SAFParams(warmup_steps=10)),
}


def fresh_state(name: str):
    """SAF: a schedule at step 4 of 10 (warm-up scale 0.4) so that every call sees the same coefficients."""
    if name != "saf_opd":
        return None
    schedule = Schedule.from_params(METHOD_CASES[name][1])
    for _ in range(3):
        schedule.advance()
    return schedule


@st.composite
def batches(draw, max_b: int = 3, max_l: int = 8):
    """Random (mask, o, T, s, rewards, groups) plus replacement values for the masked positions."""
    b, length = draw(st.integers(1, max_b)), draw(st.integers(1, max_l))
    logp = hnp.arrays(np.float64, (b, length), elements=st.floats(-6.0, 0.0))
    mask = draw(hnp.arrays(np.float64, (b, length), elements=st.sampled_from([0.0, 1.0])))
    o, teacher, other_o, other_t, other_s = (draw(logp) for _ in range(5))
    shift = draw(hnp.arrays(np.float64, (b, length), elements=st.floats(-0.4, 0.4)))
    rewards = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=b, max_size=b))
    groups = draw(st.lists(st.integers(0, 1), min_size=b, max_size=b))
    return mask, o, teacher, o + shift, rewards, groups, (other_o, other_t, other_s)


@settings(max_examples=60, deadline=None)
@given(batches(), st.floats(0.0, 1.0))
def test_sod_weights_finite_bounded_zero_when_masked(data, delta):
    mask, o, teacher, *_ = data
    w = step_weights(t(o), t(teacher), t(mask), eps=1e-6, delta=delta)
    assert torch.isfinite(w).all()
    assert (w >= 0).all() and (w <= 1 + delta + 1e-12).all()
    assert (w[t(mask) == 0] == 0).all()
    for b, spans in enumerate(step_spans(t(mask))):
        for k, (start, end) in enumerate(spans):
            assert torch.all(w[b, start:end] == (1.0 if k == 0 else w[b, start]))  # constant in a step, w_1 = 1


@settings(max_examples=60, deadline=None)
@given(batches(), st.floats(0.0, 100.0), st.floats(0.01, 2.0))
def test_saf_keep_within_mask_and_compress_bounded(data, k, c):
    mask, o, teacher, *_ = data
    mask_t = t(mask)
    a = opd_advantage(t(o), t(teacher), mask_t)
    keep = sparsify(a, mask_t, k)
    assert torch.all(keep <= mask_t)
    assert torch.all((keep.sum(1) > 0) == (mask_t.sum(1) > 0))  # the largest |a| always survives
    compressed = compress(a, keep, c)
    assert torch.all(compressed.abs() <= c) and torch.all(compressed[keep == 0] == 0)


@pytest.mark.parametrize("name", sorted(METHOD_CASES))
@settings(max_examples=40, deadline=None)
@given(data=batches())
def test_masked_positions_never_change_loss_or_gradient(name, data):
    objective, hp = METHOD_CASES[name]
    mask, o, teacher, s, rewards, groups, (other_o, other_t, other_s) = data
    masked = mask == 0
    results = []
    for o_, t_, s_ in ((o, teacher, s), (np.where(masked, other_o, o), np.where(masked, other_t, teacher), np.where(masked, other_s, s))):
        batch = make_batch(mask, o_, t_, rewards=rewards, groups=groups, behaviour=np.where(masked, other_s, o))
        results.append(run(objective, batch, t(s_), hp, fresh_state(name)))
    (loss_a, grad_a, diag_a), (loss_b, grad_b, diag_b) = results
    assert loss_a.item() == pytest.approx(loss_b.item(), abs=1e-12)
    assert torch.allclose(grad_a, grad_b, atol=1e-12, rtol=0)
    assert torch.all(grad_a[t(mask) == 0] == 0)
    assert diag_a == pytest.approx(diag_b, abs=1e-9)


@pytest.mark.parametrize("name", sorted(METHOD_CASES))
def test_empty_mask_gives_zero_loss_without_nan(name):
    objective, hp = METHOD_CASES[name]
    batch = make_batch([[0, 0, 0], [0, 0, 0]], [[-1.0, -2.0, -0.5]] * 2, [[-3.0, -0.1, -0.5]] * 2, rewards=[1.0, 0.0], groups=[0, 0])
    loss, grad, diag = run(objective, batch, t([[-1.2, -1.8, -0.4]] * 2), hp, fresh_state(name))
    assert loss.item() == 0.0 and torch.all(grad == 0)
    assert all(math.isfinite(v) for v in diag.values()), diag


def test_student_equal_teacher_gives_zero_opd_advantage():
    logp, mask = t([[-0.7, -1.2, -0.1, -2.0]]), t([[1, 1, 0, 1]])
    assert torch.all(sod_advantages(t([0.0]), logp, logp, mask) == 0)
    assert step_weights(logp, logp, mask).tolist() == [[1.0, 1.0, 0.0, 1.0]]  # all d_k = 0 ⇒ ratio 1
    opd_adv, _ = saf_opd_advantage(logp, logp, mask, SAFParams())
    assert torch.all(opd_adv == 0)
    batch = make_batch(mask, logp, logp)  # rewards NaN: the pure-OPD runs must not read them
    for name, objective, hp in (("sod", sod_objective, SODParams(grpo_coef=0.0)), ("saf_opd", saf_objective, SAFParams(grpo_coef=0.0))):
        loss, grad, diag = run(objective, batch, logp, hp, fresh_state(name))
        assert loss.item() == 0.0 and torch.all(grad == 0), name


@pytest.mark.parametrize("name", sorted(METHOD_CASES))
def test_gradcheck_wrt_current_student_logprobs(name):
    objective, hp = METHOD_CASES[name]
    gen = torch.Generator().manual_seed(0)
    mask = t([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]])
    o = -torch.rand(2, 5, generator=gen, dtype=F64) * 3
    teacher = -torch.rand(2, 5, generator=gen, dtype=F64) * 3
    s = (o + (torch.rand(2, 5, generator=gen, dtype=F64) - 0.5) * 0.1).requires_grad_(True)  # |s − o| ≤ 0.05: away from clip
    batch = make_batch(mask, o, teacher, rewards=[1.0, 0.0], groups=[0, 0])

    def loss(s_: torch.Tensor) -> torch.Tensor:
        return objective(batch, StudentOutputs(s_), hp, fresh_state(name))[0]

    assert torch.autograd.gradcheck(loss, (s,), eps=1e-6, atol=1e-7)


# ------------------------------------------------------------------- grading errors (NaN rewards)

NAN = float("nan")
# group 0 = rows 0-3 (row 1's grading errored), group 1 = rows 4-5; ERRORED is dropped for the "without" batch
ERR_MASK = [[1, 1, 0], [1, 1, 1], [0, 1, 1], [1, 0, 1], [1, 1, 1], [1, 0, 0]]
ERR_O = [[-1.0, -0.5, -2.0], [-0.3, -1.0, -0.8], [-0.7, -0.2, -0.9], [-1.1, -0.4, -0.6], [-0.2, -1.5, -0.3], [-0.9, -0.1, -1.0]]
ERR_T = [[-0.4, -0.9, -1.0], [-1.3, -0.2, -0.1], [-0.5, -0.6, -1.9], [-0.8, -0.3, -0.2], [-0.6, -0.9, -1.1], [-0.1, -0.7, -0.4]]
ERR_R, ERR_G, ERRORED = [1.0, NAN, 0.0, 1.0, 0.0, 1.0], [0, 0, 0, 0, 1, 1], 1
KEEP = [b for b in range(6) if b != ERRORED]


def errored_and_without():
    """The batch with row 1 ungradeable (NaN reward), and the same batch without row 1."""
    with_error = make_batch(ERR_MASK, ERR_O, ERR_T, rewards=ERR_R, groups=ERR_G)
    mask, old, teacher = ([row[b] for b in KEEP] for row in (ERR_MASK, ERR_O, ERR_T))
    without = make_batch(mask, old, teacher, rewards=[ERR_R[b] for b in KEEP], groups=[ERR_G[b] for b in KEEP])
    return with_error, without


def test_grpo_advantages_leave_an_errored_sample_out_of_its_group():
    rewards = t([1.0, NAN, 0.0, 1.0, NAN, 0.5, NAN])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    a = grpo_advantages(rewards, groups)
    expected_group_0 = grpo_advantages(t([1.0, 0.0, 1.0]), torch.zeros(3, dtype=torch.long))  # the group without its error
    assert_close(a[[0, 2, 3]], expected_group_0)
    assert a[1] == 0 and a[4] == 0 and a[6] == 0  # errors get no advantage
    assert a[5] == 0  # the last graded member of a larger group has no baseline: 0, not its raw reward
    assert torch.isfinite(a).all()
    assert grpo_advantages(t([0.5]), torch.tensor([0])).tolist() == [0.5]  # a true singleton keeps the verl convention


def test_grpo_errored_sample_changes_nothing_for_the_others_and_gets_no_gradient():
    with_error, without = errored_and_without()
    loss_e, grad_e, diag_e = run(grpo_objective, with_error, t(ERR_O), GRPOParams())
    loss_w, grad_w, diag_w = run(grpo_objective, without, without.old_logprobs, GRPOParams())
    assert math.isfinite(loss_e.item()) and loss_e.item() == pytest.approx(loss_w.item(), abs=1e-12)
    assert_close(grad_e[KEEP], grad_w, atol=1e-12)
    assert torch.all(grad_e[ERRORED] == 0)
    assert diag_e["reward_mean"] == pytest.approx(diag_w["reward_mean"]) == pytest.approx(3 / 5)  # errors are not zeros
    assert diag_e["tokens"] == diag_w["tokens"]


@pytest.mark.parametrize("name", ["sod", "saf_opd"])
def test_fused_methods_keep_only_the_opd_term_of_an_errored_sample(name):
    """SOD/SAF: the errored sample still gets its OPD advantage (no reward needed) but no GRPO term, and the
    others' advantages are those of the batch without it (same token-mean denominator up to its tokens)."""
    objective, hp = METHOD_CASES[name]
    with_error, without = errored_and_without()
    _, grad_e, diag_e = run(objective, with_error, t(ERR_O), hp, fresh_state(name))  # s = o: grad_t = −A_t / Σm
    _, grad_w, _ = run(objective, without, without.old_logprobs, hp, fresh_state(name))
    _, grad_opd_only, _ = run(objective, with_error, t(ERR_O), hp.model_copy(update={"grpo_coef": 0.0}), fresh_state(name))
    n_e, n_w = with_error.loss_mask.sum(), without.loss_mask.sum()
    assert torch.isfinite(grad_e).all()
    assert_close(grad_e[KEEP] * n_e, grad_w * n_w, atol=1e-12)  # per-token advantages of the others unchanged
    assert_close(grad_e[ERRORED], grad_opd_only[ERRORED], atol=1e-12)  # no reward gradient, its OPD one intact
    assert diag_e["reward_mean"] == pytest.approx(3 / 5)


# --------------------------------------------------------------------------------- registration


def test_methods_registered_with_declared_inputs():
    assert {"grpo", "sod", "saf_opd"} <= set(METHODS.names())
    assert grpo_needs(GRPOParams()) == {"rewards", "behaviour_logprobs", "old_logprobs"}
    assert sod_needs(SODParams()) == {"rewards", "teacher_logprobs", "behaviour_logprobs", "old_logprobs", "step_boundaries"}
    assert saf_needs(SAFParams()) == {"rewards", "teacher_logprobs", "behaviour_logprobs", "old_logprobs"}
    assert "rewards" not in sod_needs(SODParams(grpo_coef=0.0)) | saf_needs(SAFParams(grpo_coef=0.0))
    spec = METHODS.get("saf_opd")
    assert spec.describe()["stateful"] and spec.notes
    defaults = SAFParams()
    assert (defaults.topk_percent, defaults.tanh_coef, defaults.warmup_steps, defaults.kl_drop_delta) == (20.0, 0.1, 100, 0.2)
    assert (defaults.anneal_min, defaults.anneal_steps, defaults.anneal_total_steps) == (0.0, 200, 0)
    assert SODParams().delta == 0.2 and GRPOParams().clip_high == 0.28
    assert copy.deepcopy(Schedule.from_params(defaults)).state_dict()["step"] == 0


def test_sod_uniform_weights_is_the_grpo_plus_sampled_opd_fusion():
    """`weights: uniform` (every w_k = 1) is the paper's OPD baseline L_GRPO + L_OPD (App. B.3): the group-normalised
    reward advantage plus the sampled-token OPD advantage T − o on every model token, under one PPO clip (dual clip c for
    A < 0), token-mean. The reference is written out here from those definitions, not from the project's helpers."""
    gen = torch.Generator().manual_seed(7)
    mask = t([[0, 1, 1, 0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 1, 1, 0], [0, 1, 0, 1, 1, 0, 1, 0, 0],
              [0, 1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 1, 1, 1, 1], [0, 1, 1, 0, 1, 1, 0, 0, 0]])  # fmt: skip
    old = -torch.rand(mask.shape, generator=gen, dtype=F64) * 3 * mask
    teacher = -torch.rand(mask.shape, generator=gen, dtype=F64) * 3 * mask
    s = old + (torch.rand(mask.shape, generator=gen, dtype=F64) - 0.5) * 1.6 * mask  # ratios far from 1: the clips act
    s[2, 3] = old[2, 3] + 2.0  # ratio e² > c = 3 on a token whose fused advantage is negative: the dual clip acts
    teacher[2, 3] = old[2, 3] - 3.0
    rewards, groups = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0], [0, 0, 0, 0, 1, 1]
    batch = make_batch(mask, old, teacher, rewards=rewards, groups=groups)
    hp = SODParams(weights="uniform")

    r, g = torch.tensor(rewards, dtype=F64), torch.tensor(groups)
    a_grpo = torch.zeros(6, dtype=F64)
    for group in (0, 1):
        members = g == group
        a_grpo[members] = (r[members] - r[members].mean()) / (r[members].std(unbiased=True) + 1e-6)
    advantage = a_grpo[:, None] * mask + (teacher - old) * mask
    s_ref = s.clone().requires_grad_(True)
    ratio = torch.exp(s_ref - old)
    per_token = -torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - hp.clip_low, 1 + hp.clip_high) * advantage)
    per_token = torch.where(advantage < 0, torch.minimum(per_token, -hp.dual_clip * advantage), per_token)
    expected = (per_token * mask).sum() / mask.sum()
    expected.backward()
    assert float(torch.clamp(ratio, 1 - hp.clip_low, 1 + hp.clip_high).ne(ratio)[mask > 0].float().mean()) > 0.2
    assert float(ratio[2, 3]) > hp.dual_clip and float(advantage[2, 3]) < 0

    loss, grad, diag = run(sod_objective, batch, s, hp)  # rewards are float32 in a TensorBatch: its GRPO statistics too
    assert_close(loss, expected.detach(), atol=1e-8)
    assert_close(grad, s_ref.grad, atol=1e-8)
    assert diag["step_weight_mean"] == 1.0 and diag["frac_steps_w_lt_half"] == 0.0
    # the default (adaptive) weights differ on this batch: the option is what makes them equal
    adaptive_loss, _, _ = run(sod_objective, batch, s, SODParams())
    assert abs(float(adaptive_loss) - float(expected)) > 1e-3


def test_sod_uniform_without_grpo_is_naive_sampled_opd_at_one_update_per_step():
    """The sod recipe's 'naive OPD' arm (App. C.3), `sod` with uniform weights and no GRPO, has the gradient of `opd` with
    the sampled-token estimator where the batch was sampled from the current student (ratio 1: one update per step)."""
    from opd_harness.trainers.objectives.opd import OPDParams, opd_objective

    gen = torch.Generator().manual_seed(3)
    mask = t([[0, 1, 1, 0, 1, 1], [1, 1, 0, 0, 1, 0], [0, 1, 1, 1, 1, 1]])
    old = -torch.rand(mask.shape, generator=gen, dtype=F64) * 3 * mask
    teacher = -torch.rand(mask.shape, generator=gen, dtype=F64) * 3 * mask
    batch = make_batch(mask, old, teacher)
    _, g_sod, _ = run(sod_objective, batch, old, SODParams(weights="uniform", grpo_coef=0.0))
    _, g_opd, _ = run(opd_objective, batch, old, OPDParams(estimator="sampled"))
    assert g_opd.abs().max() > 0.01
    assert_close(g_sod, g_opd, atol=1e-12)
