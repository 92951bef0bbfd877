"""Attention with the entropy of every attention row, without the N x N matrix."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..dispatch import check_floating, check_heads, check_scale, forward_backend, triton_dtype_refusal
from .naive import attention_with_entropy_reference


@dataclass(frozen=True)
class AttentionEntropy:
    """Result of :func:`attention_with_entropy`; unpacks as ``out, entropy, lse = result``.

    out:     [B, H, Nq, Dv], dtype of q
    entropy: [B, H, Nq] float32 (float64 for float64 inputs on the reference backend), nats, -sum_j p_ij ln p_ij of each query row
    lse:     [B, H, Nq] float32 (likewise), ln sum_j exp(s_ij) over the visible keys (natural log)
    backend: "triton" or "reference", the code that produced it (for job records)
    """

    out: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
    backend: str

    def __iter__(self):
        return iter((self.out, self.entropy, self.lse))


def _check(q, k, v, key_padding_mask, causal, softcap, window):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, H, N, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[-1] != d:
        raise ValueError(f"q and k head dims differ: {d} vs {k.shape[-1]}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on [B, H_kv, N]; got {tuple(k.shape)} and {tuple(v.shape)}")
    check_heads(h, k.shape[1])
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError("sequence lengths must be at least 1")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if key_padding_mask is not None:
        if key_padding_mask.shape != (b, k.shape[2]):
            raise ValueError(
                f"key_padding_mask must be [B, N_k] = [{b}, {k.shape[2]}]; got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.dtype != torch.bool:
            raise ValueError(f"key_padding_mask must be bool (True = attend); got {key_padding_mask.dtype}")
    if softcap is not None and (isinstance(softcap, bool) or not (isinstance(softcap, (int, float))
                                                                  and 0 < softcap < math.inf)):
        raise ValueError(f"softcap must be a positive finite number or None; got {softcap!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a whole number of keys >= 1 or None; got {window!r}")
        if not causal:
            raise ValueError("a sliding window needs causal=True")


MAX_HEAD_DIM = 256  # the Triton kernel's largest head dim (its tiles hold a whole head)


def head_dim_refusal(*head_dims: int) -> str | None:
    """Why the Triton kernel cannot take heads this wide, or None."""
    if max(head_dims) > MAX_HEAD_DIM:
        return f"the Triton kernel supports head dims up to {MAX_HEAD_DIM}; got {', '.join(map(str, head_dims))}"
    return None


def attention_triton_refusal(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot take these inputs, or None."""
    return head_dim_refusal(q.shape[-1], v.shape[-1]) or triton_dtype_refusal(q)


def attention_with_entropy(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    backend: str | None = None,
) -> AttentionEntropy:
    """softmax(q kᵀ · scale) v together with the entropy and log-sum-exp of every softmax row.

    q: [B, H, Nq, D]; k: [B, H_kv, Nk, D]; v: [B, H_kv, Nk, Dv] with H a multiple of H_kv
    (grouped-query attention: query head h reads kv head h // (H // H_kv)).
    causal: query i sees keys j <= i + (Nk - Nq) (bottom-right aligned, as with a KV cache).
    scale: defaults to 1/sqrt(D). key_padding_mask: [B, Nk] bool, True = attend (combinable with
    causal). A row with no visible key gets out = 0, entropy = 0 and lse = -inf.
    softcap: Gemma 2's logit soft-capping, scores s → softcap · tanh(s / softcap) before the softmax.
    window: a causal sliding window (Mistral, Gemma 2): query i sees the ``window`` keys ending at
    i + (Nk - Nq).
    backend: None (see ``kernel_backend``; what the Triton kernel cannot take, head dims above 256,
    float64 or tensors that need gradients, runs on the reference), "triton" or "reference". The Triton
    path has no autograd; the reference path is differentiable.
    """
    check_floating("attention_with_entropy", q=q, k=k, v=v)
    _check(q, k, v, key_padding_mask, causal, softcap, window)
    scale = check_scale("attention_with_entropy", scale)
    backend = forward_backend(backend, "attention_with_entropy", q, k, v, refusal=attention_triton_refusal(q, v))
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if backend == "reference":
        out, ent, lse = attention_with_entropy_reference(
            q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask, softcap=softcap, window=window
        )
        return AttentionEntropy(out, ent, lse, "reference")
    from .triton_kernel import attention_with_entropy_triton  # lazy: importing triton is optional

    with torch.no_grad():
        out, ent, lse = attention_with_entropy_triton(
            q, k, v, causal=causal, scale=float(scale), key_padding_mask=key_padding_mask,
            softcap=None if softcap is None else float(softcap), window=window,
        )
    return AttentionEntropy(out, ent, lse, "triton")


__all__ = ["AttentionEntropy", "attention_with_entropy", "attention_with_entropy_reference"]
