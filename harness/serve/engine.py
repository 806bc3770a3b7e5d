"""The batching engine behind ``harness serve``: one decode loop over an HF causal LM, shared by requests.

Requests are split into sequences (one per prompt × sample). A worker thread keeps a running batch
of sequences, each with its own rows of the KV cache, and advances it one forward pass per token.
Continuous batching: before every decode step it admits waiting sequences (up to ``max_batch``
and ``max_batch_tokens``): they are prefilled together and their cache rows are merged into the
running batch's (left-padded to a common length), so a request that arrives while long ones decode
joins at the next step and a short one finishes first. A finished or cancelled sequence leaves the
batch at once. Sequences report each step to their request, so streaming is truly incremental.
The decode loop only draws tokens and ends rows at EOS or ``max_tokens``; the text work (appending tokens,
detokenising, stop strings, reporting) is handed over once per step, to a second thread (``TextThread``, beside
the next forward pass; the default on an accelerator) or run in the loop (``InlineText``, the default on a CPU).
A stop string found in the thread ends its sequence, and the loop drops the row at its next step: the tokens
drawn in between are never shown or returned.
The cache's layers are ``SlotLayer``s (buffers with spare rows and columns), so a step writes one column
in place, a leaver's place is refilled by the last row and joiners go into spare rows; nothing copies
the whole cache per step or per arrival.

Every sequence samples with its own ``torch.Generator`` seeded from its request's seed, so a
request's tokens do not depend on what it was batched with (up to float rounding of batched matmuls,
which only matters at exact ties); rows that share temperature and top-p are drawn in one batched
``draw_rows``. Log-probs are those of the untempered model distribution, as the
HF backend computes them; prompt log-probs come from the same prefill. Text is detokenised
incrementally (``Detokenizer``: a few tokens' decode per step, through the Rust tokenizer directly where
that decodes as the HF wrapper does), only for sequences that stream or have stop strings.
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from opd_harness.backends.hf import fast_decoder
from opd_harness.backends.sampling import draw_rows

log = logging.getLogger("opd_harness.serve")

TopList = list[tuple[int, float]]  # (token id, log-prob), most likely first


@dataclass
class Sequence:
    """One prompt × sample to decode, plus what decoding produced (filled in by the engine)."""

    prompt: list[int]
    max_tokens: int  # 0: score the prompt only
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # sample from the k most likely tokens only (0: off; vLLM's top_k, -1 also off)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop: bool = False  # keep a matched stop string in the text (vLLM's include_stop_str_in_output)
    min_tokens: int = 0  # no EOS and no stop string before this many tokens (vLLM's min_tokens)
    ignore_eos: bool = False  # EOS does not end the sequence (vLLM's ignore_eos)
    top_n: int = 0  # alternatives per position
    prompt_logprobs: bool = False
    stream: bool = False  # report text as it is decoded (otherwise only stop strings need the text before the end)
    on_event: Callable[["Sequence", str, "Delta | None"], None] | None = None  # from the engine (text) thread: "step", "done", "error"
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
    retried: bool = False  # decoded again after its batch failed: a second failure is its own
    released: bool = False  # no longer counted in the engine's load

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def over(self) -> bool:
        """Finished, failed or cancelled: nothing more to decode."""
        return self.done or self.cancelled

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

    waves: int = 0  # prefills: groups of sequences admitted together into the running batch
    sequences: int = 0
    max_wave: int = 0  # most sequences decoding at once
    forward_passes: int = 0


def top_list(logp: torch.Tensor, n: int) -> TopList:
    """The ``n`` most likely (id, log-prob) pairs of one position, most likely first."""
    if n <= 0:
        return []
    values, ids = logp.topk(min(n, logp.shape[-1]))
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def first_stop(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` beginning at or after ``start``, as (index, stop), or None."""
    found = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
    return min(found, key=lambda f: f[0]) if found else None


def safe_prefix(text: str, stops: tuple[str, ...]) -> str:
    """The part of ``text`` that can be shown now: without a tail that may still grow into a stop string
    (its longest stop minus one character) or an incomplete UTF-8 sequence."""
    safe = len(text) - (max((len(s) for s in stops), default=1) - 1)
    while safe > 0 and text[safe - 1] == "\ufffd":
        safe -= 1
    return text[: max(safe, 0)]


