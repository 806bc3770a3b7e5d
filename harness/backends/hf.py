"""Hugging Face transformers backend: batched sampling with per-token log-probs, and scoring.

Sampling is seeded per row: row (prompt ``p``, sample ``s``) draws from its own generator seeded
``prompt_seed(params, p) + s`` (:func:`opd_harness.backends.prompt_seed`, as vLLM seeds a request's samples), so a
row's tokens do not depend on the other rows of its batch, on ``batch_size`` or on the prompts' order. Unseeded
calls draw each row's seed from torch's global RNG."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import EosTokenCriteria, StoppingCriteria, StoppingCriteriaList, StopStringCriteria

from opd_harness.backends import SCORE_FIELDS, Completion, SamplingParams, prompt_seed
from opd_harness.backends.sampling import ScoredRowSampler


class HFBackend:
    """Wraps an in-memory causal LM; training code may update the model in place between calls."""

    score_fields = SCORE_FIELDS  # ``score`` returns any of them
    gives_top_ids = True  # ``generate`` honours SamplingParams.top_logprobs (Completion.top_ids)
    presence_penalty = False  # SamplingParams.presence_penalty is refused (vllm and openai apply it)

    def __init__(
        self, model, tokenizer, *, batch_size: int = 64, device: str = "cpu", show_progress: bool = False, score_chunk: int = 0,
        score_tokens: int = 0,
    ) -> None:
        if score_chunk < 0:
            raise ValueError(f"score_chunk {score_chunk}: positions per chunk must be 0 (off) or more")
        if score_tokens < 0:
            raise ValueError(f"score_tokens {score_tokens}: padded tokens per forward must be 0 (off) or more")
        self.model = model.to(device)
        self.score_chunk = score_chunk  # > 0: ``score`` without gradient computes the logits this many positions at a time
        self.score_tokens = score_tokens  # > 0: ``score`` without gradient runs length-sorted row groups of this many padded tokens
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"
        self.batch_size = batch_size
        self.device = device
        self.version = 0
        self.show_progress = show_progress
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.max_context: int | None = getattr(model.config, "max_position_embeddings", None)  # rollout's context budget
        self._fast_decode = fast_decoder(tokenizer)

    @classmethod
    def load(cls, model: str, *, dtype: str = "fp32", enable_thinking: bool | None = None, **options) -> "HFBackend":
        """Load a local directory or hub id (a hub id not cached is refused at once offline) with its weights in ``dtype``
        (fp32, bf16, fp16 or auto: bf16 on a CUDA device that supports it); ``enable_thinking`` is passed to the chat
        template. Device and dtype are checked before any weights are read."""
        from opd_harness.config import device_unavailable
        from opd_harness.models.hub import dtype_name, set_thinking, torch_dtype
        from opd_harness.models.tiny import load_model_and_tokenizer

        device = options.get("device", "cpu")
        why = device_unavailable(device, key="device")
        if why:
            raise ValueError(why)
        if device == "auto":
            import torch

            options["device"] = device = "cuda" if torch.cuda.is_available() else "cpu"
        chosen = dtype_name(dtype, device=device)
        lm, tok = load_model_and_tokenizer(model, dtype=torch_dtype(chosen))
        if enable_thinking is not None:
            set_thinking(tok, enable_thinking)
        return cls(lm, tok, **options)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Replace the weights (async rollout workers) and record the policy version."""
        self.model.load_state_dict(state_dict)
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``params.n`` samples per prompt; log-probs are of the untempered model distribution."""
        if params.presence_penalty:
            raise ValueError(f"the {type(self).__name__} backend has no presence penalty (presence_penalty={params.presence_penalty:g}); "
                             "use the vllm or openai backend, or presence_penalty 0")  # fmt: skip
        if params.seeds is not None and len(params.seeds) != len(prompts):
            raise ValueError(f"SamplingParams.seeds has {len(params.seeds)} seeds for {len(prompts)} prompts; give one per prompt")
        jobs = [(p, s) for p in range(len(prompts)) for s in range(params.n)]
        seeds = [row_seed(params, p, s) for p, s in jobs]
        out: list[Completion] = []
        was_training = self.model.training
        self.model.eval()
        chunks = range(0, len(jobs), self.batch_size)
        for start in tqdm(chunks, desc="generate", leave=False, disable=not self.show_progress):
            chunk = slice(start, start + self.batch_size)
            out.extend(self._generate_chunk(prompts, jobs[chunk], seeds[chunk], params))
        self.model.train(was_training)
        return out

    def _generate_chunk(
        self, prompts: list[list[int]], chunk: list[tuple[int, int]], seeds: list[int], params: SamplingParams
    ) -> list[Completion]:
        started = time.perf_counter()
        ids, attn = left_pad([prompts[p] for p, _ in chunk], self.pad_id, width_multiple=self.width_multiple)
        stops = SampledLengths(self.stop_criteria(params.stop), prompt_width=ids.shape[1])
        kwargs = dict(
            max_new_tokens=params.max_new_tokens,
            do_sample=False,  # ScoredRowSampler draws each sampled row from its own generator (argmax when greedy): greedy emits it
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            stopping_criteria=StoppingCriteriaList([stops]),
            return_dict_in_generate=True,
        )
        new_tokens, logprobs, top = self._sample(ids, attn, seeds, params, kwargs)
        lengths = stops.lengths(len(chunk))
        elapsed = time.perf_counter() - started
        completions = []
        token_rows, logprob_rows = new_tokens.tolist(), logprobs.tolist()  # one conversion each, not one per row
        top_rows = top.tolist() if top is not None else None
        for row, (p, s) in enumerate(chunk):
            stopped = lengths[row] is not None
            n = lengths[row] if stopped else new_tokens.shape[1]
            tokens = token_rows[row][:n]
            completions.append(
                Completion(
                    token_ids=tokens,
                    logprobs=logprob_rows[row][:n],
                    top_ids=top_rows[row][:n] if top_rows is not None else None,
                    text=self._decode(tokens),
                    finish_reason="stop" if stopped else "length",
                    prompt_index=p,
                    sample_index=s,
                    timings={"generate_s": elapsed / len(chunk)},
                )
            )
        return completions

    width_multiple = 1  # prompts are left-padded to a multiple of this width (1: the longest prompt's)

    def _sample(
        self, ids: torch.Tensor, attn: torch.Tensor, seeds: list[int], params: SamplingParams, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Sample the rows: the new tokens (b, new), their untempered log-probs and (``params.top_logprobs`` = k) the k most
        likely ids per step (b, new, k), recorded step by step by :class:`ScoredRowSampler` (one (b,) or (b, k) tensor a
        step: the (b, new, V) logits of every step are never kept). ``kwargs`` are ``model.generate``'s keywords for the
        chunk (``max_new_tokens``, ``stopping_criteria`` …), which :meth:`_generate_tokens` runs or mirrors."""
        sampler = ScoredRowSampler(seeds, params.temperature, params.top_p, self.device, top_ids=params.top_logprobs, top_k=params.top_k,
                                   block=params.max_new_tokens)  # fmt: skip
        new_tokens = self._generate_tokens(ids.to(self.device), attn.to(self.device), sampler, kwargs)
        top = sampler.top_ids()
        top = top[:, : new_tokens.shape[1]].cpu() if top is not None else None
        return new_tokens.cpu(), sampler.logprobs()[:, : new_tokens.shape[1]].cpu(), top

    def _generate_tokens(self, ids: torch.Tensor, attn: torch.Tensor, sampler: ScoredRowSampler, kwargs: dict) -> torch.Tensor:
        """The new tokens (b, new) of left-padded rows, each step's token ``sampler.choose``'s: :func:`decode_loop`, the
        forward passes of ``model.generate`` without its per-step machinery (``hf_static`` runs ``model.generate`` itself,
        for its static cache and compiled decode step)."""
        return decode_loop(self.model, ids, attn, sampler.choose, kwargs["stopping_criteria"], kwargs["max_new_tokens"], self.pad_id)

    def stop_criteria(self, stop: tuple[str, ...]) -> StoppingCriteriaList:
        """What ends a row: its EOS (kept, so the loss covers it) or a completed stop string (as transformers matches it)."""
        criteria = StoppingCriteriaList([EosTokenCriteria(self.eos_id)] if self.eos_id is not None else [])
        if stop:
            criteria.append(StopStringCriteria(self.tokenizer, list(stop)))
        return criteria

    def _decode(self, tokens: list[int]) -> str:
        """A completion's text (special tokens skipped), through the Rust tokenizer directly where that decodes as the HF
        wrapper does (:func:`fast_decoder`: a third of the wrapper's cost a call)."""
        if self._fast_decode is not None:
            return self._fast_decode(tokens, skip_special_tokens=True)
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        want: tuple[str, ...] = ("logprobs",),
        top_k: int = 0,
        grad: bool = False,
        token_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-position scores for right-padded sequences (position 0 has no prefix and scores 0).

        ``want`` ⊆ {"logprobs", "entropy", "topk", "full", "hidden", "at_ids"}: log-prob of each given token, entropy of
        the predictive distribution, top-k (values, indices), the full log-distribution, the last hidden states that predict
        each position (``hidden``: (B, T, H), what the output head maps to the logits; position 0 zeros), and the log-probs of
        ``token_ids`` (B, T, k) at each position (``at_ids_logprobs``). With ``score_tokens`` (and no gradient) rows run in
        length-sorted groups cut to their longest row (:func:`length_buckets`); positions past a row's length hold the model's
        guesses after padding, or 0 past its group's longest row (nothing reads them).
        """
        unknown = set(want) - set(SCORE_FIELDS)
        if unknown:
            raise ValueError(f"unknown score fields {sorted(unknown)}; allowed: {SCORE_FIELDS}")
        if "at_ids" in want and token_ids is None:
            raise ValueError("score field at_ids needs token_ids (B, T, k): the tokens to score at each position")
        aligned = () if token_ids is None else (token_ids,)
        if self.score_tokens and not grad:
            return bucketed(lambda ids, mask, *ids_k: self._score_whole(ids, mask, want, top_k, grad, *ids_k), input_ids,
                            attention_mask, self.score_tokens, *aligned)  # fmt: skip
        return self._score_whole(input_ids, attention_mask, want, top_k, grad, *aligned)

    def _score_whole(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, want: tuple[str, ...], top_k: int, grad: bool,
        token_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """:meth:`score` of all rows in one forward (or one pass from the last hidden states)."""
        ids, attention = input_ids.to(self.device), attention_mask.to(self.device)
        token_ids = token_ids.to(self.device) if token_ids is not None else None
        if not grad and (self.score_chunk or "hidden" in want):
            return self._score_from_hidden(ids, attention, want, top_k, token_ids)
        with torch.set_grad_enabled(grad):
            logits = self.model(input_ids=ids, attention_mask=attention).logits
            return scores_from_logits(logits.float(), ids, want, top_k, token_ids)

    @torch.no_grad()
    def _score_from_hidden(
        self, ids: torch.Tensor, attention: torch.Tensor, want: tuple[str, ...], top_k: int, token_ids: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """:meth:`score` from the last hidden states: the output head runs ``score_chunk`` positions at a time into
        preallocated outputs (the whole (B, T, V) logits and their float32 copy never exist, only the ``full`` output when it
        is asked for), or over all positions at once without ``score_chunk``; ``hidden`` returns the states themselves."""
        with without_output_head(self.model) as head:
            hidden = self.model(input_ids=ids, attention_mask=attention).logits  # the last hidden states
        fields = tuple(f for f in want if f != "hidden")
        out = {"hidden": F.pad(hidden[:, :-1], (0, 0, 1, 0))} if "hidden" in want else {}  # position t: the state before it
        if not fields:
            return out
        if not self.score_chunk:
            return {**out, **scores_from_logits(head(hidden).float(), ids, fields, top_k, token_ids)}
        rows, length = ids.shape
        top = top_k if "topk" in fields else token_ids.shape[-1] if token_ids is not None else 0
        out.update(empty_scores(rows, length, int(head.weight.shape[0]), fields, top, ids.device))
        for b in range(rows):
            for start, stop in chunk_bounds(length - 1, self.score_chunk):  # hidden start..stop-1 predict tokens start+1..stop
                logits = head(hidden[b : b + 1, start : stop + 1]).float()  # the last one predicts past the chunk, and is dropped
                chosen = token_ids[b : b + 1, start : stop + 1] if token_ids is not None else None
                chunk = scores_from_logits(logits, ids[b : b + 1, start : stop + 1], fields, top_k, chosen)
                for name, value in chunk.items():
                    out[name][b, start + 1 : stop + 1] = value[0, 1:]  # the chunk's own position 0 is its context token
        return out


@torch.no_grad()
def decode_loop(
    model, ids: torch.Tensor, attn: torch.Tensor, choose: Callable[[torch.Tensor], torch.Tensor], stops: StoppingCriteria,
    max_new_tokens: int, pad_id: int,
) -> torch.Tensor:
    """Sample up to ``max_new_tokens`` tokens after the left-padded rows ``ids`` (mask ``attn``): the new tokens (b, new).
    Each step's token per row is ``choose(logits)`` of the step's (b, V) float32 next-token logits; a row ``stops`` has
    ended (called as generate calls its stopping criteria) takes ``pad_id`` from then on; the loop ends when every row
    has ended, or after ``max_new_tokens`` steps.

    The forward passes are ``model.generate``'s, input for input (position ids from the mask, the mask left out when no
    row is padded, the last position's logits only, a dynamic KV cache), so the logits, and the tokens chosen from them,
    are bit for bit those of ``model.generate`` choosing by a logits processor under greedy decoding, with no processor
    of the model's generation config (e.g. ``repetition_penalty``). What it leaves out is generate's work around them at
    every step (input preparation, the processor and criteria lists, the (b, V) mask a processor hands greedy decoding
    to pick its token from): half of generate's time outside the forwards at the cpu-demo shape on a CPU (issue #46,
    ``benchmarks/hf_generate_overhead.py``)."""
    rows, width = ids.shape
    accepted = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in accepted else "past_key_values"  # transformers 5 renamed it
    fixed = {"use_cache": True, **({"logits_to_keep": 1} if "logits_to_keep" in accepted else {})}
    mask = None if bool(attn.all()) else torch.cat([attn, attn.new_ones(rows, max_new_tokens)], dim=1)
    positions = (attn.cumsum(-1) - 1).masked_fill_(attn == 0, 0)
    takes_positions = "position_ids" in accepted  # as generate: position ids only for a model that takes them
    sequence = torch.cat([ids, ids.new_full((rows, max_new_tokens), pad_id)], dim=1)  # what stop criteria read
    running = torch.ones(rows, dtype=torch.bool, device=ids.device)
    step = 0
    with decoding(model):
        first = {"position_ids": positions} if takes_positions else {}
        out = model(input_ids=ids, attention_mask=None if mask is None else attn, **first, **fixed)
        for step in range(max_new_tokens):
            token = torch.where(running, choose(out.logits[:, -1].float()), pad_id)
            sequence[:, width + step] = token
            running &= ~stops(sequence[:, : width + step + 1], None)
            if step + 1 == max_new_tokens or not bool(running.any()):
                break
            seen = None if mask is None else mask[:, : width + step + 1]
            later = {"position_ids": positions[:, -1:] + step + 1} if takes_positions else {}
            out = model(input_ids=token[:, None], attention_mask=seen, **later, **{cache_arg: getattr(out, cache_arg)}, **fixed)
    return sequence[:, width : width + step + 1]


def decoding(model) -> contextlib.AbstractContextManager:
    """What ``model.generate`` wraps its decode loop in (an MoE's faster expert kernels on an accelerator), or nothing."""
    optimize = getattr(model, "_optimize_model_for_decode", None)
    return optimize() if optimize is not None else contextlib.nullcontext()


def row_seed(params: SamplingParams, prompt_index: int, sample_index: int) -> int:
    """The generator seed of one sampled row: its prompt's seed plus the sample index (a fresh draw when unseeded)."""
    seed = prompt_seed(params, prompt_index)
    return int(torch.randint(0, 2**63 - 1, ())) if seed is None else seed + sample_index


class SampledLengths(StoppingCriteria):
    """Stops rows by ``criteria`` and records how many tokens each row sampled before it stopped: generate pads a
    stopped row with the pad token, which may be EOS itself, so the sampled length cannot be read from token values."""

    def __init__(self, criteria: StoppingCriteriaList, *, prompt_width: int) -> None:
        self.criteria = criteria
        self.prompt_width = prompt_width
        self._stopped_at: torch.Tensor | None = None  # (b,) new tokens when the row stopped; -1 while it runs

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = self.criteria(input_ids, scores, **kwargs)
        if self._stopped_at is None:
            self._stopped_at = torch.full(done.shape, -1, dtype=torch.long, device=done.device)
        first = done & (self._stopped_at < 0)
        self._stopped_at = torch.where(first, input_ids.shape[1] - self.prompt_width, self._stopped_at)
        return done

    def lengths(self, rows: int) -> list[int | None]:
        """Per row the tokens sampled up to and including the one that stopped it; None for a row cut at the token limit."""
        if self._stopped_at is None:
            return [None] * rows
        return [n if n >= 0 else None for n in self._stopped_at.cpu().tolist()]


def scores_from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, want: tuple[str, ...], top_k: int = 0, token_ids: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Shift next-token logits onto the positions they predict and compute the requested fields (``at_ids``: the log-probs
    of ``token_ids`` (B, T, k), position-aligned like the rest)."""
    logp = F.log_softmax(logits[:, :-1], dim=-1)  # predicts tokens 1..T-1
    pad = lambda x: F.pad(x, (0, 0) * (x.dim() - 2) + (1, 0))  # noqa: E731  prepend position 0
    out: dict[str, torch.Tensor] = {}
    if "logprobs" in want:
        out["logprobs"] = pad(logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1))
    if "entropy" in want:
        out["entropy"] = pad(-(logp.exp() * logp).sum(-1))
    if "topk" in want:
        values, indices = logp.topk(top_k, dim=-1)
        out["topk_logprobs"], out["topk_ids"] = pad(values), pad(indices)
    if "full" in want:
        out["full"] = pad(logp)
    if "at_ids" in want:
        out["at_ids_logprobs"] = pad(logp.gather(-1, token_ids[:, 1:]))
    return out


def length_buckets(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Row indices sorted longest first and cut into groups whose padded size (rows × the group's longest row) stays
    within ``token_budget`` (a longer row is a group of its own): forwards that skip most of a batch's padding."""
    order = sorted(range(len(lengths)), key=lambda row: (-lengths[row], row))
    groups: list[list[int]] = []
    for row in order:
        if groups and (len(groups[-1]) + 1) * max(lengths[groups[-1][0]], 1) <= token_budget:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def bucketed(
    score: Callable[..., dict[str, torch.Tensor]],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    token_budget: int,
    *aligned: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """``score(ids, mask, *aligned)`` of right-padded rows, run per :func:`length_buckets` group on the group's columns only
    (``aligned`` (B, T, …) tensors cut likewise) and put back in row order, zero-padded to the full width (autograd flows
    through when ``score`` keeps a graph)."""
    width = input_ids.shape[1]
    slices = bucket_slices(attention_mask, token_budget)
    parts: dict[str, list[torch.Tensor]] = {}
    for index, cols in slices:
        for name, value in score(input_ids[index, :cols], attention_mask[index, :cols], *(a[index, :cols] for a in aligned)).items():
            parts.setdefault(name, []).append(F.pad(value, (0, 0) * (value.dim() - 2) + (0, width - cols)))
    inverse = torch.argsort(torch.cat([index for index, _ in slices]))
    return {name: torch.cat(values)[inverse] for name, values in parts.items()}


def bucket_slices(attention_mask: torch.Tensor, token_budget: int) -> list[tuple[torch.Tensor, int]]:
    """Each :func:`length_buckets` group of right-padded rows as (row indices, columns): the rows, longest first, and the
    group's longest length (at least 1), so ``x[index, :cols]`` is the group's part of any (B, T, …) tensor."""
    lengths = [int(n) for n in attention_mask.sum(-1).tolist()]
    groups = length_buckets(lengths, token_budget)
    return [(torch.tensor(rows, device=attention_mask.device), max(lengths[rows[0]], 1)) for rows in groups]


def chunk_bounds(length: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of at most ``size`` covering ``range(length)``."""
    return [(start, min(start + size, length)) for start in range(0, length, size)]


def empty_scores(rows: int, length: int, vocab: int, want: tuple[str, ...], top_k: int, device) -> dict[str, torch.Tensor]:
    """Zero tensors for every field of ``want`` (position 0 keeps its 0, as :func:`scores_from_logits` pads it)."""
    f32, long = torch.float32, torch.long
    shapes = {"logprobs": [("logprobs", (rows, length), f32)], "entropy": [("entropy", (rows, length), f32)],
              "full": [("full", (rows, length, vocab), f32)],
              "topk": [("topk_logprobs", (rows, length, top_k), f32), ("topk_ids", (rows, length, top_k), long)],
              "at_ids": [("at_ids_logprobs", (rows, length, top_k), f32)]}  # fmt: skip
    return {name: torch.zeros(shape, dtype=dtype, device=device) for field in want for name, shape, dtype in shapes[field]}


@contextlib.contextmanager
def without_output_head(model) -> Iterator[torch.nn.Module]:
    """``model``'s output head swapped for an identity while the block runs (its forward then returns the last hidden states
    as ``logits``); yields the head. Tied weights stay tied: the head module is put back, its parameter never left the model."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output head (get_output_embeddings) to run in chunks")
    model.set_output_embeddings(torch.nn.Identity())
    try:
        yield head
    finally:
        model.set_output_embeddings(head)


def fast_decoder(tokenizer) -> Callable[..., str] | None:
    """The Rust tokenizer's own ``decode`` where the HF wrapper's adds nothing to it (a ``TokenizersBackend`` with
    its stock ``decode`` and no clean-up of spaces), else None (also for a stand-in tokenizer with no ``decode``, which
    scoring alone never calls): a per-token saving for the detokeniser."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind = type(tokenizer)
    stock = getattr(kind, "decode", None) is PreTrainedTokenizerBase.decode and getattr(kind, "_decode", None) is TokenizersBackend._decode
    if not stock or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return tokenizer.backend_tokenizer.decode


def left_pad(seqs: list[list[int]], pad_id: int, *, width_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists for batched generation (decoder-only models continue on the right), to the longest
    prompt's width rounded up to ``width_multiple`` (few distinct shapes for a compiled forward)."""
    width = -(-max(len(s) for s in seqs) // width_multiple) * width_multiple
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            attn[i, width - len(s) :] = 1
    return ids, attn
