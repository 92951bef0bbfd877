"""Permutation-equivariant targets f: [0,1]^(n×d) → R^(n×d) for the sumformer sweep.

Each target is built from a *semi-invariant* scalar g(x1, {x2, …, xn}): x1 is the token whose output
we compute, the others enter only as a set. It is applied to every coordinate c separately:

    f(X)_{i,c} = g(x_{i,c}, {x_{k,c} : k ≠ i})

so f is equivariant (permuting the tokens permutes the outputs). Written with the per-coordinate
power sums p_m = Σ_k x_k^m over *all* tokens, "the others" are p_m − x_i^m, which is how a Sumformer
S(X)_i = ψ(x_i, Σ_k φ(x_k)) can represent them.

The names and formulas shown to users live in `lmscope.params.sweep.TARGET_FORMULAS` (light module);
a test checks that both list the same targets.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def _others_sum(x: torch.Tensor, power: int = 1) -> torch.Tensor:
    """Σ_{k≠i} x_k^power for every token i (per coordinate): the total minus the token itself."""
    xp = x**power
    return xp.sum(dim=-2, keepdim=True) - xp


def fig2_poly(x: torch.Tensor) -> torch.Tensor:
    """g = x1 + 7·x1² + 3·x1·(x2 + … + xn)³ (the paper's Fig. 2)."""
    return x + 7 * x**2 + 3 * x * _others_sum(x) ** 3


def poly_moments(x: torch.Tensor) -> torch.Tensor:
    """g = x1·(x2 + … + xn) + (x2² + … + xn²) = x1·p1 + p2 − 2·x1² (linear in x1², x1·p1, p2)."""
    return x * _others_sum(x) + _others_sum(x, 2)


def sin_exp(x: torch.Tensor) -> torch.Tensor:
    """g = sin(2π·x1) + exp(−Σ_{k≥2} (xk − x1)²)."""
    # Σ_k (x_k − x_i)² = p2 − 2·x_i·p1 + n·x_i² over all k (the k = i term is 0): O(n·d), not the
    # [n, n, d] table of differences, which at n = 256, d = 32 and 2000 samples is 34 GB.
    n = x.shape[-2]
    p1, p2 = x.sum(dim=-2, keepdim=True), (x * x).sum(dim=-2, keepdim=True)
    squares = (p2 - 2 * x * p1 + n * x * x).clamp_min(0)  # rounding may dip a hair below 0
    return torch.sin(2 * math.pi * x) + torch.exp(-squares)


def max_dist(x: torch.Tensor) -> torch.Tensor:
    """g = max_{k≥2} |xk − x1| = max(max_k x_k − x1, x1 − min_k x_k): the farthest token is the largest
    or the smallest one (the k = i term is 0 and never exceeds the others' distances)."""
    return torch.maximum(x.amax(dim=-2, keepdim=True) - x, x - x.amin(dim=-2, keepdim=True))


TARGETS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "fig2_poly": fig2_poly,
    "poly_moments": poly_moments,
    "sin_exp": sin_exp,
    "max_dist": max_dist,
}


def evaluate_target(name: str, x: torch.Tensor) -> torch.Tensor:
    """f(X) for X of shape [..., n, d]; same shape out."""
    return TARGETS[name](x)


def sample_inputs(samples: int, seq_len: int, token_dim: int, seed: int, *, dtype=torch.float32) -> torch.Tensor:
    """`samples` sequences of n tokens uniform on [0,1]^d, reproducible from `seed` (CPU generator)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(samples, seq_len, token_dim, generator=g, dtype=dtype)
