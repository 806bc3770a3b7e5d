"""What one decoder layer keeps for its backward, per token, against the memory plan's per-layer term.

Runs one decoder layer's forward (a dense ``Qwen3DecoderLayer`` and a sparse ``Qwen3MoeDecoderLayer``, transformers'
eager expert loop) under ``torch.autograd.graph.saved_tensors_hooks`` and sums the distinct storages it saves, leaving
out the weights; compares with ``opd_harness.memory_plan.layer_activation_bytes_per_token`` times the tokens.

    OMP_NUM_THREADS=1 python benchmarks/moe_layer_activations.py [--tokens 512] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opd_harness.memory_plan import ModelShape, layer_activation_bytes_per_token  # noqa: E402


def saved_bytes(layer: torch.nn.Module, hidden: torch.Tensor, position_embeddings, mask) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during ``layer``'s forward."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()  # the saved tensors are usable: the backward runs
    return sum(seen.values())


def measure(sparse: bool, tokens: int, dtype: torch.dtype) -> dict:
    """One layer of a small Qwen3 / Qwen3-MoE shape: measured vs planned bytes per token."""
    from transformers import Qwen3Config, Qwen3MoeConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    common = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64)  # fmt: skip
    if sparse:
        config = Qwen3MoeConfig(**common, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=96, norm_topk_prob=True)
        layer = Qwen3MoeDecoderLayer(config, 0)
    else:
        config = Qwen3Config(**common)
        layer = Qwen3DecoderLayer(config, 0)
    config._attn_implementation = "sdpa"
    layer = layer.to(dtype).train()
    torch.manual_seed(0)
    for p in layer.parameters():  # the experts are torch.empty: give every weight finite values
        torch.nn.init.normal_(p, std=0.02)
    hidden = torch.randn(1, tokens, config.hidden_size, dtype=dtype, requires_grad=True)
    rotary = Qwen3RotaryEmbedding(config)
    position_embeddings = tuple(t.to(dtype) for t in rotary(hidden, torch.arange(tokens)[None]))
    measured = saved_bytes(layer, hidden, position_embeddings, None)
    shape = ModelShape("bench", "benchmark", 1, 256, 4, 2, 64, 512, 1000, False,
                       *((16, 4, 96, 1) if sparse else (0, 0, 0, 0)))  # fmt: skip
    planned = layer_activation_bytes_per_token(shape, torch.finfo(dtype).bits // 8, sparse) * tokens
    return {"layer": "Qwen3-MoE (16 experts, 4 per token)" if sparse else "Qwen3 dense", "tokens": tokens, "dtype": str(dtype),
            "measured_bytes_per_token": measured / tokens, "planned_bytes_per_token": planned / tokens,
            "planned_over_measured": round(planned / measured, 3)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    for sparse in (False, True):
        print(json.dumps(measure(sparse, args.tokens, getattr(torch, args.dtype))))


if __name__ == "__main__":
    main()
