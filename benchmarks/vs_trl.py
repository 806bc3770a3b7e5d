"""An OPD step of the harness vs TRL's ``DistillationTrainer`` (beta = 1: on-policy reverse KL), side by side in one run.

Both sides train the same student against the same teacher (the cpu-demo shapes, random weights built once with the
preset's seeds and saved for both; ``--vocab 151936`` widens both to a real vocabulary at a tiny hidden size), on the
same prompts (step ``s`` takes the harness's ``sample_problems`` of step ``s``, 64 prompts, one sample each), with the
same work per step: sample ≤ 48 new tokens at temperature 1.0, score the samples with the teacher, one AdamW step
(lr 1e-3, clip 1.0, fp32) on the token-mean full-vocabulary reverse KL, ``--threads`` torch threads (default two). Each side runs in its own
process (``--trl-python``: an environment with TRL, e.g. ``pip install torch==2.13.0 'trl>=1.16,<1.17'``; the
harness side runs with this interpreter), processes alternated A B B A over ``--rounds``; the first ``--warmup`` steps
of every process are discarded. Printed: per-step medians (whole step, generation, teacher scoring + learner step)
with their spread (interquartile range) per side, the ratio, the load average before and after, and the loss
cross-check: both sides' loss functions on one fixed batch (64 of the harness's own samples), which must agree to
1e-6 relative.

    PYTHONPATH=. python benchmarks/vs_trl.py --trl-python /path/to/venv-trl/bin/python [--steps 12] [--warmup 2]
        [--rounds 2] [--vocab 0|151936] [--hidden 0] [--shapes cpu-demo,vocab151936] [--set [SHAPE:]trainer.KEY=VALUE ...]

(``--vocab 0``: the char tokenizer's own vocabulary; ``--hidden`` > 0 sets the student's and teacher's hidden size,
e.g. 32 with ``--vocab 151936``.) ``--shapes`` drives several named shapes (``SHAPES``) one after the other in one
invocation instead, each side by side as above, and prints one table per shape and a summary; a ``--set SHAPE:KEY=VALUE``
applies to that shape only (e.g. ``vocab151936:trainer.prompts_per_step=16``). Needs ``arith`` problems (generated, no
data folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("step", "generate", "teacher_learner")
PHASE_NAMES = {"step": "whole step", "generate": "generation", "teacher_learner": "teacher scoring + learner step"}
SHAPES = {"cpu-demo": (0, 0), "vocab151936": (151_936, 32)}  # name: (vocab, hidden), 0 for the cpu-demo's own
LOSS_RTOL = 1e-6  # issue 46: the two losses on one fixed batch agree to this, relative


def build_models(out: Path, vocab: int, hidden: int) -> dict:
    """The cpu-demo student and teacher (random weights, the preset's seeds) saved under ``out``; their folders."""
    from opd_harness.config import load_preset
    from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model, save_model_and_tokenizer

    preset = load_preset("cpu-demo")
    tok = build_char_tokenizer()
    paths = {}
    for role in ("student", "teacher"):
        arch = dict(preset[role]["arch"])
        if hidden:
            arch.update(hidden=hidden, ffn=2 * hidden)
        model = build_tiny_model(TinyArch(**arch), vocab or len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                                 seed=preset[role]["seed"])  # fmt: skip
        paths[role] = str(out / role)
        save_model_and_tokenizer(model, tok, paths[role])
    return paths


def harness_plan(models: dict, extra: list[str] = (), threads: int = 2):
    """The cpu-demo plan with the saved models, no warm-ups, ``threads`` torch threads, and ``extra`` ``--set`` overrides."""
    from opd_harness.config import build_config
    from opd_harness.plan import load_plan_data, plan_run

    sets = [f"student.path={models['student']}", "student.arch=null", "student.sft_steps=0", f"teacher.path={models['teacher']}",
            "teacher.arch=null", "teacher.sft_steps=0", f"threads={threads}", *extra]  # fmt: skip
    return load_plan_data(plan_run(build_config(preset="cpu-demo", overrides=sets)))


def step_prompts(plan, steps: int) -> list[list[str]]:
    """Every step's prompt texts, as the harness samples them (``sample_problems`` of that step)."""
    from opd_harness.trainers.pipeline import sample_problems

    return [[plan.task.env(p, None).reset() for p in sample_problems(plan.config, plan.train_problems, s)] for s in range(steps)]


def run_harness(models: dict, steps: int, extra: list[str] = (), threads: int = 2) -> list[dict]:
    """The harness's sync in-process step, ``steps`` times: publish the learner's weights to the rollout engine, roll out
    and teacher-score (``make_batch``), learn (``learn``). Per step: seconds of the whole, generation, teacher + learner."""
    import torch

    from opd_harness.backends.hf import HFBackend
    from opd_harness.models.tiny import load_model_and_tokenizer
    from opd_harness.trainers.pipeline import (
        _optimizer_factory, learn, load_rollout_weights, make_batch, sample_problems,
    )  # fmt: skip
    from opd_harness.trainers.teacher import output_head, wrap_hf_teacher
    from opd_harness.trainers.weight_sync import checksum, rollout_copy

    plan = harness_plan(models, extra, threads)
    cfg = plan.config
    torch.set_num_threads(threads)
    student, tok = load_model_and_tokenizer(models["student"])
    engine = HFBackend.load(models["student"], batch_size=cfg.trainer.generate_batch_size, device="cpu")
    teacher_model, teacher_tok = load_model_and_tokenizer(models["teacher"])
    options = {"device": "cpu", "score_chunk": cfg.trainer.vocab_chunk, "score_tokens": cfg.trainer.forward_tokens}
    teacher = wrap_hf_teacher(teacher_model, teacher_tok, cfg.trainer.generate_batch_size, options)
    optimizer = _optimizer_factory(cfg)(student)
    state = plan.method.make_state(plan.hparams) if plan.method.make_state else None
    torch.manual_seed(0)
    out: list[dict] = []
    for step in range(steps):
        started = time.perf_counter()
        weights = rollout_copy(student.state_dict(), torch.float32)
        load_rollout_weights(engine, None, weights, step, checksum(weights))
        metrics: dict = {}
        problems = sample_problems(cfg, plan.train_problems, step)
        batch, _ = make_batch(plan, engine, teacher, problems, step, metrics)
        learn(plan, student, optimizer, batch, state, step, metrics, teacher_head=output_head(teacher))
        whole = time.perf_counter() - started
        if step == 0:
            out.append({"fixed_batch": fixed_batch(batch), "loss": metrics["loss"]})  # the loss before any update
        out.append({"step": whole, "generate": metrics["time_generate_s"], "teacher_learner": whole - metrics["time_generate_s"],
                    "tokens": float(batch.loss_mask.sum())})  # fmt: skip
    return out


def fixed_batch(batch) -> list[dict]:
    """Each row of a harness batch as its prompt and completion token ids (the completion: the loss-masked tokens)."""
    rows = []
    for ids, mask, loss in zip(batch.input_ids.tolist(), batch.attention_mask.tolist(), batch.loss_mask.tolist(), strict=True):
        first = loss.index(1)
        rows.append({"prompt": ids[:first], "completion": [t for t, m in zip(ids, loss, strict=True) if m]})
        assert sum(mask) == first + len(rows[-1]["completion"])  # the completion runs to the end of the row
    return rows


def run_trl(models: dict, prompts: list[list[str]], steps: int, fixed: list[dict], threads: int) -> list[dict]:
    """TRL's ``DistillationTrainer`` (beta 1, fully on-policy) for ``steps`` steps of 64 prompts, ``prompts[s]`` at step
    ``s``; per step the seconds of the whole (``on_step_begin`` to ``on_step_end``), generation (``_generate``) and the rest.
    First, before any update, its loss on the harness's ``fixed`` batch."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(models["student"])
    student = AutoModelForCausalLM.from_pretrained(models["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(models["teacher"], dtype=torch.float32)
    args = DistillationConfig(
        output_dir=tempfile.mkdtemp(prefix="vs-trl-"), per_device_train_batch_size=len(prompts[0]), gradient_accumulation_steps=1,
        learning_rate=1e-3, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim="adamw_torch",
        max_steps=steps, bf16=False, fp16=False, gradient_checkpointing=False, beta=1.0, temperature=1.0, top_p=1.0,
        max_completion_length=48, shuffle_dataset=False, logging_steps=10**6, save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, seed=0, disable_dropout=True,
    )  # fmt: skip
    data = Dataset.from_dict({"prompt": [p for step in prompts[:steps] for p in step]})
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=data, processing_class=tok)
    out: list[dict] = [{"loss": trl_loss(trainer, fixed)}]
    seen: list[list[str]] = []
    generate, clock = trainer._generate, {}

    def timed_generate(batch_prompts):
        started = time.perf_counter()
        result = generate(batch_prompts)
        clock["generate"] = time.perf_counter() - started
        seen.append(list(batch_prompts))
        return result

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **k):
            clock["started"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            whole = time.perf_counter() - clock["started"]
            out.append({"step": whole, "generate": clock["generate"], "teacher_learner": whole - clock["generate"]})

    trainer._generate = timed_generate
    trainer.add_callback(Steps())
    trainer.train()
    if [sorted(s) for s in seen] != [sorted(s) for s in prompts[:steps]]:
        raise SystemExit("TRL's steps did not take the harness's prompts step for step")
    return out


def trl_loss(trainer, fixed: list[dict]) -> float:
    """TRL's loss (``_compute_loss``: chunked reverse KL over the completion tokens, token mean) on ``fixed``, no update."""
    import torch

    inputs = trl_inputs(fixed, trainer.processing_class.pad_token_id)
    student = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        loss, _, _ = trainer._compute_loss(student, inputs, inputs["completion_mask"].sum())
    return float(loss)


def trl_inputs(fixed: list[dict], pad: int) -> dict:
    """``fixed`` as TRL batches it: prompts left-padded, completions right-padded, with their masks."""
    import torch

    width, length = max(len(r["prompt"]) for r in fixed), max(len(r["completion"]) for r in fixed)
    return {
        "prompt_ids": torch.tensor([[pad] * (width - len(r["prompt"])) + r["prompt"] for r in fixed]),
        "prompt_mask": torch.tensor([[0] * (width - len(r["prompt"])) + [1] * len(r["prompt"]) for r in fixed]),
        "completion_ids": torch.tensor([r["completion"] + [pad] * (length - len(r["completion"])) for r in fixed]),
        "completion_mask": torch.tensor([[1] * len(r["completion"]) + [0] * (length - len(r["completion"])) for r in fixed]),
    }


def child(args: argparse.Namespace) -> None:
    """One side's process: its steps as JSON lines on stdout."""
    spec = json.loads(Path(args.spec).read_text())
    if args.child == "harness":
        rows = run_harness(spec["models"], spec["steps"], spec.get("set", []), spec["threads"])
    else:
        rows = run_trl(spec["models"], spec["prompts"], spec["steps"], spec["fixed"], spec["threads"])
    print("RESULT " + json.dumps(rows), flush=True)


def side_run(python: str, side: str, spec: Path) -> list[dict]:
    """Run one side in a fresh process; its rows."""
    threads = json.loads(spec.read_text())["threads"]  # OpenMP's pool sized like torch's on both sides
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(Path(__file__).resolve().parents[1])),
           "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([python, __file__, "--child", side, "--spec", str(spec)], capture_output=True, text=True, env=env)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"{side} side exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(line.removeprefix("RESULT "))


