"""Benchmark: a sweep child's training steps, eager against replayed from a CUDA graph, side by side.

One grid point per architecture of the Fig. 1 / Fig. 2 networks (n = 3, d = 4, d' = 64, k = 16, the
paper's 2,000 samples and batches of 64), each trained twice in this process: with every step launched
op by op (`cuda_graph=False`, the route before CUDA graphs) and with full batches replayed from a captured
graph (`TrainingSteps`, the default on a GPU). Prints the training time of each route, their ratio, and
how far apart their validation curves ended (the two routes run the same kernels, so ~0).

    python benchmarks/sumformer_steps.py                 # on the GPU (needs CUDA)
    python benchmarks/sumformer_steps.py --epochs 40     # shorter: the ratio settles within a few epochs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

ARCHITECTURES = ["poly_sumformer", "mlp_sumformer", "transformer", "linformer", "performer"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--architectures", nargs="+", default=ARCHITECTURES, choices=ARCHITECTURES)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    import torch

    from lmscope.analyses.local import LocalContext
    from lmscope.analyses.sumformer_fit import run_sumformer_fit
    from lmscope.params.sweep import SumformerFitParams

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device: CUDA graphs are a GPU route (on a CPU every step is eager)")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"sweep child training steps on {args.device} ({name}), torch {torch.__version__}, "
          f"{args.epochs} epochs of 2000 samples (1600 train, batches of 64)", flush=True)
    print("| architecture | eager s | graph s | eager/graph | route | max val_error rel diff |")
    print("| --- | --- | --- | --- | --- | --- |", flush=True)
    rows = []
    folder = Path(tempfile.mkdtemp(prefix="lmscope-steps-"))

    fig2 = json.loads((ROOT / "lmscope/examples/fig2_full.json").read_text())["train"]  # the paper's training

    def child(arch: str, epochs: int) -> SumformerFitParams:
        return SumformerFitParams(
            architecture=arch, target="fig2_poly", token_dim=4, seq_len=3, latent_dim=64, seed=0,
            features=16 if arch in ("linformer", "performer") else None, train={**fig2, "epochs": epochs})

    for graph in (False, True):  # untimed: the first use of the device (context, cuBLAS) is no route's cost
        run_sumformer_fit(child(args.architectures[0], 5), LocalContext(folder / "warm-up", device=args.device),
                          cuda_graph=graph)
    for arch in args.architectures:
        params = child(arch, args.epochs)
        runs = {}
        for route, graph in (("eager", False), ("graph", True)):
            ctx = LocalContext(folder / f"{arch}-{route}", device=args.device)
            out = run_sumformer_fit(params, ctx, cuda_graph=graph)
            val = next(s for s in out.series if s.name == "val_error")
            runs[route] = (out.summary["train_seconds"], list(val.y), ctx.environment.get("training_steps"))
        (te, ve, _), (tg, vg, route) = runs["eager"], runs["graph"]
        diff = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(ve, vg))
        row = {"architecture": arch, "eager_seconds": te, "graph_seconds": tg, "ratio": te / tg, "route": route,
               "max_val_error_rel_diff": diff}
        rows.append(row)
        print(f"| {arch} | {te:.2f} | {tg:.2f} | {te / tg:.2f} | {route} | {diff:.1e} |", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"device": args.device, "device_name": name, "torch": torch.__version__,
                                             "epochs": args.epochs, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
