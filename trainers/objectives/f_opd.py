"""f-OPD: freshness-aware asynchronous on-policy distillation (docs/methods/f-opd.md, arXiv 2605.17862), and
the asynchronous baselines of its paper (its Table 1's "Async. OPD" rows; docs/methods/f-opd.md, 'The baselines').

All six methods share one per-token distillation loss ``ℓ_t = sg(s_t − T_t)·s_t`` (T = T^fresh when the
batch carries it, else T^stale), averaged per sample over a token set and then over samples. They differ
only in
- the sample weight w_i: f_opd σ(f_i − ξ); opd_lag_only σ((τ_i+1)⁻¹ − ξ); the others 1;
  opd_async is the bare loss (the paper's "Async. OPD": no weight, no anchor, no filtering, no refresh);
- the token sets: f_opd averages ℓ over U^sup and the anchor over U^roll; the others use all valid tokens;
- the anchor coefficient λ of R^anchor = mean k3(s; q): f_opd and opd_kl λ > 0, the others 0;
- per-token truncated importance weights min(e^{s−q}, c_iw) (opd_clipped_iw only);
- the refresh signal: f_opd adaptive ('Adaptive refresh'), opd_hard_refresh every H steps. The signal is only
  reported (``refresh_signal`` diagnostic, counted by :class:`RefreshMonitor`); the async pipeline acts.

Layout: :func:`async_stats` (detached batch statistics) → a method's ``*_terms`` (detached
:class:`LossTerms`) → :func:`async_opd_loss`, the only differentiable step. With the terms fixed the loss
is an ordinary function of the student log-probs, which is what the gradcheck tests use.

The formulas, the reconstructed choices and the options that select the alternatives are written out in
docs/methods/f-opd.md, 'The reconstructed formulas'; a quoted section name below is a section of that page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias

from pydantic import Field

from opd_harness.lazy import lazy_import
from opd_harness.method import HParams, MethodSpec, StudentOutputs
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.objectives.common import k3
from opd_harness.trainers.objectives.opd import exact_reverse_kl

if TYPE_CHECKING:
    import torch
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")

FreshnessForm = Literal["exp", "reciprocal", "product"]
RefreshRule = Literal["freshness", "freshness_or_coverage", "periodic"]
Xi = float | Literal["batch_mean"]
Result: TypeAlias = "tuple[torch.Tensor, dict[str, float]]"  # (loss, diagnostics); a string: torch is imported on first use

LOG_RATIO_CLAMP = 20.0  # |s − q| bound inside exponentials (verl's k3 uses the same ±20)


# ----------------------------------------------------------------------------------------------
# Masked reductions


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where mask is set, 0 elsewhere (``where``, not multiply, so inf/NaN never leak)."""
    return torch.where(mask > 0, values, torch.zeros_like(values))


