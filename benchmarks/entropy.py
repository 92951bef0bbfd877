"""Benchmark: the `entropy` job against a plain SDPA forward and the eager `output_attentions` route.

For each seq_len, over the same token windows of WikiText-2 and the same model:

  sdpa   model forward with PyTorch SDPA, no entropy at all (the floor; target job <= 1.3x)
  job    the whole `entropy` job (lmscope.analyses.entropy.run: windows, fused kernel, statistics,
         plots); its `measure` stage is reported separately
  eager  attn_implementation="eager", output_attentions=True, then -sum p ln p of every row and the
         same per-layer x head means (what one would write without the kernel; target job >= 5x
         faster at seq_len 4096 on GPU)

Then, per route, the longest seq_len that runs (doubling until out of memory, --max-seq-len, or a
run slower than --time-limit). On CPU the job uses the reference kernel (plain PyTorch, in blocks
of query rows), so CPU ratios say little about the GPU kernel.

    python benchmarks/entropy.py                         # bench-llama, seq_len 256..2048, CPU or GPU
    python benchmarks/entropy.py --seq-lens 1024,4096 --windows 8 --dtype bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from lmscope.analyses import entropy
from lmscope.analyses.base import LoadedModel
from lmscope.analyses.local import LocalContext
from lmscope.catalog import BYTE_VOCAB_SIZE, read_documents
from lmscope.config import Settings
from lmscope.kernels import kernel_backend
from lmscope.modeling.windows import token_windows
from lmscope.params.entropy import EntropyParams

from _common import gpu_busy, is_oom, load_spec, random_init, sync  # noqa: E402  (this folder, first on sys.path)

WIKITEXT = Settings.from_env().wikitext2_path


# LLaMA shapes with heads of 64 dims (RoPE, so any length fits); bench-llama-1b is LLaMA-3.2-1B's shape,
# where a GPU's time goes on a real model
BENCH_SHAPES = {
    "bench-llama": dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, hidden_size=512,
                        intermediate_size=1376),
    "bench-llama-1b": dict(num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, hidden_size=2048,
                           intermediate_size=8192),
}


def bench_model(spec: str, dtype: str, device: str) -> LoadedModel:
    """A `BENCH_SHAPES` model with random weights, a built-in, or an HF dir."""
    if spec in BENCH_SHAPES:
        from transformers import LlamaConfig

        config = LlamaConfig(**BENCH_SHAPES[spec], max_position_embeddings=1 << 17, vocab_size=BYTE_VOCAB_SIZE,
                             bos_token_id=256, eos_token_id=257, pad_token_id=258)
        return random_init(spec, config, dtype, device)
    return load_spec(spec, dtype, device)


# ------------------------------------------------------------------ the three routes


@torch.no_grad()
def route_sdpa(loaded: LoadedModel, windows: torch.Tensor, batch_size: int, device: str) -> None:
    loaded.model.set_attn_implementation("sdpa")
    for start in range(0, len(windows), batch_size):
        loaded.model(input_ids=windows[start:start + batch_size].to(device), use_cache=False)


@torch.no_grad()
def route_eager(loaded: LoadedModel, windows: torch.Tensor, batch_size: int, device: str) -> torch.Tensor:
    """Per layer x head mean entropy from the materialised attention matrices."""
    model = loaded.model
    model.set_attn_implementation("eager")
    try:
        total = None
        for start in range(0, len(windows), batch_size):
            attentions = model(input_ids=windows[start:start + batch_size].to(device), output_attentions=True,
                               use_cache=False).attentions
            # -sum p ln p per row; p = 0 entries (masked keys) contribute 0
            ent = torch.stack([-(p.float() * torch.log(p.float().clamp_min(1e-30))).sum(-1).sum((0, 2))
                               for p in attentions])
            total = ent.double() if total is None else total + ent.double()
            del attentions
        return total / (len(windows) * windows.shape[1])
    finally:
        model.set_attn_implementation("sdpa")


def route_job(loaded: LoadedModel, documents: list[str], seq_len: int, n_windows: int, batch_size: int,
              dtype: str, device: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = LocalContext(tmp, models={loaded.name: loaded}, datasets={"wikitext-2": documents}, device=device)
        params = EntropyParams(model=loaded.name, dataset="wikitext-2", seq_len=seq_len, num_segments=n_windows,
                               batch_size=batch_size, dtype=dtype)
        output = entropy.run(params, ctx)
        mean = torch.from_numpy(np.load(Path(tmp) / "entropy_by_position.npz")["mean"][0])
    return {"measure_s": ctx.timings.get("measure"), "summary": output.summary, "mean": mean}


def timed(fn, device: str, repeats: int) -> float:
    """Best wall time of `repeats` runs (after the caller's warm-up)."""
    best = math.inf
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


# ------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench-llama", help="bench-llama, bench-llama-1b, a built-in (tiny-gpt2, tiny-llama) or an HF dir")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default bf16 on GPU, fp32 on CPU)")
    ap.add_argument("--seq-lens", default=None, help="comma-separated (default 1024,2048,4096 on GPU; 256,512,1024 on CPU)")
    ap.add_argument("--windows", type=int, default=4, help="windows per seq_len (same tokens for every route)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-seq-len", type=int, default=None, help="stop the longest-seq_len search here "
                    "(default 131072 on GPU, 4096 on CPU)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="stop the search when one run takes longer (s)")
    ap.add_argument("--skip-longest", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()

    gpu = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    seq_lens = [int(s) for s in (args.seq_lens or ("1024,2048,4096" if gpu else "256,512,1024")).split(",")]
    max_seq = args.max_seq_len or ((1 << 17) if gpu else 4096)
    documents = read_documents(WIKITEXT, "lines")
    loaded = bench_model(args.model, dtype, args.device)
    device_name = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"model {loaded.name} ({dtype}) on {device_name}; kernel backend {kernel_backend(args.device)}; "
          f"{args.windows} windows x batch {args.batch_size}; best of {args.repeats}")

    rows, longest = [], {}
    stopped = None

    def save() -> None:  # after every row: `timeout -s INT` (gpu_suite.sh) may stop the run at any point
        if args.json:
            args.json.write_text(json.dumps({"model": loaded.name, "dtype": dtype, "device": device_name,
                                             "backend": kernel_backend(args.device), "rows": rows, "longest": longest,
                                             "stopped": stopped}, indent=1, default=str))

    try:
        measure_routes(args, loaded, documents, seq_lens, max_seq, dtype, gpu, rows, longest, save)
    except KeyboardInterrupt:
        stopped = (f"interrupted after {len(rows)} of {len(seq_lens)} rows" if len(rows) < len(seq_lens) else
                   f"interrupted while finding the longest seq_len (done: {', '.join(longest) or 'none'})")
        print(f"stopped ({stopped}): the rows above stand", flush=True)
        save()
        raise SystemExit(130) from None
    save()


def measure_routes(args, loaded, documents, seq_lens, max_seq, dtype, gpu, rows, longest, save) -> None:
    """Each seq_len's row (sdpa, job, eager side by side), then the longest seq_len per route."""
    print(f"{'seq_len':>8} {'sdpa s':>9} {'job s':>9} {'measure s':>10} {'eager s':>9} {'job/sdpa':>9} {'eager/job':>10}  max|Δ head mean|")
    for n in seq_lens:
        windows = token_windows(loaded.tokenizer, documents, n, args.windows)
        k = len(windows)
        run_sdpa = lambda: route_sdpa(loaded, windows, args.batch_size, args.device)  # noqa: E731
        job_runs: list[dict] = []
        run_job = lambda: job_runs.append(route_job(loaded, documents, n, k, args.batch_size, dtype, args.device))  # noqa: E731
        run_eager = lambda: route_eager(loaded, windows, args.batch_size, args.device)  # noqa: E731
        row = {"seq_len": n, "windows": k}
        for key, fn in (("sdpa", run_sdpa), ("job", run_job), ("eager", run_eager)):
            try:
                fn()  # warm-up (Triton compilation, allocator)
                row[f"{key}_s"] = timed(fn, args.device, args.repeats)
            except Exception as e:  # noqa: BLE001 - an OOM is a result here, and any other error one cell
                row[f"{key}_s"] = None
                row[f"{key}_error"] = "out of memory" if is_oom(e) else f"{type(e).__name__}: {str(e)[:200]}"
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
        if job_runs:
            row["measure_s"] = min(r["measure_s"] for r in job_runs)
        if job_runs and row.get("eager_s") is not None:  # the two routes must agree on the numbers
            row["max_abs_diff_head_mean"] = float((run_eager().cpu() - job_runs[-1]["mean"]).abs().max())
        ratio = lambda a, b: (row[a] / row[b]) if row.get(a) and row.get(b) else None  # noqa: E731
        row["job_over_sdpa"] = ratio("job_s", "sdpa_s")
        row["measure_over_sdpa"] = ratio("measure_s", "sdpa_s")
        row["eager_over_job"] = ratio("eager_s", "job_s")
        if gpu and row.get("sdpa_s") and row.get("job_s"):  # one profiled run each (None where it fails)
            row["gpu_busy_sdpa"], row["gpu_busy_job"] = gpu_busy(run_sdpa, args.device), gpu_busy(run_job, args.device)
        rows.append(row)
        save()
        fmt = lambda v, w, p=3: f"{v:>{w}.{p}f}" if isinstance(v, float) else f"{'-':>{w}}"  # noqa: E731
        print(f"{n:>8} {fmt(row.get('sdpa_s'), 9)} {fmt(row.get('job_s'), 9)} {fmt(row.get('measure_s'), 10)} "
              f"{fmt(row.get('eager_s'), 9)} {fmt(row['job_over_sdpa'], 9, 2)} {fmt(row['eager_over_job'], 10, 2)}  "
              f"{fmt(row.get('max_abs_diff_head_mean'), 8, 6)}")
        if row.get("gpu_busy_sdpa") is not None and row.get("gpu_busy_job") is not None:
            print(f"{'':>8} GPU busy (kernel time / wall, one profiled run): sdpa {100 * row['gpu_busy_sdpa']:.0f} %, "
                  f"job {100 * row['gpu_busy_job']:.0f} %")

    if not args.skip_longest:
        print(f"longest seq_len per route (1 window; doubling up to {max_seq}, or a run over {args.time_limit:.0f} s):")
        for key in ("sdpa", "job", "eager"):
            n, ok, why = min(seq_lens), None, f"reached --max-seq-len {max_seq}"
            while n <= max_seq:
                try:
                    windows = token_windows(loaded.tokenizer, documents, n, 1)
                except ValueError:
                    why = "dataset too short"
                    break
                t0 = time.perf_counter()
                try:
                    if key == "sdpa":
                        route_sdpa(loaded, windows, 1, args.device)
                    elif key == "eager":
                        route_eager(loaded, windows, 1, args.device)
                    else:
                        route_job(loaded, documents, n, 1, 1, dtype, args.device)
                    sync(args.device)
                except Exception as e:  # noqa: BLE001
                    why = f"out of memory at {n}" if is_oom(e) else f"{type(e).__name__} at {n}: {str(e)[:200]}"
                    break
                finally:
                    gc.collect()
                    if gpu:
                        torch.cuda.empty_cache()
                ok = n
                if time.perf_counter() - t0 > args.time_limit:
                    why = f"one run took over {args.time_limit:.0f} s at {n}"
                    break
                n *= 2
            longest[key] = {"seq_len": ok, "stopped": why}
            save()
            print(f"  {key:<6} {ok}  ({why})")


if __name__ == "__main__":
    main()
