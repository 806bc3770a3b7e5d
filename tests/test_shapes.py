"""Qwen3 models at the published shapes: parameter counts on the meta device, a real forward/backward on a slice,
the stand-in tokenizer, and ``arch: qwen3-…-shape`` in the run config."""

from __future__ import annotations

import random

import pytest
import torch

from opd_harness.config import ConfigError, build_config
from opd_harness.models.shapes import EOS_ID, HUB_VARIANTS, PAD_ID, SHAPES, build_shape_model, build_shape_tokenizer, shape_config

# The model cards' "Number of Parameters" (total, non-embedding), in billions, at the cards' precision.
CARDS = {
    "qwen3-0.6b-shape": (0.6, 0.44),
    "qwen3-1.7b-shape": (1.7, 1.4),
    "qwen3-4b-shape": (4.0, 3.6),
    "qwen3-8b-shape": (8.2, 6.95),
    "qwen3-14b-shape": (14.8, 13.2),
    "qwen3-32b-shape": (32.8, 31.2),
    "qwen3-30b-a3b-shape": (30.5, 29.9),  # Qwen3-30B-A3B(-Instruct-2507): "30.5B in total", "29.9B" non-embedding
}


def digits(x: float) -> int:
    """Decimal places of a number as the card writes it (0.44 → 2)."""
    return len(repr(x).split(".")[1])


@pytest.mark.parametrize("arch", list(SHAPES))
def test_each_shape_on_the_meta_device_has_its_published_parameter_count(arch):
    model = build_shape_model(arch, device="meta")
    shape = SHAPES[arch]
    total = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    embeddings = model.model.embed_tokens.weight.numel() * (1 if shape.tie_word_embeddings else 2)
    card_total, card_non_embedding = CARDS[arch]
    assert round(total / 1e9, digits(card_total)) == card_total
    assert round((total - embeddings) / 1e9, digits(card_non_embedding)) == card_non_embedding
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == shape.tie_word_embeddings
    assert next(model.parameters()).device.type == "meta" and next(model.parameters()).dtype == torch.bfloat16
    assert model.config.vocab_size == 151_936 and model.config.head_dim == 128 and model.config.rope_parameters["rope_theta"] == 1e6
    if arch == "qwen3-0.6b-shape":
        assert abs(total - 0.6e9) / 0.6e9 < 0.01  # 596,049,920


def test_the_moe_shape_builds_every_expert_and_routes_eight_of_128():
    """Qwen3-30B-A3B on the meta device: a Qwen3MoeForCausalLM whose 48 layers are all sparse (128 experts of 768, a
    router), and whose parameters one token is routed through match the card's "3.3B activated" (the card truncates:
    3.35B counting both untied embeddings and the router)."""
    from transformers import Qwen3MoeForCausalLM

    from opd_harness.memory_plan import parameter_count, published_shape

    model = build_shape_model("qwen3-30b-a3b-shape", device="meta")
    assert isinstance(model, Qwen3MoeForCausalLM) and model.config.num_hidden_layers == 48
    mlp = model.model.layers[47].mlp
    assert tuple(mlp.experts.gate_up_proj.shape) == (128, 2 * 768, 2048) and tuple(mlp.gate.weight.shape) == (128, 2048)
    assert model.config.num_experts_per_tok == 8 and model.config.norm_topk_prob
    shape = published_shape("qwen3-30b-a3b-shape")
    assert parameter_count(shape) == sum(p.numel() for p in model.parameters()) == 30_532_122_624
    active = parameter_count(shape, active=True)
    assert 3.3e9 <= active < 3.4e9, active  # 3,353,032,704
    expert = 3 * 2048 * 768
    assert parameter_count(shape) - active == 48 * (128 - 8) * expert


def test_every_hub_variant_names_a_shape_and_what_was_checked():
    from opd_harness.memory_plan import published_hub_ids

    ids = published_hub_ids()
    for repo, (name, why) in HUB_VARIANTS.items():
        assert name in SHAPES and ids[repo] == name and len(why) > 40, repo
    assert ids["Qwen/Qwen3-30B-A3B"] == ids["Qwen/Qwen3-30B-A3B-Instruct-2507"] == "qwen3-30b-a3b-shape"
    assert ids["Qwen/Qwen3-1.7B-Base"] == "qwen3-1.7b-shape" and ids["Qwen/Qwen3-8B"] == "qwen3-8b-shape"


