"""Plain-PyTorch attention with per-row entropy: the test oracle's fp32 twin and the CPU path.

Materialises the [B, H, Nq, Nk] score matrix, computes in float32 (float64 for float64 inputs) and
is differentiable.
"""

from __future__ import annotations

import math

import torch

from ..dispatch import repeat_kv


def visible_keys(
    nq: int,
    nk: int,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None = None,
    window: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean [B or 1, 1, Nq, Nk] mask of the keys each query may attend to.

    Causal masks are aligned bottom-right (query i sees keys j <= i + Nk - Nq), as with a KV cache.
    A sliding ``window`` (causal only) keeps the last ``window`` of those: j > i + Nk - Nq - window.
    """
    allowed = torch.ones(1, 1, nq, nk, dtype=torch.bool, device=device)
    qi = torch.arange(nq, device=device)[:, None]
    kj = torch.arange(nk, device=device)[None, :]
    if causal:
        allowed = allowed & (kj <= qi + (nk - nq))
    if window is not None:
        if not causal:
            raise ValueError("a sliding window needs causal=True")
        allowed = allowed & (kj > qi + (nk - nq) - window)
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
    softcap: float | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (out [B,H,Nq,Dv] in q's dtype, entropy [B,H,Nq], lse [B,H,Nq]).

    Computes in promote_types(q.dtype, float32): entropy and lse are float32 for float32 and half
    inputs, float64 (and out computed in float64) for float64 inputs.

    ``attn_mask`` (bool, broadcastable to [B,H,Nq,Nk], True = attend) is an extra restriction used
    by the transformers integration for mask patterns the fused kernel does not know.
    ``softcap`` (Gemma 2's attention logit soft-capping): scores s become softcap · tanh(s / softcap)
    before the softmax; the entropy and lse are those of the capped scores.
    ``window`` (causal only): a sliding window of that many keys, see :func:`visible_keys`.
    Rows with no visible key get out = 0, entropy = 0, lse = -inf (as in the Triton kernel).
    """
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])  # grouped-query attention
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])

    work = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)).mul_(scale)  # [B, H, Nq, Nk]
    if softcap:
        s = torch.tanh(s / softcap).mul_(softcap)
    allowed = visible_keys(q.shape[2], k.shape[2], causal=causal, key_padding_mask=key_padding_mask,
                           window=window, device=q.device)
    if attn_mask is not None:
        allowed = allowed & attn_mask.to(device=q.device, dtype=torch.bool)
    any_visible = allowed.any(dim=-1).expand(s.shape[:-1])  # [B, H, Nq]
    s = s.masked_fill(~allowed, float("-inf"))
    # A row has no visible key only under a mask, or where causal queries outnumber the keys; asking the
    # device costs a host sync (per call, and it breaks a CUDA graph's capture of a training step), so only then.
    nq, nk = q.shape[2], k.shape[2]
    can_be_empty = (key_padding_mask is not None or attn_mask is not None or nk == 0 or (causal and nq > nk)
                    or (window is not None and not window >= 1))
    empty = can_be_empty and bool((~any_visible).any())
    if empty:  # rows with no visible key: score them 0 here (no -inf - -inf), zero them below
        s = s.masked_fill(~any_visible[..., None], 0.0)
    logp = torch.log_softmax(s, dim=-1)
    p = logp.exp()
    if empty:
        p = p.masked_fill(~any_visible[..., None], 0.0)
    # masked entries have p = 0 and log p = -inf: drop them rather than form 0 * (-inf)
    entropy = -(p * logp.masked_fill(~allowed, 0.0)).sum(dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    if empty:
        entropy = entropy.masked_fill(~any_visible, 0.0)
        lse = lse.masked_fill(~any_visible, float("-inf"))
    out = torch.matmul(p, v.to(work)).to(q.dtype)
    return out, entropy, lse
