# The serve engine as it was before continuous batching (`git show main:harness/serve/engine.py` at 2e29556), kept only as
# the baseline of benchmarks/serve_engine.py. Not imported by harness/.
"""The batching engine behind ``harness serve``: one decode loop over an HF causal LM, shared by requests.

Requests are split into sequences (one per prompt × sample). A worker thread takes up to
``max_batch`` waiting sequences at a time — from however many requests — and decodes them together
(one left-padded prefill, then one forward pass per new token with the KV cache). Sequences report
each step to their request, so streaming is truly incremental.

Every sequence samples with its own ``torch.Generator`` seeded from its request's seed, so a
request's tokens do not depend on what it was batched with (up to float rounding of batched matmuls,
which only matters at exact ties). Log-probs are those of the untempered model distribution, as the
HF backend computes them; prompt log-probs come from the same prefill.
"""

from __future__ import annotations

import inspect
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger("opd_harness.serve")

TopList = list[tuple[int, float]]  # (token id, log-prob), most likely first


@dataclass
class Sequence:
    """One prompt × sample to decode, plus what decoding produced (filled in by the engine)."""

    prompt: list[int]
    max_tokens: int  # 0: score the prompt only
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop: bool = False  # keep a matched stop string in the text (vLLM's include_stop_str_in_output)
    top_n: int = 0  # alternatives per position
    prompt_logprobs: bool = False
    stream: bool = False  # report text as it is decoded (otherwise only stop strings need the text before the end)
    on_event: Callable[["Sequence", str, "Delta | None"], None] | None = None  # from the engine thread: "step", "done", "error"
    # results
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[TopList] = field(default_factory=list)
    prompt_lps: list[float | None] = field(default_factory=list)
    prompt_tops: list[TopList | None] = field(default_factory=list)
    text: str = ""  # final text (stop string removed unless include_stop)
    finish_reason: str | None = None
    error: BaseException | None = None
    cancelled: bool = False
    streamed_out: bool = False  # a streamed step was reported: decoding it again would repeat text
    released: bool = False  # no longer counted in the engine's load

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def reset(self) -> None:
        """Forget what a failed decode produced, so the sequence can be decoded again from its prompt."""
        self.tokens, self.logprobs, self.tops, self.prompt_lps, self.prompt_tops = [], [], [], [], []
        self.text, self.finish_reason, self.error = "", None, None


@dataclass(frozen=True)
class Delta:
    """What a step adds to a sequence's reported output: text, and the tokens that text completes."""

    text: str
    tokens: list[int]
    logprobs: list[float]
    tops: list[TopList]


@dataclass
class EngineStats:
    """Counters exposed by ``/metrics``: how requests were batched."""

    waves: int = 0  # backend decode calls (one prefill + its decode steps)
    sequences: int = 0
    max_wave: int = 0
    forward_passes: int = 0


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Draw one token id from ``softmax(logits / temperature)`` cut to the ``top_p`` nucleus (greedy at 0).

    The same draw as transformers' sampling (temperature, then top-p, then ``torch.multinomial`` over
    the vocabulary in id order), so one sequence seeded ``s`` samples what ``HFBackend.generate`` does
    with seed ``s``.
    """
    if temperature == 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p  # the mass above a token already reaches top_p
        probs = probs.masked_fill(outside.scatter(-1, order, outside), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_list(logp: torch.Tensor, n: int) -> TopList:
    """The ``n`` most likely (id, log-prob) pairs of one position, most likely first."""
    if n <= 0:
        return []
    values, ids = logp.topk(min(n, logp.shape[-1]))
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` as (index, stop), or None."""
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found, key=lambda f: f[0]) if found else None


def safe_prefix(text: str, stops: tuple[str, ...]) -> str:
    """The part of ``text`` that can be shown now: without a tail that may still grow into a stop string
    (its longest stop minus one character) or an incomplete UTF-8 sequence."""
    safe = len(text) - (max((len(s) for s in stops), default=1) - 1)
    while safe > 0 and text[safe - 1] == "\ufffd":
        safe -= 1
    return text[: max(safe, 0)]


class Overloaded(Exception):
    """``submit`` refused: the sequences would take the engine's load past the caller's limit."""


