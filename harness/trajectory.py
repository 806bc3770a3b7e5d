"""The one data structure shared by evaluation and training: a trajectory, and its tensor form.

A trajectory is a prompt followed by alternating segments of model tokens and environment tokens
(tool output, observations). Each model segment carries its step index, the policy version that
produced it and, when known, per-token behaviour and teacher log-probs. ``to_tensor_batch`` turns
a list of trajectories into right-padded ``(B, T)`` tensors aligned with the token positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # torch is imported inside the functions that build tensors (tasks import this module)
    import torch

SegmentKind = Literal["model", "env"]


@dataclass
class Segment:
    """A run of tokens produced by the model (``kind="model"``) or by the environment."""

    kind: SegmentKind
    token_ids: list[int]
    text: str = ""
    step: int | None = None  # model segments: 0-based step (assistant turn) index
    policy_version: int | None = None  # model segments: student version that sampled it
    behaviour_logprobs: list[float] | None = None  # log π_behaviour(token) at sampling time
    teacher_logprobs: list[float] | None = None  # log π_teacher(token | same prefix)
    finish_reason: str | None = None  # model segments: "stop" (EOS/stop string) or "length"
    top_ids: list[list[int]] | None = None  # model segments: per token the sampler's k most likely ids (student_topk)

    def __post_init__(self) -> None:
        if self.kind == "model" and self.step is None:
            raise ValueError("a model segment needs its step index")
        for name in ("behaviour_logprobs", "teacher_logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.token_ids):
                raise ValueError(f"{name} has {len(values)} entries for {len(self.token_ids)} tokens")


@dataclass
class Trajectory:
    """One episode: prompt tokens, then model/environment segments, plus outcome and timings."""

    task: str
    problem_id: str
    sample_index: int
    prompt_ids: list[int]
    prompt_text: str = ""
    segments: list[Segment] = field(default_factory=list)
    reward: float | None = None
    status: str | None = None  # grade: pass / fail / error
    extracted: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)

    @property
    def model_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.kind == "model"]

    @property
    def num_steps(self) -> int:
        return len(self.model_segments)

    @property
    def completion_text(self) -> str:
        """Everything after the prompt (model and environment text) as one string."""
        return "".join(s.text for s in self.segments)

    @property
    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def num_model_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.model_segments)

    @property
    def policy_version(self) -> int | None:
        """The oldest policy version that produced any token (staleness is measured from it)."""
        versions = [s.policy_version for s in self.model_segments if s.policy_version is not None]
        return min(versions) if versions else None

    @property
    def newest_policy_version(self) -> int | None:
        """The newest policy version that produced any token (equals :attr:`policy_version` unless the episode spans several)."""
        versions = [s.policy_version for s in self.model_segments if s.policy_version is not None]
        return max(versions) if versions else None


@dataclass
class TensorBatch:
    """Right-padded ``(B, T)`` tensors over prompt+response positions.

    Position ``t`` of every per-token tensor refers to token ``input_ids[:, t]`` predicted from its
    prefix; ``loss_mask`` is 1 on model tokens only (0 on prompt, environment tokens and padding).
    Log-prob tensors are 0 where unknown; ``step_index`` is -1 outside model tokens.
    """

    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, 1 on real tokens
    loss_mask: torch.Tensor  # (B, T) float
    step_index: torch.Tensor  # (B, T) long
    behaviour_logprobs: torch.Tensor  # (B, T) float
    teacher_logprobs: torch.Tensor  # (B, T) float
    rewards: torch.Tensor  # (B,) float, NaN where absent
    policy_version: torch.Tensor  # (B,) long, -1 where unknown
    group_ids: torch.Tensor  # (B,) long: trajectories of the same problem share an id
    # the teacher's distribution when a method reads it: a compact one (opd_harness.teacher_signal: hidden states + head, or
    # top-k + tail), or a dense (B, T, V) log-distribution (tests and references)
    teacher_dist: Any = None
    student_topk_ids: torch.Tensor | None = None  # (B, T, k) the student's top-k tokens at sampling time (student_topk signal)
    old_logprobs: torch.Tensor | None = None  # (B, T) trainer-recomputed π_old; None ⇒ the current student, detached
    teacher_fresh_logprobs: torch.Tensor | None = None  # (B, T) teacher re-scored at learner time (async)
    policy_lag: torch.Tensor | None = None  # (B,) learner version − behaviour version; None ⇒ 0 (sync)
    newest_version: torch.Tensor | None = None  # (B,) long: newest policy version among a row's tokens, -1 where unknown

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]


def to_tensor_batch(trajectories: list[Trajectory], pad_id: int) -> TensorBatch:
    """Pack trajectories into right-padded tensors; the loss mask covers model tokens only."""
    import torch

    if not trajectories:
        raise ValueError("cannot build a tensor batch from zero trajectories")
    rows = [_flatten(t) for t in trajectories]
    width = max(len(r[0]) for r in rows)
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    loss_mask = torch.zeros((batch, width), dtype=torch.float32)
    steps = torch.full((batch, width), -1, dtype=torch.long)
    behaviour = torch.zeros((batch, width), dtype=torch.float32)
    teacher = torch.zeros((batch, width), dtype=torch.float32)
    for b, (ids, mask, step, beh, tea) in enumerate(rows):
        n = len(ids)
        input_ids[b, :n] = torch.tensor(ids, dtype=torch.long)
        attention[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(mask, dtype=torch.float32)
        steps[b, :n] = torch.tensor(step, dtype=torch.long)
        behaviour[b, :n] = torch.tensor(beh, dtype=torch.float32)
        teacher[b, :n] = torch.tensor(tea, dtype=torch.float32)
    groups: dict[tuple[str, str], int] = {}
    group_ids = torch.tensor([groups.setdefault((t.task, t.problem_id), len(groups)) for t in trajectories])
    rewards = torch.tensor([float("nan") if t.reward is None else float(t.reward) for t in trajectories])
    versions = torch.tensor([-1 if t.policy_version is None else t.policy_version for t in trajectories])
    newest = torch.tensor([-1 if t.newest_policy_version is None else t.newest_policy_version for t in trajectories])
    top_ids = student_top_ids(trajectories, width)
    return TensorBatch(input_ids, attention, loss_mask, steps, behaviour, teacher, rewards, versions, group_ids,
                       student_topk_ids=top_ids, newest_version=newest)  # fmt: skip


def student_top_ids(trajectories: list[Trajectory], width: int) -> torch.Tensor | None:
    """(B, width, k) the sampler's k most likely ids at each model token's position (0 elsewhere), when every model
    segment carries them; None when none does."""
    import torch

    segments = [s for t in trajectories for s in t.model_segments if s.token_ids]
    if not segments or all(s.top_ids is None for s in segments):
        return None
    if any(s.top_ids is None for s in segments):
        raise ValueError("some model segments carry the sampler's top-k ids and some do not")
    k = len(segments[0].top_ids[0])
    out = torch.zeros((len(trajectories), width, k), dtype=torch.long)
    for b, traj in enumerate(trajectories):
        position = len(traj.prompt_ids)
        for seg in traj.segments:
            if seg.kind == "model" and seg.token_ids:
                out[b, position : position + len(seg.token_ids)] = torch.tensor(seg.top_ids, dtype=torch.long)
            position += len(seg.token_ids)
    return out


def _flatten(traj: Trajectory) -> tuple[list[int], list[float], list[int], list[float], list[float]]:
    ids = list(traj.prompt_ids)
    n_prompt = len(ids)
    mask, step, beh, tea = [0.0] * n_prompt, [-1] * n_prompt, [0.0] * n_prompt, [0.0] * n_prompt
    for seg in traj.segments:
        n = len(seg.token_ids)
        ids.extend(seg.token_ids)
        is_model = seg.kind == "model"
        mask.extend([1.0 if is_model else 0.0] * n)
        step.extend([seg.step if is_model else -1] * n)  # type: ignore[list-item]
        beh.extend(seg.behaviour_logprobs if is_model and seg.behaviour_logprobs else [0.0] * n)
        tea.extend(seg.teacher_logprobs if is_model and seg.teacher_logprobs else [0.0] * n)
    return ids, mask, step, beh, tea


PAD_VALUES = {"step_index": -1}  # what a padded position holds per tensor (input_ids: the parts' own pad token; others 0)


def pad_token(parts: list[TensorBatch]) -> int:
    """The pad token the parts were packed with (read off a padded position; 0 when no part has padding)."""
    for part in parts:
        padded = part.input_ids[part.attention_mask == 0]
        if padded.numel():
            return int(padded[0])
    return 0


def concat_batches(parts: list[TensorBatch]) -> TensorBatch:
    """One batch of ``parts``' rows in order, right-padded to the widest (what ``to_tensor_batch`` of all their
    trajectories would give), group ids renumbered to stay distinct across parts."""
    import torch

    from opd_harness.teacher_signal import is_distribution, pad_cat

    if len(parts) == 1:
        return parts[0]
    width, pad = max(p.shape[1] for p in parts), pad_token(parts)
    offsets = torch.tensor([0] + [int(p.group_ids.max()) + 1 for p in parts[:-1]]).cumsum(0)
    merged: dict[str, torch.Tensor | None] = {}
    for name in TensorBatch.__dataclass_fields__:
        values = [getattr(p, name) for p in parts]
        if all(v is None for v in values):
            merged[name] = None
        elif any(v is None for v in values):
            raise ValueError(f"cannot join batches where only some carry {name}")
        elif is_distribution(values[0]):
            merged[name] = type(values[0]).concat(values, width)
        elif name == "group_ids":
            merged[name] = torch.cat([v + int(offset) for v, offset in zip(values, offsets, strict=True)])
        elif values[0].dim() == 1:
            merged[name] = torch.cat(values)
        else:
            fill = pad if name == "input_ids" else PAD_VALUES.get(name, 0)
            merged[name] = pad_cat(values, width, fill)
    return TensorBatch(**merged)
