"""FAVOR+ and Linformer against exact softmax attention and explicit float64 feature matrices."""

from __future__ import annotations

import math

import pytest
import torch

from lmscope.kernels import (attention_with_entropy, dimension_entropy, draw_favor_projection, draw_linformer_projections,
                             favor_attention, linformer_attention)


def _qkv(b, h, n, d, *, hk=None, spread=0.5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hk = h if hk is None else hk
    q = spread * torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    k = spread * torch.randn(b, hk, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, n, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ------------------------------------------------------------------ projections

def test_favor_projection_is_orthogonal_blocks_and_reproducible():
    d, m = 16, 40
    w = draw_favor_projection(m, d, seed=3, dtype=torch.float64)
    assert w.shape == (m, d)
    assert torch.equal(w, draw_favor_projection(m, d, seed=3, dtype=torch.float64))
    assert not torch.equal(w, draw_favor_projection(m, d, seed=4, dtype=torch.float64))
    for start in range(0, m, d):  # rows inside a block are mutually orthogonal
        blk = w[start : start + d]
        gram = blk @ blk.T
        off = gram - torch.diag(torch.diag(gram))
        assert off.abs().max() < 1e-10
    # row norms are chi(d)-distributed, as a Gaussian row's: the squares have mean d and variance 2d (a
    # constant norm √d has the right mean and no spread, and biases the estimator)
    norms = draw_favor_projection(4096, d, seed=0, dtype=torch.float64).norm(dim=1)
    assert abs(norms.pow(2).mean().item() - d) < 0.05 * d
    assert abs(norms.pow(2).var().item() - 2 * d) < 0.15 * 2 * d


def test_linformer_projections_distribution_and_seed():
    e, f = draw_linformer_projections(32, 200, seed=1, dtype=torch.float64)
    assert e.shape == f.shape == (32, 200)
    assert not torch.equal(e, f)
    e2, f2 = draw_linformer_projections(32, 200, seed=1, dtype=torch.float64)
    assert torch.equal(e, e2) and torch.equal(f, f2)
    assert abs(e.var().item() - 1 / 32) < 0.1 / 32  # N(0, 1/k)
    assert abs(e.mean().item()) < 0.01


# ------------------------------------------------------------------ Linformer

def test_linformer_with_identity_is_exact_attention(oracle):
    q, k, v = _qkv(2, 4, 23, 16, hk=2, spread=1.0)
    eye = torch.eye(23, dtype=torch.float64)
    out = linformer_attention(q, k, v, eye, eye)
    torch.testing.assert_close(out, oracle.softmax_attention(q, k, v, causal=False), atol=1e-12, rtol=0)


def test_linformer_with_pooling_matrix_matches_explicit(oracle):
    # E = F = averaging over blocks of 4 positions: attention over 6 pooled keys, checked by hand
    n, kk = 24, 6
    q, k, v = _qkv(1, 2, n, 8, seed=2, spread=1.0)
    pool = torch.zeros(kk, n, dtype=torch.float64)
    for i in range(kk):
        pool[i, 4 * i : 4 * i + 4] = 0.25
    kp = k.view(1, 2, kk, 4, 8).mean(3)
    vp = v.view(1, 2, kk, 4, 8).mean(3)
    p = torch.softmax(q @ kp.transpose(-1, -2) / math.sqrt(8), -1)
    torch.testing.assert_close(linformer_attention(q, k, v, pool, pool), p @ vp, atol=1e-12, rtol=0)


def test_linformer_is_differentiable():
    q, k, v = _qkv(1, 1, 6, 3, seed=3)
    e, f = draw_linformer_projections(3, 6, seed=0, dtype=torch.float64)
    inputs = tuple(t.requires_grad_() for t in (q, k, v, e, f))
    assert torch.autograd.gradcheck(lambda *a: linformer_attention(*a), inputs)


def test_linformer_float32_and_validation():
    q, k, v = _qkv(1, 2, 12, 8, dtype=torch.float32)
    e, f = draw_linformer_projections(4, 12, seed=0)
    assert linformer_attention(q, k, v, e, f).dtype == torch.float32
    with pytest.raises(ValueError, match="columns"):
        linformer_attention(q, k, v, e[:, :5], f)
    with pytest.raises(ValueError, match=r"E must be \[k, N\]"):
        linformer_attention(q, k, v, e[0], f)
    with pytest.raises(ValueError, match=r"broadcast against \[B, H\] = \[1, 2\]"):
        linformer_attention(q, k, v, e.expand(3, 4, 12), f)  # per head, but 3 heads for q's 2
    with pytest.raises(ValueError, match="scale must be finite"):
        linformer_attention(q, k, v, e, f, scale=float("nan"))
    with pytest.raises(TypeError, match="floating-point"):
        linformer_attention(q, k, v, e.long(), f)
    for bad in (4.0, True, 0):
        with pytest.raises(ValueError, match="k must be a whole number >= 1"):
            draw_linformer_projections(bad, 12, seed=0)
    with pytest.raises(ValueError, match="seed must be a whole number"):
        draw_linformer_projections(4, 12, seed=1.7)  # not truncated to 1: another seed's draw


# ------------------------------------------------------------------ FAVOR+

def _explicit_favor(q, k, v, w, causal):
    """float64, no stabiliser: φ(x) = exp(ωᵀx - |x|²/2)/sqrt(m), x = q d^(-1/4); explicit kernel matrix."""
    d, m = q.shape[-1], w.shape[0]
    xq, xk = q.double() * d**-0.25, k.double() * d**-0.25
    phi = lambda x: torch.exp(x @ w.double().T - 0.5 * (x * x).sum(-1, keepdim=True)) / math.sqrt(m)  # noqa: E731
    a = phi(xq) @ phi(xk).transpose(-1, -2)  # [B, H, N, N] estimate of exp(q k / sqrt(d))
    if causal:
        a = torch.tril(a)
    return (a @ v.double()) / a.sum(-1, keepdim=True)


@pytest.mark.parametrize("causal", [False, True])
def test_favor_equals_explicit_feature_computation(causal):
    # prefix sums (chunked) and the max-subtraction must not change the estimator itself
    q, k, v = _qkv(2, 2, 150, 16, spread=0.8, seed=4)
    w = draw_favor_projection(64, 16, seed=0, dtype=torch.float64)
    out = favor_attention(q, k, v, projection=w, causal=causal, eps=0.0)
    torch.testing.assert_close(out, _explicit_favor(q, k, v, w, causal), atol=1e-10, rtol=1e-8)


def _aligned_late_keys(n, late, d, m, seed):
    """float32 q, k, v [1, 2, n, d] and ω [m, d] whose keys from position ``late`` on are ω's own rows
    (scaled so x = k·d^(-1/4) = ω_r): their log-features reach ‖ω_r‖²/2 ≈ d/2 = 128 nats at d = 256,
    while the earlier keys' stay near 0. A single stabiliser over all keys pushes the early keys'
    features e^-128 down (float32 underflow, or below any eps)."""
    q, k, v = _qkv(1, 2, n, d, spread=0.5, seed=seed, dtype=torch.float32)
    w = draw_favor_projection(m, d, seed=seed)
    k[..., late:, :] = w[: n - late] * d**0.25
    return q, k, v, w


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_causal_favor_output_depends_only_on_earlier_keys(backend, device):
    # a query's estimate is built from keys j <= n: the first 20 outputs of a 40-token sequence are
    # those of the 20-token prefix, whatever the later keys are, and the float64 kernel matrix's
    if backend == "triton":
        from tests.kernels.conftest import TRITON_OK
        from tests.conftest import need
        need(TRITON_OK, "triton is not installed")
    q, k, v, w = (t.to(device) for t in _aligned_late_keys(40, 20, 256, 48, seed=3))
    full = favor_attention(q, k, v, projection=w, causal=True, backend=backend)
    prefix = favor_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20], projection=w, causal=True, backend=backend)
    assert torch.isfinite(full).all()
    torch.testing.assert_close(full[:, :, :20], prefix, rtol=1e-5, atol=1e-6)
    # float32 log-features of ~128 nats carry ~1e-5 of rounding into every feature
    assert _rel_err(full, _explicit_favor(q, k, v, w, causal=True)) < 1e-4


