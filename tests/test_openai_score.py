"""`--backend openai` scoring (prompt log-probs through ``echo``) against a real `harness serve` app on a tiny
model, compared with the HF backend scoring the same model in-process."""

from __future__ import annotations

import pytest
import torch

from opd_harness.backends.hf import HFBackend
from opd_harness.backends.openai_backend import OpenAIBackend, ScoringMismatch
from opd_harness.models.tiny import build_char_tokenizer, load_model_and_tokenizer
from opd_harness.serve import make_app
from serving import Probe, running, saved_tiny_model

MODEL = "tiny"
TEXTS = ["12+3=15", "7*8=56 and more", "a", "(9-4)*2=10"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("scored"), seed=3)


@pytest.fixture(scope="module")
def hf(model_dir):
    lm, tok = load_model_and_tokenizer(model_dir)
    return HFBackend(lm, tok, batch_size=64)


@pytest.fixture(scope="module")
def server(hf):
    probe = Probe(make_app(hf, model_name=MODEL, max_logprobs=-1))  # no cap: top-k up to the vocabulary
    with running(probe) as base:
        yield base + "/v1", probe


@pytest.fixture
def url(server):
    server[1].reset()
    yield server[0]
    server[1].reset()


@pytest.fixture
def probe(server):
    return server[1]


