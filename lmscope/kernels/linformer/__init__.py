"""Linformer attention: keys and values projected to k rows along the sequence."""

from __future__ import annotations

import math

import torch

from ..dispatch import check_floating, check_heads, check_scale, forward_backend, repeat_kv
from .naive import draw_linformer_projections, linformer_attention_reference


def linformer_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str | None = None) -> str:
    """The backend :func:`linformer_attention` runs these inputs on: its attention over the projected keys
    is :func:`attention_with_entropy`'s kernel, so that kernel's limits decide."""
    from ..attention_entropy import attention_triton_refusal

    return forward_backend(backend, "linformer_attention", q, k, v, refusal=attention_triton_refusal(q, v))


def linformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    E: torch.Tensor,
    F: torch.Tensor,
    *,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """softmax(q (E k)ᵀ · scale) (F v) → [B, H, N, Dv]; non-causal, differentiable.

    q: [B, H, N, D]; k, v: [B, H_kv, N, D(v)]; E, F: [k, N] shared by all heads, or anything that
    broadcasts against [B, H, k, N] (e.g. per-head [H, k, N]). scale defaults to 1/sqrt(D).
    With E = F = I_N this is exact softmax attention.
    backend: None (Triton on CUDA, the reference elsewhere and for what Triton cannot take: gradients,
    head dims above 256, float64), "triton"
    (forward only: the projections are matmuls, the attention over the k projected keys runs in
    :func:`attention_with_entropy`'s kernel, non-causal) or "reference".
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be [B, H, N, D]")
    if k.shape[:3] != v.shape[:3] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
    check_heads(q.shape[1], k.shape[1])
    check_floating("linformer_attention", q=q, k=k, v=v, E=E, F=F)
    scale = check_scale("linformer_attention", scale)
    n = k.shape[2]
    for name, m in (("E", E), ("F", F)):
        if m.ndim < 2:
            raise ValueError(f"{name} must be [k, N] (or per head [H, k, N]); got {tuple(m.shape)}")
        try:
            fits = torch.broadcast_shapes(m.shape[:-2], q.shape[:2]) == q.shape[:2]
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"{name} {tuple(m.shape)}: its leading dims must broadcast against [B, H] = "
                             f"{list(q.shape[:2])} (shared [k, N], or per head [H, k, N])")
    if E.shape[-1] != n or F.shape[-1] != n:
        raise ValueError(f"E and F must have N = {n} columns; got {tuple(E.shape)} and {tuple(F.shape)}")
    if E.shape[-2] != F.shape[-2]:
        raise ValueError(f"E and F must have the same number of rows; got {tuple(E.shape)} and {tuple(F.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    E, F = E.to(q.device), F.to(q.device)
    from ..attention_entropy import attention_with_entropy

    if linformer_backend(q, k, v, backend=backend) == "triton":
        with torch.no_grad():
            if E.ndim > 2 or F.ndim > 2:  # per-head projections are indexed by query head
                k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
            # projections summed in fp32, then back to the input dtype: a bf16 attention runs on tensor cores
            kp = torch.matmul(E.float(), k.float()).to(q.dtype)  # [B, H_kv, k, D]: grouped-query heads stay grouped
            vp = torch.matmul(F.float(), v.float()).to(q.dtype)
            return attention_with_entropy(q, kp, vp, causal=False, scale=scale, backend="triton").out
    return linformer_attention_reference(q, k, v, E, F, scale=scale)


__all__ = ["draw_linformer_projections", "linformer_attention", "linformer_backend", "linformer_attention_reference"]
