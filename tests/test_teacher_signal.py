"""Teacher signal kinds (opd_harness.teacher_signal): each kind's loss and gradient equal the same method computed from the whole
teacher distribution, the HF teacher's hidden-state and at-ids scores equal its full scores, and scoring a 2k-token sequence
at Qwen3's vocabulary keeps no (T, V) tensor."""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys
import textwrap

import pytest
import torch

from test_chunked_vocab import batch_for, loss_and_grads
from opd_harness.backends.hf import HFBackend
from opd_harness.registry import METHODS
from opd_harness.teacher_signal import HiddenDistribution, TopKDistribution, bytes_per_token
from opd_harness.trainers.teacher import score_teacher

K = 4
# (method, hyper-parameters, the kinds it accepts): every method that reads the teacher's distribution
CASES = [
    ("opd", {"estimator": "full"}, ("full", "topk", "student_topk")),
    ("f_opd", {"estimator": "full"}, ("full", "topk", "student_topk")),
    ("gkd", {"beta": 0.5, "temperature": 0.8}, ("full", "topk", "student_topk")),
    ("eopd", {"gate": "soft", "rkl_estimator": "full"}, ("full",)),
]


def test_the_cases_are_the_methods_and_kinds_declared():
    readers = {n for n in METHODS.names() if "teacher_dist" in METHODS.get(n).needs(METHODS.get(n).hparams(**dict(
        [("estimator", "full")] if "estimator" in METHODS.get(n).hparams.model_fields else [])))}  # fmt: skip
    assert {"opd", "f_opd", "gkd", "eopd"} <= readers
    for name, args, kinds in CASES:
        spec = METHODS.get(name)
        assert spec.accepted_signals(spec.hparams(**args)) == kinds


