"""Fixtures for the kernel tests: float64 oracles built from the explicit attention matrix.

The Triton kernels run on CPU tensors through the interpreter, which the root conftest switches on
(before triton is imported) when there is no GPU. A triton that will not import skips its tests
locally and fails them in CI.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from tests.conftest import need



def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


TRITON_OK = _triton_ok()


def close_in_float64(actual, expected, atol, rtol=0.0):
    """assert_close on the CPU in float64, absolute tolerance unless `rtol` is given."""
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


def _allowed(nq, nk, causal, key_padding_mask, device, window=None):
    """[B|1, 1, Nq, Nk] bool: query i sees key j iff (not causal or j <= i + Nk - Nq) and j unpadded.

    With a sliding ``window`` also j > i + Nk - Nq - window (the window's last key is the diagonal).
    """
    i = torch.arange(nq, device=device).view(nq, 1)
    j = torch.arange(nk, device=device).view(1, nk)
    allowed = (j <= i + (nk - nq)) if causal else torch.ones(nq, nk, dtype=torch.bool, device=device)
    if window is not None:
        allowed = allowed & (i + (nk - nq) - j < window)
    allowed = allowed.view(1, 1, nq, nk)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.view(key_padding_mask.shape[0], 1, 1, nk)
    return allowed


def attention_oracle(q, k, v, *, causal, scale=None, key_padding_mask=None, softcap=None, window=None):
    """float64 (out, entropy, lse, probabilities) from the explicit N x N matrix.

    Rows with no visible key: out = 0, entropy = 0, lse = -inf (the convention under test).
    ``softcap``: scores become softcap · tanh(score / softcap) (Gemma 2).
    """
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    allowed = _allowed(q.shape[2], k.shape[2], causal, key_padding_mask, q.device, window).expand_as(s)
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # empty rows: exp(-inf - -inf) = nan -> 0
    entropy = -torch.special.xlogy(p, p).sum(-1)
    out = p @ v
    return out, entropy, lse, p


def dimension_oracle(q, k, *, causal, scale=None):
    """float64 [B, H, D, N]: per dimension i, entropy of rows of softmax(scale q_i k_iᵀ)."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    b, h, n, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    mask = _allowed(n, n, causal, None, q.device)[0, 0]
    out = torch.empty(b, h, d, n, dtype=torch.float64, device=q.device)
    for i in range(d):
        s = q[..., i, None] * k[..., None, :, i] * scale  # [B, H, N, N] explicit
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        out[:, :, i] = -torch.special.xlogy(p, p).sum(-1)
    return out


def softmax_attention_oracle(q, k, v, *, causal, scale=None):
    return attention_oracle(q, k, v, causal=causal, scale=scale)[0]


@pytest.fixture
def oracle():
    """Independent float64 computations (explicit matrices; no lmscope code)."""
    return types.SimpleNamespace(
        attention=attention_oracle,
        dimension=dimension_oracle,
        softmax_attention=softmax_attention_oracle,
        allowed=_allowed,
    )


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    """Every kernel test runs on both implementations."""
    if request.param == "triton":
        need(TRITON_OK, "triton is not installed")
    return request.param


@pytest.fixture
def triton_backend():
    """For tests of the Triton kernel alone."""
    need(TRITON_OK, "triton is not installed")
    return "triton"
