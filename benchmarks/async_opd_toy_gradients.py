"""What each async-OPD surrogate follows in expectation on a stale sample, by exact enumeration (issue 45).

One position, a categorical student π_θ = softmax(θ) over V tokens, a stale behaviour q = softmax(θ + σ·ε) that sampled
the token, and a teacher T. For each objective (the registered code, on a one-token batch per token y):

    E_q[∇θ loss] = Σ_y q(y) · ∇θ loss(y),     compared with   g* = ∇θ KL(π_θ ‖ T)   (what sync OPD follows).

Printed per drift scale σ (mean over draws): the drift KL(π_θ ‖ q); the cosine between E_q[∇loss] and g*; the norm
ratio ‖E_q[∇loss]‖ / ‖g*‖ (f-OPD's weights σ(f − ξ) < 1 shrink it); and the noise of one sample relative to its own
mean, E_q‖∇loss − E_q∇loss‖² / ‖E_q∇loss‖² (median over draws; how many samples the mean needs to show).

``--dynamics``: the same single position trained for ``--steps`` steps, the behaviour refreshed to the current student
every K steps (K = 1: sync), in two versions: plain gradient descent on the exact expectation (no sampling noise: what
the surrogate drives towards), and Adam on ``--samples`` tokens drawn from q per step (the regime's noise and optimizer).
Printed: the final KL(π_θ ‖ T) and entropy of π_θ (mean over draws) per objective and K. Usage:

    python benchmarks/async_opd_toy_gradients.py [--vocab 16] [--draws 200] [--dynamics --steps 300]
"""

from __future__ import annotations

import argparse

import torch

from opd_harness.method import StudentOutputs
from opd_harness.trainers.objectives.f_opd import AsyncOPDParams, FOPDParams, f_opd_objective, opd_async_objective
from opd_harness.trainers.objectives.opd import OPDParams, opd_objective
from opd_harness.trainers.objectives.opd_recompute import RecomputeParams, recompute_objective
from opd_harness.trajectory import TensorBatch

ARMS = {
    "opd (stale IS, reward from q)": (opd_objective, OPDParams()),
    "opd_recompute (no clip)": (recompute_objective, RecomputeParams()),
    "opd_recompute (AsyncOPD clip 0.2)": (recompute_objective, RecomputeParams(clip_eps=0.2)),
    "opd_async (§5.8, no ratio)": (opd_async_objective, AsyncOPDParams()),
    "f_opd λ=0.1 (defaults)": (f_opd_objective, FOPDParams()),
    "f_opd λ=1": (f_opd_objective, FOPDParams(anchor_coef=1.0)),
}
LAG = 3  # f-OPD's freshness reads it; the other objectives ignore it


