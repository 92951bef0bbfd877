"""Attention with entropy vs PyTorch SDPA vs eager attention + entropy, side by side in one run.

    python benchmarks/attention.py            # full sweep on a GPU; --quick on a machine without CUDA
    python benchmarks/attention.py --quick    # small sizes (the default when no CUDA is present)

For each head dim D and length N (B·H = 32, causal, bf16 by default) it times
  kernel: lmscope.kernels.attention_with_entropy (out + entropy + lse; backend as dispatched)
  sdpa:   torch.nn.functional.scaled_dot_product_attention (out only: the speed ceiling)
  eager:  scores -> softmax -> P·V plus entropy -(p·log p).sum() from the materialised matrix
and records peak memory (CUDA only) and which lengths ran out of memory. Output: a markdown table
with the ratios kernel/sdpa and eager/kernel, then the longest N each method managed.

On CUDA a second table times SDPA with each backend pinned (flash, cuDNN, memory-efficient) at
N = 4096 and the longest N, so the `sdpa` column's backend is known.

A third table (skip it with --no-options) times the kernel's options against the plain kernel on
the same inputs: Gemma 2's soft-capping (softcap=50) and a causal sliding window of N/4 keys.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lmscope.kernels import attention_with_entropy, kernel_backend  # noqa: E402

from _common import is_oom  # noqa: E402  (this folder, first on sys.path)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def eager_with_entropy(q, k, v, scale):
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    p = torch.softmax(s, dim=-1)
    ent = -torch.special.xlogy(p, p).sum(-1)
    return torch.matmul(p.to(v.dtype), v), ent


def timed(fn, device, reps, warmup):
    """Median seconds per call and peak bytes above the inputs (CUDA), or raise on OOM."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()

        def run(calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / calls

        # Short calls are timed as runs of back-to-back calls (>= ~2 ms each): a lone call between two
        # events also counts the synchronisation gap, which at small N is as long as the kernel.
        calls = min(200, max(1, int(2e-3 / max(run(1), 1e-6))))
        times = [run(calls) for _ in range(reps)]
        peak = torch.cuda.max_memory_allocated() - base
    else:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        peak = None
    times.sort()
    return times[len(times) // 2], peak


def random_qkv(b, h, n, d, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(device=device, dtype=dtype) for _ in range(3))


def time_each(fns, device, args):
    """{name: (seconds, peak bytes)} of each function, side by side; None marks an out-of-memory, a string
    any other failure (e.g. Triton's OutOfResources, not a RuntimeError): one cell, not the whole table."""
    res = {}
    for name, fn in fns.items():
        try:
            res[name] = timed(fn, device, args.reps, args.warmup)
        except Exception as exc:  # noqa: BLE001 (a first compiled run may fail in ways no CPU run shows)
            if is_oom(exc):
                res[name] = None
            else:
                res[name] = f"error: {type(exc).__name__}"
                print(f"# {name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                      file=sys.stderr, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return res


def bench_case(b, h, n, d, dtype, device, args):
    """Time the three methods on one shape; None marks an out-of-memory."""
    q, k, v = random_qkv(b, h, n, d, dtype, device, seed=0)
    scale = 1.0 / math.sqrt(d)
    res = time_each({
        "kernel": lambda: attention_with_entropy(q, k, v, causal=True),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "eager": lambda: eager_with_entropy(q, k, v, scale),
    }, device, args)
    if args.check and isinstance(res["kernel"], tuple):
        # first (batch, head) only, against float64 from the explicit matrix
        q1, k1, v1 = (t[:1, :1].double() for t in (q, k, v))
        _, ent64 = eager_with_entropy(q1, k1, v1, scale)
        err = (attention_with_entropy(q, k, v, causal=True).entropy[:1, :1] - ent64).abs().max().item()
        print(f"#   D={d} N={n}: max |entropy(kernel) - entropy(float64)| = {err:.2e}")
    return res


def bench_options(b, h, n, d, dtype, device, args):
    """Kernel time with each option / without: what soft-capping and a window of N/4 keys cost or save."""
    q, k, v = random_qkv(b, h, n, d, dtype, device, seed=1)
    window = max(1, n // 4)
    return time_each({
        "plain": lambda: attention_with_entropy(q, k, v, causal=True),
        "softcap": lambda: attention_with_entropy(q, k, v, causal=True, softcap=50.0),
        "window": lambda: attention_with_entropy(q, k, v, causal=True, window=window),
    }, device, args)


def run(args):
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    bh = args.bh
    b, h = 1, bh  # the kernels see B*H programs per query block either way
    backend = kernel_backend(device)
    print(f"# attention benchmark: device={torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'}"
          f", torch {torch.__version__}, kernel backend={backend}, dtype={args.dtype}, B*H={bh}, causal")
    if device.type != "cuda":
        print("# (no CUDA: the kernel runs its PyTorch reference, so these rows measure the CPU path, not Triton)")
    longest = {"kernel": 0, "sdpa": 0, "eager": 0}
    print()
    print("| D | N | kernel ms | sdpa ms | eager+entropy ms | kernel/sdpa | eager/kernel "
          "| kernel MiB | sdpa MiB | eager MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for d in args.dims:
        for n in args.ns:  # each row as soon as it is measured: a later failure keeps the rows before it
            res = bench_case(b, h, n, d, dtype, device, args)
            for name, r in res.items():
                if isinstance(r, tuple):
                    longest[name] = max(longest[name], n)
            if device.type == "cuda":
                torch.cuda.empty_cache()

            def ms(name):
                r = res[name]
                return f"{r[0] * 1e3:.3f}" if isinstance(r, tuple) else r or "OOM"

            def mib(name):
                r = res[name]
                if not isinstance(r, tuple):
                    return r or "OOM"
                return "n/a" if r[1] is None else f"{r[1] / 2**20:.1f}"

            t = {name: r[0] if isinstance(r, tuple) else None for name, r in res.items()}
            ks = f"{t['kernel'] / t['sdpa']:.2f}" if t["kernel"] and t["sdpa"] else "-"
            ek = f"{t['eager'] / t['kernel']:.2f}" if t["kernel"] and t["eager"] else "-"
            print(f"| {d} | {n} | {ms('kernel')} | {ms('sdpa')} | {ms('eager')} | {ks} | {ek} "
                  f"| {mib('kernel')} | {mib('sdpa')} | {mib('eager')} |", flush=True)
    print()
    print("longest N run: " + ", ".join(f"{k} {v}" for k, v in longest.items()))
    print("goals on a GPU: kernel/sdpa <= 1.25; eager/kernel >= 5 at N = 4096; kernel memory linear in N")
    if device.type == "cuda":
        sdpa_backends_table(b, h, dtype, device, args, [n for n in args.ns if n >= 4096][:1] + args.ns[-1:])
    if not args.options:
        return
    print()
    print("| D | N | kernel ms | softcap=50 ms | window=N/4 ms | softcap/kernel | window/kernel |")
    print("|---|---|---|---|---|---|---|")
    for d in args.dims:
        for n in args.ns:
            try:
                res = bench_options(b, h, n, d, dtype, device, args)
            except (RuntimeError, MemoryError) as exc:  # the inputs themselves do not fit
                if not is_oom(exc):
                    raise
                res = {"plain": None, "softcap": None, "window": None}
            t = {name: r[0] if isinstance(r, tuple) else None for name, r in res.items()}

            def ms(name):
                return f"{t[name] * 1e3:.3f}" if t[name] else res[name] or "OOM"

            def per_plain(name):
                return f"{t[name] / t['plain']:.2f}" if t[name] and t["plain"] else "-"

            print(f"| {d} | {n} | {ms('plain')} | {ms('softcap')} | {ms('window')} "
                  f"| {per_plain('softcap')} | {per_plain('window')} |", flush=True)
    print("a causal window of N/4 keys reads about 7/16 of the causal triangle's key blocks")


def sdpa_backends_table(b, h, dtype, device, args, ns):
    """Which SDPA backend the `sdpa` column is: each one pinned in turn, on the same inputs.

    At short N every column (the kernel's too) is bounded by host time per call (~50 us of Python
    in the kernel's wrapper), not by the GPU: read the ratios at N >= 4096.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = [name for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION") if hasattr(SDPBackend, name)]
    print()
    print("| D | N | sdpa (default) ms | " + " | ".join(f"{name.split('_')[0].lower()} ms" for name in names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for d in args.dims:
        for n in sorted(set(ns)):
            q, k, v = random_qkv(b, h, n, d, dtype, device, seed=0)
            row = []
            for name in [None] + names:
                # pinned for the whole timing, not per call
                pinned = sdpa_kernel(getattr(SDPBackend, name)) if name else contextlib.nullcontext()
                try:
                    with pinned:
                        t = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device,
                                  args.reps, args.warmup)
                    row.append(f"{t[0] * 1e3:.3f}")
                except Exception as exc:  # noqa: BLE001 (this backend cannot take this shape / device, or OOM)
                    row.append("OOM" if is_oom(exc) else "n/a")
            print(f"| {d} | {n} | " + " | ".join(row) + " |")
            q = k = v = None  # free them before the next shape
            torch.cuda.empty_cache()


def main(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", default=not cuda,
                   help="small sizes (default when no CUDA is present)")
    p.add_argument("--full", dest="quick", action="store_false", help="the full sweep even without CUDA")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--bh", type=int, default=32, help="batch x heads")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--ns", type=int, nargs="+", default=None, help="sequence lengths")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--check", action="store_true", help="also print the kernel's entropy error vs float64")
    p.add_argument("--no-options", dest="options", action="store_false",
                   help="skip the table of the kernel's options (soft-capping, sliding window)")
    args = p.parse_args(argv)
    if args.ns is None:
        args.ns = [128, 256, 512] if args.quick else [512, 1024, 2048, 4096, 8192, 16384, 32768]
    args.reps = args.reps or (10 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    if os.environ.get("TRITON_INTERPRET") == "1" and args.device == "cuda":
        p.error("TRITON_INTERPRET=1 is set: unset it to benchmark the compiled kernels")
    run(args)


if __name__ == "__main__":
    main()
