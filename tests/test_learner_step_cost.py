"""The learner-side savings of a training step are exact: length-bucketed forwards (``trainer.forward_tokens``) give the
same loss and gradients as one padded forward, and the teacher's scores on every real position; π_old is skipped only
where it equals the training forward's log-probs (then loss and gradients are those with π_old scored)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from opd_harness.backends.hf import HFBackend, length_buckets
from opd_harness.config import TrainerConfig
from opd_harness.registry import METHODS
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.learner import old_logprobs_redundant
from opd_harness.trainers.pipeline import behaviour_logprobs, needs_behaviour_scorer, scores_old_logprobs

from test_chunked_vocab import loss_and_grads

LENGTHS = [11, 4, 9, 2, 11, 6, 7, 3]  # right-padded rows of very different lengths, two of the longest


def ragged_batch(vocab: int, seed: int = 0) -> TensorBatch:
    """Rows of ``LENGTHS`` padded to 11 (pad id 0), a 2-token prompt, teacher log-probs, rewards in groups of two."""
    g = torch.Generator().manual_seed(seed)
    rows, width = len(LENGTHS), max(LENGTHS)
    attention = torch.tensor([[1] * n + [0] * (width - n) for n in LENGTHS])
    ids = torch.randint(3, vocab, (rows, width), generator=g) * attention
    mask = attention.float()
    mask[:, :2] = 0.0
    teacher = -3.0 * torch.rand((rows, width), generator=g) * mask
    return TensorBatch(
        input_ids=ids, attention_mask=attention, loss_mask=mask, step_index=torch.where(mask > 0, 0, -1),
        behaviour_logprobs=(teacher - 0.2) * mask, teacher_logprobs=teacher, rewards=torch.tensor([1.0, 0.0] * (rows // 2)),
        policy_version=torch.zeros(rows, dtype=torch.long), group_ids=torch.arange(rows) // 2,
        policy_lag=torch.zeros(rows, dtype=torch.long),
    )  # fmt: skip


def assert_same(a, b, real: torch.Tensor, atol: float = 1e-5) -> None:
    (loss_a, diag_a, ent_a, grads_a), (loss_b, diag_b, ent_b, grads_b) = a, b
    assert float(loss_a) != 0.0
    assert abs(float(loss_a - loss_b)) <= atol
    for key, value in diag_a.items():
        assert diag_b[key] == pytest.approx(value, abs=atol), key
    torch.testing.assert_close(ent_b[real], ent_a[real], rtol=0, atol=atol)  # trained positions: elsewhere 0 on the one-graph path
    assert grads_a.keys() == grads_b.keys()
    for param, grad in grads_a.items():
        assert grad.abs().max() > 0, param
        torch.testing.assert_close(grads_b[param], grad, rtol=0, atol=atol, msg=lambda m, p=param: f"{p}: {m}")


def test_length_buckets_sort_longest_first_and_keep_to_the_budget():
    groups = length_buckets(LENGTHS, 24)
    assert sorted(row for g in groups for row in g) == list(range(len(LENGTHS)))
    assert [[LENGTHS[r] for r in g] for g in groups] == [[11, 11], [9, 7], [6, 4, 3, 2]]
    assert all(len(g) * LENGTHS[g[0]] <= 24 for g in groups)
    assert length_buckets([30, 5], 8) == [[0], [1]]  # a row over the budget is a group of its own


@pytest.mark.parametrize(("name", "args"), [("sod", {}), ("opd", {"estimator": "full"}), ("grpo", {})])
def test_bucketed_forward_gives_the_same_loss_and_gradients(tiny_model_factory, name, args):
    model = tiny_model_factory(seed=3, hidden=32, layers=2)
    batch = ragged_batch(model.config.vocab_size)
    if name == "opd":
        batch.teacher_dist = torch.log_softmax(torch.randn((*batch.input_ids.shape, model.config.vocab_size)), dim=-1)
    whole = loss_and_grads(model, batch, name, args)
    assert len(length_buckets(LENGTHS, 24)) == 3
    assert_same(whole, loss_and_grads(model, batch, name, args, forward_tokens=24), batch.loss_mask.bool())


def test_bucketed_scores_equal_the_whole_batch_on_every_real_position(tiny_model_factory, char_tokenizer):
    model = tiny_model_factory(seed=4, hidden=32, layers=2).eval()
    batch = ragged_batch(model.config.vocab_size)
    want = ("logprobs", "entropy", "topk", "full")
    whole = HFBackend(model, char_tokenizer).score(batch.input_ids, batch.attention_mask, want=want, top_k=3)
    parts = HFBackend(model, char_tokenizer, score_tokens=24).score(batch.input_ids, batch.attention_mask, want=want, top_k=3)
    real = batch.attention_mask.bool()
    assert whole.keys() == parts.keys()
    for name, value in whole.items():
        torch.testing.assert_close(parts[name][real], value[real], rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", ["sod", "grpo"])
def test_without_pi_old_the_one_update_step_has_the_loss_and_gradients_of_the_scored_pi_old(tiny_model_factory, char_tokenizer, name):
    """At lag 0, π_old scored by the behaviour weights (the old forward) and the training forward's own log-probs
    (detached; what a batch without ``old_logprobs`` gets) give the same loss and gradients."""
    model = tiny_model_factory(seed=5, hidden=32, layers=2)
    batch = ragged_batch(model.config.vocab_size)
    skipped = loss_and_grads(model, batch, name, {})
    batch.old_logprobs = behaviour_logprobs(HFBackend(model, char_tokenizer), batch)
    model.train()
    assert_same(loss_and_grads(model, batch, name, {}), skipped, batch.loss_mask.bool())
    batch.old_logprobs = batch.old_logprobs - 0.3 * batch.loss_mask  # a policy one update behind: π_old is no longer s
    assert abs(float(loss_and_grads(model, batch, name, {})[0] - skipped[0])) > 1e-3


@pytest.mark.parametrize(
    ("sets", "redundant"),
    [
        ({}, True),  # sync, recompute, fp32
        ({"mode": "async", "max_lag": 0}, True),
        ({"mode": "async", "fixed_lag": 0}, True),
        ({"mode": "async"}, False),  # max_lag 1: a batch may be a version behind
        ({"mode": "async", "max_lag": 0, "fixed_lag": 2}, False),
        ({"behaviour_logprobs": "engine"}, False),  # π_old is the engine's own scores
        ({"precision": "bf16"}, False),  # the training forward runs under autocast, π_old does not
    ],
)
def test_pi_old_is_skipped_only_where_it_equals_the_training_forward(sets, redundant):
    assert old_logprobs_redundant(TrainerConfig(**sets)) is redundant


@pytest.mark.parametrize(("sets", "scorer"), [({}, False), ({"mode": "async"}, True), ({"behaviour_logprobs": "engine"}, False)])
def test_a_non_hf_engine_gets_a_behaviour_scorer_only_where_pi_old_is_scored(sets, scorer):
    """A skipped π_old needs no trainer model beside the engine (its weights would be loaded every step for nothing)."""
    spec = METHODS.get("sod")
    plan = SimpleNamespace(method=spec, hparams=spec.hparams(), config=SimpleNamespace(trainer=TrainerConfig(**sets)))
    assert scores_old_logprobs(plan) is (sets != {})  # sync, recompute, fp32: the training forward's log-probs are π_old
    assert needs_behaviour_scorer(plan, engine=object()) is scorer
