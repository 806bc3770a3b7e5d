"""Where the tool demo's OPD KL comes from, and where full-vocabulary OPD moves the student (issue 26 item 4).

Rolls the student out on ``--problems`` arith_tool training problems × 4 through the real path (``rollout`` →
``to_tensor_batch`` → ``score_teacher`` with the full distribution), with an in-process interpreter instead of the
sandbox (it runs only the reference's ``print(f"{EXPR:0Wd}")`` form; anything else gets a SyntaxError observation,
which the demo's models never need otherwise). It prints:

1. alignment: the largest gap between the pipeline's stored teacher distribution / student log-probs on trained
   positions and each model's own unpadded forward over that episode's prefix (``tests/test_multiturn_alignment.py``
   pins the same on tiny models);
2. KL(student ‖ teacher) per position class (turn × digit / template / EOS);
3. at the positions where the teacher copies a digit: the normalised geometric mean of the teacher's distributions
   there (the minimiser of the expected reverse KL for a student that cannot tell which digit comes, so cannot copy)
   and its mass off the digits;
4. the student's mass off the digits at those positions, and its teacher-forced NLL on held-out reference
   episodes, before and after ``--updates`` full-KL OPD updates on that one batch (lr ``--lr``).

Usage: ``PYTHONPATH=. python benchmarks/tool_demo_kl_positions.py --student DIR --teacher DIR`` (the tool-demo
preset's warm-ups: ``<results root>/cache/models/{student,teacher}-*``). Results are in README's tool-use section.
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import torch

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.config import build_config
from opd_harness.models.tiny import load_model_and_tokenizer
from opd_harness.plan import make_task
from opd_harness.rollout import reference_trajectories, rollout
from opd_harness.trajectory import to_tensor_batch
from opd_harness.trainers.learner import train_step
from opd_harness.trainers.objectives import masked_mean
from opd_harness.trainers.objectives.opd import OPD_SPEC, OPDParams
from opd_harness.trainers.teacher import score_teacher

PRINT_FORM = re.compile(r'\s*print\(f"\{([0-9+\-*]+):0(\d+)d\}"\)\s*')


class CellResult:
    def __init__(self, output: str, raised: bool = False) -> None:
        self.status, self.output, self.raised, self.error = "ok", output, raised, None


class ArithInterpreter:
    """Runs only ``print(f"{EXPR:0Wd}")`` (digits and + - *): what the demo's reference calls are."""

    def run_cell(self, code: str, timeout_s: float) -> CellResult:
        match = PRINT_FORM.fullmatch(code)
        if match is None:
            return CellResult("SyntaxError: invalid syntax\n", raised=True)
        return CellResult(f"{eval(match.group(1), {'__builtins__': {}}, {}):0{int(match.group(2))}d}\n")  # noqa: S307 - digits, + - *

    def close(self) -> None:
        pass


def reference_nll(student: HFBackend, refs) -> float:
    with torch.no_grad():
        logp = student.score(refs.input_ids, refs.attention_mask)["logprobs"]
    return -float(masked_mean(logp, refs.loss_mask))


def demo_task_and_models(student_dir: str, teacher_dir: str) -> tuple:
    """The tool-demo preset's ``arith_tool`` (its interpreter in-process, no sandbox) and the student and teacher
    backends loaded from their directories, on one torch thread."""
    torch.set_num_threads(1)
    cfg = build_config(preset="tool-demo")
    task = make_task("arith_tool", {"arith_tool": {**cfg.task_args["arith_tool"], "sandbox": "local"}})
    task.open_interpreter = ArithInterpreter  # no sandbox
    student_model, tok = load_model_and_tokenizer(student_dir)
    teacher_model, _ = load_model_and_tokenizer(teacher_dir)
    return task, HFBackend(student_model, tok), HFBackend(teacher_model, tok)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--problems", type=int, default=16)
    parser.add_argument("--updates", type=int, default=12)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    task, student, teacher = demo_task_and_models(args.student, args.teacher)
    student_model, teacher_model, tok = student.model, teacher.model, student.tokenizer
    problems = random.Random(args.seed).sample(task.read_problems("train", Path(".")), args.problems)
    trajs = rollout(student, task, problems, SamplingParams(temperature=1.0, max_new_tokens=64, n=4, seed=args.seed))
    batch = to_tensor_batch(trajs, student.pad_id)
    score_teacher(teacher, batch, kind="full")
    trained = batch.loss_mask > 0
    with torch.no_grad():
        own = student.score(batch.input_ids, batch.attention_mask, want=("full",))["full"]
    gap_t = gap_s = 0.0
    kl = (own.exp() * (own - batch.teacher_dist)).sum(-1)
    classes: dict[str, list[float]] = {}
    for row, traj in enumerate(trajs):
        ids = traj.prompt_ids + traj.response_ids
        with torch.no_grad():
            direct_t = torch.log_softmax(teacher_model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
            direct_s = torch.log_softmax(student_model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
        on = trained[row, 1 : len(ids)]
        gap_t = max(gap_t, float((batch.teacher_dist[row, 1 : len(ids)] - direct_t)[on].abs().max()))
        gap_s = max(gap_s, float((own[row, 1 : len(ids)] - direct_s)[on].abs().max()))
        at = len(traj.prompt_ids)
        for segment in traj.segments:
            for token in segment.token_ids:
                if segment.kind == "model":
                    char = tok.decode([token])
                    kind = "eos" if token == tok.eos_token_id else "digit" if char.isdigit() else "template"
                    classes.setdefault(f"turn {segment.step} {kind}", []).append(float(kl[row, at]))
                at += 1
    print(f"{len(trajs)} episodes, {int(trained.sum())} trained tokens")
    print(f"alignment: max |stored - direct| on trained positions: teacher {gap_t:.1e}, student {gap_s:.1e}")
    print(f"KL(student || teacher) per trained token: {float(masked_mean(kl, batch.loss_mask)):.3f}; by class:")
    for name in sorted(classes):
        values = classes[name]
        print(f"  {name:<18} {sum(values) / len(values):6.3f} nats  ({len(values)} tokens)")
    digits = torch.tensor(tok.convert_tokens_to_ids(list("0123456789")))
    best = batch.teacher_dist.max(-1)
    copies = trained & torch.isin(best.indices, digits) & (best.values.exp() > 0.9)
    geometric = torch.softmax(batch.teacher_dist[copies].mean(0), -1)
    print(f"digit-copy positions (teacher's top token a digit at p > 0.9): {int(copies.sum())}")
    print(f"  normalised geometric mean of the teacher there: mass off digits {1 - float(geometric[digits].sum()):.3f}")
    refs_problems = task.read_problems("test", Path("."))[:25]
    refs = to_tensor_batch(reference_trajectories(task, refs_problems, tok), student.pad_id)

    def off_digits() -> float:
        with torch.no_grad():
            dist = student.score(batch.input_ids, batch.attention_mask, want=("full",))["full"][copies].exp()
        return 1 - float(dist[:, digits].sum(-1).mean())

    print(f"  student mass off digits there {off_digits():.3f}, reference NLL/token {reference_nll(student, refs):.3f} (before)")
    optimizer = torch.optim.AdamW(student_model.parameters(), lr=args.lr, weight_decay=0.0)
    for _ in range(args.updates):
        train_step(student_model, optimizer, batch, OPD_SPEC, OPDParams(estimator="full"))
    print(f"  student mass off digits there {off_digits():.3f}, reference NLL/token {reference_nll(student, refs):.3f} "
          f"(after {args.updates} full-KL updates on this batch, lr {args.lr:g})")


if __name__ == "__main__":
    main()
