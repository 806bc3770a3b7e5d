"""The learner's side of a training step: forward with gradient, objective, optimizer update."""

from __future__ import annotations

import torch

from harness.backends.hf import scores_from_logits
from harness.method import HParams, MethodSpec, StudentOutputs
from harness.trajectory import TensorBatch
from trainers.objectives import masked_mean


def student_outputs(model: torch.nn.Module, batch: TensorBatch, full: bool) -> tuple[StudentOutputs, torch.Tensor]:
    """Current-student log-probs (and full distribution if asked) with gradient, plus detached entropy."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    want = ("logprobs", "full") if full else ("logprobs", "entropy")
    scores = scores_from_logits(logits, batch.input_ids, want)
    if full:
        entropy = -(scores["full"].exp() * scores["full"]).sum(-1).detach()
    else:
        entropy = scores["entropy"].detach()
    return StudentOutputs(logprobs=scores["logprobs"], full=scores.get("full")), entropy


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TensorBatch,
    method: MethodSpec,
    hparams: HParams,
    state: object = None,
    *,
    grad_clip: float = 1.0,
) -> dict[str, float]:
    """One optimizer step of ``method`` on ``batch``; returns loss, grad norm, entropy and diagnostics.

    A non-finite loss or gradient norm is never applied: the update is skipped and reported as
    ``nonfinite = skipped = 1``; the driver then stops or goes on (``trainer.on_nonfinite``).
    """
    model.train()
    needs = method.needs(hparams)
    outputs, entropy = student_outputs(model, batch, full="student_full" in needs)
    loss, diagnostics = method.objective(batch, outputs, hparams, state)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip) if grad_clip > 0 else total_grad_norm(model)
    finite = bool(torch.isfinite(loss.detach())) and bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return {
        "loss": float(loss.detach()),
        "grad_norm": float(grad_norm),
        "student_entropy": float(masked_mean(entropy, batch.loss_mask)),
        "nonfinite": float(not finite),
        "skipped": float(not finite),
        **diagnostics,
    }


def total_grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """L2 norm of all gradients, without clipping (``grad_clip = 0`` still guards against non-finite gradients)."""
    grads = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(grads)) if grads else torch.tensor(0.0)
