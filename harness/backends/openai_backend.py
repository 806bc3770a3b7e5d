"""OpenAI-compatible HTTP backend (``--backend openai``): any server speaking the OpenAI API
(``harness serve``, vLLM's ``vllm serve``, ...) through the official ``openai`` client.

``OpenAIBackend.load(model, base_url=..., api_key=..., mode=..., ...)`` where ``model`` is the
*served* model name (what ``GET /v1/models`` lists). Options (all also accepted as strings, as a
command line passes them):

* ``base_url``: e.g. ``http://127.0.0.1:8000/v1``; else ``OPENAI_BASE_URL``; one is required
  (the backend never falls back to a public API by accident).
* ``api_key``: else ``OPENAI_API_KEY``, else ``"EMPTY"`` (what local servers expect).
* ``mode``: ``"completions"`` (default; ``POST /v1/completions``) or ``"chat"``
  (``POST /v1/chat/completions``, the decoded prompt sent as one user message, so the *server*
  applies its chat template: use it only when the harness prompt is plain text, i.e. the
  tokenizer given here has no chat template, or the template would be applied twice).
* ``prompt_format``: completions mode only. ``"tokens"`` sends the prompt's token ids (exact; our
  server and vLLM accept them), ``"text"`` sends the decoded text, ``"auto"`` (default) sends ids
  and, if the server answers 400/422 to an id prompt but accepts the same prompt as text, switches
  to text for the rest of the run (logged once).
* ``concurrency`` (default 8): at most this many HTTP requests in flight; one request per prompt,
  carrying all ``n`` samples of it.
* ``timeout_s`` (default 600): per-request timeout. ``max_retries`` (default 2): the client's own
  retries, with exponential backoff (0.5 s · 2^i, at most 8 s, jittered; ``Retry-After`` /
  ``retry-after-ms`` honoured) on 408/409/429/5xx, timeouts and connection errors.
  ``connect_retries`` (default 3) and ``retry_backoff_s`` (default 1.0): a further bounded retry
  here, around the client, for connection errors and timeouts only (a server restarting or not up
  yet), sleeping ``retry_backoff_s · 2^i`` (at most 30 s) between tries. A request is thus tried at
  most ``(max_retries + 1) · (connect_retries + 1)`` times on connection errors and
  ``max_retries + 1`` times on 429/5xx; the last error is raised as the client's exception
  (``openai.RateLimitError``, ``openai.InternalServerError``, ``openai.APIConnectionError``, ...).
* ``tokenizer``: a path (or hub id) for ``AutoTokenizer``; it must match the served model, since
  the harness encodes prompts with it and this backend sends token ids. Default: the tokenizer in
  directory ``model`` when ``model`` is a local model directory, else the harness's built-in
  character tokenizer (right only for the harness's tiny models; a warning says so).
* ``server_extensions`` (default true): send vLLM's extra fields ``return_tokens_as_token_ids``
  (exact sampled token ids from the log-prob tokens) and ``include_stop_str_in_output`` (the text
  keeps a matched stop string, as the HF backend does). Our server and vLLM accept them; set it
  false for servers that reject unknown fields (then stop strings are cut from the text, OpenAI's
  semantics, and token ids are re-encoded from the text).
* ``logprobs`` (default true): ask for the sampled tokens' log-probs.

What comes back per sample: ``token_ids`` are exact when the server returns ``token_id:<id>``
tokens (then a final EOS is included, as with the HF backend), else the text re-encoded with the
tokenizer. ``logprobs`` are the server's sampled-token log-probs when it returns them and they align
one-to-one with ``token_ids``; otherwise an empty list (servers without log-prob support, or
re-encoded ids that do not line up). Our server returns untempered log-probs; vLLM returns its
``logprobs_mode`` (raw by default).

Seeds: with ``params.seed`` every prompt gets its own seed derived from (seed, prompt index), so a
run is reproducible and two prompts with the same text (rollout sends the k samples of a problem as
k prompts) still get different samples.

``score()`` is not available: teacher scoring over HTTP (prompt log-probs) is out of scope here;
use the ``hf`` (or ``vllm``) backend for teachers.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness.backends import Completion, SamplingParams, as_bool
from harness.registry import BACKENDS

log = logging.getLogger("harness.backends.openai")

MODES = ("completions", "chat")
PROMPT_FORMATS = ("auto", "tokens", "text")
MAX_BACKOFF_S = 30.0


def derive_seed(seed: int, prompt_index: int) -> int:
    """A 31-bit seed per (seed, prompt) pair; stable across runs and platforms."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def load_tokenizer(path: str | None, model: str):
    """``tokenizer=PATH``; else the model directory's tokenizer; else the character tokenizer (warned)."""
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(str(path))
    local = Path(model)
    if local.is_dir() and any((local / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(str(local))
    from harness.models.tiny import build_char_tokenizer

    log.warning(
        "openai backend: no tokenizer=PATH option and %r is not a local model directory; using the harness's "
        "character tokenizer, which is only right for the harness's tiny models. Pass tokenizer=PATH for any other model.",
        model,
    )
    return build_char_tokenizer()


@BACKENDS.register("openai")
class OpenAIBackend:
    """Generates through an OpenAI-compatible server; see the module docstring for the options."""

    name = "openai"

    def __init__(
        self,
        client,
        model: str,
        tokenizer,
        *,
        mode: str = "completions",
        concurrency: int = 8,
        prompt_format: str = "auto",
        connect_retries: int = 3,
        retry_backoff_s: float = 1.0,
        server_extensions: bool = True,
        logprobs: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"openai backend: mode {mode!r}: choose one of {', '.join(MODES)}")
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"openai backend: prompt_format {prompt_format!r}: choose one of {', '.join(PROMPT_FORMATS)}")
        if concurrency < 1:
            raise ValueError(f"openai backend: concurrency must be >= 1, got {concurrency}")
        if connect_retries < 0 or retry_backoff_s < 0:
            raise ValueError("openai backend: connect_retries and retry_backoff_s must be >= 0")
        self.client = client
        self.model = model
        self.tokenizer = tokenizer
        self.mode = mode
        self.concurrency = concurrency
        self.prompt_format = prompt_format
        self.connect_retries = connect_retries
        self.retry_backoff_s = retry_backoff_s
        self.server_extensions = server_extensions
        self.want_logprobs = logprobs
        self.version = 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.sleep = time.sleep  # replaceable in tests
        self._format_lock = threading.Lock()

    @classmethod
    def load(
        cls,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        mode: str = "completions",
        concurrency: int | str = 8,
        timeout_s: float | str = 600.0,
        max_retries: int | str = 2,
        connect_retries: int | str = 3,
        retry_backoff_s: float | str = 1.0,
        tokenizer: str | None = None,
        prompt_format: str = "auto",
        server_extensions: bool | str = True,
        logprobs: bool | str = True,
    ) -> "OpenAIBackend":
        """Connect to the server at ``base_url`` (or ``OPENAI_BASE_URL``) serving ``model``."""
        import openai

        base_url = base_url or os.environ.get("OPENAI_BASE_URL")
        if not base_url:
            raise ValueError("openai backend: no server address; pass base_url=http://HOST:PORT/v1 or set OPENAI_BASE_URL")
        client = openai.OpenAI(
            base_url=base_url,
            api_key=api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY",
            timeout=float(timeout_s),
            max_retries=int(max_retries),
        )
        return cls(
            client,
            model,
            load_tokenizer(tokenizer, model),
            mode=mode,
            concurrency=int(concurrency),
            prompt_format=prompt_format,
            connect_retries=int(connect_retries),
            retry_backoff_s=float(retry_backoff_s),
            server_extensions=as_bool(server_extensions),
            logprobs=as_bool(logprobs),
        )

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``params.n`` completions per prompt, prompt-major; one request per prompt, ``concurrency`` at a time."""
        if not prompts:
            return []
        workers = min(self.concurrency, len(prompts))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="openai-backend") as pool:
            per_prompt = list(pool.map(lambda item: self._generate_one(item[0], item[1], params), enumerate(prompts)))
        return [c for completions in per_prompt for c in completions]

    def _common_kwargs(self, prompt_index: int, params: SamplingParams) -> dict:
        kwargs: dict = {"model": self.model, "n": params.n, "max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p}
        if params.seed is not None:
            kwargs["seed"] = derive_seed(params.seed, prompt_index)
        if params.stop:
            kwargs["stop"] = list(params.stop)
        if self.server_extensions:
            kwargs["extra_body"] = {"return_tokens_as_token_ids": True, "include_stop_str_in_output": True}
        return kwargs

    def _generate_one(self, prompt_index: int, prompt: list[int], params: SamplingParams) -> list[Completion]:
        started = time.perf_counter()
        kwargs = self._common_kwargs(prompt_index, params)
        if self.mode == "chat":
            text = self.tokenizer.decode(prompt, skip_special_tokens=False)
            if self.want_logprobs:
                kwargs["logprobs"] = True
            response = self._with_retries(self.client.chat.completions.create, messages=[{"role": "user", "content": text}], **kwargs)
            raw = [(c.index, c.message.content or "", self._chat_logprobs(c.logprobs), c.finish_reason) for c in response.choices]
        else:
            if self.want_logprobs:
                kwargs["logprobs"] = 0
            response = self._complete(prompt, kwargs)
            raw = [(c.index, c.text, self._completion_logprobs(c.logprobs), c.finish_reason) for c in response.choices]
        if len(raw) != params.n:
            raise RuntimeError(f"openai backend: asked {self.model!r} for {params.n} samples of prompt {prompt_index}, got {len(raw)}")
        elapsed = time.perf_counter() - started
        out = []
        for sample_index, (_, text, token_info, finish) in enumerate(sorted(raw, key=lambda r: r[0])):
            token_ids, logprobs = self._tokens(text, token_info, finish)
            out.append(
                Completion(
                    token_ids=token_ids,
                    logprobs=logprobs,
                    text=text,
                    finish_reason="length" if finish == "length" else "stop",
                    prompt_index=prompt_index,
                    sample_index=sample_index,
                    timings={"generate_s": elapsed / params.n},
                )
            )
        return out

    def _complete(self, prompt: list[int], kwargs: dict):
        """Completions call with the prompt as ids or text per ``prompt_format`` (see the module docstring)."""
        import openai

        create = self.client.completions.create
        if self.prompt_format == "text":
            return self._with_retries(create, prompt=self.tokenizer.decode(prompt, skip_special_tokens=False), **kwargs)
        try:
            return self._with_retries(create, prompt=prompt, **kwargs)
        except (openai.BadRequestError, openai.UnprocessableEntityError) as exc:
            if self.prompt_format != "auto":
                raise
            response = self._with_retries(create, prompt=self.tokenizer.decode(prompt, skip_special_tokens=False), **kwargs)
            with self._format_lock:
                if self.prompt_format == "auto":
                    log.warning("openai backend: the server refused a token-id prompt (%s); sending text prompts from now on", exc)
                    self.prompt_format = "text"
            return response

    def _with_retries(self, create, **kwargs):
        """``create(**kwargs)``; on connection errors and timeouts (after the client's own retries),
        try again up to ``connect_retries`` times with exponential backoff."""
        import openai

        for attempt in range(self.connect_retries + 1):
            try:
                return create(**kwargs)
            except openai.APIConnectionError as exc:  # includes APITimeoutError
                if attempt == self.connect_retries:
                    raise
                delay = min(self.retry_backoff_s * 2**attempt, MAX_BACKOFF_S) * (1 - 0.25 * random.random())
                log.warning("openai backend: %s (%s); retry %d/%d in %.2fs", type(exc).__name__, exc, attempt + 1, self.connect_retries, delay)
                self.sleep(delay)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ response parsing

    @staticmethod
    def _completion_logprobs(logprobs) -> tuple[list[str], list[float]] | None:
        if logprobs is None or logprobs.tokens is None or logprobs.token_logprobs is None:
            return None
        return list(logprobs.tokens), [float(x) if x is not None else float("nan") for x in logprobs.token_logprobs]

    @staticmethod
    def _chat_logprobs(logprobs) -> tuple[list[str], list[float]] | None:
        if logprobs is None or logprobs.content is None:
            return None
        return [t.token for t in logprobs.content], [float(t.logprob) for t in logprobs.content]

    def _tokens(self, text: str, token_info: tuple[list[str], list[float]] | None, finish: str) -> tuple[list[int], list[float]]:
        """Exact ids from ``token_id:<id>`` tokens when present, else ``text`` re-encoded; log-probs only when aligned.

        A server that lists a final EOS among the log-prob tokens (ours and vLLM do) but not in the text
        gives one log-prob more than the re-encoded text: the EOS id is appended so both line up.
        """
        if token_info is not None:
            tokens, logprobs = token_info
            if tokens and all(t.startswith("token_id:") for t in tokens):
                try:
                    return [int(t.removeprefix("token_id:")) for t in tokens], logprobs
                except ValueError:
                    pass
        token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if token_info is not None:
            if len(token_info[1]) == len(token_ids):
                return token_ids, token_info[1]
            if finish == "stop" and self.eos_id is not None and len(token_info[1]) == len(token_ids) + 1:
                return token_ids + [self.eos_id], token_info[1]
        return token_ids, []

    def score(self, *args, **kwargs):
        raise NotImplementedError(
            "the openai backend cannot score sequences: teacher scoring (prompt log-probs over given tokens) "
            "over HTTP is out of scope; use the hf or vllm backend for a teacher"
        )
