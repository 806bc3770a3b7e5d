"""SOD — Step-wise On-policy Distillation (docs/methods/sod.md, verified from the official verl fork).

A *step* is a maximal contiguous run of model tokens (one assistant turn between tool outputs). Each
step k gets a detached reliability weight from its mean absolute student–teacher log-prob gap d_k:

    w_1 = 1,   w_k = min((d_1 + ε) / (d_k + ε), 1 + δ)          (telescoped running product)

and the OPD advantage of its tokens is scaled by it before fusing with GRPO:

    A_total = g·A^grpo·m + c_opd·w_{k(t)}·(T − o)·m

followed by the shared PPO-clip surrogate (one ratio, one clip on the fused advantage), token-mean.
Steps, divergences, the weight rules and the edge cases: docs/methods/sod.md, 'Steps and weights'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from opd_harness.lazy import lazy_import
from opd_harness.method import MethodSpec, StudentOutputs
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.objectives import masked_mean
from opd_harness.trainers.objectives.common import clipped_surrogate, graded_reward_mean, old_logprobs, opd_advantage
from opd_harness.trainers.objectives.grpo import DUAL_CLIP_NOTE, ClipParams, GroupParams, grpo_sequence_advantages

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")
    F = lazy_import("torch.nn.functional")

WeightRule = Literal["telescoped", "recursive"]
StepSource = Literal["mask_runs", "step_index"]
Weights = Literal["adaptive", "uniform"]


class SODParams(ClipParams, GroupParams):
    eps: float = Field(1e-6, gt=0, description="ε in w_k = min((d_1+ε)/(d_k+ε), 1+δ)")
    delta: float = Field(0.2, ge=0, description="δ: weight cap 1+δ (0.2 = official run script; the config dataclass default is 0.5)")
    c_opd: float = Field(1.0, description="c_opd: weight of the step-weighted OPD advantage")
    grpo_coef: float = Field(1.0, description="g: weight of the GRPO advantage (0 = pure step-wise OPD, no rewards needed)")
    weight_rule: WeightRule = Field(
        "telescoped", description="telescoped = official code (clip the output); recursive = clip the carried product"
    )
    steps: StepSource = Field(
        "mask_runs", description="mask_runs = official code; step_index also splits turns by step id (sod page, 'Steps and weights')"
    )
    weights: Weights = Field(
        "adaptive", description="adaptive = SOD's step weights; uniform = w_k = 1 for every step: L_GRPO + L_OPD with the sampled-token "
        "term, the paper's OPD baseline (App. B.3) and ablation 1.1",
    )


def step_ids(mask: torch.Tensor, step_index: torch.Tensor | None = None) -> torch.Tensor:
    """1-based step number of every token, 0 on masked positions; a step starts where a run of m = 1 starts."""
    valid = mask > 0
    previous = F.pad(valid[:, :-1], (1, 0), value=False)
    starts = valid & ~previous  # first token of each maximal run of m = 1
    if step_index is not None:  # optional: also split where the recorded step index changes
        previous_step = F.pad(step_index[:, :-1], (1, 0), value=-1)
        starts = starts | (valid & (step_index != previous_step))
    return torch.cumsum(starts.long(), dim=1) * valid.long()


def step_spans(mask: torch.Tensor, step_index: torch.Tensor | None = None) -> list[list[tuple[int, int]]]:
    """Half-open [start, end) token spans S_k of the steps of every sequence."""
    spans: list[list[tuple[int, int]]] = []
    for row in step_ids(mask, step_index).tolist():
        row_spans: list[list[int]] = []
        for t, k in enumerate(row):
            if k == 0:
                continue
            if len(row_spans) < k:
                row_spans.append([t, t + 1])
            else:
                row_spans[-1][1] = t + 1
        spans.append([(start, end) for start, end in row_spans])
    return spans


def step_divergences(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, step_index: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, present, ids): d_k = mean_{t∈S_k} |o_t − T_t| as (B, K_max), which steps exist, and step ids (B, L)."""
    ids = step_ids(mask, step_index)
    num_steps = int(ids.max()) if ids.numel() else 0
    valid = mask > 0
    gap = torch.where(valid, (student_logp - teacher_logp).abs(), torch.zeros_like(student_logp)).detach()
    sums = torch.zeros(ids.shape[0], num_steps + 1, dtype=gap.dtype).scatter_add_(1, ids, gap)
    counts = torch.zeros_like(sums).scatter_add_(1, ids, valid.to(gap.dtype))
    d = sums[:, 1:] / counts[:, 1:].clamp(min=1.0)  # column 0 collects the masked positions; dropped
    return d, counts[:, 1:] > 0, ids


