"""Per-row seeded sampling at the cost of a batched draw (issue 46): each row's tokens depend only on its own seed and
logits (not on which rows share its batch, their order or the block its uniforms were drawn in), and the draw samples
the tempered, top-k, top-p distribution exactly (a chi-square test that a deliberately biased sampler fails)."""

from __future__ import annotations

import pytest
import torch

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.backends.sampling import RowSampler, RowUniforms, ScoredRowSampler, draw_rows, inverse_cdf, next_uniforms, nucleus_probs

SETTINGS = [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.5, 1.0, 5), (1.2, 0.8, 7)]  # (temperature, top_p, top_k)


def row_logits(row: int, step: int, vocab: int = 40) -> torch.Tensor:
    """Row ``row``'s logits at decode step ``step``: its own, whatever batch it is in."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 * row + step)) * 3


def sampled(sampler_cls, rows: list[int], steps: int, setting: tuple[float, float, int], block: int) -> dict[int, list[int]]:
    """Each row's tokens over ``steps`` steps, sampled in one batch of ``rows`` (row r seeded 17 + r)."""
    temperature, top_p, top_k = setting
    sampler = sampler_cls([17 + r for r in rows], temperature, top_p, "cpu", top_k=top_k, block=block)
    out: dict[int, list[int]] = {r: [] for r in rows}
    for step in range(steps):
        chosen = sampler.choose(torch.stack([row_logits(r, step) for r in rows]))
        for r, token in zip(rows, chosen.tolist(), strict=True):
            out[r].append(token)
    return out


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("sampler_cls", [RowSampler, ScoredRowSampler])
def test_a_rows_samples_do_not_depend_on_its_batch_its_order_or_the_uniform_block(setting, sampler_cls):
    whole = sampled(sampler_cls, list(range(8)), 30, setting, block=30)
    assert sampled(sampler_cls, [6, 1, 4], 30, setting, block=7) == {r: whole[r] for r in (6, 1, 4)}  # removed and permuted
    assert sampled(sampler_cls, [3], 30, setting, block=64) == {3: whole[3]}  # alone
    grown = sampled(sampler_cls, [*range(8), 11, 12], 30, setting, block=30)  # rows added
    assert {r: grown[r] for r in range(8)} == whole
    assert len({tuple(tokens) for tokens in whole.values()}) == 8  # the rows do sample, and differently


def test_a_generators_uniform_stream_is_the_same_in_any_block():
    one = [torch.Generator().manual_seed(5)]
    single = torch.cat([next_uniforms(one) for _ in range(50)])
    for block in (1, 7, 50, 64):
        stream = RowUniforms([torch.Generator().manual_seed(5)], block)
        assert torch.equal(torch.cat([stream.next() for _ in range(50)]), single)


