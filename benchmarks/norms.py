"""Benchmark: the `norms` job against a plain forward pass over the same tokens, and the Gram condition's cost.

Over the same WikiText-2 samples (same batches, same right padding):

  forward     model(input_ids, attention_mask).logits with the model's own attention (sdpa): the floor
  job         the whole `norms` job without the Gram condition (hidden states, norms, PCA, inner loss,
              artifacts, plots); target ≤ 1.3× the forward on GPU. Twice: with the inner loss's last
              block computed at the current tokens only (the job's route for GPT-2 / LLaMA-family
              blocks) and by re-running the whole block on all positions (the generic route). Also
              reported: the job without the inner loss, and the job's measuring stages only
              (forward + inner loss + pca, no plots)
  gram        the "gram condition" stage per (sample, layer) pair: the linearised layer applied to x
              (matrix-vector products, float64) and its forward passes, batched on the device
              (GPT-2-style models only)

    python benchmarks/norms.py                                  # tiny-gpt2 on CPU (seconds)
    python benchmarks/norms.py --model bench-gpt2 --samples 16 --max-tokens 128 --batch-size 8 --threads 1  # CPU
    python benchmarks/norms.py --model bench-gpt2 --samples 512 --json out.json     # GPT-2-small shape, GPU

The routes run interleaved, best of --repeats each, so a busy shared machine slows them alike. On a
GPU the job's loop never waits for the device, so its stage times are the host's (the wait for the
queued work is timed as "forward"): the inner loss's cost there is the job against the job without it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from lmscope.analyses import norms
from lmscope.analyses.base import LoadedModel
from lmscope.analyses.linearised_layer import linearisable
from lmscope.analyses.local import LocalContext
from lmscope.catalog import read_documents
from lmscope.config import Settings
from lmscope.modeling.loading import DTYPES
from lmscope.params.norms import NormsParams

from _common import gpu_busy, load_spec, random_init, sync  # noqa: E402  (this folder, first on sys.path)

WIKITEXT = Settings.from_env().wikitext2_path


def bench_model(spec: str, dtype: str, device: str) -> LoadedModel:
    """`bench-gpt2` (GPT-2 small: 12 layers, 12 heads, 768 wide, 50257-token head), `bench-llama` (the same
    size as a LLaMA: 12 layers, 12 query / 4 key-value heads, 768 wide, 32000-token head), a built-in,
    or an HF dir. Random weights: the timings do not depend on them."""
    if spec in ("bench-gpt2", "bench-llama"):
        from transformers import GPT2Config, LlamaConfig

        config = GPT2Config() if spec == "bench-gpt2" else LlamaConfig(
            num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, hidden_size=768,
            intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048)
        return random_init(spec, config, dtype, device)
    return load_spec(spec, dtype, device)


@torch.no_grad()
def plain_forward(lm: LoadedModel, params: NormsParams, documents, device: str) -> float:
    """Seconds for model(...).logits over exactly the job's batches."""
    samples = norms.select_samples(lm.tokenizer, documents, params)
    pad = 0  # what the job pads with (masked positions)
    start = time.perf_counter()
    for batch, _ in norms.batches(samples, params.batch_size):
        ids, mask = norms.pad_batch(samples, batch, pad, device)
        lm.model(input_ids=ids, attention_mask=mask).logits
    sync(device)
    return time.perf_counter() - start


def job(lm: LoadedModel, params: NormsParams, documents, device: str,
        route: str = "auto") -> tuple[float, LocalContext, dict]:
    """The whole job; route "full" makes the inner loss re-run the whole last block (the generic path)."""
    with tempfile.TemporaryDirectory() as d:
        ctx = LocalContext(d, models={lm.name: lm}, datasets={"wiki": documents}, device=device)
        start = time.perf_counter()
        out = norms.run(params, ctx, inner_loss_route=route)
        sync(device)
        return time.perf_counter() - start, ctx, out.summary