def bucketed_log_probs(log_dist: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Reference coarse-graining: probabilities summed into k + 1 buckets (ids' own, then the rest) with scatter_add."""
    vocab, k = log_dist.shape[-1], ids.shape[-1]
    bucket = torch.full(log_dist.shape, k, dtype=torch.long).scatter(-1, ids, torch.arange(k).expand(ids.shape).contiguous())
    mass = torch.zeros((*log_dist.shape[:-1], k + 1), dtype=log_dist.dtype).scatter_add(-1, bucket, log_dist.exp())
    assert vocab > k
    return mass.log()


@pytest.mark.parametrize("chunk", [0, 3])
@pytest.mark.parametrize(("name", "args", "kinds"), CASES, ids=[c[0] for c in CASES])
def test_full_as_hidden_states_equals_the_whole_distribution(tiny_model_factory, name, args, kinds, chunk):
    model = tiny_model_factory(seed=3, hidden=32, layers=1)
    torch.manual_seed(1)
    head = torch.nn.Linear(16, model.config.vocab_size, bias=False).requires_grad_(False)
    dense = batch_for(model.config.vocab_size)
    hidden = torch.randn((*dense.input_ids.shape, 16)) * 2
    dense.teacher_dist = torch.log_softmax(head(hidden), -1)
    compact = batch_for(model.config.vocab_size)
    compact.teacher_dist = HiddenDistribution(hidden, head)
    want_loss, _, _, want_grads = loss_and_grads(model, dense, name, args, vocab_chunk=chunk)
    loss, _, _, grads = loss_and_grads(model, compact, name, args, vocab_chunk=chunk)
    assert float(want_loss) != 0.0 and abs(float(loss - want_loss)) <= 1e-6
    for param, grad in want_grads.items():
        torch.testing.assert_close(grads[param], grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["topk", "student_topk"])
@pytest.mark.parametrize(("name", "args", "kinds"), [c for c in CASES if "topk" in c[2]], ids=[c[0] for c in CASES if "topk" in c[2]])
def test_a_topk_signal_equals_the_method_on_the_whole_distribution_in_k_plus_one_buckets(tiny_model_factory, name, args, kinds, kind):
    """The loss and gradient from the compact top-k signal (chunked on the learner) equal the method's per-position function
    applied to both whole distributions summed into the k + 1 buckets by a reference coarse-graining."""
    model = tiny_model_factory(seed=3, hidden=32, layers=1)
    batch = batch_for(model.config.vocab_size)
    whole = batch.teacher_dist
    if kind == "topk":
        logp, ids = whole.topk(K, dim=-1)
    else:  # the teacher's log-probs on the student's (here: a random other distribution's) top-k tokens
        ids = torch.log_softmax(torch.randn(whole.shape, generator=torch.Generator().manual_seed(5)), -1).topk(K, dim=-1).indices
        logp = whole.gather(-1, ids)
    batch.teacher_dist = TopKDistribution(ids, logp, kind)
    loss, _, _, grads = loss_and_grads(model, batch, name, args, vocab_chunk=3)

    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    student_log = torch.nn.functional.pad(torch.log_softmax(logits[:, :-1].float(), -1), (0, 0, 1, 0))
    teacher_buckets = bucketed_log_probs(whole, ids).detach()
    reference = reference_loss(name, args, batch, student_log, lambda fn: fn(bucketed_log_probs(student_log, ids), teacher_buckets))
    reference.backward()
    reference = reference.detach()
    assert float(reference) != 0.0 and abs(float(loss - reference)) <= 1e-5, (float(loss), float(reference))
    for param, p in model.named_parameters():
        torch.testing.assert_close(grads[param], p.grad, rtol=0, atol=1e-5)


def reference_loss(name: str, args: dict, batch, student_log: torch.Tensor, terms) -> torch.Tensor:
    """The objective's loss with its per-position function ``fn`` applied as ``terms(fn)`` instead of to the batch's signal."""
    from opd_harness.method import StudentOutputs

    spec = METHODS.get(name)
    hp = spec.hparams(**args)
    logprobs = student_log.gather(-1, batch.input_ids.unsqueeze(-1)).squeeze(-1)
    outputs = StudentOutputs(logprobs=logprobs, vocab_map=lambda fn, *aligned: terms(fn))
    state = spec.make_state(hp) if spec.make_state else None
    return spec.objective(batch, outputs, hp, state)[0]


@pytest.mark.parametrize(("chunk", "tokens"), [(0, 0), (3, 0), (0, 20), (4, 20)])
def test_hf_teacher_hidden_states_and_at_ids_equal_its_full_scores(tiny_model_factory, char_tokenizer, chunk, tokens):
    model = tiny_model_factory(seed=3, hidden=32, layers=1).requires_grad_(False)
    batch = batch_for(model.config.vocab_size)
    backend = HFBackend(model, char_tokenizer, score_chunk=chunk, score_tokens=tokens)
    full = HFBackend(model, char_tokenizer).score(batch.input_ids, batch.attention_mask, want=("logprobs", "full"))
    ids = torch.randint(0, model.config.vocab_size, (*batch.input_ids.shape, K))
    got = backend.score(batch.input_ids, batch.attention_mask, want=("logprobs", "hidden", "at_ids"), token_ids=ids)
    rows = batch.attention_mask.bool()
    rows[:, 0] = False  # position 0 has no prefix
    from_hidden = HiddenDistribution(got["hidden"], model.get_output_embeddings()).log_distribution()
    torch.testing.assert_close(from_hidden[rows], full["full"][rows], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["logprobs"][rows], full["logprobs"][rows], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["at_ids_logprobs"][rows], full["full"].gather(-1, ids)[rows], rtol=0, atol=1e-5)


def test_score_teacher_fills_each_kind_on_the_cpu_in_the_signal_dtype(tiny_model_factory, char_tokenizer):
    model = tiny_model_factory(seed=3, hidden=32, layers=1).requires_grad_(False)
    backend = HFBackend(model, char_tokenizer, score_chunk=4)
    batch = batch_for(model.config.vocab_size)
    tokens, hidden = batch.input_ids.numel(), model.config.hidden_size
    score_teacher(backend, batch, kind="full", dtype="bf16")
    assert isinstance(batch.teacher_dist, HiddenDistribution) and batch.teacher_dist.hidden.dtype == torch.bfloat16
    assert batch.teacher_dist.shape == (*batch.input_ids.shape, model.config.vocab_size)
    per_token = (batch.teacher_dist.nbytes() + batch.teacher_logprobs.nbytes) / tokens  # what the docs' table states
    assert per_token == bytes_per_token("full", hidden=hidden, top_k=K, dtype_bytes=2)
    score_teacher(backend, batch, kind="topk", top_k=K)
    assert isinstance(batch.teacher_dist, TopKDistribution) and batch.teacher_dist.shape == (*batch.input_ids.shape, K)
    per_token = (batch.teacher_dist.nbytes() + batch.teacher_logprobs.nbytes) / tokens
    assert per_token == bytes_per_token("topk", hidden=hidden, top_k=K, dtype_bytes=4)  # the tail bucket is computed, not stored
    score_teacher(backend, batch, kind="sampled")
    assert batch.teacher_dist is None


def test_full_signal_scores_the_sampled_tokens_from_its_hidden_states_at_the_trained_positions_only(char_tokenizer):
    """At vocabulary 151,936 and mixed lengths: the teacher is asked for its hidden states alone (no whole-row log-softmax),
    and the sampled tokens' log-probs computed from them at the trained positions equal its whole-row scores there."""
    from test_learner_one_graph import SHORT, VOCAB, mixed_batch

    from opd_harness.models.tiny import TinyArch, build_tiny_model

    model = build_tiny_model(TinyArch(hidden=16, layers=1, heads=2, kv_heads=1, ffn=32), VOCAB, pad_id=0, eos_id=1, seed=7)
    backend = HFBackend(model.requires_grad_(False), char_tokenizer, score_tokens=256)
    batch = mixed_batch(SHORT, seed=3)
    expected = backend.score(batch.input_ids, batch.attention_mask, want=("logprobs",))["logprobs"] * batch.loss_mask
    asked, score = [], backend.score
    backend.score = lambda *a, **k: asked.append(k["want"]) or score(*a, **k)
    score_teacher(backend, batch, kind="full")
    assert asked == [("hidden",)]
    assert float(batch.loss_mask.sum()) > 0 and float(expected.abs().min()) == 0.0 < float(expected.abs().max())
    torch.testing.assert_close(batch.teacher_logprobs, expected, rtol=0, atol=1e-5)


PEAK_SCRIPT = """
import json, sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
sys.path.insert(0, 'tests')
from batches import make_batch
from opd_harness.backends.hf import HFBackend
from opd_harness.trainers.teacher import score_teacher
torch.manual_seed(0)
torch.set_num_threads(1)
cfg = Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True)
model = Qwen3ForCausalLM(cfg).eval().requires_grad_(False)
class Tok:
    pad_token_id, eos_token_id, padding_side = 0, 1, "left"
length = 2048
batch = make_batch([[1] * length], [[0.0] * length], [[0.0] * length])
batch.input_ids = torch.randint(2, 151936, (1, length))
backend = HFBackend(model, Tok(), score_chunk=128, score_tokens=2048)
from benchmarks.peak_memory import peak_rise
_, rise = peak_rise(lambda: score_teacher(backend, batch, kind=sys.argv[1], top_k=20))
print(json.dumps({"peak_mb": rise / 2**20}))
"""


@pytest.mark.parametrize("kind", ["full", "topk"])
def test_teacher_scoring_of_2k_tokens_at_qwen3_vocabulary_keeps_no_vocabulary_sized_tensor(kind):
    """(T, V) float32 at T = 2,048 is 1,245 MB (the batch field the teacher filled before, with a 4x scoring peak); the
    compact signals hold (T, 32) hidden states or (T, 20) top-k, and the chunked scoring peaks near 2 x (128, V)."""
    root = Path(__file__).resolve().parents[1]  # the script imports tests/ and benchmarks/ from there
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(PEAK_SCRIPT), kind], capture_output=True, text=True, timeout=300,
                          cwd=root)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_mb"]
    print(f"teacher scoring peak over the model, kind {kind}: {peak:.0f} MB")
    assert peak < 400