class Detokenizer:
    """The text of a growing token list, one token at a time, at a cost independent of its length.

    The prefix-offset technique (vLLM's, and ``tokenizers``' ``DecodeStream``): decode only the tokens
    since the last emitted text plus the few before them (for context such as leading spaces), and emit
    the new characters once they no longer end in an incomplete UTF-8 sequence. A run of more than
    ``MAX_PENDING`` tokens that stays incomplete is invalid UTF-8 and is emitted as the tokenizer decodes it.
    """

    MAX_PENDING = 8  # a character is at most 4 bytes: byte-level tokens this long that stay incomplete never complete

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self.prefix = 0  # tokens[prefix:read] were decoded before: their text is context, already emitted
        self.read = 0  # tokens[:read] have all their text emitted
        self.text = ""
        self.ends: list[int] = []  # len(text) once each token's text was complete

    def add(self, token: int) -> str:
        """Append ``token``; the text it completes ("" while a character is incomplete)."""
        self.tokens.append(token)
        before = self.decode(self.tokens[self.prefix : self.read])
        after = self.decode(self.tokens[self.prefix :])
        new = ""
        complete = not after.endswith("\ufffd") or len(self.tokens) - self.read > self.MAX_PENDING
        if complete and len(after) > len(before) and after.startswith(before):
            new = after[len(before) :]
            self.text += new
            self.prefix, self.read = self.read, len(self.tokens)
        elif complete and not after.startswith(before):  # the context's own text changed: re-anchor here
            self.prefix = self.read = len(self.tokens)
        self.ends.append(len(self.text))
        if new:  # the tokens of a character that was incomplete end where it ends
            self.ends[self.prefix :] = [len(self.text)] * (len(self.ends) - self.prefix)
        return new

    def tokens_covering(self, length: int) -> int:
        """The fewest leading tokens whose text covers ``length`` characters of ``text``."""
        if length <= 0:
            return 0
        first = bisect.bisect_left(self.ends, length)  # the token completing that character, or the first of its bytes
        return bisect.bisect_right(self.ends, self.ends[first]) if first < len(self.ends) else len(self.ends)


def run_text_work(work: list[tuple[Callable, tuple]]) -> None:
    """Run text work (``(function, args)`` pairs) in order; one that fails is logged and the rest still run."""
    for function, args in work:
        try:
            function(*args)
        except Exception:  # noqa: BLE001 - one sequence's text must not stop the others'
            log.exception("text work for a sequence failed")


class InlineText:
    """The engine's text work in its decode loop: each step's work runs as it is handed over."""

    def post(self, work: list[tuple[Callable, tuple]]) -> None:
        run_text_work(work)

    def drain(self) -> None:
        """Nothing waits: all the work ran when it was posted."""

    def stop(self) -> None:
        """Nothing to stop."""

    def join(self, timeout_s: float) -> None:
        """Nothing to wait for."""


