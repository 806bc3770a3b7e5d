"""Full-vocabulary objectives in chunks of positions (``trainer.vocab_chunk``): the student's forward stops at the decoder's
last hidden states, and each chunk of positions computes output head → log-softmax → the method's per-position terms under
activation checkpointing, so neither the (B, T, V) logits nor the log-distribution of all positions is ever kept.

Per chunk the forward keeps only the chunk's inputs (views of the hidden states and of the aligned teacher tensors) and its
per-position outputs; the backward recomputes the chunk's logits and frees them before the next chunk. The peak of the
student's vocabulary side is so a few (``vocab_chunk``, V) float32 tensors instead of a few (B, T, V) ones. The price is
compute: each call re-runs the output head over every position once more in the backward (checkpointing), and the
sampled-token log-probs are one such call, a method's full-vocabulary terms another. Liger-Kernel's fused linear
cross-entropy / JSD instead compute the gradient in the forward (no recompute), which needs the loss to be a plain sum of
per-position terms; the objectives here weight, gate and average their per-position terms per sample, so they get the
per-position terms with a graph and reduce them as on the unchunked path, to the same value and gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from opd_harness.backends.hf import chunk_bounds
from opd_harness.teacher_signal import apply_terms

PositionFn = Callable[..., torch.Tensor]  # fn(log-distribution (n, V), *aligned (n, ...)) -> (n,) or (n, k)


class ChunkedVocabulary:
    """The student's distribution at every position of a (B, T) batch, computed chunk by chunk from the last hidden states.

    Position t's distribution predicts token t from hidden state t − 1, as ``scores_from_logits`` shifts it; position 0 has
    no prefix and gets an all-zero log-distribution there, so a position function sees exactly what it sees unchunked.
    """

    def __init__(self, hidden: torch.Tensor, head: torch.nn.Module, chunk: int, precision_context: Callable[[], object]) -> None:
        if chunk < 1:
            raise ValueError(f"vocab_chunk {chunk}: positions per chunk must be at least 1")
        self.hidden, self.head, self.chunk, self.precision_context = hidden, head, chunk, precision_context
        self.vocab = int(head.weight.shape[0])

    def log_distribution(self, hidden: torch.Tensor) -> torch.Tensor:
        """log-softmax of the head's logits (float32) for a (n, H) slice of hidden states."""
        with self.precision_context():
            logits = self.head(hidden)
        return F.log_softmax(logits.float(), dim=-1)

    def map(self, fn: PositionFn, *aligned: torch.Tensor) -> torch.Tensor:
        """``fn`` over every position, (B, T) or (B, T, k): ``aligned`` tensors are (B, T, ...) and reach ``fn`` sliced like the
        positions. ``fn`` must treat positions independently (it runs on a chunk at a time, twice: forward and recompute)."""
        rows, length = self.hidden.shape[:2]
        aligned = tuple(a.to(self.hidden.device) for a in aligned)
        out_rows = []
        for b in range(rows):
            first = apply_terms(fn, torch.zeros((1, self.vocab), device=self.hidden.device), *(a[b, :1] for a in aligned))
            parts = [first]
            for start, stop in chunk_bounds(length - 1, self.chunk):  # positions start+1 .. stop predicted from hidden start .. stop-1
                inputs = (self.hidden[b, start:stop], *(a[b, start + 1 : stop + 1] for a in aligned))
                parts.append(checkpoint(self._chunk_terms, fn, *inputs, use_reentrant=False))
            out_rows.append(torch.cat(parts, dim=0))
        return torch.stack(out_rows, dim=0)

    def _chunk_terms(self, fn: PositionFn, hidden: torch.Tensor, *aligned: torch.Tensor) -> torch.Tensor:
        return apply_terms(fn, self.log_distribution(hidden), *aligned)


def token_logprob_and_entropy(log_dist: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """(n, 2): log-prob of each position's token (with gradient) and the distribution's entropy (detached)."""
    logprob = log_dist.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_dist.exp() * log_dist).sum(-1).detach()
    return torch.stack([logprob, entropy], dim=-1)


def token_logprob(log_dist: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """(n,): log-prob of each position's token."""
    return log_dist.gather(-1, token.unsqueeze(-1)).squeeze(-1)
