"""dimension_entropy: both backends against per-dimension float64 matrices."""

from __future__ import annotations

import math

import pytest
import torch

from lmscope.kernels import dimension_entropy
from tests.kernels.conftest import close_in_float64 as _close


def _qk(b, h, hk, n, d, *, device, dtype=torch.float32, seed=0, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    q = spread * torch.randn(b, h, n, d, generator=g)
    k = spread * torch.randn(b, hk, n, d, generator=g)
    return q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 7, 77, 130])
def test_matches_float64_oracle(backend, device, oracle, n, causal):
    q, k = _qk(1, 2, 2, n, 16, device=device, seed=n)
    ent = dimension_entropy(q, k, causal=causal, backend=backend)
    assert ent.shape == (1, 2, 16, n) and ent.dtype == torch.float32
    _close(ent, oracle.dimension(q, k, causal=causal), atol=2e-5)


def test_grouped_query_and_scale(backend, device, oracle):
    q, k = _qk(2, 4, 1, 40, 16, device=device, seed=1)
    ent = dimension_entropy(q, k, causal=True, scale=0.7, backend=backend)
    _close(ent, oracle.dimension(q, k, causal=True, scale=0.7), atol=2e-5)


def test_bfloat16_inputs(backend, device, oracle):
    q, k = _qk(1, 2, 2, 50, 16, device=device, dtype=torch.bfloat16, seed=2)
    ent = dimension_entropy(q, k, causal=False, backend=backend)
    assert ent.dtype == torch.float32
    _close(ent, oracle.dimension(q, k, causal=False), atol=1e-4)