def sample_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sample masked mean Σ_t m·v / max(Σ_t m, 1), shape (B,); 0 for an empty row."""
    return _masked(values, mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def coverage(subset: torch.Tensor, mask: torch.Tensor) -> float:
    """M̄ = mean_i |U_i| / n_i over samples with n_i > 0 valid tokens; 1.0 when there are none."""
    n = mask.sum(-1)
    has_tokens = n > 0
    if not bool(has_tokens.any()):
        return 1.0
    return float(((subset * mask).sum(-1)[has_tokens] / n[has_tokens]).mean())


# ----------------------------------------------------------------------------------------------
# Drift diagnostics, token sets, freshness ('Drift diagnostics', 'Token sets and the anchor', 'Freshness score')


def rollout_drift(student_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """D_roll_i ≈ KL(π^t ‖ π^{r(i)}) per sample (B,), estimated on the behaviour's own samples; detached."""
    lam = torch.clamp(student_logp.detach() - behaviour_logp.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # δ^roll_t = e^λ·λ − e^λ + 1 with λ = s − q: ≥ 0 and unbiased for KL(cur‖beh) under behaviour samples
    delta = torch.exp(lam) * lam - torch.exp(lam) + 1.0
    return sample_mean(delta, mask)


def supervision_drift(teacher_stale: torch.Tensor, teacher_fresh: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """D_sup_i ≈ KL(π_T(·|c^t) ‖ π_T(·|c^{r(i)})) per sample (B,) by k3; zeros when T^fresh is absent."""
    if teacher_fresh is None:
        return torch.zeros(mask.shape[0], dtype=teacher_stale.dtype, device=teacher_stale.device)
    # μ_t = T^stale_t − T^fresh_t, δ^sup_t = e^μ − μ − 1 (verl low_var_kl, with its clamps)
    delta = k3(teacher_fresh.detach(), teacher_stale.detach())
    return sample_mean(delta, mask)


def trusted_tokens(logp: torch.Tensor | None, reference: torch.Tensor, mask: torch.Tensor, kappa: float = 0.5) -> torch.Tensor:
    """U = {t : m_t = 1, |logp_t − reference_t| ≤ κ} as a float mask; all valid tokens when ``logp`` is None.

    U^roll: ``trusted_tokens(s, q, m, κ_roll)``; U^sup: ``trusted_tokens(T^fresh, T^stale, m, κ_sup)``.
    """
    valid = mask > 0
    if logp is None:
        return valid.to(mask.dtype)
    close = (logp.detach() - reference.detach()).abs() <= kappa
    return (close & valid).to(mask.dtype)


def freshness(
    lag: torch.Tensor,
    d_roll: torch.Tensor,
    d_sup: torch.Tensor,
    alpha: float = 1.0,
    beta: float = 0.5,
    *,
    form: FreshnessForm = "exp",
) -> torch.Tensor:
    """Sample freshness f_i in (0, 1] (1 = perfectly fresh), reconstructed Eq. 11; ``form`` picks the variant ('Freshness score')."""
    d_roll = torch.as_tensor(d_roll).detach()
    d_sup = torch.as_tensor(d_sup, dtype=d_roll.dtype).detach()
    tau = torch.as_tensor(lag).to(d_roll.dtype)
    if bool((tau < 0).any()):
        raise ValueError("policy lag must be ≥ 0 (learner version − behaviour version)")
    drift = alpha * d_roll + beta * d_sup
    if form == "exp":
        return torch.exp(-drift) / (tau + 1.0)  # f = exp(−(α·D_roll + β·D_sup)) / (τ + 1)
    if form == "reciprocal":
        return 1.0 / (1.0 + tau + drift)  # f = 1 / (1 + τ + α·D_roll + β·D_sup)
    if form == "product":
        return 1.0 / ((tau + 1.0) * (1.0 + drift))  # f = 1 / ((τ + 1)(1 + α·D_roll + β·D_sup))
    raise ValueError(f"unknown freshness form {form!r}; valid: exp, reciprocal, product")


def lag_only_freshness(lag: torch.Tensor) -> torch.Tensor:
    """Lag-only baseline score f_i = (τ_i + 1)⁻¹ (paper App. B.1); equals :func:`freshness` with α = β = 0."""
    tau = torch.as_tensor(lag)
    tau = tau if tau.is_floating_point() else tau.to(torch.get_default_dtype())
    return freshness(tau, torch.zeros_like(tau), torch.zeros_like(tau), 0.0, 0.0)


def freshness_weights(f: torch.Tensor, xi: Xi = 0.5) -> torch.Tensor:
    """w_i = σ(f_i − ξ), detached; ξ a constant or ``"batch_mean"`` (ξ = f̄ of this batch)."""
    f = f.detach()
    centre = f.mean() if xi == "batch_mean" else float(xi)
    return torch.sigmoid(f - centre)


def renormalised(weights: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """w_i / mean_{i∈C} w_i so the selected weights average 1 (the effective learning rate is kept)."""
    if not bool(selected.any()):
        return weights
    return weights / weights[selected].mean()


# ----------------------------------------------------------------------------------------------
# Adaptive / periodic refresh ('Adaptive refresh', 'The baselines')


def refresh_due(
    f_mean: float,
    m_roll: float = 1.0,
    m_sup: float = 1.0,
    *,
    rule: Literal["freshness", "freshness_or_coverage"] = "freshness",
    kappa_f: float = 0.10,
    kappa_cov: float = 0.5,
) -> bool:
    """Adaptive refresh decision: f̄ < κ_f; with rule ``freshness_or_coverage`` also M̄^roll or M̄^sup < κ_cov."""
    if rule == "freshness":
        return f_mean < kappa_f
    if rule == "freshness_or_coverage":
        return f_mean < kappa_f or m_roll < kappa_cov or m_sup < kappa_cov
    raise ValueError(f"unknown refresh rule {rule!r}; valid: freshness, freshness_or_coverage")


@dataclass
class RefreshMonitor:
    """Per-run refresh signal: adaptive ('Adaptive refresh') or every ``every`` steps (``rule="periodic"``); counts refreshes.

    It only signals; flushing/re-scoring the buffer and pushing weights is the async pipeline's job.
    """

    rule: RefreshRule = "freshness"
    kappa_f: float = 0.10
    kappa_cov: float = 0.5
    every: int = 10
    steps: int = 0
    refreshes: int = 0
    last_refresh_step: int = 0

    def observe(self, f_mean: float = 1.0, m_roll: float = 1.0, m_sup: float = 1.0) -> bool:
        """Advance one learner step and say whether a refresh is due after it."""
        self.steps += 1
        if self.rule == "periodic":
            due = self.steps % self.every == 0
        else:
            due = refresh_due(f_mean, m_roll, m_sup, rule=self.rule, kappa_f=self.kappa_f, kappa_cov=self.kappa_cov)
        if due:
            self.refreshes += 1
            self.last_refresh_step = self.steps
        return due

    def state_dict(self) -> dict:
        return {"rule": self.rule, "steps": self.steps, "refreshes": self.refreshes, "last_refresh_step": self.last_refresh_step}

    def load_state_dict(self, state: dict) -> None:
        if state.get("rule", self.rule) != self.rule:
            raise ValueError(f"checkpoint refresh rule {state['rule']!r} differs from this run's {self.rule!r}")
        self.steps = int(state["steps"])
        self.refreshes = int(state["refreshes"])
        self.last_refresh_step = int(state["last_refresh_step"])


def _refresh_signal(state: object, f_mean: float, m_roll: float, m_sup: float, *, stateless: bool) -> tuple[bool, int]:
    """(signal, refresh events so far) from the run's monitor; without one, the stateless decision (or none)."""
    if isinstance(state, RefreshMonitor):
        return state.observe(f_mean, m_roll, m_sup), state.refreshes
    return stateless, int(stateless)


# ----------------------------------------------------------------------------------------------
# Detached batch statistics and per-method loss terms


@dataclass(frozen=True)
class AsyncStats:
    """Detached per-batch quantities every async method reads ('Drift diagnostics'); zero off valid tokens."""

    mask: torch.Tensor  # (B, T) m: valid (model) tokens
    current: torch.Tensor  # (B, T) sg(s): current student
    behaviour: torch.Tensor  # (B, T) q: behaviour student, version r(i)
    teacher_stale: torch.Tensor  # (B, T) T^stale, scored at rollout time
    teacher_fresh: torch.Tensor | None  # (B, T) T^fresh, scored at learner time; None ⇒ D_sup skipped
    lag: torch.Tensor  # (B,) τ_i = t − r(i)
    d_roll: torch.Tensor  # (B,)
    d_sup: torch.Tensor  # (B,)

    @property
    def teacher(self) -> torch.Tensor:
        """Supervision target of the distillation loss: T^fresh if re-scored, else T^stale."""
        return self.teacher_fresh if self.teacher_fresh is not None else self.teacher_stale


def policy_lag(batch: TensorBatch, dtype: torch.dtype | None = None) -> torch.Tensor:
    """τ_i per sample (B,) in ``dtype`` (default float32); 0 when the batch carries none (sync). Negative lags are an error."""
    device, dtype = batch.loss_mask.device, dtype or torch.float32
    if batch.policy_lag is None:
        return torch.zeros(batch.shape[0], dtype=dtype, device=device)
    lag = batch.policy_lag.to(device=device, dtype=dtype)
    if bool((lag < 0).any()):
        raise ValueError("policy lag must be ≥ 0 (learner version − behaviour version)")
    return lag


def async_stats(batch: TensorBatch, current: torch.Tensor) -> AsyncStats:
    """Drift statistics of ``batch`` against the current student log-probs ``current`` (detached)."""
    mask = batch.loss_mask.to(current.dtype)
    current = _masked(current.detach(), mask)
    behaviour = _masked(batch.behaviour_logprobs.detach().to(current.dtype), mask)
    stale = _masked(batch.teacher_logprobs.detach().to(current.dtype), mask)
    fresh = batch.teacher_fresh_logprobs
    fresh = None if fresh is None else _masked(fresh.detach().to(current.dtype), mask)
    return AsyncStats(
        mask=mask,
        current=current,
        behaviour=behaviour,
        teacher_stale=stale,
        teacher_fresh=fresh,
        lag=policy_lag(batch, current.dtype),
        d_roll=rollout_drift(current, behaviour, mask),
        d_sup=supervision_drift(stale, fresh, mask),
    )


@dataclass(frozen=True)
class LossTerms:
    """Everything detached an async-OPD loss needs besides the student log-probs s."""

    log_ratio: torch.Tensor  # (B, T) sg(s_t − T_t): coefficient of s_t in ℓ_t
    behaviour: torch.Tensor  # (B, T) q_t: anchor target
    sup_mask: torch.Tensor  # (B, T) tokens averaged in l_i (U^sup, or all valid tokens)
    roll_mask: torch.Tensor  # (B, T) tokens averaged in R^anchor (U^roll, or all valid tokens)
    weights: torch.Tensor  # (B,) sample weights w_i
    token_weights: torch.Tensor  # (B, T) per-token multipliers (truncated IS), ones otherwise
    anchor_coef: float = 0.0  # λ

    @property
    def selected(self) -> torch.Tensor:
        """C(B^t): samples with a non-empty U^sup (their l_i is defined)."""
        return self.sup_mask.sum(-1) > 0


def plain_terms(stats: AsyncStats, *, anchor_coef: float = 0.0, weights: torch.Tensor | None = None) -> LossTerms:
    """Async-OPD terms with no token filtering: both token sets are all valid tokens, weights 1 unless given."""
    return LossTerms(
        log_ratio=_masked(stats.current - stats.teacher, stats.mask),
        behaviour=stats.behaviour,
        sup_mask=stats.mask,
        roll_mask=stats.mask,
        weights=torch.ones_like(stats.lag) if weights is None else weights.detach(),
        token_weights=torch.ones_like(stats.mask),
        anchor_coef=anchor_coef,
    )


def per_sample_terms(
    student_logp: torch.Tensor, terms: LossTerms, token_kl: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(l_i, R_i^anchor) per sample, with gradient w.r.t. the student log-probs.

    ``token_kl`` (estimator ``full``): the exact per-position reverse KL replaces the sampled-token ℓ_t.
    """
    token_loss = terms.log_ratio * student_logp if token_kl is None else token_kl  # ℓ_t = sg(s_t − T_t)·s_t
    per_token = terms.token_weights * token_loss  # (× truncated IS weight)
    distill = sample_mean(per_token, terms.sup_mask)  # l_i = Σ_{U^sup} ℓ_t / max(|U^sup|, 1)
    anchor = sample_mean(k3(student_logp, terms.behaviour), terms.roll_mask)  # R_i = mean_{U^roll} k3(s; q)
    return distill, anchor


def combine(distill: torch.Tensor, anchor: torch.Tensor, terms: LossTerms) -> torch.Tensor:
    """J = mean_{i∈C} w_i·(l_i + λ·R_i); 0 (with a graph) when C is empty."""
    selected = terms.selected
    per_sample = terms.weights * (distill + terms.anchor_coef * anchor)
    return _masked(per_sample, selected).sum() / selected.sum().clamp(min=1).to(per_sample.dtype)


def async_opd_loss(student_logp: torch.Tensor, terms: LossTerms, token_kl: torch.Tensor | None = None) -> torch.Tensor:
    """The shared differentiable loss of every method here ('Token sets and the anchor', 'The objective'); terms are held fixed."""
    distill, anchor = per_sample_terms(student_logp, terms, token_kl)
    return combine(distill, anchor, terms)


# ----------------------------------------------------------------------------------------------
# Hyper-parameters


class AsyncOPDParams(HParams):
    """Shared by the six async methods (opd_async has no others): which per-token distillation loss they weight and filter."""

    estimator: Literal["sampled", "full"] = Field(
        "sampled",
        description="sampled: ℓ_t = sg(s_t − T_t)·s_t (the paper's); full: exact full-vocabulary reverse KL at each position "
        "against the rollout-time teacher distribution (lower variance at small batches; stale samples only shift the states)",
    )
    rescore_teacher: bool = Field(
        False,
        description="re-score the teacher's log-probs of the sampled tokens at update time on the batch's context as it is then "
        "(T^fresh): D_sup and U^sup are measured instead of 0 / all tokens and the sampled loss targets T^fresh "
        "(one more teacher forward per step; in-process executor)",
    )


class FOPDParams(AsyncOPDParams):
    alpha: float = Field(1.0, ge=0, description="α: weight of rollout drift D_roll in the freshness score")
    beta: float = Field(0.5, ge=0, description="β: weight of supervision drift D_sup in the freshness score")
    freshness_form: FreshnessForm = Field("exp", description="Eq. 11 form: exp (reconstructed default), reciprocal, product")
    xi: Xi = Field(0.5, description="ξ in σ(f − ξ): a constant, or 'batch_mean' (ξ = f̄ of the batch)")
    anchor_coef: float = Field(0.1, ge=0, description="λ: weight of the rollout-anchored regulariser")
    kappa_roll: float = Field(0.5, gt=0, description="κ_roll: token bound |s − q| ≤ κ for U^roll")
    kappa_sup: float = Field(0.5, gt=0, description="κ_sup: token bound |T^fresh − T^stale| ≤ κ for U^sup")
    renormalise: bool = Field(False, description="rescale the selected samples' weights to mean 1")
    kappa_f: float = Field(0.10, ge=0, description="κ_f: refresh when the batch-mean freshness f̄ falls below it")
    refresh_rule: Literal["freshness", "freshness_or_coverage"] = Field(
        "freshness", description="which reading triggers refresh: f̄ < κ_f only, or also M̄^roll/M̄^sup < kappa_cov "
        "(f-opd page, 'Adaptive refresh')"
    )
    kappa_cov: float = Field(
        0.5, ge=0, le=1, description="κ_d read as a refresh threshold on M̄^roll / M̄^sup (rule freshness_or_coverage)"
    )


class OPDKLParams(AsyncOPDParams):
    anchor_coef: float = Field(0.1, ge=0, description="λ: weight of the KL-to-behaviour anchor on all valid tokens")


class ClippedIWParams(AsyncOPDParams):
    c_iw: float = Field(2.0, gt=0, description="c_iw: cap of the per-token importance weight exp(s − q)")


class LagOnlyParams(AsyncOPDParams):
    xi: Xi = Field(0.5, description="ξ in σ((τ+1)⁻¹ − ξ): a constant, or 'batch_mean'")
    renormalise: bool = Field(False, description="rescale the selected samples' weights to mean 1")


class HardRefreshParams(AsyncOPDParams):
    refresh_every: int = Field(10, ge=1, description="H: signal a full refresh every H learner steps")


# ----------------------------------------------------------------------------------------------
# Per-method terms


def f_opd_terms(stats: AsyncStats, hp: FOPDParams) -> tuple[LossTerms, torch.Tensor]:
    """f-OPD terms (σ(f−ξ) weights, U^sup/U^roll filtering, λ anchor) and the freshness scores f."""
    u_roll = trusted_tokens(stats.current, stats.behaviour, stats.mask, hp.kappa_roll)
    u_sup = trusted_tokens(stats.teacher_fresh, stats.teacher_stale, stats.mask, hp.kappa_sup)
    f = freshness(stats.lag, stats.d_roll, stats.d_sup, hp.alpha, hp.beta, form=hp.freshness_form)
    weights = freshness_weights(f, hp.xi)
    selected = u_sup.sum(-1) > 0
    base = plain_terms(stats, anchor_coef=hp.anchor_coef)
    terms = LossTerms(
        log_ratio=base.log_ratio,
        behaviour=base.behaviour,
        sup_mask=u_sup,
        roll_mask=u_roll,
        weights=renormalised(weights, selected) if hp.renormalise else weights,
        token_weights=base.token_weights,
        anchor_coef=hp.anchor_coef,
    )
    return terms, f


def opd_kl_terms(stats: AsyncStats, hp: OPDKLParams) -> LossTerms:
    """Async OPD + KL: the f-OPD anchor on all valid tokens, no freshness weight, no filtering."""
    return plain_terms(stats, anchor_coef=hp.anchor_coef)


def clipped_iw_weights(stats: AsyncStats, c_iw: float) -> torch.Tensor:
    """min(exp(s_t − q_t), c_iw) on valid tokens (truncated IS towards the behaviour policy), detached."""
    lam = torch.clamp(stats.current - stats.behaviour, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _masked(torch.clamp(torch.exp(lam), max=c_iw), stats.mask)


def opd_clipped_iw_terms(stats: AsyncStats, hp: ClippedIWParams) -> LossTerms:
    """Async OPD + clipped IW: each token's loss × min(exp(s − q), c_iw)."""
    base = plain_terms(stats)
    return LossTerms(
        log_ratio=base.log_ratio,
        behaviour=base.behaviour,
        sup_mask=base.sup_mask,
        roll_mask=base.roll_mask,
        weights=base.weights,
        token_weights=clipped_iw_weights(stats, hp.c_iw),
    )


def opd_lag_only_terms(stats: AsyncStats, hp: LagOnlyParams) -> tuple[LossTerms, torch.Tensor]:
    """Lag-only weighting: w_i = σ((τ_i+1)⁻¹ − ξ), no filtering, no anchor; also returns f."""
    f = lag_only_freshness(stats.lag)
    weights = freshness_weights(f, hp.xi)
    selected = stats.mask.sum(-1) > 0
    return plain_terms(stats, weights=renormalised(weights, selected) if hp.renormalise else weights), f


# ----------------------------------------------------------------------------------------------
# Objectives


def token_reverse_kl(batch: TensorBatch, student: StudentOutputs, hp: AsyncOPDParams) -> torch.Tensor | None:
    """Exact per-position KL(π_θ ‖ π_T) for estimator ``full`` (teacher distribution from rollout time); None for ``sampled``."""
    return exact_reverse_kl(batch, student) if hp.estimator == "full" else None


def _loss_and_diagnostics(student_logp: torch.Tensor, stats: AsyncStats, terms: LossTerms, token_kl: torch.Tensor | None = None) -> Result:
    """The shared loss plus the diagnostics every method logs."""
    distill, anchor = per_sample_terms(student_logp, terms, token_kl)
    loss = combine(distill, anchor, terms)
    selected = terms.selected
    n_sel = max(int(selected.sum()), 1)
    kl = _masked(stats.behaviour - stats.teacher, stats.mask).sum() / stats.mask.sum().clamp(min=1.0)
    diagnostics = {
        "teacher_kl": float(kl),  # Σ(q − T)/Σm, the sampled reverse-KL estimate opd logs
        "tokens": float(stats.mask.sum()),
        "lag_mean": float(stats.lag.mean()),
        "lag_max": float(stats.lag.max()),
        "d_roll_mean": float(stats.d_roll.mean()),
        "d_sup_mean": float(stats.d_sup.mean()),
        "distill": float(_masked(distill.detach(), selected).sum()) / n_sel,
        "anchor": float(_masked(anchor.detach(), selected).sum()) / n_sel,
        "weight_mean": float(terms.weights.mean()),
        "trusted_roll_frac": coverage(terms.roll_mask, stats.mask),
        "trusted_sup_frac": coverage(terms.sup_mask, stats.mask),
        "excluded_samples": float((~selected).sum()),
        "refresh_signal": 0.0,
        "refresh_events": 0.0,
    }
    return loss, diagnostics


def f_opd_objective(batch: TensorBatch, student: StudentOutputs, hp: FOPDParams, state: object = None) -> Result:
    """f-OPD: J = mean_{i∈C} σ(f_i − ξ)(l_i + λR_i), plus the adaptive refresh signal ('The objective', 'Adaptive refresh')."""
    stats = async_stats(batch, student.logprobs.detach())
    terms, f = f_opd_terms(stats, hp)
    loss, diagnostics = _loss_and_diagnostics(student.logprobs, stats, terms, token_reverse_kl(batch, student, hp))
    f_mean = float(f.mean())
    m_roll, m_sup = diagnostics["trusted_roll_frac"], diagnostics["trusted_sup_frac"]
    stateless = refresh_due(f_mean, m_roll, m_sup, rule=hp.refresh_rule, kappa_f=hp.kappa_f, kappa_cov=hp.kappa_cov)
    signal, events = _refresh_signal(state, f_mean, m_roll, m_sup, stateless=stateless)
    diagnostics.update(
        freshness_mean=f_mean,
        weight_mean=float(freshness_weights(f, hp.xi).mean()),  # σ(f − ξ) before any renormalisation
        refresh_signal=float(signal),
        refresh_events=float(events),
    )
    return loss, diagnostics


def opd_async_objective(batch: TensorBatch, student: StudentOutputs, hp: AsyncOPDParams, state: object = None) -> Result:
    """Async OPD (the paper's Table 1 baseline): mean_i l_i over all valid tokens; no freshness weight, no anchor, no filtering."""
    stats = async_stats(batch, student.logprobs.detach())
    return _loss_and_diagnostics(student.logprobs, stats, plain_terms(stats), token_reverse_kl(batch, student, hp))


def opd_kl_objective(batch: TensorBatch, student: StudentOutputs, hp: OPDKLParams, state: object = None) -> Result:
    """Async OPD + KL: mean_i (l_i + λR_i) over all valid tokens, unweighted."""
    stats = async_stats(batch, student.logprobs.detach())
    return _loss_and_diagnostics(student.logprobs, stats, opd_kl_terms(stats, hp), token_reverse_kl(batch, student, hp))


def opd_clipped_iw_objective(batch: TensorBatch, student: StudentOutputs, hp: ClippedIWParams, state: object = None) -> Result:
    """Async OPD + clipped IW: per-token loss × min(exp(s − q), c_iw), no anchor, no weights."""
    stats = async_stats(batch, student.logprobs.detach())
    terms = opd_clipped_iw_terms(stats, hp)
    loss, diagnostics = _loss_and_diagnostics(student.logprobs, stats, terms, token_reverse_kl(batch, student, hp))
    iw = terms.token_weights
    diagnostics["iw_mean"] = float(_masked(iw, stats.mask).sum() / stats.mask.sum().clamp(min=1.0))
    diagnostics["iw_clip_fraction"] = float(_masked((iw >= hp.c_iw).to(iw.dtype), stats.mask).sum() / stats.mask.sum().clamp(min=1.0))
    return loss, diagnostics


def opd_lag_only_objective(batch: TensorBatch, student: StudentOutputs, hp: LagOnlyParams, state: object = None) -> Result:
    """Lag-only weighting: mean_i σ((τ_i+1)⁻¹ − ξ)·l_i over all valid tokens."""
    stats = async_stats(batch, student.logprobs.detach())
    terms, f = opd_lag_only_terms(stats, hp)
    loss, diagnostics = _loss_and_diagnostics(student.logprobs, stats, terms, token_reverse_kl(batch, student, hp))
    diagnostics.update(freshness_mean=float(f.mean()), weight_mean=float(freshness_weights(f, hp.xi).mean()))
    return loss, diagnostics


def opd_hard_refresh_objective(batch: TensorBatch, student: StudentOutputs, hp: HardRefreshParams, state: object = None) -> Result:
    """Plain async OPD loss; the run's RefreshMonitor signals a full refresh every H steps."""
    stats = async_stats(batch, student.logprobs.detach())
    loss, diagnostics = _loss_and_diagnostics(student.logprobs, stats, plain_terms(stats), token_reverse_kl(batch, student, hp))
    signal, events = _refresh_signal(state, 1.0, 1.0, 1.0, stateless=False)  # no monitor ⇒ no step count ⇒ no signal
    diagnostics.update(refresh_signal=float(signal), refresh_events=float(events))
    return loss, diagnostics


# ----------------------------------------------------------------------------------------------
# Registration


ASYNC_NEEDS = frozenset({"teacher_logprobs", "behaviour_logprobs", "policy_lag"})
MODES = ("sync", "async")  # sync is allowed (lag ≡ 0, the pipeline warns)
SHARED_NOTES = {
    "per_token_loss": "ℓ_t = sg(s_t − T_t)·s_t with T = T^fresh if re-scored else T^stale "
    "(reconstructed; docs/methods/f-opd.md, 'Token sets and the anchor')",
    "aggregation": "per-sample mean over the token set, then mean over samples with a non-empty set "
    "(docs/methods/f-opd.md, 'The objective')",
}


def _needs(hp: HParams) -> frozenset[str]:
    full = getattr(hp, "estimator", "sampled") == "full"
    needs = ASYNC_NEEDS | {"teacher_dist", "student_full"} if full else ASYNC_NEEDS
    return needs | {"teacher_fresh_logprobs"} if getattr(hp, "rescore_teacher", False) else needs


def _spec(description: str, objective, hparams: type[HParams], make_state=None, notes: dict[str, str] | None = None) -> MethodSpec:
    return MethodSpec(
        description=description,
        objective=objective,
        hparams=hparams,
        needs=_needs,
        modes=MODES,
        default_mode="async",  # the freshness weights and lag baselines read the policy lag, which is 0 in sync mode
        make_state=make_state,
        notes={**SHARED_NOTES, **(notes or {})},
        teacher_kinds=lambda hp: ("full", "topk", "student_topk"),  # estimator full: the reverse KL of opd's, top-k buckets too
    )


F_OPD_SPEC = _spec(
    "f-OPD: freshness-weighted async OPD with trusted-token filtering, a rollout-anchored KL and an adaptive refresh signal",
    f_opd_objective,
    FOPDParams,
    make_state=lambda hp: RefreshMonitor(rule=hp.refresh_rule, kappa_f=hp.kappa_f, kappa_cov=hp.kappa_cov),
    notes={
        "freshness_form": "exp (reconstructed Eq. 11); reciprocal and product selectable",
        "rollout_drift": "e^λλ − e^λ + 1, λ = s − q, per-sample token mean "
        "(reconstructed; docs/methods/f-opd.md, 'Drift diagnostics')",
        "supervision_drift": "k3 of T^stale vs T^fresh, per-sample token mean; 0 when T^fresh is absent "
        "(reconstructed; docs/methods/f-opd.md, 'Drift diagnostics')",
        "token_sets": "|log-ratio| ≤ κ per token; U^sup = all valid tokens when T^fresh is absent "
        "(reconstructed; docs/methods/f-opd.md, 'Token sets and the anchor')",
        "anchor": "k3(s; q) with gradient, mean over U^roll (reconstructed; docs/methods/f-opd.md, 'Token sets and the anchor')",
        "xi": "0.5 constant (reconstructed; paper: fixed across tasks); 'batch_mean' selectable",
        "anchor_coef": "λ = 0.1 (reconstructed)",
        "refresh": "signal only; rule 'freshness' (f̄ < κ_f) by default, 'freshness_or_coverage' selectable "
        "(reconstructed; docs/methods/f-opd.md, 'Adaptive refresh')",
        "selection": "C(B^t) excludes samples with an empty U^sup (reconstructed)",
    },
)
OPD_ASYNC_SPEC = _spec(
    "Async OPD (the f-OPD paper's baseline): the shared async OPD loss with no freshness weight, no anchor, no token filtering",
    opd_async_objective,
    AsyncOPDParams,
    notes={"baseline": "the paper's 'Async. OPD' (Table 1): f-OPD's per-token loss and aggregation with w_i = 1, λ = 0, all valid tokens"},
)
OPD_KL_SPEC = _spec(
    "Async OPD + KL: the shared async OPD loss plus λ·KL(current‖behaviour) (k3) on all valid tokens; anchor_coef=0 equals opd_async",
    opd_kl_objective,
    OPDKLParams,
    notes={"baseline": "the paper's 'Async. OPD + KL' (Table 1), reconstructed: f-OPD anchor on all valid tokens, "
        "no freshness weight, no filtering"
    },
)
OPD_CLIPPED_IW_SPEC = _spec(
    "Async OPD + clipped IW: each token's loss times min(exp(s − q), c_iw), detached",
    opd_clipped_iw_objective,
    ClippedIWParams,
    notes={"baseline": "the paper's 'Async. OPD + clipped IW' (Table 1), reconstructed: truncated IS towards the behaviour policy, "
        "c_iw = 2 by default"
    },
)
OPD_LAG_ONLY_SPEC = _spec(
    "Async OPD + lag-only weighting: sample weight σ((τ+1)⁻¹ − ξ)",
    opd_lag_only_objective,
    LagOnlyParams,
    notes={"baseline": "paper App. B.1: f = (τ+1)⁻¹, w = σ(f − ξ); no filtering, no anchor"},
)
OPD_HARD_REFRESH_SPEC = _spec(
    "Async OPD + hard refresh: plain async OPD loss and a full-refresh signal every H steps",
    opd_hard_refresh_objective,
    HardRefreshParams,
    make_state=lambda hp: RefreshMonitor(rule="periodic", every=hp.refresh_every),
    notes={"baseline": "the paper's 'Async. OPD + hard refresh' (Table 1), reconstructed: periodic full synchronisation "
        "every H steps regardless of statistics"
    },
)