def measuring(ctx: LocalContext) -> float:
    """Seconds of the job's measuring stages (no artifacts, no plots)."""
    return sum(ctx.timings.get(k, 0.0) for k in ("forward", "inner loss", "pca"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="bench-gpt2 | tiny-gpt2 | tiny-llama | HF directory "
                                                  "(default: bench-gpt2 on GPU, tiny-gpt2 on CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--gram-samples", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs per route")
    ap.add_argument("--position", default="last", choices=["last", "all"])
    ap.add_argument("--min-position", type=int, default=5)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (CPU: 1 makes shared machines comparable)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = args.model or ("bench-gpt2" if args.device.startswith("cuda") else "tiny-gpt2")
    lm = bench_model(spec, args.dtype, args.device)
    documents = read_documents(WIKITEXT, "lines")
    base = dict(model=lm.name, dataset="wiki", max_samples=args.samples, max_tokens=args.max_tokens,
                batch_size=args.batch_size, dtype=args.dtype, loss_filter=None, gram_condition=False,
                position=args.position, min_position=args.min_position)

    routes = {  # name → one timed run; a float, or (seconds, context, summary)
        "forward": lambda: plain_forward(lm, NormsParams(**base), documents, args.device),
        "job": lambda: job(lm, NormsParams(**base), documents, args.device),
        "job_full_block": lambda: job(lm, NormsParams(**base), documents, args.device, route="full"),
        "job_without_inner_loss": lambda: job(lm, NormsParams(**base, inner_loss=False), documents, args.device),
    }
    runs = {name: [] for name in routes}
    # `timeout -s INT` (gpu_suite.sh) stops a run like Ctrl-C: report the repeats that finished, and write
    # the JSON before the optional extras (a profiled run each, the Gram condition), then again after them.
    repeats = 0
    try:
        for name, fn in routes.items():
            fn()  # warm-up: kernels compiled, caches filled
        for _ in range(args.repeats):  # interleaved: a noisy neighbour slows every route alike
            for name, fn in routes.items():
                runs[name].append(fn())
            repeats += 1
            print(f"  repeat {repeats}/{args.repeats}: " + ", ".join(
                f"{name} {seconds(r[-1]):.3f} s" for name, r in runs.items()), flush=True)
    except KeyboardInterrupt:
        if repeats == 0:
            print("stopped before every route had run once: nothing to report", flush=True)
            raise SystemExit(130) from None
        print(f"stopped after {repeats} of {args.repeats} repeats: the best of those", flush=True)
        runs = {name: r[:repeats] for name, r in runs.items()}  # the stopped repeat ran some routes only
    best = {name: min(r, key=seconds) for name, r in runs.items()}
    forward_s = best["forward"]
    job_s, ctx, summary = best["job"]
    full_s, full_ctx, _ = best["job_full_block"]
    no_loss_s, _, _ = best["job_without_inner_loss"]
    inner = {name: min(r[1].timings["inner loss"] for r in runs[name]) for name in ("job", "job_full_block")}
    result = {
        "model": spec, "device": args.device, "dtype": args.dtype, "samples": summary["samples"],
        "trajectories": summary["trajectories"], "position": args.position, "tokens": args.max_tokens,
        "batch_size": args.batch_size, "threads": torch.get_num_threads(), "repeats": repeats,
        "repeats_requested": args.repeats,
        "kernel_backend": ctx.environment.get("kernel_backend"),
        "forward_s": forward_s, "job_s": job_s, "job_ratio": job_s / forward_s,
        "measuring_stages_ratio": measuring(ctx) / forward_s,
        "job_full_block_s": full_s, "job_full_block_ratio": full_s / forward_s,
        "measuring_stages_full_block_ratio": measuring(full_ctx) / forward_s,
        "job_without_inner_loss_ratio": no_loss_s / forward_s,
        "inner_loss_s": inner["job"], "inner_loss_full_block_s": inner["job_full_block"],
        "stage_s": ctx.timings,
    }
    print(f"{spec} on {args.device} ({args.dtype}, {result['threads']} threads), {result['samples']} samples × "
          f"≤{args.max_tokens} tokens, position={args.position} ({result['trajectories']} trajectories), "
          f"batch {args.batch_size}, attention: {result['kernel_backend']}, best of {repeats}")
    print(f"  plain forward                            {forward_s:8.3f} s")
    print(f"  norms job (no Gram)                      {job_s:8.3f} s   {result['job_ratio']:5.2f}×   "
          f"(measuring stages only {result['measuring_stages_ratio']:.2f}×)")
    print(f"  norms job, whole last block re-run       {full_s:8.3f} s   {result['job_full_block_ratio']:5.2f}×   "
          f"(measuring stages only {result['measuring_stages_full_block_ratio']:.2f}×)")
    print(f"  norms job, no inner loss                 {no_loss_s:8.3f} s   "
          f"{result['job_without_inner_loss_ratio']:5.2f}×")
    print(f"  inner loss stage: {inner['job']:.3f} s at the current tokens vs {inner['job_full_block']:.3f} s "
          f"re-running the whole block")
    print("  stages: " + ", ".join(f"{k} {v:.3f} s" for k, v in ctx.timings.items()), flush=True)
    write_json(args.json, result)
    if repeats < args.repeats:
        raise SystemExit(130)  # stopped: what it measured is written, the exit status says it was cut short
    try:
        extras(args, lm, base, documents, routes, result)
    except KeyboardInterrupt:
        print("stopped during the extras (profiled runs, Gram condition): the rows above stand", flush=True)
        result["stopped"] = "during the extras"
        write_json(args.json, result)
        raise SystemExit(130) from None
    write_json(args.json, result)


def seconds(run) -> float:
    """A route's time: a float, or the first of (seconds, context, summary)."""
    return run if isinstance(run, float) else run[0]


def write_json(path: Path | None, result: dict) -> None:
    if path:
        path.write_text(json.dumps(result, indent=2))


def extras(args, lm, base, documents, routes, result) -> None:
    """One profiled run per route (how busy the GPU is; None on CPU), and the Gram condition's cost."""
    result["gpu_busy_forward"] = gpu_busy(routes["forward"], args.device)
    result["gpu_busy_job"] = gpu_busy(routes["job"], args.device)
    if result["gpu_busy_forward"] is not None and result["gpu_busy_job"] is not None:
        print(f"  GPU busy (kernel time / wall, one profiled run): forward {100 * result['gpu_busy_forward']:.0f} %, "
              f"job {100 * result['gpu_busy_job']:.0f} %  (well below 100 %: the host sets the pace)", flush=True)
    if all(linearisable(b) for b in norms.model_parts(lm.model).blocks) and args.gram_samples:
        gram_params = NormsParams(**{**base, "gram_condition": True, "inner_loss": False, "pca_samples": 0,
                                     "gram_samples": args.gram_samples})
        job(lm, gram_params, documents, args.device)
        _, gctx, gsum = min((job(lm, gram_params, documents, args.device) for _ in range(args.repeats)),
                            key=lambda r: r[1].timings["gram condition"])
        pairs = gsum["gram_condition_pairs"] + gsum.get("gram_condition_nonfinite", 0)  # every pair it computed
        result.update(gram_pairs=pairs, gram_s=gctx.timings["gram condition"],
                      gram_ms_per_pair=1e3 * gctx.timings["gram condition"] / pairs)
        print(f"  Gram condition           {result['gram_s']:8.3f} s for {result['gram_pairs']} (sample, layer) pairs"
              f" = {result['gram_ms_per_pair']:.2f} ms per pair (float64, incl. its forward passes)", flush=True)


if __name__ == "__main__":
    main()
