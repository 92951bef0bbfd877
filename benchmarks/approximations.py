"""FAVOR+ and Linformer: Triton path vs PyTorch reference vs exact SDPA, side by side in one run.

    python benchmarks/approximations.py            # on a GPU
    python benchmarks/approximations.py --quick    # small sizes (the default without CUDA)

For each length N (B·H = 32, D = 64, bf16 by default; float32 on a CPU) it times
  favor/triton:     favor_attention(causal=True, backend="triton")   (prefix-sum kernel)
  favor/reference:  favor_attention(causal=True, backend="reference") (the same maths, chunked in PyTorch)
  linformer/triton: linformer_attention(backend="triton")            (projections + attention kernel)
  linformer/ref:    linformer_attention(backend="reference")
  sdpa:             causal scaled_dot_product_attention, the exact attention they approximate
with m = k = --features, and prints one markdown table with the ratios reference/triton and
triton/sdpa. Without CUDA only the references run (the interpreter is no speed measure).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lmscope.kernels import (draw_favor_projection, draw_linformer_projections, favor_attention,  # noqa: E402
                             linformer_attention)

from attention import DTYPES, time_each  # noqa: E402  (this folder first on sys.path; the attention benchmark's timer)


def bench_length(n, args, device, dtype):
    """{method: seconds, or "oom"} for one sequence length."""
    g = torch.Generator(device="cpu").manual_seed(n)
    q, k, v = ((0.5 * torch.randn(1, args.bh, n, args.dim, generator=g)).to(device, dtype) for _ in range(3))
    w = draw_favor_projection(args.features, args.dim, seed=0, device=device)
    e, f = draw_linformer_projections(min(args.features, n), n, seed=0, device=device)
    methods = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
               "favor/reference": lambda: favor_attention(q, k, v, projection=w, causal=True, backend="reference"),
               "linformer/reference": lambda: linformer_attention(q, k, v, e, f, backend="reference")}
    if device.type == "cuda":
        methods["favor/triton"] = lambda: favor_attention(q, k, v, projection=w, causal=True, backend="triton")
        methods["linformer/triton"] = lambda: linformer_attention(q, k, v, e, f, backend="triton")
    with torch.no_grad():  # a failed cell (OOM, or e.g. Triton's OutOfResources) is one cell, not the table
        cells = time_each(methods, device, args)
    return {name: c[0] if isinstance(c, tuple) else "oom" if c is None else c for name, c in cells.items()}


def main(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", default=not cuda, help="small sizes (default without CUDA)")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if cuda else "fp32")
    p.add_argument("--bh", type=int, default=32, help="batch x heads")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--features", type=int, default=256, help="FAVOR+ features m and Linformer rows k")
    p.add_argument("--ns", type=int, nargs="+", default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    args.ns = args.ns or ([256, 512] if args.quick else [512, 1024, 2048, 4096, 8192, 16384])
    args.reps = args.reps or (3 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.quick:
        args.bh = min(args.bh, 4)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"# FAVOR+ / Linformer on {name}: B·H={args.bh}, D={args.dim}, m=k={args.features}, {args.dtype}, "
          f"torch {torch.__version__}\n")
    cols = ["sdpa", "favor/triton", "favor/reference", "linformer/triton", "linformer/reference"]
    print("| N | " + " | ".join(f"{c} ms" for c in cols) + " | favor ref/triton | favor triton/sdpa "
          "| linformer ref/triton | linformer triton/sdpa |")
    print("|" + " --- |" * (len(cols) + 5))

    def ms(t):
        return "—" if t is None else "OOM" if t == "oom" else t if isinstance(t, str) else f"{t * 1e3:.3f}"

    def ratio(a, b):
        return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) else "—"

    for n in args.ns:
        t = bench_length(n, args, device, dtype)
        cells = [ms(t[c]) if c in t else "—" for c in cols]
        print(f"| {n} | " + " | ".join(cells) + f" | {ratio(t.get('favor/reference'), t.get('favor/triton'))} "
              f"| {ratio(t.get('favor/triton'), t.get('sdpa'))} "
              f"| {ratio(t.get('linformer/reference'), t.get('linformer/triton'))} "
              f"| {ratio(t.get('linformer/triton'), t.get('sdpa'))} |", flush=True)
    if device.type != "cuda":
        print("\nNo CUDA: the Triton paths were not timed (under TRITON_INTERPRET they are a correctness check, "
              "not a speed measure).")


if __name__ == "__main__":
    main()