@pytest.mark.parametrize("causal", [False, True])
def test_favor_is_unbiased_by_stabilising_at_large_norms(causal):
    # ‖x‖ ≈ 6 and key norms growing along the sequence: features span e^±30; the stabilisers are
    # factors that cancel and the default adds nothing, so this is still the plain estimator
    q, k, v = _qkv(1, 2, 150, 16, spread=3.0, seed=8)
    k = k * torch.linspace(0.3, 1.5, 150, dtype=torch.float64)[:, None]
    w = draw_favor_projection(64, 16, seed=0, dtype=torch.float64)
    torch.testing.assert_close(favor_attention(q, k, v, projection=w, causal=causal),
                               _explicit_favor(q, k, v, w, causal), atol=1e-10, rtol=1e-8)


def test_favor_projection_gives_unbiased_softmax_kernel_features():
    # draw_favor_projection's rows must have the distribution that makes positive random features
    # unbiased: with φ(x) = exp(ωx − |x|²/2)/√m built here from its ω, φ(x)·φ(y) is a Monte Carlo
    # mean whose expectation is exp(x·y); with m = 50k the estimate sits within a few percent
    # (rows of the wrong norm would bias it)
    g = torch.Generator().manual_seed(5)
    x = 0.2 * torch.randn(6, 8, generator=g, dtype=torch.float64)
    y = 0.2 * torch.randn(6, 8, generator=g, dtype=torch.float64)
    m = 50_000
    w = draw_favor_projection(m, 8, seed=0, dtype=torch.float64)
    fx = torch.exp(x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True)) / math.sqrt(m)
    fy = torch.exp(y @ w.T - 0.5 * (y * y).sum(-1, keepdim=True)) / math.sqrt(m)
    torch.testing.assert_close(fx @ fy.T, torch.exp(x @ y.T), rtol=0.05, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_favor_error_decreases_with_features(oracle, causal):
    q, k, v = _qkv(1, 2, 64, 16, spread=0.5, seed=6)
    exact = oracle.softmax_attention(q, k, v, causal=causal)
    errs = []
    for m in (16, 64, 256, 1024):
        errs.append(sum(_rel_err(favor_attention(q, k, v, num_features=m, seed=s, causal=causal), exact)
                        for s in range(6)) / 6)
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < errs[0] / 4, errs  # Monte Carlo: ~ 1/sqrt(m), i.e. /8 from 16 to 1024


def test_favor_is_close_to_exact_with_many_features(oracle):
    q, k, v = _qkv(1, 2, 48, 16, hk=1, spread=0.4, seed=7)
    exact = oracle.softmax_attention(q, k, v, causal=False)
    out = favor_attention(q, k, v, num_features=8192, seed=0, causal=False)
    assert _rel_err(out, exact) < 0.02


def test_favor_is_differentiable():
    q, k, v = _qkv(1, 1, 7, 3, seed=8)
    w = draw_favor_projection(6, 3, seed=1, dtype=torch.float64)
    for causal in (False, True):
        # eps=0: the detached stabilisers cancel exactly, so autograd must equal finite differences
        assert torch.autograd.gradcheck(
            lambda a, b, c: favor_attention(a, b, c, projection=w, causal=causal, eps=0.0),
            tuple(t.clone().requires_grad_() for t in (q, k, v)),
        )


def test_favor_float32_seed_and_validation():
    q, k, v = _qkv(1, 2, 10, 8, dtype=torch.float32)
    a = favor_attention(q, k, v, num_features=32, seed=3)
    assert a.dtype == torch.float32 and a.shape == (1, 2, 10, 8)
    assert torch.equal(a, favor_attention(q, k, v, projection=draw_favor_projection(32, 8, seed=3)))
    with pytest.raises(ValueError, match="projection"):
        favor_attention(q, k, v)
    with pytest.raises(ValueError):
        favor_attention(q, k, v, projection=torch.randn(16, 4))
    for bad in (16.0, True, 0, -3):
        with pytest.raises(ValueError, match="num_features must be a whole number >= 1"):
            favor_attention(q, k, v, num_features=bad, seed=3)
    with pytest.raises(ValueError, match="seed must be a whole number"):
        favor_attention(q, k, v, num_features=32, seed=1.7)  # not truncated to 1: another seed's draw
    with pytest.raises(TypeError, match="scale must be a real number"):
        favor_attention(q, k, v, num_features=32, seed=3, scale="0.3")
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        favor_attention(q.int(), k.int(), v.int(), num_features=32, seed=3)


def test_the_backend_functions_name_what_runs(triton_backend, device, monkeypatch):
    """favor_backend / linformer_backend / dimension_entropy_backend say which code the kernel runs on these
    inputs (jobs record it): with Triton the automatic choice, causal FAVOR+ is Triton and non-causal the
    PyTorch matmuls; gradients, float64 and (for Linformer's attention kernel) head dims over 256 the
    reference."""
    from lmscope.kernels import dimension_entropy_backend, dispatch, favor_backend, linformer_backend

    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    q, k, v = (t.to(device) for t in _qkv(1, 2, 8, 16, dtype=torch.float32))
    assert favor_backend(q, k, v, causal=True) == "triton" and favor_backend(q, k, v, causal=False) == "reference"
    assert linformer_backend(q, k, v) == dimension_entropy_backend(q, k) == "triton"
    q64, k64, v64 = (t.double() for t in (q, k, v))
    assert favor_backend(q64, k64, v64) == linformer_backend(q64, k64, v64) == dimension_entropy_backend(q64, k64) \
        == "reference"
    wide = torch.zeros(1, 2, 8, 288, device=device)
    assert linformer_backend(wide, wide, wide) == "reference" and favor_backend(wide, wide, wide) == "triton"
    needs_grad = q.clone().requires_grad_()
    assert favor_backend(needs_grad, k, v) == linformer_backend(needs_grad, k, v) == "reference"
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert favor_backend(q, k, v) == linformer_backend(q, k, v) == dimension_entropy_backend(q, k) == "reference"


# ------------------------------------------------------------------ the Triton paths (interpreted on CPU)

@pytest.mark.parametrize("n", [1, 7, 77, 130])
@pytest.mark.parametrize("hk", [2, 1])
def test_favor_triton_equals_the_explicit_kernel_matrix(triton_backend, device, n, hk):
    # m = 40 features and Dv = 10 value columns: neither fills the kernel's blocks; v is a strided view
    q, k, v = (t.to(device) for t in _qkv(2, 2, n, 16, hk=hk, spread=0.8, seed=n, dtype=torch.float32))
    v = v[..., 3:13]
    w = draw_favor_projection(40, 16, seed=1, device=device)
    out = favor_attention(q, k, v, projection=w, causal=True, eps=0.0, backend=triton_backend)
    g = 2 // hk
    expected = _explicit_favor(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), w, causal=True)
    assert out.dtype == torch.float32 and out.shape == (2, 2, n, 10)
    torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-5)
    reference = favor_attention(q, k, v, projection=w, causal=True, eps=0.0, backend="reference")
    torch.testing.assert_close(out, reference, rtol=2e-4, atol=2e-5)


