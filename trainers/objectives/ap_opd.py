"""AP-OPD — Adaptive Pullback on-policy distillation (docs/methods/ap-opd.md, RECONSTRUCTED) and its controls (docs/methods/ap-opd.md).

Penalty d_t = sg([o_t − T_t]_+) is averaged over blocks of ``block`` valid tokens (each maximal run of
mask==1 is blocked on its own, paper App. B.3). When a block's mean penalty jumps above its
predecessor's (z-gate or top-α detector), its tokens are pulled back with w = D_i / D_{i+1}, so the
block's mean penalty returns to the pre-jump level. The loss is vanilla token-mean OPD with weights:
L = −(1/Σm) Σ m·w·ρ·A,  A = T − o,  ρ = exp(s − o).

Controls from the paper: ``ap_opd_magcap`` caps the ⌈α·C⌉ largest post-boundary blocks at the
response's mean penalty (selection by magnitude, not by jumps); ``ap_opd_fixed`` uses the same
detector with a constant post-jump weight of 0.3. All weights are detached.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias

from pydantic import Field, field_validator

from opd_harness.lazy import lazy_import
from opd_harness.method import HParams, MethodSpec, StudentOutputs
from opd_harness.trajectory import TensorBatch
from opd_harness.trainers.objectives import masked_mean, masked_sum
from opd_harness.trainers.objectives.common import dual_clipped, old_logprobs, ppo_clip_per_token
from opd_harness.trainers.objectives.grpo import DUAL_CLIP, check_dual_clip

if TYPE_CHECKING:
    import torch
else:  # imported on first use: `harness methods` and config validation read the method's spec without torch
    torch = lazy_import("torch")

Detector = Literal["z", "topk", "z_and_topk"]
CountsAs = Literal["blocks", "boundaries"]
PartialBlock = Literal["keep", "merge"]
Aggregation = Literal["token-mean", "seq-mean"]
AdvantageSign = Literal["signed", "penalty-only"]


# --------------------------------------------------------------------------------------------------
# Blocks of one sequence


@dataclass(frozen=True)
class Blocks:
    """Blocks over one sequence's valid tokens: per-token block id and per-block statistics (float64, CPU)."""

    positions: torch.Tensor  # (n,) row index of each valid token, in order
    token_block: torch.Tensor  # (n,) block id of each valid token
    mean: torch.Tensor  # (C,) D_i
    var: torch.Tensor  # (C,) s_i², sample variance (n−1); 0 for a one-token block
    size: torch.Tensor  # (C,) n_i
    comparable: torch.Tensor  # (C−1,) bool: blocks i and i+1 lie in the same mask run (a boundary)

    @property
    def count(self) -> int:
        return int(self.mean.numel())


def make_blocks(d_row: torch.Tensor, mask_row: torch.Tensor, block: int, partial: PartialBlock = "keep") -> Blocks:
    """Cut each maximal mask==1 run of one row into ``block``-token blocks (the last may be short)."""
    positions = torch.nonzero(mask_row > 0).flatten()
    n = positions.numel()
    d = d_row[positions].double()
    if n == 0:
        empty = torch.zeros(0, dtype=torch.float64)
        return Blocks(positions, positions, empty, empty, empty, torch.zeros(0, dtype=torch.bool))
    starts_run = torch.ones(n, dtype=torch.bool)
    starts_run[1:] = positions[1:] != positions[:-1] + 1  # a masked gap ends a run
    run_id = torch.cumsum(starts_run.long(), 0) - 1
    first_of_run = torch.nonzero(starts_run).flatten()
    rank = torch.arange(n) - first_of_run[run_id]  # position inside the run
    in_run = torch.div(rank, block, rounding_mode="floor")
    if partial == "merge":  # RECONSTRUCTED alternative: a last block shorter than B/2 joins its predecessor
        run_len = torch.bincount(run_id, minlength=first_of_run.numel())
        rem, n_blocks = run_len % block, (run_len + block - 1) // block
        merge = (rem > 0) & (2 * rem < block) & (n_blocks > 1)
        in_run = torch.where(merge[run_id], torch.minimum(in_run, (n_blocks - 2)[run_id]), in_run)
    starts_block = starts_run.clone()
    starts_block[1:] |= in_run[1:] != in_run[:-1]
    token_block = torch.cumsum(starts_block.long(), 0) - 1
    c = int(starts_block.sum())
    size = torch.bincount(token_block, minlength=c).double()
    mean = torch.bincount(token_block, weights=d, minlength=c) / size.clamp(min=1)  # D_i = mean_{t∈i} d_t
    sq = (d - mean[token_block]) ** 2
    var = torch.bincount(token_block, weights=sq, minlength=c) / (size - 1).clamp(min=1)  # s_i² = Σ(d−D_i)²/(n_i−1)
    block_run = run_id[starts_block]
    return Blocks(positions, token_block, mean, var, size, block_run[1:] == block_run[:-1])


