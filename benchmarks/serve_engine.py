"""``harness serve``'s engine before and after continuous batching and incremental detokenisation, side by side in one run.

Two measurements, each warmed up on both sides (untimed) and then run ``--rounds`` times in alternating order:
  - **decode work**: the engine thread's per-token text work for one streamed sequence with a stop string that never
    matches, at 1k / 2k / 4k tokens: each side's ``_step`` fed the same token stream (no model), so only the
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
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model
from harness.serve import engine as new

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
    """Seconds of the new engine's per-token text work for one streamed sequence."""
    engine = new.Engine.__new__(new.Engine)
    engine.tokenizer, engine.tokenizer_lock, engine.eos_id = tokenizer, threading.Lock(), tokenizer.eos_token_id
    seq = new.Sequence(prompt=[0], max_tokens=len(tokens) + 1, stop=NEVER, stream=True)
    row = new._Row(seq, torch.Generator(), new.Detokenizer(lambda t: engine.decode(t)), new._TextState())
    start = time.perf_counter()
    for token in tokens:
        engine._step(row, token, 0.0, [])
    return time.perf_counter() - start


def staggered(module, model, tokenizer, *, clients: int, tokens: int, gap_s: float, max_batch: int) -> tuple[float, float]:
    """(generated tokens per second, median seconds to first token) for ``clients`` streamed requests ``gap_s`` apart."""
    engine = module.Engine(model, tokenizer, device="cpu", max_batch=max_batch, batch_wait_s=0.002)
    first_at: dict[int, float] = {}
    sent_at: dict[int, float] = {}
    done = threading.Semaphore(0)

    def on_event(seq, kind: str, delta) -> None:
        if kind in ("step", "done") and id(seq) not in first_at:
            first_at[id(seq)] = time.perf_counter()
        if kind in ("done", "error"):
            done.release()

    seqs = [module.Sequence(prompt=[5 + i % 50, 6], max_tokens=tokens, temperature=1.0, seed=i, stream=True) for i in range(clients)]
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
    assert all(len(s.tokens) == tokens for s in seqs), "a client stopped early"
    return clients * tokens / elapsed, statistics.median(first_at[id(s)] - sent_at[id(s)] for s in seqs)


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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = build_char_tokenizer()

    if args.lengths:
        print("decode work per streamed sequence with a stop string (µs per token)")
        print(f"{'tokens':>7} {'old':>10} {'new':>10} {'old/new':>8}")
        decode_work_old(tokenizer, token_stream(tokenizer, 256)), decode_work_new(tokenizer, token_stream(tokenizer, 256))  # warm-up
    for length in args.lengths:
        stream = token_stream(tokenizer, length, seed=length)
        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            sides = [("old", decode_work_old), ("new", decode_work_new)]
            for name, work in sides if r % 2 == 0 else sides[::-1]:
                times[name].append(work(tokenizer, stream))
        o, n = statistics.mean(times["old"]), statistics.mean(times["new"])
        per_token = f"{o / length * 1e6:>10.1f} {n / length * 1e6:>10.1f}"
        print(f"{length:>7} {per_token} {o / n:>8.1f}   (old {o:.2f} s, new {n:.3f} s per sequence)")

    if args.skip_clients:
        return
    arch = TinyArch(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, max_positions=1024)
    model = NoEos(build_tiny_model(arch, len(tokenizer), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, seed=0),
                  tokenizer.eos_token_id).eval()  # fmt: skip
    gap_s = args.gap_ms / 1000
    kwargs = {"clients": args.clients, "tokens": args.tokens, "gap_s": gap_s, "max_batch": args.max_batch}
    for module in (old, new):  # warm-up
        staggered(module, model, tokenizer, **{**kwargs, "clients": 4, "tokens": 16})
    results: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for r in range(args.rounds):
        sides = [("old", old), ("new", new)]
        for name, module in sides if r % 2 == 0 else sides[::-1]:
            results[name].append(staggered(module, model, tokenizer, **kwargs))
    print(f"\n{args.clients} streamed clients, {args.tokens} tokens each, {args.gap_ms:g} ms apart, max batch {args.max_batch}")
    rates = {k: statistics.mean(r[0] for r in v) for k, v in results.items()}
    ttft = {k: statistics.mean(r[1] for r in v) for k, v in results.items()}
    for name in ("old", "new"):
        print(f"  {name}: {rates[name]:8.0f} tokens/s, median time to first token {ttft[name] * 1000:8.1f} ms")
    print(f"  new/old tokens/s: {rates['new'] / rates['old']:.2f}; old/new median TTFT: {ttft['old'] / ttft['new']:.1f}")


if __name__ == "__main__":
    main()
