"""Chunked full-vocabulary objectives (``trainer.vocab_chunk``): every method that reads the full student distribution gives
the same loss, diagnostics and gradients chunked as unchunked (fp32, CPU), with a chunk that divides neither T nor T − 1.
The backward one ``forward_tokens`` bucket at a time (``trainer.bucket_backward``) gives every method's loss, diagnostics,
entropy and gradients of one graph over the step, chunked and unchunked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from opd_harness.registry import METHODS
from opd_harness.teacher_signal import TopKDistribution
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.learner import BucketBackward, bucket_calls, student_outputs, student_pass

ROWS, LENGTH, CHUNK = 3, 11, 4  # 10 predicted positions per row: chunks of 4, 4, 2
TOP_K = 5

# (method, hyper-parameters): every configuration that turns on the full student distribution.
CASES = [
    ("opd", {"estimator": "full"}),
    ("opd", {"estimator": "full", "aggregation": "sum"}),  # with a top-k teacher signal (batch_for's row seed 1: see below)
    ("gkd", {}),
    ("gkd", {"beta": 0.0, "temperature": 0.7, "top_k": TOP_K}),
    ("gkd", {"beta": 1.0}),
    ("eopd", {"entropy_threshold": 2.0}),
    ("eopd", {"gate": "soft", "rkl_estimator": "full", "fkl_top_k": TOP_K}),
    *[(name, {"estimator": "full"}) for name in ("f_opd", "opd_async", "opd_kl", "opd_clipped_iw", "opd_lag_only", "opd_hard_refresh")],
    ("opd_forward_kl", {}),
]


def batch_for(vocab: int, seed: int = 0, top_k_signal: bool = False) -> TensorBatch:
    """A (3, 11) batch of random tokens with a prompt part, one padded row, teacher log-probs and the full distribution (or
    its top-k signal)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (ROWS, LENGTH), generator=g)
    attention = torch.ones((ROWS, LENGTH), dtype=torch.long)
    attention[2, 8:] = 0
    mask = torch.zeros((ROWS, LENGTH))
    mask[:, 3:] = 1.0
    mask[2, 8:] = 0.0
    teacher_dist = torch.log_softmax(2.0 * torch.randn((ROWS, LENGTH, vocab), generator=g), dim=-1)
    teacher_logp = teacher_dist.gather(-1, ids.unsqueeze(-1)).squeeze(-1) * mask
    topk = teacher_dist.topk(TOP_K, dim=-1)
    return TensorBatch(
        input_ids=ids, attention_mask=attention, loss_mask=mask, step_index=torch.where(mask > 0, 0, -1),
        behaviour_logprobs=(teacher_logp - 0.3 * torch.rand((ROWS, LENGTH), generator=g)) * mask, teacher_logprobs=teacher_logp,
        rewards=torch.full((ROWS,), float("nan")), policy_version=torch.zeros(ROWS, dtype=torch.long), group_ids=torch.arange(ROWS),
        teacher_dist=TopKDistribution(topk.indices, topk.values) if top_k_signal else teacher_dist,
        policy_lag=torch.tensor([0, 1, 2]), teacher_fresh_logprobs=teacher_logp + 0.05 * mask,
    )  # fmt: skip


def loss_and_grads(model, batch: TensorBatch, name: str, args: dict, **forward: int):
    """The objective's loss, diagnostics and the gradients of every parameter, with ``student_pass`` options
    ``forward`` (``vocab_chunk``, ``forward_tokens``, ``bucket_backward``)."""
    spec = METHODS.get(name)
    hp = spec.hparams(**args)
    model.zero_grad(set_to_none=True)
    student = student_pass(model, batch, full="student_full" in spec.needs(hp), **forward)
    state = spec.make_state(hp) if spec.make_state else None
    loss, diagnostics = spec.objective(batch, student.outputs, hp, state)
    student.backward(loss)
    return loss.detach(), diagnostics, student.entropy, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_cases_cover_every_method_that_reads_the_full_student_distribution():
    full_readers = set()
    for name in METHODS.names():
        spec = METHODS.get(name)
        for args in ({}, {"estimator": "full"}, {"rkl_estimator": "full"}):
            try:
                hp = spec.hparams(**args)
            except ValueError:
                continue
            if "student_full" in spec.needs(hp):
                full_readers.add(name)
    assert full_readers == {name for name, _ in CASES}


