"""The AsyncOPD baselines (opd_forward_kl, opd_recompute) against references computed here, teacher re-scoring at update
time (f-OPD's T^fresh and D_sup), and verl-style per-trajectory staleness accounting."""

import json
import math
import sqlite3

import pytest
import torch
from typer.testing import CliRunner

from batches import make_batch
from opd_harness.cli import app
from opd_harness.leaderboard import leaderboard_rows, render_markdown
from opd_harness.method import StudentOutputs
from opd_harness.registry import METHODS
from opd_harness.store import Store
from opd_harness.teacher_signal import TopKDistribution
from opd_harness.tracking import step_key
from opd_harness.trajectory import Segment, Trajectory, to_tensor_batch
from opd_harness.trainers.objectives.f_opd import AsyncOPDParams, FOPDParams, f_opd_objective, opd_async_objective, supervision_drift
from opd_harness.trainers.objectives.forward_kl import ForwardKLParams, forward_kl_objective
from opd_harness.trainers.objectives.opd import OPDParams, opd_objective
from opd_harness.trainers.objectives.opd_recompute import RecomputeParams, recompute_objective
from opd_harness.trainers.pipeline import staleness_metrics
from opd_harness.trainers.teacher import rescore_teacher, score_teacher

runner = CliRunner()


def test_both_baselines_are_registered_methods():
    assert METHODS.get("opd_forward_kl").objective is forward_kl_objective
    assert METHODS.get("opd_recompute").objective is recompute_objective
    assert METHODS.get("opd_forward_kl").accepted_signals(ForwardKLParams()) == ("full", "topk", "student_topk")
    assert METHODS.get("opd_recompute").accepted_signals(RecomputeParams()) == ("sampled",)


# --------------------------------------------------------------------------------------------- forward KL


def dense_case(seed: int = 0, b: int = 2, t: int = 4, v: int = 7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2, -1)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float64)
    return logits, teacher, mask


def test_forward_kl_equals_the_dense_sum_and_its_gradient_is_p_student_minus_p_teacher():
    logits, teacher, mask = dense_case()
    student_log = torch.log_softmax(logits, -1)
    batch = make_batch(mask, torch.zeros_like(mask), torch.zeros_like(mask), teacher_dist=teacher, dtype=torch.float64)
    loss, diag = forward_kl_objective(batch, StudentOutputs(logprobs=student_log[..., 0], full=student_log), ForwardKLParams())
    # reference by explicit loops: Σ_v p_T(v)(log p_T(v) − log p_S(v)) per valid position, mean over the 6 valid positions
    total, n = 0.0, 0
    for i in range(2):
        for j in range(4):
            if mask[i, j]:
                p_t = teacher[i, j].exp()
                total += float(sum(p_t[k] * (teacher[i, j, k] - student_log.detach()[i, j, k]) for k in range(7)))
                n += 1
    assert float(loss) == pytest.approx(total / n, rel=1e-12)
    assert diag["forward_kl"] == pytest.approx(total / n, rel=1e-12)
    loss.backward()
    expected = (torch.softmax(logits.detach(), -1) - teacher.exp()) * mask[..., None] / n  # d KL(p_T‖softmax z)/dz = p_S − p_T
    assert torch.allclose(logits.grad, expected, atol=1e-12)


def test_forward_kl_on_a_top_k_signal_is_the_kl_of_the_k_plus_tail_buckets():
    logits, teacher, mask = dense_case(1)
    student_log = torch.log_softmax(logits, -1)
    top = teacher.topk(3, dim=-1)
    signal = TopKDistribution(top.indices, top.values.float())
    batch = make_batch(mask, torch.zeros_like(mask), torch.zeros_like(mask), teacher_dist=signal, dtype=torch.float64)
    loss, _ = forward_kl_objective(batch, StudentOutputs(logprobs=student_log[..., 0], full=student_log), ForwardKLParams())
    total, n = 0.0, 0
    for i in range(2):
        for j in range(4):
            if not mask[i, j]:
                continue
            ids = top.indices[i, j].tolist()
            p_t = [math.exp(float(top.values[i, j, k].float())) for k in range(3)]
            p_s = [math.exp(float(student_log[i, j, idx])) for idx in ids]
            p_t.append(1 - sum(p_t))
            p_s.append(1 - sum(p_s))
            total += sum(a * (math.log(a) - math.log(c)) for a, c in zip(p_t, p_s))
            n += 1
    assert float(loss) == pytest.approx(total / n, rel=1e-5)


