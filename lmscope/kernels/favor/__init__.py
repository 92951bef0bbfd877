"""Performer FAVOR+ attention (positive orthogonal random features)."""

from __future__ import annotations

import math

import torch

from ..dispatch import check_count, check_floating, check_heads, check_scale, forward_backend
from .naive import draw_favor_projection, favor_attention_reference, favor_causal_key_features, favor_features


def favor_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                  backend: str | None = None) -> str:
    """The backend :func:`favor_attention` runs these inputs on: "triton" only for the causal prefix sums
    (the non-causal form is two matmuls, the same PyTorch code on both backends)."""
    chosen = forward_backend(backend, "favor_attention", q, k, v)
    return "triton" if chosen == "triton" and causal else "reference"


def favor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_features: int | None = None,
    causal: bool = True,
    seed: int | None = None,
    projection: torch.Tensor | None = None,
    scale: float | None = None,
    eps: float = 0.0,
    backend: str | None = None,
) -> torch.Tensor:
    """FAVOR+ estimate [B, H, N, Dv] of softmax(q kᵀ · scale) v; differentiable.

    Give either ``projection`` (ω [m, D], e.g. from :func:`draw_favor_projection`) or
    ``num_features`` and ``seed`` (the projection is then drawn from the seed). k, v may have
    fewer heads (grouped-query). causal: query n averages over keys j <= n (prefix sums).
    scale defaults to 1/sqrt(D). ``eps`` is added to every stabilised feature: 0 gives the estimator
    itself; the Performer code's 1e-6 biases it where the features are small (see ``favor_features``).
    backend: None (Triton on CUDA, the reference elsewhere and whenever gradients are needed), "triton"
    (forward only: the causal prefix sums run in the Triton kernel; the features, and the two matmuls
    of the non-causal form, are PyTorch on both backends) or "reference".
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be [B, H, N, D]")
    if k.shape[:3] != v.shape[:3] or k.shape[-1] != q.shape[-1] or k.shape[2] != q.shape[2]:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
    check_heads(q.shape[1], k.shape[1])
    check_floating("favor_attention", q=q, k=k, v=v)
    scale = check_scale("favor_attention", scale)
    d = q.shape[-1]
    if num_features is not None:
        num_features = check_count("favor_attention", "num_features", num_features)
    if projection is None:
        if num_features is None or seed is None:
            raise ValueError("give projection=, or num_features= and seed=")
        projection = draw_favor_projection(num_features, d, seed, device=q.device)
    else:
        if projection.ndim != 2 or projection.shape[1] != d:
            raise ValueError(f"projection must be [num_features, {d}]; got {tuple(projection.shape)}")
        if num_features is not None and num_features != projection.shape[0]:
            raise ValueError(f"num_features={num_features} but projection has {projection.shape[0]} rows")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    projection = projection.to(q.device)
    if favor_backend(q, k, v, causal=causal, backend=backend) == "triton":
        from .triton_kernel import favor_causal_triton  # lazy: importing triton is optional

        with torch.no_grad():
            phi_q = favor_features(q.float(), projection, scale=scale, is_query=True, eps=eps)
            phi_k, key_max = favor_causal_key_features(k.float(), projection, scale=scale, eps=eps)
            return favor_causal_triton(phi_q, phi_k, key_max, v).to(q.dtype)
    return favor_attention_reference(q, k, v, projection, causal=causal, scale=scale, eps=eps)


__all__ = ["draw_favor_projection", "favor_attention", "favor_backend", "favor_attention_reference", "favor_causal_key_features",
           "favor_features"]
