"""The learner's side of a training step: forward with gradient, objective, optimizer update."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from opd_harness.backends.hf import bucket_slices, bucketed, length_buckets, without_output_head
from opd_harness.method import HParams, MethodSpec, StudentOutputs
from opd_harness.teacher_signal import apply_terms, is_distribution
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.chunked_vocab import ChunkedVocabulary, PositionFn, token_logprob, token_logprob_and_entropy
from opd_harness.trainers.distributed import Shard, gather_rows, local_rows, shard_bounds
from opd_harness.trainers.objectives import masked_mean
from opd_harness.trainers.objectives.common import k3


def student_outputs(
    model: torch.nn.Module,
    batch: TensorBatch,
    full: bool,
    shard: Shard | None = None,
    precision: str = "fp32",
    vocab_chunk: int = 0,
    forward_tokens: int = 0,
) -> tuple[StudentOutputs, torch.Tensor]:
    """Current-student log-probs (and full distribution if asked) with gradient, plus detached entropy.

    With a ``shard`` the forward runs on this rank's rows only and the outputs are gathered into the global batch's
    (:mod:`opd_harness.trainers.distributed`), so the objective sees every row. ``precision="bf16"``: the forward (and so its
    backward) under bfloat16 autocast. ``vocab_chunk`` > 0: the (T, V) logits are never materialised whole: the
    sampled-token log-probs and entropy, and for ``full`` the distribution the objective reads, are computed chunk by chunk
    of positions (:mod:`opd_harness.trainers.chunked_vocab`). ``forward_tokens`` > 0: the
    forward runs on length-sorted row groups of at most that many padded tokens (:func:`opd_harness.backends.hf.bucketed`),
    one graph and one backward over all of them: the same loss and gradients with less padding computed (:func:`student_pass`
    runs the backward per bucket instead, bounding activations by one bucket's). With a ``shard``
    every rank makes as many forward calls as the rank with the most buckets (:func:`paired_bucketed`), so the collectives
    DDP and FSDP2 run in each forward and backward pair across ranks.

    Unchunked, the forward stops at the last hidden states and the output head, log-softmax, entropy and the method's
    full-vocabulary terms run only at the positions a loss reads (:func:`loss_positions`, the completion tokens), as TRL's
    trainers do: at a vocabulary of 151,936 the prompt's and the padding's (T, V) work was most of the step (issue 46).
    Log-probs, entropy and terms are 0 at the other positions, which every objective masks out."""
    if vocab_chunk:
        return chunked_student_outputs(model, batch, vocab_chunk, shard=shard, precision=precision)
    rows = batch.input_ids.shape[0]
    ids, attention = local_rows(batch.input_ids, shard), local_rows(batch.attention_mask, shard)
    positions = loss_positions(local_rows(batch.loss_mask, shard))

    heads: list[torch.nn.Module] = []

    def forward(ids: torch.Tensor, attention: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden, head = hidden_states(model, ids, attention, precision)
        heads.append(head)
        return {"hidden": hidden}

    if forward_tokens:
        calls = bucket_calls(batch.attention_mask, shard, forward_tokens)
        hidden = paired_bucketed(forward, ids, attention, forward_tokens, calls)["hidden"]
    else:
        hidden = forward(ids, attention)["hidden"]
    log_dist = position_log_distribution(hidden, heads[0], positions, precision)

    def vocab_map(fn: PositionFn, *aligned: Any) -> torch.Tensor:
        return gather_rows(position_terms(fn, log_dist, positions, *(local_rows(a, shard) for a in aligned)), shard, rows)

    logprobs = gather_rows(position_logprobs(log_dist, ids, positions), shard, rows)
    outputs = StudentOutputs(logprobs=logprobs, vocab_map=vocab_map if full else None)
    return outputs, gather_rows(position_entropy(log_dist.detach(), positions), shard, rows)


def loss_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the positions a loss reads (``loss_mask`` > 0; position 0, which no prefix predicts, never)."""
    positions = loss_mask > 0
    positions[:, 0] = False
    return positions


def position_log_distribution(
    hidden: torch.Tensor, head: torch.nn.Module, positions: torch.Tensor, precision: str
) -> torch.Tensor:
    """(N, V) float32 log-distribution at the N ``positions`` of (B, T) rows from their (B, T, H) last hidden states (position
    t from state t − 1): the output head and log-softmax run on those positions only, not on the prompt and padding."""
    before = hidden[:, :-1][positions[:, 1:]]
    with autocast(hidden.device, precision):
        logits = head(before)
    return torch.log_softmax(logits.float(), dim=-1)


def position_logprobs(log_dist: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, T) log-probs of the tokens ``ids`` at the N ``positions`` from their (N, V) ``log_dist``, 0 elsewhere."""
    return at_positions(log_dist.gather(-1, ids[positions].unsqueeze(-1)).squeeze(-1), positions)


def position_entropy(log_dist: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, T) entropy of the (N, V) ``log_dist`` at its N ``positions``, 0 elsewhere."""
    return at_positions(-(log_dist.exp() * log_dist).sum(-1), positions)


def position_terms(fn: PositionFn, log_dist: torch.Tensor, positions: torch.Tensor, *aligned: Any) -> torch.Tensor:
    """``fn`` over the (N, V) ``log_dist`` of the N ``positions`` of (B, T) rows, with the (B, T, ...) ``aligned`` tensors or
    teacher distributions at those positions; back on (B, T), 0 elsewhere."""
    local = (a.to(log_dist.device)[positions] for a in aligned)
    return at_positions(apply_terms(fn, log_dist, *local), positions)


def at_positions(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(N, ...) per-position values back on their (B, T) ``positions``, zero elsewhere (with gradient)."""
    out = values.new_zeros((*positions.shape, *values.shape[1:]))
    return out.index_put((positions,), values)


def bucket_calls(attention: torch.Tensor, shard: Shard | None, token_budget: int) -> int:
    """The most length-bucket forwards (:func:`~opd_harness.backends.hf.length_buckets`) any rank makes on its rows of the global
    batch (``attention``: the global (B, T) mask). Every rank holds the global batch, so every rank computes the same number
    without communicating."""
    lengths = [int(n) for n in attention.sum(-1).tolist()]
    world = shard.world if shard is not None else 1
    bounds = [shard_bounds(len(lengths), rank, world) for rank in range(world)]
    return max(len(length_buckets(lengths[start:stop], token_budget)) for start, stop in bounds)


def rank_bucket_tokens(attention: torch.Tensor, shard: Shard | None, token_budget: int) -> tuple[int, int]:
    """(padded tokens of all its length buckets, of its largest bucket) of the rank with the most bucketed tokens, from the
    global (B, T) mask: every rank computes the same numbers without communicating."""
    lengths = [int(n) for n in attention.sum(-1).tolist()]
    world = shard.world if shard is not None else 1
    worst = (0, 0)
    for start, stop in (shard_bounds(len(lengths), rank, world) for rank in range(world)):
        sizes = [len(group) * max(lengths[start + group[0]], 1) for group in length_buckets(lengths[start:stop], token_budget)]
        worst = max(worst, (sum(sizes), max(sizes, default=0)))
    return worst


def fits_one_graph(
    model: torch.nn.Module, attention: torch.Tensor, shard: Shard | None, forward_tokens: int, full: bool, vocab_chunk: int,
    precision: str, budget_gib: float, loss_mask: torch.Tensor | None = None,
) -> bool:
    """Whether one graph over the step's length buckets keeps at most ``budget_gib`` GiB of activations on every rank
    (the memory plan's estimate, :func:`opd_harness.memory_plan.one_graph_bytes`, from the student's config): then the
    step needs no per-bucket backward and its extra forward. With the step's (B, T) ``loss_mask`` the vocabulary side
    counts the loss's positions, where :func:`student_outputs` runs it. False when the model has no readable config."""
    from opd_harness.memory_plan import GIB, one_graph_bytes, shape_from_config

    inner = getattr(model, "module", model)  # DDP's wrapped model
    config = getattr(inner, "config", None)
    if budget_gib <= 0 or config is None or not hasattr(config, "to_dict"):
        return False
    try:
        shape = shape_from_config(config.to_dict(), "student", "the student's config")
    except ValueError:
        return False
    graph, bucket = rank_bucket_tokens(attention, shard, forward_tokens)
    flag = "is_activation_checkpointing" if hasattr(type(inner), "is_activation_checkpointing") else "is_gradient_checkpointing"
    checkpointing = bool(getattr(inner, flag, False))  # transformers 5 renamed the flag
    need = one_graph_bytes(shape, graph_tokens=graph, bucket_tokens=bucket, dtype_bytes=2 if precision == "bf16" else 4,
                           checkpointing=checkpointing, student_full=full, vocab_chunk=vocab_chunk,
                           vocab_tokens=None if loss_mask is None else rank_loss_tokens(loss_mask, shard))  # fmt: skip
    return need <= budget_gib * GIB


def rank_loss_tokens(loss_mask: torch.Tensor, shard: Shard | None) -> int:
    """The most loss positions (:func:`loss_positions`) any rank has of the global (B, T) ``loss_mask``."""
    counts = loss_positions(loss_mask).sum(-1).tolist()
    world = shard.world if shard is not None else 1
    return max(int(sum(counts[start:stop])) for start, stop in (shard_bounds(len(counts), rank, world) for rank in range(world)))


def paired_bucketed(
    forward: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
    ids: torch.Tensor,
    attention: torch.Tensor,
    token_budget: int,
    calls: int,
    *aligned: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """:func:`~opd_harness.backends.hf.bucketed` on this rank's rows (``aligned`` (B, T) tensors cut with them), then empty
    forwards (a 2-token row, its ``aligned`` values 1) up to ``calls`` forwards.

    DDP broadcasts buffers in every forward and FSDP2 all-gathers parameters in every forward and again in its backward,
    so every rank must call the model equally often. Each empty forward's outputs are added to the real ones with weight 0
    (the values are unchanged, bit for bit), which puts it in the loss's graph: its backward, and so FSDP2's collectives
    in it, run too, in the same order on every rank (autograd runs the later forwards' graphs first)."""
    own = len(length_buckets([int(n) for n in attention.sum(-1).tolist()], token_budget))
    scores = bucketed(forward, ids, attention, token_budget, *aligned)
    for _ in range(calls - own):
        extra = forward(ids.new_zeros((1, 2)), attention.new_ones((1, 2)), *(a.new_ones((1, 2)) for a in aligned))
        tie = 0.0 * sum(value.sum() for value in extra.values() if value.is_floating_point())
        scores = {name: value + tie if value.is_floating_point() else value for name, value in scores.items()}
    return scores


def chunked_student_outputs(
    model: torch.nn.Module, batch: TensorBatch, vocab_chunk: int, shard: Shard | None = None, precision: str = "fp32"
) -> tuple[StudentOutputs, torch.Tensor]:
    """:func:`student_outputs` with the full distribution as a chunked map (``StudentOutputs.over_vocabulary``): the forward
    stops at the last hidden states, and log-probs, entropy and the method's terms are computed ``vocab_chunk`` positions at a
    time; a shard's map runs on its rows of the aligned tensors and gathers its outputs into the global batch's.

    Every rank makes one forward call, whatever its rows. Under FSDP2 the head's weight is the root's gathered parameter:
    the root stays unsharded from its forward to the end of the backward (:func:`opd_harness.trainers.distributed.shard_fully`), so
    the chunks (in the forward and in the backward's recompute, as many as the rank's rows need) make no collective, and
    the head's gradient is reduce-scattered once, with the rest of the root's."""
    rows = batch.input_ids.shape[0]
    ids, attention = local_rows(batch.input_ids, shard), local_rows(batch.attention_mask, shard)
    hidden, head = hidden_states(model, ids, attention, precision)
    chunks = ChunkedVocabulary(hidden, head, vocab_chunk, lambda: autocast(ids.device, precision))

    def vocab_map(fn, *aligned: torch.Tensor) -> torch.Tensor:
        return gather_rows(chunks.map(fn, *(local_rows(a, shard) for a in aligned)), shard, rows)

    both = chunks.map(token_logprob_and_entropy, ids)
    logprobs, entropy = gather_rows(both[..., 0], shard, rows), gather_rows(both[..., 1].detach(), shard, rows)
    return StudentOutputs(logprobs=logprobs, vocab_map=vocab_map), entropy


def hidden_states(
    model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, precision: str
) -> tuple[torch.Tensor, torch.nn.Module]:
    """The decoder's last hidden states (n, T, H) of ``ids`` and the model's output head (for :class:`ChunkedVocabulary`)."""
    inner = getattr(model, "module", model)  # DDP's wrapped model; the forward still goes through the wrapper
    with autocast(ids.device, precision), without_output_head(inner) as head:
        hidden = model(input_ids=ids, attention_mask=attention).logits  # the head is an identity: the last hidden states
    if hasattr(head.weight, "full_tensor"):  # a DTensor: FSDP2 resharded the root after its forward
        raise RuntimeError("trainer.vocab_chunk under fsdp2 needs the root module unsharded after its forward "
                           "(fully_shard(model, reshard_after_forward=False), as shard_fully does)")  # fmt: skip
    return hidden, head


@dataclass
class StudentPass:
    """What the objective reads of the student (``outputs``, detached ``entropy``) and how its loss reaches the weights:
    ``backward(loss)`` accumulates d loss / d parameters into their ``.grad`` (synchronised over data-parallel ranks)."""

    outputs: StudentOutputs
    entropy: torch.Tensor
    backward: Callable[[torch.Tensor], None]


def student_pass(
    model: torch.nn.Module,
    batch: TensorBatch,
    full: bool,
    shard: Shard | None = None,
    precision: str = "fp32",
    vocab_chunk: int = 0,
    forward_tokens: int = 0,
    bucket_backward: bool = True,
    graph_memory_gib: float = 0.0,
) -> StudentPass:
    """The student's outputs for one training step, and their backward.

    A step whose rows fit one ``forward_tokens`` bucket on every rank (or ``forward_tokens`` 0, or ``bucket_backward``
    off, or whose one graph over its buckets fits ``graph_memory_gib``: :func:`fits_one_graph`) keeps one graph:
    :func:`student_outputs`, then ``loss.backward()``. Otherwise the step is cut into buckets in both directions
    (:class:`BucketBackward`): activation memory is one bucket's, for one more forward without a graph."""
    calls = bucket_calls(batch.attention_mask, shard, forward_tokens) if forward_tokens and bucket_backward else 1
    if calls > 1 and fits_one_graph(model, batch.attention_mask, shard, forward_tokens, full, vocab_chunk, precision, graph_memory_gib,
                                    loss_mask=batch.loss_mask):  # fmt: skip
        calls = 1
    if calls <= 1:
        outputs, entropy = student_outputs(model, batch, full, shard=shard, precision=precision, vocab_chunk=vocab_chunk,
                                           forward_tokens=forward_tokens)  # fmt: skip
        return StudentPass(outputs, entropy, lambda loss: loss.backward())
    cached = BucketBackward(StudentForward(model, precision, vocab_chunk), batch, shard, forward_tokens, calls)
    outputs, entropy = cached.first_pass(full)
    return StudentPass(outputs, entropy, cached.backward)


@dataclass
class StudentForward:
    """The student's forward on some of this rank's rows, as both passes of :class:`BucketBackward` run it, with a graph
    when grad mode is on. The forward stops at the (n, T, H) last hidden states, the ``state`` a method's vocabulary terms
    are computed from (:meth:`terms`). Unchunked, the output head and log-softmax run at the rows' loss positions only
    (:func:`loss_positions`, as :func:`student_outputs` does; log-probs and entropy 0 elsewhere); with ``vocab_chunk``: at
    every position, ``vocab_chunk`` positions at a time."""

    model: torch.nn.Module
    precision: str
    vocab_chunk: int = 0
    head: torch.nn.Module | None = None

    def __call__(self, ids: torch.Tensor, attention: torch.Tensor, want: tuple[str, ...],
                 loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
        """The fields of ``want`` (``logprobs``, ``entropy``, ``state``) for right-padded rows ``ids`` whose (n, T)
        ``loss_mask`` says where a loss reads them, each (n, T, ...)."""
        hidden, self.head = hidden_states(self.model, ids, attention, self.precision)
        out = {"state": hidden} if "state" in want else {}
        if not self.vocab_chunk:
            positions = loss_positions(loss_mask)
            if "logprobs" in want or "entropy" in want:
                log_dist = position_log_distribution(hidden, self.head, positions, self.precision)
            if "logprobs" in want:
                out["logprobs"] = position_logprobs(log_dist, ids, positions)
            if "entropy" in want:
                out["entropy"] = position_entropy(log_dist, positions)
            return out
        if "entropy" in want:
            both = self.chunks(hidden).map(token_logprob_and_entropy, ids)
            out["logprobs"], out["entropy"] = both[..., 0], both[..., 1]
        elif "logprobs" in want:
            out["logprobs"] = self.chunks(hidden).map(token_logprob, ids)
        return out

    def chunks(self, hidden: torch.Tensor) -> ChunkedVocabulary:
        return ChunkedVocabulary(hidden, self.head, self.vocab_chunk, lambda: autocast(hidden.device, self.precision))

    def terms(self, state: torch.Tensor, loss_mask: torch.Tensor, fn: PositionFn, *aligned: Any) -> torch.Tensor:
        """``fn`` over the rows' vocabulary (what :meth:`StudentOutputs.over_vocabulary` computes), (n, T, ...), from their
        (n, T, H) hidden ``state``: unchunked at the (n, T) ``loss_mask``'s positions (0 elsewhere), chunked at every one."""
        if self.vocab_chunk:
            return self.chunks(state).map(fn, *aligned)
        positions = loss_positions(loss_mask)
        return position_terms(fn, position_log_distribution(state, self.head, positions, self.precision), positions, *aligned)


@dataclass
class _Recorded:
    """One ``over_vocabulary(fn, *aligned)`` call of the objective in the first pass, and the terms it was given (a leaf)."""

    fn: PositionFn
    aligned: tuple
    leaf: torch.Tensor


@dataclass
class BucketBackward:
    """Gradient caching over length buckets: the step's backward one ``forward_tokens`` bucket at a time, with the gradients
    of one graph over the whole step.

    First pass, without a graph: the student's log-probs (and entropy) of every bucket, gathered over ranks, become leaf
    tensors; the objective runs on them (the whole global batch: token means, groups, method state), and every
    ``over_vocabulary`` call it makes is recorded and answered with its terms as a leaf too. Unchunked, the vocabulary side
    runs at the loss's positions only (:class:`StudentForward`), per bucket, or for a method that reads the full
    distribution once over the step's loss positions, whose (N, V) log-distribution the terms read until the backward
    (as the one-graph step holds it). ``backward(loss)`` takes
    d loss / d leaves, then, per bucket of this rank's rows, runs the forward again with a graph and back-propagates the
    cached gradient of its rows (×W under data parallelism, as :class:`opd_harness.trainers.distributed._GatherRows` does), freeing
    the graph before the next bucket. Every rank makes ``calls`` forwards in each pass and ``calls`` backwards (padding with
    2-token rows whose gradient is zero); DDP synchronises on the last backward only (``no_sync`` before), FSDP2
    reduce-scatters after each (its gradients stay sharded; the averaged sums add up to the same gradient)."""

    forward: StudentForward
    batch: TensorBatch
    shard: Shard | None
    forward_tokens: int
    calls: int
    recorded: list[_Recorded] = field(default_factory=list)
    terms: Callable[..., torch.Tensor] | None = None  # the first pass's vocabulary terms of this rank's rows, until backward
    logprobs: torch.Tensor | None = None  # the global (B, T) leaf

    @property
    def rows(self) -> int:
        """Rows of the global batch."""
        return self.batch.input_ids.shape[0]

    def local(self, tensor: Any) -> Any:
        """This rank's rows of a global (B, …) tensor or teacher distribution."""
        return local_rows(tensor, self.shard)

    def first_pass(self, full: bool) -> tuple[StudentOutputs, torch.Tensor]:
        """Log-probs (a leaf: the objective's loss is differentiated w.r.t. them) and entropy of every row, no graph kept."""
        ids, attention, mask = (self.local(t) for t in (self.batch.input_ids, self.batch.attention_mask, self.batch.loss_mask))
        whole = full and not self.forward.vocab_chunk  # the terms read every loss position's distribution: computed once
        want = ("state",) if whole else ("logprobs", "entropy", "state") if full else ("logprobs", "entropy")
        with torch.no_grad():
            scores = paired_bucketed(lambda i, a, m: self.forward(i, a, want, m), ids, attention, self.forward_tokens, self.calls, mask)
            if whole:
                positions = loss_positions(mask)
                log_dist = position_log_distribution(scores["state"], self.forward.head, positions, self.forward.precision)
                scores = {"logprobs": position_logprobs(log_dist, ids, positions), "entropy": position_entropy(log_dist, positions)}
                self.terms = lambda fn, *aligned: position_terms(fn, log_dist, positions, *aligned)
            elif full:
                hidden = scores["state"]
                self.terms = lambda fn, *aligned: self.forward.terms(hidden, mask, fn, *aligned)
            self.logprobs = gather_rows(scores["logprobs"], self.shard, self.rows).requires_grad_(True)
            entropy = gather_rows(scores["entropy"], self.shard, self.rows)
        return StudentOutputs(logprobs=self.logprobs, vocab_map=self.record if full else None), entropy

    def record(self, fn: PositionFn, *aligned: object) -> torch.Tensor:
        """``over_vocabulary(fn, *aligned)`` in the first pass: the global terms as a leaf, remembered for the second pass."""
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in aligned):
            raise ValueError("over_vocabulary's aligned tensors must not require grad under trainer.forward_tokens bucketing")
        if self.terms is None:
            raise RuntimeError("over_vocabulary after the backward: the first pass's distribution is gone")
        with torch.no_grad():
            local = self.terms(fn, *(self.local(a) for a in aligned))
            leaf = gather_rows(local, self.shard, self.rows).requires_grad_(True)
        self.recorded.append(_Recorded(fn, aligned, leaf))
        return leaf

    def backward(self, loss: torch.Tensor) -> None:
        """d loss / d parameters, accumulated into ``.grad`` one bucket at a time (see the class)."""
        self.terms = None  # the first pass's distribution: only the recorded terms are needed now
        grads = self.cached_grads(loss)
        ids, attention, mask = (self.local(t) for t in (self.batch.input_ids, self.batch.attention_mask, self.batch.loss_mask))
        slices = bucket_slices(attention, self.forward_tokens)
        for call in range(self.calls):
            with gradient_sync(self.forward.model, last=call == self.calls - 1):
                if call < len(slices):
                    self.bucket_backward(ids, attention, mask, *slices[call], grads)
                else:  # an empty forward and a zero backward: the collectives of the ranks with more buckets
                    ones = attention.new_ones((1, 2))
                    padding = self.forward(ids.new_zeros((1, 2)), ones, ("logprobs",), ones)["logprobs"]
                    torch.autograd.backward(padding, torch.zeros_like(padding))

    def cached_grads(self, loss: torch.Tensor) -> list[torch.Tensor | None]:
        """d loss / d (log-probs, each recorded call's terms) on this rank's rows, ×W (None: the loss does not use it)."""
        leaves = [self.logprobs, *(r.leaf for r in self.recorded)]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * len(leaves)
        world = self.shard.world if self.shard is not None else 1
        return [None if g is None else self.local(g) * world if world > 1 else g for g in grads]

    def bucket_backward(self, ids: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, cols: int,
                        grads: list[torch.Tensor | None]) -> None:  # fmt: skip
        """One bucket's forward with a graph, its outputs' cached gradients back-propagated, the graph freed."""
        logprob_grad, term_grads = grads[0], grads[1:]
        needed = [(r, g) for r, g in zip(self.recorded, term_grads, strict=True) if g is not None]
        want = ("logprobs",) * (logprob_grad is not None or not needed) + ("state",) * bool(needed)
        scores = self.forward(ids[index, :cols], attention[index, :cols], want, mask[index, :cols])
        outputs, cached = [], []
        if "logprobs" in scores:
            outputs.append(scores["logprobs"])
            cached.append(logprob_grad[index, :cols] if logprob_grad is not None else torch.zeros_like(scores["logprobs"]))
        for recorded, grad in needed:
            aligned = (self.local(a)[index, :cols] for a in recorded.aligned)
            outputs.append(self.forward.terms(scores["state"], mask[index, :cols], recorded.fn, *aligned))
            cached.append(grad[index, :cols])
        torch.autograd.backward(outputs, cached)


def gradient_sync(model: torch.nn.Module, last: bool):
    """DDP: no gradient all-reduce before the ``last`` backward of a step (``no_sync``; the last reduces the accumulated sum).
    FSDP2 and a single rank: nothing (FSDP2 reduce-scatters every backward, which keeps its gradients sharded)."""
    return model.no_sync() if not last and hasattr(model, "no_sync") else contextlib.nullcontext()


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TensorBatch,
    method: MethodSpec,
    hparams: HParams,
    state: object = None,
    *,
    grad_clip: float = 1.0,
    shard: Shard | None = None,
    precision: str = "fp32",
    vocab_chunk: int = 0,
    forward_tokens: int = 0,
    bucket_backward: bool = True,
    graph_memory_gib: float = 0.0,
) -> dict[str, float]:
    """One optimizer step of ``method`` on ``batch``; returns loss, grad norm, entropy and diagnostics.

    With a ``shard`` (``model`` wrapped in DDP or sharded with FSDP2) this is one rank's part of the data-parallel step on
    the global ``batch``: the same loss, global gradient norm, diagnostics and update on every rank
    (:mod:`opd_harness.trainers.distributed`).

    A non-finite loss or gradient norm is never applied: the update is skipped and reported as
    ``nonfinite = skipped = 1``; the driver then stops or goes on (``trainer.on_nonfinite``).

    The batch goes to the model's device (a model on CUDA learns from the CPU batch the rollout made);
    ``precision="bf16"`` is autocast with float32 master weights, gradients and optimizer state; ``vocab_chunk`` > 0
    computes a full-vocabulary method's terms that many positions at a time (:mod:`opd_harness.trainers.chunked_vocab`);
    ``forward_tokens`` > 0 runs the forward on length-sorted row groups, and with ``bucket_backward`` the backward too, one
    group at a time (:func:`student_pass`) unless one graph over the groups fits ``graph_memory_gib`` GiB.

    A method that reads π_old on a batch without ``old_logprobs`` (:func:`old_logprobs_redundant`: they equal this
    forward's log-probs, detached) gets the engine/trainer mismatch measured against this forward instead.
    """
    model.train()
    needs = method.needs(hparams)
    batch = batch_to(batch, next(model.parameters()).device)
    student = student_pass(model, batch, full="student_full" in needs, shard=shard, precision=precision, vocab_chunk=vocab_chunk,
                           forward_tokens=forward_tokens, bucket_backward=bucket_backward, graph_memory_gib=graph_memory_gib)  # fmt: skip
    outputs, entropy = student.outputs, student.entropy
    loss, diagnostics = method.objective(batch, outputs, hparams, state)
    if "old_logprobs" in needs and batch.old_logprobs is None and batch.behaviour_logprobs is not None:
        diagnostics = {**diagnostics, **behaviour_mismatch(batch.behaviour_logprobs, outputs.logprobs.detach(), batch.loss_mask)}
    optimizer.zero_grad(set_to_none=True)
    student.backward(loss)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip) if grad_clip > 0 else total_grad_norm(model)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2: a replicated DTensor
    finite = bool(torch.isfinite(loss.detach())) and bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return {
        "loss": float(loss.detach()),
        "grad_norm": float(grad_norm),
        "student_entropy": float(masked_mean(entropy, batch.loss_mask)),
        "nonfinite": float(not finite),
        "skipped": float(not finite),
        **diagnostics,
    }


def old_logprobs_redundant(trainer) -> bool:
    """Whether π_old equals the training forward's log-probs (detached), so the rollout need not score it (verl and TRL
    skip it likewise): every batch is trained by the policy that sampled it (sync, or async with max_lag or fixed_lag 0),
    with one optimizer step (the learner's only kind), π_old is the trainer's model's (``behaviour_logprobs=recompute``)
    and both forwards run in float32 (bf16 autocast would score the training forward differently)."""
    lag_zero = trainer.mode == "sync" or trainer.fixed_lag == 0 or (trainer.fixed_lag is None and trainer.max_lag == 0)
    return lag_zero and trainer.behaviour_logprobs == "recompute" and trainer.precision == "fp32"


def behaviour_mismatch(engine_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's sampling-time log-probs q are from the trainer's recomputed o on the trained tokens:
    ``behaviour_mismatch_kl``, the k3 estimate of KL(π_engine ‖ π_trainer) on the engine's samples (verl's and
    AReaL's training/inference mismatch metric; ≥ 0, 0 when they agree), and the largest |q − o|."""
    engine_logp, trainer_logp = engine_logp.float(), trainer_logp.float()
    gap = torch.where(mask > 0, (engine_logp - trainer_logp).abs(), 0.0)
    return {
        "behaviour_mismatch_kl": float(masked_mean(k3(engine_logp, trainer_logp), mask)),
        "behaviour_mismatch_max": float(gap.max()) if gap.numel() else 0.0,
    }


def autocast(device: torch.device, precision: str):
    """bfloat16 autocast on ``device`` for ``precision="bf16"``; nothing for ``fp32``."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision != "bf16":
        raise ValueError(f"precision {precision!r}: choose fp32 or bf16")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def batch_to(batch: TensorBatch, device: torch.device) -> TensorBatch:
    """``batch`` with every tensor on ``device`` (itself when they are there already)."""
    if batch.input_ids.device == device:
        return batch
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return dataclasses.replace(batch, **{k: v.to(device) for k, v in moved.items() if isinstance(v, torch.Tensor) or is_distribution(v)})


def total_grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """L2 norm of all gradients, without clipping (``grad_clip = 0`` still guards against non-finite gradients)."""
    grads = [p.grad.detach().float() for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)  # over DTensors too (FSDP2's shards)