def weights_from_divergences(
    d: torch.Tensor, present: torch.Tensor, eps: float = 1e-6, delta: float = 0.2, rule: WeightRule = "telescoped"
) -> torch.Tensor:
    """Per-step weights (B, K): w_1 = 1, w_k = min((d_1+ε)/(d_k+ε), 1+δ); 0 for steps that do not exist."""
    if d.shape[1] == 0:
        return d.clone()
    ratio = (d[:, :1] + eps) / (d + eps)  # P_k = Π_{u<k} (d_u+ε)/(d_{u+1}+ε) telescopes to (d_1+ε)/(d_k+ε)
    if rule == "telescoped":
        w = torch.clamp(ratio, max=1.0 + delta)  # official code: clip the output, carry the unclipped product
    else:
        columns = [torch.ones_like(d[:, 0])]
        for k in range(1, d.shape[1]):  # w_k = min(w_{k−1}·(d_{k−1}+ε)/(d_k+ε), 1+δ): clip the carried product
            columns.append(torch.clamp(columns[-1] * (d[:, k - 1] + eps) / (d[:, k] + eps), max=1.0 + delta))
        w = torch.stack(columns, dim=1)
    w[:, 0] = 1.0  # w_1 = 1 by definition (and avoids 0/0 if ε were 0)
    return (w * present).detach()