def per_token_grads(objective, hp, theta: torch.Tensor, behaviour: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """(V, V): row y is ∇θ loss on the one-token batch whose sampled token is y, from one call of the objective on a batch of
    V one-token rows: ∂loss/∂s_y times the rows the objective averages over (all V for a token mean, the selected samples
    for the f-OPD family) is the one-row batch's, and ∇θ s_y = e_y − π_θ."""
    v = theta.shape[0]
    log_pi = torch.log_softmax(theta.detach(), -1)
    s = log_pi.clone().reshape(v, 1).requires_grad_(True)
    batch = TensorBatch(
        input_ids=torch.zeros(v, 1, dtype=torch.long), attention_mask=torch.ones(v, 1, dtype=torch.long),
        loss_mask=torch.ones(v, 1, dtype=s.dtype), step_index=torch.zeros(v, 1, dtype=torch.long),
        behaviour_logprobs=behaviour.reshape(v, 1), teacher_logprobs=teacher.reshape(v, 1), rewards=torch.full((v,), float("nan")),
        policy_version=torch.zeros(v, dtype=torch.long), group_ids=torch.arange(v), policy_lag=torch.full((v,), LAG),
    )  # fmt: skip
    loss, diagnostics = objective(batch, StudentOutputs(logprobs=s), hp)
    rows = v - diagnostics.get("excluded_samples", 0.0)
    coef = torch.autograd.grad(loss, s)[0].reshape(v) * rows if loss.requires_grad and rows > 0 else torch.zeros(v, dtype=s.dtype)
    return coef[:, None] * (torch.eye(v, dtype=s.dtype) - log_pi.exp()[None, :])


def kl_and_entropy(theta: torch.Tensor, teacher: torch.Tensor) -> tuple[float, float]:
    log_pi = torch.log_softmax(theta.detach(), -1)
    return float((log_pi.exp() * (log_pi - teacher)).sum()), float(-(log_pi.exp() * log_pi).sum())


def train(objective, hp, theta0, teacher, *, every: int, steps: int, lr: float, samples: int, g: torch.Generator):
    """Final (KL(π ‖ T), entropy): exact-expectation gradient descent (samples = 0) or Adam on sampled tokens."""
    theta = theta0.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([theta], lr=lr) if samples else torch.optim.SGD([theta], lr=lr)
    behaviour = torch.log_softmax(theta0, -1)
    for step in range(steps):
        if step % every == 0:
            behaviour = torch.log_softmax(theta.detach(), -1)  # weight sync: the sampler catches up
        grads = per_token_grads(objective, hp, theta, behaviour, teacher)
        if samples:
            ys = torch.multinomial(behaviour.exp(), samples, replacement=True, generator=g)
            grad = grads[ys].mean(0)  # a batch of one-token samples, token-mean
        else:
            grad = (behaviour.exp()[:, None] * grads).sum(0)
        optimizer.zero_grad()
        theta.grad = grad
        optimizer.step()
    return kl_and_entropy(theta, teacher)


def dynamics(args) -> None:
    g = torch.Generator().manual_seed(1)
    print(f"V = {args.vocab}, {args.draws} draws, {args.steps} steps; exact: SGD lr {args.lr_exact}; sampled: Adam lr "
          f"{args.lr_sampled}, {args.samples} tokens from q per step")
    print("| objective | K (steps between syncs) | exact: KL(π‖T) | exact: entropy | sampled: KL(π‖T) | sampled: entropy |")
    print("|---|---|---|---|---|---|")
    draws = []
    for _ in range(args.draws):
        draws.append(((2 * torch.randn(args.vocab, generator=g, dtype=torch.float64)),
                      torch.log_softmax(3 * torch.randn(args.vocab, generator=g, dtype=torch.float64), -1)))  # fmt: skip
    start = [kl_and_entropy(theta, teacher) for theta, teacher in draws]
    target_entropy = sum(float(-(t.exp() * t).sum()) for _, t in draws) / len(draws)
    print(f"| (start) | | {sum(k for k, _ in start) / len(start):.3f} | {sum(h for _, h in start) / len(start):.3f} | "
          f"(teacher entropy {target_entropy:.3f}) | |")
    for name, (objective, hp) in ARMS.items():
        for every in args.every:
            exact = [train(objective, hp, th, t, every=every, steps=args.steps, lr=args.lr_exact, samples=0, g=g) for th, t in draws]
            noisy = [train(objective, hp, th, t, every=every, steps=args.steps, lr=args.lr_sampled, samples=args.samples, g=g)
                     for th, t in draws]  # fmt: skip
            row = [sum(x[i] for x in rows) / len(rows) for rows in (exact, noisy) for i in (0, 1)]
            print(f"| {name} | {every} | " + " | ".join(f"{x:.3f}" for x in row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0, 2.0])
    parser.add_argument("--dynamics", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, nargs="+", default=[1, 24])
    parser.add_argument("--lr-exact", type=float, default=0.5)
    parser.add_argument("--lr-sampled", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    if args.dynamics:
        dynamics(args)
        return
    g = torch.Generator().manual_seed(0)
    print(f"V = {args.vocab}, {args.draws} draws per σ; θ ~ 2·N(0, 1), log T = log_softmax(3·N(0, 1)), q = softmax(θ + σ·N(0, 1))")
    print("| σ | KL(π‖q) | objective | cos(E∇, ∇KL(π‖T)) | ‖E∇‖ / ‖∇KL(π‖T)‖ | one-sample noise / ‖E∇‖² |")
    print("|---|---|---|---|---|---|")
    for sigma in args.sigmas:
        stats: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ARMS}
        drifts = []
        for _ in range(args.draws):
            theta = (2 * torch.randn(args.vocab, generator=g, dtype=torch.float64)).requires_grad_(True)
            teacher = torch.log_softmax(3 * torch.randn(args.vocab, generator=g, dtype=torch.float64), -1)
            behaviour = torch.log_softmax(theta.detach() + sigma * torch.randn(args.vocab, generator=g, dtype=torch.float64), -1)
            log_pi = torch.log_softmax(theta, -1)
            target = torch.autograd.grad((log_pi.exp() * (log_pi - teacher)).sum(), theta)[0]
            drifts.append(float((log_pi.exp() * (log_pi - behaviour)).sum().detach()))
            weights = behaviour.exp()[:, None]
            for name, (objective, hp) in ARMS.items():
                grads = per_token_grads(objective, hp, theta, behaviour, teacher)
                mean = (weights * grads).sum(0)
                cos = float(torch.nn.functional.cosine_similarity(mean, target, dim=0))
                scale = float(mean.norm() / target.norm())
                noise = float((weights * (grads - mean) ** 2).sum() / mean.norm() ** 2)
                stats[name].append((cos, scale, noise))
        drift = sum(drifts) / len(drifts)
        for name, rows in stats.items():
            cos, scale = (sum(r[i] for r in rows) / len(rows) for i in range(2))
            noise = sorted(r[2] for r in rows)[len(rows) // 2]  # median: a draw whose mean nearly cancels gives a huge ratio
            print(f"| {sigma} | {drift:.3f} | {name} | {cos:.3f} | {scale:.3f} | {noise:.1f} |")


if __name__ == "__main__":
    main()
