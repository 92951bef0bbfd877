"""Performer FAVOR+ attention in plain PyTorch (differentiable; the oracle of ``triton_kernel.py``).

Softmax attention softmax(q kᵀ·scale) v is approximated with positive random features
(Choromanski et al., "Rethinking Attention with Performers", 2021):

    exp(x·y) = E_ω[φ(x) φ(y)],  φ(x) = exp(ωᵀx − ‖x‖²/2) / √m,  ω ~ N(0, I) (orthogonal blocks)

with x = q·scale^(1/2), y = k·scale^(1/2) so that x·y = q·k·scale. Attention becomes
out_n = φ(q_n)ᵀ Σ_j φ(k_j) v_jᵀ / φ(q_n)ᵀ Σ_j φ(k_j), linear in N; the causal version sums over
j <= n (prefix sums, computed chunk by chunk).
"""

from __future__ import annotations

import math

import torch

from ..dispatch import repeat_kv


def draw_favor_projection(
    num_features: int,
    head_dim: int,
    seed: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Random feature matrix ω [num_features, head_dim]: orthogonal blocks, chi-distributed norms.

    Each block of head_dim rows is the Q factor of a Gaussian matrix (exactly orthogonal rows);
    every row is then rescaled by the norm of an independent Gaussian vector, so each row is
    marginally N(0, I) as the estimator requires. Drawn on the CPU in float64 from ``seed`` so the
    same seed gives the same matrix on every device.
    """
    if num_features < 1 or head_dim < 1:
        raise ValueError(f"num_features and head_dim must be >= 1; got {num_features}, {head_dim}")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    n_blocks = math.ceil(num_features / head_dim)
    g = torch.randn(n_blocks, head_dim, head_dim, generator=gen, dtype=torch.float64)
    qmat, r = torch.linalg.qr(g)  # batched: one QR per block
    # fix the sign ambiguity of QR so the draw is Haar-distributed and platform-independent
    diag = torch.diagonal(r, dim1=-2, dim2=-1)
    qmat = qmat * torch.where(diag < 0, -1.0, 1.0).to(torch.float64)[:, None, :]
    omega = qmat.transpose(-1, -2).reshape(n_blocks * head_dim, head_dim)[:num_features]  # rows orthonormal
    norms = torch.randn(num_features, head_dim, generator=gen, dtype=torch.float64).norm(dim=1)
    return (omega * norms[:, None]).to(device=device, dtype=dtype)


def favor_features(
    x: torch.Tensor, projection: torch.Tensor, *, scale: float, is_query: bool, eps: float = 1e-6
) -> torch.Tensor:
    """Positive random features φ(x·scale^(1/2)) [..., N, m], stabilised.

    Stabilisation subtracts a max before exp: per row for queries, per (batch, head) over all keys
    and features for keys (as in the Performer code). Both factors cancel between numerator and
    denominator of the attention, so they are detached; ``eps`` keeps every feature positive.
    """
    x = x * scale**0.5
    proj = torch.matmul(x, projection.transpose(-1, -2).to(x.dtype))  # ωᵀx for every feature
    sq = 0.5 * (x * x).sum(dim=-1, keepdim=True)
    if is_query:
        stab = proj.amax(dim=-1, keepdim=True)
    else:
        stab = proj.amax(dim=(-1, -2), keepdim=True)
    m = projection.shape[0]
    return (torch.exp(proj - sq - stab.detach()) + eps) / math.sqrt(m)


def favor_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    projection: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    eps: float = 1e-6,
    chunk: int = 64,
) -> torch.Tensor:
    """FAVOR+ attention [B, H, N, Dv] in the dtype of q (computed in at least float32)."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    work = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = q.to(work), k.to(work), v.to(work)
    phi_q = favor_features(qf, projection, scale=scale, is_query=True, eps=eps)  # [B,H,N,m]
    phi_k = favor_features(kf, projection, scale=scale, is_query=False, eps=eps)
    if not causal:
        kv = torch.matmul(phi_k.transpose(-1, -2), vf)  # [B,H,m,Dv]
        z = phi_k.sum(dim=-2)  # [B,H,m]
        num = torch.matmul(phi_q, kv)
        den = torch.matmul(phi_q, z.unsqueeze(-1))
        return (num / den).to(q.dtype)

    # Causal: prefix sums S_n = Σ_{j<=n} φ(k_j) v_jᵀ, z_n = Σ_{j<=n} φ(k_j), done per chunk of
    # positions (state carried across chunks, masked quadratic form inside a chunk) so memory is
    # O(N·(m + chunk) + m·Dv) instead of the O(N·m·Dv) of a full cumsum.
    n = q.shape[2]
    state = torch.zeros(*phi_k.shape[:2], phi_k.shape[-1], vf.shape[-1], dtype=work, device=q.device)
    zsum = torch.zeros(*phi_k.shape[:2], phi_k.shape[-1], dtype=work, device=q.device)
    outs = []
    for s0 in range(0, n, chunk):
        pq, pk, vc = phi_q[:, :, s0 : s0 + chunk], phi_k[:, :, s0 : s0 + chunk], vf[:, :, s0 : s0 + chunk]
        a = torch.tril(torch.matmul(pq, pk.transpose(-1, -2)))  # [B,H,c,c], j <= i inside the chunk
        num = torch.matmul(pq, state) + torch.matmul(a, vc)
        den = torch.matmul(pq, zsum.unsqueeze(-1)) + a.sum(dim=-1, keepdim=True)
        outs.append(num / den)
        state = state + torch.matmul(pk.transpose(-1, -2), vc)
        zsum = zsum + pk.sum(dim=-2)
    return torch.cat(outs, dim=2).to(q.dtype)
