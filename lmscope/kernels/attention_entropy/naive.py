"""Plain-PyTorch attention with per-row entropy: the test oracle's fp32 twin and the CPU path.

Materialises the [B, H, Nq, Nk] score matrix, computes in float32 and is differentiable.
"""

from __future__ import annotations

import math

import torch


def visible_keys(
    nq: int,
    nk: int,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean [B or 1, 1, Nq, Nk] mask of the keys each query may attend to.

    Causal masks are aligned bottom-right (query i sees keys j <= i + Nk - Nq), as with a KV cache.
    """
    allowed = torch.ones(1, 1, nq, nk, dtype=torch.bool, device=device)
    if causal:
        qi = torch.arange(nq, device=device)[:, None]
        kj = torch.arange(nk, device=device)[None, :]
        allowed = allowed & (kj <= qi + (nk - nq))
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    return allowed


def attention_with_entropy_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (out [B,H,Nq,Dv] in q's dtype, entropy [B,H,Nq] fp32, lse [B,H,Nq] fp32).

    ``attn_mask`` (bool, broadcastable to [B,H,Nq,Nk], True = attend) is an extra restriction used
    by the transformers integration for mask patterns the fused kernel does not know.
    Rows with no visible key get out = 0, entropy = 0, lse = -inf (as in the Triton kernel).
    """
    h, hk = q.shape[1], k.shape[1]
    if h != hk:  # grouped-query attention: query head h reads kv head h // (H // H_kv)
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])

    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    allowed = visible_keys(q.shape[2], k.shape[2], causal=causal, key_padding_mask=key_padding_mask, device=q.device)
    if attn_mask is not None:
        allowed = allowed & attn_mask.to(torch.bool)
    allowed = allowed.expand_as(s)

    neg_inf = torch.tensor(float("-inf"), device=s.device)
    s_masked = torch.where(allowed, s, neg_inf)
    any_visible = allowed.any(dim=-1)
    # A row with no visible key has max -inf; shift it by 0 instead so no (-inf) - (-inf) appears.
    m = torch.where(any_visible, s_masked.amax(dim=-1), torch.zeros((), device=s.device)).detach()
    e = torch.where(allowed, torch.exp(s_masked - m[..., None]), torch.zeros((), device=s.device))
    l = e.sum(dim=-1)
    l_safe = torch.where(any_visible, l, torch.ones((), device=s.device))
    p = e / l_safe[..., None]
    log_l = torch.log(l_safe)
    # -sum p log p with log p = (s - m) - log l computed per entry: no cancellation between large
    # numbers when the scores are big, and masked entries contribute exactly 0 (never 0 * -inf).
    logp = torch.where(allowed, s - m[..., None] - log_l[..., None], torch.zeros((), device=s.device))
    entropy = torch.where(any_visible, -(p * logp).sum(dim=-1), torch.zeros((), device=s.device))
    lse = torch.where(any_visible, m + log_l, neg_inf)
    out = torch.matmul(p, v.float()).to(q.dtype)
    return out, entropy, lse
