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

from ..dispatch import check_count, repeat_kv


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
    num_features = check_count("draw_favor_projection", "num_features", num_features)
    head_dim = check_count("draw_favor_projection", "head_dim", head_dim)
    gen = torch.Generator(device="cpu").manual_seed(check_count("draw_favor_projection", "seed", seed, least=0))
    n_blocks = math.ceil(num_features / head_dim)
    g = torch.randn(n_blocks, head_dim, head_dim, generator=gen, dtype=torch.float64)
    qmat, r = torch.linalg.qr(g)  # batched: one QR per block
    # fix the sign ambiguity of QR so the draw is Haar-distributed and platform-independent
    diag = torch.diagonal(r, dim1=-2, dim2=-1)
    qmat = qmat * torch.where(diag < 0, -1.0, 1.0).to(torch.float64)[:, None, :]
    omega = qmat.transpose(-1, -2).reshape(n_blocks * head_dim, head_dim)[:num_features]  # rows orthonormal
    norms = torch.randn(num_features, head_dim, generator=gen, dtype=torch.float64).norm(dim=1)
    return (omega * norms[:, None]).to(device=device, dtype=dtype)


def favor_log_features(x: torch.Tensor, projection: torch.Tensor, *, scale: float) -> torch.Tensor:
    """log(√m · φ(x·scale^(1/2))) = ωᵀx − ‖x‖²/2 for every feature [..., N, m]."""
    x = x * scale**0.5
    return torch.matmul(x, projection.transpose(-1, -2).to(x.dtype)) - 0.5 * (x * x).sum(dim=-1, keepdim=True)


def favor_features(
    x: torch.Tensor, projection: torch.Tensor, *, scale: float, is_query: bool, eps: float = 0.0
) -> torch.Tensor:
    """Positive random features φ(x·scale^(1/2)) [..., N, m], stabilised.

    Stabilisation subtracts a max before exp: per row for queries, per (batch, head) over all keys
    and features for keys (as in the Performer code). Each is one factor shared by everything it
    multiplies, so it cancels between numerator and denominator of the attention (and is detached).
    For causal attention the keys take :func:`favor_causal_key_features` instead. ``eps`` is added to
    every stabilised feature; the Performer code adds 1e-6, which is not a constant factor: it biases
    the estimate wherever the features are small (large ‖x‖), so the default is 0.
    """
    logits = favor_log_features(x, projection, scale=scale)
    stab = logits.amax(dim=-1, keepdim=True) if is_query else logits.amax(dim=(-1, -2), keepdim=True)
    return (torch.exp(logits - stab.detach()) + eps) / math.sqrt(projection.shape[0])


def favor_causal_key_features(
    k: torch.Tensor, projection: torch.Tensor, *, scale: float, eps: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key features for causal FAVOR+: (φ(k_j)·e^(−M_j) [..., N, m], M [..., N]).

    M_j is the running max of the log-features over keys 1..j (detached). Query n combines the keys
    j <= n with the one factor e^(−M_n), which cancels in its ratio: φ(k_j)e^(−M_j) · e^(M_j − M_n),
    every factor <= 1. A single max over all keys would also cancel in exact arithmetic, but through
    underflow and ``eps`` a later key with large features would change an earlier query's output;
    with M the output at n depends on keys j <= n only.
    """
    logits = favor_log_features(k, projection, scale=scale)
    running_max = torch.cummax(logits.amax(dim=-1), dim=-1).values.detach()
    return (torch.exp(logits - running_max.unsqueeze(-1)) + eps) / math.sqrt(projection.shape[0]), running_max


def favor_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    projection: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    eps: float = 0.0,
    chunk: int = 64,
) -> torch.Tensor:
    """FAVOR+ attention [B, H, N, Dv] in the dtype of q (computed in at least float32)."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    work = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = q.to(work), k.to(work), v.to(work)
    phi_q = favor_features(qf, projection, scale=scale, is_query=True, eps=eps)  # [B,H,N,m]
    if not causal:
        phi_k = favor_features(kf, projection, scale=scale, is_query=False, eps=eps)
        kv = torch.matmul(phi_k.transpose(-1, -2), vf)  # [B,H,m,Dv]
        z = phi_k.sum(dim=-2)  # [B,H,m]
        num = torch.matmul(phi_q, kv)
        den = torch.matmul(phi_q, z.unsqueeze(-1))
        return (num / den).to(q.dtype)

    # Causal: prefix sums S_n = Σ_{j<=n} φ(k_j) v_jᵀ, z_n = Σ_{j<=n} φ(k_j), done per chunk of
    # positions (state carried across chunks, masked quadratic form inside a chunk) so memory is
    # O(N·(m + chunk) + m·Dv) instead of the O(N·m·Dv) of a full cumsum. Query n sees every key in
    # units of e^(−M_n) (favor_causal_key_features): key j's features are scaled by e^(M_j − M_n)
    # inside the chunk, and the state, kept in units of the previous chunk's last M, by e^(M_prev − M_n).
    phi_k, key_max = favor_causal_key_features(kf, projection, scale=scale, eps=eps)
    n = q.shape[2]
    state = torch.zeros(*phi_k.shape[:2], phi_k.shape[-1], vf.shape[-1], dtype=work, device=q.device)
    zsum = torch.zeros(*phi_k.shape[:2], phi_k.shape[-1], dtype=work, device=q.device)
    m_prev = torch.full(phi_k.shape[:2], -math.inf, dtype=work, device=q.device)  # nothing carried yet
    outs = []
    for s0 in range(0, n, chunk):
        pq, pk, vc = phi_q[:, :, s0 : s0 + chunk], phi_k[:, :, s0 : s0 + chunk], vf[:, :, s0 : s0 + chunk]
        mc = key_max[:, :, s0 : s0 + chunk]  # [B,H,c], non-decreasing
        rescale = torch.exp((mc.unsqueeze(-2) - mc.unsqueeze(-1)).clamp(max=0))  # e^(M_j − M_i), j <= i
        a = torch.tril(torch.matmul(pq, pk.transpose(-1, -2)) * rescale)  # [B,H,c,c], j <= i inside the chunk
        carry = torch.exp(m_prev.unsqueeze(-1) - mc).unsqueeze(-1)  # [B,H,c,1]; 0 for the first chunk
        num = carry * torch.matmul(pq, state) + torch.matmul(a, vc)
        den = carry * torch.matmul(pq, zsum.unsqueeze(-1)) + a.sum(dim=-1, keepdim=True)
        outs.append(num / den)
        m_end = mc[:, :, -1]
        pk_end = pk * torch.exp(mc - m_end.unsqueeze(-1)).unsqueeze(-1)  # the chunk's keys in units of e^(−m_end)
        decay = torch.exp(m_prev - m_end)
        state = decay[..., None, None] * state + torch.matmul(pk_end.transpose(-1, -2), vc)
        zsum = decay.unsqueeze(-1) * zsum + pk_end.sum(dim=-2)
        m_prev = m_end
    return torch.cat(outs, dim=2).to(q.dtype)
