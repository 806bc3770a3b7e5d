"""HF backend generation vs a bare ``model.generate`` on the same prompts: what the backend's extras cost (per-row seeded
sampling, per-token log-probs, stop strings, EOS cutting, decoding), measured side by side in one run; beside them the
backend as it decoded before issue 46 (``model.generate`` greedy over its ``RowSampler`` as a logits processor).

All ways sample the same left-padded batch of 64 arith prompts at temperature 1.0 with the same ``max_new_tokens``; the
bare way (transformers' batched ``torch.multinomial`` from the global RNG, TRL's generation path) returns only the token
ids. Each way is warmed up once, then run ``--rounds`` times in alternating order; printed are the median milliseconds
per decode step of the batch (a call's seconds over the steps it ran: the batch runs until its last row ends) and
each way's ratio to the bare one, the median over rounds of the ratio within a round (1.0 = the backend's extras are
free; below 1.0 = faster than bare ``generate``).

    PYTHONPATH=. python benchmarks/hf_generate_overhead.py [--prompts 64] [--new-tokens 48] [--rounds 8] [--threads 1]
        [--stop] [--models demo-student]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend, left_pad
from opd_harness.backends.hf_static import StaticCacheBackend
from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model
from opd_harness.plan import load_problems, make_task

MODELS = {
    "demo-student": TinyArch(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256),  # 128x2, the cpu-demo student
    "demo-teacher": TinyArch(hidden=192, layers=3, heads=4, kv_heads=2, ffn=384),  # 192x3
    "wide": TinyArch(hidden=512, layers=4, heads=8, kv_heads=4, ffn=1024),  # 512x4
}


class GenerateLoopBackend(StaticCacheBackend):
    """The hf backend before issue 46: its rows decoded by ``model.generate`` over a dynamic KV cache, the sampler a logits
    processor (``hf_static``'s path without its static cache)."""

    def _generate_options(self) -> dict:
        return {}


@torch.no_grad()
def bare_generate(model, prompts: list[list[int]], params: SamplingParams, pad_id: int, eos_id: int) -> int:
    """``model.generate`` alone on one batch; returns the decode steps it ran."""
    torch.manual_seed(params.seed)
    ids, attn = left_pad(prompts, pad_id)
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=params.max_new_tokens, do_sample=True,
                         temperature=params.temperature, top_p=1.0, top_k=0, pad_token_id=pad_id, eos_token_id=eos_id)  # fmt: skip
    return out.shape[1] - ids.shape[1]


def backend_generate(backend: HFBackend, prompts: list[list[int]], params: SamplingParams) -> int:
    """The backend's ``generate`` on one batch; returns the decode steps it ran (its longest completion)."""
    return max(len(c.token_ids) for c in backend.generate(prompts, params))


def measure(arch: TinyArch, prompts: list[list[int]], params: SamplingParams, rounds: int) -> dict[str, tuple[float, float]]:
    """Per way: the median milliseconds per decode step, and the median over rounds of its ratio to the bare way's in the
    same round (paired: a load that changes between rounds moves both); warmed up once, alternated over ``rounds``."""
    tok = build_char_tokenizer()
    model = build_tiny_model(arch, len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, seed=0).eval()
    now = HFBackend(model, tok, batch_size=len(prompts))
    before = GenerateLoopBackend(model, tok, batch_size=len(prompts), compile=False, width_multiple=1)
    ways: dict[str, Callable[[], int]] = {
        "bare generate": lambda: bare_generate(model, prompts, params, tok.pad_token_id, tok.eos_token_id),
        "backend before #46": lambda: backend_generate(before, prompts, params),
        "backend": lambda: backend_generate(now, prompts, params),
    }
    for way in ways.values():
        way()
    ms: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name in list(ways) if r % 2 == 0 else list(ways)[::-1]:
            started = time.perf_counter()
            steps = ways[name]()
            ms[name].append((time.perf_counter() - started) / steps * 1e3)
    bare = ms["bare generate"]
    return {name: (statistics.median(v), statistics.median(a / b for a, b in zip(v, bare, strict=True))) for name, v in ms.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--stop", action="store_true", help="the backend also watches a stop string (the bare side cannot)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = build_char_tokenizer()
    task = make_task("arith", {"arith": {"n_test": args.prompts}})
    problems = load_problems(task, "test")[: args.prompts]
    prompts = [tok(task.format_prompt(p, tok), add_special_tokens=False)["input_ids"] for p in problems]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0, stop=("\n\n",) if args.stop else ())
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    print(f"{len(prompts)} arith prompts, {args.new_tokens} new tokens, batch {len(prompts)}, threads {torch.get_num_threads()}, "
          f"{args.rounds} rounds; loadavg {load}")  # fmt: skip
    for name in args.models:
        ms = measure(MODELS[name], prompts, params, args.rounds)
        print(f"{name:13s} ms/decode step (median ratio to bare in the same round): "
              + "   ".join(f"{way} {value:.3f} ({ratio:.3f}x)" for way, (value, ratio) in ms.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
