"""`harness serve` (the OpenAI-compatible server over the HF backend) and the `openai` backend.

A real uvicorn server runs in a background thread on a free loopback port, serving a tiny model
built here. An ASGI probe in front of the app counts requests and in-flight requests and can
answer the next requests with injected errors (429/503) or refuse token-id prompts.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import httpx2
import openai
import pytest
import torch

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.backends.openai_backend import OpenAIBackend
from opd_harness.models.tiny import build_char_tokenizer
from opd_harness.registry import BACKENDS
from opd_harness.rollout import encode
from opd_harness.serve import make_app, render_chat
from serving import Probe, running, saved_tiny_model

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("served"), seed=0)


@pytest.fixture(scope="module")
def hf(model_dir):
    from opd_harness.models.tiny import load_model_and_tokenizer

    lm, tok = load_model_and_tokenizer(model_dir)
    return HFBackend(lm, tok, batch_size=64)


@pytest.fixture(scope="module")
def server(hf):
    probe = Probe(make_app(hf, model_name=MODEL))
    with running(probe) as base:
        yield base + "/v1", probe


@pytest.fixture
def probe(server):
    server[1].reset()
    yield server[1]
    server[1].reset()


@pytest.fixture
def url(server):
    return server[0]


def hf_token_logprobs(hf: HFBackend, prompt: list[int], tokens: list[int]) -> list[float]:
    """The HF backend's log-probs of ``tokens`` following ``prompt``."""
    ids = torch.tensor([prompt + tokens])
    return hf.score(ids, torch.ones_like(ids))["logprobs"][0, len(prompt) :].tolist()


def make_backend(url, model_dir, **options) -> OpenAIBackend:
    return OpenAIBackend.load(MODEL, base_url=url, tokenizer=str(model_dir), **options)


def post(url: str, path: str, body, *, method: str = "POST", raw: bytes | None = None, headers: dict | None = None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url + path, data=data, method=method, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ----------------------------------------------------------------------------- round trips


def test_registered_and_scores_what_a_server_returns(url, model_dir):
    assert BACKENDS.get("openai") is OpenAIBackend
    assert OpenAIBackend.score_fields == ("logprobs", "topk")  # scoring itself: tests/test_openai_score.py


def test_load_needs_a_server_address(monkeypatch, model_dir):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ValueError, match="OPENAI_BASE_URL"):
        OpenAIBackend.load(MODEL, tokenizer=str(model_dir))
    with pytest.raises(ValueError, match="mode"):
        OpenAIBackend.load(MODEL, base_url="http://127.0.0.1:9/v1", tokenizer=str(model_dir), mode="edits")


def test_completions_round_trip_matches_hf(url, model_dir, hf, probe):
    backend = make_backend(url, model_dir, concurrency="4")  # options arrive as strings from a command line
    tok = backend.tokenizer
    prompts = [encode(tok, "abc"), encode(tok, "hello world"), encode(tok, "abc")]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=7)
    out = backend.generate(prompts, params)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(3) for s in range(3)]
    for c in out:
        assert 1 <= len(c.token_ids) <= 8
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason == ("stop" if c.token_ids[-1] == tok.eos_token_id else "length")
    assert all(isinstance(b["prompt"], list) for b in probe.bodies)  # token ids went over the wire
    # reproducible with a seed, different with another one
    again = backend.generate(prompts, params)
    assert [c.token_ids for c in again] == [c.token_ids for c in out]
    other = backend.generate(prompts, params.model_copy(update={"seed": 8}))
    assert [c.token_ids for c in other] != [c.token_ids for c in out]
    # identical prompts get their own seeds (rollout sends k samples of a problem as k prompts)
    assert [c.token_ids for c in out[0:3]] != [c.token_ids for c in out[6:9]]
    # the server is the HF model: its log-probs are the HF backend's scores of the sampled tokens,
    # and greedy decoding gives the HF backend's tokens
    for c in out[3:6]:
        assert c.logprobs == pytest.approx(hf_token_logprobs(hf, prompts[1], c.token_ids), abs=1e-5)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    assert [c.token_ids for c in backend.generate(prompts, greedy)] == [c.token_ids for c in hf.generate(prompts, greedy)]


def test_stop_strings(url, model_dir):
    backend = make_backend(url, model_dir)
    tok = backend.tokenizer
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    for text in ("abc", "The answer is", "x = 1 + 2", "hello"):
        prompt = encode(tok, text)
        free = backend.generate([prompt], greedy)[0]
        if len(free.text) >= 3 and free.finish_reason == "length":
            break
    else:
        pytest.fail("the seeded tiny model gave no greedy output long enough to place a stop string")
    stop = free.text[2]
    cut = free.text.index(stop)
    stopped = backend.generate([prompt], greedy.model_copy(update={"stop": (stop,)}))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: cut + 1]  # the stop string is kept, as with the HF backend
    assert stopped.token_ids == free.token_ids[: cut + 1]
    assert len(stopped.logprobs) == len(stopped.token_ids)
    # without the vLLM extensions the server follows OpenAI: the text ends before the stop string
    plain = make_backend(url, model_dir, server_extensions="false")
    stripped = plain.generate([prompt], greedy.model_copy(update={"stop": (stop,)}))[0]
    assert stripped.text == free.text[:cut]
    assert stripped.finish_reason == "stop"
    assert len(stripped.logprobs) == len(stripped.token_ids) == cut


