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
* ``logprobs`` (default true): ask for the sampled tokens' log-probs. ``false`` suits servers that cannot return
  them: an evaluation reads none (its episodes then hold no behaviour log-probs), while training, which does, refuses
  an engine told so (``trainer.rollout_backend_options.logprobs=false`` exits 2).

Sampling: ``temperature``, ``top_p``, ``seed``, ``stop`` and ``presence_penalty`` (when not 0) are OpenAI fields.
``top_k`` (when ``SamplingParams.top_k`` > 0 and not greedy) is not an OpenAI field: it goes in the request body as an
extra field, which vLLM, SGLang, llama.cpp's server and ``harness serve`` accept; OpenAI's own API and servers that
reject unknown fields refuse it (400), and servers that ignore unknown fields sample without it, so use a server that
takes ``top_k`` for a top-k protocol.

What comes back per sample: ``token_ids`` are exact when the server returns ``token_id:<id>``
tokens (then a final EOS is included, as with the HF backend), else the text re-encoded with the
tokenizer. ``logprobs`` are the server's sampled-token log-probs when it returns them and they align
one-to-one with ``token_ids``; otherwise an empty list (servers without log-prob support, or
re-encoded ids that do not line up). Our server returns untempered log-probs; vLLM returns its
``logprobs_mode`` (raw by default).

