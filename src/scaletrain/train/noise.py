"""The gradient noise scale, measured along a run from two batch sizes it already has.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training") found that the batch
beyond which larger batches stop paying — the critical batch B_crit, where a run takes twice the
fewest steps and twice the fewest tokens it could — is predicted by the simple noise scale
B_simple = tr(Σ) / |G|², Σ the covariance of one example's gradient and G the true gradient;
training at batch B then takes (1 + B_simple / B) times the fewest steps and (1 + B / B_simple)
times the fewest tokens (their eq. 2.11, with B_simple for B_noise). B_simple grows as the loss
falls (Kaplan et al. 2020 measured B_crit ∝ L^(-1/0.21)), which is why batches are ramped up.

A step with gradient accumulation holds the gradient of its first micro-batch (B_small tokens
over every data-parallel rank) before the others add theirs, and then that of the whole step
(B_big). E|G_B|² = |G|² + tr(Σ)/B for a batch of B, so the two norms give unbiased estimates
of both (their appendix A.1):

    |G|²  ≈ (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1 / B_small − 1 / B_big)

Each is noisy, and |G|²'s is often negative early on; their ratio is taken of exponential
moving averages over the steps measured (the estimates averaged before dividing, as McCandlish
et al. did). Examples are counted in tokens: a batch's sequences are independent draws, its
tokens are not, and B_simple counts the tokens of as many sequences as it takes.

Adam's preconditioning and the learning rate's schedule are outside this model; B_simple
bounds the batch worth using, it does not set it (McCandlish et al.'s B_noise, which weights Σ
by the Hessian, is closer to B_crit still, and costs Hessian-vector products to measure).
"""

from __future__ import annotations

import math

import torch

# Weight of the newest estimate in the moving averages: about the last 20 steps measured.
SMOOTHING = 0.05


def estimates(small_sq: float, big_sq: float, small_tokens: int, big_tokens: int) -> tuple[float, float]:
    """(|G|², tr(Σ)) from the squared gradient norms of a batch of small_tokens and one of
    big_tokens that contains it."""
    if not small_tokens < big_tokens:
        raise ValueError(f"the small batch ({small_tokens} tokens) must be smaller than the big one ({big_tokens})")
    grad_sq = (big_tokens * big_sq - small_tokens * small_sq) / (big_tokens - small_tokens)
    trace = (small_sq - big_sq) / (1 / small_tokens - 1 / big_tokens)
    return grad_sq, trace


def new_stats() -> torch.Tensor:
    """The moving averages of |G|² and tr(Σ), and the weight they have gathered (checkpointed)."""
    return torch.zeros(3, dtype=torch.float64)


def update(stats: torch.Tensor, grad_sq: float, trace: float) -> torch.Tensor:
    """stats with one more step's estimates folded in (non-finite ones are left out)."""
    if not (math.isfinite(grad_sq) and math.isfinite(trace)):
        return stats
    keep = 1 - SMOOTHING
    return torch.tensor([keep * stats[0].item() + SMOOTHING * grad_sq, keep * stats[1].item() + SMOOTHING * trace,
                         keep * stats[2].item() + SMOOTHING], dtype=torch.float64)


def noise_scale(stats: torch.Tensor) -> float | None:
    """B_simple in tokens from the moving averages (their shared start-up bias cancels), or None
    while either is not positive (early on, noise can drive either estimate below zero)."""
    grad_sq, trace, weight = stats.tolist()
    if weight == 0 or grad_sq <= 0 or trace <= 0:
        return None
    return trace / grad_sq
