"""Dimension-wise attention entropy in Triton.

Score matrices of one head dimension are rank 1: s_nm = a_n b_m with a = scale * q[:, i] and
b = k[:, i]. Their row max is known in advance, max_m a_n b_m = a_n * (max b if a_n >= 0 else min b)
(over the visible keys: a running max/min along the sequence when causal), and floating-point
multiplication by a fixed a_n is monotone, so every exponent a_n b_m - max is <= 0 (exactly when
interpreted; compiled, the product and subtraction fuse into one FMA and may leave +1/2 ulp). The
kernel therefore needs no online rescaling: it accumulates l = sum e^(s - max) and
t = sum e^(s - max) (s - max) over key blocks for a [BLOCK_M, BLOCK_D] tile of (query, dimension)
pairs and returns H = ln l - t / l. The [N, N] matrices never exist.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import cdiv, check_grid, fit_int32_offsets, interpreting, next_power_of_2, on_device_of
from ..tuning import autotune_on_gpu

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # used inside kernels: globals must be constexpr


@triton.jit
def _fold_keys(
    l_i, t_i, a, mx, k_base, offs_m, offs_d, start_n, stride_kn, stride_kd, N, D,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kb = tl.load(
        k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=(offs_n[:, None] < N) & (offs_d[None, :] < D), other=0.0,
    ).to(tl.float32)
    # [BLOCK_M, BLOCK_N, BLOCK_D] tile of exponents (log2 units), all <= 0 where visible
    z = a[:, None, :] * kb[None, :, :] - mx[:, None, :]
    valid = offs_n[None, :, None] < N
    if CAUSAL:
        valid = valid & (offs_n[None, :, None] <= offs_m[:, None, None])
    z = tl.where(valid, z, float("-inf"))
    p = tl.math.exp2(z)
    l_i += tl.sum(p, 1)
    t_i += tl.sum(p * tl.where(valid, z, 0.0), 1)  # never 0 * (-inf)
    return l_i, t_i


@triton.jit(do_not_specialize=["N_BUCKET"])
def _dim_entropy_fwd(
    Q, K, KMAX, KMIN, Out,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_xb, stride_xh, stride_xn, stride_xd,
    stride_ob, stride_oh, stride_od, stride_on,
    H, N, D, GROUP, qk_scale, N_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    tile = (offs_m[:, None] < N) & (offs_d[None, :] < D)

    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    a = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, mask=tile, other=0.0)
    a = a.to(tl.float32) * qk_scale
    # max / min of the keys visible to each query row (prefix extrema when causal; see wrapper)
    x_off = b.to(tl.int64) * stride_xb + hk.to(tl.int64) * stride_xh \
        + offs_m[:, None] * stride_xn + offs_d[None, :] * stride_xd
    kmax = tl.load(KMAX + x_off, mask=tile, other=0.0).to(tl.float32)
    kmin = tl.load(KMIN + x_off, mask=tile, other=0.0).to(tl.float32)
    mx = tl.where(a >= 0.0, a * kmax, a * kmin)

    l_i = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    t_i = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    if CAUSAL:
        hi = tl.minimum(pid_m * BLOCK_M + BLOCK_M, N)
    else:
        hi = N
    if INTERPRET:
        # range() over a tensor bound breaks the 3.6 interpreter on numpy >= 2.4 (triton-lang/triton#9171)
        start_n = 0
        while start_n < hi:
            l_i, t_i = _fold_keys(l_i, t_i, a, mx, k_base, offs_m, offs_d, start_n, stride_kn, stride_kd,
                                  N, D, BLOCK_N, CAUSAL)
            start_n += BLOCK_N
    else:
        for start_n in range(0, hi, BLOCK_N):
            l_i, t_i = _fold_keys(l_i, t_i, a, mx, k_base, offs_m, offs_d, start_n, stride_kn, stride_kd,
                                  N, D, BLOCK_N, CAUSAL)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # l >= 1 for real rows (the max term is e^0); guards padding
    ent = tl.log(l_safe) - LN2 * t_i / l_safe
    o_ptrs = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh \
        + offs_d[None, :] * stride_od + offs_m[:, None] * stride_on
    tl.store(o_ptrs, ent, mask=tile)


def _configs():
    # (BLOCK_M, BLOCK_N, BLOCK_D, num_warps): tiles that compile for sm_90 without register spills on
    # triton 3.6 (on 3.9 all but (32, 32, 16, 8) spill 64-548 B: time them on a GPU)
    tiles = ((16, 32, 32, 4), (32, 16, 32, 4), (32, 32, 16, 8), (32, 32, 32, 8))
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": bd}, num_warps=w, num_stages=2)
        for bm, bn, bd, w in tiles
    ]


# N_BUCKET (next power of two of N): the best tile depends on the length, tuned once per octave
_kernel, _BLOCKS = autotune_on_gpu(_dim_entropy_fwd, configs=_configs(), key=["N_BUCKET", "D", "CAUSAL"],
                                   interpreter_blocks={"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_D": 16})


def dimension_entropy_triton(q: torch.Tensor, k: torch.Tensor, *, causal: bool, scale: float) -> torch.Tensor:
    """Launch the kernel; the public wrapper has validated shapes (q, k: [B, H(_kv), N, D])."""
    if interpreting() and q.dtype in (torch.bfloat16, torch.float16):
        q, k = q.float(), k.float()  # numpy (the interpreter) has no bfloat16
    q, k = fit_int32_offsets(q), fit_int32_offsets(k)
    b, h, n, d = q.shape
    hk = k.shape[1]
    check_grid(b * h)
    if causal:
        # running extrema along the sequence: query n sees keys 0..n
        kmax = torch.cummax(k, dim=2).values
        kmin = torch.cummin(k, dim=2).values
    else:
        # one extremum per (b, h, d), broadcast to every query row with stride 0
        kmax = k.amax(dim=2, keepdim=True).expand(b, hk, n, d)
        kmin = k.amin(dim=2, keepdim=True).expand(b, hk, n, d)
    out = torch.empty((b, h, d, n), device=q.device, dtype=torch.float32)

    def grid(meta):
        return (cdiv(n, meta["BLOCK_M"]), b * h, cdiv(d, meta["BLOCK_D"]))

    with on_device_of(q):
        _kernel[grid](
            q, k, kmax, kmin, out,
            *q.stride(), *k.stride(), *kmax.stride(), *out.stride(),
            h, n, d, h // hk, scale * LOG2E, next_power_of_2(n),
            CAUSAL=causal, INTERPRET=interpreting(), **_BLOCKS,
        )
    return out
