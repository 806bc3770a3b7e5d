"""HF backend generation vs a bare ``model.generate`` on the same prompts: what the backend's extras cost (per-token
log-probs from the step logits, stop strings, EOS cutting, decoding), measured side by side in one run.

Both sides sample the same left-padded batches with the same seed and ``max_new_tokens``; the bare side returns only
the token ids. Tokens per second counts generated tokens (up to EOS) on each side; the ratio is backend / bare
(1.0 = free; the target is at least 0.9).

    PYTHONPATH=. python benchmarks/hf_generate_overhead.py [--prompts 64] [--new-tokens 64] [--rounds 3] [--stop]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend, left_pad
from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model
from opd_harness.plan import load_problems, make_task

MODELS = {
    "demo-student (128x2)": TinyArch(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256),
    "demo-teacher (192x3)": TinyArch(hidden=192, layers=3, heads=4, kv_heads=2, ffn=384),
    "wide (512x4)": TinyArch(hidden=512, layers=4, heads=8, kv_heads=4, ffn=1024),
}


@torch.no_grad()
def bare_generate(model, prompts: list[list[int]], params: SamplingParams, pad_id: int, eos_id: int, batch_size: int) -> int:
    """``model.generate`` alone, batch by batch; returns the generated tokens up to and including EOS."""
    torch.manual_seed(params.seed)
    tokens = 0
    for start in range(0, len(prompts), batch_size):
        ids, attn = left_pad(prompts[start : start + batch_size], pad_id)
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=params.max_new_tokens, do_sample=True,
                             temperature=params.temperature, top_p=1.0, top_k=0, pad_token_id=pad_id, eos_token_id=eos_id)  # fmt: skip
        for row in out[:, ids.shape[1] :].tolist():
            tokens += row.index(eos_id) + 1 if eos_id in row else len(row)
    return tokens


def backend_generate(backend: HFBackend, prompts: list[list[int]], params: SamplingParams) -> int:
    """The HF backend's ``generate``; returns the generated tokens it reports."""
    return sum(len(c.token_ids) for c in backend.generate(prompts, params))


def measure(name: str, arch: TinyArch, prompts: list[list[int]], params: SamplingParams, rounds: int) -> dict:
    """Tokens per second both ways, alternating, ``rounds`` times each; medians and their ratio."""
    tok = build_char_tokenizer()
    model = build_tiny_model(arch, len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, seed=0).eval()
    backend = HFBackend(model, tok, batch_size=len(prompts))
    bare_rates, backend_rates = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        n = bare_generate(model, prompts, params, tok.pad_token_id, tok.eos_token_id, len(prompts))
        bare_rates.append(n / (time.perf_counter() - started))
        started = time.perf_counter()
        n = backend_generate(backend, prompts, params)
        backend_rates.append(n / (time.perf_counter() - started))
    bare, ours = statistics.median(bare_rates), statistics.median(backend_rates)
    return {"model": name, "bare_tok_s": round(bare), "backend_tok_s": round(ours), "ratio": round(ours / bare, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stop", action="store_true", help="the backend also watches a stop string (the bare side cannot)")
    args = parser.parse_args(argv)
    tok = build_char_tokenizer()
    task = make_task("arith", {"arith": {"n_test": args.prompts}})
    problems = load_problems(task, "test")[: args.prompts]
    prompts = [tok(task.format_prompt(p, tok), add_special_tokens=False)["input_ids"] for p in problems]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0, stop=("\n\n",) if args.stop else ())
    print(f"{len(prompts)} arith prompts, {args.new_tokens} new tokens, batch {len(prompts)}, threads {torch.get_num_threads()}")
    for name, arch in MODELS.items():
        row = measure(name, arch, prompts, params, args.rounds)
        print(f"{row['model']:22s} bare {row['bare_tok_s']:7d} tok/s   backend {row['backend_tok_s']:7d} tok/s   ratio {row['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