class Engine:
    """Decodes waves of sequences in one worker thread; ``submit`` and ``cancel`` are safe from any thread.

    A wave whose decoding fails is decoded again one sequence at a time (those not streamed yet), so
    only the sequences that fail alone get the error; a sequence whose sampling fails (e.g. a
    temperature that overflows its logits) fails alone without stopping the rest of its wave.
    """

    def __init__(
        self, model, tokenizer, *, device: str, max_batch: int = 64, max_batch_tokens: int | None = None, batch_wait_s: float = 0.002
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be at least 1, got {max_batch_tokens}")
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.batch_wait_s = batch_wait_s
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.stats = EngineStats()
        self.tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to share across threads
        self._queue: queue.Queue[Sequence | None] = queue.Queue()
        self._load = 0  # sequences submitted and not yet finished, failed or cancelled
        self._load_lock = threading.Lock()
        self._closed = False
        self._held: Sequence | None = None  # taken from the queue but left for the next batch (token budget)
        self._worker: threading.Thread | None = None
        self._start_lock = threading.Lock()
        accepted = inspect.signature(model.forward).parameters
        self._keep_logits = "logits_to_keep" in accepted
        self._cache_arg = "cache" if "cache" in accepted else "past_key_values"  # transformers 5 renamed it

    # -- tokenizer access (any thread)

    def encode(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, tokens: list[int], *, skip_special: bool = True) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode(tokens, skip_special_tokens=skip_special)

    def pieces(self, tokens: list[int]) -> list[str]:
        """Each token's own text (special tokens spelled out)."""
        with self.tokenizer_lock:
            return self.tokenizer.batch_decode([[t] for t in tokens], skip_special_tokens=False)

    # -- submission

    @property
    def load(self) -> int:
        """Sequences waiting or being decoded (cancelled ones no longer count)."""
        return self._load

    def submit(self, sequences: list[Sequence], *, max_load: int | None = None) -> None:
        """Queue ``sequences``; each reports through its ``on_event``. Raises ``Overloaded`` (queueing
        nothing) when they would take ``load`` above ``max_load``."""
        with self._start_lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._loop, name="harness-serve-engine", daemon=True)
                self._worker.start()
        with self._load_lock:
            if max_load is not None and self._load + len(sequences) > max_load:
                raise Overloaded(f"{self._load} sequences are waiting or decoding; {len(sequences)} more would exceed {max_load}")
            self._load += len(sequences)
        for seq in sequences:
            self._queue.put(seq)

    def cancel(self, sequences: list[Sequence]) -> None:
        """Stop ``sequences``: queued ones are skipped, a batch decoding them ends once all its sequences are stopped."""
        for seq in sequences:
            seq.cancelled = True
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        with self._load_lock:
            if not seq.released:
                seq.released = True
                self._load -= 1

    def _take_wave(self) -> list[Sequence]:
        """The next batch: block for one sequence, then take what arrives within ``batch_wait_s``, up to
        ``max_batch`` sequences and ``max_batch_tokens`` padded positions (batch × longest prompt + max_tokens)."""
        first, self._held = self._held or self._queue.get(), None
        if first is None:  # close() woke the worker up
            return []
        wave = [first]
        deadline = time.monotonic() + self.batch_wait_s
        while len(wave) < self.max_batch:
            try:
                seq = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if seq is None:
                break
            limit = self.max_batch_tokens
            if limit is not None and (len(wave) + 1) * max(len(s.prompt) + s.max_tokens for s in [*wave, seq]) > limit:
                self._held = seq
                break
            wave.append(seq)
        for seq in wave:
            if seq.cancelled:
                self._release(seq)
        return [s for s in wave if not s.cancelled]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the worker: the batch in progress ends at its next step, queued sequences are dropped."""
        self._closed = True
        self._queue.put(None)
        if self._worker is not None:
            self._worker.join(timeout_s)

    def _loop(self) -> None:
        while not self._closed:
            wave = self._take_wave()
            try:
                self._run(wave)
            finally:
                for seq in wave:
                    self._release(seq)

    def _run(self, wave: list[Sequence]) -> None:
        """Decode ``wave``; if that fails, decode again alone each sequence that can be (see the class docstring)."""
        try:
            if wave:
                self.decode_wave(wave)
            if self._closed:
                raise RuntimeError("the server is shutting down")
        except Exception as exc:  # noqa: BLE001 - reported to the sequences it concerns
            if not self._closed:
                log.exception("decoding a batch of %d sequences failed", len(wave))
            unfinished = [s for s in wave if not (s.done or s.cancelled)]
            retry = [s for s in unfinished if not s.streamed_out] if len(wave) > 1 and not self._closed else []
            for seq in unfinished:
                if not any(seq is r for r in retry):
                    self._fail(seq, exc)
            for seq in retry:
                seq.reset()
                self._run([seq])

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        seq.error = exc
        self._emit(seq, "error")

    def _emit(self, seq: Sequence, kind: str, delta: Delta | None = None) -> None:
        if seq.on_event is not None:
            try:
                seq.on_event(seq, kind, delta)
            except Exception:  # noqa: BLE001 - a callback must not take the engine down
                log.exception("a request callback failed")

    # -- decoding

    def _forward(self, ids: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor, cache, all_logits: bool):
        self.stats.forward_passes += 1
        kwargs = {} if all_logits or not self._keep_logits else {"logits_to_keep": 1}
        kwargs[self._cache_arg] = cache
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True, **kwargs)
        return out.logits, getattr(out, self._cache_arg)

    @torch.no_grad()
    def decode_wave(self, wave: list[Sequence]) -> None:
        """Prefill ``wave`` together, record prompt log-probs where asked, then decode step by step."""
        self.stats.waves += 1
        self.stats.sequences += len(wave)
        self.stats.max_wave = max(self.stats.max_wave, len(wave))
        was_training = self.model.training
        self.model.eval()
        try:
            self._decode(wave)
        finally:
            self.model.train(was_training)

    def _decode(self, wave: list[Sequence]) -> None:
        width = max(len(s.prompt) for s in wave)
        ids = torch.full((len(wave), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(wave), width), dtype=torch.long)
        for i, s in enumerate(wave):
            ids[i, width - len(s.prompt) :] = torch.tensor(s.prompt, dtype=torch.long)
            attn[i, width - len(s.prompt) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        generators = [torch.Generator(device=self.device).manual_seed(self._seed(s)) for s in wave]
        logits, cache = self._forward(ids, attn, positions, None, any(s.prompt_logprobs for s in wave))
        for i, s in enumerate(wave):
            if s.prompt_logprobs:
                self._record_prompt(s, logits[i, width - len(s.prompt) :])
        states = [_TextState() for _ in wave]
        for i, s in enumerate(wave):
            if s.max_tokens == 0:
                self._finish(s, states[i], "length")
        logits = logits[:, -1]
        while not self._closed and not all(s.done or s.cancelled for s in wave):
            chosen_by_row = self._choose(wave, [i for i, s in enumerate(wave) if not (s.done or s.cancelled)], logits, generators)
            live, tokens = list(chosen_by_row), list(chosen_by_row.values())
            if not live:
                break
            logp = F.log_softmax(logits[live].float(), dim=-1)  # one device-to-host copy per step, not per row
            chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None]).squeeze(-1).tolist()
            k = min(max(wave[i].top_n for i in live), logp.shape[-1])
            top_values, top_ids = logp.topk(k) if k else (logp[:, :0], logp[:, :0].long())
            top_values, top_ids = top_values.tolist(), top_ids.tolist()
            next_ids = torch.full((len(wave),), self.pad_id, dtype=torch.long)
            for row, i in enumerate(live):
                next_ids[i] = tokens[row]
                top = list(zip(top_ids[row], top_values[row], strict=True))[: wave[i].top_n]
                self._step(wave[i], states[i], tokens[row], chosen[row], top)
            if all(s.done or s.cancelled for s in wave):
                break
            attn = torch.cat([attn, attn.new_ones((len(wave), 1))], dim=1)
            positions = positions[:, -1:] + 1
            logits, cache = self._forward(next_ids.to(self.device)[:, None], attn, positions, cache, False)
            logits = logits[:, -1]

    def _choose(self, wave: list[Sequence], live: list[int], logits: torch.Tensor, generators: list[torch.Generator]) -> dict[int, int]:
        """The next token of each live sequence, by wave index: greedy rows by one batched argmax, sampled rows by their
        own generator. A row whose sampling fails fails its sequence alone and is left out."""
        greedy = logits[live].argmax(-1).tolist()
        chosen = {}
        for row, i in enumerate(live):
            seq = wave[i]
            try:
                chosen[i] = greedy[row] if seq.temperature == 0.0 else sample_token(logits[i], seq.temperature, seq.top_p, generators[i])
            except RuntimeError as exc:  # e.g. "probability tensor contains either inf, nan or element < 0"
                log.warning("sampling one sequence failed: %s", exc)
                self._fail(seq, exc)
        return chosen

    def _seed(self, seq: Sequence) -> int:
        return random.SystemRandom().getrandbits(63) if seq.seed is None else seq.seed % 2**64

    def _record_prompt(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Log-probs of prompt tokens 1..L-1 given their prefixes; token 0 has none (``None``)."""
        logp = F.log_softmax(logits[:-1].float(), dim=-1)
        targets = torch.tensor(seq.prompt[1:], dtype=torch.long, device=logp.device)
        seq.prompt_lps = [None, *logp.gather(-1, targets[:, None]).squeeze(-1).tolist()]
        seq.prompt_tops = [None, *(top_list(row, seq.top_n) for row in logp)]

    def _step(self, seq: Sequence, state: "_TextState", token: int, logprob: float, top: TopList) -> None:
        """Record ``token``; finish on EOS, a stop string or ``max_tokens``, else report what is safe to show."""
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.tops.append(top)
        at_limit = len(seq.tokens) >= seq.max_tokens
        if token == self.eos_id:
            self._finish(seq, state, "stop")
        elif not seq.stream and not seq.stop:  # nothing to look at in the text before the end
            if at_limit:
                self._finish(seq, state, "length")
        elif hit := first_stop(text := self.decode(seq.tokens), seq.stop):
            at, stop = hit
            self._finish(seq, state, "stop", text[: at + len(stop)] if seq.include_stop else text[:at], strip=not seq.include_stop)
        elif at_limit:
            self._finish(seq, state, "length", text)
        elif (delta := state.advance(self, seq, safe_prefix(text, seq.stop))) is not None:
            seq.streamed_out = seq.streamed_out or seq.stream
            self._emit(seq, "step", delta)

    def _finish(self, seq: Sequence, state: "_TextState", reason: str, text: str | None = None, *, strip: bool = False) -> None:
        seq.text = self.decode(seq.tokens) if text is None else text
        if strip:  # keep the shortest token prefix whose text still covers the kept text
            keep = len(seq.tokens)
            while keep > 0 and len(self.decode(seq.tokens[: keep - 1])) >= len(seq.text):
                keep -= 1
            del seq.tokens[keep:], seq.logprobs[keep:], seq.tops[keep:]
        delta = state.advance(self, seq, seq.text, final=True)
        seq.finish_reason = reason
        self._emit(seq, "done", delta)


class _TextState:
    """What of a sequence has been reported so far, for streaming: text and the tokens it covers."""

    def __init__(self) -> None:
        self.text = ""
        self.tokens = 0

    def advance(self, engine: Engine, seq: Sequence, visible: str, *, final: bool = False) -> Delta | None:
        """Report text up to ``visible`` and the tokens whose text it covers (all of them when ``final``)."""
        if not visible.startswith(self.text):  # a detokeniser that rewrote earlier text: wait for the end
            if not final:
                return None
            log.warning("streamed text is not a prefix of the final text; the stream differs from the response")
            visible = self.text + visible[len(self.text) :]
        end = self.tokens
        if final:
            end = len(seq.tokens)
        else:
            while end < len(seq.tokens) and len(engine.decode(seq.tokens[: end + 1])) <= len(visible):
                end += 1
        if visible == self.text and end == self.tokens and not final:
            return None
        new = slice(self.tokens, end)
        delta = Delta(visible[len(self.text) :], seq.tokens[new], seq.logprobs[new], seq.tops[new])
        self.text, self.tokens = visible, end
        return delta
