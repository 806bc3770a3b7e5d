"""Chunked full-vocabulary objectives (``trainer.vocab_chunk``): every method that reads the full student distribution gives
the same loss, diagnostics and gradients chunked as unchunked (fp32, CPU), with a chunk that divides neither T nor T − 1."""

from __future__ import annotations

import pytest
import torch

from harness.registry import METHODS
from harness.teacher_signal import TopKDistribution
from harness.trajectory import TensorBatch
from trainers.learner import student_outputs

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
    """The objective's loss, diagnostics and the gradients of every parameter, with ``student_outputs`` options
    ``forward`` (``vocab_chunk``, ``forward_tokens``)."""
    spec = METHODS.get(name)
    hp = spec.hparams(**args)
    model.zero_grad(set_to_none=True)
    outputs, entropy = student_outputs(model, batch, full="student_full" in spec.needs(hp), **forward)
    state = spec.make_state(hp) if spec.make_state else None
    loss, diagnostics = spec.objective(batch, outputs, hp, state)
    loss.backward()
    return loss.detach(), diagnostics, entropy, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


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
    torch.testing.assert_close(entropy, plain_entropy, rtol=0, atol=1e-6)
    assert grads.keys() == plain_grads.keys()
    for param, grad in plain_grads.items():
        assert grad.abs().max() > 0, param
        torch.testing.assert_close(grads[param], grad, rtol=0, atol=1e-6, msg=lambda m, p=param: f"{p}: {m}")


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
    from trainers.chunked_vocab import ChunkedVocabulary

    with pytest.raises(ValueError, match="vocab_chunk 0"):
        ChunkedVocabulary(torch.zeros(1, 2, 3), torch.nn.Linear(3, 4), 0, lambda: None)


def test_teacher_scoring_in_chunks_of_positions_equals_whole_scoring(tiny_model_factory, char_tokenizer):
    from harness.backends.hf import HFBackend

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
