"""The teacher's signal in the form a batch carries it: the kinds a teacher produces and a method accepts, and the compact
distributions that stand in for the teacher's (B, T, V) log-distribution.

Kinds (``teacher.signal``; a method lists those it accepts in ``MethodSpec.teacher_kinds``):

- ``sampled``: the teacher's log-prob of each sampled token only (``TensorBatch.teacher_logprobs``; every kind has it);
- ``topk``: the teacher's top-k log-probs and token ids (k = ``teacher.top_k``) plus one tail bucket holding the rest of
  the mass, so that it is a (k + 1)-way distribution (:class:`TopKDistribution`);
- ``student_topk``: the teacher's log-probs on the student's top-k tokens at sampling time, plus the tail
  (:class:`TopKDistribution` over the student's ids);
- ``full``: the exact distribution, carried as the teacher's last hidden states (B, T, H) and applied through a copy of its
  output head chunk by chunk on the learner (:class:`HiddenDistribution`): H values per token instead of V (4,096 vs 151,936
  for Qwen3-8B, ~37× fewer, 74× in bf16), and never a (B, T, V) tensor in a batch.

An objective reads the teacher's distribution only through ``StudentOutputs.over_vocabulary(fn, batch.teacher_dist)``:
:func:`apply_terms` hands ``fn`` the two log-distributions of each position, the full ones for ``full`` and, for the top-k
kinds, both coarse-grained onto the same k + 1 buckets (the k tokens and the rest of the vocabulary). A per-position
divergence computed on the coarse pair is the method's top-k formula: for the reverse KL, a lower bound of the full one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opd_harness.lazy import lazy_import

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")

KINDS = ("sampled", "topk", "student_topk", "full")
DISTRIBUTION_KINDS = ("full", "topk", "student_topk")  # what a method reading the teacher's distribution may accept
SCORE_FIELD = {"full": "hidden", "topk": "topk", "student_topk": "at_ids"}  # the backend score field each kind is made from
TAIL_FLOOR = 1e-12  # the teacher's tail mass is at least this (its top-k may round to a total above 1)


def coarse_student(student_log: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(…, k + 1): the student's log-probs of ``ids`` and the log of its mass on every other token.

    The rest is a sum of the small probabilities outside ``ids`` (no 1 − Σ cancellation); where ``ids`` cover the whole
    vocabulary it is clamped to the smallest float, so a 0 · log 0 term stays finite with a zero gradient."""
    inside = student_log.gather(-1, ids)
    rest = student_log.exp().scatter(-1, ids, 0.0).sum(-1, keepdim=True)  # one vocabulary-sized tensor less than a mask
    return torch.cat([inside, rest.clamp(min=torch.finfo(rest.dtype).tiny).log()], dim=-1)


def coarse_teacher(logp: torch.Tensor) -> torch.Tensor:
    """(…, k + 1): the teacher's log-probs of its k tokens and the log of the remaining mass (computed in float64)."""
    rest = (1.0 - logp.double().exp().sum(-1, keepdim=True)).clamp(min=TAIL_FLOOR).log()
    return torch.cat([logp, rest.to(logp.dtype)], dim=-1)