def test_the_rollout_returns_the_student_s_top_k_ids_of_every_sampled_token(tiny_model_factory, char_tokenizer):
    """The hf engine's top-k ids per generated token equal the top-k of the same model scoring the finished sequences,
    and ``to_tensor_batch`` puts them at the model tokens' positions (what the student_topk signal scores the teacher on)."""
    from opd_harness.backends import SamplingParams
    from opd_harness.trajectory import Segment, Trajectory, to_tensor_batch

    model = tiny_model_factory(seed=3, hidden=32, layers=1).requires_grad_(False)
    backend = HFBackend(model, char_tokenizer)
    prompts = [[5, 6, 7], [8, 9]]
    completions = backend.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=4, top_logprobs=K))
    trajectories = [Trajectory("t", str(c.prompt_index), c.sample_index, prompts[c.prompt_index],
                               segments=[Segment("model", c.token_ids, step=0, behaviour_logprobs=c.logprobs, top_ids=c.top_ids)])
                    for c in completions]  # fmt: skip
    batch = to_tensor_batch(trajectories, backend.pad_id)
    scored = backend.score(batch.input_ids, batch.attention_mask, want=("topk",), top_k=K)
    trained = batch.loss_mask > 0
    assert int(trained.sum()) == sum(len(c.token_ids) for c in completions) > 0
    assert torch.equal(batch.student_topk_ids[trained], scored["topk_ids"][trained])
    assert not batch.student_topk_ids[~trained].any()


