"""Model preparation: load a pretrained model, or build a tiny one and warm it up with SFT.

Built models are cached under ``<results root>/cache/models/<role>-<hash>`` keyed by everything
that determines their weights, so repeated runs (and the CPU demo) reuse them.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
from pathlib import Path

import torch

from opd_harness.config import ModelSpec
from opd_harness.models.shapes import build_shape_model, build_shape_tokenizer, get_shape
from opd_harness.models.tiny import build_char_tokenizer, build_tiny_model, load_model_and_tokenizer, save_model_and_tokenizer
from opd_harness.progress import progress
from opd_harness.rollout import reference_trajectories
from opd_harness.trajectory import to_tensor_batch
from opd_harness.trainers.learner import train_step
from opd_harness.trainers.objectives.sft import SFT_SPEC

CACHE_FORMAT = 1  # bump when the way tiny models are built or warmed up changes
READY_MARKER = "READY"


def cache_key(spec: ModelSpec, task) -> str:
    """Hash of the spec, the warm-up task and its options: equal keys mean identical weights."""
    payload = {"spec": spec.model_dump(), "task": task.name, "options": task.options.model_dump(), "format": CACHE_FORMAT}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def prepare_model(
    spec: ModelSpec, role: str, task, problems: list, cache_root: Path, *, show_progress: bool = True, enable_thinking: bool | None = None
):
    """(model, tokenizer, path): loaded from ``spec.path``, from the cache, or built and warmed up now on
    ``problems`` (the task's training split, as the run loaded it). ``enable_thinking`` (trainer.enable_thinking) is set
    in a pretrained model's chat template."""
    if spec.path is not None:
        model, tokenizer = load_model_and_tokenizer(spec.path)
        if enable_thinking is not None:
            from opd_harness.models.hub import set_thinking

            set_thinking(tokenizer, enable_thinking)
        if spec.sft_steps:
            raise ValueError(f"{role}.sft_steps is only supported for tiny models built from 'arch'")
        return model, tokenizer, spec.path
    target = Path(cache_root) / "cache" / "models" / f"{role}-{cache_key(spec, task)}"
    if (target / READY_MARKER).exists():
        model, tokenizer = load_model_and_tokenizer(target)
        if spec.sft_steps and show_progress:
            print(f"{role}: loaded from {target} ({spec.sft_steps} SFT steps done by an earlier run)", file=sys.stderr, flush=True)
        return model, tokenizer, str(target)
    model, tokenizer = build_model(spec)
    model = model.float() if spec.sft_steps else model
    if spec.sft_steps:
        supervised_warmup(model, tokenizer, task, problems, spec, desc=f"SFT {role}", show_progress=show_progress)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model_and_tokenizer(model, tokenizer, tmp)
    (tmp / READY_MARKER).write_text(json.dumps(spec.model_dump(), sort_keys=True))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    model = model.float()  # a published shape is saved in bfloat16 (half the disk) and trained from float32 weights
    if spec.sft_steps and show_progress:
        print(f"{role}: cached at {target}; the next run with the same {role} and task loads it from there", file=sys.stderr, flush=True)
    return model, tokenizer, str(target)


def load_prepared(spec: ModelSpec, path: str, enable_thinking: bool | None = None):
    """(model, tokenizer) from the folder :func:`prepare_model` returned for ``spec``, as it returned them: float32, with a
    pretrained model's chat template set to ``enable_thinking`` (what another process of the run loads)."""
    model, tokenizer = load_model_and_tokenizer(path)
    if spec.path is not None and enable_thinking is not None:
        from opd_harness.models.hub import set_thinking

        set_thinking(tokenizer, enable_thinking)
    return model, tokenizer


def build_model(spec: ModelSpec):
    """(model, tokenizer) built from ``spec.arch``: a tiny shape (float32, character tokenizer) or a published Qwen3
    shape by name (bfloat16, random weights, a stand-in tokenizer with its 151,936-id vocabulary)."""
    if isinstance(spec.arch, str):
        return build_shape_model(spec.arch, seed=spec.seed), build_shape_tokenizer(get_shape(spec.arch).vocab)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(spec.arch, len(tokenizer), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, seed=spec.seed)
    return model, tokenizer


def warmup_schedule(optimizer: torch.optim.Optimizer, lr: float, steps: int):
    """One-cycle learning rate (5 % warm-up, at least two steps of it); a constant rate for runs too short to have one."""
    if steps < 4:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=min(0.5, max(0.05, 2 / steps)))


def supervised_warmup(
    model, tokenizer, task, problems: list, spec: ModelSpec, *, desc: str, show_progress: bool = True
) -> dict[str, float]:
    """SFT on the reference solutions of ``problems`` with a one-cycle learning rate; deterministic under the seed."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    schedule = warmup_schedule(optimizer, spec.sft_lr, spec.sft_steps)
    rng = random.Random(spec.seed)
    hparams = SFT_SPEC.hparams()
    metrics: dict[str, float] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        bar = progress(range(spec.sft_steps), desc=desc, disable=not show_progress, total=spec.sft_steps)
        for _ in bar:
            chosen = rng.sample(problems, min(spec.sft_batch_size, len(problems)))
            batch = to_tensor_batch(reference_trajectories(task, chosen, tokenizer), tokenizer.pad_token_id)
            metrics = train_step(model, optimizer, batch, SFT_SPEC, hparams)
            schedule.step()
            bar.set_postfix(nll=f"{metrics['nll']:.3f}")
    model.eval()
    return metrics
