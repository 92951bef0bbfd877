"""Causal FAVOR+ (linear attention over positive features) in Triton.

Given the features φq = φ(q) [B, H, N, m] (``naive.favor_features``), the key features and their
running max (``naive.favor_causal_key_features``: φk_j·e^(−M_j), M_j = max of the log-features of
keys 1..j) and v, causal FAVOR+ is

    out_n = φq_n · S_n / φq_n · z_n,   S_n = Σ_{j<=n} φk_j e^(M_j−M_n) v_jᵀ [m, Dv],   z_n = Σ_{j<=n} φk_j e^(M_j−M_n) [m].

A program owns one (batch, head), one block of features and one block of value columns, and walks
the sequence in chunks of BLOCK_N positions, carrying its slice of S and z in registers, in units of
e^(−M) at the end of the previous chunk (as online softmax carries its running max): per chunk the
numerator is e^(M_prev−M_i) φq_c S + (tril(φq_c φk_cᵀ) ∘ e^(M_j−M_i)) v_c and the denominator the same
with z and the row sums. Every factor is <= 1, and query n depends on keys j <= n only. Both are sums
over features, so each feature block writes its partial sums and the wrapper adds the blocks up
(deterministic; no atomics) before dividing. The N x N matrix is never formed, nor the [N, m, Dv]
prefix sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import cdiv, check_grid, interpreting, next_power_of_2, on_device_of
from ..tuning import autotune_on_gpu


@triton.jit
def _favor_chunk(
    state, zsum, m_prev, start, pq_base, pk_base, km_base, v_base, num_base, den_base, offs_m, offs_d, rows,
    stride_qn, stride_qm, stride_kn, stride_km, stride_mn, stride_vn, stride_vd, stride_nn, stride_nd, stride_dn,
    N, M, DV, WRITE_DEN, INPUT_PRECISION: tl.constexpr,
):
    """One chunk of positions: write its partial numerator (and denominator), return the new state."""
    offs_n = start + rows
    in_n = offs_n < N
    # the keys' running max (non-decreasing); padded rows read 0 and are masked wherever they would count,
    # and every exponent is clamped at 0 (exact for real rows), so no inf or nan arises in padding
    mc = tl.load(km_base + offs_n * stride_mn, mask=in_n, other=0.0)
    m_end = tl.max(tl.where(in_n, mc, float("-inf")), 0)
    fmask = in_n[:, None] & (offs_m[None, :] < M)
    # padded rows and features load as 0: they add nothing to any sum
    pq = tl.load(pq_base + offs_n[:, None] * stride_qn + offs_m[None, :] * stride_qm, mask=fmask, other=0.0)
    pk = tl.load(pk_base + offs_n[:, None] * stride_kn + offs_m[None, :] * stride_km, mask=fmask, other=0.0)
    vmask = in_n[:, None] & (offs_d[None, :] < DV)
    vc = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=vmask, other=0.0)
    a = tl.dot(pq, tl.trans(pk), input_precision=INPUT_PRECISION)  # [BLOCK_N, BLOCK_N]
    # key j <= query i inside the chunk, in units of e^(−M_i)
    visible = (rows[:, None] >= rows[None, :]) & in_n[:, None]
    a = tl.where(visible, a * tl.exp(tl.minimum(mc[None, :] - mc[:, None], 0.0)), 0.0)
    carry = tl.where(in_n, tl.exp(tl.minimum(m_prev - mc, 0.0)), 0.0)  # the state's units to query i's; 0 at first
    num = tl.dot(a, vc, tl.dot(pq, state, input_precision=INPUT_PRECISION) * carry[:, None],
                 input_precision=INPUT_PRECISION)
    tl.store(num_base + offs_n[:, None] * stride_nn + offs_d[None, :] * stride_nd, num, mask=vmask)
    # the denominator does not depend on the value columns: the first column block writes it
    den = tl.sum(pq * zsum[None, :], 1) * carry + tl.sum(a, 1)
    if WRITE_DEN:  # a branch, not `mask=in_n & WRITE_DEN`: Triton 3.9's interpreter makes that mask int
        tl.store(den_base + offs_n * stride_dn, den, mask=in_n)
    # the new state in units of e^(−m_end): the chunk's keys scaled by e^(M_j − m_end), the old state by
    # e^(m_prev − m_end)
    pk = pk * tl.where(in_n, tl.exp(tl.minimum(mc - m_end, 0.0)), 0.0)[:, None]
    decay = tl.exp(m_prev - m_end)
    state = tl.dot(tl.trans(pk), vc, state * decay, input_precision=INPUT_PRECISION)
    zsum = zsum * decay + tl.sum(pk, 0)
    return state, zsum, m_end


@triton.jit(do_not_specialize=["N_BUCKET"])
def _favor_causal_fwd(
    PQ, PK, KM, V, Num, Den,
    stride_qb, stride_qh, stride_qn, stride_qm,
    stride_kb, stride_kh, stride_kn, stride_km,
    stride_mb, stride_mh, stride_mn,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_nf, stride_nb, stride_nh, stride_nn, stride_nd,
    stride_df, stride_db, stride_dh, stride_dn,
    H, N, M, DV, GROUP, N_BUCKET,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_f = tl.program_id(0)  # feature block
    pid_v = tl.program_id(1)  # value-column block
    pid_bh = tl.program_id(2)
    # int64: the partial-sum buffers hold n_f * B * H * N * Dv values, past int32 for long contexts
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP  # grouped-query: query head h reads key/value head h // (H / H_kv)
    f = pid_f.to(tl.int64)

    offs_m = pid_f * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    rows = tl.arange(0, BLOCK_N)
    pq_base = PQ + b * stride_qb + h * stride_qh
    pk_base = PK + b * stride_kb + hk * stride_kh
    km_base = KM + b * stride_mb + hk * stride_mh
    v_base = V + b * stride_vb + hk * stride_vh
    num_base = Num + f * stride_nf + b * stride_nb + h * stride_nh
    den_base = Den + f * stride_df + b * stride_db + h * stride_dh
    write_den = pid_v == 0

    state = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # this block's slice of S
    zsum = tl.zeros([BLOCK_M], dtype=tl.float32)  # and of z
    m_prev = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)  # their units e^(−m_prev): none yet
    if INTERPRET:
        # the Triton 3.6 interpreter cannot take a tensor as a range() bound with numpy >= 2.4
        # (triton-lang/triton#9171; see attention_entropy): a while loop there, the for loop compiled
        start = 0
        while start < N:
            state, zsum, m_prev = _favor_chunk(
                state, zsum, m_prev, start, pq_base, pk_base, km_base, v_base, num_base, den_base, offs_m, offs_d,
                rows, stride_qn, stride_qm, stride_kn, stride_km, stride_mn, stride_vn, stride_vd, stride_nn,
                stride_nd, stride_dn,
                N, M, DV, write_den, INPUT_PRECISION,
            )
            start += BLOCK_N
    else:
        for start in range(0, N, BLOCK_N):
            state, zsum, m_prev = _favor_chunk(
                state, zsum, m_prev, start, pq_base, pk_base, km_base, v_base, num_base, den_base, offs_m, offs_d,
                rows, stride_qn, stride_qm, stride_kn, stride_km, stride_mn, stride_vn, stride_vd, stride_nn,
                stride_nd, stride_dn,
                N, M, DV, write_den, INPUT_PRECISION,
            )


# One feature block per program (BLOCK_M) for every config: the partial-sum buffers are sized by it.
BLOCK_M = 64
INTERPRET_BLOCK_M = 32  # the interpreter's (numpy) cost grows with the block
# (BLOCK_N, BLOCK_DV, num_warps, num_stages) candidates; with 3xTF32 dots (tensor cores) these compile
# for sm_90 with < 1 KB of register spills, where exact fp32 (FMA) dots spilled 5 KB.
# Two-stage variants prefetch the next chunk (cp.async) and spill no more: the GPU's autotuner picks.
_TILES = [(64, 64, 8, 1), (32, 64, 4, 1), (64, 32, 4, 1), (32, 32, 4, 1), (32, 32, 4, 2), (64, 32, 4, 2)]


def _prune(configs, named_args, **kwargs):
    widest = max(16, next_power_of_2(named_args["DV"]))  # no value block wider than the values
    kept = [c for c in configs if c.kwargs["BLOCK_DV"] <= widest]
    return kept or configs[-1:]


_kernel, _BLOCKS = autotune_on_gpu(
    _favor_causal_fwd, configs=[triton.Config({"BLOCK_N": bn, "BLOCK_DV": bdv}, num_warps=w, num_stages=st)
                                for bn, bdv, w, st in _TILES],
    key=["N_BUCKET", "M", "DV"], prune=_prune, interpreter_blocks={"BLOCK_N": 16, "BLOCK_DV": 16})


def favor_causal_triton(phi_q: torch.Tensor, phi_k: torch.Tensor, key_max: torch.Tensor,
                        v: torch.Tensor) -> torch.Tensor:
    """Causal FAVOR+ from features: phi_q [B, H, N, m], phi_k [B, H_kv, N, m] and its running max key_max
    [B, H_kv, N] (``favor_causal_key_features``), v [B, H_kv, N, Dv] → float32 out."""
    B, H, N, M = phi_q.shape
    Hk, DV = phi_k.shape[1], v.shape[-1]
    if phi_k.shape != (B, Hk, N, M) or v.shape[:3] != (B, Hk, N) or key_max.shape != (B, Hk, N):
        raise ValueError(f"incompatible shapes phi_q {tuple(phi_q.shape)}, phi_k {tuple(phi_k.shape)}, "
                         f"key_max {tuple(key_max.shape)}, v {tuple(v.shape)}")
    check_grid(B * H)
    # features are fp32 anyway; tl.dot wants one dtype
    phi_q, phi_k, key_max, v = (t.float() for t in (phi_q, phi_k, key_max, v))
    block_m = INTERPRET_BLOCK_M if interpreting() else BLOCK_M
    n_f = cdiv(M, block_m)
    num = torch.empty(n_f, B, H, N, DV, device=v.device, dtype=torch.float32)
    den = torch.empty(n_f, B, H, N, device=v.device, dtype=torch.float32)

    def grid(meta):
        return (n_f, cdiv(DV, meta["BLOCK_DV"]), B * H)

    with on_device_of(v):
        _kernel[grid](
            phi_q, phi_k, key_max, v, num, den,
            *phi_q.stride(), *phi_k.stride(), *key_max.stride(), *v.stride(), *num.stride(), *den.stride(),
            H, N, M, DV, H // Hk, next_power_of_2(N),
            BLOCK_M=block_m,
            # fp32 features: 3xTF32 keeps fp32 accuracy on tensor cores (plain TF32 would cost ~3 digits
            # the estimate does not need to lose); the interpreter computes in exact fp32 anyway
            INPUT_PRECISION="ieee" if interpreting() else "tf32x3",
            INTERPRET=interpreting(), **_BLOCKS,
        )
    return num.sum(0) / den.sum(0).unsqueeze(-1)
