"""Linformer attention (Wang et al., 2020) in plain PyTorch (differentiable).

Keys and values are projected along the sequence, K' = E K and V' = F V with E, F ∈ R^{k×N}, and
out = softmax(q K'ᵀ · scale) V'. Non-causal by construction: every K' row mixes all positions.
"""

from __future__ import annotations

import math

import torch

from ..dispatch import check_count, repeat_kv


def draw_linformer_projections(
    k: int,
    seq_len: int,
    seed: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """E, F [k, seq_len] with i.i.d. N(0, 1/k) entries (the paper's JL projections), from ``seed``.

    Drawn on the CPU in float64 so a seed gives the same matrices on every device.
    """
    k = check_count("draw_linformer_projections", "k", k)
    seq_len = check_count("draw_linformer_projections", "seq_len", seq_len)
    gen = torch.Generator(device="cpu").manual_seed(check_count("draw_linformer_projections", "seed", seed, least=0))
    e = torch.randn(k, seq_len, generator=gen, dtype=torch.float64) / math.sqrt(k)
    f = torch.randn(k, seq_len, generator=gen, dtype=torch.float64) / math.sqrt(k)
    return e.to(device=device, dtype=dtype), f.to(device=device, dtype=dtype)


def linformer_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor, f: torch.Tensor, *, scale: float
) -> torch.Tensor:
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    work = torch.promote_types(q.dtype, torch.float32)
    kp = torch.matmul(e.to(work), k.to(work))  # [B,H,k,D]; E may be [k,N] or per-head [H,k,N]
    vp = torch.matmul(f.to(work), v.to(work))
    p = torch.softmax(torch.matmul(q.to(work), kp.transpose(-1, -2)) * scale, dim=-1)
    return torch.matmul(p, vp).to(q.dtype)