def load() -> str:
    """The 1-, 5- and 15-minute load averages."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def quartiles(values: list[float]) -> str:
    """median [q1, q3] of ``values``."""
    q1, med, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return f"{med:.3f} [{q1:.3f}, {q3:.3f}]"


def report(side: str, steps: list[dict]) -> None:
    """One process's kept steps, as it finishes."""
    print(f"  {side:8s} process: " + "  ".join(f"{phase} {statistics.median(r[phase] for r in steps):.3f}" for phase in PHASES)
          + f" s (medians of {len(steps)}); load {load()}", flush=True)  # fmt: skip


def shape_sets(sets: list[str], shape: str) -> list[str]:
    """The ``--set`` overrides of ``shape``: plain ``KEY=VALUE`` ones and its own ``SHAPE:KEY=VALUE`` ones."""
    out = []
    for item in sets:
        name, sep, rest = item.partition(":")
        if not sep or "=" in name:
            out.append(item)
        elif name == shape:
            out.append(rest)
    return out


def drive(args: argparse.Namespace, vocab: int, hidden: int, sets: list[str]) -> dict:
    """One shape side by side: models, the ABBA processes (each reported as it ends), both sides' kept steps and losses."""
    root = Path(tempfile.mkdtemp(prefix="vs-trl-"))
    models = build_models(root, vocab, hidden)
    plan = harness_plan(models, sets)
    spec = {"models": models, "steps": args.steps, "threads": args.threads, "prompts": step_prompts(plan, args.steps), "set": sets}
    (root / "spec.json").write_text(json.dumps(spec))
    pythons = {"harness": sys.executable, "trl": args.trl_python}
    print(f"vocab {vocab or 'char'}, hidden {hidden or 'cpu-demo'}, {args.steps} steps/process ({args.warmup} discarded), "
          f"{args.rounds} ABBA rounds, threads {args.threads}, harness --set {sets}; loadavg {load()}", flush=True)  # fmt: skip
    kept: dict[str, list[dict]] = {"harness": [], "trl": []}
    losses: dict[str, float] = {}
    first = side_run(pythons["harness"], "harness", root / "spec.json")  # the fixed batch comes from the harness's first step
    spec["fixed"], losses["harness"] = first[0]["fixed_batch"], first[0]["loss"]
    (root / "spec.json").write_text(json.dumps(spec))
    kept["harness"] += first[1 + args.warmup :]
    report("harness", first[1 + args.warmup :])
    order = ["trl", "trl", "harness"] + [s for r in range(1, args.rounds) for s in (("harness", "trl", "trl", "harness") if r % 2
                                                                                    else ("trl", "harness", "harness", "trl"))]  # fmt: skip
    for side in order:
        rows = side_run(pythons[side], side, root / "spec.json")
        losses.setdefault(side, rows[0]["loss"])
        steps = rows[1 + args.warmup :]
        kept[side] += steps
        report(side, steps)
    return {"kept": kept, "losses": losses, "batch": len(spec["fixed"])}