@pytest.mark.slow  # about 40 s on a loaded 2-core machine
def test_a_two_layer_slice_runs_forward_and_backward_on_cpu():
    model = build_shape_model("qwen3-0.6b-shape", dtype=torch.float32, layers=2, seed=0)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 1024
    ids = torch.randint(3, 151_936, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 12, 151_936) and out.logits.dtype == torch.float32
    out.loss.backward()
    assert torch.isfinite(out.loss) and 10 < float(out.loss.detach()) < 13  # random weights: about ln(151,936) = 11.9
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert float(grads["model.layers.1.mlp.down_proj.weight"].abs().sum()) > 0


@pytest.mark.slow
def test_a_two_layer_bf16_slice_runs_forward_on_cpu():
    """bf16 forward only: torch's CPU backward in bf16 at this vocabulary takes minutes (the GPU check runs it on CUDA)."""
    model = build_shape_model("qwen3-0.6b-shape", dtype=torch.bfloat16, layers=2, seed=0)
    ids = torch.randint(3, 151_936, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 12, 151_936) and out.logits.dtype == torch.bfloat16
    assert torch.isfinite(out.loss) and 10 < float(out.loss) < 13


def test_a_slice_is_refused_outside_the_shapes_layers():
    with pytest.raises(ValueError, match="1..28 layers"):
        shape_config("qwen3-0.6b-shape", layers=29)
    with pytest.raises(ValueError, match="known shapes: qwen3-0.6b-shape"):
        shape_config("qwen3-3b-shape")


def test_the_standin_tokenizer_covers_the_vocabulary_and_round_trips():
    tok = build_shape_tokenizer()
    assert len(tok) == 151_936 and (tok.pad_token_id, tok.eos_token_id) == (PAD_ID, EOS_ID)
    text = "Compute 37+4*12.\n\\boxed{85}\t"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    rand = [random.Random(0).randrange(3, 151_936) for _ in range(1)] + random.Random(1).sample(range(3, 151_936), 500)
    assert tok(tok.decode(rand), add_special_tokens=False)["input_ids"] == rand
    assert tok.decode([ids[0], EOS_ID, PAD_ID], skip_special_tokens=True) == text[0]


def test_a_shape_is_selectable_by_name_in_the_run_config():
    cfg = build_config(preset="smoke", overrides=["student.arch=qwen3-0.6b-shape", "teacher.arch=qwen3-1.7b-shape"])
    assert (cfg.student.arch, cfg.teacher.arch) == ("qwen3-0.6b-shape", "qwen3-1.7b-shape")
    with pytest.raises(ConfigError, match=r"student\.arch.*unknown model shape 'qwen3-3b-shape'"):
        build_config(preset="smoke", overrides=["student.arch=qwen3-3b-shape"])


def test_prepare_model_builds_caches_and_reloads_a_shape(tmp_path, monkeypatch):
    """The run's model preparation for ``arch: <shape>``: built (here a 1-layer slice, to stay small), saved in
    bfloat16 under the cache, returned in float32, and the same weights loaded back on the next run."""
    from functools import partial

    from opd_harness.config import ModelSpec
    from opd_harness.registry import TASKS
    from opd_harness.trainers import warmup

    monkeypatch.setattr(warmup, "build_shape_model", partial(build_shape_model, layers=1))
    task = TASKS.get("arith")()
    spec = ModelSpec(arch="qwen3-0.6b-shape", seed=3)
    model, tok, path = warmup.prepare_model(spec, "student", task, [], tmp_path, show_progress=False)
    again, tok2, path2 = warmup.prepare_model(spec, "student", task, [], tmp_path, show_progress=False)
    assert path == path2 and len(tok2) == len(tok) == 151_936
    assert next(model.parameters()).dtype == next(again.parameters()).dtype == torch.float32
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
