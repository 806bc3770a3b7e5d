"""The memory plan's learner estimate against the peak RSS of one real learner step on the CPU.

Each shape runs in a fresh subprocess: a tiny Qwen3 with Qwen3's vocabulary (151,936), AdamW, and one
``opd_harness.trainers.learner.train_step`` of OPD on a synthetic batch. Measured: the process's RSS high-water mark
(``VmHWM``) minus its RSS after the imports. Estimated: ``opd_harness.memory_plan``'s learner terms (weights,
gradients, AdamW, activations, the batch with its teacher signal) for the same shape and tokens.

    OMP_NUM_THREADS=1 python benchmarks/memory_plan_check.py            # every shape
    OMP_NUM_THREADS=1 python benchmarks/memory_plan_check.py --shape A  # one
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peak_memory import status_bytes  # noqa: E402
from opd_harness.teacher_signal import bytes_per_token  # noqa: E402
from opd_harness.memory_plan import (  # noqa: E402
    FP32,
    ModelShape,
    first_pass_bytes,
    learner_activation_bytes,
    learner_state_terms,
)

VOCAB = 151_936
MIB = 1024**2


@dataclass(frozen=True)
class Case:
    """One measured shape: the tiny model, the batch (rows × tokens) and the learner's options."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rows: int
    tokens: int
    estimator: str  # opd's: sampled (teacher log-probs) or full (the teacher's whole distribution in the batch)
    forward_tokens: int = 0
    vocab_chunk: int = 0

    def shape(self) -> ModelShape:
        return ModelShape("tiny", "benchmark", self.layers, self.hidden, self.heads, self.kv_heads, self.hidden // self.heads,
                          self.ffn, VOCAB, True)  # fmt: skip


CASES = {
    "A": Case(hidden=16, layers=1, heads=2, kv_heads=1, ffn=64, rows=2, tokens=256, estimator="sampled"),
    "B": Case(hidden=64, layers=2, heads=4, kv_heads=2, ffn=256, rows=6, tokens=256, estimator="sampled", forward_tokens=512),
    "C": Case(hidden=32, layers=2, heads=4, kv_heads=2, ffn=128, rows=2, tokens=256, estimator="full"),
    "D": Case(hidden=32, layers=2, heads=4, kv_heads=2, ffn=128, rows=4, tokens=512, estimator="full", vocab_chunk=64),
    "E": Case(hidden=32, layers=2, heads=4, kv_heads=2, ffn=128, rows=4, tokens=256, estimator="full", forward_tokens=512),
    "F": Case(hidden=32, layers=2, heads=4, kv_heads=2, ffn=128, rows=8, tokens=512, estimator="full", forward_tokens=1024,
              vocab_chunk=64),
    "G": Case(hidden=32, layers=2, heads=4, kv_heads=2, ffn=128, rows=8, tokens=512, estimator="sampled", forward_tokens=1024,
              vocab_chunk=64),
}


def estimate(case: Case) -> int:
    """The memory plan's learner bytes for ``case`` (one rank, fp32, no checkpointing)."""
    shape = case.shape()
    state = sum(size for size, _ in learner_state_terms(shape, ranks=1, sharding="ddp", precision="fp32").values())
    rank_tokens = case.rows * case.tokens
    bucket = min(rank_tokens, max(case.forward_tokens, case.tokens)) if case.forward_tokens else rank_tokens
    per_bucket = bucket < rank_tokens  # trainer.bucket_backward (the default): one bucket's graph at a time
    graph = bucket if per_bucket else rank_tokens
    full = case.estimator == "full"
    layers, vocab = learner_activation_bytes(shape, graph_tokens=graph, bucket_tokens=bucket, dtype_bytes=FP32,
                                             checkpointing=False, student_full=full, vocab_chunk=case.vocab_chunk,
                                             teacher_in_chunk=full, rank_tokens=rank_tokens)  # fmt: skip
    if per_bucket:
        vocab += first_pass_bytes(step_tokens=rank_tokens, student_full=full)
    signal = bytes_per_token("full" if full else "sampled", hidden=shape.hidden, top_k=20, dtype_bytes=FP32) + 4 * 8 + 2 * FP32
    head = VOCAB * shape.hidden * FP32 if full else 0  # the teacher's output head (a copy of the student's shape here)
    return state + layers + vocab + signal * rank_tokens + head


