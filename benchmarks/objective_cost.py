"""Cost of every registered objective per training step, relative to vanilla OPD on the same batch.

Two measurements per method, interleaved in one run so machine noise hits all methods alike:
- ``objective``: the objective's forward + backward on fixed student logits (the method's own cost);
- ``step``: a whole learner step (tiny student forward, objective, backward, AdamW).
Usage: ``python benchmarks/objective_cost.py [--batch 64] [--length 128] [--repeats 20]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model
from opd_harness.registry import METHODS
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.learner import train_step
from opd_harness.method import StudentOutputs


def synthetic_batch(batch: int, length: int, vocab: int, seed: int = 0) -> tuple[TensorBatch, torch.Tensor]:
    """A batch with two assistant steps separated by an environment segment, rewards in groups of 4."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.zeros(batch, length)
    prompt, split = length // 8, length // 2
    mask[:, prompt:split] = 1
    mask[:, split + 8 :] = 1
    steps = torch.full((batch, length), -1)
    steps[:, prompt:split], steps[:, split + 8 :] = 0, 1
    teacher_dist = F.log_softmax(torch.randn(batch, length, vocab, generator=g) * 2, dim=-1)
    teacher = teacher_dist.gather(-1, ids.unsqueeze(-1)).squeeze(-1) * mask
    student_logits = torch.randn(batch, length, vocab, generator=g) * 2
    behaviour = F.log_softmax(student_logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1) * mask
    tb = TensorBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=mask,
        step_index=steps,
        behaviour_logprobs=behaviour,
        teacher_logprobs=teacher,
        rewards=torch.randint(0, 2, (batch,), generator=g).float(),
        policy_version=torch.zeros(batch, dtype=torch.long),
        group_ids=torch.arange(batch) // 4,
        teacher_dist=teacher_dist,
        policy_lag=torch.randint(0, 4, (batch,), generator=g),
    )
    return tb, student_logits


def time_objective(spec, hparams, batch: TensorBatch, logits: torch.Tensor) -> float:
    state = spec.make_state(hparams) if spec.make_state else None
    leaf = logits.clone().requires_grad_(True)
    started = time.perf_counter()
    full = F.log_softmax(leaf, -1)
    logp = full.gather(-1, batch.input_ids.unsqueeze(-1)).squeeze(-1)
    loss, _ = spec.objective(batch, StudentOutputs(logp, full), hparams, state)
    loss.backward()
    return time.perf_counter() - started


def time_step(spec, hparams, batch: TensorBatch, model, optimizer) -> float:
    state = spec.make_state(hparams) if spec.make_state else None
    started = time.perf_counter()
    train_step(model, optimizer, batch, spec, hparams, state)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    batch, logits = synthetic_batch(args.batch, args.length, len(tok))
    model = build_tiny_model(TinyArch(hidden=128, layers=2), len(tok), pad_id=0, eos_id=1, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    methods = [(name, spec, spec.hparams()) for name, spec in METHODS.items() if spec.on_policy]
    objective_s: dict[str, list[float]] = {name: [] for name, *_ in methods}
    step_s: dict[str, list[float]] = {name: [] for name, *_ in methods}
    for _ in range(args.repeats):  # interleaved: every method sees the same machine conditions
        for name, spec, hp in methods:
            objective_s[name].append(time_objective(spec, hp, batch, logits))
            step_s[name].append(time_step(spec, hp, batch, model, optimizer))
    base_obj, base_step = statistics.median(objective_s["opd"]), statistics.median(step_s["opd"])
    print(f"batch {args.batch}×{args.length}, vocab {len(tok)}, {args.repeats} repeats, medians; ratio = method / opd")
    print(f"{'method':<20}{'objective ms':>14}{'ratio':>8}{'step ms':>10}{'ratio':>8}")
    for name, *_ in methods:
        o, s = statistics.median(objective_s[name]), statistics.median(step_s[name])
        print(f"{name:<20}{o * 1e3:>14.2f}{o / base_obj:>8.2f}{s * 1e3:>10.1f}{s / base_step:>8.2f}")


if __name__ == "__main__":
    main()
