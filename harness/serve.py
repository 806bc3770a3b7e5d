"""A small OpenAI-compatible HTTP server over the HF backend (``harness serve``).

Endpoints:

* ``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a list
  of token-id lists; ``n``, ``max_tokens`` (default 16), ``temperature``, ``top_p``, ``seed``,
  ``stop``, ``logprobs`` (an integer; the sampled tokens' log-probs in the completions format:
  ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``). Choices are prompt-major:
  choice ``p * n + s`` is sample ``s`` of prompt ``p``.
* ``POST /v1/chat/completions``: ``messages`` are rendered with the tokenizer's chat template
  when it has one (``add_generation_prompt=True``); otherwise with a plain join, documented in
  ``render_chat``: one ``"{role}: {content}"`` line per message, then a final ``"assistant:"``.
  ``n``, ``max_tokens`` / ``max_completion_tokens`` (default: the rest of the context window),
  ``temperature``, ``top_p``, ``seed``, ``stop``, ``logprobs`` / ``top_logprobs``.
* ``GET /v1/models`` (the one served model) and ``GET /health``.

Every response carries ``usage`` (prompt tokens counted once per prompt; completion tokens summed
over all choices, a final EOS token included) and ``finish_reason`` ``"stop"`` (EOS or a stop
string) or ``"length"``. Errors are OpenAI-shaped JSON, ``{"error": {"message", "type", "param",
"code"}}``: 400 for bad input (malformed JSON, a field out of range, a prompt longer than the
context window, an unsupported feature such as ``stream``), 401 for a missing/wrong API key when
the server has one, 404 for an unknown model or route, 405 for a wrong method, 500 when generation
itself fails. Unknown request fields are ignored, as OpenAI-compatible servers usually do.

Semantics worth knowing:

* **One model, one request at a time.** Requests are parsed concurrently, but every use of the
  model and tokenizer runs in a worker thread under a single ``threading.Lock``, so generations
  are serialised (a request waits its turn; the event loop stays free to answer ``/health`` and
  ``/v1/models``). Batching happens *within* a request: all its prompts × ``n`` samples go to the
  backend together, ``batch_size`` at a time. The lock is taken inside the worker thread, so a
  request whose client went away can never overlap the next generation.
* **Seeds.** With ``seed`` the whole request is reproducible (the HF backend seeds a forked torch
  RNG); the same request with the same seed gives the same choices.
* **Log-probs** are those of the model's untempered distribution (as the HF backend computes them).
  Alternatives are not computed: each ``top_logprobs`` entry holds only the sampled token, whatever
  ``logprobs`` / ``top_logprobs`` asks for. ``text_offset`` counts characters from the start of the
  returned text. A final EOS token is listed (its logprob is part of the sample) but adds no text.
* **Stop strings** follow OpenAI: the returned text ends *before* the stop string. With the vLLM
  extension ``include_stop_str_in_output: true`` it is kept (as the harness's HF backend does).
  A stop string that ends inside a multi-character token keeps that token in the log-probs.
* **vLLM extensions** accepted: ``include_stop_str_in_output`` and ``return_tokens_as_token_ids``
  (log-prob tokens written ``"token_id:<id>"``, so a client recovers exact token ids).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from harness.backends import SamplingParams

log = logging.getLogger("harness.serve")

MAX_N = 128
MAX_STOP = 16
MAX_LOGPROBS = 20
MAX_BODY_BYTES = 32 * 1024 * 1024


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON with an HTTP status."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# ----------------------------------------------------------------------------- request models


class _Common(BaseModel):
    """Fields shared by both endpoints; ``None`` means "the default" (clients send explicit nulls)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    n: int | None = Field(None, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)  # normalised to a list
    stream: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool = False  # vLLM extension
    return_tokens_as_token_ids: bool = False  # vLLM extension

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
        if self.stream:
            raise APIError(400, "stream=true is not supported by this server; send stream=false", param="stream")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported by this server (only 0)", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")