@pytest.mark.parametrize(("name", "args"), CASES, ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in a.items())}" for n, a in CASES])
def test_chunked_equals_unchunked_loss_and_gradients(tiny_model_factory, name, args):
    torch.manual_seed(0)
    model = tiny_model_factory(seed=3, hidden=32, layers=1)
    batch = batch_for(model.config.vocab_size, top_k_signal=args.get("aggregation") == "sum")
    plain_loss, plain_diag, plain_entropy, plain_grads = loss_and_grads(model, batch, name, args, vocab_chunk=0)
    loss, diag, entropy, grads = loss_and_grads(model, batch, name, args, vocab_chunk=CHUNK)
    assert float(plain_loss) != 0.0
    assert abs(float(loss - plain_loss)) <= 1e-6
    assert diag.keys() == plain_diag.keys()
    for key, value in plain_diag.items():
        assert diag[key] == pytest.approx(value, abs=1e-6), key
    trained = batch.loss_mask > 0  # unchunked, one graph computes the entropy where the loss reads it
    torch.testing.assert_close(entropy[trained], plain_entropy[trained], rtol=0, atol=1e-6)
    assert grads.keys() == plain_grads.keys()
    for param, grad in plain_grads.items():
        assert grad.abs().max() > 0, param
        torch.testing.assert_close(grads[param], grad, rtol=0, atol=1e-6, msg=lambda m, p=param: f"{p}: {m}")


BUCKET_TOKENS = 22  # batch_for's rows (11, 11, 8 tokens) in 2 buckets: rows 0 and 1 together, row 2 alone
FULL_READERS = {name for name, _ in CASES}
EVERY_CASE = [(name, {}, 0) for name in METHODS.names() if not name.startswith("_")] + [
    (name, args, chunk) for name, args in CASES for chunk in (0, CHUNK)
]  # every registered method at its defaults (a full reader unchunked), and every full-distribution case unchunked and chunked


def every_method_batch(vocab: int, top_k_signal: bool) -> TensorBatch:
    """:func:`batch_for` with rewards and a group of two (GRPO-family methods then have a non-zero advantage)."""
    batch = batch_for(vocab, top_k_signal=top_k_signal)
    return dataclasses.replace(batch, rewards=torch.tensor([1.0, 0.0, 1.0]), group_ids=torch.tensor([0, 0, 1]))


@pytest.mark.parametrize(("name", "args", "chunk"), EVERY_CASE,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in a.items())}-chunk{c}" for n, a, c in EVERY_CASE])  # fmt: skip
def test_bucket_backward_equals_one_graph(tiny_model_factory, monkeypatch, name, args, chunk):
    """Loss, diagnostics, entropy on the sequences' positions and every gradient of the per-bucket backward equal one graph's."""
    model = tiny_model_factory(seed=3, hidden=32, layers=1)
    batch = every_method_batch(model.config.vocab_size, top_k_signal=args.get("aggregation") == "sum")
    assert bucket_calls(batch.attention_mask, None, BUCKET_TOKENS) == 2
    one_graph = loss_and_grads(model, batch, name, args, vocab_chunk=chunk, forward_tokens=BUCKET_TOKENS, bucket_backward=False)
    backwards: list[int] = []
    bucket = BucketBackward.bucket_backward
    monkeypatch.setattr(BucketBackward, "bucket_backward", lambda self, *a: backwards.append(1) or bucket(self, *a))
    loss, diag, entropy, grads = loss_and_grads(model, batch, name, args, vocab_chunk=chunk, forward_tokens=BUCKET_TOKENS)
    assert len(backwards) == 2  # the per-bucket path ran, one backward per bucket
    plain_loss, plain_diag, plain_entropy, plain_grads = one_graph
    assert float(plain_loss) != 0.0
    assert abs(float(loss - plain_loss)) <= 1e-5 * max(1.0, abs(float(plain_loss)))
    assert diag.keys() == plain_diag.keys()
    for key, value in plain_diag.items():
        assert diag[key] == pytest.approx(value, abs=1e-5, rel=1e-5, nan_ok=True), key
    trained = batch.loss_mask > 0  # one graph unchunked computes the entropy where the loss reads it (the objective reads no other)
    torch.testing.assert_close(entropy[trained], plain_entropy[trained], rtol=0, atol=1e-5)
    assert grads.keys() == plain_grads.keys()
    for param, grad in plain_grads.items():
        torch.testing.assert_close(grads[param], grad, rtol=1e-5, atol=1e-5, msg=lambda m, p=param: f"{p}: {m}")
    assert max(float(g.abs().max()) for g in plain_grads.values()) > 0


SAMPLED_READERS = sorted(name for name in METHODS.names() if not name.startswith("_") and name not in FULL_READERS
                         and "student_full" not in METHODS.get(name).needs(METHODS.get(name).hparams()))  # fmt: skip


@pytest.mark.parametrize("name", SAMPLED_READERS)
def test_chunking_a_sampled_token_method_equals_the_whole_logits(tiny_model_factory, name):
    """``vocab_chunk`` runs the output head a chunk of positions at a time for every method, not only the full-vocabulary
    ones: the sampled tokens' log-probs and entropy, one graph or per bucket, equal the whole logits' (loss, every grad)."""
    model = tiny_model_factory(seed=3, hidden=32, layers=1)
    batch = every_method_batch(model.config.vocab_size, top_k_signal=False)
    plain_loss, _, plain_entropy, plain_grads = loss_and_grads(model, batch, name, {}, vocab_chunk=0)
    for forward in ({}, {"forward_tokens": BUCKET_TOKENS}):
        loss, _, entropy, grads = loss_and_grads(model, batch, name, {}, vocab_chunk=CHUNK, **forward)
        assert float(plain_loss) != 0.0 and abs(float(loss - plain_loss)) <= 1e-5 * max(1.0, abs(float(plain_loss))), forward
        trained = batch.loss_mask > 0  # where the whole logits' one graph computes the entropy
        torch.testing.assert_close(entropy[trained], plain_entropy[trained], rtol=0, atol=1e-5)
        for param, grad in plain_grads.items():
            torch.testing.assert_close(grads[param], grad, rtol=1e-5, atol=1e-5, msg=lambda m, p=param: f"{p}: {m}")
    vocab, kept = model.config.vocab_size, []

    def pack(tensor: torch.Tensor):
        if tensor.shape and tensor.shape[-1] == vocab:
            kept.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # chunked: no (T, V) logits kept for the backward
        student_outputs(model, batch, full=False, vocab_chunk=CHUNK)
    assert sum(kept) <= 4 * ROWS * vocab, kept


