"""Model preparation: load a pretrained model, or build a tiny one and warm it up with SFT.

Built models are cached under ``<results root>/cache/models/<role>-<hash>`` keyed by everything
that determines their weights, so repeated runs (and the CPU demo) reuse them. Each built model's folder holds
``warmup.json``, what its warm-up did and reached (:func:`warmup_record`): steps, final NLL, seed, torch threads,
CPU kernel capability and, with ``sft_target``, the held-out Avg@k after every round.

A warm-up's weights are bit-identical on one machine and torch build (any thread count), but not across CPU kernel
paths (AVX2 vs AVX-512 round differently), and a fixed number of steps can then end on either side of the point where a
tiny model learns to copy. ``sft_target`` makes the quality, not the step count, the specification: rounds of
``sft_steps`` until held-out Avg@k reaches ``avg_at_k`` (or ``max_steps``, when the run fails or warns: ``on_miss``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import random
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.config import ModelSpec, SFTTarget
from opd_harness.errors import ConfigError
from opd_harness.evaluation import evaluate_task
from opd_harness.models.shapes import build_shape_model, build_shape_tokenizer, get_shape
from opd_harness.models.tiny import build_char_tokenizer, build_tiny_model, load_model_and_tokenizer, save_model_and_tokenizer
from opd_harness.progress import progress
from opd_harness.rollout import reference_trajectories
from opd_harness.trajectory import to_tensor_batch
from opd_harness.trainers.learner import train_step
from opd_harness.trainers.objectives.sft import SFT_SPEC

CACHE_FORMAT = 1  # bump when the way tiny models are built or warmed up changes
READY_MARKER = "READY"
RECORD_FILE = "warmup.json"  # what the warm-up did and reached, next to the weights


class WarmupTargetMissed(ConfigError):
    """A warm-up ended at ``sft_target.max_steps`` below ``sft_target.avg_at_k`` with ``on_miss: fail``; exit code 2."""


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
    with _cache_entry_lock(target, role):  # another process building the same model: wait, then load its result
        if (target / READY_MARKER).exists():
            model, tokenizer = load_model_and_tokenizer(target)
            if spec.sft_steps and show_progress:
                done = describe_warmup(warmup_record(target))
                print(f"{role}: loaded from {target} ({done}, done by an earlier run)", file=sys.stderr, flush=True)
            check_target(warmup_record(target), role, target)
            return model, tokenizer, str(target)
        return _build_and_cache(spec, role, task, problems, target, show_progress)


@contextmanager
def _cache_entry_lock(target: Path, role: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``cache/locks/<role>-<hash>.lock`` while a process checks, builds and publishes one cached
    model, so two runs (e.g. two workers of one sweep) never build into the same folder; the second waits and loads the
    first's. The lock lives outside ``cache/models``, which holds only models."""
    locks = target.parent.parent / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{target.name}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{role}: another process is building {target}; waiting for it", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # closing the descriptor releases the lock


def _build_and_cache(spec: ModelSpec, role: str, task, problems: list, target: Path, show_progress: bool):
    """(model, tokenizer, path) of a model built and warmed up now, then published at ``target`` (its READY marker last)."""
    model, tokenizer = build_model(spec)
    model = model.float() if spec.sft_steps else model
    record = None
    if spec.sft_steps:
        record = warm_up(model, tokenizer, task, problems, spec, desc=f"SFT {role}", show_progress=show_progress)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model_and_tokenizer(model, tokenizer, tmp)
    if record is not None:
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
    (tmp / READY_MARKER).write_text(json.dumps(spec.model_dump(), sort_keys=True))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    model = model.float()  # a published shape is saved in bfloat16 (half the disk) and trained from float32 weights
    if spec.sft_steps and show_progress:
        print(f"{role}: cached at {target} ({describe_warmup(record)}); the next run with the same {role} and task loads it from there",
              file=sys.stderr, flush=True)  # fmt: skip
    check_target(record, role, target)  # a miss is cached too: the same spec would train to the same miss on this machine
    return model, tokenizer, str(target)


def load_prepared(spec: ModelSpec, path: str, enable_thinking: bool | None = None):
    """(model, tokenizer) from the folder :func:`prepare_model` returned for ``spec``, as it returned them: float32, with a
    pretrained model's chat template set to ``enable_thinking`` (what another process of the run loads)."""
    model, tokenizer = load_model_and_tokenizer(path)
    if spec.path is not None and enable_thinking is not None:
        from opd_harness.models.hub import set_thinking

        set_thinking(tokenizer, enable_thinking)
    return model, tokenizer

def warmup_record(path: str | Path) -> dict | None:
    """What the warm-up of the model at ``path`` did and reached (:func:`warm_up`), or None (a pretrained model, no
    warm-up, or one cached by a version that wrote no record)."""
    file = Path(path) / RECORD_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def describe_warmup(record: dict | None) -> str:
    """One line: steps, and with a target the held-out Avg@k it reached against it."""
    if record is None:
        return "no warm-up record (cached by a version that wrote none)"
    text = f"{record['steps']} SFT steps (seed {record['seed']}, {record['threads']} thread(s), {record['cpu_capability']})"
    target = record.get("target")
    if target is None:
        return text
    last = record["checks"][-1]
    verdict = "reached" if record["reached"] else "BELOW"
    return (
        f"{text}, held-out Avg@{target['k']} {last['avg_at_k']:.3f} [{last['ci_low']:.3f}, {last['ci_high']:.3f}] on "
        f"{last['n_problems']} held-out training problems after {len(record['checks'])} round(s): {verdict} target {target['avg_at_k']:.3f}"
    )


