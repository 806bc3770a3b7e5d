"""``harness serve``'s engine before and after continuous batching and incremental detokenisation, side by side in one run.

Two measurements, each warmed up on both sides (untimed) and then run ``--rounds`` times in alternating order:
  - **decode work**: the engine thread's per-token text work for one streamed sequence with a stop string that never
    matches, at 1k / 2k / 4k tokens: each side's per-token text step (old ``_step``, new ``_take``, which runs in the
    engine's text thread) fed the same token stream (no model), so only the
    detokenisation (stop-string search, stream deltas) is timed. Reported as µs per token and the old / new ratio;
    linear work keeps the per-token figure flat as the length grows.
  - **staggered clients**: ``--clients`` streamed requests of ``--tokens`` tokens each (EOS masked in the model, so
    every one runs to its length), arriving ``--gap-ms`` apart, through each engine on a tiny Qwen3 model:
    generated tokens per second over the whole run, and the median time to first token.

The old engine is ``benchmarks/serve_engine_before.py``, a copy of ``harness/serve/engine.py`` before the change.

Usage: ``PYTHONPATH=. python benchmarks/serve_engine.py [--rounds 2] [--clients 64] [--tokens 256] [--gap-ms 10] [--threads 1]``
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers.cache_utils import DynamicLayer

from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model
from opd_harness.serve import engine as new

sys.path.insert(0, str(Path(__file__).parent))
import serve_engine_before as old  # noqa: E402

NEVER = ("\x00never",)


class NoEos(torch.nn.Module):
    """The model, never emitting ``eos_id``: every client runs to its ``max_tokens`` on both engines."""

    def __init__(self, inner: torch.nn.Module, eos_id: int) -> None:
        super().__init__()
        self.inner, self.eos_id, self.config = inner, eos_id, inner.config

    def forward(self, cache=None, **kwargs):
        out = self.inner(cache=cache, **kwargs)
        out.logits[..., self.eos_id] = float("-inf")
        return out


def token_stream(tokenizer, length: int, seed: int = 0) -> list[int]:
    """``length`` random printable-character token ids (no specials)."""
    rng = random.Random(seed)
    ids = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    return [rng.choice(ids) for _ in range(length)]


def decode_work_old(tokenizer, tokens: list[int]) -> float:
    """Seconds of the old engine's per-token text work for one streamed sequence."""
    engine = old.Engine.__new__(old.Engine)
    engine.tokenizer, engine.tokenizer_lock, engine.eos_id = tokenizer, threading.Lock(), tokenizer.eos_token_id
    seq = old.Sequence(prompt=[0], max_tokens=len(tokens) + 1, stop=NEVER, stream=True)
    state = old._TextState()
    start = time.perf_counter()
    for token in tokens:
        engine._step(seq, state, token, 0.0, [])
    return time.perf_counter() - start


def decode_work_new(tokenizer, tokens: list[int]) -> float:
    """Seconds of the new engine's per-token text work (its text thread's) for one streamed sequence."""
    engine = new.Engine.__new__(new.Engine)
    engine.tokenizer, engine.tokenizer_lock, engine.eos_id = tokenizer, threading.Lock(), tokenizer.eos_token_id
    engine._fast_decode = new.fast_decoder(tokenizer)
    seq = new.Sequence(prompt=[0], max_tokens=len(tokens) + 1, stop=NEVER, stream=True)
    row = new._Row(seq, torch.Generator(), new.Detokenizer(lambda t: engine.decode(t)), new._TextState())
    start = time.perf_counter()
    for token in tokens:
        engine._take(row, token, 0.0, [], None)
    return time.perf_counter() - start


def staggered(
    module, model, tokenizer, *, lengths: list[int], gap_s: float, max_batch: int, device: str = "cpu", **options
) -> tuple[float, float]:
    """(generated tokens per second, median seconds to first token) for one streamed request per entry of ``lengths``
    (its ``max_tokens``), sent ``gap_s`` apart; ``options`` go to the engine."""
    engine = module.Engine(model, tokenizer, device=device, max_batch=max_batch, batch_wait_s=0.002, **options)
    first_at: dict[int, float] = {}
    sent_at: dict[int, float] = {}
    done = threading.Semaphore(0)

    def on_event(seq, kind: str, delta) -> None:
        if kind in ("step", "done") and id(seq) not in first_at:
            first_at[id(seq)] = time.perf_counter()
        if kind in ("done", "error"):
            done.release()

    seqs = [module.Sequence(prompt=[5 + i % 50, 6], max_tokens=n, temperature=1.0, seed=i, stream=True) for i, n in enumerate(lengths)]
    start = time.perf_counter()
    try:
        for i, seq in enumerate(seqs):
            seq.on_event = on_event
            delay = start + i * gap_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            sent_at[id(seq)] = time.perf_counter()
            engine.submit([seq])
        for _ in seqs:
            done.acquire()
        elapsed = time.perf_counter() - start
    finally:
        engine.close()
    assert all(len(s.tokens) == n for s, n in zip(seqs, lengths, strict=True)), "a client stopped early"
    return sum(lengths) / elapsed, statistics.median(first_at[id(s)] - sent_at[id(s)] for s in seqs)