def table(shape: str, result: dict) -> dict:
    """Print ``shape``'s per-step medians [quartiles] side by side, the ratio and the loss cross-check; return the summary."""
    kept, losses = result["kept"], result["losses"]
    n = {side: len(kept[side]) for side in kept}
    h, t = (statistics.median(r["step"] for r in kept[s]) for s in ("harness", "trl"))
    rel = abs(losses["harness"] - losses["trl"]) / abs(losses["trl"])
    print(f"\n| {shape}: per step (n = {n['harness']} harness, {n['trl']} TRL) | harness | TRL | harness / TRL |")
    print("|---|---|---|---|")
    for phase in PHASES:
        ratio = f"{t / h:.2f}x TRL's steps per second" if phase == "step" else ""
        print(f"| {PHASE_NAMES[phase]} | {quartiles([r[phase] for r in kept['harness']])} s | "
              f"{quartiles([r[phase] for r in kept['trl']])} s | {ratio} |")  # fmt: skip
    verdict = "OK" if rel <= LOSS_RTOL else "MISMATCH"
    print(f"loss on one fixed batch of {result['batch']} samples: harness {losses['harness']:.9f}, TRL {losses['trl']:.9f}, "
          f"relative difference {rel:.2e} ({verdict} at {LOSS_RTOL:g}); loadavg {load()}", flush=True)  # fmt: skip
    return {"ratio": t / h, "rel": rel, "verdict": verdict}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", help="an interpreter with TRL installed (the TRL side's process)")
    parser.add_argument("--steps", type=int, default=12, help="steps per process, warm-ups included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each process discarded")
    parser.add_argument("--rounds", type=int, default=2, help="A B B A rounds (two processes per side each)")
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size of both models (0: the char tokenizer's)")
    parser.add_argument("--hidden", type=int, default=0, help="hidden size of both models (0: the cpu-demo shapes)")
    parser.add_argument("--shapes", help=f"comma-separated named shapes driven one after the other ({', '.join(SHAPES)}); "
                        "replaces --vocab and --hidden")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each side (1 on a loaded machine: 2 threads "
                        "spin at their barriers when the cores are shared)")
    parser.add_argument("--set", action="append", default=[], help="a harness override [SHAPE:]KEY=VALUE, e.g. "
                        "trainer.graph_memory_gib=16 or vocab151936:trainer.prompts_per_step=16 (that shape only)")  # fmt: skip
    parser.add_argument("--child", choices=("harness", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if not args.trl_python:
        parser.error("--trl-python is required")
    shapes = {"": (args.vocab, args.hidden)}
    if args.shapes:
        names = [name.strip() for name in args.shapes.split(",") if name.strip()]
        unknown = [name for name in names if name not in SHAPES]
        if unknown or not names:
            parser.error(f"--shapes {args.shapes!r}: unknown {', '.join(unknown) or 'empty'}; shapes: {', '.join(SHAPES)}")
        shapes = {name: SHAPES[name] for name in names}
    summary = {}
    for shape, (vocab, hidden) in shapes.items():
        label = shape or f"vocab {vocab or 'char'}, hidden {hidden or 'cpu-demo'}"
        summary[label] = table(label, drive(args, vocab, hidden, shape_sets(args.set, shape)))
    if len(summary) > 1:
        print("\nsummary: " + "; ".join(f"{label} {r['ratio']:.2f}x TRL's steps/s, loss {r['rel']:.1e} apart ({r['verdict']})"
                                          for label, r in summary.items()))  # fmt: skip


if __name__ == "__main__":
    main()