@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_head_dims(triton_backend, device, oracle, d):
    q, k = _qk(1, 1, 1, 9, d, device=device, seed=d)
    _close(dimension_entropy(q, k, causal=True, backend=triton_backend), oracle.dimension(q, k, causal=True), 2e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_zero_query_dimensions_are_uniform(backend, device, causal):
    # a dimension where q is 0 scores every key equally: entropy = ln(number of visible keys)
    n = 37
    q, k = _qk(1, 2, 2, n, 16, device=device, seed=3)
    q[..., 5] = 0.0
    ent = dimension_entropy(q, k, causal=causal, backend=backend)
    visible = torch.arange(1, n + 1, dtype=torch.float64) if causal else torch.full((n,), float(n), dtype=torch.float64)
    _close(ent[:, :, 5], torch.log(visible).expand(1, 2, n), atol=2e-5)
    assert (ent[:, :, [i for i in range(16) if i != 5]] < math.log(n) + 1e-5).all()


def test_peaked_dimension_has_near_zero_entropy(backend, device):
    # one key is far larger than the others in dimension 0: rows with positive q pick it
    n = 20
    q = torch.ones(1, 1, n, 4, device=device) * 10.0
    k = torch.zeros(1, 1, n, 4, device=device)
    k[0, 0, 3, 0] = 30.0  # score 10*30/2 = 150 nats above the rest
    ent = dimension_entropy(q, k, causal=False, backend=backend)
    assert ent[0, 0, 0].abs().max() < 1e-6
    _close(ent[0, 0, 1], torch.full((n,), math.log(n), dtype=torch.float64), atol=2e-5)


@pytest.mark.parametrize("n", [20, 70])
def test_a_late_large_key_leaves_the_earlier_causal_rows_uniform(backend, device, n):
    """Causal rows shift their scores by the largest key they see, not the largest of all: a key far
    above the others at the last position is invisible to every earlier row, which stays uniform
    (entropy ln(t + 1)); shifted by it, exp underflows and those rows read 0."""
    q = torch.ones(1, 1, n, 4, device=device)
    k = torch.zeros(1, 1, n, 4, device=device)
    k[0, 0, -1, 0] = 500.0
    ent = dimension_entropy(q, k, causal=True, scale=1.0, backend=backend)
    uniform = torch.log(torch.arange(1, n + 1, dtype=torch.float64))
    _close(ent[0, 0, 0, :-1], uniform[:-1], atol=2e-5)
    assert ent[0, 0, 0, -1].abs() < 1e-6  # the last row sees the key and picks it
    _close(ent[0, 0, 1], uniform, atol=2e-5)  # a dimension where every key is 0


def _entropy_per_dimension_float64(q, k, *, causal):
    """[B, H, D, N] float64, differentiable: for each dimension i, S_i = scale · q_i k_iᵀ (rank 1), the
    visible keys' p = exp(S_i − logsumexp), entropy −Σ p ln p over them. Masked entries never enter a
    product (torch.where on finite values), so the gradient there is 0, not NaN."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    n, d = q.shape[2], q.shape[3]
    allowed = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    rows = []
    for i in range(d):
        s = q[..., i, None] * k[..., None, :, i] / math.sqrt(d)  # [B, H, N, N]
        lse = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), dim=-1, keepdim=True)
        log_p = torch.where(allowed, s - lse, 0.0)
        p = torch.where(allowed, log_p.exp(), 0.0)
        rows.append(-(p * log_p).sum(-1))
    return torch.stack(rows, dim=2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["reference", None], ids=["reference", "automatic-as-on-a-gpu"])
def test_reference_gradients(device, monkeypatch, backend, causal):
    """The gradients of a weighted sum of the entropies w.r.t. q and k (GQA: k is shared by two heads)
    are float64 autograd's through the explicit per-dimension matrices, finite at the masked entries,
    whether asked for by name or chosen automatically (Triton on a GPU, which hands tensors that need
    gradients to the reference)."""
    from lmscope.kernels import dispatch

    monkeypatch.setenv(dispatch.ENV_VAR, "triton")  # the automatic choice on a GPU; backend="reference" wins
    q, k = _qk(1, 2, 1, 9, 4, device=device, seed=21)
    # a peaked row: scores ~20·k spread over > 100 nats, so most of its p underflow to 0 in float32 (and
    # the causal row 0 sees one key: entropy 0 whatever q and k)
    q[0, 0, 6] = 40.0
    w = torch.rand(1, 2, 4, 9, generator=torch.Generator().manual_seed(0)).to(device)
    params = [t.clone().requires_grad_() for t in (q, k)]
    ent = dimension_entropy(*params, causal=causal, backend=backend)
    (ent * w).sum().backward()

    p64 = [t.double().clone().requires_grad_() for t in (q, k)]
    ent64 = _entropy_per_dimension_float64(*p64, causal=causal)
    (ent64 * w.double()).sum().backward()
    assert ent64[0, 0, :, 6].max() < 0.25  # the row is peaked in every dimension (uniform: ln 7 ≈ 1.95)
    _close(ent, ent64.detach(), atol=2e-5)
    # The reference computes in float32 (whatever the input): gradients up to ~2.5 here, off float64 by
    # at most 4e-7 (measured); 1e-5 + 1e-5·|g| leaves 20x room for other float32 roundings and stays far
    # below what a wrong mask, scale or head grouping gives (≥ 1e-3).
    for got, want in zip(params, p64):
        assert torch.isfinite(got.grad).all()
        _close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


def test_float64_runs_on_the_reference_unless_triton_is_asked_for(triton_backend, device, oracle, monkeypatch):
    """The automatic choice (Triton, as on a GPU) runs what the Triton kernel cannot take on the reference."""
    from lmscope.kernels import dispatch

    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    q, k = _qk(1, 2, 1, 9, 16, device=device, dtype=torch.float64)
    _close(dimension_entropy(q, k, causal=True), oracle.dimension(q, k, causal=True), 1e-5)
    with pytest.raises(ValueError, match="float64; use backend='reference'"):
        dimension_entropy(q, k, causal=True, backend=triton_backend)


def test_validation_errors(device):
    q, k = _qk(1, 2, 2, 8, 16, device=device)
    with pytest.raises(ValueError):
        dimension_entropy(q, k[:, :, :5])
    with pytest.raises(ValueError):
        dimension_entropy(q, k[..., :8])
    with pytest.raises(ValueError, match="multiple"):
        dimension_entropy(torch.cat([q, q[:, :1]], 1), k)


@pytest.mark.parametrize("block_rows", [1, 4, 11])
@pytest.mark.parametrize("causal", [True, False])
def test_reference_in_blocks_of_query_rows(device, oracle, block_rows, causal):
    """The reference's blocks of rows (each causal block over only the keys its rows see) and of dimensions
    (a chunk of 3 does not divide D = 16) against the float64 oracle."""
    from lmscope.kernels.dimension_entropy.naive import dimension_entropy_reference

    q, k = _qk(2, 4, 2, 29, 16, device=device, seed=7)
    ent = dimension_entropy_reference(q, k, causal=causal, chunk=3, block_rows=block_rows)
    _close(ent, oracle.dimension(q, k, causal=causal), atol=2e-5)


def test_reference_splits_by_its_score_budget(device, oracle, monkeypatch):
    """Without ``block_rows``, blocks of about SCORES_PER_BLOCK scores: 2 rows of a 3-dimension chunk here."""
    import importlib

    from lmscope.kernels.attention_entropy import naive

    dimension_naive = importlib.import_module("lmscope.kernels.dimension_entropy.naive")  # the package's name is the function's
    q, k = _qk(1, 2, 1, 13, 6, device=device, seed=8)
    monkeypatch.setitem(naive.SCORES_PER_BLOCK, q.device.type, 2 * 2 * 3 * 13)
    blocks = []
    real = naive.softmax_entropy

    def counting(s, allowed):
        blocks.append(tuple(s.shape[-3:-1]))
        return real(s, allowed)

    monkeypatch.setattr(dimension_naive, "softmax_entropy", counting)
    ent = dimension_naive.dimension_entropy_reference(q, k, causal=True, chunk=3)
    assert sorted(set(blocks)) == [(3, 1), (3, 2)] and len(blocks) == 2 * 7
    _close(ent, oracle.dimension(q, k, causal=True), atol=2e-5)
