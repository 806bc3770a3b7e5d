"""Shared fixtures: tiny models built locally (no hub), quiet libraries."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(scope="session", autouse=True)
def _quiet():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def char_tokenizer():
    from harness.models.tiny import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_factory(char_tokenizer):
    from harness.models.tiny import TinyArch, build_tiny_model

    def make(seed: int = 0, hidden: int = 32, layers: int = 1):
        arch = TinyArch(hidden=hidden, layers=layers, heads=2, kv_heads=1, ffn=2 * hidden)
        return build_tiny_model(arch, len(char_tokenizer), pad_id=char_tokenizer.pad_token_id, eos_id=char_tokenizer.eos_token_id, seed=seed)

    return make
