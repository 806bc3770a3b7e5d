"""A small OpenAI-compatible HTTP server over an HF causal LM (``harness serve``).

Endpoints:

* ``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a list
  of token-id lists; ``n``, ``max_tokens`` (default 16; 0 with ``echo`` scores the prompt only),
  ``temperature``, ``top_p``, ``top_k`` (vLLM's extension; 0 or -1: off), ``seed``, ``stop``, ``echo``,
  ``logprobs`` (an integer N: per token
  ``tokens``, ``token_logprobs``, ``top_logprobs`` — the N most likely tokens plus the chosen one —
  and ``text_offset``), ``stream``, ``stream_options.include_usage``. Choices are prompt-major:
  choice ``p * n + s`` is sample ``s`` of prompt ``p``.
* ``POST /v1/chat/completions``: ``messages`` are rendered with the tokenizer's chat template
  when it has one (``add_generation_prompt=True``); otherwise with a plain join, documented in
  ``render_chat``: one ``"{role}: {content}"`` line per message, then a final ``"assistant:"``.
  ``n``, ``max_tokens`` / ``max_completion_tokens`` (default: the rest of the context window),
  ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``logprobs`` / ``top_logprobs`` (N entries per
  token, most likely first), ``stream``, ``stream_options.include_usage``.
* ``GET /v1/models`` (the one served model), ``GET /health`` and ``GET /metrics`` (Prometheus text:
  batches, sequences, largest batch, forward passes, requests).

Every response carries ``usage`` (prompt tokens counted once per prompt; completion tokens summed
over all choices, a final EOS token included, echoed prompts not) and ``finish_reason`` ``"stop"``
(EOS or a stop string) or ``"length"``. Errors are OpenAI-shaped JSON, ``{"error": {"message",
"type", "param", "code"}}``: 400 for bad input (malformed JSON, a field of the wrong type — fields are
strict, as vLLM's: no ``"yes"`` for true, no ``true`` for 1 — or out of range, a prompt longer than the
context window, a request over its limits, more log-probs than ``max_logprobs``, an unsupported feature),
401 for a missing/wrong API key when the server has one, 404 for an unknown model or route, 405 for a
wrong method, 413 for a body over ``Limits.max_body_bytes``, 503 (with ``Retry-After``) when the queue
is full, 500 when generation itself fails (in a stream: a final ``data: {"error": ...}`` event).
Unknown request fields are ignored, as OpenAI-compatible servers usually do.

Hostile clients (``Limits``): a request is refused before any decoding when it has too many sequences
(prompts × n), too many tokens (per sequence against the context window, and in total), a body too large
(refused before it is read) or when too many sequences are queued; a client that disconnects, streamed
or not, stops its sequences; a sequence whose sampling fails fails alone, and a batch whose forward pass
fails is decoded again one sequence at a time, so one request cannot fail another.

Semantics worth knowing:

* **Continuous batching across requests.** Every request is split into sequences (prompt × sample) that go
  to one engine (``opd_harness.serve.engine``): a worker thread decodes up to ``max_batch`` sequences together
  (and at most ``max_batch_tokens`` padded positions: batch size × (longest prompt + max_tokens), which
  bounds the prompt-logits memory of ``echo``), from however many requests, one forward pass per token.
  Sequences that arrive while others decode are prefilled and join the running batch at its next step;
  a finished sequence leaves it at once, so a short request does not wait for long ones.
* **Seeds.** Each sequence samples with its own generator: sample ``s`` of a request with ``seed``
  uses seed ``seed + s`` (as vLLM does), whatever else is in the batch, so the same request with the
  same seed gives the same choices, alone or batched, streamed or not. A sequence draws as
  transformers does, so sample 0 of a request seeded ``s`` is what ``HFBackend.generate`` samples
  for that prompt with seed ``s``. Without a seed each sequence draws a fresh one.
* **Streaming** is incremental: each decode step sends what it adds (server-sent events, ``data:
  {...}`` chunks, ``data: [DONE]`` last). Text that could still turn out to be the start of a stop
  string is held back until it cannot, so the concatenated deltas equal the non-streamed text.
  With ``echo`` the prompt is the first chunk. ``stream_options.include_usage`` adds a last chunk
  with ``usage`` and no choices (other chunks carry ``"usage": null``).
* **Log-probs** are those of the model's untempered distribution (as the HF backend computes
  them). With ``echo`` the prompt's tokens come first; the first prompt token has no prefix, so its
  ``token_logprobs`` and ``top_logprobs`` entries are ``null``. A completions ``top_logprobs``
  entry maps token text to log-prob: the N most likely tokens, most likely first, then the chosen
  token when it is not among them (tokens that decode to the same text share one key; use
  ``return_tokens_as_token_ids`` for exact ids). ``text_offset`` counts characters from the start of
  the returned text. A final EOS token is listed (its logprob is part of the sample) but adds no text.
* **Stop strings** follow OpenAI: the returned text ends *before* the stop string. With the vLLM
  extension ``include_stop_str_in_output: true`` it is kept (as the harness's HF backend does).
  A stop string that ends inside a multi-character token keeps that token in the log-probs.
* **vLLM extensions** accepted: ``include_stop_str_in_output``, ``return_tokens_as_token_ids``
  (log-prob tokens written ``"token_id:<id>"``, so a client recovers exact token ids), ``ignore_eos``
  (EOS is sampled like any token and does not end the sequence) and ``min_tokens`` (at most ``max_tokens``:
  EOS is masked, and stop strings do not end the text, before that many tokens; log-probs stay the model's).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from opd_harness.backends import MAX_TEMPERATURE, MIN_TEMPERATURE
from opd_harness.serve.engine import Delta, Engine, Overloaded, TopList
from opd_harness.serve.engine import Sequence as Seq

log = logging.getLogger("opd_harness.serve")

MAX_N = 128
MAX_STOP = 16
MAX_LOGPROBS = 20  # default of --max-logprobs, as vLLM's
MAX_BATCH_TOKENS = 32768  # default of --max-batch-tokens
MIN_LOGPROB = -9999.0  # what OpenAI and vLLM write for -inf
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still connected
RETRY_AFTER_S = 1  # what a 503 (server busy) tells clients to wait


@dataclass(frozen=True)
class Limits:
    """What one request, and all requests together, may ask of the server (the ``harness serve`` flags of the same names)."""

    max_model_len: int | None = None  # context window: prompt + max_tokens per sequence (None: the model's max_position_embeddings)
    max_request_sequences: int = 1024  # prompts x n per request
    max_request_tokens: int = 1 << 20  # sum over a request's sequences of prompt tokens + max_tokens
    max_queued_sequences: int = 4096  # sequences waiting or decoding, all requests together (more: 503)
    max_body_bytes: int = 16 << 20  # request body (more: 413, refused before it is read)

    def check(self) -> None:
        """Raise ``ValueError`` naming the flag of a value out of range."""
        for name in ("max_model_len", "max_request_sequences", "max_request_tokens", "max_queued_sequences", "max_body_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.max_queued_sequences < self.max_request_sequences:
            raise ValueError(
                f"--max-queued-sequences must be at least --max-request-sequences ({self.max_request_sequences}), "
                f"got {self.max_queued_sequences}"
            )


DEFAULT_LIMITS = Limits()


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type_, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientDisconnected(Exception):
    """The client of a request went away before its answer was ready."""


# ----------------------------------------------------------------------------- request models


STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # no "yes" for true, no true for 1, no NaN: 400, as vLLM


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints; ``None`` means "the default" (clients send explicit nulls)."""

    model_config = STRICT
    model: str
    n: int | None = Field(None, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM extension: the k most likely tokens only (0 or -1: off)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)  # normalised to a list
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool = False  # vLLM extension
    return_tokens_as_token_ids: bool = False  # vLLM extension
    ignore_eos: bool = False  # vLLM extension: EOS does not end a sequence
    min_tokens: int = Field(0, ge=0)  # vLLM extension: no EOS and no stop string before this many tokens

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def unsupported(self) -> None:
        """Refuse features this server does not implement rather than silently ignoring them."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options can only be set when stream=true", param="stream_options")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported by this server (only 0)", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")

    def top_n(self) -> int | None:
        """Alternatives asked per position (``None``: no log-probs)."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: Any
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> list[str | list[int]]:
        """Normalise to a list whose items are strings or token-id lists."""

        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(value, str):
            items: list = [value]
        elif is_ids(value):
            items = [value]
        elif isinstance(value, list) and value and all(isinstance(x, str) or is_ids(x) for x in value):
            items = list(value)
        else:
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists (non-empty)")
        if any(isinstance(x, str) and x == "" for x in items):
            raise ValueError("empty prompt: this server needs at least one prompt token to continue from")
        return items

    def unsupported(self) -> None:
        super().unsupported()
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(400, "best_of other than n is not supported by this server", param="best_of")

    def top_n(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: str | list[dict[str, Any]] | None) -> str:
        if value is None or isinstance(value, str):
            return value or ""
        parts = []
        for part in value:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)

    def unsupported(self) -> None:
        super().unsupported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    def top_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def render_chat(tokenizer, messages: Sequence[dict[str, str]]) -> str:
    """The prompt text for ``messages``.

    With a chat template: ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``.
    Without one (e.g. the harness's character tokenizer): each message on its own line as
    ``"{role}: {content}"``, followed by a line ``"assistant:"`` for the model to continue, e.g.
    ``"system: Be brief.\\nuser: 2+2?\\nassistant:"``.
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


# ----------------------------------------------------------------------------- the app


def _clamp(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, MIN_LOGPROB)


class _Served:
    """The engine plus everything derived from the model; validation and response formatting."""

    def __init__(self, engine: Engine, model_name: str, api_key: str | None, max_logprobs: int, limits: Limits) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.max_logprobs = max_logprobs
        self.limits = limits
        self.created = int(time.time())
        self.requests = 0
        config = getattr(engine.model, "config", None)
        self.max_len: int = context_window(getattr(config, "max_position_embeddings", None), limits.max_model_len)
        self.vocab_size: int = getattr(config, "vocab_size", None) or len(self.tokenizer)
        self.special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        self.token_chars = longest_token(self.tokenizer)

    def check_size(self, n_prompts: int, n: int) -> None:
        """Refuse a request of more than ``max_request_sequences`` sequences before any work is done for it."""
        if n_prompts * n > self.limits.max_request_sequences:
            raise APIError(
                400,
                f"this request asks for {n_prompts * n} sequences ({n_prompts} prompts x n={n}); this server decodes at most "
                f"{self.limits.max_request_sequences} per request",
                param="n" if n > 1 else "prompt",
            )

    def check_text(self, texts: list[str], n: int) -> None:
        """Refuse text that cannot fit, before tokenising it: one token covers at most ``token_chars`` characters
        (after the tokenizer's normaliser), so longer text has more tokens than the context window or the request budget."""
        sizes = [normalized_length(self.tokenizer, t) for t in texts]
        for p, size in enumerate(sizes):
            if size > self.max_len * self.token_chars:
                raise APIError(
                    400,
                    f"prompt {p} has {size} characters, more than fit in this model's maximum context length of {self.max_len} tokens",
                    param="prompt",
                    code="context_length_exceeded",
                )
        if n * sum(sizes) > self.limits.max_request_tokens * self.token_chars:
            raise APIError(
                400,
                f"this request's prompts ({sum(sizes)} characters, x n={n}) exceed {self.limits.max_request_tokens} tokens per request",
                param="prompt",
            )

    def check_logprobs(self, req: _Common) -> None:
        n = req.top_n()
        if n is not None and self.max_logprobs >= 0 and n > self.max_logprobs:
            param = "logprobs" if isinstance(req, CompletionRequest) else "top_logprobs"
            raise APIError(400, f"Requested sample logprobs of {n}, which is greater than max allowed: {self.max_logprobs}", param=param)

    def check_prompts(self, prompts: list[list[int]], max_tokens: int | None, n: int) -> int:
        """Validate token ids, each sequence's length against the context window and the request's total tokens
        (``n`` samples per prompt); return the max_tokens to use."""
        for p, ids in enumerate(prompts):
            if not ids:
                raise APIError(400, f"prompt {p} is empty after tokenisation", param="prompt")
        longest = max(len(ids) for ids in prompts)
        if max_tokens is None:
            max_tokens = max(1, self.max_len - longest)
        if longest + max_tokens > self.max_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_len} tokens. However, you requested "
                f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        total = n * sum(len(ids) + max_tokens for ids in prompts)
        if total > self.limits.max_request_tokens:
            raise APIError(
                400,
                f"this request asks for {total} tokens (prompt + max_tokens, summed over its {n * len(prompts)} sequences); "
                f"this server accepts at most {self.limits.max_request_tokens} per request",
                param="max_tokens",
            )
        for p, ids in enumerate(prompts):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"prompt {p}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        return max_tokens

    def sequences(self, prompts: list[list[int]], req: _Common, max_tokens: int, *, echo: bool = False) -> list[Seq]:
        """One engine sequence per prompt × sample, prompt-major; sample ``s`` is seeded ``seed + s``."""
        n = req.n or 1
        if req.min_tokens > max_tokens:
            message = f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {req.min_tokens}"
            raise APIError(400, message, param="min_tokens")
        return [
            Seq(
                prompt=list(prompt),
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=max(req.top_k or 0, 0),
                seed=None if req.seed is None else req.seed + s,
                stop=tuple(req.stop),
                include_stop=req.include_stop_str_in_output,
                min_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos,
                top_n=req.top_n() or 0,
                prompt_logprobs=echo and req.top_n() is not None,
                stream=bool(req.stream),
            )
            for prompt in prompts
            for s in range(n)
        ]

    # -- formatting

    def names(self, tokens: list[int], as_ids: bool) -> dict[int, str]:
        """How each of ``tokens`` is written in a response: its text, or ``token_id:<id>``."""
        unique = list(dict.fromkeys(tokens))
        return dict(zip(unique, [f"token_id:{t}" for t in unique] if as_ids else self.engine.pieces(unique), strict=True))

    def completion_logprobs(
        self, tokens: list[int], logprobs: list[float | None], tops: list[TopList | None], as_ids: bool, offset: int = 0
    ) -> dict:
        """The completions ``logprobs`` object for ``tokens``; ``offset`` is where their text starts."""
        pieces = self.engine.pieces(tokens)
        names = self.names(tokens + [t for top in tops for t, _ in top or []], as_ids)
        offsets, top_dicts = [], []
        for token, piece, lp, top in zip(tokens, pieces, logprobs, tops, strict=True):
            offsets.append(offset)
            offset += 0 if token in self.special else len(piece)
            if lp is None:
                top_dicts.append(None)
                continue
            entry = {names[t]: _clamp(v) for t, v in top or []}
            entry.setdefault(names[token], _clamp(lp))
            top_dicts.append(entry)
        token_logprobs = [_clamp(lp) for lp in logprobs]
        return {"tokens": [names[t] for t in tokens], "token_logprobs": token_logprobs, "top_logprobs": top_dicts, "text_offset": offsets}

    def chat_logprobs(self, tokens: list[int], logprobs: list[float], tops: list[TopList], as_ids: bool) -> dict:
        """The chat ``logprobs`` object: per token its name, log-prob, UTF-8 bytes and the top N alternatives."""
        every = tokens + [t for top in tops for t, _ in top]
        names, texts = self.names(every, as_ids), self.names(every, False)

        def entry(token: int, lp: float) -> dict:
            return {"token": names[token], "logprob": _clamp(lp), "bytes": list(texts[token].encode("utf-8"))}

        triples = zip(tokens, logprobs, tops, strict=True)
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]} for t, lp, top in triples]}

    def text_length(self, tokens: list[int]) -> int:
        """Characters ``tokens`` add to the returned text (special tokens add none)."""
        return sum(0 if t in self.special else len(p) for t, p in zip(tokens, self.engine.pieces(tokens), strict=True))


