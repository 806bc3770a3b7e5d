"""`harness serve`'s OpenAI API against the HF backend: echo and prompt log-probs, top-k log-probs and
their cap, streaming, and batching across concurrent requests.

A real uvicorn server runs in a background thread on a free loopback port, serving a tiny model built
here; requests are plain HTTP (urllib), as any client would send them.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable

import pytest
import torch
from serving import metrics, post, post_raw, post_stream, running

from opd_harness.backends.hf import HFBackend
from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model
from opd_harness.serve import Limits, make_app
from opd_harness.serve.engine import Engine
from opd_harness.serve.engine import Sequence as Seq

MODEL = "tiny"
PROMPTS = ["Q: What is 2+3?\nA:", "hello world"]


@pytest.fixture(scope="module")
def hf() -> HFBackend:
    tok = build_char_tokenizer()
    arch = TinyArch(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64, max_positions=128)
    model = build_tiny_model(arch, len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, seed=0)
    return HFBackend(model, tok)


@pytest.fixture(scope="module")
def url(hf):
    with running(make_app(hf, model_name=MODEL)) as base:
        yield base + "/v1"


def encode(hf: HFBackend, text: str) -> list[int]:
    return hf.tokenizer(text, add_special_tokens=False)["input_ids"]


def hf_scores(hf: HFBackend, ids: list[int], top_k: int = 0) -> dict[str, torch.Tensor]:
    """The HF backend's ``score`` of one sequence (position t: token t given its prefix)."""
    tensor = torch.tensor([ids])
    want = ("logprobs", "topk") if top_k else ("logprobs",)
    return {k: v[0] for k, v in hf.score(tensor, torch.ones_like(tensor), want=want, top_k=top_k).items()}


# ----------------------------------------------------------------------------- echo and prompt log-probs