def tokens_from_steps(per_step: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Spread per-step values (B, K) to tokens (B, L) by step id; masked positions (id 0) get 0."""
    table = torch.cat([per_step.new_zeros(per_step.shape[0], 1), per_step], dim=1)
    return table.gather(1, ids)


def step_weights(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-6,
    delta: float = 0.2,
    *,
    step_index: torch.Tensor | None = None,
    rule: WeightRule = "telescoped",
) -> torch.Tensor:
    """Token weights w_{k(t)} (B, L): constant within a step, 0 on masked positions, detached."""
    d, present, ids = step_divergences(student_logp, teacher_logp, mask, step_index)
    return tokens_from_steps(weights_from_divergences(d, present, eps, delta, rule), ids).detach()


def sod_advantages(
    grpo_adv: torch.Tensor,
    old_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps: float = 1e-6,
    delta: float = 0.2,
    c_opd: float = 1.0,
    grpo_coef: float = 1.0,
    step_index: torch.Tensor | None = None,
    rule: WeightRule = "telescoped",
    weights: Weights = "adaptive",
) -> torch.Tensor:
    """Fused advantage (B, L) from per-sequence A^grpo (B,): A_total = g·A^grpo·m + c_opd·w_{k(t)}·(T − o)·m;
    ``weights="uniform"`` sets every w_k = 1 (the paper's OPD baseline, L_GRPO + L_OPD)."""
    if weights == "uniform":
        w = (mask > 0).to(old_logp.dtype)
    else:
        w = step_weights(old_logp, teacher_logp, mask, eps, delta, step_index=step_index, rule=rule)
    opd = opd_advantage(old_logp, teacher_logp, mask)  # (T − o)·m, detached
    return (grpo_coef * grpo_adv.to(opd.dtype)[:, None] * mask + c_opd * w * opd).detach()


def sod_diagnostics(d: torch.Tensor, present: torch.Tensor, per_step_w: torch.Tensor) -> dict[str, float]:
    """First/last step divergence, mean weight, steps per sequence, share of w < 0.5, and d_1 = 0 flags.

    What they measure: docs/methods/sod.md, 'Steps and weights'.
    """
    num_steps = present.sum(dim=1)  # K per sequence
    has_steps = num_steps > 0
    n_seq = max(int(has_steps.sum()), 1)
    n_steps = max(int(num_steps.sum()), 1)
    if d.shape[1] == 0:
        first = last = torch.zeros_like(num_steps, dtype=d.dtype)
    else:
        first = d[:, 0]
        last = d.gather(1, (num_steps - 1).clamp(min=0)[:, None])[:, 0]
    later_diverges = ((d[:, 1:] > 0) & present[:, 1:]).any(dim=1) if d.shape[1] > 1 else torch.zeros_like(has_steps)
    return {
        "step_div_first": float((first * has_steps).sum()) / n_seq,
        "step_div_last": float((last * has_steps).sum()) / n_seq,
        "step_weight_mean": float((per_step_w * present).sum()) / n_steps,
        "steps_per_seq": float(num_steps.float().mean()) if num_steps.numel() else 0.0,
        "frac_steps_w_lt_half": float(((per_step_w < 0.5) & present).sum()) / n_steps,
        "d1_zero_sequences": float((has_steps & (first == 0) & later_diverges).sum()),  # later OPD signal ≈ switched off
    }


def sod_objective(
    batch: TensorBatch, student: StudentOutputs, hp: SODParams, state: object = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate on the SOD fused advantage, token-mean, with step diagnostics."""
    mask = batch.loss_mask
    old = old_logprobs(batch, student)
    step_index = batch.step_index if hp.steps == "step_index" else None
    grpo_adv = grpo_sequence_advantages(batch, hp.grpo_coef)  # g·A^grpo_b (zeros when g = 0)
    advantages = sod_advantages(
        grpo_adv, old, batch.teacher_logprobs, mask, eps=hp.eps, delta=hp.delta, c_opd=hp.c_opd, step_index=step_index, rule=hp.weight_rule,
        weights=hp.weights,
    )
    d, present, _ = step_divergences(old, batch.teacher_logprobs, mask, step_index)
    per_step_w = present.to(d.dtype) if hp.weights == "uniform" else weights_from_divergences(d, present, hp.eps, hp.delta, hp.weight_rule)
    opd = opd_advantage(old, batch.teacher_logprobs, mask)
    loss, diagnostics = clipped_surrogate(
        student.logprobs, old, advantages, mask, clip_low=hp.clip_low, clip_high=hp.clip_high, dual_clip=hp.dual_clip
    )
    diagnostics.update(sod_diagnostics(d, present, per_step_w))
    diagnostics.update(
        opd_advantage_mean=float(masked_mean(opd, mask)),
        advantage_mean=float(masked_mean(advantages, mask)),
        tokens=float(mask.sum()),
    )
    if hp.grpo_coef != 0.0:
        diagnostics["reward_mean"] = graded_reward_mean(batch.rewards)  # over graded samples: errors are not zeros
    return loss, diagnostics


def sod_needs(hp: SODParams) -> frozenset[str]:
    base = {"teacher_logprobs", "behaviour_logprobs", "old_logprobs", "step_boundaries"}
    return frozenset(base | {"rewards"} if hp.grpo_coef != 0.0 else base)


SOD_SPEC = MethodSpec(
    description="Step-wise OPD: per-turn reliability weights min((d_1+ε)/(d_k+ε), 1+δ) on the OPD advantage, "
    "fused with GRPO under one PPO clip",
    objective=sod_objective,  # type: ignore[arg-type]
    hparams=SODParams,
    needs=sod_needs,  # type: ignore[arg-type]
    group_size=16,  # docs/methods/sod.md: 16 rollouts per prompt (run_sod.sh)
    notes={
        "dual_clip": DUAL_CLIP_NOTE,
        "samples_per_prompt": "default 16 per prompt (official run script); with grpo_coef ≠ 0, 1 needs allow_single_sample",
        "delta": "δ = 0.2 from the official run script; the fork's config dataclass default is 0.5",
        "weight_rule": "official code clips only the output of the unclipped running product (= (d_1+ε)/(d_k+ε)); "
        "'recursive' clips the carried product, a possible paper reading",
        "steps": "a step is a maximal run of loss_mask = 1 (official code); "
        "'step_index' also splits adjacent model segments with different step ids",
        "d1_zero": "d_1 = 0 makes every later w_k ≈ 0 (faithful to code); counted in d1_zero_sequences",
        "weights": "uniform: every w_k = 1, i.e. L_GRPO + L_OPD with the sampled-token OPD term (App. B.3's OPD baseline, "
        "Table 2 ablation 1.1); with grpo_coef 0 it is naive sampled-token OPD under the PPO clip (App. C.3)",
    },
)