def test_forward_kl_at_qwen_vocabulary_with_chunking_matches_the_unchunked_loss_and_gradient():
    """V = 151,936 with a tiny hidden size: the learner's chunked map (trainer.vocab_chunk) against the whole distribution."""
    from contextlib import nullcontext

    from opd_harness.trainers.chunked_vocab import ChunkedVocabulary

    vocab, hidden, b, t = 151_936, 8, 2, 6
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.5)
    states = torch.randn(b, t, hidden, generator=g, requires_grad=True)
    teacher = torch.log_softmax(3 * torch.randn(b, t, vocab, generator=g), -1)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.float32)  # mixed lengths
    batch = make_batch(mask, torch.zeros_like(mask), torch.zeros_like(mask), teacher_dist=teacher)
    # position t is predicted from hidden state t − 1 (position 0 has no prefix)
    full = torch.cat([torch.zeros(b, 1, vocab), torch.log_softmax(head(states[:, :-1]), -1)], dim=1)
    dense_loss, _ = forward_kl_objective(batch, StudentOutputs(logprobs=full[..., 0], full=full), ForwardKLParams())
    (dense_grad,) = torch.autograd.grad(dense_loss, states)
    chunks = ChunkedVocabulary(states, head, 2, nullcontext)
    chunked_loss, _ = forward_kl_objective(batch, StudentOutputs(logprobs=full[..., 0].detach(), vocab_map=chunks.map), ForwardKLParams())
    (chunked_grad,) = torch.autograd.grad(chunked_loss, states)
    assert float(dense_loss) > 0.1
    assert float(chunked_loss) == pytest.approx(float(dense_loss), rel=1e-5)
    assert torch.allclose(chunked_grad, dense_grad, atol=1e-6)


# --------------------------------------------------------------------------------------------- recompute