def test_the_bucket_cases_cover_every_method_and_every_full_reader_chunked():
    covered = {(name, chunk > 0) for name, _, chunk in EVERY_CASE}
    builtin = {name for name in METHODS.names() if not name.startswith("_")}
    assert {name for name, _ in covered} == builtin
    assert {name for name, chunked in covered if chunked} == FULL_READERS


def test_bucket_backward_refuses_vocabulary_terms_of_tensors_with_a_gradient(tiny_model_factory):
    """The cached backward replays ``fn`` on the recorded aligned tensors, detached: one with a gradient would lose it."""
    model = tiny_model_factory(seed=3)
    batch = batch_for(model.config.vocab_size)
    student = student_pass(model, batch, full=True, forward_tokens=BUCKET_TOKENS)
    with pytest.raises(ValueError, match="must not require grad"):
        student.outputs.over_vocabulary(lambda log, x: log[..., 0] * x, student.outputs.logprobs)


def test_a_chunk_longer_than_the_sequence_is_one_chunk_and_the_same(tiny_model_factory):
    model = tiny_model_factory(seed=3)
    batch = batch_for(model.config.vocab_size, seed=1)
    plain = loss_and_grads(model, batch, "opd", {"estimator": "full"}, vocab_chunk=0)
    chunked = loss_and_grads(model, batch, "opd", {"estimator": "full"}, vocab_chunk=10_000)
    assert abs(float(chunked[0] - plain[0])) <= 1e-6


def test_chunking_keeps_no_full_distribution_for_the_backward(tiny_model_factory):
    """What the graph keeps for the backward, beyond views of the batch's teacher tensor: the whole (B, T, V) distribution
    unchunked; chunked, nothing vocabulary-sized but position 0's one-row zeros (checkpointed chunks recompute theirs)."""
    model = tiny_model_factory(seed=3)
    batch = batch_for(model.config.vocab_size)
    vocab, teacher_storage = model.config.vocab_size, batch.teacher_dist.untyped_storage().data_ptr()
    kept: list[int] = []

    def pack(tensor: torch.Tensor):
        if tensor.shape and tensor.shape[-1] == vocab and tensor.untyped_storage().data_ptr() != teacher_storage:
            kept.append(tensor.numel())
        return tensor

    whole = ROWS * (LENGTH - 1) * vocab
    for chunk in (0, CHUNK):
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            spec = METHODS.get("gkd")
            outputs, _ = student_outputs(model, batch, full=True, vocab_chunk=chunk)
            spec.objective(batch, outputs, spec.hparams(), None)
        if chunk == 0:
            assert max(kept) >= whole
        else:
            assert sum(kept) <= 4 * ROWS * vocab, kept  # a few saves of each row's position-0 zeros


def test_a_non_positive_chunk_is_refused(tiny_model_factory):
    from opd_harness.trainers.chunked_vocab import ChunkedVocabulary

    with pytest.raises(ValueError, match="vocab_chunk 0"):
        ChunkedVocabulary(torch.zeros(1, 2, 3), torch.nn.Linear(3, 4), 0, lambda: None)


def test_teacher_scoring_in_chunks_of_positions_equals_whole_scoring(tiny_model_factory, char_tokenizer):
    from opd_harness.backends.hf import HFBackend

    model = tiny_model_factory(seed=7)
    batch = batch_for(model.config.vocab_size, seed=2)
    want = ("logprobs", "entropy", "topk", "full")
    whole = HFBackend(model, char_tokenizer).score(batch.input_ids, batch.attention_mask, want=want, top_k=TOP_K)
    chunked = HFBackend(model, char_tokenizer, score_chunk=CHUNK).score(batch.input_ids, batch.attention_mask, want=want, top_k=TOP_K)
    assert whole.keys() == chunked.keys() == {"logprobs", "entropy", "topk_logprobs", "topk_ids", "full"}
    for name, value in whole.items():
        torch.testing.assert_close(chunked[name], value, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert model.get_output_embeddings() is not None and isinstance(model.lm_head, torch.nn.Linear)  # the head is back
    with pytest.raises(ValueError, match="score_chunk -1"):
        HFBackend(model, char_tokenizer, score_chunk=-1)