def mixed_lengths(clients: int, short: int, long: int, long_every: int, seed: int = 0) -> list[int]:
    """``clients`` output lengths: one in ``long_every`` is ``long``, the rest ``short``, in a seeded random order."""
    lengths = [long if i % long_every == 0 else short for i in range(clients)]
    random.Random(seed).shuffle(lengths)
    return lengths


class Clock:
    """Seconds spent in wrapped callables by name, counted while the number of decode forward passes so far is in
    ``window`` (``events`` for the per-event names); and every decode forward pass's (start, end). A forward pass
    without a cache is a prefill."""

    def __init__(self, window: range, events: range) -> None:
        self.window, self.events = window, events
        self.spent: dict[str, float] = {}
        self.forwards: list[tuple[float, float]] = []

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            counted = len(self.forwards) in (self.events if name in PER_EVENT or name == "forward" else self.window)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                if name == "forward" and args[3] is not None:  # _forward(ids, attn, positions, cache, all_logits)
                    self.forwards.append((start, end))
                elif counted:
                    key = "prefill" if name == "forward" else name
                    self.spent[key] = self.spent.get(key, 0.0) + end - start

        return timed


@contextlib.contextmanager
def patched(clock: Clock, targets: dict[str, tuple[object, str]]) -> Iterator[Clock]:
    """Wrap ``getattr(owner, attr)`` with ``clock`` under each name for the duration."""
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in targets.values()]
    try:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, clock.wrap(name, getattr(owner, attr)))
        yield clock
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


PER_EVENT = ("keep", "join", "prefill")  # once per row leaving / joining, not per step


def step_costs(module, model, tokenizer, *, batch: int, kv: int, window: int) -> dict[str, float]:
    """Milliseconds per decode step of ``batch`` streamed sequences over ``window`` steps from KV length ``kv``: the
    median step and forward pass, and per step on average the cache update inside the forward, sampling
    (``_choose``) and each row's bookkeeping and text (``text``: the old ``_step`` in the decode loop, the new ``_take``
    in the text thread, beside it). On the new engine a 2-token newcomer then arrives
    every 4 steps for ``window`` more steps, and its prefill, its ``join`` and its ``keep`` when it leaves are timed
    per event."""
    engine = module.Engine(model, tokenizer, device="cpu", max_batch=batch + 1, batch_wait_s=0.05)
    prompt_len = 2
    first = kv - prompt_len - 1  # decode forward j attends over prompt_len + j + 1 positions
    last = first + window
    seqs = [
        module.Sequence(prompt=[5 + i % 50, 6], max_tokens=last + window + 2, temperature=1.0, seed=i, stream=True) for i in range(batch)
    ]
    continuous = hasattr(module, "SlotLayer")
    arrive_at = range(last, last + window - 4, 4)
    arrivals = {j: module.Sequence(prompt=[7, 8], max_tokens=2, temperature=1.0, seed=j, stream=True) for j in arrive_at}
    newcomers = list(arrivals.values()) if continuous else []
    done = threading.Semaphore(0)
    clock = Clock(range(first, last), range(last, last + window))
    targets = {"forward": (engine, "_forward"), "sampling": (engine, "_choose"), "text": (engine, "_take" if continuous else "_step")}
    if continuous:
        targets |= {"cache update": (module.SlotLayer, "update"), "keep": (module._Batch, "keep"), "join": (module._Batch, "join")}
    else:
        targets["cache update"] = (DynamicLayer, "update")

    def on_event(seq, kind: str, delta) -> None:
        if kind in ("done", "error"):
            done.release()
        if continuous and seq is seqs[0] and (newcomer := arrivals.pop(len(clock.forwards), None)) is not None:
            newcomer.on_event = on_event
            engine.submit([newcomer])

    for seq in seqs:
        seq.on_event = on_event
    with patched(clock, targets):
        try:
            engine.submit(seqs)
            for _ in range(batch + len(newcomers)):
                done.acquire()
        finally:
            engine.close()
    ends = [end for _, end in clock.forwards]
    steps = [ends[j] - ends[j - 1] for j in range(first, last)]
    inside = [end - start for start, end in clock.forwards[first:last]]
    costs = {k: v * 1000 / (len(newcomers) if k in PER_EVENT else window) for k, v in clock.spent.items()}
    return {"step": statistics.median(steps) * 1000, "forward": statistics.median(inside) * 1000, **costs}


ENGINES = {"old": old, "new": new}


