"""Qwen3 models at the published shapes (dense 0.6B, 1.7B, 4B, 8B, 14B, 32B; mixture-of-experts 30B-A3B) with random
weights, built without the hub.

For cost measurements only (step time, tokens/s, MFU, memory): the weights are random, so nothing measured with
them says anything about accuracy. A real checkpoint (``path:`` a hub id or folder) goes through the same model
class (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` for the MoE shape) and the same learner/engine code.

Every dense number below is copied from the ``config.json`` of the Qwen organisation's repositories on the Hugging Face
hub (``Qwen/Qwen3-0.6B``, ``-1.7B``, ``-4B``, ``-8B``, ``-14B``, ``-32B``; transformers 4.51 era):
``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` (128 in all
six), ``intermediate_size``, ``vocab_size`` (151,936), ``rope_theta`` (1,000,000), ``max_position_embeddings``
(40,960), ``rms_norm_eps`` (1e-6) and ``tie_word_embeddings`` (true for 0.6B, 1.7B and 4B; false for 8B, 14B, 32B).
The parameter counts in ``published_params`` are the model cards' "Number of Parameters" lines (0.6B, 1.7B, 4.0B,
8.2B, 14.8B, 32.8B); ``tests/test_shapes.py`` checks the built models against them.

``Qwen/Qwen3-30B-A3B`` (``Qwen3MoeForCausalLM``): 48 layers, hidden 2048, 32 query / 4 key-value heads of 128,
``intermediate_size`` 6144 (no dense layer uses it: ``decoder_sparse_step`` 1, ``mlp_only_layers`` empty), 128 experts of
``moe_intermediate_size`` 768 with 8 routed per token, ``norm_topk_prob`` true, untied embeddings, vocabulary 151,936,
``rope_theta`` 1,000,000, ``max_position_embeddings`` 40,960. Read from configurations that copy the checkpoint's: slime's
``scripts/models/qwen3-30B-A3B.sh`` (Megatron arguments: layers, widths, heads, experts, top-k, vocabulary, untied, rotary
base) and Ascend MindSpeed-RL's ``configs/model/qwen3_30b_a3b.yaml`` (the same, plus max positions 40,960 and
``norm_topk_prob``); the model card's lines (30.5B in total, 3.3B activated, 29.9B non-embedding; 48 layers, 32/4 heads,
128 experts, 8 activated) are checked in ``tests/test_shapes.py``.

:data:`HUB_VARIANTS` lists further hub ids whose architecture is one of these shapes (post-trained ``-2507`` and
pre-trained ``-Base`` checkpoints): their parameter counts are the shape's; their context length and RoPE base may differ
(the memory plan reads neither), and what was checked for each is its entry's text.

torch and transformers are imported where used, so the config (which reads ``SHAPES``) stays cheap to import.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM, Qwen3MoeForCausalLM


@dataclass(frozen=True)
class QwenShape:
    """One published Qwen3 configuration: dense, or mixture-of-experts when ``experts`` > 0 (every layer sparse, as in
    Qwen3-30B-A3B: ``decoder_sparse_step`` 1, no ``mlp_only_layers``)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    tie_word_embeddings: bool
    published_params: float  # the model card's "Number of Parameters", incl. embeddings
    source: str
    head_dim: int = 128
    vocab: int = 151_936
    rope_theta: float = 1_000_000.0
    max_positions: int = 40_960
    rms_norm_eps: float = 1e-6
    experts: int = 0  # routed experts per layer (num_experts); 0: dense
    experts_per_token: int = 0  # num_experts_per_tok
    expert_intermediate: int = 0  # moe_intermediate_size
    norm_topk_prob: bool = False
    published_active: float | None = None  # the model card's activated parameters (MoE)


SHAPES: dict[str, QwenShape] = {
    "qwen3-0.6b-shape": QwenShape(28, 1024, 16, 8, 3072, True, 0.6e9, "Qwen/Qwen3-0.6B config.json"),
    "qwen3-1.7b-shape": QwenShape(28, 2048, 16, 8, 6144, True, 1.7e9, "Qwen/Qwen3-1.7B config.json"),
    "qwen3-4b-shape": QwenShape(36, 2560, 32, 8, 9728, True, 4.0e9, "Qwen/Qwen3-4B config.json"),
    "qwen3-8b-shape": QwenShape(36, 4096, 32, 8, 12288, False, 8.2e9, "Qwen/Qwen3-8B config.json"),
    "qwen3-14b-shape": QwenShape(40, 5120, 40, 8, 17408, False, 14.8e9, "Qwen/Qwen3-14B config.json"),
    "qwen3-32b-shape": QwenShape(64, 5120, 64, 8, 25600, False, 32.8e9, "Qwen/Qwen3-32B config.json"),
    "qwen3-30b-a3b-shape": QwenShape(48, 2048, 32, 4, 6144, False, 30.5e9, "Qwen/Qwen3-30B-A3B config.json", experts=128,
                                     experts_per_token=8, expert_intermediate=768, norm_topk_prob=True,
                                     published_active=3.3e9),  # fmt: skip
}