def ceil_fraction(alpha: float, count: int) -> int:
    """⌈α·C⌉ robust to float noise (0.1·30 = 3.0000000000000004 must give 3, not 4)."""
    return math.ceil(round(alpha * count, 9))


def top_alpha_count(blocks: Blocks, alpha: float, counts_as: CountsAs) -> int:
    """⌈α·C⌉ with C = number of blocks (default) or number of within-run boundaries (RECONSTRUCTED flag)."""
    c = blocks.count if counts_as == "blocks" else int(blocks.comparable.sum())
    return ceil_fraction(alpha, c)


def largest_first(values: torch.Tensor, candidates: torch.Tensor, k: int) -> list[int]:
    """Indices of the ``k`` largest ``values`` among ``candidates``; ties go to the lower index."""
    idx = torch.nonzero(candidates).flatten().tolist()
    return sorted(sorted(idx, key=lambda i: (-float(values[i]), i))[:k])


# --------------------------------------------------------------------------------------------------
# Detectors and per-block weight rules


def detect_jumps(blocks: Blocks, z: float, detector: Detector, alpha: float, counts_as: CountsAs = "blocks") -> list[int]:
    """Boundaries i (block i → i+1, same mask run) flagged as jumps by the z-gate and/or the top-α detector."""
    if blocks.count < 2:
        return []
    delta = blocks.mean[1:] - blocks.mean[:-1]  # Δ_i = D_{i+1} − D_i
    candidate = blocks.comparable & (delta > 0)
    # Welch SE of a difference of block means: sqrt(s_i²/n_i + s_{i+1}²/n_{i+1})
    se = torch.sqrt(blocks.var[:-1] / blocks.size[:-1] + blocks.var[1:] / blocks.size[1:])
    z_pass = set(torch.nonzero(candidate & (delta > z * se)).flatten().tolist())
    if detector == "z":
        return sorted(z_pass)
    k = min(top_alpha_count(blocks, alpha, counts_as), int(candidate.sum()))  # K = min(⌈α·C⌉, #{Δ>0})
    top = largest_first(delta, candidate, k)
    return top if detector == "topk" else [i for i in top if i in z_pass]


def pullback_block_weights(blocks: Blocks, jumps: list[int], w_min: float = 0.0, fixed: float | None = None) -> torch.Tensor:
    """w = max(D_i / D_{i+1}, w_min) on each post-jump block i+1 (or the constant ``fixed``); 1 elsewhere."""
    weights = torch.ones(blocks.count, dtype=torch.float64)
    for i in jumps:  # consecutive jumps do not compound: each block is compared with its raw predecessor
        weights[i + 1] = fixed if fixed is not None else max(float(blocks.mean[i] / blocks.mean[i + 1]), w_min)
    return weights


def magnitude_cap_block_weights(blocks: Blocks, d_mean: float, alpha: float, counts_as: CountsAs = "blocks") -> tuple[torch.Tensor, int]:
    """The ⌈α·C⌉ post-boundary blocks with the largest D get min(1, D̄/D_{i+1}); D̄ = response mean penalty."""
    weights = torch.ones(blocks.count, dtype=torch.float64)
    if blocks.count < 2:
        return weights, 0
    post = torch.zeros(blocks.count, dtype=torch.bool)
    post[1:] = blocks.comparable  # a block with a predecessor in the same run
    chosen = largest_first(blocks.mean, post, min(top_alpha_count(blocks, alpha, counts_as), int(post.sum())))
    for j in chosen:
        weights[j] = min(1.0, d_mean / float(blocks.mean[j])) if blocks.mean[j] > 0 else 1.0
    return weights, len(chosen)


