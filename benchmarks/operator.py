"""Benchmark: the `operator` job's passes against plain forward passes over the same windows.

  plain     the model's own attention (sdpa), no weights returned: the floor
  eager     eager attention with output_attentions=True: what reading every layer's A costs without the job
  measure   the job's measuring pass (the model's eager attention through "lmscope_operator", each head's term
            and its change under the three replacements)
  job       the whole job: the mean pattern's pass, the measuring pass, the plots

    python benchmarks/operator.py                                       # tiny-gpt2 on CPU (seconds)
    python benchmarks/operator.py --model bench-llama --seq-len 512 --windows 16 --json out.json   # GPU

Interleaved, best of --repeats, so a busy machine slows every route alike.
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

from lmscope.analyses import operator
from lmscope.analyses.local import LocalContext
from lmscope.catalog import read_documents
from lmscope.config import Settings
from lmscope.kernels.hf import eager_attention
from lmscope.modeling.windows import token_windows
from lmscope.params.operator import OperatorParams

from _common import sync  # noqa: E402  (this folder, first on sys.path)
from pruning import best_of, bench_model  # noqa: E402  (the same bench-* models)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = bench_model(args.model, args.dtype, device)
    model = loaded.model
    documents = read_documents(Settings.from_env().wikitext2_path, "lines")
    windows = token_windows(loaded.tokenizer, documents, args.seq_len, args.windows).to(device)
    batches = operator.window_batches(len(windows), args.batch_size)
    heads = int(model.config.num_attention_heads)

    @torch.no_grad()
    def plain():
        for batch in batches:
            model(input_ids=windows[batch], use_cache=False)
        sync(device)

    @torch.no_grad()
    def eager():
        with eager_attention(model):
            for batch in batches:
                model(input_ids=windows[batch], use_cache=False, output_attentions=True)
        sync(device)

    with tempfile.TemporaryDirectory() as out:
        ctx = LocalContext(out, models={"m": loaded}, datasets={"d": documents}, device=device)
        params = OperatorParams(model="m", dataset="d", seq_len=args.seq_len, num_segments=args.windows,
                                batch_size=args.batch_size, dtype=args.dtype, replacements=["other_window",
                                                                                            "uniform"])

        def measure():
            operator.measure_operator(model, windows, params, heads, ctx, lambda stage: None)
            sync(device)

        plain(), eager(), measure()  # warm-up
        passes = best_of(args.repeats, {"plain": plain, "eager": eager, "measure": measure})
        # its own context: the stage timings above were summed into the first one
        ctx = LocalContext(Path(out) / "job", models={"m": loaded}, datasets={"d": documents}, device=device)
        start = time.perf_counter()
        job = operator.run(params.model_copy(update={"replacements": ["other_window", "mean", "uniform"]}), ctx)
        job_s = time.perf_counter() - start
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "model": args.model,
        "dtype": args.dtype, "seq_len": args.seq_len, "windows": args.windows, "batch_size": args.batch_size,
        "seconds": passes, "eager_ratio": passes["eager"] / passes["plain"],
        "measure_ratio": passes["measure"] / passes["plain"], "job_s": job_s, "job_stages": ctx.timings,
        "job_ratio": job_s / passes["plain"], "mean_input_dependence": job.summary["mean_input_dependence"],
    }
    print(f"{result['device']}, {args.model} {args.dtype}, {args.windows} windows × {args.seq_len} tokens, "
          f"batch {args.batch_size}")
    print(f"  eager    {passes['eager']:.3f} s vs plain forward {passes['plain']:.3f} s: {result['eager_ratio']:.2f}×")
    print(f"  measure  {passes['measure']:.3f} s vs plain forward {passes['plain']:.3f} s: "
          f"{result['measure_ratio']:.2f}×  (other_window and uniform)")
    print(f"  job      {job_s:.2f} s vs one plain pass: {result['job_ratio']:.1f}×  "
          f"(stages {', '.join(f'{k} {v:.2f}' for k, v in ctx.timings.items())})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