def test_recompute_gradient_is_ratio_times_current_log_ratio_per_token():
    s = torch.tensor([[-0.5, -1.2, -2.0], [-0.1, -0.7, -3.0]], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([[-0.9, -1.0, -1.5], [-0.3, -0.2, -2.5]], dtype=torch.float64)
    teacher = torch.tensor([[-0.2, -2.0, -1.0], [-1.5, -0.4, -0.9]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    batch = make_batch(mask, q, teacher, dtype=torch.float64)
    loss, _ = recompute_objective(batch, StudentOutputs(logprobs=s), RecomputeParams(kl_coef=0.5))
    loss.backward()
    for i in range(2):
        for j in range(3):
            ratio = math.exp(float(s[i, j] - q[i, j]))
            expected = 0.5 * ratio * float(s[i, j] - teacher[i, j]) / 5 if mask[i, j] else 0.0  # d/ds of −ρ·A, A = −c(sg(s) − T)
            assert float(s.grad[i, j]) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    ratios = [math.exp(float(s[i, j] - q[i, j])) for i in range(2) for j in range(3) if mask[i, j]]
    values = [0.5 * r * float(s[i, j] - teacher[i, j]) for r, (i, j) in zip(ratios, [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)])]
    assert float(loss) == pytest.approx(sum(values) / 5, rel=1e-12)


def test_recompute_is_the_exact_reverse_kl_gradient_in_expectation_over_a_stale_sampler_and_opd_is_not():
    """Enumerate every token of one position: Σ_y q(y)·∇θ loss(y) against the dense ∇θ KL(π_θ ‖ π_T) by autograd."""
    g = torch.Generator().manual_seed(3)
    v = 6
    theta = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    behaviour = torch.log_softmax(torch.randn(v, generator=g, dtype=torch.float64), -1)  # a stale student q ≠ π_θ
    teacher = torch.log_softmax(torch.randn(v, generator=g, dtype=torch.float64), -1)
    def dense_kl_grad(target: torch.Tensor) -> torch.Tensor:  # ∇θ KL(π_θ ‖ target), summed over the vocabulary
        return torch.autograd.grad((theta.softmax(-1) * (torch.log_softmax(theta, -1) - target)).sum(), theta)[0]

    dense = dense_kl_grad(teacher)

    def expected_grad(objective, hp) -> torch.Tensor:
        total = torch.zeros(v, dtype=torch.float64)
        for y in range(v):
            s = torch.log_softmax(theta, -1)[y].reshape(1, 1)
            batch = make_batch([[1.0]], behaviour[y].reshape(1, 1), teacher[y].reshape(1, 1), dtype=torch.float64)
            loss, _ = objective(batch, StudentOutputs(logprobs=s), hp)
            total += behaviour[y].exp() * torch.autograd.grad(loss, theta)[0]
        return total

    assert torch.allclose(expected_grad(recompute_objective, RecomputeParams()), dense, atol=1e-12)
    stale = expected_grad(opd_objective, OPDParams())  # opd's reward −(q − T) from the stale sampler is biased:
    assert torch.allclose(stale, dense - dense_kl_grad(behaviour), atol=1e-12)  # ∇KL(π_θ‖π_T) − ∇KL(π_θ‖q): away from q
    assert not torch.allclose(stale, dense, atol=1e-3)


def test_recompute_with_asyncopds_clip_drops_exactly_the_tokens_ppo_clips():
    """clip_eps: max(−ρA, −clip(ρ, 1 − ε, 1 + ε)A) with A = −(sg(s) − T), AsyncOPD's policy_gradient_kl with online
    advantages. Four tokens, one per case: ρ above 1 + ε with A > 0 and ρ below 1 − ε with A < 0 lose their gradient;
    ρ above 1 + ε with A < 0 and ρ inside the clip keep the unclipped one, ρ(s − T) / Σm."""
    s = torch.tensor([[-0.5, -2.0, -0.5, -1.0]], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([[-1.0, -1.0, -1.0, -1.05]], dtype=torch.float64)  # ρ = e^0.5, e^−1, e^0.5, e^0.05
    teacher = torch.tensor([[-2.0, -3.0, 0.0, -2.0]], dtype=torch.float64)  # A = −(s − T) = −1.5, −1, +0.5, −1
    batch = make_batch([[1, 1, 1, 1]], q, teacher, dtype=torch.float64)
    loss, diag = recompute_objective(batch, StudentOutputs(logprobs=s), RecomputeParams(clip_eps=0.2))
    loss.backward()
    rho = [math.exp(float(a - b)) for a, b in zip(s[0].detach(), q[0])]
    adv = [-(float(a) - float(t)) for a, t in zip(s[0].detach(), teacher[0])]
    expected = [rho[0] * -adv[0] / 4, 0.0, 0.0, rho[3] * -adv[3] / 4]
    assert s.grad[0].tolist() == pytest.approx(expected, abs=1e-15)
    values = [-rho[0] * adv[0], -0.8 * adv[1], -1.2 * adv[2], -rho[3] * adv[3]]  # the larger of the two terms
    assert float(loss) == pytest.approx(sum(values) / 4, rel=1e-12)
    assert diag["clip_fraction"] == 0.5
    unclipped, _ = recompute_objective(batch, StudentOutputs(logprobs=s), RecomputeParams())
    assert torch.autograd.grad(unclipped, s)[0].abs().min() > 0  # without the clip every token has a gradient


def test_recompute_equals_opd_on_fresh_samples():
    s = torch.tensor([[-0.5, -1.2], [-0.1, -0.7]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[-0.2, -2.0], [-1.5, -0.4]], dtype=torch.float64)
    batch = make_batch([[1, 1], [1, 0]], s.detach(), teacher, dtype=torch.float64)  # behaviour = current student (lag 0)
    ours, _ = recompute_objective(batch, StudentOutputs(logprobs=s), RecomputeParams())
    theirs, _ = opd_objective(batch, StudentOutputs(logprobs=s), OPDParams())
    assert float(ours) == pytest.approx(float(theirs), rel=1e-12)
    assert torch.allclose(torch.autograd.grad(ours, s)[0], torch.autograd.grad(theirs, s)[0], atol=1e-15)


def fixed_batch(lag: int, dtype=torch.float64):
    """One batch of sampled tokens from a 7-token vocabulary: rows of 4 valid tokens (equal lengths, so that opd's token
    mean and the f-OPD family's mean of per-sample means coincide), the student's log-probs s (a leaf), a behaviour q that
    is s itself at lag 0 and a drifted student otherwise, and the teacher's T."""
    g = torch.Generator().manual_seed(11)
    b, t, v = 3, 4, 7
    current = torch.log_softmax(torch.randn(b, t, v, generator=g, dtype=dtype), -1)
    old = torch.log_softmax(torch.log_softmax(current, -1) + 0.8 * torch.randn(b, t, v, generator=g, dtype=dtype), -1)
    teacher = torch.log_softmax(2 * torch.randn(b, t, v, generator=g, dtype=dtype), -1)
    tokens = torch.randint(0, v, (b, t), generator=g)

    def pick(logp: torch.Tensor) -> torch.Tensor:
        return logp.gather(-1, tokens[..., None]).squeeze(-1)

    s = pick(current).clone().requires_grad_(True)
    q = s.detach().clone() if lag == 0 else pick(old)
    batch = make_batch(torch.ones(b, t), q, pick(teacher), lag=[lag] * b, dtype=dtype)
    return batch, s


def loss_and_grad(objective, hp, batch, s):
    loss, _ = objective(batch, StudentOutputs(logprobs=s), hp)
    return loss, torch.autograd.grad(loss, s)[0]


REDUCED_F_OPD = FOPDParams(alpha=0.0, beta=0.0, renormalise=True, anchor_coef=0.0, kappa_roll=1e9, kappa_sup=1e9, kappa_f=0.0)
"""f-OPD with its controls off: with no drift terms every sample of one common lag has the same f, so renormalised weights
are 1; λ = 0; κ so wide that every valid token is kept; no refresh."""


def test_at_lag_zero_recompute_opd_opd_async_and_reduced_f_opd_give_one_gradient():
    """Fresh samples (q = s): the sampled reverse-KL gradient (s − T)∇s / Σm is the same for every objective, with or
    without AsyncOPD's clip (ρ = 1 is inside it); recompute's loss value is opd's too."""
    batch, s = fixed_batch(lag=0)
    opd_loss, opd_grad = loss_and_grad(opd_objective, OPDParams(), batch, s)
    expected = (s.detach() - batch.teacher_logprobs) / batch.loss_mask.sum()
    assert torch.allclose(opd_grad, expected, atol=1e-15)
    for hp in (RecomputeParams(), RecomputeParams(clip_eps=0.2), RecomputeParams(ratio_cap=2.0)):
        loss, grad = loss_and_grad(recompute_objective, hp, batch, s)
        assert float(loss) == pytest.approx(float(opd_loss), rel=1e-12)
        assert torch.allclose(grad, opd_grad, atol=1e-15)
    for objective, hp in ((opd_async_objective, AsyncOPDParams()), (f_opd_objective, REDUCED_F_OPD)):
        assert torch.allclose(loss_and_grad(objective, hp, batch, s)[1], opd_grad, atol=1e-15)


def test_f_opd_with_its_controls_off_is_opd_async_on_a_stale_batch():
    batch, s = fixed_batch(lag=5)
    assert float((s.detach() - batch.behaviour_logprobs).abs().max()) > 0.5  # stale: f-OPD's default κ would drop tokens
    ours, our_grad = loss_and_grad(f_opd_objective, REDUCED_F_OPD, batch, s)
    theirs, their_grad = loss_and_grad(opd_async_objective, AsyncOPDParams(), batch, s)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-12)
    assert torch.allclose(our_grad, their_grad, atol=1e-15)
    default, _ = loss_and_grad(f_opd_objective, FOPDParams(), batch, s)  # the controls on: a different loss
    assert abs(float(default) - float(theirs)) > 1e-3


def test_expected_gradients_of_the_async_surrogates_under_a_stale_sampler():
    """Exact enumeration at one position (student softmax(θ), stale behaviour q, teacher T): Σ_y q(y)·∇θ loss(y) for each
    objective against closed forms. Only unclipped recompute is ∇KL(π_θ ‖ T); opd_async (and f-OPD with its controls
    off) follow ∇θ ½·E_q[(log π_θ − log T)²], whose minimum is still π_θ = T; AsyncOPD's clip biases recompute."""
    g = torch.Generator().manual_seed(3)
    v = 6
    theta = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    behaviour = torch.log_softmax(theta.detach() + 1.5 * torch.randn(v, generator=g, dtype=torch.float64), -1)
    teacher = torch.log_softmax(torch.randn(v, generator=g, dtype=torch.float64), -1)

    def expected_grad(objective, hp) -> torch.Tensor:
        total = torch.zeros(v, dtype=torch.float64)
        for y in range(v):
            s = torch.log_softmax(theta, -1)[y].reshape(1, 1)
            batch = make_batch([[1.0]], behaviour[y].reshape(1, 1), teacher[y].reshape(1, 1), lag=[3], dtype=torch.float64)
            loss, _ = objective(batch, StudentOutputs(logprobs=s), hp)
            total += behaviour[y].exp() * torch.autograd.grad(loss, theta)[0]
        return total

    log_pi = torch.log_softmax(theta, -1)
    reverse_kl = torch.autograd.grad((log_pi.exp() * (log_pi - teacher)).sum(), theta, retain_graph=True)[0]
    squared = torch.autograd.grad(0.5 * (behaviour.exp() * (log_pi - teacher) ** 2).sum(), theta)[0]
    assert torch.allclose(expected_grad(recompute_objective, RecomputeParams()), reverse_kl, atol=1e-12)
    for objective, hp in ((opd_async_objective, AsyncOPDParams()), (f_opd_objective, REDUCED_F_OPD)):
        got = expected_grad(objective, hp)
        assert torch.allclose(got, squared, atol=1e-12)
        assert not torch.allclose(got, reverse_kl, atol=1e-3)
    clipped = expected_grad(recompute_objective, RecomputeParams(clip_eps=0.2))
    assert not torch.allclose(clipped, reverse_kl, atol=1e-3)


# --------------------------------------------------------------------------------------------- teacher re-scoring


def trajectory(prompt: list[int], segments: list[tuple[str, list[int]]], version: int = 0) -> Trajectory:
    model = [kind == "model" for kind, _ in segments]
    parts = [Segment(kind, ids, step=i if model[i] else None, policy_version=version if model[i] else None,
                     behaviour_logprobs=[0.0] * len(ids) if model[i] else None) for i, (kind, ids) in enumerate(segments)]  # fmt: skip
    return Trajectory("t", "p", 0, prompt, segments=parts)


def test_rescored_teacher_makes_supervision_drift_nonzero_exactly_where_the_context_changed(tiny_model_factory, char_tokenizer):
    from opd_harness.backends.hf import HFBackend

    teacher = HFBackend(tiny_model_factory(seed=5), char_tokenizer)
    env_before, env_after = [7, 8, 9], [12, 13, 14]  # an observation that differs between rollout time and update time
    rows = [
        trajectory([3, 4, 5], [("model", [10, 11]), ("env", env_before), ("model", [15, 16, 17])]),
        trajectory([3, 4, 6], [("model", [20, 21, 22]), ("env", [7, 7]), ("model", [23, 24])]),
    ]
    batch = to_tensor_batch(rows, char_tokenizer.pad_token_id)
    score_teacher(teacher, batch)  # T^stale, at rollout time
    rows[0].segments[1].token_ids = env_after  # row 0's context changes before the update, row 1's does not
    updated = to_tensor_batch(rows, char_tokenizer.pad_token_id)
    updated.teacher_logprobs = batch.teacher_logprobs
    fresh = rescore_teacher(teacher, updated)
    d_sup = supervision_drift(updated.teacher_logprobs, fresh, updated.loss_mask)
    assert float(d_sup[1]) == 0.0 and torch.equal(fresh[1], batch.teacher_logprobs[1])
    assert float(d_sup[0]) > 1e-4
    first_model = slice(3, 5)  # row 0's first turn precedes the changed observation: same prefix, same teacher log-probs
    assert torch.equal(fresh[0, first_model], batch.teacher_logprobs[0, first_model])
    assert not torch.allclose(fresh[0, 8:11], batch.teacher_logprobs[0, 8:11])
    assert float(supervision_drift(updated.teacher_logprobs, None, updated.loss_mask).abs().sum()) == 0.0  # no re-score: 0


def test_rescore_option_declares_the_fresh_teacher_input():
    for name in ("f_opd", "opd_async", "opd_kl", "opd_clipped_iw", "opd_lag_only", "opd_hard_refresh"):
        spec = METHODS.get(name)
        assert "teacher_fresh_logprobs" not in spec.needs(spec.hparams())
        assert "teacher_fresh_logprobs" in spec.needs(spec.hparams(rescore_teacher=True))
    assert FOPDParams(rescore_teacher=True).rescore_teacher and not AsyncOPDParams().rescore_teacher


# --------------------------------------------------------------------------------------------- staleness accounting


def test_staleness_metrics_follow_verls_definitions_on_mixed_version_trajectories():
    rows = [
        trajectory([3], [("model", [10]), ("env", [7]), ("model", [11])], version=2),  # one version
        trajectory([3], [("model", [10]), ("env", [7]), ("model", [11])], version=2),
        trajectory([3], [("model", [10])], version=5),
    ]
    rows[1].segments[2].policy_version = 4  # a trajectory whose second turn came from a newer policy: spans 2, 3, 4
    rows.append(Trajectory("t", "ref", 0, [3], segments=[Segment("model", [9], step=0)]))  # a reference row: no version
    batch = to_tensor_batch(rows, 0)
    metrics = staleness_metrics(batch.policy_version, batch.newest_version, learner_version=6)
    spans, newest, worst = [1, 3, 1], [6 - 2, 6 - 4, 6 - 5], [6 - 2, 6 - 2, 6 - 5]
    for name, values in (("trajectory_spans", spans), ("trajectory_staleness", newest), ("trajectory_staleness_worst", worst)):
        assert metrics[f"{name}_mean"] == pytest.approx(sum(values) / 3)
        assert metrics[f"{name}_max"] == max(values) and metrics[f"{name}_min"] == min(values)
    assert staleness_metrics(torch.tensor([-1]), torch.tensor([-1]), 3) == {}
    keys = {step_key(name) for name in metrics}
    assert "training/off_policy/trajectory_staleness_worst/max" in keys and "training/off_policy/trajectory_spans/mean" in keys
    assert len(keys) == 9 and all(k.startswith("training/off_policy/") for k in keys)


BASE = ["run", "--task", "arith", "--preset", "smoke", "--set", "threads=1", "--set", "eval.teacher=false",
        "--set", "eval.before_training=false"]  # fmt: skip


@pytest.mark.slow
def test_forced_lag_run_logs_staleness_and_measured_supervision_drift(tmp_path):
    lag, steps = 2, 5
    result = runner.invoke(app, [*BASE, "--out", str(tmp_path), "--method", "f_opd", "--mode", "async", "--set", f"trainer.fixed_lag={lag}",
                                 "--set", f"trainer.steps={steps}", "--set", "method_args.f_opd.rescore_teacher=true"])  # fmt: skip
    assert result.exit_code == 0, result.output
    with sqlite3.connect(tmp_path / "results.sqlite") as conn:
        (run_id,) = conn.execute("SELECT run_id FROM runs WHERE kind='train'").fetchone()
        rows = conn.execute("SELECT step, name, value FROM step_metrics WHERE run_id=?", (run_id,)).fetchall()
    metrics: dict[int, dict[str, float]] = {}
    for step, name, value in rows:
        metrics.setdefault(step, {})[name] = json.loads(value) if isinstance(value, str) else value
    for step in range(1, steps + 1):
        m = metrics[step]
        behind = min(step - 1, lag)  # batch b is made by version max(b − 1 − L, 0) and trained at version b − 1
        for stat in ("mean", "max", "min"):
            assert m[f"trajectory_staleness_worst_{stat}"] == behind
            assert m[f"trajectory_staleness_{stat}"] == behind  # one version per trajectory here
            assert m[f"trajectory_spans_{stat}"] == 1
        assert m["time_rescore_s"] > 0 and 0 <= m["d_sup_mean"] < 1e-6  # measured: the stored context did not change
    board = leaderboard_rows(Store(tmp_path), [run_id])
    last = [r for r in board if r["step"] == steps][0]
    assert last["staleness_worst_max"] == lag and last["spans_max"] == 1
    assert last["staleness_mean"] == pytest.approx(sum(min(s - 1, lag) for s in range(1, steps + 1)) / steps)
    assert f"{last['staleness_mean']:.1f} / {lag}" in render_markdown(board)
    from opd_harness.leaderboard_page import load_board, render_html

    page = render_html(load_board([tmp_path]))
    assert "stale worst (max)" in page and f'data-sort="{float(lag)!r}">{lag}</td>' in page


def step_metrics(out) -> dict[int, dict[str, float]]:
    with sqlite3.connect(out / "results.sqlite") as conn:
        (run_id,) = conn.execute("SELECT run_id FROM runs WHERE kind='train'").fetchone()
        rows = conn.execute("SELECT step, name, value FROM step_metrics WHERE run_id=?", (run_id,)).fetchall()
    metrics: dict[int, dict[str, float]] = {}
    for step, name, value in rows:
        metrics.setdefault(step, {})[name] = value
    return metrics


@pytest.mark.slow
def test_async_recompute_at_lag_zero_trains_exactly_as_sync_opd_with_the_sampled_estimator(tmp_path):
    """End to end with the sampled estimator (the f-OPD recipe's; the smoke preset's opd is `full`): per-row seeds make
    the async rollout at lag 0 draw sync's samples, and recompute's loss and update are opd's there, so every step's loss
    and sampled KL estimate (which reads the samples, hence the previous updates) agree."""
    runs = {}
    for name, extra in (("sync", ["--method", "opd", "--set", "method_args.opd.estimator=sampled"]),
                        ("recompute", ["--method", "opd_recompute", "--mode", "async", "--set", "trainer.fixed_lag=0"])):  # fmt: skip
        result = runner.invoke(app, [*BASE, "--out", str(tmp_path / name), "--set", "trainer.steps=6",
                                     "--set", "trainer.checkpoint_every=3", *extra])  # fmt: skip
        assert result.exit_code == 0, result.output
        runs[name] = step_metrics(tmp_path / name)
    sync, lag0 = runs["sync"], runs["recompute"]
    assert sorted(sync) == sorted(lag0) == list(range(1, 7))
    for key in ("loss", "teacher_kl"):
        assert [lag0[s][key] for s in range(1, 7)] == pytest.approx([sync[s][key] for s in range(1, 7)], abs=1e-6)
    assert len({round(sync[s]["teacher_kl"], 6) for s in range(1, 7)}) > 1  # the steps differ: not a constant compared
    assert all(lag0[s]["lag_max"] == 0 for s in lag0) and all(lag0[s]["ratio_mean"] == pytest.approx(1.0, abs=1e-5) for s in lag0)


def test_ray_executor_refuses_teacher_rescoring(tmp_path):
    result = runner.invoke(app, [*BASE, "--out", str(tmp_path), "--method", "f_opd", "--mode", "async", "--executor", "ray",
                                 "--set", "method_args.f_opd.rescore_teacher=true"])  # fmt: skip
    assert result.exit_code == 2
    assert "method_args.f_opd.rescore_teacher" in result.output