def right_padded(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and mask, as the trainers build batches."""
    seqs = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask


def scored_positions(mask: torch.Tensor) -> torch.Tensor:
    """Positions with a prefix: real tokens after each row's first."""
    valid = mask.bool().clone()
    valid[:, 0] = False
    return valid


@pytest.mark.parametrize("options", [{}, {"prompt_format": "text", "server_extensions": "false"}], ids=["token-ids", "text"])
def test_score_equals_hf_scoring(url, model_dir, hf, probe, options):
    backend = OpenAIBackend.load(MODEL, base_url=url, tokenizer=str(model_dir), concurrency=2, **options)
    ids, mask = right_padded(hf.tokenizer, TEXTS)
    got = backend.score(ids, mask, want=("logprobs", "topk"), top_k=5)
    want = hf.score(ids, mask, want=("logprobs", "topk"), top_k=5)
    valid = scored_positions(mask)
    assert torch.allclose(got["logprobs"][valid], want["logprobs"][valid], atol=1e-4)
    assert torch.all(got["logprobs"][~valid] == 0)  # position 0 and padding score 0, as in the HF backend
    assert torch.allclose(got["topk_logprobs"][valid], want["topk_logprobs"][valid], atol=1e-4)
    assert torch.equal(got["topk_ids"][valid], want["topk_ids"][valid])
    assert len(probe.bodies) == len(TEXTS) and all(b["echo"] is True and b["max_tokens"] == 0 for b in probe.bodies)
    sent_ids = all(isinstance(b["prompt"], list) for b in probe.bodies)
    assert sent_ids == (options.get("prompt_format") != "text")


@pytest.mark.parametrize("k", [1, 3, 12])
def test_topk_lists_have_k_entries_in_descending_order(url, model_dir, hf, k):
    backend = OpenAIBackend.load(MODEL, base_url=url, tokenizer=str(model_dir))
    ids, mask = right_padded(hf.tokenizer, TEXTS[:2])
    got = backend.score(ids, mask, want=("logprobs", "topk"), top_k=k)
    valid = scored_positions(mask)
    values = got["topk_logprobs"][valid]
    assert values.shape == (int(valid.sum()), k) and got["topk_ids"][valid].shape == (int(valid.sum()), k)
    assert torch.all(values[:, :-1] >= values[:, 1:])
    assert torch.all(values[:, 0] >= got["logprobs"][valid] - 1e-6)  # nothing beats the top-1
    assert all(len(set(row)) == k for row in got["topk_ids"][valid].tolist())


def test_topk_over_the_whole_vocabulary_is_the_full_distribution(url, model_dir, hf):
    backend = OpenAIBackend.load(MODEL, base_url=url, tokenizer=str(model_dir))
    ids, mask = right_padded(hf.tokenizer, TEXTS[:1])
    vocab = len(hf.tokenizer)
    got = backend.score(ids, mask, want=("topk",), top_k=vocab)
    full = hf.score(ids, mask, want=("full",))["full"]
    valid = scored_positions(mask)
    rebuilt = torch.zeros_like(full).scatter(-1, got["topk_ids"], got["topk_logprobs"])
    assert torch.allclose(rebuilt[valid], full[valid], atol=1e-4)


def merging_tokenizer():
    """The served model's character vocabulary plus one merged token "12": the same text, other token positions."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = build_char_tokenizer()
    inner = Tokenizer(models.WordLevel(vocab={**base.get_vocab(), "12": len(base)}, unk_token=base.unk_token))
    inner.pre_tokenizer = pre_tokenizers.Split(Regex("12|."), behavior="isolated")
    inner.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token=base.pad_token, eos_token=base.eos_token, unk_token=base.unk_token)


def test_text_prompts_retokenised_differently_are_a_clear_error(url):
    import openai

    local = merging_tokenizer()
    backend = OpenAIBackend(openai.OpenAI(base_url=url, api_key="x"), MODEL, local, prompt_format="text", server_extensions=False)
    ids, mask = right_padded(local, ["12+3"])
    assert ids[0, 0].item() == len(local) - 1  # "12" is one local token
    with pytest.raises(
        ScoringMismatch,
        match=r"row 0, position 0: the server's token '1' is not the local token \d+ \('12'\); the server tokenised the prompt differently",
    ):
        backend.score(ids, mask)


def test_a_server_refusing_max_tokens_0_is_scored_with_max_tokens_1(url, model_dir, hf, probe):
    backend = OpenAIBackend.load(MODEL, base_url=url, tokenizer=str(model_dir), prompt_format="tokens", max_retries=0)
    ids, mask = right_padded(hf.tokenizer, TEXTS[:2])
    probe.fail_next = [400]  # the first echo request (max_tokens 0) is refused
    got = backend.score(ids, mask, want=("logprobs",))
    valid = scored_positions(mask)
    assert torch.allclose(got["logprobs"][valid], hf.score(ids, mask)["logprobs"][valid], atol=1e-4)
    assert 1 in [b["max_tokens"] for b in probe.bodies] and backend._echo_max_tokens == 1  # the refused row was re-sent
    sent = len(probe.bodies)  # (rows run concurrently: the other row's max_tokens-0 request may come last)
    again = backend.score(ids, mask, want=("logprobs",))
    assert torch.allclose(again["logprobs"], got["logprobs"], atol=1e-5) and [b["max_tokens"] for b in probe.bodies[sent:]] == [
        1,
        1,
    ]  # and the choice is kept


def test_score_refuses_what_a_server_cannot_return(url, model_dir, hf):
    backend = OpenAIBackend.load(MODEL, base_url=url, tokenizer=str(model_dir))
    ids, mask = right_padded(hf.tokenizer, TEXTS[:1])
    with pytest.raises(NotImplementedError, match=r"cannot score \['full'\]"):
        backend.score(ids, mask, want=("logprobs", "full"))
    with pytest.raises(NotImplementedError, match="gradients"):
        backend.score(ids, mask, grad=True)
    with pytest.raises(ValueError, match="top_k >= 1"):
        backend.score(ids, mask, want=("topk",), top_k=0)
    assert OpenAIBackend.score_fields == ("logprobs", "topk")


def test_lm_eval_loglikelihood_scoring_through_the_openai_backend(url, model_dir, hf):
    from opd_harness.tasks.lm_eval_bridge import score_continuations

    backend = OpenAIBackend.load(MODEL, base_url=url, tokenizer=str(model_dir))
    pairs = [("2+2=", "4"), ("2+2=", "5"), ("The answer is", " 12"), ("x", "yz")]
    remote, local = score_continuations(backend, pairs), score_continuations(hf, pairs)
    for (r_logp, r_greedy, r_text), (l_logp, l_greedy, l_text) in zip(remote, local, strict=True):
        assert r_logp == pytest.approx(l_logp, abs=1e-4) and (r_greedy, r_text) == (l_greedy, l_text)


def test_lm_eval_multiple_choice_through_harness_eval_equals_hf(url, model_dir, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    import json
    import shutil
    import sqlite3
    from pathlib import Path

    from typer.testing import CliRunner

    from opd_harness.cli import app

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    data = Path(__file__).parent / "data" / "lm_eval"
    include = tmp_path / "tasks"
    include.mkdir()
    for template in data.glob("*.yaml.tmpl"):
        (include / template.name.removesuffix(".tmpl")).write_text(template.read_text().format(data_file=(data / "arith.jsonl").resolve()))
    shutil.copy(data / "utils.py", include / "utils.py")
    task = ["--task", "lm_eval:arith_mc", "--task-arg", f"lm_eval:arith_mc.include_path={include}", "--json"]
    results = {}
    for name, backend in (
        ("hf", ["--model", str(model_dir)]),
        (
            "openai",
            ["--backend", "openai", "--model", MODEL, "--backend-option", f"base_url={url}", "--backend-option", f"tokenizer={model_dir}"],
        ),
    ):
        out = tmp_path / name
        result = CliRunner().invoke(app, ["eval", *backend, *task, "--out", str(out)])
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout)["tasks"]["lm_eval:arith_mc"]
        assert summary["n_samples"] == 6 and summary["n_errors"] == 0
        with sqlite3.connect(out / "results.sqlite") as db:
            results[name] = (summary["avg_at_k"], sorted(db.execute("SELECT problem_id, completion, status FROM samples").fetchall()))
    assert results["openai"] == results["hf"]
