"""Where a model named by the user comes from (a local folder, the hub cache or the hub), its dtype by name, and the
chat template's thinking switch: each refused in one line before any weights are read."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class ModelUnavailable(ValueError):
    """A model that cannot be read from here (no such folder, a folder without config or weights, an offline hub)."""


def dtype_name(value: str, *, device: str = "cpu") -> str:
    """``fp32``, ``bf16`` or ``fp16`` for a dtype given by name (``auto``: bf16 on a CUDA device that supports it, else fp32;
    torch's names accepted); anything else is a ValueError naming the choices."""
    name = DTYPE_ALIASES.get(str(value).lower(), str(value).lower())
    if name == "auto":
        return auto_precision(device)
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype {value!r}: choose one of auto, bf16, fp16, fp32")
    return name


def auto_precision(device: str, *, planning: bool = False) -> str:
    """``--dtype auto``: bf16 on a CUDA device that supports it, else fp32. Planned on a host without CUDA (``planning``), a
    ``cuda`` device is taken to support bf16 (every GPU since Ampere does)."""
    if device == "cpu":
        return "fp32"
    import torch

    if not torch.cuda.is_available():
        return "bf16" if planning and device != "auto" else "fp32"
    try:
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    except (RuntimeError, AssertionError):  # a CUDA runtime that cannot be asked: the safe choice
        return "fp32"


def hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """The hub's address when a TCP connection to it does not open within ``timeout_s`` (name lookup included), else None:
    huggingface_hub's own retries take tens of seconds to give up on a host without network."""
    import socket
    import threading
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    opened: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((url.hostname, port), timeout=timeout_s).close()
            opened.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)  # getaddrinfo has no timeout of its own
    thread.start()
    thread.join(timeout_s)
    return None if opened else constants.ENDPOINT


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``fp32`` / ``bf16`` / ``fp16``."""
    import torch

    return getattr(torch, TORCH_DTYPES[dtype_name(name)])


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` switches the hub off."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_unavailable() -> str | None:
    """Why the hub cannot be asked now (``HF_HUB_OFFLINE``, or no connection within seconds), in words a message can
    carry; None when it can."""
    if hub_offline():
        return "the hub is offline (HF_HUB_OFFLINE)"
    endpoint = hub_unreachable()
    return f"the hub ({endpoint}) is not reachable from here" if endpoint else None


def looks_like_hub_id(name: str) -> bool:
    """``owner/name`` that is not a path here."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


def hub_config(name: str) -> dict:
    """The config.json of hub model ``name``, fetched from the hub (its ETag check bounded to 5 s); the hub's own error
    when it cannot (unknown or gated repo, no network), for the caller to report in its words."""
    from huggingface_hub import hf_hub_download

    return json.loads(Path(hf_hub_download(name, "config.json", etag_timeout=5)).read_text())


def locate_model(name: str, *, weights: bool = True, flag: str = "--model") -> str:
    """A model folder to read ``name`` from: a local folder (with config.json, and weights when ``weights``), or a hub id,
    found in the hub cache or (online) left to the hub. Offline, or when the hub does not answer within seconds, a hub id that
    is not cached is refused at once naming the local folder to give, instead of tens of seconds of hub retries."""
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelUnavailable(f"{flag} {name}: no config.json in that folder (give a folder saved by save_pretrained)")
        if weights and not any((local / f).is_file() for f in WEIGHT_FILES):
            raise ModelUnavailable(f"{flag} {name}: the folder has no weights ({' or '.join(WEIGHT_FILES[::2])})")
        return str(local)
    if not looks_like_hub_id(name):
        raise ModelUnavailable(f"{flag} {name}: no such folder, and not a hub id of the form owner/name")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, local_files_only=True)  # the cache: whole snapshot, no network
    except Exception:  # noqa: BLE001 - not cached (LocalEntryNotFoundError and kin): ask the hub, if there is one
        pass
    hint = f"download it where the hub is reachable (hf download {name} --local-dir DIR) and pass {flag} DIR"
    why = hub_unavailable()
    if why:
        raise ModelUnavailable(f"{flag} {name}: not in the hub cache and {why}; {hint}")
    return name


def set_thinking(tokenizer, enabled: bool) -> None:
    """Pass ``enable_thinking`` to every rendering of the tokenizer's chat template (Qwen3's thinking switch), by setting
    it at the template's top (it then holds wherever the template is applied: prompts, episodes, serving). A tokenizer
    without a chat template, or whose template has no such switch, is refused."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        raise ValueError("--enable-thinking: the model's tokenizer has no chat template (a single one) to pass it to")
    if "enable_thinking" not in template:
        raise ValueError("--enable-thinking: the model's chat template has no enable_thinking switch (it is Qwen3's)")
    tokenizer.chat_template = "{%- set enable_thinking = " + ("true" if enabled else "false") + " %}" + template
