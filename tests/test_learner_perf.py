"""The learner's precision and memory options (bf16 autocast, activation checkpointing) and its throughput/MFU
accounting, on CPU. The CUDA-only parts (fused AdamW, the peak of a real GPU) are not run here."""

from __future__ import annotations

import pytest
import torch

from opd_harness.tracking import step_key
from opd_harness.trainers.learner import batch_to, train_step
from opd_harness.trainers.objectives.sft import SFT_SPEC
from opd_harness.trainers.perf import flop_params, peak_flops, step_perf


def sft_batch(seed: int = 0):
    """Two rows of random character ids, every position trained (SFT reads the sampled tokens' log-probs only)."""
    from tests.batches import make_batch

    g = torch.Generator().manual_seed(seed)
    batch = make_batch(torch.ones(2, 10).tolist(), torch.zeros(2, 10).tolist(), torch.zeros(2, 10).tolist())
    batch.input_ids = torch.randint(3, 90, (2, 10), generator=g)
    return batch


def one_step(model, precision: str = "fp32") -> tuple[dict, dict]:
    """Metrics and gradients of one SFT step (learning rate 0, so the weights stay as they were)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    metrics = train_step(model, optimizer, sft_batch(), SFT_SPEC, SFT_SPEC.hparams(), grad_clip=0.0, precision=precision)
    return metrics, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow  # 145 s at load average ~20 on 2 cores (much less on a quiet machine)
def test_activation_checkpointing_gives_the_same_loss_and_gradients(tiny_model_factory):
    plain_metrics, plain_grads = one_step(tiny_model_factory(seed=4, layers=2))
    model = tiny_model_factory(seed=4, layers=2)
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    ckpt_metrics, ckpt_grads = one_step(model)
    assert ckpt_metrics["loss"] == pytest.approx(plain_metrics["loss"], abs=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_keeps_float32_master_weights_and_is_close_to_fp32(tiny_model_factory):
    fp32_metrics, _ = one_step(tiny_model_factory(seed=5))
    model = tiny_model_factory(seed=5)
    bf16_metrics, grads = one_step(model, precision="bf16")
    assert bf16_metrics["loss"] == pytest.approx(fp32_metrics["loss"], rel=2e-2)
    assert bf16_metrics["loss"] != fp32_metrics["loss"]  # the forward really ran in bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters()) and all(g.dtype == torch.float32 for g in grads.values())
    with pytest.raises(ValueError, match="precision 'fp16'"):
        one_step(tiny_model_factory(seed=5), precision="fp16")


def test_batch_to_moves_every_tensor_and_keeps_a_batch_already_there():
    batch = sft_batch()
    assert batch_to(batch, torch.device("cpu")) is batch
    moved = batch_to(batch, torch.device("meta"))
    assert moved.input_ids.device.type == moved.loss_mask.device.type == moved.group_ids.device.type == "meta"
    assert moved.teacher_dist is None


def test_peak_flops_by_device_name():
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None


def test_step_perf_is_six_n_tokens_over_time_and_peak():
    out = step_perf(600_000_000, 8192, 0.5, "NVIDIA H200")
    assert out["learner_tokens_per_s"] == 16384
    assert out["mfu"] == pytest.approx(6 * 600e6 * 8192 / 0.5 / 989e12)
    assert step_perf(600_000_000, 8192, 0.5, None) == {"learner_tokens_per_s": 16384}  # CPU: no MFU
    assert step_key("mfu") == "perf/mfu/actor" and step_key("learner_tokens_per_s") == "perf/learner_tokens_per_s"


def test_flop_params_count_the_output_head_but_not_an_untied_input_embedding():
    from opd_harness.models.shapes import build_shape_model

    tied = build_shape_model("qwen3-0.6b-shape", device="meta")
    untied = build_shape_model("qwen3-8b-shape", device="meta")
    assert flop_params(tied) == sum(p.numel() for p in tied.parameters())
    assert flop_params(untied) == sum(p.numel() for p in untied.parameters()) - 151_936 * 4096