def alternated(rounds: int, sides: dict[str, object], measure) -> dict[str, list]:
    """``measure(side)`` of every side once per round, the sides' order reversed every other round: {name: results}."""
    results: dict[str, list] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name].append(measure(sides[name]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048, 4096], help="none: skip the decode-work rows")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a shared 2-core machine: 1)")
    parser.add_argument("--skip-clients", action="store_true")
    parser.add_argument("--text-thread", action="store_true", help="client rows: also the new engine with its text work in a thread")
    parser.add_argument("--mixed-clients", type=int, default=192, help="the mixed-length row's clients (0: skip it)")
    parser.add_argument("--mixed-gap-ms", type=float, default=2.0, help="the mixed row's arrival gap")
    parser.add_argument("--short", type=int, default=16, help="the mixed row's short output length (the long one is --tokens)")
    parser.add_argument("--long-every", type=int, default=8, help="the mixed row: one client in this many is long")
    parser.add_argument("--step-costs", action="store_true", help="also time a decode step of each engine and its parts")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64], help="--step-costs: batch sizes")
    parser.add_argument("--kv", type=int, default=128, help="--step-costs: KV length at the window's start")
    parser.add_argument("--window", type=int, default=32, help="--step-costs: decode steps timed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = build_char_tokenizer()

    if args.lengths:
        print("decode work per streamed sequence with a stop string (µs per token)")
        print(f"{'tokens':>7} {'old':>10} {'new':>10} {'old/new':>8}")
        decode_work_old(tokenizer, token_stream(tokenizer, 256)), decode_work_new(tokenizer, token_stream(tokenizer, 256))  # warm-up
    for length in args.lengths:
        stream = token_stream(tokenizer, length, seed=length)
        times = alternated(args.rounds, {"old": decode_work_old, "new": decode_work_new}, lambda work: work(tokenizer, stream))
        o, n = statistics.mean(times["old"]), statistics.mean(times["new"])
        per_token = f"{o / length * 1e6:>10.1f} {n / length * 1e6:>10.1f}"
        print(f"{length:>7} {per_token} {o / n:>8.1f}   (old {o:.2f} s, new {n:.3f} s per sequence)")

    if args.skip_clients and not args.step_costs:
        return
    arch = TinyArch(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, max_positions=1024)
    model = NoEos(build_tiny_model(arch, len(tokenizer), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, seed=0),
                  tokenizer.eos_token_id).eval()  # fmt: skip
    if args.step_costs:
        print_step_costs(model, tokenizer, batches=args.batches, kv=args.kv, window=args.window, rounds=args.rounds)
    if args.skip_clients:
        return
    rows = [(f"{args.clients} streamed clients, {args.tokens} tokens each", [args.tokens] * args.clients, args.gap_ms)]
    if args.mixed_clients:
        lengths = mixed_lengths(args.mixed_clients, args.short, args.tokens, args.long_every)
        title = f"{args.mixed_clients} streamed clients, 1 in {args.long_every} of {args.tokens} tokens, the rest {args.short}"
        rows.append((title, lengths, args.mixed_gap_ms))
    sides = {"old": (old, {}), "new": (new, {})} | ({"new, text thread": (new, {"text_thread": True})} if args.text_thread else {})
    for module, options in sides.values():  # warm-up
        staggered(module, model, tokenizer, lengths=[16] * 4, gap_s=args.gap_ms / 1000, max_batch=args.max_batch, **options)
    for title, lengths, gap_ms in rows:
        results = alternated(args.rounds, sides, lambda side: staggered(side[0], model, tokenizer, lengths=lengths,
                                                                         gap_s=gap_ms / 1000, max_batch=args.max_batch, **side[1]))
        print(f"\n{title}, {gap_ms:g} ms apart, max batch {args.max_batch} ({sum(lengths)} tokens)")
        rates = {k: statistics.mean(r[0] for r in v) for k, v in results.items()}
        ttft = {k: statistics.mean(r[1] for r in v) for k, v in results.items()}
        for name in sides:
            each = ", ".join(f"{r[0]:.0f}" for r in results[name])
            print(f"  {name}: {rates[name]:8.0f} tokens/s ({each}), median time to first token {ttft[name] * 1000:8.1f} ms")
        for name in list(sides)[1:]:
            print(f"  {name} / old tokens/s: {rates[name] / rates['old']:.2f}; old / {name} median TTFT: {ttft['old'] / ttft[name]:.1f}")


def print_step_costs(model, tokenizer, *, batches: list[int], kv: int, window: int, rounds: int) -> None:
    """The table of ``step_costs`` for both engines at each batch size, warmed up, sides alternated, means of ``rounds``."""
    for module in (old, new):  # warm-up
        step_costs(module, model, tokenizer, batch=4, kv=16, window=8)
    columns = ["step", "forward", "cache update", "sampling", "text", *PER_EVENT]
    print(f"\ndecode step costs at KV length {kv} (ms; mean of {rounds}; a step and its forward: median over {window} steps;")
    print(f"cache update, sampling, text: per step; {', '.join(PER_EVENT)}: per event, new engine only)")
    print(f"{'engine':>6} {'batch':>5} " + " ".join(f"{c:>12}" for c in columns) + f" {'step/row':>9}")
    for batch in batches:
        results = alternated(rounds, ENGINES, lambda module: step_costs(module, model, tokenizer, batch=batch, kv=kv, window=window))
        for name in ("old", "new"):
            mean = {c: statistics.mean(run.get(c, float("nan")) for run in results[name]) for c in columns}
            cells = " ".join(f"{mean[c]:>12.3f}" if mean[c] == mean[c] else f"{'-':>12}" for c in columns)
            print(f"{name:>6} {batch:>5} {cells} {mean['step'] / batch:>9.3f}")


if __name__ == "__main__":
    main()
