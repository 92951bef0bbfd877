"""Fused attention + per-row entropy (FlashAttention-2 style forward, Triton).

One program owns BLOCK_M query rows of one (batch, head) and streams the keys in BLOCK_N blocks,
keeping per row the running max m, the normaliser l = sum e^(s-m) and the entropy term
t = sum e^(s-m) * (s - m), all in fp32. At the end

    lse = m + ln l,   H = -sum p ln p = ln l - t / l        (p = e^(s-m) / l)

which is the identity H = m + ln l - (sum e^(s-m) s) / l with t taken relative to the running max:
this keeps one-hot rows (H ~ 0) exact instead of a difference of two large numbers.
The kernel works in base 2 (exp2 is the fast hardware instruction): scores are scaled by log2(e)
and t, m are converted back to natural-log units at the end. The N x N matrix never exists.

Two options ride along as compile-time switches: Gemma 2's logit soft-capping (scores s become
c · tanh(s / c) before the softmax) and a causal sliding window (query i sees the W keys ending at
its diagonal; key blocks left of every row's window are skipped, like those right of the diagonal).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import INT32_MAX, cdiv, check_grid, fit_int32_offsets, interpreting, next_power_of_2, on_device_of
from ..tuning import autotune_on_gpu

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # used inside kernels: globals must be constexpr


@triton.jit
def _fold_key_block(
    acc, m_i, l_i, t_i,
    q, k_base, v_base, kpm_base,
    offs_m, offs_d, offs_dv, start_n,
    stride_kn, stride_kd, stride_vn, stride_vd,
    N_K, CAUSAL_OFFSET, qk_scale, cap_log2, WINDOW_SIZE,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Fold the key block starting at start_n into the running (acc, m, l, t) of BLOCK_M rows.

    MASKED=False is the fast path for blocks entirely in range, below the causal diagonal and inside
    every row's sliding window; MASKED=True handles the diagonal, the window's edge and the ragged tail.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    if MASKED:
        in_k = offs_n < N_K
        k = tl.load(k_ptrs, mask=in_k[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        v = tl.load(v_ptrs, mask=in_k[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    else:
        k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)

    # scores in log2 units: s2 = (q . k) * scale * log2(e). Without soft-capping the scale is applied
    # below, fused with subtracting the max (one FMA per score; the max of the raw scores, scaled, is
    # the max of the scaled ones since the scale is positive).
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    if SOFTCAP:
        # qk_scale is scale / cap here: s2 = cap * log2(e) * tanh(s), tanh(x) = 1 - 2 / (e^2x + 1)
        # (no tanh in every Triton version; the absolute error stays ~cap * 1e-7, as a softmax needs).
        # e^2x is capped at 2^64, where tanh is 1 in fp32 anyway, rather than overflowing to inf.
        s = s * qk_scale
        s = cap_log2 * (1.0 - 2.0 / (tl.math.exp2(tl.minimum(s * (2.0 / LN2), 64.0)) + 1.0))
        row_scale = 1.0
    else:
        row_scale = qk_scale
    valid = tl.full([1, BLOCK_N], 1, tl.int1)
    if MASKED:
        valid = valid & (offs_n[None, :] < N_K)
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + CAUSAL_OFFSET)
        if WINDOW:  # query i sees the WINDOW_SIZE keys ending at i + CAUSAL_OFFSET
            valid = valid & (offs_n[None, :] > offs_m[:, None] + CAUSAL_OFFSET - WINDOW_SIZE)
    if HAS_KPM:
        kp = tl.load(kpm_base + offs_n, mask=offs_n < N_K, other=0)
        valid = valid & (kp[None, :] != 0)
    if MASKED or HAS_KPM:
        s = tl.where(valid, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1) * row_scale)
    # Rows that have seen no visible key yet keep m = -inf; shift them by 0 so that neither
    # (-inf) - (-inf) nor 0 * (-inf) can appear below.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    z = s * row_scale - m_use[:, None]
    p = tl.math.exp2(z)
    if MASKED or HAS_KPM:
        z = tl.where(valid, z, 0.0)
    # re-base t from the old max to the new one: sum p (s - m_new) = t_old + l_old (m_old - m_new)
    shift = tl.where(m_i == float("-inf"), 0.0, m_i - m_use)
    t_i = alpha * (t_i + l_i * shift) + tl.sum(p * z, 1)
    l_i = alpha * l_i + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    return acc, m_new, l_i, t_i


@triton.jit
def _attn_entropy_inner(
    acc, m_i, l_i, t_i,
    q, k_base, v_base, kpm_base,
    offs_m, offs_d, offs_dv,
    stride_kn, stride_kd, stride_vn, stride_vd,
    start, end, N_K, CAUSAL_OFFSET, qk_scale, cap_log2, WINDOW_SIZE,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, INPUT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Fold key blocks [start, end) into the running state."""
    if INTERPRET:
        # The Triton 3.6 interpreter cannot use a tensor as a range() bound with numpy >= 2.4
        # (triton-lang/triton#9171); a while loop only needs bool(), which works. Compiled code
        # keeps the for loop, which the software pipeliner understands.
        start_n = start
        while start_n < end:
            acc, m_i, l_i, t_i = _fold_key_block(
                acc, m_i, l_i, t_i, q, k_base, v_base, kpm_base, offs_m, offs_d, offs_dv, start_n,
                stride_kn, stride_kd, stride_vn, stride_vd, N_K, CAUSAL_OFFSET, qk_scale, cap_log2,
                WINDOW_SIZE, HEAD_DIM, HEAD_DIM_V, BLOCK_N, MASKED, CAUSAL, HAS_KPM, SOFTCAP, WINDOW,
                INPUT_PRECISION,
            )
            start_n += BLOCK_N
    else:
        for start_n in range(start, end, BLOCK_N):
            acc, m_i, l_i, t_i = _fold_key_block(
                acc, m_i, l_i, t_i, q, k_base, v_base, kpm_base, offs_m, offs_d, offs_dv, start_n,
                stride_kn, stride_kd, stride_vn, stride_vd, N_K, CAUSAL_OFFSET, qk_scale, cap_log2,
                WINDOW_SIZE, HEAD_DIM, HEAD_DIM_V, BLOCK_N, MASKED, CAUSAL, HAS_KPM, SOFTCAP, WINDOW,
                INPUT_PRECISION,
            )
    return acc, m_i, l_i, t_i