def test_evaluation_without_logprobs(url, model_dir, probe, tmp_path):
    """``logprobs=false``: the server is asked for none and nothing in an evaluation reads them, so episodes hold no
    behaviour log-probs (unknown, not zeros claimed as values) and ``harness eval`` runs (it crashed every rollout)."""
    from typer.testing import CliRunner

    from opd_harness.cli import app
    from opd_harness.registry import TASKS
    from opd_harness.rollout import rollout
    from opd_harness.trajectory import to_tensor_batch

    task = TASKS.get("arith")()
    trajs = rollout(make_backend(url, model_dir, logprobs="false"), task, task.load()[:2], SamplingParams(max_new_tokens=6, n=2, seed=0))
    segments = [s for t in trajs for s in t.model_segments]
    assert len(segments) == 4 and all(s.token_ids and s.behaviour_logprobs is None for s in segments)
    assert probe.bodies and not any("logprobs" in body for body in probe.bodies)
    assert to_tensor_batch(trajs, 0).behaviour_logprobs.abs().sum() == 0
    options = [f"base_url={url}", f"tokenizer={model_dir}", "logprobs=false"]
    args = [
        "eval", "--backend", "openai", "--model", MODEL, "--task", "arith", "--k", "2", "--limit", "3", "--json", "--out", str(tmp_path)
    ]
    result = CliRunner().invoke(app, [*args, *(x for option in options for x in ("--backend-option", option))])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["tasks"]["arith"]
    assert summary["n_samples"] == 6 and summary["n_errors"] == 0


def test_chat_round_trip(url, model_dir, hf):
    backend = make_backend(url, model_dir, mode="chat")
    tok = backend.tokenizer
    prompt = encode(tok, "What is 2+2?")
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3)
    out = backend.generate([prompt], params)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(0, 0), (0, 1)]
    for c in out:
        assert 1 <= len(c.token_ids) <= 6 and len(c.logprobs) == len(c.token_ids)
    assert backend.generate([prompt], params)[0].token_ids == out[0].token_ids
    # the server rendered the message with the plain join (the char tokenizer has no chat template)
    rendered = render_chat(tok, [{"role": "user", "content": "What is 2+2?"}])
    assert rendered == "user: What is 2+2?\nassistant:"
    for c in out:
        assert c.logprobs == pytest.approx(hf_token_logprobs(hf, encode(tok, rendered), c.token_ids), abs=1e-5)