def check_target(record: dict | None, role: str, path: Path) -> None:
    """Raise WarmupTargetMissed when ``record`` ends below its target and the target says ``on_miss: fail``."""
    if record is None or record.get("reached") is not False or record["target"]["on_miss"] != "fail":
        return
    last, target = record["checks"][-1], record["target"]
    raise WarmupTargetMissed(
        f"{role}.sft_target: held-out Avg@{target['k']} {last['avg_at_k']:.3f} after {record['steps']} SFT steps is below avg_at_k "
        f"{target['avg_at_k']}; raise {role}.sft_target.max_steps, lower {role}.sft_target.avg_at_k or set {role}.sft_target.on_miss=warn "
        f"(the model is cached at {path})"
    )


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


def split_heldout(problems: list, spec: ModelSpec) -> tuple[list, list]:
    """(SFT problems, held-out problems): with ``sft_target``, ``heldout`` problems drawn under the seed are kept out of the
    SFT data, as is any other problem with the same question (a duplicate would leak); without one, all are SFT data."""
    if spec.sft_target is None:
        return list(problems), []
    n = spec.sft_target.heldout
    if n >= len(problems):
        raise ConfigError(f"sft_target.heldout: {n} held-out problems leave none of the {len(problems)} training problems to train on")
    chosen = set(random.Random(spec.seed).sample(range(len(problems)), n))
    heldout = [p for i, p in enumerate(problems) if i in chosen]
    questions = {p.question for p in heldout}
    return [p for i, p in enumerate(problems) if i not in chosen and p.question not in questions], heldout


def heldout_quality(model, tokenizer, task, problems: list, target: SFTTarget, seed: int) -> dict:
    """Avg@k (bootstrap CI) of ``model`` on ``problems``: live episodes through the task's rollout and grader, as an
    evaluation runs them, sampled as ``target`` says."""
    sampling = SamplingParams(temperature=target.temperature, top_p=target.top_p, max_new_tokens=task.options.max_new_tokens, seed=seed)
    model.eval()
    summary = evaluate_task(HFBackend(model, tokenizer), task, problems, k=target.k, sampling=sampling, n_resamples=2000,
                            show_progress=False).summary  # fmt: skip
    keep = ("avg_at_k", "ci_low", "ci_high", "pass_at_k", "n_problems", "n_errors", "seconds", "invalid_tool_rate", "mean_tool_calls")
    return {key: summary[key] for key in keep if key in summary}


def warm_up(model, tokenizer, task, problems: list, spec: ModelSpec, *, desc: str, show_progress: bool = True) -> dict:
    """Train ``model`` by SFT as ``spec`` says and return its record: ``sft_steps`` one-cycle steps, or with ``sft_target``
    rounds of them (from the weights the last round left) with held-out Avg@k after each, until ``avg_at_k`` or ``max_steps``."""
    started = time.perf_counter()
    target = spec.sft_target
    train, heldout = split_heldout(problems, spec)
    rounds = target.max_steps // spec.sft_steps if target is not None else 1
    rng, checks, metrics = random.Random(spec.seed), [], {}
    for index in range(1, rounds + 1):
        label = f"{desc} round {index}/{rounds}" if target is not None else desc
        metrics = supervised_warmup(model, tokenizer, task, train, spec, desc=label, show_progress=show_progress, rng=rng)
        if target is None:
            break
        checks.append({"steps": index * spec.sft_steps, "nll": metrics.get("nll"),
                       **heldout_quality(model, tokenizer, task, heldout, target, spec.seed)})  # fmt: skip
        if show_progress:
            print(f"{desc}: {checks[-1]['steps']} steps, held-out Avg@{target.k} {checks[-1]['avg_at_k']:.3f} "
                  f"(target {target.avg_at_k})", file=sys.stderr, flush=True)  # fmt: skip
        if checks[-1]["avg_at_k"] >= target.avg_at_k:
            break
    return {
        "steps": (len(checks) or 1) * spec.sft_steps,
        "round_steps": spec.sft_steps,
        "final_nll": metrics.get("nll"),
        "target": target.model_dump() if target is not None else None,
        "reached": (checks[-1]["avg_at_k"] >= target.avg_at_k) if target is not None else None,
        "checks": checks,
        "sft_problems": len(train),
        "heldout_ids": [p.id for p in heldout],
        "seed": spec.seed,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1),
    }


def supervised_warmup(
    model, tokenizer, task, problems: list, spec: ModelSpec, *, desc: str, show_progress: bool = True, rng: random.Random | None = None
) -> dict[str, float]:
    """One round: ``spec.sft_steps`` SFT steps on the reference solutions of ``problems`` with a one-cycle learning rate,
    batches drawn from ``rng`` (default: seeded with ``spec.seed``); deterministic under the seed on one CPU kernel path."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    schedule = warmup_schedule(optimizer, spec.sft_lr, spec.sft_steps)
    rng = rng if rng is not None else random.Random(spec.seed)
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
