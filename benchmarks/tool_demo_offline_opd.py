"""The tool demo's OPD without a sandbox: does the student get better (issue 26 item 4)?

The training step of ``--preset tool-demo`` on its real path (``rollout`` → ``to_tensor_batch`` → ``score_teacher`` →
``train_step``; 16 prompts × 4 episodes at temperature 1.0, AdamW with 5 warm-up steps), with the in-process
interpreter of ``tool_demo_kl_positions.py`` instead of the Docker sandbox. Every ``--every`` steps it prints the
student's accuracy and invalid-tool rate on the first 25 test problems × 4 (temperature 1.0, top_p 0.95, the preset's
evaluation sampling; accuracy here: the last ``\\boxed{}`` equals the value as an integer) and its teacher-forced NLL
per token on their reference episodes. ``--student`` may be any warm-up (e.g. one with more SFT steps).

Usage: ``PYTHONPATH=. python benchmarks/tool_demo_offline_opd.py --student DIR --teacher DIR [--lr 1e-3]
[--steps 20] [--every 10] [--teacher-top-k 0]``. Results are in README's tool-use section.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

import torch

from benchmarks.tool_demo_kl_positions import demo_task_and_models, reference_nll
from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.rollout import reference_trajectories, rollout
from opd_harness.trajectory import to_tensor_batch
from opd_harness.trainers.learner import train_step
from opd_harness.trainers.objectives.opd import OPD_SPEC, OPDParams
from opd_harness.trainers.teacher import score_teacher

BOXED = re.compile(r"\\boxed\{([^}]*)\}")


def answered(traj) -> int | None:
    """The episode's last ``\\boxed{}`` as an integer (None when there is none or it is not one)."""
    found = BOXED.findall("".join(s.text for s in traj.model_segments))
    return int(found[-1]) if found and found[-1].isdigit() else None


def evaluate(student: HFBackend, task, problems: list, refs) -> str:
    trajs = rollout(student, task, problems, SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=64, n=4, seed=99))
    by_id = {p.id: p for p in problems}
    accuracy = sum(answered(t) == int(by_id[t.problem_id].answer) for t in trajs) / len(trajs)
    invalid = sum(t.metadata["episode"].get("invalid_tool_calls", 0) > 0 for t in trajs) / len(trajs)
    return f"accuracy {accuracy:.3f}, invalid tool rate {invalid:.3f}, reference NLL/token {reference_nll(student, refs):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--teacher-top-k", type=int, default=0, help="a top-k teacher signal of this k (0: the full distribution)")
    args = parser.parse_args()
    task, student, teacher = demo_task_and_models(args.student, args.teacher)
    student_model, tok = student.model, student.tokenizer
    teacher.model.requires_grad_(False)
    train, test = task.read_problems("train", Path(".")), task.read_problems("test", Path("."))[:25]
    refs = to_tensor_batch(reference_trajectories(task, test, tok), student.pad_id)
    hparams = OPDParams(estimator="full")
    kind = "topk" if args.teacher_top_k else "full"
    optimizer = torch.optim.AdamW(student_model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    print(f"step 0: {evaluate(student, task, test, refs)}", flush=True)
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        sampling = SamplingParams(temperature=1.0, max_new_tokens=64, n=4, seed=step)
        trajs = rollout(student, task, random.Random(step).sample(train, 16), sampling)
        batch = to_tensor_batch(trajs, student.pad_id)
        score_teacher(teacher, batch, kind=kind, top_k=args.teacher_top_k)
        metrics = train_step(student_model, optimizer, batch, OPD_SPEC, hparams)
        schedule.step()
        invalid = sum(t.metadata["episode"].get("invalid_tool_calls", 0) > 0 for t in trajs) / len(trajs)
        print(f"  step {step}: KL {metrics['teacher_kl_full']:.3f}, training invalid rate {invalid:.2f} "
              f"({time.perf_counter() - started:.1f} s)", flush=True)
        if step % args.every == 0:
            print(f"step {step}: {evaluate(student, task, test, refs)}", flush=True)


if __name__ == "__main__":
    main()