class TextThread:
    """The engine's text work off its decode loop: a thread that runs, in order, the work the loop hands over (each
    decode step's tokens in one message). The loop only draws tokens; appending them to their sequences,
    detokenising, matching stop strings and reporting to the requests happen here, beside the next forward pass."""

    def __init__(self, name: str = "harness-serve-text") -> None:
        self._work: queue.Queue[list[tuple[Callable, tuple]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, work: list[tuple[Callable, tuple]]) -> None:
        """Queue ``work`` (``(function, args)`` pairs), run after everything posted before it."""
        if work:
            self._work.put(work)

    def drain(self) -> None:
        """Wait until everything posted so far has run."""
        self._work.join()

    def stop(self) -> None:
        """End the thread once everything posted so far has run."""
        self._work.put(None)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (work := self._work.get()) is not None:
            try:
                run_text_work(work)
            finally:
                self._work.task_done()
        self._work.task_done()


class Overloaded(Exception):
    """``submit`` refused: the sequences would take the engine's load past the caller's limit."""


@dataclass
class _Row:
    """A sequence in the running batch: its sampler, its text state (the text thread's) and what the decode loop
    knows of it (tokens drawn, and why it ends when that needs no text: EOS, ``max_tokens``, a failure)."""

    seq: Sequence
    generator: torch.Generator
    detok: Detokenizer | None  # None: nothing looks at the text before the end
    shown: "_TextState"
    drawn: int = 0
    ending: str | None = None  # "stop" (EOS), "length", "error": the row leaves at this step

    @property
    def live(self) -> bool:
        """Still decoding: no ending drawn here, and not finished (a stop string), failed or cancelled elsewhere."""
        return self.ending is None and not self.seq.over


@dataclass
class _Batch:
    """The running batch: rows, their KV cache (left-padded to one length), attention mask, last positions and
    next-token logits."""

    rows: list[_Row] = field(default_factory=list)
    cache: object = None
    attn: torch.Tensor | None = None  # (rows, cached length)
    positions: torch.Tensor | None = None  # (rows, 1): position of each row's last token
    logits: torch.Tensor | None = None  # (rows, vocab)

    def keep(self, index: list[int]) -> None:
        """Keep only rows ``index`` (in an order of ``fill_holes``: rows from the end move into the places of rows that
        left, so the cache moves a row per leaver rather than all of them), dropping cache columns that are padding in
        every row left."""
        order = fill_holes(len(self.rows), index)
        self.rows = [self.rows[i] for i in order]
        if not self.rows:
            self.cache = self.attn = self.positions = self.logits = None
            return
        at = torch.tensor(order, device=self.attn.device)
        self.attn, self.positions, self.logits = self.attn[at], self.positions[at], self.logits[at]
        first = int(self.attn.any(0).nonzero()[0])  # every row has a real token
        self.attn = self.attn[:, first:]
        for layer in cache_layers(self.cache):
            if isinstance(layer, SlotLayer):
                layer.move_rows(order, first)
            else:
                layer.keys, layer.values = layer.keys[at, :, first:], layer.values[at, :, first:]

    def join(self, other: "_Batch") -> None:
        """Append ``other``'s rows, left-padding the shorter cache with masked zeros."""
        if not self.rows:
            self.rows, self.cache, self.attn = other.rows, other.cache, other.attn
            self.positions, self.logits = other.positions, other.logits
            return
        width = max(self.attn.shape[1], other.attn.shape[1])
        self.attn = torch.cat([left_pad(self.attn, width), left_pad(other.attn, width)])
        for mine, theirs in zip(cache_layers(self.cache), cache_layers(other.cache), strict=True):
            if isinstance(mine, SlotLayer):
                mine.add_rows(theirs.keys, theirs.values)
            else:
                mine.keys = torch.cat([left_pad(mine.keys, width, dim=2), left_pad(theirs.keys, width, dim=2)])
                mine.values = torch.cat([left_pad(mine.values, width, dim=2), left_pad(theirs.values, width, dim=2)])
        self.positions = torch.cat([self.positions, other.positions])
        self.logits = torch.cat([self.logits, other.logits])
        self.rows = self.rows + other.rows


def fill_holes(size: int, index: list[int]) -> list[int]:
    """An arrangement of the rows ``index`` (ascending, of ``size`` rows) as the source row of each new place: rows
    below ``len(index)`` stay where they are, and the kept rows beyond it fill the places of those that left."""
    count, kept = len(index), set(index)
    holes = [i for i in range(count) if i not in kept]
    movers = [i for i in index if i >= count]
    order = list(range(count))
    for hole, mover in zip(holes, movers, strict=True):
        order[hole] = mover
    return order


class SlotLayer(DynamicLayer):
    """A ``DynamicLayer`` that keeps its keys and values in buffers with spare rows and columns, as views
    ``buffer[:rows, :, start:end]``: a decode step writes its column in place (``DynamicLayer`` copies the whole cache
    into a new tensor each step), a row leaving moves one other row into its place, and rows joining are written into
    spare rows. Only a full buffer is copied into a new one, twice the size (so the copies are amortised)."""

    buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    rows = start = end = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self._owns_views() or key_states.shape[0] != self.rows:
            self._reallocate([self.keys] if self.keys.numel() else [], [self.values] if self.values.numel() else [], key_states)
        new = key_states.shape[2]
        if self.end + new > self.buffers[0].shape[2]:
            self._reallocate([self.keys], [self.values], key_states, extra=new)
        for buffer, states in zip(self.buffers, (key_states, value_states), strict=True):
            buffer[: self.rows, :, self.end : self.end + new] = states
        self.end += new
        self._set_views()
        return self.keys, self.values

    def move_rows(self, order: list[int], first: int) -> None:
        """Keep rows ``order`` (``order[i]``: the row that goes to place ``i``) and drop the first ``first`` columns."""
        if not self._owns_views():
            self.keys, self.values = self.keys[order, :, first:], self.values[order, :, first:]
            return
        for place, row in enumerate(order):
            if place != row:
                for buffer in self.buffers:
                    buffer[place, :, self.start : self.end] = buffer[row, :, self.start : self.end]
        self.rows, self.start = len(order), self.start + first
        self._set_views()

    def add_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append rows ``keys`` / ``values`` (b, h, length, d), right-aligned; the shorter side is left-padded with zeros."""
        width = max(self.end - self.start, keys.shape[2]) if self._owns_views() else 0
        fits = width and self.rows + keys.shape[0] <= self.buffers[0].shape[0] and self.end - width >= 0
        if not fits:
            self._reallocate([self.keys, keys], [self.values, values], keys)
            self._set_views()
            return
        start = self.end - width
        for buffer, states in zip(self.buffers, (keys, values), strict=True):
            buffer[: self.rows, :, start : self.start] = 0  # masked padding: finite, so masked attention scores stay finite
            added = buffer[self.rows : self.rows + states.shape[0]]
            added[:, :, start : self.end - states.shape[2]] = 0
            added[:, :, self.end - states.shape[2] : self.end] = states
        self.rows, self.start = self.rows + keys.shape[0], start
        self._set_views()

    def _owns_views(self) -> bool:
        """Whether ``keys`` / ``values`` are still this layer's views (not replaced from outside)."""
        return self.buffers is not None and self.keys is self._views[0] and self.values is self._views[1]

    def _set_views(self) -> None:
        self.keys, self.values = (buffer[: self.rows, :, self.start : self.end] for buffer in self.buffers)
        self._views = (self.keys, self.values)

    def _reallocate(self, keys: list[torch.Tensor], values: list[torch.Tensor], like: torch.Tensor, extra: int = 0) -> None:
        """New buffers holding ``keys`` / ``values`` (parts of rows) stacked by row, right-aligned, left-padded with zeros,
        with twice the rows and columns needed (``extra`` columns more to be written next)."""
        rows = sum(part.shape[0] for part in keys) or like.shape[0]
        width = max((part.shape[2] for part in keys), default=0)
        shape = (max(2 * rows, 8), like.shape[1], max(2 * (width + extra), 64), like.shape[3])
        self.buffers = (like.new_empty(shape), like.new_empty(shape))
        for buffer, parts in zip(self.buffers, (keys, values), strict=True):
            row = 0
            for part in parts:
                buffer[row : row + part.shape[0], :, : width - part.shape[2]] = 0  # masked padding (see add_rows)
                buffer[row : row + part.shape[0], :, width - part.shape[2] : width] = part
                row += part.shape[0]
        self.rows, self.start, self.end = rows, 0, width
        self.is_initialized, self.device = True, like.device
        self._set_views()


def with_slots(cache):
    """``cache`` with each plain ``DynamicLayer`` (not sliding-window or other kinds) a :class:`SlotLayer` holding the
    same keys and values."""
    for index, layer in enumerate(cache_layers(cache)):
        if type(layer) is DynamicLayer and layer.is_initialized:
            slot = SlotLayer()
            slot.lazy_initialization(layer.keys, layer.values)
            slot._reallocate([layer.keys], [layer.values], layer.keys)
            cache.layers[index] = slot
    return cache


def cache_layers(cache) -> list:
    """The layers of a transformers ``DynamicCache`` (each with ``keys`` and ``values``, batch first)."""
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(layer, "keys") for layer in layers):
        raise TypeError(f"continuous batching needs a transformers DynamicCache with per-layer keys/values, got {type(cache).__name__}")
    return layers


