"""Which tiles the attention-entropy kernel should autotune over: every (BLOCK_M, BLOCK_N, warps, stages)
of a wide grid, timed on the same inputs next to PyTorch SDPA, per head dim and length.

    python benchmarks/attention_tiles.py                       # GPU only: D 64 and 128, N 4096 and 16384
    python benchmarks/attention_tiles.py --dims 128 --ns 8192 --top 5
    python benchmarks/attention_tiles.py --dims 256 --ns 4096            # Gemma 2's head width
    python benchmarks/attention_tiles.py --dtype float32 --dims 128      # the jobs' default dtype (exact dots)

It launches the kernel itself (not the autotuner), so the table shows what each tile costs, including
the ones `_TILES` in lmscope/kernels/attention_entropy/triton_kernel.py leaves out; tiles that do not fit
the GPU's shared memory or registers show as errors, and every tile `_TILES` lists for the shape is
timed too. B·H = 32, causal, bf16 (as benchmarks/attention.py) or float32 (exact fp32 dot products, as
the kernel runs float32 inputs; a grid of smaller tiles).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from lmscope.kernels.attention_entropy import triton_kernel as tk  # noqa: E402


def launch(q, k, v, block_m, block_n, warps, stages):
    b, h, n, d = q.shape
    block_d = max(16, triton.next_power_of_2(d))
    out = torch.empty_like(q)
    ent = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    lse = torch.empty_like(ent)
    kpm = torch.empty(1, device=q.device, dtype=torch.int8)
    grid = (triton.cdiv(n, block_m), b * h)

    def run():
        tk._attn_entropy_fwd[grid](
            q, k, v, kpm, out, ent, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(), 0,
            h, n, n, 1, tk.LOG2E / math.sqrt(d), 0.0, 0, triton.next_power_of_2(n), triton.next_power_of_2(n),
            HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_D=block_d, BLOCK_DV=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
            CAUSAL=True, HAS_KPM=False, SOFTCAP=False, WINDOW=False,
            INPUT_PRECISION="ieee" if q.dtype == torch.float32 else None, INTERPRET=False,
            num_warps=warps, num_stages=stages,
        )
    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--ns", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--bh", type=int, default=32)
    p.add_argument("--top", type=int, default=8, help="rows per shape, fastest first")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU: the tiles only mean something compiled")
    print(f"# tiles of _attn_entropy_fwd on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, {args.dtype}, causal, B·H = {args.bh}")
    exact = args.dtype == "float32"
    dtype = torch.float32 if exact else torch.bfloat16
    # exact fp32 dot products hold their operands in registers: smaller tiles than bf16's
    grid = (itertools.product([32, 64], [16, 32, 64], [4, 8], [2, 3]) if exact
            else itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3, 4]))
    grid = list(grid)
    for d in args.dims:
        listed = set(tk._TILES[(exact, tk.head_dim_bucket(d))])
        for n in args.ns:
            g = torch.Generator(device="cpu").manual_seed(0)
            q, k, v = (torch.randn(1, args.bh, n, d, generator=g).to("cuda", dtype) for _ in range(3))
            sdpa = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), warmup=25, rep=100)
            rows = []
            for bm, bn, w, st in dict.fromkeys(grid + sorted(listed)):
                try:
                    ms = do_bench(launch(q, k, v, bm, bn, w, st), warmup=25, rep=100)
                except Exception as exc:  # noqa: BLE001 (out of shared memory / registers: a cell, not the run)
                    rows.append((math.inf, (bm, bn, w, st), type(exc).__name__))
                    continue
                rows.append((ms, (bm, bn, w, st), ""))
            rows.sort(key=lambda r: r[0])
            print(f"\n## D = {d}, N = {n}: sdpa {sdpa:.3f} ms")
            print("| BLOCK_M | BLOCK_N | warps | stages | ms | /sdpa | in _TILES |")
            print("|---|---|---|---|---|---|---|")
            for ms, (bm, bn, w, st), err in rows[:args.top]:
                print(f"| {bm} | {bn} | {w} | {st} | {ms:.3f} | {ms / sdpa:.2f} | {'yes' if (bm, bn, w, st) in listed else ''} |")
            for ms, tile, err in rows[args.top:]:
                if tile in listed:
                    print(f"| {tile[0]} | {tile[1]} | {tile[2]} | {tile[3]} | {ms:.3f} | {ms / sdpa:.2f} | yes |")
            failed = [tile for ms, tile, err in rows if err]
            if failed:
                print(f"failed to launch: {failed}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
