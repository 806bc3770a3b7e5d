"""Tiny Qwen3-architecture causal LMs and a character-level tokenizer for CPU-scale runs.

Everything here is built locally (no hub): a tokenizer over printable ASCII and a model from a
config, saved and reloaded with the standard ``save_pretrained`` / ``from_pretrained`` calls.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # torch, tokenizers and transformers are imported where used: ``TinyArch`` (read by the config) stays cheap
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARSET = string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", "")


class TinyArch(BaseModel):
    """Shape of a tiny Qwen3 model; ``head_dim`` is derived (Qwen3Config defaults it to 128)."""

    model_config = ConfigDict(extra="forbid")
    hidden: int = Field(128, ge=8, description="hidden size")
    layers: int = Field(2, ge=1, description="decoder layers")
    heads: int = Field(4, ge=1, description="attention heads")
    kv_heads: int = Field(2, ge=1, description="key/value heads (GQA)")
    ffn: int = Field(256, ge=8, description="MLP intermediate size")
    max_positions: int = Field(512, ge=16, description="maximum sequence length")


def build_char_tokenizer(charset: str = CHARSET) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character of ``charset`` plus pad/eos/unk."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in dict.fromkeys(charset):
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    fast.padding_side = "left"
    return fast


def build_tiny_model(arch: TinyArch, vocab_size: int, *, pad_id: int, eos_id: int, seed: int) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 causal LM, deterministic under ``seed``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if arch.hidden % arch.heads or arch.heads % arch.kv_heads:
        raise ValueError(f"hidden ({arch.hidden}) must divide by heads ({arch.heads}) and heads by kv_heads ({arch.kv_heads})")
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=arch.hidden,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        head_dim=arch.hidden // arch.heads,
        intermediate_size=arch.ffn,
        max_position_embeddings=arch.max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = pad_id
    model.generation_config.eos_token_id = eos_id
    return model


def load_model_and_tokenizer(path: str | Path, *, dtype: torch.dtype | None = None):
    """Load a causal LM and its tokenizer (``dtype`` default float32); padding side is set to left (transformers 5 does
    not save it). ``path`` is a local directory, or a hub id of the form ``owner/name`` (needs the hub).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from opd_harness.models.hub import ModelUnavailable, locate_model

    try:
        where = locate_model(str(path), flag="model")
    except ModelUnavailable as exc:
        raise FileNotFoundError(str(exc)) from None
    tokenizer = load_tokenizer(where)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32 if dtype is None else dtype)
    return model, tokenizer


def load_tokenizer(path: str | Path):
    """A model's tokenizer, padding on the left (transformers 5 does not save it), pad = EOS when it has no pad token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_model_and_tokenizer(model, tokenizer, path: str | Path) -> None:
    """Save both so that ``load_model_and_tokenizer`` (or any HF loader) restores them."""
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
