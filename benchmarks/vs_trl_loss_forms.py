"""Where the harness's and TRL's OPD losses part at a real vocabulary: the reverse KL's float32 arithmetic, side by side.

Builds the ``vs_trl.py`` models (``--vocab``, ``--hidden``), runs one harness step for the fixed batch (its samples and
the harness's loss before any update), then on each side's own last hidden states at the completion positions (the
harness's right-padded forward; TRL's ``_get_last_hidden_state`` of its left-padded batch, in the TRL environment)
computes the token-mean reverse KL in several forms: the plain float32 sum over log-softmaxes (the harness's form before
the mass correction), the harness's ``full_reverse_kl``, TRL's online log-sum-exp over 32,768-wide vocabulary tiles
(``trl.kernels.chunked_divergence``'s torch path for beta = 1, which reproduces TRL's loss), and float64. Run:

    PYTHONPATH=. python benchmarks/vs_trl_loss_forms.py --trl-python VENV_TRL/bin/python [--vocab 151936] [--hidden 32]
        [--prompts 16]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402

TRL_TILE = 32_768  # trl.kernels.chunked_divergence.VOCAB_CHUNK_SIZE


def trl_tiles(z_s, z_t):
    """Per-position KL(student ‖ teacher) from float32 logits as TRL 1.16's torch path computes it (beta = 1):
    E_s[z_s − z_t] − log Z_s + log Z_t from online max / sum statistics over vocabulary tiles."""
    import torch

    n = z_s.shape[0]
    s_max, t_max = torch.full((n,), -math.inf), torch.full((n,), -math.inf)
    s_sum, t_sum, gap = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for start in range(0, z_s.shape[1], TRL_TILE):
        a, b = z_s[:, start : start + TRL_TILE], z_t[:, start : start + TRL_TILE]
        top = torch.maximum(s_max, a.amax(-1))
        rescale, e = torch.exp(s_max - top), torch.exp(a - top[:, None])
        s_sum, gap, s_max = s_sum * rescale + e.sum(-1), gap * rescale - (e * (b - a)).sum(-1), top
        top = torch.maximum(t_max, b.amax(-1))
        t_sum, t_max = t_sum * torch.exp(t_max - top) + torch.exp(b - top[:, None]).sum(-1), top
    return gap / s_sum - (s_max + torch.log(s_sum)) + (t_max + torch.log(t_sum))


def forms(h_s, w_s, h_t, w_t, harness_kl=None) -> dict[str, float]:
    """Token-mean KL over the N positions of (N, H) hidden states ``h_*`` and (V, H) heads ``w_*``, in each form."""
    import torch

    z_s, z_t = h_s.float() @ w_s.float().T, h_t.float() @ w_t.float().T
    log_s, log_t = torch.log_softmax(z_s, -1), torch.log_softmax(z_t, -1)
    out = {"plain float32 sum": float((log_s.exp() * (log_s - log_t)).sum(-1).mean())}
    if harness_kl is not None:
        out["harness full_reverse_kl"] = float(harness_kl(log_s, log_t).mean())
    out["TRL tiles (float32)"] = float(trl_tiles(z_s, z_t).mean())
    l64_s, l64_t = torch.log_softmax(z_s.double(), -1), torch.log_softmax(z_t.double(), -1)
    out["float64"] = float((l64_s.exp() * (l64_s - l64_t)).sum(-1).mean())
    return out


def harness_side(args: argparse.Namespace) -> dict:
    """Models, the fixed batch and the harness's loss, and the forms on the harness's hidden states."""
    import torch

    from opd_harness.models.tiny import load_model_and_tokenizer
    from opd_harness.trainers.objectives.opd import full_reverse_kl

    models = vs_trl.build_models(Path(tempfile.mkdtemp(prefix="kl-forms-")), args.vocab, args.hidden)
    first = vs_trl.run_harness(models, 1, [f"trainer.prompts_per_step={args.prompts}"], threads=1)[0]
    fixed = first["fixed_batch"]
    seqs = [r["prompt"] + r["completion"] for r in fixed]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    rows = [i for i, r in enumerate(fixed) for _ in r["completion"]]
    cols = [len(r["prompt"]) + j - 1 for r in fixed for j in range(len(r["completion"]))]  # the state predicting token j
    states = []
    for role in ("student", "teacher"):
        model, _ = load_model_and_tokenizer(models[role])
        with torch.no_grad():
            hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
        states += [hidden[rows, cols], model.get_output_embeddings().weight.detach()]
    return {"models": models, "fixed": fixed, "loss": first["loss"], "forms": forms(*states, harness_kl=full_reverse_kl)}


def trl_side(spec: dict) -> dict:
    """TRL's loss on the fixed batch and the forms on TRL's hidden states (in the TRL environment)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    torch.set_num_threads(1)
    models, fixed = spec["models"], spec["fixed"]
    tok = AutoTokenizer.from_pretrained(models["student"])
    student = AutoModelForCausalLM.from_pretrained(models["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(models["teacher"], dtype=torch.float32)
    config = DistillationConfig(output_dir=tempfile.mkdtemp(prefix="kl-forms-"), per_device_train_batch_size=len(fixed), max_steps=1,
                                beta=1.0, max_completion_length=48, report_to=[], use_cpu=True, save_strategy="no")  # fmt: skip
    data = Dataset.from_dict({"prompt": ["1+1="] * len(fixed)})
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=data, processing_class=tok)
    inputs = vs_trl.trl_inputs(fixed, tok.pad_token_id)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    trained = inputs["completion_mask"].reshape(-1) > 0
    states = []
    for model in (trainer.accelerator.unwrap_model(trainer.model), trainer.teacher_model):
        with torch.no_grad():
            hidden = trainer._get_last_hidden_state(model, ids, attention, inputs["completion_ids"].shape[1])
        states += [hidden.reshape(-1, hidden.shape[-1])[trained], model.get_output_embeddings().weight.detach()]
    return {"loss": vs_trl.trl_loss(trainer, fixed), "forms": forms(*states)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", help="an interpreter with TRL installed")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=16, help="samples in the fixed batch (trainer.prompts_per_step)")
    parser.add_argument("--trl-spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_spec:
        print("RESULT " + json.dumps(trl_side(json.loads(Path(args.trl_spec).read_text()))), flush=True)
        return
    if not args.trl_python:
        parser.error("--trl-python is required")
    import torch

    torch.set_num_threads(1)
    ours = harness_side(args)
    spec = Path(tempfile.mkdtemp(prefix="kl-forms-")) / "spec.json"
    spec.write_text(json.dumps({"models": ours["models"], "fixed": ours["fixed"]}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([args.trl_python, __file__, "--trl-spec", str(spec)], capture_output=True, text=True, env=env)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"TRL side exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    theirs = json.loads(line.removeprefix("RESULT "))
    reference = theirs["loss"]
    positions = sum(len(r["completion"]) for r in ours["fixed"])
    print(f"vocab {args.vocab}, hidden {args.hidden}, {len(ours['fixed'])} samples, {positions} completion tokens")
    print("| value | on the harness's hidden states | on TRL's hidden states |\n|---|---|---|")
    print(f"| the side's own loss | {ours['loss']:.10f} | {reference:.10f} |")
    for name in ours["forms"]:
        cells = ("" if v is None else f"{v:.10f} ({(v - reference) / reference:+.1e} vs TRL)" for v in (ours["forms"].get(name),
                                                                                                   theirs["forms"].get(name)))  # fmt: skip
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
