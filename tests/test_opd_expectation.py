"""The sampled-token OPD estimator is unbiased: with the prefix fixed, E_{y~π}[∇ loss(y)] equals the gradient of the
full-vocabulary reverse KL(π_θ ‖ π_T) at that position (docs/methods/opd.md vs the ``full`` estimator).

Exact, not Monte Carlo: a tiny student and teacher, one row per vocabulary token y after a fixed prefix, the real
objectives run through the method contract on the learner's own forward (``opd_harness.trainers.learner.student_outputs``) and the
teacher's scoring path (``opd_harness.trainers.teacher.score_teacher``); each row's gradient weighted by π(y) and summed. The
behaviour log-probs q the estimator reads are the rollout engine's (the hf backend's recorded log-probs, sync: the
weights that generated are the learner's)."""

import pytest
import torch

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.models.tiny import TinyArch, build_tiny_model
from opd_harness.registry import METHODS
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.learner import student_outputs
from opd_harness.trainers.teacher import score_teacher

from test_chunked_vocab import loss_and_grads

VOCAB = 12  # a small vocabulary (ids 0..11 of the character tokenizer: pad, eos, unk and 9 characters)
PREFIX = [5, 7, 3, 9, 11]  # a fixed prompt; the response is the one token after it


def peaked(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """Scale the tied embedding/output matrix so the random model's next-token distribution is far from uniform."""
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)
    return model


def tiny(seed: int) -> torch.nn.Module:
    """A one-layer Qwen3 over ``VOCAB`` tokens, its next-token distribution peaked (max π ≈ 0.4-0.7 after PREFIX)."""
    arch = TinyArch(hidden=16, layers=1, heads=2, kv_heads=1, ffn=32)
    return peaked(build_tiny_model(arch, VOCAB, pad_id=0, eos_id=1, seed=seed), 10.0)


@pytest.fixture(scope="module")
def models():
    return tiny(3), tiny(4)


def one_token_batch(token: int, q: float = 0.0) -> TensorBatch:
    """PREFIX + [token]; the loss mask covers the last position only; ``q`` its behaviour log-prob."""
    ids = torch.tensor([PREFIX + [token]])
    n = ids.shape[1]
    mask = torch.zeros((1, n))
    mask[0, -1] = 1.0
    behaviour = mask * q
    return TensorBatch(
        input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask, step_index=torch.zeros_like(ids),
        behaviour_logprobs=behaviour, teacher_logprobs=torch.zeros((1, n)), rewards=torch.full((1,), float("nan")),
        policy_version=torch.zeros(1, dtype=torch.long), group_ids=torch.zeros(1, dtype=torch.long),
    )  # fmt: skip


def gradient(model: torch.nn.Module, teacher: HFBackend, batch: TensorBatch, method: str, args: dict) -> torch.Tensor:
    """d loss / d θ of ``method`` (the registered spec, default hyper-parameters but ``args``) on ``batch``, flattened."""
    spec = METHODS.get(method)
    score_teacher(teacher, batch, kind="full" if "teacher_dist" in spec.needs(spec.hparams(**args)) else "sampled")
    grads = loss_and_grads(model, batch, method, args)[3]
    return torch.cat([g.flatten() for g in grads.values()])


def engine_logprobs(engine: HFBackend, vocab: int) -> torch.Tensor:
    """log π(y | PREFIX) as the rollout engine records it when it samples y (NaN for a token never drawn in 512 samples)."""
    seen: dict[int, float] = {}
    params = SamplingParams(temperature=1.0, max_new_tokens=1, n=512, seed=0)
    for completion in engine.generate([PREFIX], params):
        seen[completion.token_ids[0]] = completion.logprobs[0]
    return torch.tensor([seen.get(y, float("nan")) for y in range(vocab)])


