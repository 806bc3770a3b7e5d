"""SAF-OPD — Stable Advantage Fusion (docs/methods/saf-opd.md, verified from the official verl fork).

Four switchable stages act on the raw OPD advantage a_t = (T_t − o_t)·m_t only, in order:

1. top-k% sparsification per sequence:  keep_t = m_t·1[|a_t| ≥ τ_b],  τ_b = quantile_{1−k/100}(|a| on V_b)
2. bounded compression:                 â_t = c·tanh(a_t) on kept tokens (NOT c·tanh(a/c)), else 0
3. KL-triggered linear warm-up σ_w(s) (frozen once done; early stop on a relative KL drop ≥ δ)
4. linear annealing a(s) from 1 to c_min once warm-up is over

then fused with GRPO:  A_total = g·A^grpo·m + c_opd·a(s)·σ_w(s)·â, PPO-clip surrogate, token-mean.
Stages 3 and 4 are a state machine (:class:`Schedule`) advanced once per objective call and saved in
checkpoints. Its KL signal K_s is the token-mean k3 between the current student and the teacher
(monitored, no gradient), read with a one-step lag as in the official code. The schedule's rules and
a worked example: docs/methods/saf-opd.md, 'The warm-up and annealing schedule'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import Field

from opd_harness.lazy import lazy_import
from opd_harness.method import MethodSpec, StudentOutputs
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.objectives import masked_mean
from opd_harness.trainers.objectives.common import clipped_surrogate, graded_reward_mean, k3, old_logprobs, opd_advantage
from opd_harness.trainers.objectives.grpo import DUAL_CLIP_NOTE, ClipParams, GroupParams, grpo_sequence_advantages

if TYPE_CHECKING:
    import torch
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")


class SAFParams(ClipParams, GroupParams):
    # Stage 1 — top-k% sparsification
    topk: bool = Field(True, description="Stage 1 switch: per-sequence top-k% sparsification by |a|")
    topk_percent: float = Field(20.0, ge=0, le=100, description="k: percent of valid tokens kept (identity unless 0 < k < 100)")
    # Stage 2 — bounded tanh compression
    tanh: bool = Field(True, description="Stage 2 switch: â = c·tanh(a) on kept tokens")
    tanh_coef: float = Field(0.1, gt=0, description="c in c·tanh(a)")
    # Stage 3 — KL-triggered warm-up
    warmup: bool = Field(True, description="Stage 3 switch: linear warm-up σ_w(s) = min(s/N, 1)")
    warmup_steps: int = Field(100, ge=0, description="N (0 also disables Stage 3)")
    kl_drop_delta: float = Field(0.2, ge=0, description="δ: stop warm-up early once (KL_0 − K)/KL_0 ≥ δ (0 = never)")
    # Stage 4 — linear annealing
    anneal: bool = Field(True, description="Stage 4 switch: a(s) = c_min + (1 − c_min)·max(0, 1 − u/R) after warm-up")
    anneal_min: float = Field(0.0, ge=0, le=1, description="c_min")
    anneal_steps: int = Field(200, ge=0, description="R when anneal_total_steps = 0")
    anneal_total_steps: int = Field(0, ge=0, description="S > 0: R = max(1, S − warm-up end step) ('over the remaining steps')")
    anneal_without_warmup: bool = Field(True, description="Stage 3 off: anneal from step 1 (code) or not at all (README)")
    # Fusion
    opd_coef: float = Field(1.0, description="c_opd")
    grpo_coef: float = Field(1.0, description="g (0 = pure OPD, TRAIN_MODE=opd; no rewards needed)")


def sparsify(adv: torch.Tensor, mask: torch.Tensor, k_percent: float) -> torch.Tensor:
    """Stage 1 keep mask (B, L): per sequence, tokens with |a| at or above the (1 − k/100) linear quantile of |a| on its valid tokens."""
    valid = mask > 0
    if not 0.0 < k_percent < 100.0:
        return valid.to(adv.dtype)  # stage inactive: keep = m
    magnitude = adv.detach().abs()
    keep = torch.zeros_like(valid)
    level = 1.0 - k_percent / 100.0
    for b in range(adv.shape[0]):
        values = magnitude[b][valid[b]]
        if values.numel() == 0:
            continue  # n_b = 0 keeps nothing
        # τ_b = v_⌊p⌋ + (p − ⌊p⌋)(v_⌈p⌉ − v_⌊p⌋) over sorted |a|, p = level·(n − 1)
        tau = torch.quantile(values, level, interpolation="linear")
        keep[b] = valid[b] & (magnitude[b] >= tau)  # ties at τ are all kept
    return keep.to(adv.dtype)


def compress(adv: torch.Tensor, keep: torch.Tensor, c: float) -> torch.Tensor:
    """Stage 2: â = c·tanh(a) on kept tokens, 0 elsewhere; |â| < c, slope c near 0 (the code's form, not c·tanh(a/c))."""
    return torch.where(keep > 0, c * torch.tanh(adv), torch.zeros_like(adv))


_STATE_FIELDS = (
    "step",
    "last_kl",
    "kl_0",
    "warmup_done",
    "early_stopped",
    "frozen_scale",
    "warmup_end_step",
    "anneal_active",
    "anneal_t",
    "anneal_horizon",
)


@dataclass
class Schedule:
    """Stage 3+4 state machine: call :meth:`advance` once per training step, then :meth:`record_kl`.

    The rules: docs/methods/saf-opd.md, 'The warm-up and annealing schedule'.
    """

    warmup_steps: int = 100  # N; 0 = no warm-up (σ_w ≡ 1)
    kl_drop_delta: float = 0.2  # δ; 0 = no early stop
    anneal: bool = True
    anneal_min: float = 0.0  # c_min
    anneal_steps: int = 200  # R unless anneal_total_steps > 0
    anneal_total_steps: int = 0  # S
    anneal_without_warmup: bool = True  # N = 0: anneal from step 1 (code) or never (README)
    # State, saved by state_dict(); names follow the official _get_opd_sa_state_dict
    step: int = field(default=0, init=False)  # s of the last advance(); verl global_steps starts at 1
    last_kl: float | None = field(default=None, init=False)  # K_{s−1}, the one-step-lagged KL
    kl_0: float | None = field(default=None, init=False)  # first KL seen (K_1, read at s = 2)
    warmup_done: bool = field(default=False, init=False)
    early_stopped: bool = field(default=False, init=False)
    frozen_scale: float | None = field(default=None, init=False)  # σ*
    warmup_end_step: int | None = field(default=None, init=False)
    anneal_active: bool = field(default=False, init=False)
    anneal_t: int = field(default=0, init=False)  # u
    anneal_horizon: int | None = field(default=None, init=False)  # R from anneal_total_steps, fixed at anneal start

    @classmethod
    def from_params(cls, hp: SAFParams) -> Schedule:
        """The schedule a run with ``hp`` uses; a stage switched off becomes its neutral setting."""
        return cls(
            warmup_steps=hp.warmup_steps if hp.warmup else 0,
            kl_drop_delta=hp.kl_drop_delta,
            anneal=hp.anneal,
            anneal_min=hp.anneal_min,
            anneal_steps=hp.anneal_steps,
            anneal_total_steps=hp.anneal_total_steps,
            anneal_without_warmup=hp.anneal_without_warmup,
        )

    def advance(self) -> tuple[float, float]:
        """Start step s = previous + 1 and return (σ_w(s), a(s)); uses the KL recorded at step s − 1."""
        self.step += 1
        if self.kl_0 is None and self.last_kl is not None:
            self.kl_0 = self.last_kl  # KL_0 = first non-None K, i.e. K_1 read at s = 2
        return self._warmup_scale(), self._anneal_coef()

    def record_kl(self, kl: float | None) -> None:
        """Store this step's K_s (None: no measurement, e.g. an empty batch); the next advance() reads it."""
        self.last_kl = None if kl is None else float(kl)

    @property
    def warmup_in_progress(self) -> bool:
        return self.warmup_steps > 0 and not self.warmup_done

    def kl_drop(self, kl: float | None) -> float:
        """(KL_0 − K)/KL_0, or 0 while KL_0 is unknown or 0."""
        if kl is None or self.kl_0 is None or self.kl_0 <= 0.0:
            return 0.0
        return (self.kl_0 - kl) / self.kl_0

    def _warmup_scale(self) -> float:
        """σ_w(s) = min(s/N, 1) until done (s ≥ N or a relative KL drop ≥ δ), then frozen at σ* forever."""
        if self.warmup_steps <= 0:
            return 1.0
        s, n = self.step, self.warmup_steps
        if not self.warmup_done:
            natural = s >= n
            early = self.kl_drop_delta > 0.0 and self.last_kl is not None and self.kl_drop(self.last_kl) >= self.kl_drop_delta
            if natural or early:
                self.warmup_done, self.early_stopped = True, not natural
                self.frozen_scale, self.warmup_end_step = min(s / n, 1.0), s  # σ* uses the trigger step itself
        return self.frozen_scale if self.warmup_done else min(s / n, 1.0)  # type: ignore[return-value]

    def _anneal_coef(self) -> float:
        """a(s) = 1 during warm-up, then c_min + (1 − c_min)·max(0, 1 − u/R) with u = 0, 1, … from the first post-warm-up step."""
        if not self.anneal or self.warmup_in_progress:
            return 1.0
        if self.warmup_steps <= 0 and not self.anneal_without_warmup:
            return 1.0  # README reading: N = 0 disables Stage 4 too
        if not self.anneal_active:
            self.anneal_active, self.anneal_t = True, 0
            if self.anneal_total_steps > 0:  # R = max(1, S − s_end) "over the remaining steps"
                self.anneal_horizon = max(1, self.anneal_total_steps - (self.warmup_end_step or 0))
        horizon = self.anneal_horizon if self.anneal_horizon is not None else self.anneal_steps
        u = self.anneal_t
        coef = self.anneal_min + (1.0 - self.anneal_min) * max(0.0, 1.0 - u / horizon) if horizon > 0 else self.anneal_min
        self.anneal_t += 1  # the counter advances after each step
        return coef

    def state_dict(self) -> dict:
        return {name: getattr(self, name) for name in _STATE_FIELDS}

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state) - set(_STATE_FIELDS)
        if unknown:
            raise ValueError(f"unknown SAF schedule state keys: {sorted(unknown)}")
        for name in _STATE_FIELDS:
            setattr(self, name, state[name])