def test_favor_triton_bf16_matches_the_reference_on_the_same_inputs(triton_backend, device):
    q, k, v = (t.to(device) for t in _qkv(1, 4, 70, 32, hk=2, spread=0.6, seed=11, dtype=torch.bfloat16))
    w = draw_favor_projection(96, 32, seed=2, device=device)
    out = favor_attention(q, k, v, projection=w, causal=True, backend=triton_backend)
    assert out.dtype == torch.bfloat16
    reference = favor_attention(q, k, v, projection=w, causal=True, backend="reference")
    torch.testing.assert_close(out.float(), reference.float(), rtol=2e-2, atol=2e-2)  # one bf16 rounding apart
    # non-causal FAVOR+ is two matmuls (the same PyTorch code on both backends): against the explicit
    # float64 kernel matrix on the same bf16 inputs
    kx, vx = (t.repeat_interleave(2, dim=1) for t in (k, v))
    torch.testing.assert_close(
        favor_attention(q, k, v, projection=w, causal=False, eps=0.0, backend=triton_backend).double(),
        _explicit_favor(q, kx, vx, w, causal=False), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n,rows", [(7, 3), (77, 16), (130, 33)])
@pytest.mark.parametrize("hk", [2, 1])
def test_linformer_triton_equals_explicit_softmax_over_projected_keys(triton_backend, oracle, device, n, rows, hk):
    q, k, v = (t.to(device) for t in _qkv(2, 2, n, 16, hk=hk, spread=0.7, seed=n, dtype=torch.float32))
    e, f = draw_linformer_projections(rows, n, seed=rows, device=device)
    out = linformer_attention(q, k, v, e, f, backend=triton_backend)
    kp, vp = e.double() @ k.double(), f.double() @ v.double()  # [B, H_kv, rows, D]
    expected = oracle.softmax_attention(q.double(), kp, vp, causal=False)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    # per-head projections [H, rows, N] (indexed by query head, also with grouped-query k, v)
    e2, f2 = torch.stack([e, e.flip(0)]), torch.stack([f, f.flip(0)])
    group = q.shape[1] // k.shape[1]  # query head h reads kv head h // group, projected by E_h, F_h
    kv = [(k[:, h // group:h // group + 1].double(), v[:, h // group:h // group + 1].double()) for h in range(q.shape[1])]
    per_head = [oracle.softmax_attention(q[:, h:h + 1].double(), e2[h].double() @ kh, f2[h].double() @ vh, causal=False)
                for h, (kh, vh) in enumerate(kv)]
    for backend in (triton_backend, "reference"):
        out2 = linformer_attention(q, k, v, e2, f2, backend=backend)
        torch.testing.assert_close(out2.double(), torch.cat(per_head, 1), rtol=1e-4, atol=1e-5)


def test_linformer_triton_bf16_attends_in_bf16_and_matches_the_reference(triton_backend, oracle, device):
    q, k, v = (t.to(device) for t in _qkv(1, 4, 90, 32, hk=2, spread=0.6, seed=5, dtype=torch.bfloat16))
    e, f = draw_linformer_projections(24, 90, seed=3, device=device)
    out = linformer_attention(q, k, v, e, f, backend=triton_backend)
    assert out.dtype == torch.bfloat16
    # the Triton path rounds the projected keys and values to bf16 once before attending
    kp, vp = (e.double() @ k.double()).bfloat16(), (f.double() @ v.double()).bfloat16()
    expected = oracle.softmax_attention(q.double(), kp.double(), vp.double(), causal=False)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), linformer_attention(q, k, v, e, f, backend="reference").float(),
                               rtol=3e-2, atol=3e-2)


def test_linformer_triton_with_identity_projections_is_exact_attention(triton_backend, oracle, device):
    q, k, v = (t.to(device) for t in _qkv(1, 2, 45, 32, spread=0.9, seed=12, dtype=torch.float32))
    eye = torch.eye(45, device=device)
    out = linformer_attention(q, k, v, eye, eye, backend=triton_backend)
    torch.testing.assert_close(out.double(), oracle.softmax_attention(q, k, v, causal=False), rtol=1e-4, atol=1e-5)


def test_the_triton_paths_leave_gradients_to_the_reference(triton_backend, device, monkeypatch):
    q, k, v = (t.to(device) for t in _qkv(1, 2, 9, 16, dtype=torch.float32))
    w = draw_favor_projection(20, 16, seed=0, device=device)
    e, f = draw_linformer_projections(4, 9, seed=0, device=device)
    grads = tuple(t.clone().requires_grad_() for t in (q, k, v))
    # asked for explicitly, Triton refuses tensors that need gradients rather than drop them
    with pytest.raises(ValueError, match="no autograd"):
        favor_attention(*grads, projection=w, causal=True, backend="triton")
    with pytest.raises(ValueError, match="no autograd"):
        linformer_attention(*grads, e, f, backend="triton")
    with pytest.raises(ValueError, match="float64"):
        favor_attention(q.double(), k.double(), v.double(), projection=w, backend="triton")
    with pytest.raises(ValueError, match="no autograd"):
        attention_with_entropy(*grads, backend="triton")
    with pytest.raises(ValueError, match="no autograd"):
        dimension_entropy(grads[0], grads[1], backend="triton")
    # chosen automatically (here forced to Triton as on a GPU), training still gets its gradients
    monkeypatch.setenv("LMSCOPE_KERNEL_BACKEND", "triton")
    res = attention_with_entropy(*grads)
    out = (favor_attention(*grads, projection=w, causal=True) + linformer_attention(*grads, e, f) + res.out
           + dimension_entropy(grads[0], grads[1]).sum(2, keepdim=True).transpose(2, 3))
    assert res.backend == "reference"
    out.sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in grads)


def test_linformer_on_head_dims_its_triton_attention_cannot_take_runs_the_reference(triton_backend, oracle,
                                                                                     device, monkeypatch):
    """Linformer attends over the projected keys with attention_with_entropy's kernel (head dims up to
    256): a model with head_dim 288 on a GPU gets the reference from the automatic choice, as the exact side."""
    from lmscope.kernels import dispatch

    q, k, v = (t.to(device) for t in _qkv(1, 2, 12, 288, spread=0.3, seed=4, dtype=torch.float32))
    e, f = draw_linformer_projections(4, 12, seed=1, device=device)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")  # what the automatic choice is on a GPU
    out = linformer_attention(q, k, v, e, f)
    expected = oracle.softmax_attention(q.double(), (e.double() @ k.double()), (f.double() @ v.double()), causal=False)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="head dims up to 256.*backend='reference'"):
        linformer_attention(q, k, v, e, f, backend=triton_backend)
