"""Does a tiny model learn to copy in ``arith_tool`` episodes? SFT on the reference episodes, measured under teacher forcing.

The tool-demo's failure (issue 26 item 4) is copying: the expression into the code, the printed value into
``\\boxed{}``. This warms a tiny model up on ``arith_tool``'s reference episodes (constant learning rate, the SFT
objective of the warm-up) and every ``--every`` steps prints, over the first 50 test problems' reference
episodes: the mean probability that sampling at temperature 1.0 / 0.3 reproduces the whole episode (a lower bound
on that temperature's Avg@1 when the tool prints what the reference shows), and the share whose every token is the
greedy choice (greedy decoding would solve it). No sandbox: the observations are the reference's.

Usage: ``PYTHONPATH=. python benchmarks/tool_demo_copy.py [--hidden 192 --layers 3 --ffn 384] [--steps 400]
[--task-arg min_operand=100 --task-arg max_operand=999 --task-arg value_width=10]`` (those task options are the
tool-demo preset's). Measured 2026-12-02 with them (the preset teacher's shape, 1 thread, load average 3-10): P(episode)
at T 1.0 / greedy share 0.000 / 0.00 at step 50, 0.008 / 0.06 at 100, 0.402 / 0.46 at 150, 0.948 / 1.00 at 200.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import yaml

from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model
from opd_harness.plan import make_task
from opd_harness.rollout import reference_trajectories
from opd_harness.trajectory import to_tensor_batch
from opd_harness.trainers.learner import train_step
from opd_harness.trainers.objectives.sft import SFT_SPEC


def copy_scores(model, batch) -> dict[str, float]:
    """Teacher-forced: mean P(whole reference episode) at T 1.0 and 0.3, and the share that greedy decoding reproduces."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()[:, :-1]
    target, mask = batch.input_ids[:, 1:], batch.loss_mask[:, 1:]
    out = {}
    for temperature in (1.0, 0.3):
        logp = torch.log_softmax(logits / temperature, -1).gather(-1, target[..., None])[..., 0] * mask
        out[f"p_episode_T{temperature}"] = round(logp.sum(-1).exp().mean().item(), 3)
    out["greedy_exact"] = round(((logits.argmax(-1) == target).float() * mask + (1 - mask)).prod(-1).mean().item(), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=384)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--task-arg", action="append", default=[], help="arith_tool option KEY=VALUE (YAML value)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    options = {"n_train": 2000, "n_test": 100, "sandbox": "local"}
    options.update({k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.task_arg)})
    task = make_task("arith_tool", {"arith_tool": options})
    train, test = task.read_problems("train", Path(".")), task.read_problems("test", Path("."))[:50]
    tokenizer = build_char_tokenizer()
    arch = TinyArch(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=2, ffn=args.ffn)
    model = build_tiny_model(arch, len(tokenizer), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    held_out = to_tensor_batch(reference_trajectories(task, test, tokenizer), tokenizer.pad_token_id)
    rng, start = random.Random(0), time.perf_counter()
    for step in range(1, args.steps + 1):
        chosen = rng.sample(train, args.batch_size)
        model.train()
        metrics = train_step(model, optimizer, to_tensor_batch(reference_trajectories(task, chosen, tokenizer), tokenizer.pad_token_id),
                             SFT_SPEC, SFT_SPEC.hparams())
        if step % args.every == 0:
            model.eval()
            row = {"step": step, "seconds": round(time.perf_counter() - start), "nll": round(metrics["nll"], 3)}
            print(json.dumps({**row, **copy_scores(model, held_out)}), flush=True)


if __name__ == "__main__":
    main()
