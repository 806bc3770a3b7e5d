"""The method contract: a training method's :class:`MethodSpec` (objective, hyper-parameters, declared inputs),
the student quantities an objective reads, and the input names a method may declare. Methods live in
``trainers/objectives/`` and register a :class:`MethodSpec` in ``opd_harness.registry.METHODS``; a run that cannot
provide the inputs a method declares fails at config validation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeAlias

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # torch stays unloaded until an objective runs: listing methods reads only their specs
    import torch

    from opd_harness.trajectory import TensorBatch

# Inputs a method may declare; the pipeline provides each or refuses the run up front.
INPUTS = {
    "behaviour_logprobs": "student log-probs of sampled tokens at generation time",
    "old_logprobs": "π_old: log-probs of the sampled tokens under the behaviour weights, recomputed by the trainer's model "
    "(trainer.behaviour_logprobs=recompute) or the rollout engine's (engine); PPO-style ratios, docs/methods/opd.md and grpo.md",
    "teacher_logprobs": "teacher log-probs of the sampled tokens",
    "teacher_dist": "the teacher's distribution at every position, in a kind the method accepts (MethodSpec.teacher_kinds: "
    "full, topk, student_topk; teacher.signal chooses, opd_harness.teacher_signal)",
    "student_full": "full current-student distribution (with gradient)",
    "rewards": "a scalar outcome reward per trajectory (the task's grade)",
    "step_boundaries": "step index per token (multi-step trajectories)",
    "reference_responses": "dataset/teacher responses instead of student samples",
    "policy_lag": "learner version minus behaviour version per sample (async mode)",
    "teacher_fresh_logprobs": "teacher log-probs re-scored at learner time (supervision drift; optional)",
}


class HParams(BaseModel):
    """Base of every method's hyper-parameters; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class StudentOutputs:
    """Current-student quantities computed by the learner with gradient enabled."""

    logprobs: torch.Tensor  # (B, T) log π_θ(token t | prefix)
    full: torch.Tensor | None = None  # (B, T, V) log π_θ(· | prefix), when the method needs it (unchunked)
    # trainer.vocab_chunk > 0: map(fn, *aligned) runs fn over the distribution a chunk of positions at a time instead
    vocab_map: Callable[..., torch.Tensor] | None = None

    @property
    def has_full(self) -> bool:
        """Whether the full distribution was computed (whole, or as a chunked map)."""
        return self.full is not None or self.vocab_map is not None

    def over_vocabulary(self, fn: Callable[..., torch.Tensor], *aligned: torch.Tensor) -> torch.Tensor:
        """``fn(log π_θ(· | prefix), *aligned)`` at every (B, T) position: per-position terms (B, T) or (B, T, k) of the full
        distribution (last dim V) and ``aligned`` (B, T, ...) tensors; the teacher's distribution among them may be a compact one
        (:mod:`opd_harness.teacher_signal`: ``fn`` then gets both log-distributions as that kind gives them). Objectives read the full
        distribution only through this, so ``trainer.vocab_chunk`` can run ``fn`` a chunk of positions at a time (it must
        treat positions independently); the caller reduces the terms over positions."""
        if self.vocab_map is not None:
            return self.vocab_map(fn, *aligned)
        if self.full is None:
            raise ValueError("the full student distribution was not computed: the method must declare student_full")
        from opd_harness.teacher_signal import apply_terms

        return apply_terms(fn, self.full, *(a.to(self.full.device) for a in aligned))


class MethodState(Protocol):
    """Mutable per-run state of a method with a schedule; saved in every checkpoint."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


Objective: TypeAlias = Callable[["TensorBatch", StudentOutputs, HParams, object], "tuple[torch.Tensor, dict[str, float]]"]


@dataclass(frozen=True)
class MethodSpec:
    """A registered training method: its objective, hyper-parameters and declared inputs."""

    description: str
    objective: Objective
    hparams: type[HParams]
    needs: Callable[[HParams], frozenset[str]]
    on_policy: bool = True  # False: trains on reference responses, no student sampling
    modes: tuple[str, ...] = ("sync", "async")
    # The pipeline a run of this method takes when nothing sets trainer.mode (a preset, a config file, --set, --mode);
    # one of ``modes`` (default: the first). Methods whose weighting reads the policy lag (f-OPD and its async baselines)
    # declare async.
    default_mode: str = ""
    make_state: Callable[[HParams], MethodState] | None = None  # schedules (SAF warm-up/anneal, f-OPD refresh)
    notes: dict[str, str] = field(default_factory=dict)
    run_notes: Callable[[HParams], dict[str, str]] | None = None  # notes that depend on a run's hyper-parameters
    # Methods with a group-centred reward advantage (GRPO family): samples per prompt when the config sets none.
    # Their baseline needs ≥ 2 samples per prompt; config validation refuses 1 unless hparams.allow_single_sample.
    group_size: int | None = None
    # The kinds of the teacher's distribution (opd_harness.teacher_signal.DISTRIBUTION_KINDS) a method reading teacher_dist
    # accepts, preferred first; teacher.signal=auto takes the first one the teacher's backend produces.
    teacher_kinds: Callable[[HParams], tuple[str, ...]] = lambda hp: ("full",)
    name: str = ""  # set by the registry from the method's entry-point name (a method is named once)

    def __post_init__(self) -> None:
        if not self.default_mode:
            object.__setattr__(self, "default_mode", self.modes[0])
        if self.default_mode not in self.modes:
            raise ValueError(f"default_mode {self.default_mode!r} is not one of the method's modes {list(self.modes)}")

    def group_baseline(self, hparams: HParams) -> bool:
        """Whether this method, with these hyper-parameters, centres rewards on a per-prompt group mean."""
        return self.group_size is not None and "rewards" in self.needs(hparams)

    def accepted_signals(self, hparams: HParams) -> tuple[str, ...]:
        """The teacher signal kinds a run of this method can use: its distribution kinds when it reads ``teacher_dist``,
        ``sampled`` when it reads only the teacher's log-probs of the sampled tokens, none when it reads no teacher."""
        needs = self.needs(hparams)
        if "teacher_dist" in needs:
            return tuple(self.teacher_kinds(hparams))
        return ("sampled",) if "teacher_logprobs" in needs else ()

    def describe(self, hparams: HParams | None = None) -> dict:
        """Name, description, defaults, declared inputs and notes, for ``harness methods --json``; given a
        run's ``hparams`` (``method.json``), the inputs and notes are that run's."""
        defaults = self.hparams()
        chosen = defaults if hparams is None else hparams
        return {
            "name": self.name,
            "description": self.description,
            "defaults": defaults.model_dump(),
            "inputs": sorted(self.needs(chosen)),
            "teacher_kinds": list(self.accepted_signals(chosen)),
            "on_policy": self.on_policy,
            "modes": list(self.modes),
            "default_mode": self.default_mode,
            "stateful": self.make_state is not None,
            "samples_per_prompt": self.group_size,
            "notes": {**self.notes, **(self.run_notes(chosen) if self.run_notes else {})},
        }
