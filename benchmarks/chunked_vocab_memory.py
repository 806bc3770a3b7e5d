"""Peak memory of one learner step with the full-vocabulary objective whole and chunked (``trainer.vocab_chunk``), on CPU.

    PYTHONPATH=. python benchmarks/chunked_vocab_memory.py --length 2048 --chunk 512

The model is a slice of the Qwen3-0.6B shape (its 151,936-way tied output head, ``--layers`` decoder layers, float32); the
batch is one sequence of ``--length`` random tokens, the loss on its second half, with a random (1, T, V) float32 teacher
distribution. Each way runs in a fresh process: build, then the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``)
and the first step is measured, so the number is that step's own peak above what the process already held (weights, batch,
teacher distribution); it includes the parameters' gradients (the same in both ways). SGD at lr 0 keeps optimizer state
out. The GPU's own number (``torch.cuda.max_memory_allocated``) comes from ``benchmarks/gpu_check.py``'s learner section. Linux only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.peak_memory import peak_rise, status_bytes  # noqa: E402


def one_way(args: argparse.Namespace) -> dict:
    """The child: build, warm up, measure one step's peak RSS above the RSS before it."""
    import torch

    from opd_harness.models.shapes import build_shape_model
    from opd_harness.trajectory import TensorBatch
    from opd_harness.trainers.learner import train_step
    from opd_harness.trainers.objectives.opd import OPD_SPEC, OPDParams

    torch.set_num_threads(args.threads)
    model = build_shape_model("qwen3-0.6b-shape", dtype=torch.float32, layers=args.layers).train()
    vocab, length = model.config.vocab_size, args.length
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, length), generator=g)
    mask = torch.zeros((1, length))
    mask[:, length // 2 :] = 1.0
    teacher_dist = torch.randn((1, length, vocab), generator=g)
    teacher_dist = teacher_dist.log_softmax(-1)
    batch = TensorBatch(
        input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask, step_index=torch.where(mask > 0, 0, -1),
        behaviour_logprobs=torch.zeros((1, length)), teacher_logprobs=torch.zeros((1, length)), rewards=torch.full((1,), float("nan")),
        policy_version=torch.zeros(1, dtype=torch.long), group_ids=torch.zeros(1, dtype=torch.long), teacher_dist=teacher_dist,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    hparams = OPDParams(estimator="full")
    before = status_bytes("VmRSS") / 2**20
    started = time.perf_counter()
    metrics, peak = peak_rise(lambda: train_step(model, optimizer, batch, OPD_SPEC, hparams, vocab_chunk=args.chunk))
    seconds = time.perf_counter() - started
    return {"vocab_chunk": args.chunk, "rss_before_mib": before, "step_peak_above_mib": peak / 2**20,
            "step_s": seconds, "loss": metrics["loss"], "teacher_dist_mib": teacher_dist.numel() * 4 / 2**20}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2048, help="tokens in the one sequence")
    parser.add_argument("--chunk", type=int, default=512, help="trainer.vocab_chunk of the chunked way")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the 0.6B shape slice")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_way(args)))
        return 0
    results = {}
    for chunk in (0, args.chunk):  # whole first, then chunked: each in a fresh process, so neither sees the other's heap
        command = [sys.executable, __file__, "--child", "--length", str(args.length), "--chunk", str(chunk), "--layers",
                   str(args.layers), "--threads", str(args.threads)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results["whole" if chunk == 0 else "chunked"] = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps({"whole" if chunk == 0 else "chunked": results["whole" if chunk == 0 else "chunked"]}), flush=True)
    whole, chunked = results["whole"], results["chunked"]
    results["saved_mib"] = whole["step_peak_above_mib"] - chunked["step_peak_above_mib"]
    results["loss_abs_diff"] = abs(whole["loss"] - chunked["loss"])
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
