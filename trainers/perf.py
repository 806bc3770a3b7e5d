"""Learner throughput accounting: tokens/s and model FLOPs utilisation (MFU) of an optimizer step.

MFU = 6 · N · tokens / step seconds / the device's peak dense bf16 FLOP/s (the issue's formula; it leaves out
attention's quadratic term, so it undercounts at long context). N counts the parameters that take part in matrix
products: all of them, less the input embedding when it is not tied to the output projection (a lookup does no FLOPs;
a tied matrix is the output projection's).
"""

from __future__ import annotations

# Peak dense (no sparsity) bf16 tensor FLOP/s from the vendors' data sheets, matched by a substring of
# torch.cuda.get_device_name(); the first match wins, so the more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),  # H200 SXM data sheet: 1,979 TFLOPS bf16 with sparsity
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # H100 SXM
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
)


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device by its name, or None when the table does not know it (CPUs among them)."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def flop_params(model) -> int:
    """N of 6·N·tokens: the parameters in matrix products (the input embedding only when tied to the output head)."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embed is None or (head is not None and head.weight is embed.weight):
        return total
    return total - embed.weight.numel()


def step_perf(n_params: int, tokens: int, seconds: float, device_name: str | None) -> dict[str, float]:
    """``learner_tokens_per_s`` and, on a device in the peak table, ``mfu`` (a fraction) of one learner step."""
    if seconds <= 0:
        return {}
    out = {"learner_tokens_per_s": tokens / seconds}
    peak = peak_flops(device_name) if device_name else None
    if peak:
        out["mfu"] = 6 * n_params * tokens / seconds / peak
    return out
