"""How noisy is the sampled-token OPD gradient of one training batch, against the full-vocabulary KL gradient?

Both estimators have the same expectation given the sampled prefixes (tests/test_opd_expectation.py), so on the
same batch the full-KL gradient is the sampled one's target. Per batch of the cpu-demo student's own samples this
prints the cosine between the two gradients, the share of parameters whose gradient signs agree (what a first Adam
step follows), the norm ratio, and the cosine between two batches' gradients of each estimator (how much a batch's
full gradient itself moves). Usage:

    python benchmarks/opd_gradient_noise.py --models <out>/cache/models [--prompts 32] [--batches 4]

``--models`` is a cpu-demo results root's model cache (``teacher-*`` and ``student-*`` after their SFT warm-ups).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.config import build_config
from opd_harness.models.tiny import load_model_and_tokenizer
from opd_harness.plan import make_task
from opd_harness.registry import METHODS
from opd_harness.rollout import rollout
from opd_harness.trajectory import TensorBatch, to_tensor_batch
from opd_harness.trainers.learner import student_outputs
from opd_harness.trainers.teacher import score_teacher

def flat_gradient(model: torch.nn.Module, batch: TensorBatch, estimator: str) -> torch.Tensor:
    """d loss / d θ of ``opd`` with ``estimator`` on ``batch``, flattened."""
    spec = METHODS.get("opd")
    hp = spec.hparams(estimator=estimator)
    outputs, _ = student_outputs(model, batch, full=estimator == "full")
    loss, _ = spec.objective(batch, outputs, hp, None)
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True, help="a cpu-demo results root's cache/models folder")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per batch (the recipes' trainer.prompts_per_step)")
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    student_model, tokenizer = load_model_and_tokenizer(next(args.models.glob("student-*")))
    teacher_model, teacher_tok = load_model_and_tokenizer(next(args.models.glob("teacher-*")))
    student, teacher = HFBackend(student_model, tokenizer), HFBackend(teacher_model, teacher_tok)
    task = make_task("arith", build_config(preset="cpu-demo").task_args)  # the task the cpu-demo models were warmed up on
    problems = task.load("train")
    rows, grads = [], []
    for b in range(args.batches):
        chosen = problems[b * args.prompts : (b + 1) * args.prompts]
        params = SamplingParams(temperature=1.0, max_new_tokens=task.options.max_new_tokens, n=1, seed=1000 + b)
        batch = to_tensor_batch(rollout(student, task, chosen, params), student.pad_id)
        score_teacher(teacher, batch, kind="full")
        student_model.train()
        sampled, full = flat_gradient(student_model, batch, "sampled"), flat_gradient(student_model, batch, "full")
        grads.append((sampled, full))
        agree = float(((sampled.sign() == full.sign()) & (full != 0)).float().sum() / (full != 0).float().sum())
        rows.append((cosine(sampled, full), agree, float(sampled.norm() / full.norm()), int(batch.loss_mask.sum())))
        print(f"batch {b}: {rows[-1][3]} tokens  cos(sampled, full) {rows[-1][0]:.3f}  sign agreement {agree:.3f}  "
              f"|sampled|/|full| {rows[-1][2]:.2f}", flush=True)  # fmt: skip
    across_sampled = statistics.mean(cosine(grads[i][0], grads[i + 1][0]) for i in range(len(grads) - 1))
    across_full = statistics.mean(cosine(grads[i][1], grads[i + 1][1]) for i in range(len(grads) - 1))
    mean = lambda i: statistics.mean(r[i] for r in rows)  # noqa: E731
    print(f"mean over {len(rows)} batches of {args.prompts} prompts: cos(sampled, full) {mean(0):.3f}, sign agreement {mean(1):.3f}, "
          f"norm ratio {mean(2):.2f}; cos between consecutive batches: sampled {across_sampled:.3f}, full {across_full:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