def measure(case: Case) -> int:
    """Peak RSS rise of one learner step of ``case`` in this (fresh) process."""
    import torch

    from opd_harness.models.tiny import TinyArch, build_tiny_model
    from opd_harness.registry import METHODS
    from opd_harness.teacher_signal import HiddenDistribution
    from opd_harness.trajectory import TensorBatch
    from opd_harness.trainers.learner import train_step

    torch.set_num_threads(1)
    torch.ones(8) @ torch.ones(8)  # the first op's allocations belong to the baseline
    base = max(status_bytes("VmRSS"), status_bytes("VmHWM"))  # the peak of the imports (VmHWM: benchmarks/peak_memory.py)
    arch = TinyArch(hidden=case.hidden, layers=case.layers, heads=case.heads, kv_heads=case.kv_heads, ffn=case.ffn,
                    max_positions=max(512, case.tokens))  # fmt: skip
    model = build_tiny_model(arch, VOCAB, pad_id=0, eos_id=1, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    rows, length = case.rows, case.tokens
    ids = torch.randint(3, VOCAB, (rows, length), generator=g)
    loss_mask = (torch.arange(length) >= 16).float().expand(rows, -1).contiguous()
    behaviour = -torch.rand(rows, length, generator=g) * 3 * loss_mask
    full = None
    if case.estimator == "full":  # the teacher's full signal: its last hidden states and a head (opd_harness.teacher_signal)
        head = torch.nn.Linear(case.hidden, VOCAB, bias=False).requires_grad_(False)
        full = HiddenDistribution(torch.randn(rows, length, case.hidden, generator=g), head)
    batch = TensorBatch(
        input_ids=ids, attention_mask=torch.ones(rows, length, dtype=torch.long), loss_mask=loss_mask,
        step_index=torch.zeros(rows, length, dtype=torch.long), behaviour_logprobs=behaviour,
        teacher_logprobs=behaviour - 0.1, rewards=torch.full((rows,), float("nan")), policy_version=torch.zeros(rows, dtype=torch.long),
        group_ids=torch.arange(rows), teacher_dist=full,
    )  # fmt: skip
    method = METHODS.get("opd")
    hparams = method.hparams(estimator=case.estimator)
    train_step(model, optimizer, batch, method, hparams, forward_tokens=case.forward_tokens, vocab_chunk=case.vocab_chunk)
    return status_bytes("VmHWM") - base


def run_case(name: str) -> dict:
    """Measure ``name`` in a fresh interpreter; its estimate, measurement and their ratio."""
    out = subprocess.run([sys.executable, __file__, "--measure", name], capture_output=True, text=True, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])["measured"]
    estimated = estimate(CASES[name])
    return {"shape": name, "estimated": estimated, "measured": measured, "ratio": estimated / measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(CASES), action="append", help="only these shapes (repeatable)")
    parser.add_argument("--measure", choices=sorted(CASES), help=argparse.SUPPRESS)  # the child: measure one shape
    args = parser.parse_args()
    if args.measure:
        print(json.dumps({"measured": measure(CASES[args.measure])}))
        return
    print(f"{'shape':<6}{'case':<92}{'estimate MiB':>13}{'measured MiB':>13}{'est/meas':>9}")
    for name in args.shape or sorted(CASES):
        result = run_case(name)
        case = CASES[name]
        what = (f"H={case.hidden} L={case.layers} I={case.ffn} V={VOCAB} {case.rows}x{case.tokens} tokens opd {case.estimator} "
                f"forward_tokens={case.forward_tokens} vocab_chunk={case.vocab_chunk}")  # fmt: skip
        print(f"{name:<6}{what:<92}{result['estimated'] / MIB:>13.0f}{result['measured'] / MIB:>13.0f}{result['ratio']:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
