"""Per-sequence seeded sampling: each row draws from its own ``torch.Generator``, so what a sequence samples does
not depend on which other sequences share its batch (the serve engine's rows and the hf backend's rows alike)."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator, top_k: int = 0) -> int:
    """Draw one token id from ``softmax(logits / temperature)`` cut to the ``top_k`` most likely tokens and then to the
    ``top_p`` nucleus (greedy at 0).

    The same draw as transformers' sampling (temperature, then top-k, then top-p, then ``torch.multinomial`` over
    the vocabulary in id order), made from one row's own generator.
    """
    if temperature == 0.0:
        return int(logits.argmax())
    return int(draw(logits, temperature, top_p, generator, top_k))


def draw(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator, top_k: int = 0) -> torch.Tensor:
    """:func:`sample_token`'s draw at a positive temperature, as a one-element tensor on the logits' device (no sync)."""
    return torch.multinomial(nucleus_probs(logits, temperature, top_p, top_k), 1, generator=generator)


def nucleus_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """``softmax(logits / temperature)`` over the last dimension, kept to the ``top_k`` most likely tokens (0: all; ties
    with the k-th are kept, as transformers' TopKLogitsWarper does) and renormalised, then with the tokens outside the
    ``top_p`` nucleus zeroed. Each row is cut on its own values only, so a row's draw does not depend on its batch."""
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p  # the mass above a token already reaches top_p
        probs = probs.masked_fill(outside.scatter(-1, order, outside), 0.0)
    return probs


def draw_rows(
    logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator], top_k: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draw` for every row of ``logits`` (b, V) at once, row ``i`` from ``generators[i]``: (token ids (b,), valid (b,)).

    ``torch.multinomial`` draws one sample as ``argmax(probs / q)`` with ``q`` exponential noise from the generator;
    drawing each row's noise from its own generator and taking one batched argmax gives the same tokens at a fraction
    of the per-row cost. ``valid`` is False for rows whose probabilities ``multinomial`` would refuse (inf, nan,
    negative, or summing to zero); their token is meaningless.
    """
    probs = nucleus_probs(logits, temperature, top_p, top_k)
    noise = torch.empty_like(probs)
    for row, generator in zip(noise, generators, strict=True):
        row.exponential_(1, generator=generator)
    total = probs.sum(-1)  # a softmax is never negative: an inf or nan makes the sum non-finite
    valid = total.isfinite() & (total > 0)
    return (probs / noise).argmax(-1), valid


class RowSampler(LogitsProcessor):
    """Samples every row's next token from its own generator and leaves only that token possible, so that greedy
    decoding (``do_sample=False``) emits it: per-row seeded sampling inside ``model.generate``."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float, device: str | torch.device, top_k: int = 0) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(seed % 2**64) for seed in seeds]
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        chosen = self.choose(scores)
        return torch.full_like(scores, float("-inf")).scatter_(-1, chosen[:, None], 0.0)

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Every row's next token id, shape (b,), each drawn from that row's own generator."""
        return torch.cat([draw(row, self.temperature, self.top_p, g, self.top_k) for row, g in zip(scores, self.generators, strict=True)])


class ScoredRowSampler(RowSampler):
    """:class:`RowSampler` (or the argmax when ``temperature`` is 0) that also keeps each chosen token's log-prob under
    the untempered distribution of the scores it is given, one (b,) tensor per step on the scores' device: the
    sampled-token log-probs without keeping every step's (b, V) logits."""

    def __init__(
        self, seeds: list[int], temperature: float, top_p: float, device: str | torch.device, top_ids: int = 0, top_k: int = 0
    ) -> None:
        super().__init__(seeds, temperature, top_p, device, top_k)
        self.chosen_logprobs: list[torch.Tensor] = []
        self.top_ids_k = top_ids  # > 0: also keep each step's top_ids most likely token ids (b, top_ids)
        self.chosen_top: list[torch.Tensor] = []

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The rows' next tokens (the argmax at temperature 0), recording their untempered log-probs."""
        scores = scores.float()
        chosen = scores.argmax(-1) if self.temperature == 0.0 else super().choose(scores)
        logp = torch.log_softmax(scores, dim=-1)
        self.chosen_logprobs.append(logp.gather(-1, chosen[:, None]).squeeze(-1))
        if self.top_ids_k:
            self.chosen_top.append(logp.topk(self.top_ids_k, dim=-1).indices)
        return chosen

    def logprobs(self) -> torch.Tensor:
        """(b, steps) log-probs of the tokens chosen so far."""
        return torch.stack(self.chosen_logprobs, dim=1)

    def top_ids(self) -> torch.Tensor | None:
        """(b, steps, k) the k most likely token ids of each step so far (None without ``top_ids``)."""
        return torch.stack(self.chosen_top, dim=1) if self.top_ids_k else None
