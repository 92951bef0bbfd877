"""attention_with_entropy: both backends against a float64 oracle from the explicit matrix."""

from __future__ import annotations

import math

import pytest
import torch

from lmscope.kernels import AttentionEntropy, attention_with_entropy
from tests.kernels.conftest import close_in_float64 as _close


def _qkv(b, h, hk, n, d, *, device, dtype=torch.float32, seed=0, nk=None, dv=None):
    g = torch.Generator().manual_seed(seed)
    nk = n if nk is None else nk
    dv = d if dv is None else dv
    q = torch.randn(b, h, n, d, generator=g)
    k = torch.randn(b, hk, nk, d, generator=g)
    v = torch.randn(b, hk, nk, dv, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def _check_against(res, ref, atol=2e-5):
    out, ent, lse, _ = ref
    _close(res.out, out, atol)
    _close(res.entropy, ent, atol)
    _close(res.lse, lse, atol)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 7, 77, 130])
def test_matches_float64_oracle(backend, device, oracle, n, causal):
    q, k, v = _qkv(1, 2, 2, n, 32, device=device)
    res = attention_with_entropy(q, k, v, causal=causal, backend=backend)
    assert isinstance(res, AttentionEntropy) and res.backend == backend
    out, ent, lse = res  # unpacks as a triple
    assert out is res.out and ent is res.entropy and lse is res.lse
    assert res.out.shape == (1, 2, n, 32) and res.out.dtype == torch.float32
    assert res.entropy.shape == (1, 2, n) and res.entropy.dtype == torch.float32
    assert res.lse.shape == (1, 2, n) and res.lse.dtype == torch.float32
    _check_against(res, oracle.attention(q, k, v, causal=causal))
    if causal:  # the first query sees one key: a one-point distribution
        assert res.entropy[..., 0].abs().max() < 1e-6


@pytest.mark.parametrize("hk", [1, 2])
def test_grouped_query_attention(backend, device, oracle, hk):
    q, k, v = _qkv(2, 4, hk, 33, 16, device=device, seed=1)
    res = attention_with_entropy(q, k, v, causal=True, scale=0.3, backend=backend)
    _check_against(res, oracle.attention(q, k, v, causal=True, scale=0.3))