def test_render_chat_uses_the_template_when_there_is_one():
    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert render_chat(tok, [{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"


def test_raw_http_api(url):
    status, body = post(url, "/models", None, method="GET")
    assert status == 200 and body["data"][0]["id"] == MODEL and body["data"][0]["max_model_len"] == 128
    status, body = post(url, "/completions", {"model": MODEL, "prompt": ["ab", "cd"], "n": 2, "max_tokens": 5, "logprobs": 1, "seed": 1})
    assert status == 200 and body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for choice in body["choices"]:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
        assert "".join(t for t in lp["tokens"] if t != "<eos>") == choice["text"]
        assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] == 4
    assert usage["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in body["choices"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    status, body = post(
        url,
        "/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["prompt_tokens"] == len("user: hi\nassistant:")
    assert all(len(e["top_logprobs"]) == 2 for e in body["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/completions", {"model": MODEL, "prompt": "ab", "n": 0}, 400, "n"),
        ("/completions", {"model": MODEL, "prompt": "ab", "temperature": -1}, 400, "temperature"),
        ("/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
        ("/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
        ("/completions", {"model": MODEL, "prompt": [1, 2, 100000]}, 400, "prompt"),
        ("/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 1000}, 400, "max_tokens"),
        ("/completions", {"model": MODEL, "prompt": "ab", "stop": [""]}, 400, "stop"),
        ("/completions", {"model": MODEL, "prompt": "ab", "logprobs": 21}, 400, "logprobs"),
        ("/completions", {"prompt": "ab"}, 400, "model"),
        ("/completions", {"model": "other", "prompt": "ab"}, 404, "model"),
        ("/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ],
)
def test_errors_are_openai_json(url, path, body, status, param):
    got, answer = post(url, path, body)
    assert got == status
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["message"] and answer["error"]["param"] == param


def test_malformed_requests(url):
    status, answer = post(url, "/completions", None, raw=b"{not json")
    assert status == 400 and "JSON" in answer["error"]["message"]
    status, answer = post(url, "/completions", None, raw=b"[1, 2]")
    assert status == 400
    status, answer = post(url, "/completions", None, method="GET")
    assert status == 405 and "error" in answer
    status, answer = post(url, "/nowhere", {})
    assert status == 404 and "error" in answer


def test_client_sees_bad_request(url, model_dir):
    backend = make_backend(url, model_dir)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        backend.generate([encode(backend.tokenizer, "ab")], SamplingParams(max_new_tokens=500))
    assert backend.prompt_format == "auto"  # the same error as text: no switch to text prompts


def test_api_key(hf, model_dir):
    with running(make_app(hf, model_name=MODEL, api_key="sekrit")) as base:
        url = base + "/v1"
        status, answer = post(url, "/completions", {"model": MODEL, "prompt": "ab"})
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        backend = make_backend(url, model_dir, api_key="sekrit")
        assert len(backend.generate([encode(backend.tokenizer, "ab")], SamplingParams(max_new_tokens=2))) == 1


# ----------------------------------------------------------------------------- retries, fallbacks, concurrency


def test_retries_on_429_and_503(url, model_dir, probe):
    backend = make_backend(url, model_dir, max_retries=2)
    probe.fail_next = [429, 503]
    out = backend.generate([encode(backend.tokenizer, "ab")], SamplingParams(max_new_tokens=3))
    assert probe.posts == 3 and len(out) == 1
    probe.reset()
    backend = make_backend(url, model_dir, max_retries=1)
    probe.fail_next = [503, 503, 503]
    with pytest.raises(openai.InternalServerError):
        backend.generate([encode(backend.tokenizer, "ab")], SamplingParams(max_new_tokens=3))
    assert probe.posts == 2


class FlakyTransport(httpx2.BaseTransport):
    """Fails the first ``failures`` requests with a connection error, then forwards them."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.attempts = 0
        self.inner = httpx2.HTTPTransport()

    def handle_request(self, request):
        self.attempts += 1
        if self.attempts <= self.failures:
            raise httpx2.ConnectError("connection refused (injected)", request=request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_connection_errors_retried_with_backoff(url, model_dir):
    tok = build_char_tokenizer()
    transport = FlakyTransport(failures=3)
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=1, http_client=httpx2.Client(transport=transport))
    backend = OpenAIBackend(client, MODEL, tok, connect_retries=2, retry_backoff_s=0.01)
    sleeps: list[float] = []
    backend.sleep = sleeps.append
    out = backend.generate([encode(tok, "ab")], SamplingParams(max_new_tokens=2))
    # client try + client retry fail, our retry: client try fails, client retry succeeds
    assert len(out) == 1 and transport.attempts == 4 and len(sleeps) == 1
    # nothing listening: bounded, exponential, then the connection error is raised
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    backend = OpenAIBackend(openai.OpenAI(base_url=dead, api_key="x", max_retries=0), MODEL, tok, connect_retries=2, retry_backoff_s=0.1)
    sleeps.clear()
    backend.sleep = sleeps.append
    with pytest.raises(openai.APIConnectionError):
        backend.generate([encode(tok, "ab")], SamplingParams(max_new_tokens=2))
    assert len(sleeps) == 2
    assert 0.075 <= sleeps[0] <= 0.1 and 0.15 <= sleeps[1] <= 0.2


def test_timeouts_retried(url, model_dir, probe):
    probe.delay_s = 1.0
    backend = make_backend(url, model_dir, timeout_s=0.2, max_retries=0, connect_retries=1, retry_backoff_s=0.01)
    backend.sleep = lambda s: None
    with pytest.raises(openai.APITimeoutError):
        backend.generate([encode(backend.tokenizer, "ab")], SamplingParams(max_new_tokens=2))
    assert probe.posts == 2


def test_token_prompt_fallback_to_text(url, model_dir, probe):
    probe.refuse_token_prompts = True
    backend = make_backend(url, model_dir)
    out = backend.generate([encode(backend.tokenizer, "ab"), encode(backend.tokenizer, "cd")], SamplingParams(max_new_tokens=2, seed=0))
    assert len(out) == 2 and backend.prompt_format == "text"
    assert probe.bodies[-1]["prompt"] in ("ab", "cd")
    strict = make_backend(url, model_dir, prompt_format="tokens")
    with pytest.raises(openai.BadRequestError):
        strict.generate([encode(strict.tokenizer, "ab")], SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize("limit", [2, 4])
def test_concurrency_limit(url, model_dir, probe, limit):
    # Each request is held 1 s, so the client has that long to send the next ones: with 0.2 s, a run beside other
    # CPU-bound tests saw 1 request in flight, not 2 (2026-12-07), though the limit was used.
    probe.delay_s = 1.0
    backend = make_backend(url, model_dir, concurrency=limit)
    prompts = [encode(backend.tokenizer, f"p{i}") for i in range(2 * limit + 1)]
    out = backend.generate(prompts, SamplingParams(max_new_tokens=2, n=2, seed=0))
    assert len(out) == 2 * len(prompts)
    assert probe.posts == len(prompts)
    assert probe.max_inflight == limit  # never more than the limit, and the limit is actually used