def context_window(model_len: int | None, max_model_len: int | None) -> int:
    """The context window served: ``max_model_len`` when given (at most the model's), else the model's."""
    if max_model_len is not None and model_len is not None and max_model_len > model_len:
        raise ValueError(f"--max-model-len {max_model_len} is longer than the model's context window ({model_len} positions)")
    if max_model_len is None and model_len is None:
        raise ValueError("the model's config has no max_position_embeddings: pass --max-model-len")
    return max_model_len or model_len


def longest_token(tokenizer) -> int:
    """The most characters one token's text can cover (its piece's length: byte-level pieces spell one character per byte)."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max([len(p) for p in pieces if p] + [1])


def normalized_length(tokenizer, text: str) -> int:
    """The length of ``text`` after the tokenizer's normaliser (which may compose characters, e.g. NFC)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizer = getattr(backend, "normalizer", None)
    return len(normalizer.normalize_str(text)) if normalizer is not None else len(text)


def _usage(prompts: list[list[int]], seqs: list[Seq]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(s.tokens) for s in seqs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) once it is known to be over ``limit`` bytes: by its ``Content-Length``
    before any of it is read, else as soon as what arrived passes the limit."""

    def too_large(size: str) -> APIError:
        return APIError(413, f"the request body ({size}) is larger than this server accepts ({limit} bytes)", code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(f"{declared} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _validate(raw: bytes, model: type[_Common]) -> _Common:
    """Parse and validate a request body; anything malformed (bad JSON, nesting too deep, an integer of more
    digits than Python converts, a value of the wrong type or out of range) is a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError and the int digit limit are ValueErrors
        raise APIError(400, f"request body is not valid JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None


def _validation_error(exc: ValidationError) -> APIError:
    parts, first = [], None
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"])
        first = first or loc
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return APIError(400, "; ".join(parts), param=first)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, allow_nan=False)}\n\n"