# Other hub ids with one of the architectures above: hub id -> (shape name, what says so). Their parameter counts are
# the shape's; the plan reads no context length or RoPE base, so those are not carried over.
HUB_VARIANTS: dict[str, tuple[str, str]] = {
    "Qwen/Qwen3-30B-A3B-Instruct-2507": (
        "qwen3-30b-a3b-shape",
        "its model card: 30.5B in total, 3.3B activated, 29.9B non-embedding, 48 layers, 32/4 heads, 128 experts, 8 "
        "activated, as Qwen3-30B-A3B; context 262,144 natively (the shape's is 40,960)",
    ),
    "Qwen/Qwen3-4B-Instruct-2507": (
        "qwen3-4b-shape",
        "its config.json as a public EAGLE3 checkpoint validator expects it: hidden 2560, intermediate 9728, 36 layers, "
        "32/8 heads of 128, vocabulary 151,936, tied, as Qwen3-4B; max positions 262,144 and rope_theta 5,000,000 differ",
    ),
    "Qwen/Qwen3-1.7B-Base": (
        "qwen3-1.7b-shape",
        "the pre-trained checkpoint Qwen3-1.7B is post-trained from (Qwen3 technical report, arXiv:2505.09388): the "
        "same Qwen3ForCausalLM layout; its own config.json was not read here (context length not carried over)",
    ),
    "Qwen/Qwen3-8B-Base": (
        "qwen3-8b-shape",
        "the pre-trained checkpoint Qwen3-8B is post-trained from (Qwen3 technical report, arXiv:2505.09388): the "
        "same Qwen3ForCausalLM layout; its own config.json was not read here (context length not carried over)",
    ),
}

# Special ids of the stand-in tokenizer (the rest of the id space is one character per id).
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


def get_shape(arch: str) -> QwenShape:
    """The shape called ``arch``; a clear error listing the names otherwise."""
    try:
        return SHAPES[arch]
    except KeyError:
        raise ValueError(f"unknown model shape {arch!r}; known shapes: {', '.join(SHAPES)}") from None


def shape_config(arch: str, *, layers: int | None = None, pad_id: int = PAD_ID, eos_id: int = EOS_ID):
    """``Qwen3Config`` (``Qwen3MoeConfig`` for a mixture-of-experts shape) of shape ``arch``; ``layers`` keeps only the
    first that many decoder layers (a slice)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    shape = get_shape(arch)
    if layers is not None and not 1 <= layers <= shape.layers:
        raise ValueError(f"layers={layers}: a slice of {arch} has 1..{shape.layers} layers")
    moe = {}
    if shape.experts:
        moe = dict(num_experts=shape.experts, num_experts_per_tok=shape.experts_per_token, moe_intermediate_size=shape.expert_intermediate,
                   norm_topk_prob=shape.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    return (Qwen3MoeConfig if shape.experts else Qwen3Config)(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers if layers is None else layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tie_word_embeddings,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        **moe,
    )


@contextlib.contextmanager
def _default_dtype(dtype):
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_shape_model(
    arch: str, *, device: str = "cpu", dtype: torch.dtype | None = None, layers: int | None = None, seed: int = 0
) -> Qwen3ForCausalLM | Qwen3MoeForCausalLM:
    """A randomly initialised ``Qwen3ForCausalLM`` of shape ``arch`` (``Qwen3MoeForCausalLM`` for a mixture-of-experts
    shape: every expert and router built) on ``device`` (``meta``: no memory) in ``dtype`` (default bfloat16); ``layers``
    builds a slice; deterministic under ``seed`` on one device type."""
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    config = shape_config(arch, layers=layers)
    dtype = torch.bfloat16 if dtype is None else dtype
    with torch.random.fork_rng(devices=[]), torch.device(device), _default_dtype(dtype):
        torch.manual_seed(seed)
        if device != "cpu" and torch.device(device).type == "cuda":
            torch.cuda.manual_seed_all(seed)
        model = (Qwen3MoeForCausalLM if get_shape(arch).experts else Qwen3ForCausalLM)(config)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    return model


def standin_characters(vocab_size: int) -> list[str]:
    """One distinct character per id after the three specials: printable ASCII first (so task text encodes readably),
    then code points from U+00A1 on that are not controls, surrogates, separators, combining or format characters."""
    import unicodedata

    from opd_harness.models.tiny import CHARSET

    chars = list(dict.fromkeys(CHARSET))
    seen = set(chars)
    code = 0xA1
    while len(chars) < vocab_size - 3:
        ch = chr(code)
        code += 1
        if ch in seen or unicodedata.category(ch) in {"Cc", "Cs", "Cf", "Zs", "Zl", "Zp", "Mn", "Mc", "Me", "Cn"}:
            continue
        chars.append(ch)
    return chars


def build_shape_tokenizer(vocab_size: int = 151_936) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over ``vocab_size`` ids (pad 0, eos 1, unk 2): encode/decode round-trip exactly for
    any text of its characters, so random ids decode to text that encodes back to the same ids."""
    from opd_harness.models.tiny import build_char_tokenizer

    return build_char_tokenizer("".join(standin_characters(vocab_size)))  # pad 0, eos 1, unk 2, then one id per character