@pytest.mark.parametrize("scale", [-0.4, 0.0, 2.5])
def test_any_scale(backend, device, oracle, scale):
    """A negative scale (attention to the least similar keys), zero (uniform rows) or a large one: the
    kernel scales each row's max of the raw scores, which it may only do for a positive scale."""
    q, k, v = _qkv(1, 2, 2, 45, 16, device=device, seed=3)
    for causal in (True, False):
        res = attention_with_entropy(q, k, v, causal=causal, scale=scale, backend=backend)
        _check_against(res, oracle.attention(q, k, v, causal=causal, scale=scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(backend, device, oracle, dtype):
    # the oracle sees exactly the rounded inputs the kernel sees
    q, k, v = _qkv(1, 2, 1, 77, 32, device=device, dtype=dtype, seed=2)
    res = attention_with_entropy(q, k, v, causal=True, backend=backend)
    assert res.out.dtype == dtype and res.entropy.dtype == torch.float32 and res.lse.dtype == torch.float32
    out, ent, lse, _ = oracle.attention(q, k, v, causal=True)
    # output rounded to 8 (bf16) / 11 (fp16) bits, and on a GPU P rounded to them before P @ V
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    _close(res.out, out, atol=tol, rtol=tol / 2)
    _close(res.entropy, ent, atol=1e-4)  # fp32 accumulation
    _close(res.lse, lse, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(triton_backend, device, dtype):
    q, k, v = _qkv(2, 4, 2, 70, 64, device=device, dtype=dtype, seed=3)
    kpm = torch.rand(2, 70, generator=torch.Generator().manual_seed(0)) > 0.2
    kpm = kpm.to(device)
    a = attention_with_entropy(q, k, v, causal=True, key_padding_mask=kpm, backend="triton")
    r = attention_with_entropy(q, k, v, causal=True, key_padding_mask=kpm, backend="reference")
    assert a.backend == "triton" and r.backend == "reference"
    _close(a.out, r.out, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    _close(a.entropy, r.entropy, atol=1e-4)
    _close(a.lse, r.lse, atol=1e-4)


def _padding_masks(device):
    m = torch.ones(4, 40, dtype=torch.bool)
    m[1, 29:] = False  # right padding
    m[2, :11] = False  # left padding: under causal the first 11 queries see no key at all
    m[2, 20:23] = False
    m[3, ::3] = False  # holes
    return m.to(device)


@pytest.mark.parametrize("causal", [True, False])
def test_key_padding_mask(backend, device, oracle, causal):
    q, k, v = _qkv(4, 2, 2, 40, 32, device=device, seed=4)
    kpm = _padding_masks(device)
    res = attention_with_entropy(q, k, v, causal=causal, key_padding_mask=kpm, backend=backend)
    out, ent, lse, _ = oracle.attention(q, k, v, causal=causal, key_padding_mask=kpm)
    _check_against(res, (out, ent, lse, None))
    if causal:  # the defined result for rows with no visible key
        assert torch.all(res.out[2, :, :11] == 0)
        assert torch.all(res.entropy[2, :, :11] == 0)
        assert torch.all(torch.isneginf(res.lse[2, :, :11]))
        assert torch.isfinite(res.lse[2, :, 11:]).all()


def test_fully_padded_sequence(backend, device):
    q, k, v = _qkv(2, 1, 1, 20, 16, device=device, seed=5)
    kpm = torch.ones(2, 20, dtype=torch.bool, device=device)
    kpm[1] = False
    res = attention_with_entropy(q, k, v, causal=False, key_padding_mask=kpm, backend=backend)
    assert torch.all(res.out[1] == 0) and torch.all(res.entropy[1] == 0)
    assert torch.all(torch.isneginf(res.lse[1]))
    assert not torch.isnan(res.out).any() and not torch.isnan(res.entropy).any()
    assert torch.isfinite(res.entropy[0]).all() and (res.entropy[0] > 0).all()


@pytest.mark.parametrize("how", ["zero_queries", "identical_keys"])
@pytest.mark.parametrize("causal", [True, False])
def test_equal_scores_give_log_of_visible_keys(backend, device, oracle, causal, how):
    n = 40
    q, k, v = _qkv(4, 2, 2, n, 32, device=device, seed=6)
    if how == "zero_queries":
        q = torch.zeros_like(q)
    else:  # every key the same vector: each row's scores are equal but not zero
        k = k[:, :, :1].expand_as(k).contiguous()
    kpm = _padding_masks(device)
    res = attention_with_entropy(q, k, v, causal=causal, key_padding_mask=kpm, backend=backend)
    visible = oracle.allowed(n, n, causal, kpm, device).sum(-1).expand(4, 2, n).double()
    expected = torch.where(visible > 0, torch.log(visible.clamp(min=1)), torch.zeros_like(visible))
    _close(res.entropy, expected, atol=2e-5)
    # and the output is the plain mean of the visible values
    _close(res.out, oracle.attention(q, k, v, causal=causal, key_padding_mask=kpm)[0], atol=2e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_one_hot_rows_have_zero_entropy(backend, device, causal):
    n, d = 24, 32
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(7))
    if causal:
        perm = torch.arange(n)  # query i picks key i, which it can see
    k = 20.0 * torch.eye(d)[:n]  # key j = 20 e_j
    q = k[perm]  # query i aligned with key perm[i]: score 400/sqrt(32) ~ 71 vs 0 for the rest
    v = torch.randn(n, d, generator=torch.Generator().manual_seed(8))
    q, k, v = (t.view(1, 1, n, d).to(device) for t in (q, k, v))
    res = attention_with_entropy(q, k, v, causal=causal, backend=backend)
    assert res.entropy.min() >= -1e-6
    assert res.entropy.max() <= 1e-5
    _close(res.out[0, 0], v[0, 0][perm], atol=1e-5)
    _close(res.lse[0, 0], torch.full((n,), 400 / math.sqrt(d), dtype=torch.float64), atol=1e-4)


@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_head_dims(triton_backend, device, oracle, d):
    q, k, v = _qkv(1, 2, 1, 19, d, device=device, seed=9)
    res = attention_with_entropy(q, k, v, causal=True, backend=triton_backend)
    _check_against(res, oracle.attention(q, k, v, causal=True))


def test_value_dim_differs_from_key_dim(backend, device, oracle):
    q, k, v = _qkv(1, 2, 2, 21, 32, device=device, seed=10, dv=16)
    res = attention_with_entropy(q, k, v, causal=True, backend=backend)
    assert res.out.shape == (1, 2, 21, 16)
    _check_against(res, oracle.attention(q, k, v, causal=True))


@pytest.mark.parametrize("nq,nk", [(5, 37), (40, 9)])
def test_query_and_key_lengths_differ(backend, device, oracle, nq, nk):
    # causal is aligned bottom-right (KV-cache style); with nq > nk the first rows see nothing
    q, k, v = _qkv(1, 2, 2, nq, 16, device=device, seed=11, nk=nk)
    for causal in (True, False):
        res = attention_with_entropy(q, k, v, causal=causal, backend=backend)
        _check_against(res, oracle.attention(q, k, v, causal=causal))


def test_non_contiguous_inputs(backend, device, oracle):
    # transformers hands over [B, N, H, D] tensors transposed to [B, H, N, D]
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 35, 4, 16, generator=g).to(device).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    res = attention_with_entropy(q, k, v, causal=True, backend=backend)
    _check_against(res, oracle.attention(q, k, v, causal=True))


@pytest.mark.parametrize("softcap", [0.5, 4.0, 50.0])
def test_soft_capped_scores(backend, device, oracle, softcap):
    """Gemma 2's cap: scores s become c·tanh(s/c). Scaled-up queries make the cap bite (checked)."""
    q, k, v = _qkv(2, 4, 2, 45, 32, device=device, seed=14)
    q = 8.0 * q  # raw scores of tens: c = 4 squashes them, c = 50 nearly leaves them alone
    kpm = torch.ones(2, 45, dtype=torch.bool, device=device)
    kpm[1, :6] = False
    for causal in (True, False):
        res = attention_with_entropy(q, k, v, causal=causal, key_padding_mask=kpm, softcap=softcap, backend=backend)
        want = oracle.attention(q, k, v, causal=causal, key_padding_mask=kpm, softcap=softcap)
        _check_against(res, want, atol=5e-5)
        uncapped = oracle.attention(q, k, v, causal=causal, key_padding_mask=kpm)
        assert (want[1] - uncapped[1]).abs().max() > 1e-3  # the cap changed the entropies
        # capped scores lie in (-c, c): every row's entropy is at least ln(visible) - 2c, a bound that holds
        # apart from the oracle (above zero only for a small cap)
        if causal and 2 * softcap < math.log(45):
            visible = oracle.allowed(45, 45, True, kpm, device).sum(-1).expand(2, 4, 45).double()
            seen = visible > 0
            assert (res.entropy.double()[seen] >= torch.log(visible[seen]) - 2 * softcap - 1e-5).all()


@pytest.mark.parametrize("nq,nk", [(50, 50), (7, 77), (77, 40), (1, 130)])
@pytest.mark.parametrize("window", [1, 5, 16, 33, 200])
def test_sliding_window(backend, device, oracle, nq, nk, window):
    """Query i sees the `window` keys ending at i + Nk - Nq: windows shorter and longer than a block,
    at block edges (16, 33 with 32-wide blocks), KV-cache and nq > nk alignments, with key padding."""
    q, k, v = _qkv(2, 2, 1, nq, 16, device=device, seed=15, nk=nk)
    kpm = torch.rand(2, nk, generator=torch.Generator().manual_seed(window)).to(device) > 0.25
    res = attention_with_entropy(q, k, v, causal=True, key_padding_mask=kpm, window=window, backend=backend)
    _check_against(res, oracle.attention(q, k, v, causal=True, key_padding_mask=kpm, window=window))
    # with equal scores every row sees exactly its window's unpadded keys: entropy = ln(that count)
    res = attention_with_entropy(torch.zeros_like(q), k, v, causal=True, key_padding_mask=kpm, window=window,
                                 backend=backend)
    visible = oracle.allowed(nq, nk, True, kpm, device, window).sum(-1).expand(2, 2, nq).double()
    _close(res.entropy, torch.where(visible > 0, torch.log(visible.clamp(min=1)), 0.0), atol=2e-5)


@pytest.mark.parametrize("nq,nk", [(80, 80), (30, 80)])
def test_every_window_length_at_the_default_tile(triton_backend, device, oracle, nq, nk):
    """Every window length from 1 to Nk at the 32 × 32 tile: a row's window then starts at every offset
    inside a key block (its last key included), and a key block is inside every row's window of a query
    block or only some of them at every boundary. A fixed grid of lengths let two block bounds written
    one off pass."""
    q, k, v = _qkv(1, 2, 1, nq, 16, device=device, seed=21, nk=nk)
    for window in range(1, nk + 1):
        res = attention_with_entropy(q, k, v, causal=True, window=window, backend=triton_backend)
        out, ent, lse, _ = oracle.attention(q, k, v, causal=True, window=window)
        _close(res.out, out, atol=2e-5)
        _close(res.entropy, ent, atol=2e-5)
        _close(res.lse, lse, atol=2e-5)


def test_window_and_cap_together_in_low_precision(backend, device, oracle):
    q, k, v = _qkv(1, 4, 2, 70, 64, device=device, dtype=torch.bfloat16, seed=16)
    res = attention_with_entropy(4 * q, k, v, causal=True, softcap=3.0, window=20, backend=backend)
    assert res.out.dtype == torch.bfloat16
    want = oracle.attention(4 * q, k, v, causal=True, softcap=3.0, window=20)
    _close(res.entropy, want[1], atol=2e-4)
    _close(res.lse, want[2], atol=2e-4)
    _close(res.out, want[0], atol=2e-2)  # the output is rounded to bfloat16


def test_reference_gradients(device):
    q, k, v = _qkv(2, 2, 1, 17, 8, device=device, seed=13)
    kpm = torch.ones(2, 17, dtype=torch.bool, device=device)
    kpm[1, :3] = False  # queries 0-2 of sequence 1 see no key under causal
    params = [t.clone().requires_grad_() for t in (q, k, v)]
    w_out = torch.randn(2, 2, 17, 8, generator=torch.Generator().manual_seed(0)).to(device)
    res = attention_with_entropy(*params, causal=True, key_padding_mask=kpm, backend="reference")
    (res.out * w_out).sum().add(res.entropy.sum()).backward()
    grads = [p.grad for p in params]
    assert all(torch.isfinite(g_).all() for g_ in grads)

    # float64 autograd through an independent formula: H = lse - sum_j p_j s_j over visible keys
    p64 = [t.double().clone().requires_grad_() for t in (q, k, v)]
    qq, kk, vv = p64[0], p64[1].repeat_interleave(2, 1), p64[2].repeat_interleave(2, 1)
    s = qq @ kk.transpose(-1, -2) / math.sqrt(8)
    allowed = torch.ones(17, 17, dtype=torch.bool, device=device).tril()[None, None] & kpm[:, None, None, :]
    rows = allowed.any(-1)
    s_m = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s_m.masked_fill(~rows[..., None], 0.0), dim=-1)
    p = torch.softmax(s_m.masked_fill(~rows[..., None], 0.0), dim=-1) * allowed
    ent = torch.where(rows, lse - (p * s.masked_fill(~allowed, 0.0)).sum(-1), torch.zeros_like(lse))
    out = p @ vv
    (out * w_out.double()).sum().add(ent.sum()).backward()
    for got, want in zip(grads, p64):
        _close(got, want.grad, atol=1e-4, rtol=1e-4)


def test_validation_errors(device):
    q, k, v = _qkv(1, 3, 2, 8, 16, device=device)
    with pytest.raises(ValueError, match="multiple"):
        attention_with_entropy(q, k, v)
    q, k, v = _qkv(1, 2, 2, 8, 16, device=device)
    with pytest.raises(ValueError, match="head dims"):
        attention_with_entropy(q, k[..., :8], v)
    with pytest.raises(ValueError, match="B, H, N, D"):
        attention_with_entropy(q[0], k, v)
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention_with_entropy(q, k, v, key_padding_mask=torch.ones(1, 7, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="bool"):
        attention_with_entropy(q, k, v, key_padding_mask=torch.ones(1, 8, device=device))
    with pytest.raises(ValueError, match="backend"):
        attention_with_entropy(q, k, v, backend="cuda")
    for cap in (0, -1.0, float("inf"), float("nan"), "3", True):
        with pytest.raises(ValueError, match="softcap must be a positive finite number"):
            attention_with_entropy(q, k, v, softcap=cap)
    for window in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="window must be a whole number"):
            attention_with_entropy(q, k, v, window=window)
    with pytest.raises(ValueError, match="sliding window needs causal=True"):
        attention_with_entropy(q, k, v, causal=False, window=4)


def test_inputs_that_cannot_be_attention_are_refused(device):
    """A scale that is not a finite number makes every score NaN or ±inf; integer inputs and a head
    dim of 0 have no softmax: each is a clear error on either backend, not rows of NaN."""
    q, k, v = _qkv(1, 2, 2, 8, 16, device=device)
    for bad in (float("inf"), float("nan"), -float("inf")):
        with pytest.raises(ValueError, match="scale must be finite"):
            attention_with_entropy(q, k, v, scale=bad)
    for bad in ("0.3", True, [0.3]):
        with pytest.raises(TypeError, match="scale must be a real number"):
            attention_with_entropy(q, k, v, scale=bad)
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        attention_with_entropy(q.long(), k.long(), v.long())
    import numpy as np  # a numpy scalar is a number like any other

    torch.testing.assert_close(attention_with_entropy(q, k, v, scale=np.float32(0.25)).out,
                               attention_with_entropy(q, k, v, scale=0.25).out)
    with pytest.raises(ValueError, match="head dim 0"):
        attention_with_entropy(q[..., :0], k[..., :0], v)


def test_a_nan_score_gives_a_nan_row_not_an_empty_one(backend, device, oracle):
    """A NaN in q (an fp16 overflow upstream) poisons its row's scores: entropy and lse are NaN, as in the
    oracle, and not 0 / -inf, which would read as a row with no visible key. Other rows are untouched."""
    q, k, v = _qkv(1, 2, 2, 9, 16, device=device, seed=4)
    q[0, 0, 3, 5] = float("nan")
    k[0, 1, 6, 0] = float("nan")  # key 6: rows 6.. of head 1 see it (causal), rows 0..5 do not
    res = attention_with_entropy(q, k, v, causal=True, backend=backend)
    nan = torch.zeros(1, 2, 9, dtype=torch.bool)
    nan[0, 0, 3] = True
    nan[0, 1, 6:] = True
    assert torch.equal(res.entropy.isnan().cpu(), nan) and torch.equal(res.lse.isnan().cpu(), nan)
    assert torch.equal(res.out.isnan().any(-1).cpu(), nan)
    _, want, _, _ = oracle.attention(q, k, v, causal=True)
    _close(res.entropy.cpu()[~nan], want.cpu()[~nan], atol=2e-5)


def test_automatic_choice_runs_what_triton_cannot_take_on_the_reference(triton_backend, device, oracle, monkeypatch):
    """A model with head_dim 512 (or float64 inputs) on a GPU: the automatic choice is Triton, which
    cannot take them; the reference runs them and says so. Asked for by name, Triton refuses."""
    from lmscope.kernels import dispatch

    monkeypatch.setenv(dispatch.ENV_VAR, "triton")  # what the automatic choice is on a GPU
    for dtype, d in ((torch.float32, 288), (torch.float64, 16)):
        q, k, v = _qkv(1, 2, 1, 9, d, device=device, dtype=dtype, seed=3)
        res = attention_with_entropy(q, k, v, causal=True)
        assert res.backend == "reference"
        _check_against(res, oracle.attention(q, k, v, causal=True))
        with pytest.raises(ValueError, match="backend='reference'"):
            attention_with_entropy(q, k, v, causal=True, backend=triton_backend)


def test_triton_rejects_float64(triton_backend, device):
    q, k, v = _qkv(1, 1, 1, 8, 16, device=device, dtype=torch.float64)
    with pytest.raises(ValueError, match="reference"):
        attention_with_entropy(q, k, v, backend=triton_backend)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_triton_path_under_torch_compile(triton_backend, device, oracle, compiler):
    """transformers compiles the forward pass for generation with a static cache: the Triton launch
    must survive Dynamo and Inductor (as one opaque operator) with the float64 results, padding mask
    and window included. (Graph breaks are allowed, as in transformers: dispatch reads the environment.)"""
    torch._dynamo.reset()
    q, k, v = _qkv(2, 4, 2, 45, 32, device=device, seed=4)
    kpm = torch.ones(2, 45, dtype=torch.bool, device=device)
    kpm[1, :6] = False

    def attend(q, k, v, kpm):
        res = attention_with_entropy(q, k, v, causal=True, key_padding_mask=kpm, window=20, backend="triton")
        return res.out, res.entropy, res.lse

    compiled = torch.compile(attend, backend=compiler)
    out, ent, lse = compiled(q, k, v, kpm)
    ref_out, ref_ent, ref_lse, _ = oracle.attention(q, k, v, causal=True, key_padding_mask=kpm, window=20)
    _close(out, ref_out, 2e-5)
    _close(ent, ref_ent, 2e-5)
    _close(lse, ref_lse, 2e-5)


def test_triton_output_is_laid_out_heads_last(triton_backend, device, oracle):
    """The kernel writes [B, Nq, H, Dv] and returns it as a [B, H, Nq, Dv] view, so transformers' layout
    (out.transpose(1, 2).contiguous()) costs no copy. The operator torch.compile sees keeps the contiguous
    layout its fake states (opcheck compares them with a real run), or Inductor would misread it."""
    q, k, v = _qkv(2, 4, 2, 19, 16, device=device, seed=6)
    res = attention_with_entropy(q, k, v, causal=True, backend=triton_backend)
    heads_last = res.out.transpose(1, 2)
    assert heads_last.is_contiguous() and heads_last.contiguous().data_ptr() == heads_last.data_ptr()
    _close(res.out, oracle.attention(q, k, v, causal=True)[0], 2e-5)
    torch.library.opcheck(torch.ops.lmscope.attention_with_entropy, (q, k, v, True, 0.25, None, None, None),
                          test_utils=("test_schema", "test_faketensor"))


def test_heads_last_only_while_the_rows_offsets_fit_32_bits():
    """Heads-last rows are H·Dv apart; the kernel's offsets inside a head are int32, so a buffer whose last
    row would start past 2^31 − 1 is laid out heads-first (meta tensors: the shapes without the memory)."""
    from lmscope.kernels.attention_entropy.triton_kernel import empty_output

    fits = empty_output(torch.empty(1, 32, 4096, 128, device="meta"), 128, heads_last=True)
    assert fits.transpose(1, 2).is_contiguous()
    too_long = empty_output(torch.empty(1, 32, 2**20, 128, device="meta"), 128, heads_last=True)
    assert too_long.is_contiguous() and too_long.shape == (1, 32, 2**20, 128)
    assert empty_output(torch.empty(1, 2, 8, 16, device="meta"), 16, heads_last=False).is_contiguous()
    # values wider than queries: q's head fits int32 offsets (2^24 + 1 rows of 64) but the output's does not
    # (of 128: its last element at 2^31 + 127), in either layout
    for heads_last in (True, False):
        with pytest.raises(ValueError, match="more than 2\\^31 elements; split the sequence"):
            empty_output(torch.empty(1, 1, 2**24 + 1, 64, device="meta"), 128, heads_last=heads_last)
    assert empty_output(torch.empty(1, 1, 2**24, 64, device="meta"), 128, heads_last=False).shape[2] == 2**24


def _tile_buckets():
    from lmscope.kernels.dispatch import triton_available

    if not triton_available():
        return []
    from lmscope.kernels.attention_entropy import triton_kernel

    return sorted(triton_kernel._TILES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the autotuner's tiles run compiled, on a GPU (the "
                    "interpreter runs each tile's block sizes in test_kernels_gpu_tiles.py)")
@pytest.mark.parametrize("ieee,d", _tile_buckets())
def test_every_candidate_tile_on_the_gpu_matches_the_oracle(oracle, monkeypatch, ieee, d):
    """Each (BLOCK_M, BLOCK_N, warps, stages) candidate of a bucket, forced alone: a GPU otherwise runs only
    the autotuner's pick for its shapes (or, with LMSCOPE_AUTOTUNE=0, a bucket's first), so a tile that
    compiles but computes wrongly would wait for the shapes that pick it. GQA, ragged N, causal and not."""
    from lmscope.kernels.attention_entropy import triton_kernel

    dtype = torch.float32 if ieee else torch.bfloat16
    failures = []
    try:
        for tile in list(triton_kernel._TILES[ieee, d]):
            monkeypatch.setitem(triton_kernel._TILES, (ieee, d), [tile])
            triton_kernel._kernel.cache.clear()  # the pick per shape, else kept from an earlier tile
            n = tile[0] + tile[1] + 3
            q, k, v = _qkv(1, 4, 2, n, d, device="cuda", dtype=dtype, seed=sum(tile) + d)
            for causal in (True, False):
                res = attention_with_entropy(q, k, v, causal=causal, backend="triton")
                ran = triton_kernel._kernel.best_config
                ran = (ran.kwargs["BLOCK_M"], ran.kwargs["BLOCK_N"], ran.num_warps, ran.num_stages)
                out, ent, lse, _ = oracle.attention(q, k, v, causal=causal)
                tol = 2e-5 if ieee else 2e-2  # a bfloat16 output is rounded to bfloat16
                errors = [(res.out.double().cpu() - out.cpu()).abs().max().item() / tol,
                          (res.entropy.double().cpu() - ent.cpu()).abs().max().item() / 1e-4,
                          (res.lse.double().cpu() - lse.cpu()).abs().max().item() / 1e-4]
                if ran != tile or max(errors) > 1:
                    failures.append(f"{dtype} D={d} tile {tile} (ran {ran}) causal={causal}: "
                                    f"errors / tolerance (out, entropy, lse) {[round(e, 2) for e in errors]}")
    finally:  # the later tests' shapes pick from the whole bucket again
        triton_kernel._kernel.cache.clear()
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- the reference's blocks of query rows

@pytest.mark.parametrize("block_rows", [1, 3, 16])
@pytest.mark.parametrize("nq,nk,causal,window", [(40, 40, True, None), (40, 40, False, None), (9, 40, True, None),
                                                 (40, 9, True, None), (40, 40, True, 7), (12, 40, True, 5)])
def test_reference_in_blocks_matches_the_oracle(device, oracle, block_rows, nq, nk, causal, window):
    """Blocks of query rows, each over only the keys its rows can see: block edges inside the causal band
    and the window, KV-cache (nq < nk) and nq > nk alignments (leading rows see no key), padding with holes,
    a soft cap and grouped-query heads."""
    from lmscope.kernels.attention_entropy.naive import attention_with_entropy_reference

    q, k, v = _qkv(2, 4, 2, nq, 16, device=device, seed=31, nk=nk)
    kpm = torch.rand(2, nk, generator=torch.Generator().manual_seed(nk)).to(device) > 0.3
    kpm[1, :4] = False
    for softcap in (None, 2.0):
        got = attention_with_entropy_reference(3 * q, k, v, causal=causal, key_padding_mask=kpm, window=window,
                                               softcap=softcap, block_rows=block_rows)
        want = oracle.attention(3 * q, k, v, causal=causal, key_padding_mask=kpm, window=window, softcap=softcap)
        for a, b in zip(got, want):
            _close(a, b, atol=2e-5)


@pytest.mark.parametrize("block_rows", [2, 5])
def test_reference_in_blocks_with_an_explicit_mask(device, oracle, block_rows):
    """The transformers integration's explicit masks: a full [B, 1, Nq, Nk] one is cut per block along both
    axes, a [B, 1, 1, Nk] one along the keys only."""
    from lmscope.kernels.attention_entropy.naive import attention_with_entropy_reference

    q, k, v = _qkv(2, 2, 2, 23, 16, device=device, seed=32)
    kpm = torch.rand(2, 23, generator=torch.Generator().manual_seed(1)).to(device) > 0.4
    full = oracle.allowed(23, 23, True, kpm, device).expand(2, 1, 23, 23).contiguous()
    got = attention_with_entropy_reference(q, k, v, causal=False, attn_mask=full, block_rows=block_rows)
    for a, b in zip(got, oracle.attention(q, k, v, causal=True, key_padding_mask=kpm)):
        _close(a, b, atol=2e-5)
    got = attention_with_entropy_reference(q, k, v, causal=False, attn_mask=kpm[:, None, None, :],
                                           block_rows=block_rows)
    for a, b in zip(got, oracle.attention(q, k, v, causal=False, key_padding_mask=kpm)):
        _close(a, b, atol=2e-5)


def test_reference_splits_by_its_score_budget(device, oracle, monkeypatch):
    """Without ``block_rows`` the blocks hold about SCORES_PER_BLOCK scores: a budget of 3 rows' scores gives
    blocks of 3 rows, each one matmul; the results are the oracle's."""
    from lmscope.kernels.attention_entropy import naive

    q, k, v = _qkv(1, 2, 1, 10, 8, device=device, seed=33)
    monkeypatch.setitem(naive.SCORES_PER_BLOCK, q.device.type, 3 * 2 * 10)
    score_rows = []
    real_matmul = torch.matmul

    def counting_matmul(a, b):
        if b.shape[-2] == 8:  # q kᵀ, not p v
            score_rows.append(a.shape[-2])
        return real_matmul(a, b)

    monkeypatch.setattr(naive.torch, "matmul", counting_matmul)
    res = attention_with_entropy(q, k, v, causal=True, backend="reference")
    assert sorted(score_rows) == [1, 3, 3, 3]
    _check_against(res, oracle.attention(q, k, v, causal=True))


def test_reference_edge_shapes(device, oracle):
    """No batch, no key (every row empty: 0, 0, −inf), and explicit masks of fewer than four dimensions."""
    from lmscope.kernels.attention_entropy.naive import attention_with_entropy_reference

    q, k, v = _qkv(0, 2, 2, 5, 8, device=device)
    out, ent, lse = attention_with_entropy_reference(q, k, v, causal=True)
    assert out.shape == (0, 2, 5, 8) and ent.shape == lse.shape == (0, 2, 5)
    q, k, v = _qkv(1, 2, 2, 5, 8, device=device, nk=0)
    out, ent, lse = attention_with_entropy_reference(q, k, v, causal=False)
    assert (out == 0).all() and (ent == 0).all() and torch.isneginf(lse).all() and out.shape == (1, 2, 5, 8)
    q, k, v = _qkv(2, 2, 2, 9, 8, device=device, seed=34)
    band = torch.ones(9, 9, dtype=torch.bool, device=device).tril()
    got = attention_with_entropy_reference(q, k, v, causal=False, attn_mask=band, block_rows=2)
    for a, b in zip(got, oracle.attention(q, k, v, causal=True)):
        _close(a, b, atol=2e-5)


def test_reference_never_holds_the_whole_score_matrix():
    """A CPU worker's window of 16384 tokens: the score matrix alone would be 1 GiB (float32, one head), and
    the unblocked reference grew the process by 5.4 GiB. In blocks it grows by about 40 MiB, causal or not,
    run after run (blocks that grew, or results kept as pieces between the blocks' freed scores, left the
    allocator holding 0.8 to 2 GiB). Some rows are checked against float64 from their explicit scores."""
    script = r"""
import math, resource, torch
from lmscope.kernels.attention_entropy.naive import attention_with_entropy_reference
n, d = 16384, 16
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 1, n, d, generator=g) for _ in range(3))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
worst = 0.0
for causal in (True, False, True, False):
    out, ent, lse = attention_with_entropy_reference(q, k, v, causal=causal)
    for i in (0, 1, 4097, n - 1):
        seen = i + 1 if causal else n
        s = (q[0, 0, i].double() @ k[0, 0, :seen].double().T) / math.sqrt(d)
        p = torch.softmax(s, -1)
        worst = max(worst, abs(float(-(p * p.log()).sum()) - float(ent[0, 0, i])),
                    (out[0, 0, i].double() - p @ v[0, 0, :seen].double()).abs().max().item())
grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(grown_mib, worst)
"""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    grown_mib, worst = map(float, done.stdout.split())
    assert worst < 1e-4
    assert grown_mib < 256, f"the process grew by {grown_mib:.0f} MiB"