class CompletionRequest(_Common):
    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
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
        if self.echo:
            raise APIError(400, "echo=true is not supported by this server", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(400, "best_of other than n is not supported by this server", param="best_of")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
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
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


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


class _Served:
    """The backend plus everything derived from it; all model/tokenizer use goes through ``run``."""

    def __init__(self, backend, model_name: str, api_key: str | None) -> None:
        self.backend = backend
        self.tokenizer = backend.tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.created = int(time.time())
        self.lock = threading.Lock()
        config = getattr(getattr(backend, "model", None), "config", None)
        self.max_len: int | None = getattr(config, "max_position_embeddings", None)
        self.vocab_size: int = getattr(config, "vocab_size", None) or len(self.tokenizer)
        self.eos_id = getattr(self.tokenizer, "eos_token_id", None)

    # -- run under the lock, in a worker thread

    def run(self, fn, *args):
        with self.lock:
            return fn(*args)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def check_prompts(self, prompts: list[list[int]], max_tokens: int | None) -> int:
        """Validate token ids and length; return the max_tokens to use."""
        for p, ids in enumerate(prompts):
            if not ids:
                raise APIError(400, f"prompt {p} is empty after tokenisation", param="prompt")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"prompt {p}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        longest = max(len(ids) for ids in prompts)
        if max_tokens is None:
            max_tokens = max(1, self.max_len - longest) if self.max_len else 256
        if self.max_len and longest + max_tokens > self.max_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_len} tokens. However, you requested "
                f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def generate(self, prompts: list[list[int]], req: _Common, max_tokens: int | None) -> tuple[list[dict], int]:
        """Choices (prompt-major) as plain dicts with text, token ids, log-probs and finish reason."""
        max_tokens = self.check_prompts(prompts, max_tokens)
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            max_new_tokens=max_tokens,
            n=req.n or 1,
            stop=tuple(req.stop),
            seed=req.seed,
        )
        completions = self.backend.generate(prompts, params)
        choices = []
        for c in completions:
            tokens, logprobs, text = list(c.token_ids), list(c.logprobs), c.text
            if c.finish_reason == "stop" and req.stop and not req.include_stop_str_in_output and not (tokens and tokens[-1] == self.eos_id):
                tokens, logprobs, text = self._strip_stop(tokens, logprobs, text, req.stop)
            choices.append({"text": text, "tokens": tokens, "logprobs": logprobs, "finish_reason": c.finish_reason})
        return choices, max_tokens

    def _strip_stop(self, tokens: list[int], logprobs: list[float], text: str, stops: list[str]):
        matched = next((s for s in stops if text.endswith(s)), None)
        if matched is None:
            return tokens, logprobs, text
        text = text[: len(text) - len(matched)]
        keep = len(tokens)  # the shortest token prefix whose text still covers the kept text
        while keep > 0 and len(self.tokenizer.decode(tokens[: keep - 1], skip_special_tokens=True)) >= len(text):
            keep -= 1
        return tokens[:keep], logprobs[:keep], text

    def pieces(self, tokens: list[int], as_ids: bool) -> list[str]:
        if as_ids:
            return [f"token_id:{t}" for t in tokens]
        return self.tokenizer.batch_decode([[t] for t in tokens], skip_special_tokens=False)

    def completion_logprobs(self, choice: dict, as_ids: bool) -> dict:
        pieces = self.pieces(choice["tokens"], as_ids)
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        offsets, at = [], 0
        for token, piece in zip(choice["tokens"], self.pieces(choice["tokens"], False), strict=True):
            offsets.append(at)
            at += 0 if token in special else len(piece)
        return {
            "tokens": pieces,
            "token_logprobs": choice["logprobs"],
            "top_logprobs": [{p: lp} for p, lp in zip(pieces, choice["logprobs"], strict=True)],
            "text_offset": offsets,
        }

    def chat_logprobs(self, choice: dict, as_ids: bool, top: int) -> dict:
        content = []
        for piece, lp in zip(self.pieces(choice["tokens"], as_ids), choice["logprobs"], strict=True):
            entry = {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8"))}
            content.append({**entry, "top_logprobs": [entry] if top else []})
        return {"content": content}


def _usage(prompts: list[list[int]], choices: list[dict]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c["tokens"]) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _validation_error(exc: ValidationError) -> APIError:
    parts, first = [], None
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"])
        first = first or loc
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return APIError(400, "; ".join(parts), param=first)


def make_app(backend, model_name: str = "model", api_key: str | None = None) -> Starlette:
    """The ASGI app serving ``backend`` (anything with ``generate`` and ``tokenizer``, e.g. ``HFBackend``)
    under ``model_name``; with ``api_key``, requests must send ``Authorization: Bearer <api_key>``."""
    served = _Served(backend, model_name, api_key)

    def check_auth(request: Request) -> None:
        if served.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {served.api_key}":
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)", code="invalid_api_key")

    async def parse(request: Request, model: type[_Common]) -> _Common:
        check_auth(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            req = model.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        if req.model != served.model_name:
            raise APIError(404, f"The model {req.model!r} does not exist; this server serves {served.model_name!r}", param="model", code="model_not_found")
        req.unsupported()
        return req

    async def guarded(handler, request: Request) -> JSONResponse:
        try:
            return await handler(request)
        except APIError as exc:
            return exc.response()
        except Exception as exc:  # generation failed: answer JSON, keep serving
            log.exception("request failed")
            return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error").response()

    async def completions(request: Request) -> JSONResponse:
        req = await parse(request, CompletionRequest)

        def work():
            prompts = [served.encode(p) if isinstance(p, str) else p for p in req.prompt]
            choices, _ = served.generate(prompts, req, 16 if req.max_tokens is None else req.max_tokens)
            out = []
            for index, choice in enumerate(choices):
                logprobs = None if req.logprobs is None else served.completion_logprobs(choice, req.return_tokens_as_token_ids)
                out.append({"index": index, "text": choice["text"], "logprobs": logprobs, "finish_reason": choice["finish_reason"]})
            return out, _usage(prompts, choices)

        choices, usage = await run_in_threadpool(served.run, work)
        body = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": served.model_name, "choices": choices, "usage": usage}
        return JSONResponse(body)

    async def chat(request: Request) -> JSONResponse:
        req = await parse(request, ChatRequest)

        def work():
            messages = [{"role": m.role, "content": m.content} for m in req.messages]
            try:
                text = render_chat(served.tokenizer, messages)
            except Exception as exc:  # a template that rejects the conversation (e.g. role order)
                raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages") from None
            prompts = [served.encode(text)]
            choices, _ = served.generate(prompts, req, req.max_completion_tokens or req.max_tokens)
            out = []
            for index, choice in enumerate(choices):
                logprobs = served.chat_logprobs(choice, req.return_tokens_as_token_ids, req.top_logprobs or 0) if req.logprobs else None
                message = {"role": "assistant", "content": choice["text"]}
                out.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": choice["finish_reason"]})
            return out, _usage(prompts, choices)

        choices, usage = await run_in_threadpool(served.run, work)
        body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()), "model": served.model_name, "choices": choices, "usage": usage}
        return JSONResponse(body)

    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        card = {"id": served.model_name, "object": "model", "created": served.created, "owned_by": "opd-harness", "max_model_len": served.max_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    def route(path: str, handler, methods: list[str]) -> Route:
        async def endpoint(request: Request) -> JSONResponse:
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
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, max_body_size=MAX_BODY_BYTES)
    app.state.served = served
    return app


def serve(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    batch_size: int = 64,
    *,
    device: str | None = None,
    model_name: str | None = None,
    api_key: str | None = None,
    log_level: str = "info",
) -> None:
    """Load ``model_path`` with the HF backend and serve it until interrupted (blocks).

    The served model name is ``model_name``, by default ``model_path`` as given (as vLLM does);
    ``device`` defaults to CUDA when available.
    """
    import torch
    import uvicorn

    from harness.backends.hf import HFBackend

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = HFBackend.load(model_path, batch_size=batch_size, device=device)
    app = make_app(backend, model_name=model_name or model_path, api_key=api_key)
    log.info("serving %s on http://%s:%d/v1 (%s)", model_name or model_path, host, port, device)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