def test_a_smoke_run_with_the_student_topk_signal_trains(tmp_path):
    from typer.testing import CliRunner

    from opd_harness.cli import app
    from opd_harness.store import Store

    out = tmp_path / "out"
    args = ["run", "--preset", "smoke", "--out", str(out), "--set", "method_args.opd.estimator=full", "--set",
            "teacher.signal=student_topk", "--set", "teacher.top_k=3", "--set", "eval.before_training=false"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    store = Store(out)
    (run,) = [r for r in store.runs() if r["kind"] == "train"]
    assert store.get_run(run["run_id"])["config"]["teacher"]["signal"] == "student_topk"
    steps = store.step_metrics(run["run_id"])
    assert steps and all(0.0 < m["teacher_kl_full"] < 10.0 for m in steps.values())


def test_joined_batches_join_their_teacher_distributions_row_for_row():
    """A rollout streamed by prompt group joins the groups' batches (``concat_batches``); a compact teacher distribution
    is joined with them, each part right-padded with zeros to the widest part, in row order."""
    import dataclasses

    from opd_harness.trajectory import concat_batches

    short, wide = batch_for(50, seed=0), batch_for(50, seed=1)
    wide = dataclasses.replace(wide, **{f.name: torch.cat([v, v[:, :3]], dim=1) for f in dataclasses.fields(wide)
                                         if isinstance(v := getattr(wide, f.name), torch.Tensor) and v.dim() >= 2})  # fmt: skip
    head = torch.nn.Linear(4, 50, bias=False)
    for make in (lambda b, g: TopKDistribution(*reversed(b.teacher_dist.topk(K, dim=-1))),
                 lambda b, g: HiddenDistribution(torch.randn((*b.input_ids.shape, 4), generator=g), head)):  # fmt: skip
        parts = [dataclasses.replace(b, teacher_dist=make(b, torch.Generator().manual_seed(i))) for i, b in enumerate((short, wide))]
        joined = concat_batches(parts).teacher_dist
        assert type(joined) is type(parts[0].teacher_dist) and joined.shape[:2] == (6, wide.input_ids.shape[1])
        for name in ("ids", "logp") if isinstance(joined, TopKDistribution) else ("hidden",):
            first, second = getattr(parts[0].teacher_dist, name), getattr(parts[1].teacher_dist, name)
            assert torch.equal(getattr(joined, name)[:3, : first.shape[1]], first) and not getattr(joined, name)[:3, first.shape[1] :].any()
            assert torch.equal(getattr(joined, name)[3:], second)
