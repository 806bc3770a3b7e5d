"""Checkpoints: model + tokenizer (loadable by ``harness eval --model``), optimizer, schedule, RNG, trainer state.

A checkpoint folder holds the model and tokenizer (Hugging Face files), the optimizer state (``optimizer.pt``, or
``optimizer/``: a torch.distributed.checkpoint folder with one shard per FSDP2 rank) and ``trainer_state.pt`` (counters,
schedule, RNG, method state: small). It is written to a temporary folder and renamed into place, so a checkpoint folder
is complete or absent. The process that holds the weights writes them: the session in process, the learner ranks under
Ray (:mod:`opd_harness.trainers.ray_executor`), where the driver only renames the folder and records its path.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from opd_harness.models.tiny import load_model_and_tokenizer, save_model_and_tokenizer

STATE_FILE = "trainer_state.pt"
OPTIMIZER_FILE = "optimizer.pt"  # the whole optimizer state (one process holds it)
OPTIMIZER_SHARDS = "optimizer"  # torch.distributed.checkpoint folder: each FSDP2 rank wrote its shard


@dataclass
class TrainState:
    """What the loop needs to continue exactly where it stopped."""

    step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0  # wall time of training steps only (no evaluation)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:06d}"


def staging_dir(target: Path) -> Path:
    """Where ``target`` is written before it is renamed into place."""
    return target.with_name(target.name + ".tmp")


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])


def trainer_state(state: TrainState | dict, scheduler_state: dict, extra: dict | None = None) -> dict[str, Any]:
    """The small part of a checkpoint (``trainer_state.pt``) without the RNG: counters, schedule and ``extra``."""
    return {"state": asdict(state) if isinstance(state, TrainState) else dict(state), "scheduler": scheduler_state,
            "extra": extra or {}}  # fmt: skip


def write_state(folder: Path, small: dict[str, Any], **fields: Any) -> None:
    """``trainer_state.pt`` in ``folder``: ``small`` (:func:`trainer_state`), this process's RNG and ``fields``."""
    torch.save({**small, "rng": rng_state(), **fields}, Path(folder) / STATE_FILE)


def publish_checkpoint(staged: Path, target: Path) -> Path:
    """Rename a fully written ``staged`` folder to ``target`` (replacing an older one of the same step)."""
    shutil.rmtree(target, ignore_errors=True)
    Path(staged).rename(target)
    return target


def save_checkpoint(run_dir: Path, state: TrainState, model, tokenizer, optimizer, scheduler, extra: dict | None = None) -> Path:
    """Atomically write everything needed to resume at ``state.step`` (one process holds model and optimizer)."""
    target = checkpoint_dir(run_dir, state.step)
    tmp = staging_dir(target)
    shutil.rmtree(tmp, ignore_errors=True)
    save_model_and_tokenizer(model, tokenizer, tmp)
    torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    write_state(tmp, trainer_state(state, scheduler.state_dict(), extra))
    return publish_checkpoint(tmp, target)


def read_state(path: Path) -> dict[str, Any]:
    """``trainer_state.pt`` of checkpoint ``path`` (counters, schedule, RNG, extra; an older checkpoint's holds the
    optimizer too)."""
    return torch.load(Path(path) / STATE_FILE, weights_only=False)


def restore_scheduler(optimizer, scheduler_factory, state: dict):
    """A scheduler at its saved position, with the optimizer's learning rates set to the saved ones: building a
    scheduler resets each group's lr to its first value, and ``load_state_dict`` does not put it back."""
    scheduler = scheduler_factory(optimizer)
    scheduler.load_state_dict(state)
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    return scheduler


def load_optimizer_state(path: Path, payload: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load checkpoint ``path``'s optimizer state into ``optimizer`` (over the unsharded ``model``): ``optimizer.pt``,
    the per-rank shards of an FSDP2 learner (torch.distributed.checkpoint resharded into this process's full tensors),
    or the state an older checkpoint kept in ``trainer_state.pt``."""
    path = Path(path)
    if "optimizer" in payload:
        optimizer.load_state_dict(payload["optimizer"])
    elif (path / OPTIMIZER_FILE).exists():
        optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=False, map_location="cpu"))
    else:
        load_sharded_optimizer(path / OPTIMIZER_SHARDS, model, optimizer)


def load_sharded_optimizer(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """An FSDP2 learner's optimizer shards (:func:`save_sharded_optimizer`) loaded whole into ``optimizer``: the template
    is ``optimizer``'s own state by parameter name (made by a zero step, then overwritten, ``step`` included), which
    torch.distributed.checkpoint fills from the shards in this process (no process group needed)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    template = {"optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
    dcp.load(template, checkpoint_id=str(folder), no_dist=not (dist.is_available() and dist.is_initialized()))
    set_optimizer_state_dict(model, optimizer, template["optimizer"], options=options)


def save_sharded_optimizer(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A collective of an FSDP2 group: every rank writes its shard of the optimizer state (by parameter name) to ``folder``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(folder))


def load_checkpoint(path: Path, optimizer_factory, scheduler_factory, device: str = "cpu"):
    """(model, tokenizer, optimizer, scheduler, state, extra) restored from a checkpoint folder, the model (and so the
    optimizer's state) on ``device``."""
    model, tokenizer = load_model_and_tokenizer(path)
    model.to(device)
    payload = read_state(path)
    optimizer = optimizer_factory(model)
    load_optimizer_state(path, payload, model, optimizer)
    scheduler = restore_scheduler(optimizer, scheduler_factory, payload["scheduler"])
    set_rng_state(payload["rng"])
    return model, tokenizer, optimizer, scheduler, TrainState(**payload["state"]), payload["extra"]
