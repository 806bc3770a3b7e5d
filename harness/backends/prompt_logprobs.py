"""vLLM-format log-probs (one ``{token id: Logprob}`` dict per position, or bare floats) as the per-position
tensors of a backend's ``score``; the vllm backend reads them from its engine, the openai backend from a server."""

from __future__ import annotations

import math

import torch


def logprob_value(entry) -> float:
    """A vLLM ``Logprob`` (``.logprob``) or a bare float."""
    return float(getattr(entry, "logprob", entry))


def _rank(entry) -> float:
    rank = getattr(entry, "rank", None)
    return float(rank) if rank is not None else math.inf


def unpadded_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[tuple[list[int], list[int]]]:
    """Per row: (the positions where the mask is 1, the tokens there), works for right or left padding."""
    rows = []
    for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
        positions = [t for t, m in enumerate(mask) if m]
        rows.append((positions, [ids[t] for t in positions]))
    return rows


def topk_from_entry(entry: dict, k: int) -> tuple[list[float], list[int]]:
    """The ``k`` most likely (log-prob, token id) pairs of one prompt position.

    vLLM's dict holds the top ``k`` plus the actual token when that is not among them; sorting by
    log-prob (rank breaks ties) and keeping ``k`` recovers the top ``k``.
    """
    items = sorted(entry.items(), key=lambda kv: (-logprob_value(kv[1]), _rank(kv[1]), kv[0]))
    if len(items) < k:
        raise ValueError(f"vLLM returned {len(items)} prompt log-probs at a position, fewer than top_k={k}")
    items = items[:k]
    return [logprob_value(v) for _, v in items], [int(t) for t, _ in items]


def prompt_logprobs_to_tensor(
    prompt_logprobs: list[list[dict | None] | None],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    want: tuple[str, ...] = ("logprobs",),
    top_k: int = 0,
) -> dict[str, torch.Tensor]:
    """Per-position tensors aligned with ``input_ids`` from one ``prompt_logprobs`` list per row.

    Row ``b``'s list covers that row's unpadded tokens (``attention_mask == 1``) in order, its first
    entry ``None``; position 0 of each sequence and padding positions score 0, as in the HF backend
    (``logprobs`` (B, T); ``topk_logprobs``/``topk_ids`` (B, T, k)). A row with no tokens has ``None``.
    """
    batch, width = input_ids.shape
    out: dict[str, torch.Tensor] = {}
    logprobs = torch.zeros((batch, width), dtype=torch.float32)
    topk_values = torch.zeros((batch, width, top_k), dtype=torch.float32) if "topk" in want else None
    topk_ids = torch.zeros((batch, width, top_k), dtype=torch.long) if "topk" in want else None
    for row, ((positions, tokens), entries) in enumerate(zip(unpadded_sequences(input_ids, attention_mask), prompt_logprobs, strict=True)):
        if not positions:
            continue
        if entries is None or len(entries) != len(tokens):
            got = "none" if entries is None else len(entries)
            raise ValueError(f"row {row}: {len(tokens)} tokens but {got} prompt log-prob entries")
        for i in range(1, len(tokens)):
            entry, position, token = entries[i], positions[i], tokens[i]
            if entry is None or token not in entry:
                raise ValueError(f"row {row}, position {position}: vLLM's prompt log-probs lack the actual token {token}")
            logprobs[row, position] = logprob_value(entry[token])
            if topk_values is not None:
                values, ids = topk_from_entry(entry, top_k)
                topk_values[row, position] = torch.tensor(values, dtype=torch.float32)
                topk_ids[row, position] = torch.tensor(ids, dtype=torch.long)
    if "logprobs" in want:
        out["logprobs"] = logprobs
    if topk_values is not None:
        out["topk_logprobs"], out["topk_ids"] = topk_values, topk_ids
    return out