BlockRule: TypeAlias = Callable[[Blocks, "torch.Tensor"], "tuple[torch.Tensor, int]"]


def blockwise_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, block: int, rule: BlockRule, partial: PartialBlock = "keep"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply a per-block weight ``rule`` row by row; returns token weights (B, L) and #reweighted blocks (B,)."""
    d = penalty(log_ratio, mask).double().cpu()
    m = mask.detach().cpu()
    weights = torch.ones_like(d)  # masked positions keep weight 1 (irrelevant: they never enter the loss)
    counts = torch.zeros(d.shape[0], dtype=torch.float64)
    for b in range(d.shape[0]):
        blocks = make_blocks(d[b], m[b], block, partial)
        if blocks.count == 0:
            continue
        block_w, counts[b] = rule(blocks, d[b, blocks.positions])
        weights[b, blocks.positions] = block_w[blocks.token_block]
    return weights.to(device=log_ratio.device, dtype=log_ratio.dtype), counts.to(log_ratio.device)


# --------------------------------------------------------------------------------------------------
# Public weight functions


def penalty(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """d_t = sg([r_t]_+)·m_t, the detection penalty (0 on masked positions, NaN-safe)."""
    d = torch.clamp(log_ratio.detach(), min=0.0)
    return torch.where(mask > 0, d, torch.zeros_like(d))


def pullback(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    block: int = 64,
    z: float = 2.0,
    detector: Detector = "z",
    alpha: float = 0.05,
    *,
    w_min: float = 0.0,
    counts_as: CountsAs = "blocks",
    partial: PartialBlock = "keep",
    fixed: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AP-OPD pullback weights (B, L) and the number of detected jumps per row (B,)."""

    def rule(blocks: Blocks, _: torch.Tensor) -> tuple[torch.Tensor, int]:
        jumps = detect_jumps(blocks, z, detector, alpha, counts_as)
        return pullback_block_weights(blocks, jumps, w_min, fixed), len(jumps)

    return blockwise_weights(log_ratio, mask, block, rule, partial)


def pullback_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    block: int = 64,
    z: float = 2.0,
    detector: Detector = "z",
    alpha: float = 0.05,
    *,
    w_min: float = 0.0,
    counts_as: CountsAs = "blocks",
    partial: PartialBlock = "keep",
) -> torch.Tensor:
    """AP-OPD token weights (B, L) in [0, 1] for log_ratio r_t = o_t − T_t; detached.

    The rule: docs/methods/ap-opd.md, 'The detector and the weights'.
    """
    return pullback(log_ratio, mask, block, z, detector, alpha, w_min=w_min, counts_as=counts_as, partial=partial)[0]


def magnitude_cap_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    block: int = 64,
    alpha: float = 0.05,
    *,
    counts_as: CountsAs = "blocks",
    partial: PartialBlock = "keep",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitude-cap control weights (B, L) and #capped blocks per row (B,) (docs/methods/ap-opd.md)."""

    def rule(blocks: Blocks, d_valid: torch.Tensor) -> tuple[torch.Tensor, int]:
        return magnitude_cap_block_weights(blocks, float(d_valid.mean()), alpha, counts_as)

    return blockwise_weights(log_ratio, mask, block, rule, partial)


def removed_mass(weights: torch.Tensor, d: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q = Σ_t m(1−w)d / Σ_t m·d per response, averaged over responses with non-zero penalty mass (docs/methods/ap-opd.md)."""
    valid = mask > 0
    zero = torch.zeros_like(d)
    removed = torch.where(valid, (1.0 - weights) * d, zero).sum(-1)
    total = torch.where(valid, d, zero).sum(-1)
    has_mass = total > 0
    if not bool(has_mass.any()):
        return torch.zeros((), dtype=d.dtype, device=d.device)
    return (removed[has_mass] / total[has_mass]).mean().detach()


# --------------------------------------------------------------------------------------------------
# Weighted OPD surrogate (shared with iw_opd)


class SurrogateParams(HParams):
    """Loss options shared by the reweighted sampled-token OPD methods (docs/methods/ap-opd.md)."""

    advantage: AdvantageSign = Field(
        "signed", description="A = T − o (signed, default) or −[o − T]_+ (RECONSTRUCTED alternative; ap-opd page, 'Open choices')"
    )
    clip: bool = Field(False, description="PPO-clip the ratio (off for the paper's vanilla OPD)")
    clip_low: float = Field(0.2, ge=0, description="ε_lo when clip is on")
    clip_high: float = Field(0.28, ge=0, description="ε_hi when clip is on")
    dual_clip: float | None = Field(
        DUAL_CLIP, description="c when clip is on: for A < 0 the token loss is at most c·|A| (as grpo's); null or 0 disables it"
    )
    aggregation: Aggregation = Field(
        "token-mean", description="token-mean (paper default) or seq-mean (RECONSTRUCTED alternative; ap-opd page, 'Open choices')"
    )

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip_above_one(cls, value: float | None) -> float | None:
        return check_dual_clip(value)


def opd_advantage_signed(log_ratio: torch.Tensor, mask: torch.Tensor, sign: AdvantageSign = "signed") -> torch.Tensor:
    """A_t = −r_t = T_t − o_t (both signs), or −[r_t]_+; 0 on masked positions; detached."""
    a = -log_ratio.detach() if sign == "signed" else -torch.clamp(log_ratio.detach(), min=0.0)
    return torch.where(mask > 0, a, torch.zeros_like(a))


def surrogate_per_token(student_logp: torch.Tensor, old_logp: torch.Tensor, advantage: torch.Tensor, hp: SurrogateParams) -> torch.Tensor:
    """ℓ_t = −ρ_t·A_t with ρ_t = exp(s_t − o_t), or the PPO-clip form −min(ρA, clip(ρ)A) with its dual clip for A < 0."""
    ratio = torch.exp(student_logp - old_logp.detach())
    if not hp.clip:
        return -ratio * advantage
    return ppo_clip_per_token(ratio, advantage, clip_low=hp.clip_low, clip_high=hp.clip_high, dual_clip=hp.dual_clip)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation) -> torch.Tensor:
    """token-mean: Σ m ℓ / max(Σm, 1); seq-mean: mean over non-empty rows of the row's token-mean."""
    if mode == "token-mean":
        return masked_sum(per_token, mask) / mask.sum().clamp(min=1.0)
    row_sum = torch.where(mask > 0, per_token, torch.zeros_like(per_token)).sum(-1)
    row_len = mask.sum(-1)
    non_empty = (row_len > 0).to(per_token.dtype)
    return (row_sum / row_len.clamp(min=1.0) * non_empty).sum() / non_empty.sum().clamp(min=1.0)


def weighted_opd_loss(
    batch: TensorBatch,
    student: StudentOutputs,
    old_logp: torch.Tensor,
    log_ratio: torch.Tensor,
    weights: torch.Tensor,
    hp: SurrogateParams,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L = agg_t(−w_t·ρ_t·A_t) with the detached weights, plus the shared diagnostics (mean w, q, KL)."""
    mask = batch.loss_mask
    weights = weights.detach()
    advantage = opd_advantage_signed(log_ratio, mask, hp.advantage)
    per_token = surrogate_per_token(student.logprobs, old_logp, weights * advantage, hp)
    loss = aggregate(per_token, mask, hp.aggregation)
    diagnostics = {
        "teacher_kl": float(masked_mean(torch.where(mask > 0, log_ratio, 0.0), mask)),  # Σ m(o−T)/Σm
        "mean_weight": float(masked_mean(torch.where(mask > 0, weights, 0.0), mask)),
        "removed_mass": float(removed_mass(weights, penalty(log_ratio, mask), mask)),
        "advantage_mean": float(masked_mean(weights * advantage, mask)),
        "tokens": float(mask.sum()),
    }
    if hp.clip:
        ratio = torch.exp(student.logprobs.detach() - old_logp.detach())
        outside = (ratio < 1.0 - hp.clip_low) | (ratio > 1.0 + hp.clip_high)
        diagnostics["clip_fraction"] = float(masked_mean(outside.to(mask.dtype), mask))
        diagnostics["dual_clip_fraction"] = float(masked_mean(dual_clipped(ratio, weights * advantage, hp.dual_clip).to(mask.dtype), mask))
    return loss, diagnostics


def per_sequence(counts: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of a per-row count over rows with at least one valid token."""
    non_empty = mask.sum(-1) > 0
    return float(counts[non_empty].mean()) if bool(non_empty.any()) else 0.0


def sampled_log_ratio(batch: TensorBatch, student: StudentOutputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, r): trainer-side old log-probs and the detached log-ratio r_t = o_t − T_t."""
    old = old_logprobs(batch, student)
    return old, (old - batch.teacher_logprobs).detach()


# --------------------------------------------------------------------------------------------------
# Methods


class BlockParams(SurrogateParams):
    block: int = Field(64, ge=1, description="B: valid tokens per block (paper: 64)")
    alpha: float = Field(0.05, gt=0, le=1, description="α of the top-α count ⌈α·C⌉ (paper: 5%)")
    counts_as: CountsAs = Field(
        "blocks", description="C in ⌈α·C⌉: number of blocks (default) or of boundaries (RECONSTRUCTED; ap-opd page, 'Open choices')"
    )
    partial_block: PartialBlock = Field(
        "keep",
        description="last short block kept (default) or merged into its predecessor if < B/2 (RECONSTRUCTED; ap-opd page, 'Open choices')",
    )


class DetectorParams(BlockParams):
    z: float = Field(2.0, ge=0, description="z-gate: Δ_i > z·sqrt(s_i²/n_i + s_{i+1}²/n_{i+1}) (paper: 2)")
    detector: Detector = Field("z", description="z (paper default), topk (top-α ablation) or z_and_topk (both must flag)")


class APOPDParams(DetectorParams):
    w_min: float = Field(0.0, ge=0, le=1, description="floor on pullback weights; 0 = none (the paper's rule)")


class FixedWeightParams(DetectorParams):
    fixed_weight: float = Field(0.3, ge=0, le=1, description="constant weight on post-jump blocks (paper App. D: 0.3)")


class MagCapParams(BlockParams):
    pass


def ap_opd_objective(
    batch: TensorBatch, student: StudentOutputs, hp: APOPDParams, state: object = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """AP-OPD: token-mean OPD surrogate with pullback weights on post-jump blocks (docs/methods/ap-opd.md)."""
    old, r = sampled_log_ratio(batch, student)
    weights, jumps = pullback(
        r, batch.loss_mask, hp.block, hp.z, hp.detector, hp.alpha, w_min=hp.w_min, counts_as=hp.counts_as, partial=hp.partial_block
    )
    loss, diagnostics = weighted_opd_loss(batch, student, old, r, weights, hp)
    return loss, {**diagnostics, "jumps_per_seq": per_sequence(jumps, batch.loss_mask)}


def ap_opd_fixed_objective(
    batch: TensorBatch, student: StudentOutputs, hp: FixedWeightParams, state: object = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Fixed-weight control: AP-OPD's detector, constant weight on post-jump blocks (docs/methods/ap-opd.md)."""
    old, r = sampled_log_ratio(batch, student)
    weights, jumps = pullback(
        r, batch.loss_mask, hp.block, hp.z, hp.detector, hp.alpha, counts_as=hp.counts_as, partial=hp.partial_block, fixed=hp.fixed_weight
    )
    loss, diagnostics = weighted_opd_loss(batch, student, old, r, weights, hp)
    return loss, {**diagnostics, "jumps_per_seq": per_sequence(jumps, batch.loss_mask)}


def ap_opd_magcap_objective(
    batch: TensorBatch, student: StudentOutputs, hp: MagCapParams, state: object = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Magnitude-cap control: cap the largest post-boundary blocks at the response mean penalty (docs/methods/ap-opd.md)."""
    old, r = sampled_log_ratio(batch, student)
    weights, capped = magnitude_cap_weights(r, batch.loss_mask, hp.block, hp.alpha, counts_as=hp.counts_as, partial=hp.partial_block)
    loss, diagnostics = weighted_opd_loss(batch, student, old, r, weights, hp)
    return loss, {**diagnostics, "capped_blocks_per_seq": per_sequence(capped, batch.loss_mask)}


def ap_opd_needs(hp: HParams) -> frozenset[str]:
    """T of the sampled tokens, and o recomputed under the behaviour weights (the current student, detached, when absent)."""
    return frozenset({"teacher_logprobs", "old_logprobs"})


_COMMON_NOTES = {
    "status": "RECONSTRUCTED (docs/methods/ap-opd.md): no paper equations or code were available",
    "log_ratio": "r_t = o_t − T_t with o the trainer-side old log-prob (batch.old_logprobs, else the current student detached)",
    "blocks": "formed over valid tokens; each maximal mask==1 run (assistant turn) is blocked separately (App. B.3); "
    "boundaries never cross a mask break",
    "partial_block": "last short block kept with its own size (default); 'merge' joins a block shorter than B/2 to its predecessor",
    "variance": "sample variance (n−1); a one-token block has s² = 0",
    "C": "C = number of blocks in the response (all runs); counts_as='boundaries' uses within-run boundaries",
    "top_alpha": "K = min(⌈α·C⌉, #{Δ>0}) per response over all within-run boundaries; ties go to the lower index",
    "objective": "token-mean −w·ρ·A, A = T − o (signed), ρ = exp(s − o); PPO clip off; seq-mean and −[r]_+ advantage are options "
    "(docs/methods/ap-opd.md, 'Open choices')",
    "clip": "off by default (the paper's vanilla OPD), so ρ is unbounded for either sign of A under policy lag; clip=true bounds it "
    "(ε_lo, ε_hi) and adds the dual clip c = dual_clip (3.0) for A < 0, as grpo",
    "diagnostics": "jumps/capped blocks per non-empty sequence, mean weight over valid tokens, removed penalty mass q",
}

AP_OPD_SPEC = MethodSpec(
    description="AP-OPD: sampled-token OPD with adaptive pullback of blocks whose mean penalty jumps (z-gate or top-α)",
    objective=ap_opd_objective,  # type: ignore[arg-type]
    hparams=APOPDParams,
    needs=ap_opd_needs,  # type: ignore[arg-type]
    notes={
        **_COMMON_NOTES,
        "z_gate": "RECONSTRUCTED Eq. 5: jump iff Δ_i > 0 and Δ_i > z·sqrt(s_i²/n_i + s_{i+1}²/n_{i+1}) (Welch SE)",
        "detector": "'z' default; 'topk' the top-α ablation; 'z_and_topk' = boundaries flagged by both",
        "weights": "w = D_i/D_{i+1} on every valid token of post-jump block i+1, else 1; no floor (w_min=0), no renormalisation",
    },
)

AP_OPD_FIXED_SPEC = MethodSpec(
    description="AP-OPD control: same jump detector, constant weight (0.3) on post-jump blocks",
    objective=ap_opd_fixed_objective,  # type: ignore[arg-type]
    hparams=FixedWeightParams,
    needs=ap_opd_needs,  # type: ignore[arg-type]
    notes={**_COMMON_NOTES, "weights": "fixed_weight (0.3, paper App. D) on every post-jump block, else 1"},
)

AP_OPD_MAGCAP_SPEC = MethodSpec(
    description="AP-OPD control: cap the ⌈α·C⌉ post-boundary blocks with the largest mean penalty at the response mean",
    objective=ap_opd_magcap_objective,  # type: ignore[arg-type]
    hparams=MagCapParams,
    needs=ap_opd_needs,  # type: ignore[arg-type]
    notes={
        **_COMMON_NOTES,
        "weights": (
            "post-boundary blocks (a predecessor in the same run) ranked by D_{i+1}; the top ⌈α·C⌉ get "
            "min(1, D̄/D_{i+1}), D̄ = mean d over the response's valid tokens; a block with D = 0 keeps 1"
        ),
    },
)
