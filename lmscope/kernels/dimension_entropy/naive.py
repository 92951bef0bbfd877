"""Plain-PyTorch dimension-wise attention entropy (reference and CPU path).

For every head dimension i the score matrix is the rank-1 outer product
S_i = scale * q[:, i] k[:, i]ᵀ; we return the entropy of each row of softmax(S_i).
"""

from __future__ import annotations

import math

import torch

from ..dispatch import repeat_kv


def dimension_entropy_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    chunk: int = 8,
) -> torch.Tensor:
    """Entropy [B, H, D, N] (float32, nats). Materialises [B, H, chunk, N, N] at a time."""
    b, h, n, d = q.shape
    k = repeat_kv(k, h)  # grouped-query attention
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    qf = q.float().transpose(-1, -2)  # [B, H, D, N]
    kf = k.float().transpose(-1, -2)
    allowed = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.tril(allowed)
    out = []
    for i in range(0, d, chunk):
        s = qf[:, :, i : i + chunk, :, None] * kf[:, :, i : i + chunk, None, :] * scale  # [B,H,c,N,N]
        logp = torch.log_softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        # masked entries have p = 0 and logp = -inf: zero them before the product, so that neither 0 * (-inf)
        # nor its gradient (which torch.where would still form) is a NaN
        logp = logp.masked_fill(~allowed, 0.0)
        plogp = logp.exp().masked_fill(~allowed, 0.0) * logp
        out.append(-plogp.sum(dim=-1))
    return torch.cat(out, dim=2)
