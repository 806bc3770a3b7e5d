"""Checkpoints: model + tokenizer (loadable by ``harness eval --model``), optimizer, schedule, RNG, trainer state.

Written to a temporary folder and renamed into place, so a checkpoint folder is complete or absent.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from opd_harness.models.tiny import load_model_and_tokenizer, save_model_and_tokenizer

STATE_FILE = "trainer_state.pt"


@dataclass
class TrainState:
    """What the loop needs to continue exactly where it stopped."""

    step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0  # wall time of training steps only (no evaluation)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:06d}"


def save_checkpoint(run_dir: Path, state: TrainState, model, tokenizer, optimizer, scheduler, extra: dict | None = None) -> Path:
    """Atomically write everything needed to resume at ``state.step``."""
    target = checkpoint_dir(run_dir, state.step)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model_and_tokenizer(model, tokenizer, tmp)
    torch.save(
        {
            "state": asdict(state),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
            "extra": extra or {},
        },
        tmp / STATE_FILE,
    )
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def restore_scheduler(optimizer, scheduler_factory, state: dict):
    """A scheduler at its saved position, with the optimizer's learning rates set to the saved ones: building a
    scheduler resets each group's lr to its first value, and ``load_state_dict`` does not put it back."""
    scheduler = scheduler_factory(optimizer)
    scheduler.load_state_dict(state)
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    return scheduler


def load_checkpoint(path: Path, optimizer_factory, scheduler_factory, device: str = "cpu"):
    """(model, tokenizer, optimizer, scheduler, state, extra) restored from a checkpoint folder, the model (and so the
    optimizer's state) on ``device``."""
    model, tokenizer = load_model_and_tokenizer(path)
    model.to(device)
    payload = torch.load(Path(path) / STATE_FILE, weights_only=False)
    optimizer = optimizer_factory(model)
    optimizer.load_state_dict(payload["optimizer"])
    scheduler = restore_scheduler(optimizer, scheduler_factory, payload["scheduler"])
    torch.set_rng_state(payload["rng"]["torch"])
    random.setstate(payload["rng"]["python"])
    np.random.set_state(payload["rng"]["numpy"])
    return model, tokenizer, optimizer, scheduler, TrainState(**payload["state"]), payload["extra"]