@triton.jit(do_not_specialize=["N_BUCKET", "NQ_BUCKET"])
def _attn_entropy_fwd(
    Q, K, V, KPM, Out, Ent, Lse,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_kpm_b,
    H, N_Q, N_K, GROUP, qk_scale, cap_log2, WINDOW_SIZE, N_BUCKET, NQ_BUCKET,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if CAUSAL:
        # the last query blocks see the most keys: start them first (as FlashAttention-2 does), so the
        # launch does not end on a few long blocks while the other SMs idle
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP  # grouped-query attention: GROUP query heads share one kv head

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # int64 base offsets: B*H*N*D overflows int32 for long contexts
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    kpm_base = KPM + b.to(tl.int64) * stride_kpm_b

    q_mask = (offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    # fp32 running state; m starts at -inf (nothing seen), l and t at 0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    t_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # Bottom-right causal alignment: query i sees keys j <= i + (N_K - N_Q).
    causal_offset = N_K - N_Q
    if CAUSAL:
        # keys every row of this block may see / keys some row of this block may see
        full_end = tl.minimum(pid_m * BLOCK_M + causal_offset + 1, N_K)
        hi = tl.minimum(pid_m * BLOCK_M + BLOCK_M + causal_offset, N_K)
    else:
        full_end = N_K
        hi = N_K
    full_end = tl.maximum(full_end, 0)
    hi = tl.maximum(hi, 0)
    n_full = (full_end // BLOCK_N) * BLOCK_N
    if WINDOW:
        # (causal only) blocks before lo are outside every row's window; from lo_full on, inside all
        lo = tl.maximum(pid_m * BLOCK_M + causal_offset - WINDOW_SIZE + 1, 0)
        lo = tl.minimum((lo // BLOCK_N) * BLOCK_N, n_full)
        lo_full = tl.maximum(pid_m * BLOCK_M + BLOCK_M + causal_offset - WINDOW_SIZE, 0)
        lo_full = tl.maximum(tl.minimum(tl.cdiv(lo_full, BLOCK_N) * BLOCK_N, n_full), lo)
        acc, m_i, l_i, t_i = _attn_entropy_inner(
            acc, m_i, l_i, t_i, q, k_base, v_base, kpm_base, offs_m, offs_d, offs_dv,
            stride_kn, stride_kd, stride_vn, stride_vd, lo, lo_full, N_K, causal_offset, qk_scale, cap_log2,
            WINDOW_SIZE, HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, CAUSAL, HAS_KPM, SOFTCAP, WINDOW,
            INPUT_PRECISION, INTERPRET,
        )
    else:
        lo_full = 0

    acc, m_i, l_i, t_i = _attn_entropy_inner(
        acc, m_i, l_i, t_i, q, k_base, v_base, kpm_base, offs_m, offs_d, offs_dv,
        stride_kn, stride_kd, stride_vn, stride_vd, lo_full, n_full, N_K, causal_offset, qk_scale, cap_log2,
        WINDOW_SIZE, HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, CAUSAL, HAS_KPM, SOFTCAP, WINDOW,
        INPUT_PRECISION, INTERPRET,
    )
    acc, m_i, l_i, t_i = _attn_entropy_inner(
        acc, m_i, l_i, t_i, q, k_base, v_base, kpm_base, offs_m, offs_d, offs_dv,
        stride_kn, stride_kd, stride_vn, stride_vd, n_full, hi, N_K, causal_offset, qk_scale, cap_log2,
        WINDOW_SIZE, HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, CAUSAL, HAS_KPM, SOFTCAP, WINDOW,
        INPUT_PRECISION, INTERPRET,
    )

    # Rows with no visible key (padding, or N_Q > N_K under causal): out = 0, H = 0, lse = -inf.
    # A NaN score (NaN inputs, an fp16 overflow) makes l_i NaN: kept NaN, as in the reference, not
    # passed off as a row with nothing to see.
    seen = (l_i > 0.0) | (l_i != l_i)
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    ln_l = tl.log(l_safe)
    entropy = tl.where(seen, ln_l - LN2 * t_i / l_safe, 0.0)
    lse = tl.where(seen, LN2 * m_i + ln_l, float("-inf"))

    o_ptrs = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh \
        + offs_m[:, None] * stride_on + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m[:, None] < N_Q) & (offs_dv[None, :] < HEAD_DIM_V))
    row = pid_bh.to(tl.int64) * N_Q + offs_m
    tl.store(Ent + row, entropy, mask=offs_m < N_Q)
    tl.store(Lse + row, lse, mask=offs_m < N_Q)


# Candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) per input kind and head-dim bucket. The bf16 ones
# at D = 64 and 128 are the fastest of a 36-tile grid on an H100 (benchmarks/attention_tiles.py, bf16,
# causal, N = 4096 and 16384; docs/benchmarks.md), plus the small 64 x 32 tile that fits every recent GPU
# (the untuned choice). Tiles over the 99 KB of sm_86/sm_89 shared memory fail to compile there, and the
# autotuner passes them over. The untuned choice is a bucket's first tile in sorted order (the smallest).
# D = 256 (Gemma 2) has not been timed on a GPU yet: beside the small tiles, two of 128 KB that compile
# for sm_90 without spilling (ptxas -v), so the autotuner has Hopper-sized ones to pick from.
_TILES = {
    (False, 64): [(64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (64, 32, 4, 2)],
    (False, 128): [(64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 32, 4, 2)],
    (False, 256): [(64, 16, 8, 2), (32, 32, 8, 2), (64, 32, 8, 2), (128, 32, 8, 2), (64, 32, 8, 3)],
    # fp32 inputs use exact fp32 dot products (no tensor cores): smaller tiles. At D = 128 the 32 x 32 and
    # 64 x 32 tiles spill 0.5 and 1.2 KB of registers on sm_90; 32 x 16 does not (77 registers), and is
    # the untuned choice there (fp32 is the jobs' default dtype, and LLaMA-8B-class heads are 128 wide)
    (True, 64): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (True, 128): [(64, 32, 8, 2), (32, 32, 8, 2), (32, 16, 8, 2)],
    (True, 256): [(32, 32, 8, 2), (32, 16, 8, 2)],
}


def _configs():
    tiles = sorted({t for ts in _TILES.values() for t in ts})
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in tiles]


def head_dim_bucket(d: int) -> int:
    """The `_TILES` bucket of a head dim (the wider of the key and value heads)."""
    return 64 if d <= 64 else 128 if d <= 128 else 256


def _prune(configs, named_args, **kwargs):
    d = max(kwargs.get("BLOCK_D", 64), kwargs.get("BLOCK_DV", 64))
    wanted = set(_TILES[(kwargs.get("INPUT_PRECISION") == "ieee", head_dim_bucket(d))])
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]


# next powers of two of N_K and N_Q instead of the lengths: a model fed many lengths tunes once per
# octave, and a short query block (decoding) gets its own tile
_kernel, _INTERPRET_BLOCKS = autotune_on_gpu(
    _attn_entropy_fwd, configs=_configs(), prune=_prune, interpreter_blocks={"BLOCK_M": 32, "BLOCK_N": 32},
    key=["N_BUCKET", "NQ_BUCKET", "HEAD_DIM", "HEAD_DIM_V", "CAUSAL", "HAS_KPM", "SOFTCAP", "WINDOW",
         "INPUT_PRECISION"])


def attention_with_entropy_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    key_padding_mask: torch.Tensor | None,
    softcap: float | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the fused kernel; shapes, the cap and the window are validated by the public wrapper.

    Under torch.compile (e.g. transformers' generation with a static cache) the launch goes through
    the opaque operator ``lmscope::attention_with_entropy``: Dynamo and Inductor would otherwise trace
    into the autotuned kernel, which neither the interpreter nor Inductor's own compile of it survives.
    """
    if torch.compiler.is_compiling():
        return torch.ops.lmscope.attention_with_entropy(q, k, v, causal, scale, key_padding_mask, softcap, window)
    return _launch(q, k, v, causal, scale, key_padding_mask, softcap, window)


@torch.library.custom_op(
    "lmscope::attention_with_entropy", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, bool causal, float scale, Tensor? key_padding_mask, float? softcap, "
           "int? window) -> (Tensor, Tensor, Tensor)",
)
def _attention_with_entropy_op(q, k, v, causal, scale, key_padding_mask, softcap, window):
    # contiguous [B, H, Nq, Dv], as the fake says: Inductor lays out what follows itself, and a compiled
    # graph cached before a layout change would otherwise read this output with the old strides
    return _launch(q, k, v, causal, scale, key_padding_mask, softcap, window, heads_last=False)


@_attention_with_entropy_op.register_fake
def _(q, k, v, causal, scale, key_padding_mask, softcap, window):
    b, h, nq, _ = q.shape
    stats = q.new_empty((b, h, nq), dtype=torch.float32)
    return q.new_empty((b, h, nq, v.shape[-1])), stats, torch.empty_like(stats)


def empty_output(q: torch.Tensor, dv: int, heads_last: bool) -> torch.Tensor:
    """The [B, H, Nq, Dv] output buffer. heads_last: a view of a [B, Nq, H, Dv] one, which transformers
    continues with (its out.transpose(1, 2).contiguous() is then a view, not another pass over the output,
    as sdpa's route makes), while its rows, H·Dv apart, keep the kernel's offsets inside a head in int32."""
    b, h, nq, _ = q.shape
    if heads_last and (nq - 1) * h * dv + dv - 1 <= INT32_MAX:
        return torch.empty((b, nq, h, dv), device=q.device, dtype=q.dtype).transpose(1, 2)
    if nq * dv - 1 > INT32_MAX:  # even one contiguous head's rows (fit_int32_offsets checked q, k, v, not Dv × Nq)
        raise ValueError(f"one head of the output [{b}, {h}, {nq}, {dv}] holds more than 2^31 elements; "
                         "split the sequence")
    return torch.empty((b, h, nq, dv), device=q.device, dtype=q.dtype)


def _launch(q, k, v, causal, scale, key_padding_mask, softcap, window, heads_last=True):
    out_dtype = q.dtype
    if interpreting() and q.dtype in (torch.bfloat16, torch.float16):
        # The interpreter runs on numpy, which has no bfloat16: upcast the (already rounded) inputs.
        q, k, v = q.float(), k.float(), v.float()
    # The kernel takes each row's max of the unscaled scores and scales it, which needs scale > 0
    # (and a masked -inf score times 0 would be NaN): q·k·s = (−q)·k·|s|, and s = 0 scores every key 0.
    if scale < 0:
        q, scale = -q, -scale
    elif scale == 0:
        q, scale = torch.zeros_like(q), 1.0
    q, k, v = fit_int32_offsets(q), fit_int32_offsets(k), fit_int32_offsets(v)
    b, h, nq, d = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    check_grid(b * h)

    out = empty_output(q, dv, heads_last)
    ent = torch.empty((b, h, nq), device=q.device, dtype=torch.float32)
    lse = torch.empty((b, h, nq), device=q.device, dtype=torch.float32)
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(device=q.device, dtype=torch.int8).contiguous()
        stride_kpm_b = kpm.stride(0)
    else:
        # HAS_KPM=False never reads the mask pointer: q stands in for it (an allocation per call costs host
        # time, and one kept across calls would sit in a CUDA graph's memory pool if first made in a capture)
        kpm = q
        stride_kpm_b = 0
    # fp32 inputs get exact fp32 dot products (tf32 would cost ~3 decimal digits of the entropy);
    # fp16/bf16 take the target's default (tensor cores, fp32 accumulation)
    precision = "ieee" if q.dtype == torch.float32 else None
    block_d = max(16, next_power_of_2(d))
    block_dv = max(16, next_power_of_2(dv))

    def grid(meta):
        return (cdiv(nq, meta["BLOCK_M"]), b * h)

    with on_device_of(q):
        _kernel[grid](
            q, k, v, kpm, out, ent, lse,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            stride_kpm_b,
            h, nq, nk, h // hk,
            scale / softcap if softcap else scale * LOG2E, softcap * LOG2E if softcap else 0.0, window or 0,
            next_power_of_2(nk), next_power_of_2(nq),
            HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
            CAUSAL=causal, HAS_KPM=key_padding_mask is not None, SOFTCAP=bool(softcap), WINDOW=window is not None,
            INPUT_PRECISION=precision,
            INTERPRET=interpreting(),
            **_INTERPRET_BLOCKS,
        )
    return out.to(out_dtype), ent, lse
