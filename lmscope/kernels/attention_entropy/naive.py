"""Plain-PyTorch attention with per-row entropy: the test oracle's fp32 twin and the CPU path.

Materialises the score matrix a block of query rows at a time (each block only over the keys its rows
may see), computes in float32 (float64 for float64 inputs) and is differentiable.
"""

from __future__ import annotations

import math

import torch

from ..dispatch import repeat_kv


# A block of query rows holds about this many scores ("default": devices not named). On a CPU its passes
# (mask, exp, sums) then run in cache, several times faster than over the whole matrix; and a forward pass
# without gradients never holds all [B, H, Nq, Nk] scores at once.
SCORES_PER_BLOCK = {"cpu": 1 << 20, "default": 1 << 24}


def block_rows_for(device: torch.device, scores_per_row: int) -> int:
    """Query rows per block on ``device`` when each row has ``scores_per_row`` scores."""
    budget = SCORES_PER_BLOCK.get(device.type, SCORES_PER_BLOCK["default"])
    return max(1, budget // max(1, scores_per_row))


def visible_keys(
    nq: int,
    nk: int,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None = None,
    window: int | None = None,
    device: torch.device | str | None = None,
    rows: range | None = None,
    keys: range | None = None,
) -> torch.Tensor:
    """Boolean [B or 1, 1, Nq, Nk] mask of the keys each query may attend to.

    Causal masks are aligned bottom-right (query i sees keys j <= i + Nk - Nq), as with a KV cache.
    A sliding ``window`` (causal only) keeps the last ``window`` of those: j > i + Nk - Nq - window.
    ``rows`` and ``keys`` (ranges of query and key positions) give that block of the mask instead.
    """
    rows = range(nq) if rows is None else rows
    keys = range(nk) if keys is None else keys
    allowed = torch.ones(1, 1, len(rows), len(keys), dtype=torch.bool, device=device)
    qi = torch.arange(rows.start, rows.stop, device=device)[:, None]
    kj = torch.arange(keys.start, keys.stop, device=device)[None, :]
    if causal:
        allowed = allowed & (kj <= qi + (nk - nq))
    if window is not None:
        if not causal:
            raise ValueError("a sliding window needs causal=True")
        allowed = allowed & (kj > qi + (nk - nq) - window)
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(device=device, dtype=torch.bool)[:, keys.start:keys.stop]
        allowed = allowed & kpm[:, None, None, :]
    return allowed


def keys_seen_by(rows: range, nq: int, nk: int, *, causal: bool, window: int | None) -> range:
    """The key positions any of the query ``rows`` may see (never empty, so that shapes stay valid)."""
    lo = max(0, rows.start + (nk - nq) - window + 1) if window is not None else 0
    hi = min(nk, rows.stop + (nk - nq)) if causal else nk
    return range(lo, max(hi, lo + 1))


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
    block_rows: int | None = None,
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
    ``block_rows``: query rows per block (default: about ``SCORES_PER_BLOCK`` scores a block).
    """
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])  # grouped-query attention
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    work = torch.promote_types(q.dtype, torch.float32)
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    (b, h, nq, _), nk = q.shape, k.shape[2]
    # Written block by block: pieces kept between the blocks' freed scores would keep the allocator from
    # reusing that memory (non-causal blocks of equal size then grew the process by GiBs).
    out = torch.zeros(b, h, nq, v.shape[-1], dtype=q.dtype, device=q.device)
    entropy = torch.zeros(b, h, nq, dtype=work, device=q.device)
    lse = torch.full((b, h, nq), float("-inf"), dtype=work, device=q.device)
    if nk == 0:  # no key at all: every row is empty
        return out, entropy, lse
    if block_rows is None:
        block_rows = block_rows_for(q.device, b * h * nk)
    masked = causal or window is not None or key_padding_mask is not None or attn_mask is not None
    if attn_mask is not None:
        attn_mask = attn_mask.to(device=q.device, dtype=torch.bool)
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + attn_mask.shape)
    # last rows first: under a causal mask the blocks then shrink, and each reuses memory the one before freed
    # (growing blocks would each need fresh memory, which the allocator keeps: 0.8 GiB at 16384 keys)
    for start in reversed(range(0, nq, block_rows)):
        rows = range(start, min(nq, start + block_rows))
        keys = keys_seen_by(rows, nq, nk, causal=causal, window=window)
        allowed = None
        if masked:
            allowed = visible_keys(nq, nk, causal=causal, key_padding_mask=key_padding_mask, window=window,
                                   device=q.device, rows=rows, keys=keys)
            if attn_mask is not None:
                allowed = allowed & _block_of(attn_mask, rows, keys)
        s = torch.matmul(qw[:, :, rows.start:rows.stop], kw[:, :, keys.start:keys.stop].transpose(-1, -2)) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        e, l, block_entropy, block_lse = softmax_entropy(s, allowed)
        out[:, :, rows.start:rows.stop] = torch.matmul(e, vw[:, :, keys.start:keys.stop]) / l
        entropy[:, :, rows.start:rows.stop] = block_entropy
        lse[:, :, rows.start:rows.stop] = block_lse
    return out, entropy, lse


def _block_of(mask: torch.Tensor, rows: range, keys: range) -> torch.Tensor:
    """The [.., rows, keys] block of a mask broadcastable to [B, H, Nq, Nk] (broadcast dims kept)."""
    if mask.shape[-2] != 1:
        mask = mask[..., rows.start:rows.stop, :]
    return mask if mask.shape[-1] == 1 else mask[..., keys.start:keys.stop]


def softmax_entropy(s: torch.Tensor, allowed: torch.Tensor | None):
    """(e, l, entropy, lse) of the softmax of each row of scores ``s`` [..., keys] over its ``allowed`` keys
    (None: all of them); the softmax itself is e / l.

    With x = s − m (m the row max) and e = exp(x): l = Σ e, lse = m + ln l, and the entropy −Σ p ln p with
    p = e / l is ln l − (Σ e·x) / l, the Triton kernel's formula. A row with no allowed key gets e = 0,
    l = 1, entropy 0 and lse −inf; one whose scores hold a NaN, NaNs.
    """
    if allowed is None:  # nothing masked (the sweep's training steps): no row is empty
        m = s.detach().amax(dim=-1, keepdim=True)
        x = s - m
        e = torch.exp(x)
        l = e.sum(dim=-1, keepdim=True)
        ln_l = torch.log(l)
        entropy = ln_l - (e * x).sum(dim=-1, keepdim=True) / l
        return e, l, entropy.squeeze(-1), (m + ln_l).squeeze(-1)
    visible = allowed.any(dim=-1, keepdim=True)
    s = s.masked_fill(~allowed, float("-inf"))
    # the results do not depend on m, so no gradient flows through it; empty rows shift by 0
    m = s.detach().amax(dim=-1, keepdim=True).masked_fill(~visible, 0.0)
    x = s - m
    e = torch.exp(x)
    l = e.sum(dim=-1, keepdim=True)
    ex = (e * x.masked_fill(~allowed, 0.0)).sum(dim=-1, keepdim=True)  # masked keys: 0, not 0 · (−inf)
    l = torch.where(visible, l, 1.0)  # an empty row's l = 0 would give NaNs (and NaN gradients)
    ln_l = torch.log(l)
    entropy = torch.where(visible, ln_l - ex / l, 0.0)
    lse = torch.where(visible, m + ln_l, float("-inf"))
    return e, l, entropy.squeeze(-1), lse.squeeze(-1)
