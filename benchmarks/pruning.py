"""Benchmark: the `pruning` job's two passes against plain forward passes over the same windows.

  measure   the heads' terms: the forward with the hooks summing ‖o_{l,h,t}‖ (Gram form) and ‖h_{l,t}‖ (block
            pre-hooks) and the loss, against the same forward and loss without hooks
  evaluate  one pruned model's loss (half of the heads removed by the hooks), against the unpruned
            forward with the same cross-entropy
  importance the gradient importance: a forward and a backward pass to the heads' gates per batch, against
            the plain forward
  job       the whole job (default grid: 11 shares × 3 orders, 3 random draws), against as many plain
            forwards as it makes (1 measuring pass + one per distinct set of removed heads)

    python benchmarks/pruning.py                                       # tiny-gpt2 on CPU (seconds)
    python benchmarks/pruning.py --model bench-llama --seq-len 512 --windows 16 --json out.json   # GPU

Interleaved, best of --repeats, so a busy machine slows every route alike. Ratios near 1 mean the hooks
cost little next to the model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from lmscope.analyses import pruning
from lmscope.analyses.local import LocalContext
from lmscope.catalog import read_documents
from lmscope.config import Settings
from lmscope.modeling.windows import token_windows
from lmscope.params.pruning import PruningParams

from _common import load_spec, random_init, sync  # noqa: E402  (this folder, first on sys.path)


def bench_model(spec: str, dtype: str, device: str):
    if spec == "bench-llama":  # 12 layers, 12 query / 4 key-value heads, 768 wide, 32000-token head
        from transformers import LlamaConfig

        return random_init(spec, LlamaConfig(num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                                             hidden_size=768, intermediate_size=2048, vocab_size=32000,
                                             max_position_embeddings=4096), dtype, device)
    if spec == "bench-gpt2":
        from transformers import GPT2Config

        return random_init(spec, GPT2Config(), dtype, device)
    return load_spec(spec, dtype, device)


def best_of(repeats: int, fns: dict) -> dict[str, float]:
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--windows", type=int, default=16, help="measured windows, and as many evaluated")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = bench_model(args.model, args.dtype, device)
    model = loaded.model
    documents = read_documents(Settings.from_env().wikitext2_path, "lines")
    windows = token_windows(loaded.tokenizer, documents, args.seq_len, args.windows).to(device)
    heads = int(model.config.num_attention_heads)
    blocks = pruning.model_parts(model).blocks
    half = [divmod(i, heads) for i in range(0, len(blocks) * heads, 2)]
    count = lambda *_: None  # noqa: E731  (the job's progress callback)

    @torch.no_grad()
    def plain_loss():
        total = torch.zeros((), dtype=torch.float64, device=device)
        for start in range(0, len(windows), args.batch_size):
            ids = windows[start:start + args.batch_size]
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                     reduction="sum").double()
        float(total)  # one sync at the end, as the job's mean_loss

    def hooked(use):
        """Run use(hooks) with the job's hooks on the model, as the job does."""
        hooks = pruning.HeadHooks(blocks, heads, model.config)
        try:
            use(hooks)
        finally:
            hooks.close()
        sync(device)

    @torch.no_grad()
    def measured():
        hooked(lambda hooks: pruning.measure_terms(model, hooks, windows, args.batch_size, count))

    @torch.no_grad()
    def evaluated():
        def removed(hooks):
            hooks.remove_heads(half)
            pruning.mean_loss(model, windows, args.batch_size, count)
        hooked(removed)

    def importance():
        hooked(lambda hooks: pruning.gradient_importance(model, hooks, windows, args.batch_size, count))

    plain_loss(), measured(), importance()  # warm-up
    passes = best_of(args.repeats, {"plain_loss": plain_loss, "measure": measured, "evaluate": evaluated,
                                    "importance": importance})

    with tempfile.TemporaryDirectory() as out:
        ctx = LocalContext(out, models={"m": loaded}, datasets={"d": documents}, device=device)
        params = PruningParams(model="m", dataset="d", seq_len=args.seq_len, num_segments=args.windows,
                               eval_segments=args.windows, batch_size=args.batch_size, dtype=args.dtype)
        start = time.perf_counter()
        job = pruning.run(params, ctx)
        job_s = time.perf_counter() - start
    sets = ctx.progress_log[-1][1] // -(-args.windows // args.batch_size) - 1  # evaluations after the measuring pass
    floor = (1 + sets) * passes["plain_loss"]
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "model": args.model,
        "dtype": args.dtype, "seq_len": args.seq_len, "windows": args.windows, "batch_size": args.batch_size,
        "seconds": passes, "measure_ratio": passes["measure"] / passes["plain_loss"],
        "evaluate_ratio": passes["evaluate"] / passes["plain_loss"],
        "importance_ratio": passes["importance"] / passes["plain_loss"],
        "job_s": job_s, "sets_evaluated": sets, "job_stages": ctx.timings, "job_ratio": job_s / floor,
        "baseline_loss": job.summary["baseline_loss"],
    }
    print(f"{result['device']}, {args.model} {args.dtype}, {args.windows} windows × {args.seq_len} tokens, "
          f"batch {args.batch_size}")
    print(f"  measure  {passes['measure']:.3f} s vs plain forward {passes['plain_loss']:.3f} s: "
          f"{result['measure_ratio']:.2f}×")
    print(f"  evaluate {passes['evaluate']:.3f} s vs plain forward {passes['plain_loss']:.3f} s: "
          f"{result['evaluate_ratio']:.2f}×")
    print(f"  importance {passes['importance']:.3f} s vs plain forward {passes['plain_loss']:.3f} s: "
          f"{result['importance_ratio']:.2f}×")
    print(f"  job      {job_s:.2f} s vs {1 + sets} plain passes {floor:.2f} s: {result['job_ratio']:.2f}×  "
          f"(stages {', '.join(f'{k} {v:.2f}' for k, v in ctx.timings.items())})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