class _Job:
    """A request's sequences in the engine, seen from the event loop: events arrive on a queue. While it waits
    for them it checks, every ``DISCONNECT_POLL_S``, that the client is still there (``client_gone``); a client
    gone, streamed or not, stops the job's sequences."""

    def __init__(self, engine: Engine, seqs: list[Seq], client_gone: Callable[[], Awaitable[bool]], max_load: int) -> None:
        self.engine = engine
        self.seqs = seqs
        self.client_gone = client_gone
        self.events: asyncio.Queue[tuple[int, str, Delta | None]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for index, seq in enumerate(seqs):
            seq.on_event = lambda s, kind, delta, index=index: loop.call_soon_threadsafe(self.events.put_nowait, (index, kind, delta))
        try:
            engine.submit(seqs, max_load=max_load)
        except Overloaded as exc:
            raise APIError(
                503,
                f"the server is busy ({exc}); retry later",
                type_="server_error",
                code="server_busy",
                headers={"retry-after": str(RETRY_AFTER_S)},
            ) from None

    async def next_event(self) -> tuple[int, str, Delta | None]:
        """The next event; raises ``ClientDisconnected`` if the client goes away first."""
        while True:
            try:
                return await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await self.client_gone():
                    raise ClientDisconnected from None

    async def stream(self) -> AsyncIterator[tuple[int, str, Delta | None]]:
        """Events until every sequence is done; an engine failure raises."""
        remaining = len(self.seqs)
        while remaining:
            index, kind, delta = await self.next_event()
            if kind == "error":
                raise RuntimeError(f"generation failed: {type(self.seqs[index].error).__name__}: {self.seqs[index].error}")
            if kind == "done":
                remaining -= 1
            yield index, kind, delta

    async def wait(self) -> None:
        """Until every sequence is done; a request abandoned meanwhile (or a failure) stops its sequences."""
        try:
            async for _ in self.stream():
                pass
        finally:
            self.cancel()

    def cancel(self) -> None:
        self.engine.cancel(self.seqs)


def make_app(
    backend,
    model_name: str = "model",
    api_key: str | None = None,
    *,
    max_batch: int = 64,
    max_batch_tokens: int | None = MAX_BATCH_TOKENS,
    max_logprobs: int = MAX_LOGPROBS,
    batch_wait_s: float = 0.002,
    limits: Limits = DEFAULT_LIMITS,
) -> Starlette:
    """The ASGI app serving ``backend`` (anything with an HF causal LM as ``model``, its ``tokenizer`` and
    ``device``, e.g. ``HFBackend``) under ``model_name``; with ``api_key``, requests must send
    ``Authorization: Bearer <api_key>``. Up to ``max_batch`` sequences (and ``max_batch_tokens`` padded
    positions) are decoded together; ``max_logprobs`` caps ``logprobs`` / ``top_logprobs`` (-1: no cap);
    ``limits`` bounds what requests may ask."""
    limits.check()
    device = str(getattr(backend, "device", "cpu"))
    engine = Engine(
        backend.model, backend.tokenizer, device=device, max_batch=max_batch, max_batch_tokens=max_batch_tokens, batch_wait_s=batch_wait_s
    )
    served = _Served(engine, model_name, api_key, max_logprobs, limits)

    def check_auth(request: Request) -> None:
        if served.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {served.api_key}":
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)", code="invalid_api_key")

    async def parse(request: Request, model: type[_Common]) -> _Common:
        check_auth(request)
        raw = await read_body(request, served.limits.max_body_bytes)
        req = await run_in_threadpool(_validate, raw, model)  # a large body does not stall the event loop
        if req.model != served.model_name:
            message = f"The model {req.model!r} does not exist; this server serves {served.model_name!r}"
            raise APIError(404, message, param="model", code="model_not_found")
        req.unsupported()
        served.check_logprobs(req)
        served.requests += 1
        return req

    async def guarded(handler, request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as exc:
            return exc.response()
        except ClientDisconnected:
            log.info("%s %s: the client went away; its sequences were stopped", request.method, request.url.path)
            return Response(status_code=499)  # nobody reads it
        except Exception as exc:  # generation failed: answer JSON, keep serving
            log.exception("request failed")
            return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error").response()

    def streamed(events: AsyncIterator[str], job: _Job) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for chunk in events:
                    yield chunk
            except ClientDisconnected:
                log.info("a streamed request's client went away; its sequences were stopped")
                return
            except Exception as exc:  # noqa: BLE001 - the status is sent already: report in the stream
                log.exception("streamed request failed")
                yield _sse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error").body())
            finally:
                job.cancel()  # a client that went away stops its sequences
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        echo, top_n, as_ids, n = bool(req.echo), req.logprobs, req.return_tokens_as_token_ids, req.n or 1
        served.check_size(len(req.prompt), n)

        def prepare():
            with served.engine.tokenizer_lock:
                served.check_text([p for p in req.prompt if isinstance(p, str)], n)
            prompts = [served.engine.encode(p) if isinstance(p, str) else p for p in req.prompt]
            max_tokens = served.check_prompts(prompts, 16 if req.max_tokens is None else req.max_tokens, n)
            texts = [p if isinstance(p, str) else served.engine.decode(p) for p in req.prompt] if echo else None
            return prompts, texts, max_tokens

        prompts, prompt_texts, max_tokens = await run_in_threadpool(prepare)
        seqs = served.sequences(prompts, req, max_tokens, echo=echo)
        job = _Job(served.engine, seqs, request.is_disconnected, served.limits.max_queued_sequences)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": served.model_name}

        if not req.stream:
            await job.wait()
            choices = []
            for index, seq in enumerate(seqs):
                text, tokens, lps, tops = seq.text, seq.tokens, list(seq.logprobs), list(seq.tops)
                if echo:
                    text = prompt_texts[index // n] + text
                    tokens, lps, tops = seq.prompt + tokens, seq.prompt_lps + lps, seq.prompt_tops + tops
                logprobs = None if top_n is None else served.completion_logprobs(tokens, lps, tops, as_ids)
                choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": seq.finish_reason})
            return JSONResponse({**head, "choices": choices, "usage": _usage(prompts, seqs)})

        async def events() -> AsyncIterator[str]:
            offsets = [0] * len(seqs)

            def chunk(index: int, text: str, tokens: list[int], lps: list, tops: list, finish: str | None) -> str:
                logprobs = None
                if top_n is not None:
                    logprobs = served.completion_logprobs(tokens, lps, tops, as_ids, offsets[index])
                offsets[index] += served.text_length(tokens) if top_n is not None else 0
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
                return _sse({**head, "choices": [choice], "usage": None})

            echoed = [not echo] * len(seqs)  # with echo, a sequence's first chunk is its prompt (scored at prefill)
            async for index, kind, delta in job.stream():
                seq = seqs[index]
                if not echoed[index]:
                    echoed[index] = True
                    unscored = [None] * len(seq.prompt)
                    yield chunk(index, prompt_texts[index // n], seq.prompt, seq.prompt_lps or unscored, seq.prompt_tops or unscored, None)
                if delta is not None and (delta.text or delta.tokens or kind == "done"):
                    yield chunk(index, delta.text, delta.tokens, delta.logprobs, delta.tops, seq.finish_reason if kind == "done" else None)
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(prompts, seqs)})

        return streamed(events(), job)

    async def chat(request: Request) -> Response:
        req = await parse(request, ChatRequest)
        top_n, as_ids, n = req.top_n(), req.return_tokens_as_token_ids, req.n or 1
        served.check_size(1, n)

        def prepare():
            messages = [{"role": m.role, "content": m.content} for m in req.messages]
            with served.engine.tokenizer_lock:
                served.check_text(["".join(m["content"] for m in messages)], n)  # a template only adds text
                try:
                    text = render_chat(served.tokenizer, messages)
                except Exception as exc:  # a template that rejects the conversation (e.g. role order)
                    raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages") from None
            prompts = [served.engine.encode(text)]
            return prompts, served.check_prompts(prompts, req.max_completion_tokens or req.max_tokens, n)

        prompts, max_tokens = await run_in_threadpool(prepare)
        seqs = served.sequences(prompts, req, max_tokens)
        job = _Job(served.engine, seqs, request.is_disconnected, served.limits.max_queued_sequences)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": served.model_name}

        if not req.stream:
            await job.wait()
            choices = []
            for index, seq in enumerate(seqs):
                logprobs = None if top_n is None else served.chat_logprobs(seq.tokens, seq.logprobs, seq.tops, as_ids)
                message = {"role": "assistant", "content": seq.text}
                choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": seq.finish_reason})
            return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": _usage(prompts, seqs)})

        async def events() -> AsyncIterator[str]:
            def chunk(index: int, delta: dict, logprobs: dict | None, finish: str | None) -> str:
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                return _sse({**head, "object": "chat.completion.chunk", "choices": [choice], "usage": None})

            for index in range(len(seqs)):
                yield chunk(index, {"role": "assistant", "content": ""}, None, None)
            async for index, kind, delta in job.stream():
                if delta is None:
                    continue
                logprobs = None
                if top_n is not None and delta.tokens:
                    logprobs = served.chat_logprobs(delta.tokens, delta.logprobs, delta.tops, as_ids)
                if delta.text or delta.tokens or kind == "done":
                    finish = seqs[index].finish_reason if kind == "done" else None
                    yield chunk(index, {"content": delta.text} if delta.text else {}, logprobs, finish)
            if req.include_usage:
                yield _sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(prompts, seqs)})

        return streamed(events(), job)

    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        card = {
            "id": served.model_name,
            "object": "model",
            "created": served.created,
            "owned_by": "opd-harness",
            "max_model_len": served.max_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> PlainTextResponse:
        stats = served.engine.stats
        rows = [
            ("harness_serve_requests_total", "counter", "completion and chat requests accepted", served.requests),
            ("harness_serve_batches_total", "counter", "prefills (sequences admitted together into the running batch)", stats.waves),
            ("harness_serve_sequences_total", "counter", "sequences (prompt x sample) decoded", stats.sequences),
            ("harness_serve_batch_size_max", "gauge", "most sequences decoding at once", stats.max_wave),
            ("harness_serve_forward_passes_total", "counter", "model forward passes", stats.forward_passes),
        ]
        text = "".join(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name} {value}\n" for name, kind, help_, value in rows)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def route(path: str, handler, methods: list[str]) -> Route:
        async def endpoint(request: Request) -> Response:
            return await guarded(handler, request)

        return Route(path, endpoint, methods=methods)

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=kind).response()

    routes = [
        route("/v1/completions", completions, ["POST"]),
        route("/v1/chat/completions", chat, ["POST"]),
        route("/v1/models", models, ["GET"]),
        route("/health", health, ["GET"]),
        route("/metrics", metrics, ["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.served = served
    return app


def serve(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = 64,
    *,
    max_batch_tokens: int | None = MAX_BATCH_TOKENS,
    max_logprobs: int = MAX_LOGPROBS,
    device: str | None = None,
    model_name: str | None = None,
    api_key: str | None = None,
    log_level: str = "info",
    limits: Limits = DEFAULT_LIMITS,
) -> None:
    """Load ``model_path`` with the HF backend and serve it until interrupted (blocks).

    The served model name is ``model_name``, by default ``model_path`` as given (as vLLM does);
    ``device`` defaults to CUDA when available. Bad flag values raise ``ValueError`` before the model is loaded
    (``--max-model-len`` longer than the model's context: once it is).
    """
    import torch
    import uvicorn

    from opd_harness.backends.hf import HFBackend

    if max_batch < 1:
        raise ValueError(f"--max-batch must be at least 1, got {max_batch}")
    if max_batch_tokens is not None and max_batch_tokens < 1:
        raise ValueError(f"--max-batch-tokens must be at least 1, got {max_batch_tokens}")
    if max_logprobs < -1:
        raise ValueError(f"--max-logprobs must be -1 (no cap) or at least 0, got {max_logprobs}")
    limits.check()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = HFBackend.load(model_path, device=device)
    app = make_app(
        backend,
        model_name=model_name or model_path,
        api_key=api_key,
        max_batch=max_batch,
        max_batch_tokens=max_batch_tokens,
        max_logprobs=max_logprobs,
        limits=limits,
    )
    log.info("serving %s on http://%s:%d/v1 (%s, up to %d sequences per batch)", model_name or model_path, host, port, device, max_batch)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        app.state.served.engine.close()  # no decoding thread left running into interpreter shutdown
