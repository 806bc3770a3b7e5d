"""Per-sequence seeded sampling: each row draws from its own ``torch.Generator``, so what a sequence samples does
not depend on which other sequences share its batch (the serve engine's rows and the hf backend's rows alike).

A row's draw at each step is the inverse CDF of its (tempered, top-k, top-p) distribution at the row's next uniform:
one float64 uniform per row per step, from the row's generator, in stream order. The hf backend draws each row's
uniforms a block of steps at a time (:class:`RowUniforms`) and samples every row in one batched operation
(:func:`inverse_cdf`), so per-row seeds cost what a batched ``torch.multinomial`` costs."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator, top_k: int = 0) -> int:
    """Draw one token id from ``softmax(logits / temperature)`` cut to the ``top_k`` most likely tokens and then to the
    ``top_p`` nucleus (greedy at 0), by inverse CDF with one uniform from ``generator`` (see :func:`inverse_cdf`)."""
    if temperature == 0.0:
        return int(logits.argmax())
    return int(draw(logits, temperature, top_p, generator, top_k))


def draw(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator, top_k: int = 0) -> torch.Tensor:
    """:func:`sample_token`'s draw at a positive temperature, as a one-element tensor on the logits' device; raises as
    ``torch.multinomial`` does on probabilities that are not a distribution (inf, nan, negative, all zero)."""
    tokens, valid = inverse_cdf(nucleus_probs(logits[None], temperature, top_p, top_k), next_uniforms([generator]))
    if not bool(valid.all()):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")
    return tokens


def nucleus_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """``softmax(logits / temperature)`` over the last dimension, kept to the ``top_k`` most likely tokens (0: all; ties
    with the k-th are kept, as transformers' TopKLogitsWarper does) and renormalised, then with the tokens outside the
    ``top_p`` nucleus zeroed. Each row is cut on its own values only, so a row's draw does not depend on its batch."""
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return nucleus_cut(probs, top_p)


def nucleus_cut(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` with the tokens outside each row's ``top_p`` nucleus zeroed (not renormalised; 1.0: unchanged)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    outside = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p  # the mass above a token already reaches top_p
    return probs.masked_fill(outside.scatter(-1, order, outside), 0.0)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``probs`` (b, V), unnormalised, by inverse CDF: row ``i`` takes the first token whose cumulative
    mass exceeds ``uniforms[i]`` (in [0, 1)) times the row's total: (token ids (b,), valid (b,)).

    The cumulative sums are float64, so a token keeps its probability to ~1e-16 of the row's mass even over a 151,936-token
    vocabulary; a zero-probability token is never taken. ``valid`` is False for rows that are not a distribution (inf, nan,
    negative or summing to zero; ``torch.multinomial`` refuses them); their token is meaningless."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    valid = total.isfinite() & (total > 0) & (probs.amin(-1) >= 0)
    target = (uniforms.to(cdf.device, torch.float64) * total)[:, None]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens.clamp_(max=probs.shape[-1] - 1), valid


def next_uniforms(generators: list[torch.Generator]) -> torch.Tensor:
    """The next float64 uniform of each generator's stream (b,), on the first generator's device."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=g.device) for g in generators])


class RowUniforms:
    """Each row's stream of uniforms from its own generator, one per decode step, drawn ``block`` at a time per row (one
    call per row per block, not per step). A generator yields the same stream whatever the block size (torch draws them
    in sequence), so a row's draws are those of :func:`next_uniforms` step by step."""

    def __init__(self, generators: list[torch.Generator], block: int) -> None:
        self.generators, self.block = generators, max(block, 1)
        self.buffer: torch.Tensor | None = None  # (b, block)
        self.used = 0

    def next(self) -> torch.Tensor:
        """Every row's next uniform (b,)."""
        if self.buffer is None or self.used == self.block:
            self.buffer = torch.stack([torch.rand(self.block, generator=g, dtype=torch.float64, device=g.device)
                                       for g in self.generators])  # fmt: skip
            self.used = 0
        self.used += 1
        return self.buffer[:, self.used - 1]


def draw_rows(
    logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator], top_k: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draw` for every row of ``logits`` (b, V) at once, row ``i`` with the next uniform of ``generators[i]``: (token
    ids (b,), valid (b,)); one batched inverse CDF (:func:`inverse_cdf`), so a row draws the same token whatever its batch.
    ``valid`` is False for rows whose probabilities ``multinomial`` would refuse; their token is meaningless."""
    return inverse_cdf(nucleus_probs(logits, temperature, top_p, top_k), next_uniforms(generators))


class RowSampler(LogitsProcessor):
    """Samples every row's next token with its own generator's uniforms and leaves only that token possible, so that
    greedy decoding (``do_sample=False``) emits it: per-row seeded sampling inside ``model.generate``, at the cost of one
    batched draw a step (:func:`inverse_cdf`; each row's uniforms come ``block`` steps at a time, :class:`RowUniforms`)."""

    def __init__(
        self, seeds: list[int], temperature: float, top_p: float, device: str | torch.device, top_k: int = 0, block: int = 64
    ) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(seed % 2**64) for seed in seeds]
        self.uniforms = RowUniforms(self.generators, block)
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        chosen = self.choose(scores)
        return torch.full_like(scores, float("-inf")).scatter_(-1, chosen[:, None], 0.0)

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Every row's next token id, shape (b,), each drawn with that row's own generator."""
        return self.draw(nucleus_probs(scores, self.temperature, self.top_p, self.top_k))

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """The rows' tokens from their (unnormalised) probabilities ``probs`` (b, V), one uniform of each row's stream."""
        tokens, valid = inverse_cdf(probs, self.uniforms.next())
        if not bool(valid.all()):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return tokens


class ScoredRowSampler(RowSampler):
    """:class:`RowSampler` (or the argmax when ``temperature`` is 0) that also keeps each chosen token's log-prob under
    the untempered distribution of the scores it is given, one (b,) tensor per step on the scores' device: the
    sampled-token log-probs without keeping every step's (b, V) logits."""

    def __init__(
        self, seeds: list[int], temperature: float, top_p: float, device: str | torch.device, top_ids: int = 0, top_k: int = 0,
        block: int = 64,
    ) -> None:
        super().__init__(seeds, temperature, top_p, device, top_k, block)
        self.chosen_logprobs: list[torch.Tensor] = []
        self.top_ids_k = top_ids  # > 0: also keep each step's top_ids most likely token ids (b, top_ids)
        self.chosen_top: list[torch.Tensor] = []

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The rows' next tokens (the argmax at temperature 0), recording their untempered log-probs."""
        scores = scores.float()
        logp = torch.log_softmax(scores, dim=-1)
        if self.temperature == 0.0:
            chosen = scores.argmax(-1)
        elif self.temperature == 1.0 and not self.top_k:  # the sampling distribution is the untempered one: reuse its softmax
            chosen = self.draw(nucleus_cut(logp.exp(), self.top_p))
        else:
            chosen = super().choose(scores)
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