@pytest.mark.parametrize("shape", ["str", "list[str]", "list[int]", "list[list[int]]"])
def test_echo_prompt_logprobs_equal_hf_score(hf, url, shape):
    ids = [encode(hf, p) for p in PROMPTS]
    prompt = {"str": PROMPTS[0], "list[str]": PROMPTS, "list[int]": ids[0], "list[list[int]]": ids}[shape]
    status, body = post(url, "/completions", {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1})
    assert status == 200, body
    expected = PROMPTS if shape.startswith("list[") and shape != "list[int]" else PROMPTS[:1]
    assert len(body["choices"]) == len(expected)
    assert body["usage"] == {
        "prompt_tokens": sum(len(encode(hf, p)) for p in expected),
        "completion_tokens": 0,
        "total_tokens": sum(len(encode(hf, p)) for p in expected),
    }
    for choice, text in zip(body["choices"], expected, strict=True):
        lp = choice["logprobs"]
        assert choice["text"] == text and choice["finish_reason"] == "length"
        assert lp["tokens"] == list(text) and len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(text)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first token has no prefix
        assert lp["token_logprobs"][1:] == pytest.approx(hf_scores(hf, encode(hf, text))["logprobs"][1:].tolist(), abs=1e-4)
        assert [text[o : o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"], strict=True)] == lp["tokens"]


def test_echo_with_a_completion_puts_the_prompt_first(hf, url):
    base = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 5, "logprobs": 2, "seed": 3, "temperature": 1.0}
    status, plain = post(url, "/completions", base)
    assert status == 200
    status, echoed = post(url, "/completions", {**base, "echo": True})
    assert status == 200
    plain_choice, echo_choice = plain["choices"][0], echoed["choices"][0]
    n_prompt = len(PROMPTS[1])
    assert echo_choice["text"] == PROMPTS[1] + plain_choice["text"]
    lp, completion = echo_choice["logprobs"], plain_choice["logprobs"]
    assert lp["tokens"] == list(PROMPTS[1]) + completion["tokens"]
    assert lp["token_logprobs"][n_prompt:] == pytest.approx(completion["token_logprobs"], abs=1e-5)
    assert lp["text_offset"][n_prompt:] == [n_prompt + o for o in completion["text_offset"]]
    # the whole echoed sequence is scored like the HF backend scores prompt + completion
    whole = encode(hf, PROMPTS[1]) + [hf.tokenizer.convert_tokens_to_ids(t) for t in completion["tokens"]]
    assert lp["token_logprobs"][1:] == pytest.approx(hf_scores(hf, whole)["logprobs"][1:].tolist(), abs=1e-4)
    assert echoed["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] == len(completion["tokens"])


def test_lm_eval_style_loglikelihood_request(hf, url):
    """What lm-eval's local-completions sends for a log-likelihood: echo, max_tokens 1, logprobs 1, token ids."""
    context, continuation = encode(hf, "Q: What is 2+3?\nA:"), encode(hf, " 5")
    status, body = post(
        url,
        "/completions",
        {"model": MODEL, "prompt": [context + continuation], "echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0, "seed": 1234},
    )
    assert status == 200
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(context) + len(continuation) + 1
    expected = hf_scores(hf, context + continuation)["logprobs"][len(context) :]
    assert sum(lp["token_logprobs"][len(context) : -1]) == pytest.approx(expected.sum().item(), abs=1e-4)
    for token_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert max(top.values()) >= token_lp and len(top) in (1, 2)  # the most likely token, plus the given one


# ----------------------------------------------------------------------------- top-k log-probs and their cap


@pytest.mark.parametrize("n", [1, 3, 5])
def test_completion_top_logprobs(hf, url, n):
    status, body = post(
        url, "/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "logprobs": n, "seed": 5, "echo": True}
    )
    assert status == 200
    lp = body["choices"][0]["logprobs"]
    ids = encode(hf, PROMPTS[0]) + [hf.tokenizer.convert_tokens_to_ids(t) for t in lp["tokens"][len(PROMPTS[0]) :]]
    reference = hf_scores(hf, ids, top_k=n)
    for t in range(1, len(ids)):
        top, token, token_lp = lp["top_logprobs"][t], lp["tokens"][t], lp["token_logprobs"][t]
        values = list(top.values())
        assert len(top) in (n, n + 1)
        assert values[:n] == sorted(values[:n], reverse=True)  # the N most likely, most likely first
        assert top[token] == pytest.approx(token_lp, abs=1e-6)  # the chosen token is listed with its log-prob
        assert len(top) == n or token_lp < values[n - 1]  # an extra entry only for a chosen token outside the top N
        assert values[:n] == pytest.approx(reference["topk_logprobs"][t].tolist(), abs=1e-4)
        assert list(top)[:n] == hf.tokenizer.convert_ids_to_tokens(reference["topk_ids"][t].tolist())


def test_chat_top_logprobs(url):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 3,
        "seed": 2,
    }
    status, answer = post(url, "/chat/completions", body)
    assert status == 200
    for entry in answer["choices"][0]["logprobs"]["content"]:
        values = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry["logprob"] <= values[0] + 1e-6
        assert entry["token"] not in [alt["token"] for alt in entry["top_logprobs"]] or entry["logprob"] in values


def test_logprobs_cap(hf, url):
    status, answer = post(url, "/completions", {"model": MODEL, "prompt": "ab", "logprobs": 21})
    assert status == 400 and answer["error"]["param"] == "logprobs"
    assert answer["error"]["message"] == "Requested sample logprobs of 21, which is greater than max allowed: 20"
    assert post(url, "/completions", {"model": MODEL, "prompt": "ab", "logprobs": 20, "max_tokens": 1})[0] == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    status, answer = post(url, "/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21})
    assert status == 400 and answer["error"]["param"] == "top_logprobs" and "max allowed: 20" in answer["error"]["message"]
    status, answer = post(url, "/chat/completions", {**chat, "top_logprobs": 2})
    assert status == 400 and "logprobs=true" in answer["error"]["message"]
    with running(make_app(hf, model_name=MODEL, max_logprobs=2)) as base:
        assert post(base + "/v1", "/completions", {"model": MODEL, "prompt": "ab", "logprobs": 2, "max_tokens": 1})[0] == 200
        status, answer = post(base + "/v1", "/completions", {"model": MODEL, "prompt": "ab", "logprobs": 3, "max_tokens": 1})
        assert status == 400 and "max allowed: 2" in answer["error"]["message"]


# ----------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("extra", [{}, {"stop": ["a", "xy"]}, {"echo": True}, {"stop": ["b"], "include_stop_str_in_output": True}])
def test_completion_stream_equals_response(url, extra):
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 12, "n": 2, "seed": 11, "temperature": 1.0, "logprobs": 2, **extra}
    status, whole = post(url, "/completions", body)
    assert status == 200
    events = post_stream(url, "/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    chunks = events[:-2]
    assert len(chunks) > len(whole["choices"])  # incremental: more than one chunk per choice
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + [choice["finish_reason"]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for c in mine for x in c["logprobs"][key]] == choice["logprobs"][key]


def test_chat_stream_equals_response(url):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "2+2?"}],
        "max_tokens": 10,
        "n": 2,
        "seed": 4,
        "logprobs": True,
        "top_logprobs": 2,
    }
    status, whole = post(url, "/chat/completions", body)
    assert status == 200
    events = post_stream(url, "/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == choice["message"]["content"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
        assert [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]] == choice["logprobs"]["content"]