@dataclass
class TopKDistribution:
    """The teacher's log-probs on k tokens per position (its own top-k, or the student's) plus a tail bucket: (B, T, k)
    ``ids`` and ``logp``, float32 log-probs; position 0 and untrained positions hold zeros (nothing reads them)."""

    ids: torch.Tensor
    logp: torch.Tensor
    kind: str = "topk"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.ids.shape)

    def __getitem__(self, key: Any) -> "TopKDistribution":
        return TopKDistribution(self.ids[key], self.logp[key], self.kind)

    def to(self, device: Any) -> "TopKDistribution":
        return TopKDistribution(self.ids.to(device), self.logp.to(device), self.kind)

    @classmethod
    def concat(cls, parts: list["TopKDistribution"], width: int) -> "TopKDistribution":
        """The parts' rows in order, right-padded with zeros to ``width`` positions."""
        return cls(pad_cat([p.ids for p in parts], width), pad_cat([p.logp for p in parts], width), parts[0].kind)

    def pair(self, student_log: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Student and teacher log-distributions over the same k + 1 buckets."""
        return coarse_student(student_log, self.ids), coarse_teacher(self.logp.to(student_log.dtype)).detach()

    def nbytes(self) -> int:
        return self.ids.nbytes + self.logp.nbytes


@dataclass
class HiddenDistribution:
    """The teacher's exact distribution as its last hidden states (B, T, H) (position t holds the state that predicts token
    t; position 0 zeros) and its output ``head``: ``pair`` applies the head to the positions asked for, so the (…, V) logits
    exist one chunk at a time. The head is not pickled with a batch: a learner in another process attaches its own copy
    (:meth:`with_head`), shipped once per run."""

    hidden: torch.Tensor
    head: Any = None  # a module mapping (…, H) to (…, V) logits; None until attached
    kind: str = "full"

    @property
    def shape(self) -> tuple[int, ...]:
        vocab = int(self.head.weight.shape[0]) if self.head is not None else -1
        return (*self.hidden.shape[:-1], vocab)

    def __getitem__(self, key: Any) -> "HiddenDistribution":
        return HiddenDistribution(self.hidden[key], self.head, self.kind)

    def to(self, device: Any) -> "HiddenDistribution":
        return HiddenDistribution(self.hidden.to(device), self.head, self.kind)

    @classmethod
    def concat(cls, parts: list["HiddenDistribution"], width: int) -> "HiddenDistribution":
        """The parts' rows in order, right-padded with zero states to ``width`` positions."""
        return cls(pad_cat([p.hidden for p in parts], width), parts[0].head, parts[0].kind)

    def with_head(self, head: Any) -> "HiddenDistribution":
        return HiddenDistribution(self.hidden, head, self.kind)

    def __getstate__(self) -> dict:
        return {"hidden": self.hidden, "head": None, "kind": self.kind}  # the head travels once, not with every batch

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def log_distribution(self) -> torch.Tensor:
        """log-softmax of the head's logits at these positions, float32 (…, V)."""
        if self.head is None:
            raise ValueError("the teacher's output head is not attached to its hidden states (HiddenDistribution.with_head)")
        weight = self.head.weight
        with torch.no_grad():
            logits = self.head(self.hidden.to(device=weight.device, dtype=weight.dtype))
        return torch.log_softmax(logits.float(), dim=-1)

    def pair(self, student_log: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return student_log, self.log_distribution().to(student_log.device, student_log.dtype)

    def nbytes(self) -> int:
        return self.hidden.nbytes


TeacherDistribution = TopKDistribution | HiddenDistribution


def is_distribution(value: object) -> bool:
    """Whether ``value`` is a compact teacher distribution (not a plain tensor)."""
    return isinstance(value, TopKDistribution | HiddenDistribution)


def apply_terms(fn: Callable[..., torch.Tensor], student_log: torch.Tensor, *aligned: Any) -> torch.Tensor:
    """``fn(student_log, *aligned)`` with a teacher distribution among ``aligned`` replaced by its log-distribution, and the
    student's coarse-grained onto the same buckets when the teacher's is top-k; plain tensors pass as they are."""
    args = list(aligned)
    for i, value in enumerate(args):
        if is_distribution(value):
            student_log, args[i] = value.pair(student_log)
    return fn(student_log, *args)


def attach_head(dist: object, head: Any) -> object:
    """``dist`` with the teacher's output head when it is carried as hidden states and has none; anything else as it is."""
    if isinstance(dist, HiddenDistribution) and dist.head is None and head is not None:
        return dist.with_head(head)
    return dist


def bytes_per_token(kind: str, *, hidden: int, top_k: int, dtype_bytes: int) -> int:
    """What one token of a batch costs for the teacher's signal of ``kind`` (the sampled log-prob included): 4 for
    ``sampled``; + k float32 log-probs and k int64 ids for the top-k kinds; + H hidden values for ``full``."""
    extra = {"sampled": 0, "topk": 12 * top_k, "student_topk": 12 * top_k, "full": hidden * dtype_bytes}
    if kind not in extra:
        raise ValueError(f"unknown teacher signal kind {kind!r}; kinds: {', '.join(KINDS)}")
    return 4 + extra[kind]


def pad_cat(tensors: list[torch.Tensor], width: int, fill: float = 0) -> torch.Tensor:
    """(B, T, …) tensors right-padded with ``fill`` along T to ``width`` and joined along B."""
    return torch.cat([_pad_width(t, width, fill) for t in tensors])


def _pad_width(tensor: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """``tensor`` (B, T, ...) right-padded along T to ``width`` with ``fill``."""
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    shape = (tensor.shape[0], missing, *tensor.shape[2:])
    return torch.cat([tensor, torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)], dim=1)
