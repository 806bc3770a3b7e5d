"""A preset's fixed-step SFT warm-up, logged per step, to compare CPU kernel paths and thread counts.

Runs the warm-up exactly as ``opd_harness.trainers.warmup.supervised_warmup`` does (one round of ``sft_steps``) and writes
``log.jsonl`` (step, NLL, learning rate, seconds; a hash of the weights at steps 1-3 and every 10) and the weights every
``--save-every`` steps. Run it twice with different ``ATEN_CPU_CAPABILITY`` (``avx2``, ``avx512``) or ``--threads`` and
compare the logs; evaluate the saved folders with ``harness eval --model DIR``.

    ATEN_CPU_CAPABILITY=avx512 python benchmarks/warmup_divergence.py --preset tool-demo --out /tmp/wd-avx512
    ATEN_CPU_CAPABILITY=avx2   python benchmarks/warmup_divergence.py --preset tool-demo --out /tmp/wd-avx2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

import torch

from opd_harness.config import ModelSpec, load_preset
from opd_harness.models.tiny import save_model_and_tokenizer
from opd_harness.plan import make_task
from opd_harness.rollout import reference_trajectories
from opd_harness.trainers.learner import train_step
from opd_harness.trainers.objectives.sft import SFT_SPEC
from opd_harness.trainers.warmup import build_model, warmup_schedule
from opd_harness.trajectory import to_tensor_batch


def weights_hash(model: torch.nn.Module) -> str:
    """First 12 hex digits of the SHA-256 of every tensor's float32 bytes: equal hashes mean bit-identical weights."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().float().numpy().tobytes())
    return digest.hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tool-demo")
    parser.add_argument("--role", default="teacher", choices=["teacher", "student"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--stop", type=int, default=0, help="stop after this many steps (0: the whole round)")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    preset = load_preset(args.preset)
    fields = {k: v for k, v in preset[args.role].items() if k in ModelSpec.model_fields and k != "sft_target"}
    spec = ModelSpec(**fields)
    task = make_task(preset["task"], preset.get("task_args", {}))
    problems = task.load("train")
    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = build_model(spec)
    model = model.float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    schedule = warmup_schedule(optimizer, spec.sft_lr, spec.sft_steps)
    rng, hparams, started = random.Random(spec.seed), SFT_SPEC.hparams(), time.perf_counter()
    print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "init": weights_hash(model)}))  # fmt: skip
    with (args.out / "log.jsonl").open("w") as log, torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        for step in range(1, (args.stop or spec.sft_steps) + 1):
            chosen = rng.sample(problems, min(spec.sft_batch_size, len(problems)))
            batch = to_tensor_batch(reference_trajectories(task, chosen, tokenizer), tokenizer.pad_token_id)
            metrics = train_step(model, optimizer, batch, SFT_SPEC, hparams)
            schedule.step()
            row = {"step": step, "nll": metrics["nll"], "lr": schedule.get_last_lr()[0], "seconds": round(time.perf_counter() - started, 1)}
            if step <= 3 or step % 10 == 0:
                row["hash"] = weights_hash(model)
            log.write(json.dumps(row) + "\n")
            log.flush()
            if step % args.save_every == 0 or step == spec.sft_steps:
                model.eval()
                save_model_and_tokenizer(model, tokenizer, args.out / f"step{step}")
                model.train()


if __name__ == "__main__":
    main()