def test_stream_errors(url):
    status, answer = post(url, "/completions", {"model": MODEL, "prompt": "ab", "stream_options": {"include_usage": True}})
    assert status == 400 and answer["error"]["param"] == "stream_options"
    status, answer = post(url, "/completions", {"model": MODEL, "prompt": "ab", "stream": True, "max_tokens": 1000})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"  # checked before the stream starts


# ----------------------------------------------------------------------------- batching across requests


def concurrently_with_status(url: str, bodies: list[dict]) -> list[tuple[int, dict] | None]:
    """POST ``bodies`` to /completions at once; (status, answer) per body (None: no answer within 60 s)."""
    results: list[tuple[int, dict] | None] = [None] * len(bodies)

    def send(i: int) -> None:
        results[i] = post(url, "/completions", bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def concurrently(url: str, bodies: list[dict]) -> list[dict]:
    return [result[1] for result in concurrently_with_status(url, bodies)]


def test_concurrent_requests_are_batched_and_answer_as_alone(hf):
    bodies = [
        {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "seed": 1, "temperature": 1.0, "logprobs": 2},
        {"model": MODEL, "prompt": [PROMPTS[1], "xyz"], "max_tokens": 5, "seed": 2, "temperature": 0.7, "top_p": 0.9, "logprobs": 0},
        {"model": MODEL, "prompt": "abc", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1},
        {"model": MODEL, "prompt": "Q:", "max_tokens": 10, "seed": 3, "n": 2, "stop": ["e"], "logprobs": 3},
    ]
    with running(make_app(hf, model_name=MODEL, max_batch=16, batch_wait_s=1.0)) as base:
        url = base + "/v1"
        together = concurrently(url, bodies)
        stats = metrics(base)
        assert stats["harness_serve_batches_total"] == 1 and stats["harness_serve_batch_size_max"] == 6
        alone = [post(url, "/completions", body)[1] for body in bodies]
        assert metrics(base)["harness_serve_batches_total"] == 1 + len(bodies)
    for a, b in zip(alone, together, strict=True):
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
        for ca, cb in zip(a["choices"], b["choices"], strict=True):
            assert ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]
            assert ca["logprobs"]["token_logprobs"] == pytest.approx(cb["logprobs"]["token_logprobs"], abs=1e-5)


def test_max_batch_limits_a_batch(hf):
    with running(make_app(hf, model_name=MODEL, max_batch=4, batch_wait_s=0.5)) as base:
        status, body = post(
            base + "/v1", "/completions", {"model": MODEL, "prompt": ["ab", "cd", "ef"], "n": 3, "max_tokens": 2, "seed": 0}
        )
        assert status == 200 and len(body["choices"]) == 9
        stats = metrics(base)
    assert stats["harness_serve_batches_total"] == 3 and stats["harness_serve_batch_size_max"] == 4
    # a token budget: 4 padded positions per sequence (2 prompt + 2 new), 10 per batch -> 2 sequences
    with running(make_app(hf, model_name=MODEL, max_batch=16, max_batch_tokens=10, batch_wait_s=0.5)) as base:
        status, body = post(
            base + "/v1", "/completions", {"model": MODEL, "prompt": ["ab", "cd", "ef"], "n": 2, "max_tokens": 2, "seed": 0}
        )
        assert status == 200 and len(body["choices"]) == 6
        stats = metrics(base)
    assert stats["harness_serve_batches_total"] == 3 and stats["harness_serve_batch_size_max"] == 2


def test_seeded_samples_are_reproducible_and_distinct(url):
    body = {"model": MODEL, "prompt": ["ab", "ab"], "n": 2, "max_tokens": 12, "seed": 9, "temperature": 1.0}
    first, second = post(url, "/completions", body)[1], post(url, "/completions", body)[1]
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in second["choices"]]
    assert texts[0] == texts[2] and texts[1] == texts[3]  # sample s of each prompt uses seed + s, as vLLM
    assert texts[0] != texts[1]