Seeds: with ``params.seed`` every prompt gets its own seed (:func:`opd_harness.backends.prompt_seed`: the caller's
``params.seeds`` entry, the rollout's per-episode seed, else one derived from (seed, prompt index)), so a
run is reproducible and two prompts with the same text (rollout sends the k samples of a problem as
k prompts) still get different samples.

Scoring (``score``, what a teacher and lm-eval's log-likelihood tasks need): each unpadded row is
sent as one completions request with ``echo: true``, ``max_tokens: 0`` and ``logprobs: max(top_k, 1)``
(vLLM's and ``harness serve``'s prompt log-probs: the prompt's tokens come back with their
log-probs, the first one ``null``, and each position's ``top_logprobs`` holds the top-k plus the
actual token). A server that refuses ``max_tokens: 0`` is asked for ``max_tokens: 1`` instead (the
extra token is ignored; logged once). The prompt goes as token ids under ``prompt_format``
``tokens``/``auto``, so no re-tokenisation can shift positions; as text (``prompt_format=text``, or
``auto`` after a server refused ids) the server's returned tokens are checked against the local
tokenizer's and a mismatch is a :class:`ScoringMismatch` naming the position. Top-k ids come from
``token_id:<id>`` keys (``server_extensions``), else from the tokenizer's vocabulary. Only
``logprobs`` and ``topk`` can be scored (``score_fields``): a server returns no full distribution
or entropy. Position 0 of each row and padding score 0, as in the HF backend. Requests run
``concurrency`` at a time with the same retries as generation; an error after them is raised.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from opd_harness.backends import SCORE_FIELDS, Completion, SamplingParams, as_bool, prompt_seed
from opd_harness.backends.prompt_logprobs import prompt_logprobs_to_tensor, unpadded_sequences

log = logging.getLogger("opd_harness.backends.openai")

MODES = ("completions", "chat")
PROMPT_FORMATS = ("auto", "tokens", "text")
MAX_BACKOFF_S = 30.0


def load_tokenizer(path: str | None, model: str):
    """``tokenizer=PATH``; else the model directory's tokenizer; else the character tokenizer (warned)."""
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(str(path))
    local = Path(model)
    if local.is_dir() and any((local / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(str(local))
    from opd_harness.models.tiny import build_char_tokenizer

    log.warning(
        "openai backend: no tokenizer=PATH option and %r is not a local model directory; using the harness's "
        "character tokenizer, which is only right for the harness's tiny models. Pass tokenizer=PATH for any other model.",
        model,
    )
    return build_char_tokenizer()


class OpenAIBackend:
    """Generates through an OpenAI-compatible server; see the module docstring for the options."""

    presence_penalty = True  # SamplingParams.presence_penalty is applied (sent to the engine)

    score_fields = ("logprobs", "topk")  # what ``score`` can return: no full distribution over HTTP

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
        self._echo_max_tokens = 0  # 1 once a server refused echo without generation
        self._piece_index: dict[str, list[int]] | None = None

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
        enable_thinking: bool | str | None = None,
    ) -> "OpenAIBackend":
        """Connect to the server at ``base_url`` (or ``OPENAI_BASE_URL``) serving ``model``; ``enable_thinking`` is set in
        the local tokenizer's chat template, with which the harness renders prompts (completions mode only: in chat mode
        the server renders its own template, so it is refused there)."""
        import openai

        if enable_thinking is not None and mode == "chat":
            raise ValueError("openai backend: enable_thinking is set in the local tokenizer's template, which mode=chat does not use; "
                             "use mode=completions")  # fmt: skip

        base_url = base_url or os.environ.get("OPENAI_BASE_URL")
        if not base_url:
            raise ValueError("openai backend: no server address; pass base_url=http://HOST:PORT/v1 or set OPENAI_BASE_URL")
        client = openai.OpenAI(
            base_url=base_url,
            api_key=api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY",
            timeout=float(timeout_s),
            max_retries=int(max_retries),
        )
        local_tokenizer = load_tokenizer(tokenizer, model)
        if enable_thinking is not None:
            from opd_harness.models.hub import set_thinking

            set_thinking(local_tokenizer, as_bool(enable_thinking))
        return cls(
            client,
            model,
            local_tokenizer,
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
        kwargs: dict = {
            "model": self.model,
            "n": params.n,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if params.seed is not None:
            kwargs["seed"] = prompt_seed(params, prompt_index)
        if params.stop:
            kwargs["stop"] = list(params.stop)
        if params.presence_penalty:
            kwargs["presence_penalty"] = params.presence_penalty
        extra = {"return_tokens_as_token_ids": True, "include_stop_str_in_output": True} if self.server_extensions else {}
        if params.top_k and not params.greedy:  # not an OpenAI field: sent in the body only when on (vLLM, SGLang, llama.cpp take it)
            extra["top_k"] = params.top_k
        if extra:
            kwargs["extra_body"] = extra
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
                log.warning(
                    "openai backend: %s (%s); retry %d/%d in %.2fs", type(exc).__name__, exc, attempt + 1, self.connect_retries, delay
                )
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

    # ------------------------------------------------------------------ scoring

    def score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        want: tuple[str, ...] = ("logprobs",),
        top_k: int = 0,
        grad: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Per-position ``logprobs`` (and ``topk_logprobs``/``topk_ids`` with ``"topk"``) from the server's prompt log-probs."""
        check_score_request(want, top_k, grad)
        k = top_k if "topk" in want else 0
        rows = unpadded_sequences(input_ids.cpu(), attention_mask.cpu())
        workers = max(1, min(self.concurrency, len(rows)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="openai-score") as pool:
            entries = list(pool.map(lambda item: self._prompt_logprobs(item[0], item[1][1], k) if item[1][1] else None, enumerate(rows)))
        scores = prompt_logprobs_to_tensor(entries, input_ids.cpu(), attention_mask.cpu(), want, k)
        return {name: value.to(input_ids.device) for name, value in scores.items()}

    def _prompt_logprobs(self, row: int, tokens: list[int], top_k: int) -> list[dict[int, float] | None]:
        """One row's prompt log-probs as vLLM-style entries: ``None`` first, then ``{token id: log-prob}`` per position."""
        import openai

        kwargs: dict = {
            "model": self.model,
            "echo": True,
            "logprobs": max(top_k, 1),
            "temperature": 1.0,
            "max_tokens": self._echo_max_tokens,
        }
        if self.server_extensions:
            kwargs["extra_body"] = {"return_tokens_as_token_ids": True}
        try:
            response = self._complete(tokens, kwargs)
        except (openai.BadRequestError, openai.UnprocessableEntityError) as exc:
            if self._echo_max_tokens != 0:
                raise
            response = self._complete(tokens, {**kwargs, "max_tokens": 1})  # raises if this is refused too
            log.warning("openai backend: the server refused echo with max_tokens=0 (%s); scoring with max_tokens=1 from now on", exc)
            self._echo_max_tokens = 1
        if not response.choices or response.choices[0].logprobs is None:
            raise ScoringMismatch(
                f"openai backend: {self.model!r} returned no prompt log-probs for row {row} (does the server support echo with logprobs?)"
            )
        return self._entries(row, tokens, response.choices[0].logprobs, top_k)

    def _entries(self, row: int, tokens: list[int], logprobs, top_k: int) -> list[dict[int, float] | None]:
        """Check the echoed tokens are ``tokens`` and turn each position's log-probs into ``{id: log-prob}``."""
        returned, values, tops = list(logprobs.tokens or []), list(logprobs.token_logprobs or []), list(logprobs.top_logprobs or [])
        if len(returned) < len(tokens) or len(values) < len(tokens):
            raise ScoringMismatch(
                f"openai backend: row {row}: sent {len(tokens)} prompt tokens, "
                f"the server echoed {len(returned)} with {len(values)} log-probs"
            )
        entries: list[dict[int, float] | None] = [None]
        for position, token in enumerate(tokens):
            echoed = self._token_id(returned[position], token)
            if echoed != token:
                raise ScoringMismatch(
                    f"openai backend: row {row}, position {position}: the server's token {returned[position]!r} is not the local token "
                    f"{token} ({self.tokenizer.decode([token])!r}); the server tokenised the prompt differently "
                    "(send token ids with prompt_format=tokens, or pass the served model's tokenizer=PATH)"
                )
            if position == 0:
                continue
            if values[position] is None:
                raise ScoringMismatch(f"openai backend: row {row}, position {position}: the server returned no log-prob for a prompt token")
            entry = {token: float(values[position])}
            top = tops[position] if position < len(tops) else None
            for key, value in (top or {}).items() if top_k else ():
                entry.setdefault(self._token_id(key, None), float(value))
            entries.append(entry)
        return entries

    def _token_id(self, piece: str, expected: int | None) -> int | None:
        """A returned token as an id: ``token_id:<id>``; else the text of ``expected`` when it matches; else a vocabulary lookup."""
        if piece.startswith("token_id:"):
            try:
                return int(piece.removeprefix("token_id:"))
            except ValueError:
                pass
        if expected is not None and piece in self._pieces_of(expected):
            return expected
        ids = self._ids_of_piece().get(piece, [])
        if len(ids) == 1:
            return ids[0]
        if expected is not None:
            return None
        raise ScoringMismatch(
            f"openai backend: the server's top-k token {piece!r} maps to {len(ids)} local token ids; "
            "top-k scoring needs token ids (server_extensions=true, vLLM's return_tokens_as_token_ids) or the served model's tokenizer"
        )

    def _pieces_of(self, token: int) -> set[str]:
        """The ways a server may write one token: its decoded text or its vocabulary entry."""
        return {self.tokenizer.decode([token]), *self.tokenizer.convert_ids_to_tokens([token])}

    def _ids_of_piece(self) -> dict[str, list[int]]:
        """Vocabulary text → ids (decoded text and raw entry), built once."""
        with self._format_lock:
            if self._piece_index is None:
                index: dict[str, list[int]] = {}
                for token in range(len(self.tokenizer)):
                    for piece in self._pieces_of(token):
                        index.setdefault(piece, []).append(token)
                self._piece_index = index
            return self._piece_index


class ScoringMismatch(RuntimeError):
    """The server's prompt log-probs do not line up with the tokens sent (re-tokenised text, missing entries)."""


def check_score_request(want: tuple[str, ...], top_k: int, grad: bool) -> None:
    """Refuse what a server cannot score, with the reason."""
    unknown = set(want) - set(SCORE_FIELDS)
    if unknown:
        raise ValueError(f"unknown score fields {sorted(unknown)}; allowed: {SCORE_FIELDS}")
    unsupported = sorted(set(want) - set(OpenAIBackend.score_fields))
    if unsupported:
        raise NotImplementedError(
            f"the openai backend cannot score {unsupported}: an OpenAI-compatible server returns only the top-k log-probs per position, "
            "never the full distribution needed for entropy or full"
        )
    if grad:
        raise NotImplementedError("the openai backend cannot score with gradients; use the hf backend for a trained model")
    if "topk" in want and top_k < 1:
        raise ValueError(f"score(want=('topk', ...)) needs top_k >= 1, got {top_k}")
