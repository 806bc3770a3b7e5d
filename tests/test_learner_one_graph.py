"""``trainer.graph_memory_gib``: a bucketed step whose one graph fits the budget skips the per-bucket backward's extra
forward (one student forward per length bucket, not two) and gives the loss, diagnostics, entropy and gradients of the
per-bucket backward, at vocabulary 151,936 with a tiny hidden size and rows of a few to hundreds of tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from opd_harness.backends.hf import length_buckets
from opd_harness.models.tiny import TinyArch, build_tiny_model
from opd_harness.teacher_signal import TopKDistribution
from opd_harness.trainers.learner import fits_one_graph, rank_bucket_tokens, rank_loss_tokens
from opd_harness.trajectory import TensorBatch

from test_chunked_vocab import loss_and_grads

VOCAB = 151_936
LENGTHS = [230, 17, 140, 8, 75, 166, 33]  # right-padded rows of mixed lengths, a 5-token prompt each
SHORT = [72, 9, 40, 17, 28, 55, 6]  # for the full distribution: (B, T, V) float32 tensors of 151,936 a position
BUDGET = 256  # forward_tokens: 5 length buckets of LENGTHS, 2 of SHORT
TOP_K = 8
# Gradients, relative to a parameter's largest: float32 sums over 151,936 vocabulary entries, which round differently
# when the output head runs on one bucket's loss positions (per-bucket backward) or on the step's at once (one graph). The
# gradient at the hidden states, (N, V) @ (V, H), rounds worse with few rows: 1.1e-5 of its largest at N = 3, 2e-6 at
# N >= 12 (a bucket of LENGTHS has 3 loss positions). Against a float64 step (LENGTHS, opd): one graph 1.7e-6, per-bucket
# 4.8e-6 (the loss: equal); per-bucket against one graph, every case here: at most 5.5e-6.
GRAD_TOL = 2e-5


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    arch = TinyArch(hidden=16, layers=2, heads=2, kv_heads=1, ffn=32)
    return build_tiny_model(arch, VOCAB, pad_id=0, eos_id=1, seed=5)


def mixed_batch(lengths: list[int], seed: int = 0) -> TensorBatch:
    """Rows of ``lengths`` (pad id 0), teacher and behaviour log-probs, and a top-k teacher signal (a full (B, T, V)
    teacher tensor would be gigabytes at this vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(lengths)
    attention = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    ids = torch.randint(3, VOCAB, (rows, width), generator=g) * attention
    mask = attention.float()
    mask[:, :5] = 0.0
    teacher = -6.0 * torch.rand((rows, width), generator=g) * mask
    top_ids = torch.randint(3, VOCAB, (rows, width, TOP_K), generator=g)
    top_logp = torch.log_softmax(torch.randn((rows, width, TOP_K + 1), generator=g), dim=-1)[..., :TOP_K]
    return TensorBatch(
        input_ids=ids, attention_mask=attention, loss_mask=mask, step_index=torch.where(mask > 0, 0, -1),
        behaviour_logprobs=(teacher - 0.3) * mask, teacher_logprobs=teacher, rewards=(torch.arange(rows) % 2 == 0).float(),
        policy_version=torch.zeros(rows, dtype=torch.long), group_ids=torch.arange(rows) // 2,
        policy_lag=torch.zeros(rows, dtype=torch.long),
        teacher_dist=TopKDistribution(top_ids, top_logp),
    )  # fmt: skip


def counted(model: torch.nn.Module, batch: TensorBatch, name: str, args: dict, **options) -> tuple:
    """``loss_and_grads`` with the number of decoder forwards it made."""
    calls = []
    hook = model.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        return loss_and_grads(model, batch, name, args, **options), len(calls)
    finally:
        hook.remove()


def assert_same_step(want: tuple, got: tuple, trained: torch.Tensor) -> None:
    """Two ``loss_and_grads`` results agree: loss, diagnostics and the entropy at the ``trained`` positions within 1e-6,
    every gradient within ``GRAD_TOL`` of its largest value (one graph computes the entropy only where a loss reads it)."""
    (loss_a, diag_a, ent_a, grads_a), (loss_b, diag_b, ent_b, grads_b) = want, got
    assert float(loss_a) != 0.0
    assert abs(float(loss_b - loss_a)) <= 1e-6 * abs(float(loss_a))
    for key, value in diag_a.items():
        assert diag_b[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    torch.testing.assert_close(ent_b[trained], ent_a[trained], rtol=1e-6, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for param, grad in grads_a.items():
        scale = float(grad.abs().max())
        assert scale > 0, param
        torch.testing.assert_close(grads_b[param], grad, rtol=0, atol=GRAD_TOL * scale, msg=lambda m, p=param: f"{p}: {m}")


@pytest.mark.parametrize(("name", "args", "lengths", "buckets"),
                         [("opd", {}, LENGTHS, 5), ("opd", {"estimator": "full"}, SHORT, 2)])  # fmt: skip
def test_one_graph_within_the_budget_equals_the_per_bucket_backward_with_one_forward_per_bucket(model, name, args, lengths, buckets):
    batch = mixed_batch(lengths)
    assert len(length_buckets(lengths, BUDGET)) == buckets
    (loss_a, diag_a, ent_a, grads_a), forwards_a = counted(model, batch, name, args, forward_tokens=BUDGET)  # graph_memory_gib 0
    (loss_b, diag_b, ent_b, grads_b), forwards_b = counted(model, batch, name, args, forward_tokens=BUDGET, graph_memory_gib=64.0)
    assert (forwards_a, forwards_b) == (2 * buckets, buckets)  # the per-bucket backward forwards every bucket twice
    assert_same_step((loss_a, diag_a, ent_a, grads_a), (loss_b, diag_b, ent_b, grads_b), batch.loss_mask.bool())


def test_the_budget_decides_from_the_step_s_bucketed_tokens_and_the_vocabulary(model):
    attention = mixed_batch(LENGTHS).attention_mask
    graph, bucket = rank_bucket_tokens(attention, None, BUDGET)
    assert graph == sum(len(g) * LENGTHS[g[0]] for g in length_buckets(LENGTHS, BUDGET)) == 769 and bucket == 230
    # the full distribution unchunked keeps at least 4 float32 (tokens, 151,936) tensors: 769 tokens: 1.7 GiB, and one bucket passing by
    assert not fits_one_graph(model, attention, None, BUDGET, True, 0, "fp32", 1.8)
    assert fits_one_graph(model, attention, None, BUDGET, True, 0, "fp32", 4.0)
    assert fits_one_graph(model, attention, None, BUDGET, False, 0, "fp32", 1.8)  # sampled-token log-probs: 2 kept + 2 passing
    assert not fits_one_graph(model, attention, None, BUDGET, True, 0, "fp32", 0.0)  # 0: always per bucket
    assert fits_one_graph(model, attention, None, BUDGET, True, 64, "fp32", 0.5)  # chunked: (64, V) tensors, not (tokens, V)
    shard = SimpleNamespace(rank=0, world=2)  # every rank decides for the rank with the most bucketed tokens
    assert rank_bucket_tokens(attention, shard, BUDGET) == max(rank_bucket_tokens(attention[:4], None, BUDGET),
                                                               rank_bucket_tokens(attention[4:], None, BUDGET))  # fmt: skip


def test_the_vocabulary_side_of_the_budget_counts_the_loss_positions(model):
    """One graph runs the output head and vocabulary terms at the loss's positions only: with the step's loss mask the
    estimate counts those (tokens, V) tensors, not the bucketed tokens'."""
    batch = mixed_batch(LENGTHS)
    attention, trained = batch.attention_mask, batch.loss_mask
    few = torch.zeros_like(trained)
    few[:, 5:9] = trained[:, 5:9]  # at most 4 trained tokens a row
    assert rank_loss_tokens(trained, None) == sum(n - 5 for n in LENGTHS) and rank_loss_tokens(few, None) == 27
    halves = (sum(n - 5 for n in LENGTHS[:4]), sum(n - 5 for n in LENGTHS[4:]))  # every rank decides for the one with the most
    assert rank_loss_tokens(trained, SimpleNamespace(rank=1, world=2)) == max(halves)
    assert not fits_one_graph(model, attention, None, BUDGET, True, 0, "fp32", 0.5)  # every bucketed token's (T, V)
    assert fits_one_graph(model, attention, None, BUDGET, True, 0, "fp32", 0.5, loss_mask=few)  # 27 positions' (27, V)
    assert not fits_one_graph(model, attention, None, BUDGET, True, 0, "fp32", 1.8, loss_mask=trained)  # 634 positions, all at once


LONG = [1000, 8, 430, 96, 12, 700]  # rows of 8 to 1,000 tokens: a long prompt, then at most 48 trained tokens
LONG_BUDGET = 1024  # forward_tokens: 4 length buckets ([1000], [700], [430, 96], [12, 8])
ANSWER = 48


def prompted_batch(lengths: list[int], seed: int = 1) -> TensorBatch:
    """:func:`mixed_batch` with the loss on the last ``ANSWER`` tokens of a row (all but its first 5 when shorter): the
    prompt is most of a long row, as in an OPD step's (issue 46: 64 prompts of arithmetic, ≤ 48 new tokens)."""
    batch = mixed_batch(lengths, seed)
    starts = torch.tensor([max(5, n - ANSWER) for n in lengths])
    keep = (torch.arange(max(lengths)) >= starts[:, None]).float()
    mask = batch.loss_mask * keep
    return dataclasses.replace(batch, loss_mask=mask, step_index=torch.where(mask > 0, 0, -1), teacher_logprobs=batch.teacher_logprobs
                               * keep, behaviour_logprobs=batch.behaviour_logprobs * keep)  # fmt: skip


def head_rows(model: torch.nn.Module, run: Callable[[], tuple]) -> tuple[tuple, int]:
    """``run()``'s result and the positions the student's output head was applied to in it."""
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda _m, args, _o: rows.append(args[0].shape[:-1].numel()))
    try:
        return run(), sum(rows)
    finally:
        hook.remove()


@pytest.mark.parametrize(("name", "args"), [("opd", {}), ("opd", {"estimator": "full"})])
def test_the_per_bucket_backward_runs_the_head_at_the_loss_positions_with_the_loss_and_gradients_of_every_position(model, name, args):
    """The per-bucket backward (a step over ``trainer.graph_memory_gib``) applies the output head, log-softmax and vocabulary
    terms at the loss's positions only, in both passes, and gives the loss, diagnostics, entropy and gradients of a step
    that computes every position: the chunked one graph (``vocab_chunk``, its own code path), within
    :func:`assert_same_step`'s tolerances."""
    batch = prompted_batch(LONG)
    trained = batch.loss_mask.bool()
    assert len(length_buckets(LONG, LONG_BUDGET)) == 4 and int(trained.sum()) == 4 * ANSWER + 3 + 7
    every = lambda: loss_and_grads(model, batch, name, args, vocab_chunk=8192)  # noqa: E731
    (loss_a, diag_a, ent_a, grads_a), rows_a = head_rows(model, every)
    assert rows_a >= sum(n - 1 for n in LONG)  # the reference: every predicted position of every row (and padding)
    bucketed_step = lambda: loss_and_grads(model, batch, name, args, forward_tokens=LONG_BUDGET)  # noqa: E731  graph_memory_gib 0
    (loss_b, diag_b, ent_b, grads_b), rows_b = head_rows(model, bucketed_step)
    assert rows_b == 2 * int(trained.sum())  # both passes, at the trained positions only (before: every bucketed token, twice)
    assert_same_step((loss_a, diag_a, ent_a, grads_a), (loss_b, diag_b, ent_b, grads_b), trained)