# ----------------------------------------------------------------------------- failures and helpers


class Broken(torch.nn.Module):
    def forward(self, **kwargs):
        raise RuntimeError("the device fell over")


def test_a_failing_model_is_a_500_and_the_server_keeps_serving(hf):
    app = make_app(hf, model_name=MODEL)
    engine = app.state.served.engine
    with running(app) as base:
        engine.model = Broken()
        status, answer = post(base + "/v1", "/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 2})
        assert status == 500 and answer["error"]["type"] == "server_error" and "the device fell over" in answer["error"]["message"]
        events = post_stream(base + "/v1", "/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 2})
        assert events[-1] == "[DONE]" and "the device fell over" in events[-2]["error"]["message"]
        engine.model = hf.model
        assert post(base + "/v1", "/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 2})[0] == 200


def test_safe_prefix_holds_back_what_may_become_a_stop_string():
    from opd_harness.serve.engine import first_stop, safe_prefix

    assert safe_prefix("hello wor", ()) == "hello wor"
    assert safe_prefix("hello wor", ("world", "x")) == "hello"  # "wor" may still become "world"
    assert safe_prefix("ab\ufffd", ()) == "ab"  # an incomplete UTF-8 sequence waits for its next byte
    assert first_stop("a\nQ: b", ("Q:", "\n")) == (1, "\n") and first_stop("abc", ("x",)) is None


def test_tokens_as_ids_for_exact_scoring(hf, url):
    """What a scoring client sends: token ids, echo, max_tokens 0, top-k, tokens named by id."""
    ids = encode(hf, PROMPTS[0])
    body = {"model": MODEL, "prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 4, "return_tokens_as_token_ids": True}
    status, answer = post(url, "/completions", body)
    assert status == 200
    lp = answer["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    reference = hf_scores(hf, ids, top_k=4)
    for t in range(1, len(ids)):
        top = lp["top_logprobs"][t]
        assert list(top)[:4] == [f"token_id:{i}" for i in reference["topk_ids"][t].tolist()]
        assert list(top.values())[:4] == pytest.approx(reference["topk_logprobs"][t].tolist(), abs=1e-4)
        assert top[f"token_id:{ids[t]}"] == pytest.approx(reference["logprobs"][t].item(), abs=1e-4)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.8, 0.9)])
def test_one_seeded_sample_is_the_hf_backends(hf, url, temperature, top_p):
    from opd_harness.backends import SamplingParams

    for seed, text in enumerate(PROMPTS):
        body = {
            "model": MODEL,
            "prompt": text,
            "max_tokens": 16,
            "seed": seed,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        served = post(url, "/completions", body)[1]["choices"][0]
        row_seeded = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=16, seed=seed, seeds=(seed,))  # row seed = seed
        direct = hf.generate([encode(hf, text)], row_seeded)[0]
        assert [int(t.removeprefix("token_id:")) for t in served["logprobs"]["tokens"]] == direct.token_ids
        assert served["logprobs"]["token_logprobs"] == pytest.approx(direct.logprobs, abs=1e-5)


class Slow(torch.nn.Module):
    """The model, ``delay_s`` (20 ms) slower per forward pass: time for a client to go away mid-stream."""

    def __init__(self, inner: torch.nn.Module, delay_s: float = 0.02) -> None:
        super().__init__()
        self.inner, self.delay_s = inner, delay_s

    def forward(self, **kwargs):
        time.sleep(self.delay_s)
        return self.inner(**kwargs)


def test_a_stream_whose_client_goes_away_stops_decoding(hf):
    app = make_app(hf, model_name=MODEL)
    engine = app.state.served.engine
    engine.model = Slow(hf.model)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 100, "temperature": 0, "stream": True}
    with running(app) as base:
        request = urllib.request.Request(
            base + "/v1/completions", data=json.dumps(body).encode(), method="POST", headers={"content-type": "application/json"}
        )
        response = urllib.request.urlopen(request, timeout=30)
        assert response.readline().startswith(b"data: ")  # decoding has started
        response.close()
        time.sleep(1.0)
        passes = metrics(base)["harness_serve_forward_passes_total"]
        time.sleep(0.5)
        assert metrics(base)["harness_serve_forward_passes_total"] == passes < 60  # stopped, well before 100 tokens


def test_closing_the_engine_ends_a_batch_in_progress(hf):
    app = make_app(hf, model_name=MODEL)
    engine = app.state.served.engine
    engine.model = Slow(hf.model)
    with running(app) as base:
        result: list = []
        sender = threading.Thread(
            target=lambda: result.append(
                post(base + "/v1", "/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 100, "temperature": 0})
            )
        )
        sender.start()
        time.sleep(0.5)
        engine.close()
        sender.join(10)
        assert not engine._worker.is_alive()
        status, answer = result[0]
        assert status == 500 and "shutting down" in answer["error"]["message"]


# ----------------------------------------------------------------------------- hostile clients: bounded work per request


def answered_fast(base: str, send: Callable[[], tuple], within_s: float = 3.0) -> tuple:
    """``send()``'s result, which must arrive within ``within_s`` while ``/health`` answers every probe within 1 s."""
    result: list = []
    sender = threading.Thread(target=lambda: result.append(send()), daemon=True)
    start = time.monotonic()
    sender.start()
    probes = []
    while sender.is_alive() and time.monotonic() - start < within_s:
        began = time.monotonic()
        with urllib.request.urlopen(base + "/health", timeout=5) as response:
            assert response.status == 200
        probes.append(time.monotonic() - began)
        time.sleep(0.05)
    sender.join(max(0.0, start + within_s - time.monotonic()))
    assert result, f"no answer within {within_s} s"
    assert max(probes, default=0.0) < 1.0, f"/health took {max(probes):.2f} s meanwhile"
    return result[0]


def test_too_many_sequences_in_one_request_are_refused_at_once(url):
    """The issue's request: 20 KB, 4,000 prompts x n = 128 (512,000 sequences); the default cap is 1,024."""
    base = url.removesuffix("/v1")
    body = {"model": MODEL, "prompt": ["ab"] * 4000, "n": 128, "max_tokens": 1}
    status, answer, _ = answered_fast(base, lambda: post_raw(url, "/completions", json.dumps(body).encode(), timeout=30))
    assert status == 400 and "512000 sequences" in answer["error"]["message"] and answer["error"]["param"] == "n"
    assert post(url, "/completions", {**body, "prompt": ["ab"] * 8})[0] == 200  # 1,024 sequences


def test_a_prompt_longer_than_the_context_is_refused_before_tokenising(url):
    """1 MB of text cannot fit in 128 positions: refused without tokenising it (6 s for this tokenizer)."""
    base = url.removesuffix("/v1")
    body = json.dumps({"model": MODEL, "prompt": "a" * 1_000_000, "max_tokens": 1}).encode()
    status, answer, _ = answered_fast(base, lambda: post_raw(url, "/completions", body, timeout=30), within_s=2.0)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a" * 1_000_000}], "max_tokens": 1}).encode()
    status, answer, _ = answered_fast(base, lambda: post_raw(url, "/chat/completions", chat, timeout=30), within_s=2.0)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"


def test_total_tokens_per_request_are_bounded(hf):
    with running(make_app(hf, model_name=MODEL, limits=Limits(max_request_tokens=100))) as base:
        body = {"model": MODEL, "prompt": ["abc", "def"], "n": 4, "max_tokens": 10}  # 8 sequences x (3 + 10) = 104 tokens
        status, answer = post(base + "/v1", "/completions", body)
        assert status == 400 and "104 tokens" in answer["error"]["message"] and "at most 100" in answer["error"]["message"]
        assert post(base + "/v1", "/completions", {**body, "max_tokens": 9})[0] == 200  # 96 tokens
        # 4 x 127 characters > 100 x 5
        status, answer = post(base + "/v1", "/completions", {**body, "prompt": ["a" * 126, "b"], "max_tokens": 1})
        assert status == 400 and "tokens per request" in answer["error"]["message"]


def test_max_model_len_shortens_the_context(hf):
    with running(make_app(hf, model_name=MODEL, limits=Limits(max_model_len=10))) as base:
        status, answer = post(base + "/v1", "/completions", {"model": MODEL, "prompt": "abcd", "max_tokens": 7})
        assert (
            status == 400
            and answer["error"]["code"] == "context_length_exceeded"
            and "maximum context length is 10" in answer["error"]["message"]
        )
        assert post(base + "/v1", "/completions", {"model": MODEL, "prompt": "abcd", "max_tokens": 6})[0] == 200
    with pytest.raises(ValueError, match="--max-model-len 129 is longer than the model's context window"):
        make_app(hf, model_name=MODEL, limits=Limits(max_model_len=129))


def test_a_body_over_the_limit_is_refused_before_it_is_read(hf):
    with running(make_app(hf, model_name=MODEL, limits=Limits(max_body_bytes=1000))) as base:
        where = urllib.parse.urlsplit(base)
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=5)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("content-type", "application/json")
        conn.putheader("content-length", str(17 << 20))  # declared, never sent
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
        conn.close()
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=5)  # no length: refused once 1,000 bytes have come
        conn.request(
            "POST", "/v1/completions", body=iter([b" " * 600] * 3), headers={"content-type": "application/json"}, encode_chunked=True
        )
        response = conn.getresponse()
        assert response.status == 413 and "larger than this server accepts (1000 bytes)" in json.loads(response.read())["error"]["message"]
        conn.close()
        assert post(base + "/v1", "/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 1})[0] == 200


def test_the_default_body_limit_is_16_mib(url):
    where = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=5)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("content-length", str((16 << 20) + 1))
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()


