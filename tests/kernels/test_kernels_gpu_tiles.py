"""Every block shape a GPU may launch, run through the interpreter against the float64 oracles.

The interpreted tests use one small square tile per kernel; on a GPU the autotuner picks among
others (128×64, 64×16, …). Masking at the causal diagonal, at a sliding window's start and at the
ragged last block depends on BLOCK_M and BLOCK_N separately, so each GPU tile's block sizes run here
too, on lengths that fill none of them.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from lmscope.kernels import attention_with_entropy, dimension_entropy, draw_favor_projection, favor_attention
from lmscope.kernels.dispatch import interpreting
from tests.kernels.conftest import close_in_float64 as _close

attention_kernel = importlib.import_module("lmscope.kernels.attention_entropy.triton_kernel")
dimension_kernel = importlib.import_module("lmscope.kernels.dimension_entropy.triton_kernel")
favor_kernel = importlib.import_module("lmscope.kernels.favor.triton_kernel")

pytestmark = pytest.mark.skipif(not interpreting(), reason="on a GPU the autotuner launches these tiles itself")

ATTENTION_BLOCKS = sorted({(bm, bn) for tiles in attention_kernel._TILES.values() for bm, bn, _, _ in tiles})
DIMENSION_BLOCKS = sorted({tuple(c.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_D"))
                           for c in dimension_kernel._configs()})
FAVOR_BLOCKS = sorted({(bn, bdv) for bn, bdv, _, _ in favor_kernel._TILES})


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bm,bn", ATTENTION_BLOCKS)
def test_attention_tiles(triton_backend, oracle, monkeypatch, bm, bn):
    monkeypatch.setattr(attention_kernel, "_INTERPRET_BLOCKS", {"BLOCK_M": bm, "BLOCK_N": bn})
    n = bm + bn + 3  # a ragged last block of queries and of keys
    q, k, v = _randn(1, 2, n, 32, seed=bm), _randn(1, 1, n, 32, seed=bn), _randn(1, 1, n, 32, seed=7)
    kpm = torch.rand(1, n, generator=torch.Generator().manual_seed(1)) > 0.25
    cases = [
        dict(causal=True),
        dict(causal=False, key_padding_mask=kpm),
        dict(causal=True, window=bn + 5),  # the window starts inside a key block
        # the second query block's first row (bm): its window starts at a key block's last key
        dict(causal=True, window=1 + (bm + 1) % bn),
    ]
    for case in cases:
        res = attention_with_entropy(q, k, v, backend=triton_backend, **case)
        out, ent, lse, _ = oracle.attention(q, k, v, **case)
        _close(res.out, out, 2e-5)
        _close(res.entropy, ent, 2e-5)
        _close(res.lse, lse, 2e-5)
    # fewer queries than keys (a continuation): the causal diagonal is offset by N_K − N_Q
    tail = q[:, :, -(bm // 2 + 1):]
    res = attention_with_entropy(tail, k, v, causal=True, backend=triton_backend)
    out, ent, lse, _ = oracle.attention(tail, k, v, causal=True)
    _close(res.out, out, 2e-5)
    _close(res.entropy, ent, 2e-5)
    # the last bm queries, one full block, with a window whose last row starts one key into the first key
    # block: that block is inside some rows' windows only (the masked path, not the fast one)
    last = q[:, :, -bm:]
    res = attention_with_entropy(last, k, v, causal=True, window=n - 1, backend=triton_backend)
    out, ent, lse, _ = oracle.attention(last, k, v, causal=True, window=n - 1)
    _close(res.out, out, 2e-5)
    _close(res.entropy, ent, 2e-5)


@pytest.mark.parametrize("bm,bn,bd", DIMENSION_BLOCKS)
@pytest.mark.parametrize("causal", [True, False])
def test_dimension_entropy_tiles(triton_backend, oracle, monkeypatch, bm, bn, bd, causal):
    monkeypatch.setattr(dimension_kernel, "_BLOCKS", {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": bd})
    n, d = bm + bn + 3, bd + 8  # ragged in rows, keys and head dimensions
    q, k = _randn(1, 2, n, d, seed=bm + bd), _randn(1, 1, n, d, seed=bn)
    got = dimension_entropy(q, k, causal=causal, backend=triton_backend)
    _close(got, oracle.dimension(q, k, causal=causal), 2e-5)


@pytest.mark.parametrize("bn,bdv", FAVOR_BLOCKS)
def test_causal_favor_tiles(triton_backend, monkeypatch, bn, bdv):
    monkeypatch.setattr(favor_kernel, "INTERPRET_BLOCK_M", favor_kernel.BLOCK_M)  # the GPU's feature block
    monkeypatch.setattr(favor_kernel, "_BLOCKS", {"BLOCK_N": bn, "BLOCK_DV": bdv})
    n, m, dv = bn + 5, favor_kernel.BLOCK_M + 9, bdv + 3  # ragged in positions, features and value columns
    q, k, v = 0.5 * _randn(1, 2, n, 16, seed=bn), 0.5 * _randn(1, 2, n, 16, seed=bdv), _randn(1, 2, n, dv, seed=3)
    w = draw_favor_projection(m, 16, seed=1)
    got = favor_attention(q, k, v, projection=w, causal=True, eps=0.0, backend=triton_backend)
    # the oracle: the explicit causal kernel matrix of the same features, in float64
    x = lambda t: t.double() * 16 ** -0.25  # noqa: E731
    phi = lambda t: torch.exp(x(t) @ w.double().T - (x(t) ** 2).sum(-1, keepdim=True) / 2)  # noqa: E731
    a = torch.tril(phi(q) @ phi(k).transpose(-1, -2))
    _close(got, (a @ v.double()) / a.sum(-1, keepdim=True), 2e-5)