def saf_opd_advantage(
    old_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, hp: SAFParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stages 1+2 on a = (T − o)·m: (â, keep). Switched-off stages are identities (keep = m, â = a·keep)."""
    a = opd_advantage(old_logp, teacher_logp, mask)
    keep = sparsify(a, mask, hp.topk_percent) if hp.topk else (mask > 0).to(a.dtype)
    a_hat = compress(a, keep, hp.tanh_coef) if hp.tanh else a * keep
    return a_hat.detach(), keep


def saf_advantages(
    grpo_adv: torch.Tensor,
    opd_adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    warmup_scale: float,
    anneal_coef: float,
    opd_coef: float = 1.0,
    grpo_coef: float = 1.0,
) -> torch.Tensor:
    """Fusion from per-sequence A^grpo (B,) and â (B, L): A_total = g·A^grpo·m + c_opd·a(s)·σ_w(s)·â."""
    return (grpo_coef * grpo_adv.to(opd_adv.dtype)[:, None] * mask + opd_coef * anneal_coef * warmup_scale * opd_adv).detach()


def saf_objective(
    batch: TensorBatch, student: StudentOutputs, hp: SAFParams, state: object = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate on the SAF fused advantage; advances ``state`` (a :class:`Schedule`) by one step."""
    if not isinstance(state, Schedule):
        raise TypeError("saf_opd needs its Schedule state (MethodSpec.make_state); got " + type(state).__name__)
    mask = batch.loss_mask
    old = old_logprobs(batch, student)
    grpo_adv = grpo_sequence_advantages(batch, hp.grpo_coef)  # g·A^grpo_b (g applied; zeros when g = 0); may raise
    warmup_scale, anneal_coef = state.advance()
    opd_adv, keep = saf_opd_advantage(old, batch.teacher_logprobs, mask, hp)
    advantages = saf_advantages(grpo_adv, opd_adv, mask, warmup_scale=warmup_scale, anneal_coef=anneal_coef, opd_coef=hp.opd_coef)
    loss, diagnostics = clipped_surrogate(
        student.logprobs, old, advantages, mask, clip_low=hp.clip_low, clip_high=hp.clip_high, dual_clip=hp.dual_clip
    )
    # K_s: token-mean k3 KL(π_θ ‖ π_T) on the sampled tokens, monitored only (no gradient)
    kl = float(masked_mean(k3(student.logprobs.detach(), batch.teacher_logprobs), mask)) if mask.sum() > 0 else None
    state.record_kl(kl)
    diagnostics.update(
        keep_fraction=float(keep.sum() / mask.sum().clamp(min=1.0)),
        warmup_scale=warmup_scale,
        anneal_coef=anneal_coef,
        kl=kl if kl is not None else 0.0,
        kl_drop=state.kl_drop(kl),
        warmup_done=float(state.warmup_done),
        warmup_early_stopped=float(state.early_stopped),
        opd_advantage_mean=float(masked_mean(opd_advantage(old, batch.teacher_logprobs, mask), mask)),
        advantage_mean=float(masked_mean(advantages, mask)),
        tokens=float(mask.sum()),
    )
    if hp.grpo_coef != 0.0:
        diagnostics["reward_mean"] = graded_reward_mean(batch.rewards)  # over graded samples: errors are not zeros
    return loss, diagnostics


def saf_needs(hp: SAFParams) -> frozenset[str]:
    base = {"teacher_logprobs", "behaviour_logprobs", "old_logprobs"}
    return frozenset(base | {"rewards"} if hp.grpo_coef != 0.0 else base)


SAF_OPD_SPEC = MethodSpec(
    description="SAF-OPD: top-k% sparsified, tanh-compressed OPD advantage with KL-triggered "
    "warm-up and annealing, fused with GRPO under one PPO clip",
    objective=saf_objective,  # type: ignore[arg-type]
    hparams=SAFParams,
    needs=saf_needs,  # type: ignore[arg-type]
    make_state=Schedule.from_params,  # type: ignore[arg-type]
    group_size=8,  # docs/methods/saf-opd.md: GRPO with n = 8 rollouts per prompt
    notes={
        "dual_clip": DUAL_CLIP_NOTE,
        "samples_per_prompt": "default 8 per prompt (the paper's training config); with grpo_coef ≠ 0, 1 needs allow_single_sample",
        "tanh_form": "c·tanh(a) as in the code and README (not c·tanh(a/c)): slope c near 0, saturates at ±c only for |a| ≳ 2",
        "anneal_without_warmup": "code anneals from step 1 when N = 0 (default True); the README says N = 0 disables Stage 4 (False)",
        "anneal_horizon": "R = anneal_steps (200) by default; anneal_total_steps = S > 0 gives "
        "R = max(1, S − warm-up end), the paper's 'remaining steps'",
        "kl_lag": "step s reads K_{s−1}; KL_0 = K_1 (first step's update), not a pre-training measurement; an empty batch records no KL",
        "schedule_steps": "the schedule advances once per objective call: one call per optimizer step is assumed",
    },
)