# The sampled-token objectives whose per-token gradient is (log π(y) − log π_T(y))·∇log π(y) at ratio 1: vanilla OPD
# (advantage from the engine's q), and those that read o recomputed by the trainer with the weights switched to 1 (a
# one-token response is one block, no jump: AP-OPD's and the cap's w = 1; SAF with every stage off and no GRPO term).
SAMPLED_TOKEN = {
    "opd": {},
    "ap_opd": {"block": 4},
    "ap_opd_magcap": {"block": 4},
    "saf_opd": {"topk": False, "tanh": False, "warmup": False, "anneal": False, "grpo_coef": 0.0},
}


@pytest.fixture(scope="module")
def setting(models, char_tokenizer):
    """The student, the teacher's backend, π(y | PREFIX), the engine's recorded q(y) and the full-KL gradient."""
    student, teacher_model = models
    teacher = HFBackend(teacher_model, char_tokenizer)
    with torch.no_grad():
        pi = student_outputs(student, one_token_batch(0), full=True)[0].over_vocabulary(lambda log_dist: log_dist)[0, -1].exp().double()
    q = engine_logprobs(HFBackend(student, char_tokenizer), VOCAB)
    student.train()  # the learner's mode (dropout is 0 in these configs)
    full = gradient(student, teacher, one_token_batch(0), "opd", {"estimator": "full"}).double()
    return student, teacher, pi, q, full


def expected_gradient(setting, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_y π(y)·∇loss(row y), the rows' uniform mean) of ``method`` on the one-token rows, q from the engine."""
    student, teacher, pi, q, _ = setting
    behaviour = torch.where(torch.isnan(q), pi.log().float(), q)  # a token never drawn: the learner's log-prob (weight < 1e-3)
    rows = torch.stack([gradient(student, teacher, one_token_batch(y, float(behaviour[y])), method, SAMPLED_TOKEN[method])
                        for y in range(VOCAB)]).double()  # fmt: skip
    return (pi[:, None] * rows).sum(0), rows.mean(0)


def test_the_engines_behaviour_logprobs_are_the_learners_current_logprobs(setting):
    _, _, pi, q, _ = setting
    drawn = ~torch.isnan(q)
    assert int(drawn.sum()) >= VOCAB - 2, "the samples should cover (nearly) every token"
    assert torch.allclose(q[drawn].double(), pi[drawn].log(), atol=1e-5)


@pytest.mark.parametrize("method", sorted(SAMPLED_TOKEN))
def test_sampled_token_gradient_in_expectation_is_the_full_reverse_kl_gradient(setting, method):
    _, _, pi, _, full = setting
    assert pi.max() > 0.3 and pi.min() < 0.02, "the student's distribution should be far from uniform"
    scale = float(full.abs().max())
    assert scale > 1e-3, "the KL gradient should not be negligible"
    weighted, uniform = expected_gradient(setting, method)
    assert float((weighted - full).abs().max()) <= 1e-5 * max(1.0, scale)
    # the check has power: the rows' plain mean (π ignored) is far from it
    assert float((uniform - full).abs().max()) > 1e-2 * scale


def score_gradient(student: torch.nn.Module, batch: TensorBatch) -> torch.Tensor:
    """∇_θ log π(y | PREFIX) of the row's response token, flattened."""
    outputs, _ = student_outputs(student, batch, full=False)
    student.zero_grad(set_to_none=True)
    outputs.logprobs[0, -1].backward()
    return torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None])


def test_each_rows_gradient_is_the_detached_log_ratio_times_the_score(setting):
    # per sample, not only in expectation: an advantage that kept its gradient would add ∇log π(y), which averages to 0
    # under π (so the expectation test cannot see it) but is there row by row
    student, teacher, pi, _, _ = setting
    for y in (0, int(pi.argmax()), VOCAB - 2):
        batch = one_token_batch(y, float(pi[y].log()))
        row = gradient(student, teacher, batch, "opd", {})
        log_ratio = float(pi[y].log()) - float(batch.teacher_logprobs[0, -1])
        assert torch.allclose(row, log_ratio * score_gradient(student, batch), atol=1e-6)