def test_queued_work_is_bounded_with_a_503_and_retry_after(hf):
    app = make_app(hf, model_name=MODEL, max_batch=2, limits=Limits(max_request_sequences=4, max_queued_sequences=4))
    engine = app.state.served.engine
    engine.model = Slow(hf.model)
    with running(app) as base:
        url = base + "/v1"
        holder = threading.Thread(
            target=post, args=(url, "/completions", {"model": MODEL, "prompt": "abc", "n": 4, "max_tokens": 60, "temperature": 0})
        )
        holder.start()
        deadline = time.monotonic() + 10
        while engine.load < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        small = json.dumps({"model": MODEL, "prompt": "ab", "max_tokens": 1}).encode()
        status, answer, headers = answered_fast(base, lambda: post_raw(url, "/completions", small, timeout=30), within_s=2.0)
        assert status == 503 and answer["error"]["code"] == "server_busy" and headers["retry-after"] == "1"
        holder.join(30)
        assert engine.load == 0 and post_raw(url, "/completions", small)[0] == 200


# ----------------------------------------------------------------------------- hostile clients: abandoned requests


def test_abandoned_requests_stop_decoding(hf):
    """Clients that leave (three waiting for a whole answer, one for a stream) stop their sequences: a new small request
    is answered at once rather than after their 2 x 120 decode steps."""
    app = make_app(hf, model_name=MODEL, max_batch=2)
    engine = app.state.served.engine
    engine.model = Slow(hf.model, delay_s=0.05)
    with running(app) as base:
        where = urllib.parse.urlsplit(base)
        clients = []
        for i in range(4):
            conn = http.client.HTTPConnection(where.hostname, where.port, timeout=5)
            body = {"model": MODEL, "prompt": "abc", "max_tokens": 120, "temperature": 0, "stream": i == 3}
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
            clients.append(conn)
        deadline = time.monotonic() + 10
        while metrics(base)["harness_serve_forward_passes_total"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # decoding has started
        for conn in clients:
            conn.close()
        start = time.monotonic()
        status, _ = post(base + "/v1", "/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 2, "temperature": 0}, timeout=30)
        assert status == 200 and time.monotonic() - start < 3.0
        assert engine.load == 0
        passes = metrics(base)["harness_serve_forward_passes_total"]
        time.sleep(0.3)
        assert metrics(base)["harness_serve_forward_passes_total"] == passes < 100  # nothing left decoding


# ----------------------------------------------------------------------------- hostile clients: one request cannot fail its batch


def run_engine(engine: Engine, seqs: list[Seq]) -> None:
    """Submit ``seqs`` together and wait until each has finished or failed."""
    left, finished = [len(seqs)], threading.Event()

    def on_event(seq: Seq, kind: str, delta) -> None:
        if kind in ("done", "error"):
            left[0] -= 1
            if not left[0]:
                finished.set()

    for seq in seqs:
        seq.on_event = on_event
    engine.submit(seqs)
    assert finished.wait(30)


def test_a_sequence_whose_sampling_fails_fails_alone(hf):
    engine = Engine(hf.model, hf.tokenizer, device="cpu", batch_wait_s=0.5)
    try:

        def benign() -> Seq:
            return Seq(prompt=encode(hf, "ab"), max_tokens=8, temperature=1.0, seed=3)

        alone = benign()
        run_engine(engine, [alone])
        hostile, mate = Seq(prompt=encode(hf, "cd"), max_tokens=8, temperature=1e-45, seed=1), benign()  # logits / 1e-45 overflow
        run_engine(engine, [hostile, mate])
        assert engine.stats.waves == 2 and engine.stats.max_wave == 2  # decoded together
        assert "inf" in str(hostile.error) and mate.error is None
        assert mate.tokens == alone.tokens and mate.finish_reason == alone.finish_reason
    finally:
        engine.close()


class Poisoned(torch.nn.Module):
    """The model, failing every prefill whose prompts hold token ``poison``: a request that breaks the batch it is in."""

    def __init__(self, inner: torch.nn.Module, poison: int) -> None:
        super().__init__()
        self.inner, self.poison = inner, poison

    def forward(self, **kwargs):
        if kwargs["input_ids"].shape[1] > 1 and (kwargs["input_ids"] == self.poison).any():
            raise RuntimeError("poisoned batch")
        return self.inner(**kwargs)


def test_a_batch_that_fails_is_retried_one_sequence_at_a_time(hf):
    benign = {"model": MODEL, "prompt": "ab", "max_tokens": 6, "seed": 5, "temperature": 1.0}
    app = make_app(hf, model_name=MODEL, max_batch=8, batch_wait_s=1.0)
    engine = app.state.served.engine
    with running(app) as base:
        url = base + "/v1"
        alone = post(url, "/completions", benign)[1]["choices"][0]["text"]
        engine.model = Poisoned(hf.model, hf.tokenizer.convert_tokens_to_ids("z"))
        results = concurrently_with_status(url, [benign, {**benign, "prompt": "az"}])
    assert None not in results
    (benign_status, benign_answer), (poisoned_status, poisoned_answer) = results
    assert benign_status == 200 and benign_answer["choices"][0]["text"] == alone
    assert poisoned_status == 500 and "poisoned batch" in poisoned_answer["error"]["message"]


def test_an_out_of_range_temperature_is_refused_and_its_batch_mate_answered(hf):
    """The issue's case: temperature 1e-45 beside a benign request in one batch made both 500."""
    benign = {"model": MODEL, "prompt": "ab", "max_tokens": 4, "seed": 1}
    with running(make_app(hf, model_name=MODEL, batch_wait_s=1.0)) as base:
        results = concurrently_with_status(base + "/v1", [benign, {**benign, "temperature": 1e-45}])
    assert None not in results
    (status, _), (hostile_status, hostile) = results
    assert status == 200 and hostile_status == 400 and hostile["error"]["param"] == "temperature"


@pytest.mark.parametrize("temperature", [1e-45, 0.009, 2.01, -0.1])
def test_temperatures_outside_0_or_0_01_to_2_are_400(url, temperature):
    status, answer = post(url, "/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 1, "temperature": temperature})
    assert status == 400 and answer["error"]["param"] == "temperature"


@pytest.mark.parametrize("temperature", [0, 0.01, 2])
def test_temperatures_0_and_0_01_to_2_are_accepted(url, temperature):
    assert post(url, "/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 1, "temperature": temperature})[0] == 200


# ----------------------------------------------------------------------------- hostile clients: malformed and mistyped requests


def _body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "ab", "max_tokens": 1, **fields}).encode()


MALFORMED = {
    "deeply nested JSON": b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a 5,000-digit integer": _body()[:-1] + b', "seed": ' + b"7" * 5000 + b"}",
    "NaN temperature": _body()[:-1] + b', "temperature": NaN}',
    "stream: 'yes'": _body(stream="yes"),
    "logprobs: true on completions": _body(logprobs=True),
    "echo: 'no'": _body(echo="no"),
    "n: 2.0": _body(n=2.0),
    "max_tokens: '5'": _body(max_tokens="5"),
    "include_usage: 1": _body(stream=True, stream_options={"include_usage": 1}),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_or_mistyped_requests_are_400(url, case):
    status, answer, _ = post_raw(url, "/completions", MALFORMED[case])
    assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer


def test_chat_fields_are_strictly_typed(url):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert post(url, "/chat/completions", chat)[0] == 200
    for field, value in [("logprobs", "true"), ("logprobs", 1), ("top_logprobs", True), ("stream", 1)]:
        status, answer = post(url, "/chat/completions", {**chat, "logprobs": True, field: value})
        assert status == 400 and answer["error"]["param"] == field, (field, value, answer)
