"""Entropy of softmax(q_i k_iᵀ · scale) for every head dimension i separately."""

from __future__ import annotations

import math

import torch

from ..dispatch import check_floating, check_heads, check_scale, forward_backend
from .naive import dimension_entropy_reference


def dimension_entropy_backend(q: torch.Tensor, k: torch.Tensor, *, backend: str | None = None) -> str:
    """The backend :func:`dimension_entropy` runs these inputs on (float64, or tensors that need gradients:
    the reference)."""
    return forward_backend(backend, "dimension_entropy", q, k)


def dimension_entropy(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Entropy [B, H, D, N] (float32, nats) of each row of the rank-1 attention of each dimension.

    q: [B, H, N, D], k: [B, H_kv, N, D] (H a multiple of H_kv). Entry [b, h, i, n] is the entropy
    of softmax_m(scale * q[b,h,n,i] * k[b,h_kv,m,i]) over the keys m visible to query n (m <= n
    when causal). scale defaults to 1/sqrt(D), the usual attention scale (a model may scale its own
    scores otherwise: GPT-2's scale_attn_by_inverse_layer_idx, Gemma's query_pre_attn_scalar).
    backend: None (see ``kernel_backend``; float64, or tensors that need gradients, run on the reference),
    "triton" or "reference".
    """
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must be [B, H, N, D]; got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q and k must agree on B, N and D; got {tuple(q.shape)} and {tuple(k.shape)}")
    check_heads(q.shape[1], k.shape[1])
    if q.shape[2] == 0:
        raise ValueError("sequence length must be at least 1")
    check_floating("dimension_entropy", q=q, k=k)
    if q.dtype != k.dtype:
        raise ValueError(f"q and k dtypes differ: {q.dtype}, {k.dtype}")
    scale = check_scale("dimension_entropy", scale)
    backend = dimension_entropy_backend(q, k, backend=backend)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if backend == "reference":
        return dimension_entropy_reference(q, k, causal=causal, scale=scale)
    from .triton_kernel import dimension_entropy_triton  # lazy: triton is optional

    with torch.no_grad():
        return dimension_entropy_triton(q, k, causal=causal, scale=float(scale))


__all__ = ["dimension_entropy", "dimension_entropy_backend", "dimension_entropy_reference"]