def test_the_serve_engines_draw_is_the_hf_samplers_draw():
    """``draw_rows`` (a uniform a step from each row's generator) and ``RowSampler`` (uniforms a block at a time) take the
    same tokens from the same seeds."""
    logits = [torch.stack([row_logits(r, s) for r in range(5)]) for s in range(12)]
    sampler = RowSampler(list(range(5)), 0.8, 0.95, "cpu", top_k=9, block=12)
    generators = [torch.Generator().manual_seed(s) for s in range(5)]
    for step_logits in logits:
        tokens, valid = draw_rows(step_logits, 0.8, 0.95, generators, top_k=9)
        assert valid.all() and torch.equal(tokens, sampler.choose(step_logits))


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs`` over the tokens with an expected count of 5 or more
    (the rest pooled into one cell)."""
    expected = probs.double() * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def counts_of(sample, logits: torch.Tensor, draws: int, rows: int = 500) -> torch.Tensor:
    """Token counts of ``draws`` draws of ``sample(batch of rows logits, uniforms (rows,))``, each row's uniforms from its
    own fixed seed (drawn all at once per row, as the hf engine does)."""
    steps = draws // rows
    uniforms = RowUniforms([torch.Generator().manual_seed(s) for s in range(rows)], steps)
    batch = logits.expand(rows, -1)
    counts = torch.zeros(logits.shape[-1], dtype=torch.long)
    for _ in range(steps):
        tokens, valid = sample(batch, uniforms.next())
        assert valid.all()
        counts += torch.bincount(tokens, minlength=logits.shape[-1])
    return counts


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0, -30.0, 0.8, 0.2])  # one token of ~1e-14 mass


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_batched_draw_samples_the_tempered_top_k_top_p_distribution(setting):
    """What ``draw_rows`` and ``RowSampler`` draw (both are this inverse CDF, see above) against the distribution itself."""
    temperature, top_p, top_k = setting
    probs = nucleus_probs(LOGITS[None], temperature, top_p, top_k)[0]
    probs = probs / probs.sum()
    counts = counts_of(lambda batch, u: inverse_cdf(nucleus_probs(batch, temperature, top_p, top_k), u), LOGITS, 60_000)
    assert chi_square_p(counts, probs) > 1e-4
    assert (counts[probs == 0] == 0).all()  # tokens cut by top-k / top-p are never drawn


def test_the_chi_square_test_rejects_a_slightly_biased_sampler():
    """The same test on a sampler whose uniforms are skewed (u^1.05, about one point of mass moved between tokens) fails:
    the test above is tight enough to see a biased draw."""
    probs = torch.softmax(LOGITS, -1)
    biased = lambda batch, u: inverse_cdf(torch.softmax(batch, -1), u**1.05)  # noqa: E731
    assert chi_square_p(counts_of(biased, LOGITS, 60_000), probs) < 1e-6
    tempered = lambda batch, u: inverse_cdf(nucleus_probs(batch, 1.1, 1.0), u)  # noqa: E731  the wrong temperature
    assert chi_square_p(counts_of(tempered, LOGITS, 60_000), probs) < 1e-6


def test_the_batched_draw_at_a_real_vocabulary_keeps_tiny_probabilities():
    """Over 151,936 tokens the float64 cumulative sums still resolve a token of 1e-9 mass next to a near-certain one:
    with uniforms placed on either side of its interval, exactly that token is drawn."""
    vocab = 151_936
    probs = torch.zeros(2, vocab)
    probs[:, 0] = 1.0
    probs[:, 100_000] = 1e-9
    before = 1.0 / (1.0 + 1e-9)  # the cumulative mass up to the tiny token, as a fraction of the row's total
    tokens, valid = inverse_cdf(probs, torch.tensor([before * (1 + 5e-10), before * (1 - 1e-12)], dtype=torch.float64))
    assert valid.all() and tokens.tolist() == [100_000, 0]


def test_hf_generation_of_a_seeded_prompt_does_not_depend_on_its_batch(char_tokenizer, tiny_model_factory):
    """Prompts of mixed lengths with explicit seeds: each prompt's completions are the same alone, reordered, in a smaller
    batch_size or beside other prompts, for plain, tempered, top-k and top-p sampling."""
    model = tiny_model_factory(seed=2)
    texts = ["Compute 12+30.\n", "Hi", "x", "a longer prompt of many characters\n"]
    prompts = [char_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    seeds = (101, 202, 303, 404)
    for temperature, top_p, top_k in SETTINGS:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=12, n=2, seed=0, seeds=seeds)
        whole = HFBackend(model, char_tokenizer, batch_size=8).generate(prompts, params)
        by_prompt = {c.prompt_index: [] for c in whole}
        for c in whole:
            by_prompt[c.prompt_index].append(c.token_ids)
        order = [3, 0, 2]
        part = HFBackend(model, char_tokenizer, batch_size=3).generate(
            [prompts[i] for i in order], params.model_copy(update={"seeds": tuple(seeds[i] for i in order)}))
        for c in part:
            assert by_prompt[order[c.prompt_index]][c.sample_index] == c.token_ids
        assert len({tuple(c.token_ids) for c in whole}) > 4