def left_pad(tensor: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """``tensor`` with zeros prepended along ``dim`` up to ``width``."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class Engine:
    """Decodes a running batch of sequences in one worker thread; ``submit`` and ``cancel`` are safe from any thread.

    A prefill that fails for a group of newcomers is done again one sequence at a time, so only the
    sequences that fail alone get the error; a decode step that fails puts the batch's sequences not
    streamed yet back in the queue (once), to be decoded again; a sequence whose sampling fails (e.g. a
    temperature that overflows its logits) fails alone without stopping the rest of its batch.

    ``text_thread``: the text work in its own thread (True) or in the decode loop (False); by default in a thread on an
    accelerator, where the loop waits for the device outside the GIL, and in the loop on a CPU, where the forward pass
    holds the GIL for most of a step and a second Python thread only takes turns with it (measured: 0.84-0.93x the
    tokens/s at 64-192 clients, README).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        device: str,
        max_batch: int = 64,
        max_batch_tokens: int | None = None,
        batch_wait_s: float = 0.002,
        text_thread: bool | None = None,
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
        self.text_thread = torch.device(device).type != "cpu" if text_thread is None else text_thread
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.stats = EngineStats()
        self.tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to share across threads
        self._queue: queue.Queue[Sequence | None] = queue.Queue()
        self._load = 0  # sequences submitted and not yet finished, failed or cancelled
        self._load_lock = threading.Lock()
        self._closed = False
        self._held: list[Sequence] = []  # taken from the queue (or put back) ahead of it: decoded first
        self._worker: threading.Thread | None = None
        self._text: TextThread | InlineText | None = None  # made by the decode loop, stopped when it ends
        self._start_lock = threading.Lock()
        self._fast_decode = fast_decoder(tokenizer)
        accepted = inspect.signature(model.forward).parameters
        self._keep_logits = "logits_to_keep" in accepted
        self._cache_arg = "cache" if "cache" in accepted else "past_key_values"  # transformers 5 renamed it

    # -- tokenizer access (any thread)

    def encode(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, tokens: list[int], *, skip_special: bool = True) -> str:
        with self.tokenizer_lock:
            if self._fast_decode is not None:
                return self._fast_decode(tokens, skip_special_tokens=skip_special)
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
        """Stop ``sequences``: queued ones are skipped, decoding ones leave the batch at its next step."""
        for seq in sequences:
            seq.cancelled = True
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        with self._load_lock:
            if not seq.released:
                seq.released = True
                self._load -= 1

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the worker: the batch in progress fails at its next step, queued sequences are dropped; then the text
        thread, once it has reported all that."""
        self._closed = True
        self._queue.put(None)
        if self._worker is not None:
            deadline = time.monotonic() + timeout_s
            self._worker.join(timeout_s)
            if self._text is not None:
                self._text.join(max(0.0, deadline - time.monotonic()))

    # -- admission

    def _next(self, block: bool, timeout_s: float | None = None) -> Sequence | None:
        """The next waiting sequence (held ones first); None when there is none (or ``close`` woke the worker)."""
        if self._held:
            return self._held.pop(0)
        try:
            return self._queue.get(block=block, timeout=timeout_s)
        except queue.Empty:
            return None

    def _fits(self, batch: list[Sequence]) -> bool:
        """Whether ``batch`` stays within ``max_batch_tokens`` padded positions (sequences × longest prompt + max_tokens)."""
        limit = self.max_batch_tokens
        return limit is None or len(batch) * max(len(s.prompt) + s.max_tokens for s in batch) <= limit

    def _admit(self, running: list[Sequence]) -> list[Sequence]:
        """Sequences to join ``running``: with nothing running, block for one and take what arrives within
        ``batch_wait_s``; otherwise take only what waits now. Up to ``max_batch`` and ``max_batch_tokens`` in all."""
        group: list[Sequence] = []
        if any(s.retried for s in running):
            return group
        deadline = time.monotonic() + self.batch_wait_s
        while len(running) + len(group) < self.max_batch and not self._closed:
            if not running and not group:
                seq = self._next(block=True)
            else:
                wait = max(0.0, deadline - time.monotonic()) if not running else 0.0
                seq = self._next(block=wait > 0, timeout_s=wait) if wait > 0 else self._next(block=False)
            if seq is None:
                break
            if seq.cancelled:
                self._release(seq)
                continue
            if (running or group) and (seq.retried or not self._fits([*running, *group, seq])):
                self._held.insert(0, seq)
                break
            group.append(seq)
            if seq.retried:  # decoded again after its batch failed: alone
                break
        return group

    # -- the loop

    def _loop(self) -> None:
        self._text = TextThread() if self.text_thread else InlineText()
        batch = _Batch()
        try:
            while not self._closed:
                group = self._admit([r.seq for r in batch.rows])
                if group:
                    self._prefill_into(batch, group)
                if batch.rows and not self._closed:
                    self._advance(batch)
        finally:
            for row in batch.rows:
                if row.live:
                    self._fail(row.seq, RuntimeError("the server is shutting down"))
                self._release(row.seq)
            self._text.stop()

    def _prefill_into(self, batch: _Batch, group: list[Sequence]) -> None:
        """Prefill ``group`` and join it to ``batch``; a failing group is prefilled again one sequence at a time."""
        try:
            joined = self._prefill(group)
        except Exception as exc:  # noqa: BLE001 - reported to the sequences it concerns
            if self._closed:
                for seq in group:
                    self._fail(seq, RuntimeError("the server is shutting down"))
                    self._release(seq)
                return
            log.exception("prefilling %d sequences failed", len(group))
            if len(group) == 1:
                self._fail(group[0], exc)
                self._release(group[0])
                return
            for seq in group:
                seq.reset()
                self._prefill_into(batch, [seq])
            return
        batch.join(joined)
        self.stats.max_wave = max(self.stats.max_wave, len(batch.rows))

    def _forward(self, ids: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor, cache, all_logits: bool):
        self.stats.forward_passes += 1
        kwargs = {} if all_logits or not self._keep_logits else {"logits_to_keep": 1}
        kwargs[self._cache_arg] = cache
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True, **kwargs)
        return out.logits, getattr(out, self._cache_arg)

    @torch.no_grad()
    def _prefill(self, group: list[Sequence]) -> _Batch:
        """One left-padded forward pass over ``group``'s prompts: their cache rows and first next-token logits;
        prompt log-probs recorded where asked, sequences of ``max_tokens`` 0 finished."""
        self.stats.waves += 1
        self.stats.sequences += len(group)
        width = max(len(s.prompt) for s in group)
        ids = torch.full((len(group), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(group), width), dtype=torch.long)
        for i, s in enumerate(group):
            ids[i, width - len(s.prompt) :] = torch.tensor(s.prompt, dtype=torch.long)
            attn[i, width - len(s.prompt) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        with self._eval():
            logits, cache = self._forward(ids, attn, positions, None, any(s.prompt_logprobs for s in group))
        for i, s in enumerate(group):
            if s.prompt_logprobs:
                self._record_prompt(s, logits[i, width - len(s.prompt) :])
        rows = []
        for s in group:
            generator = torch.Generator(device=self.device).manual_seed(self._seed(s))
            detok = Detokenizer(lambda t: self.decode(t)) if s.stream or s.stop else None
            rows.append(_Row(s, generator, detok, _TextState()))
        scored_only = [row for row in rows if row.seq.max_tokens == 0]
        for row in scored_only:
            row.ending = "length"
        self._text.post([(self._end, (row, "length")) for row in scored_only])
        return _Batch(rows, with_slots(cache), attn, positions[:, -1:], logits[:, -1])

    @contextlib.contextmanager
    def _eval(self) -> Iterator[None]:
        """Run the model in eval mode, then put its training flag back."""
        was_training = self.model.training
        if not was_training:  # (toggling walks every module: a cost per decode step)
            yield
            return
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def _advance(self, batch: _Batch) -> None:
        """Choose each live row's next token, hand it to the text thread, drop the rows that are over, then one forward
        pass."""
        live = [i for i, r in enumerate(batch.rows) if r.live]
        chosen_by_row = self._choose(batch, live)
        live, tokens = list(chosen_by_row), list(chosen_by_row.values())
        if live:
            logp = F.log_softmax(batch.logits[live].float(), dim=-1)  # one device-to-host copy per step, not per row
            chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None]).squeeze(-1).tolist()
            k = min(max(batch.rows[i].seq.top_n for i in live), logp.shape[-1])
            top_values, top_ids = logp.topk(k) if k else (logp[:, :0], logp[:, :0].long())
            top_values, top_ids = top_values.tolist(), top_ids.tolist()
            work = []
            for at, i in enumerate(live):
                row = batch.rows[i]
                top = list(zip(top_ids[at], top_values[at], strict=True))[: row.seq.top_n]
                row.drawn += 1
                row.ending = self._ending(row, tokens[at])
                work.append((self._take, (row, tokens[at], chosen[at], top, row.ending)))
            self._text.post(work)
        token_of = {id(batch.rows[i]): token for i, token in zip(live, tokens, strict=True)}
        going = [i for i, r in enumerate(batch.rows) if r.live]
        if len(going) < len(batch.rows):  # (keeping every row would copy the whole cache for nothing)
            for r in batch.rows:
                if not r.live:
                    self._release(r.seq)
            batch.keep(going)
        if not batch.rows:
            return
        next_ids = torch.tensor([token_of[id(r)] for r in batch.rows], dtype=torch.long, device=self.device)[:, None]
        batch.attn = torch.cat([batch.attn, batch.attn.new_ones((len(going), 1))], dim=1)
        batch.positions = batch.positions + 1
        try:
            with self._eval():
                logits, batch.cache = self._forward(next_ids, batch.attn, batch.positions, batch.cache, False)
            batch.logits = logits[:, -1]
        except Exception as exc:  # noqa: BLE001 - reported to the sequences it concerns
            if not self._closed:
                log.exception("a decode step of %d sequences failed", len(batch.rows))
            self._text.drain()  # which sequences streamed (or ended at a stop string) is the text thread's to say
            for r in batch.rows:
                if r.seq.over:
                    self._release(r.seq)
                elif self._closed or r.seq.streamed_out or r.seq.retried or len(batch.rows) == 1:
                    self._fail(r.seq, RuntimeError("the server is shutting down") if self._closed else exc)
                    self._release(r.seq)
                else:
                    r.seq.reset()
                    r.seq.retried = True
                    self._held.append(r.seq)
            batch.keep([])

    def _choose(self, batch: _Batch, live: list[int]) -> dict[int, int]:
        """The next token of each live row, by batch index: greedy rows by one batched argmax, sampled rows that share
        temperature and top_p by one batched draw (each row from its own generator); EOS is masked for rows short of
        ``min_tokens``. A row whose probabilities cannot be sampled (e.g. a temperature that overflows) fails alone."""
        logits = batch.logits
        early = [i for i in live if batch.rows[i].drawn < batch.rows[i].seq.min_tokens]
        if early and self.eos_id is not None:
            logits = logits.clone()
            logits[early, self.eos_id] = float("-inf")
        groups: dict[tuple[float, float, int], list[int]] = {}
        for i in live:
            seq = batch.rows[i].seq
            greedy = seq.temperature == 0.0
            groups.setdefault((seq.temperature, 1.0 if greedy else seq.top_p, 0 if greedy else seq.top_k), []).append(i)
        chosen = {}
        for (temperature, top_p, top_k), rows in groups.items():
            at = torch.tensor(rows, device=logits.device)
            if temperature == 0.0:
                chosen.update(zip(rows, logits[at].argmax(-1).tolist(), strict=True))
                continue
            tokens, valid = draw_rows(logits[at], temperature, top_p, [batch.rows[i].generator for i in rows], top_k)
            for i, token, ok in zip(rows, tokens.tolist(), valid.tolist(), strict=True):
                if ok:
                    chosen[i] = token
                else:
                    log.warning("sampling one sequence failed: its probabilities contain inf, nan or an element < 0")
                    batch.rows[i].ending = "error"
                    self._fail(batch.rows[i].seq, RuntimeError("probability tensor contains either inf, nan or element < 0"))
        return dict(sorted(chosen.items()))

    def _seed(self, seq: Sequence) -> int:
        return random.SystemRandom().getrandbits(63) if seq.seed is None else seq.seed % 2**64

    def _record_prompt(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Log-probs of prompt tokens 1..L-1 given their prefixes; token 0 has none (``None``)."""
        logp = F.log_softmax(logits[:-1].float(), dim=-1)
        targets = torch.tensor(seq.prompt[1:], dtype=torch.long, device=logp.device)
        seq.prompt_lps = [None, *logp.gather(-1, targets[:, None]).squeeze(-1).tolist()]
        seq.prompt_tops = [None, *(top_list(row, seq.top_n) for row in logp)]

    def _ending(self, row: _Row, token: int) -> str | None:
        """Why ``row`` ends with ``token``, where that needs no text: EOS (``stop``; masked before ``min_tokens``), or
        ``max_tokens`` reached (``length``)."""
        if token == self.eos_id and not row.seq.ignore_eos:
            return "stop"
        return "length" if row.drawn >= row.seq.max_tokens else None

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """Fail ``seq``, reported by the text thread after the work posted before it (unless that finished it)."""
        self._text.post([(self._report_failure, (seq, exc))])

    def _report_failure(self, seq: Sequence, exc: BaseException) -> None:
        if seq.finish_reason is None:
            seq.error = exc
            self._emit(seq, "error")

    def _emit(self, seq: Sequence, kind: str, delta: Delta | None = None) -> None:
        if seq.on_event is not None:
            try:
                seq.on_event(seq, kind, delta)
            except Exception:  # noqa: BLE001 - a callback must not take the engine down
                log.exception("a request callback failed")

    def _take(self, row: _Row, token: int, logprob: float, top: TopList, ending: str | None) -> None:
        """(Text thread.) Record ``token``; finish on ``ending`` (the decode loop's: EOS or ``max_tokens``) or a stop
        string, else report what is safe to show. A sequence already over takes no more tokens: those the loop drew
        after its stop string, before it dropped the row, are not its."""
        seq, detok = row.seq, row.detok
        if seq.over:
            return
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.tops.append(top)
        if ending == "stop":
            self._finish(row, "stop")
            return
        if detok is None:  # nothing to look at in the text before the end
            if ending is not None:
                self._finish(row, ending)
            return
        before = len(detok.text)
        detok.add(token)
        text = detok.text
        longest = max((len(s) for s in seq.stop), default=0)
        hit = first_stop(text, seq.stop, max(0, before - longest + 1)) if seq.stop and len(seq.tokens) >= seq.min_tokens else None
        if hit:
            at, stop = hit
            self._finish(row, "stop", text[: at + len(stop)] if seq.include_stop else text[:at], strip=not seq.include_stop)
        elif ending is not None:
            self._finish(row, ending)
        elif (delta := row.shown.advance(seq, detok, safe_prefix(text, seq.stop))) is not None:
            seq.streamed_out = seq.streamed_out or seq.stream
            self._emit(seq, "step", delta)

    def _end(self, row: _Row, reason: str) -> None:
        """(Text thread.) End ``row``'s sequence with the tokens it has (a prompt scored with ``max_tokens`` 0)."""
        if not row.seq.over:
            self._finish(row, reason)

    def _finish(self, row: _Row, reason: str, text: str | None = None, *, strip: bool = False) -> None:
        """(Text thread.) End ``row``'s sequence: its text is ``text`` (a stop-string cut) or the full decode of its
        tokens (once)."""
        seq = row.seq
        seq.text = self.decode(seq.tokens) if text is None else text
        if strip:  # keep the shortest token prefix whose text still covers the kept text
            keep = row.detok.tokens_covering(len(seq.text))
            del seq.tokens[keep:], seq.logprobs[keep:], seq.tops[keep:]
        delta = row.shown.advance(seq, row.detok, seq.text, final=True)
        seq.finish_reason = reason
        self._emit(seq, "done", delta)


class _TextState:
    """What of a sequence has been reported so far, for streaming: text and the tokens it covers."""

    def __init__(self) -> None:
        self.text = ""
        self.tokens = 0

    def advance(self, seq: Sequence, detok: Detokenizer | None, visible: str, *, final: bool = False) -> Delta | None:
        """Report text up to ``visible`` and the tokens whose text it covers (all of them when ``final``)."""
        if not visible.startswith(self.text):  # a detokeniser that rewrote earlier text: wait for the end
            if not final:
                return None
            log.warning("streamed text is not a prefix of the final text; the stream differs from the response")
            visible = self.text + visible[len(self.text) :]
        end = self.tokens
        if final or detok is None:
            end = len(seq.tokens)
        else:
            while end < detok.read and detok.ends[end] <= len(visible):  # tokens past ``read`` are incomplete characters
                end += 1
        if visible == self.text and end == self.tokens and not final:
            return None
        new = slice(self.tokens, end)
        delta = Delta(visible[len(self.text) :], seq.tokens[new], seq.logprobs[new], seq.tops[new])
        self.text, self.tokens = visible, end
        return delta
