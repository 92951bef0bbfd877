"""Benchmark: how long a Sumformer sweep (Fig. 1 / Fig. 2) takes on this device, grid point by grid point.

Runs the sweep's children (`run_sumformer_fit`, exactly what a worker runs for each child) in
`--processes` parallel processes on `--device`, then the parent's aggregation, and reports the wall
time, the training time per child and — when `--limit` runs only some of the grid points, spread
evenly over it — the extrapolated wall time of the whole grid. Without `--limit` the aggregated
figures (`fig1_training.png` / `fig2_latent_dim.png`) are written to `--out`, as the service would.

    python benchmarks/sweep.py --limit 8                                        # CPU, a sample of fig2_full
    python benchmarks/sweep.py --device cuda --processes 8 --json sweep.json    # the full Fig. 2 on a GPU
    python benchmarks/sweep.py ... --results children.jsonl   # again after a time limit: runs the rest

With `--results`, every finished child is appended to that file as it ends, and a later run with the
same file, device and process count trains only the grid points it lacks or that failed (a device
call's time limit stops a run midway); the wall time reported is then those runs' together.

Several processes share one GPU well here: the networks are tiny, so a child's step is bound by kernel
launches, not arithmetic. On a CPU each child trains on one thread, so use one process per core.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

ROOT = Path(__file__).resolve().parent.parent


def run_child(index: int, params: dict, device: str, folder: str) -> dict:
    """One grid point, in a worker process: what `run_sumformer_fit` reports, plus its wall time.
    A child that fails (e.g. training diverged) is reported as failed, as the service would."""
    from lmscope.analyses.local import LocalContext
    from lmscope.analyses.sumformer_fit import run_sumformer_fit
    from lmscope.params import validate_params

    import torch

    # one CPU thread per process: 8 processes with torch's default thread pool each would oversubscribe
    # the cores, and on a GPU these small models are bound by Python's kernel launches anyway
    torch.set_num_threads(1)
    start = time.perf_counter()
    ctx = LocalContext(Path(folder) / f"child{index}", device=device)
    try:
        out = run_sumformer_fit(validate_params("sumformer_fit", params, internal=True), ctx)
    except Exception as e:  # noqa: BLE001  (one grid point must not stop the others)
        return {"index": index, "wall_seconds": time.perf_counter() - start, "error": f"{type(e).__name__}: {e}"}
    return {"index": index, "wall_seconds": time.perf_counter() - start, "summary": out.summary,
            "training_steps": ctx.environment.get("training_steps"),
            "series": [(s.name, list(s.x), list(s.y), dict(s.labels)) for s in out.series]}


def run_child_args(args: tuple) -> dict:
    return run_child(*args)


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def pick_evenly(count: int, limit: int | None) -> list[int]:
    """`limit` indices spread over range(count) (all of them when limit is None or ≥ count)."""
    if limit is None or limit >= count:
        return list(range(count))
    return sorted({round(i * (count - 1) / max(1, limit - 1)) for i in range(limit)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default=str(ROOT / "lmscope/examples/fig2_full.json"), help="a sweep's params (JSON)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--processes", type=int, default=1, help="children trained at the same time")
    ap.add_argument("--limit", type=int, default=None, help="run only this many grid points, spread over the grid")
    ap.add_argument("--out", default=None, help="folder for the children's and the parent's plots (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument("--results", default=None, help="JSON lines of the finished children: appended to, and "
                                                      "read back to resume a run that was stopped")
    args = ap.parse_args()
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be at least 1")
    if args.processes < 1:
        ap.error("--processes must be at least 1")

    import torch

    from lmscope.analyses.base import ChildResult, Series
    from lmscope.analyses.local import LocalContext
    from lmscope.analyses.sweep import aggregate
    from lmscope.params import validate_params
    from lmscope.params.sweep import expand_sweep

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sweep = validate_params("sweep", json.loads(Path(args.params).read_text()))
    children = expand_sweep(sweep)
    chosen = pick_evenly(len(children), args.limit)
    out = Path(args.out or tempfile.mkdtemp(prefix="lmscope-sweep-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({torch.get_num_threads()} threads)"
    print(f"{Path(args.params).name}: {len(children)} grid points, running {len(chosen)} on {device} ({name}) "
          f"in {args.processes} process(es)", flush=True)

    results, earlier_wall = [], 0.0
    log = Path(args.results) if args.results else None
    if log is not None and log.exists():  # a run stopped midway: keep what it finished on this setup
        text_all = log.read_text()
        if text_all and not text_all.endswith("\n"):
            with log.open("a") as f:  # end a line cut off mid-write, so the next one starts on its own
                f.write("\n")
        lines = []
        for text in text_all.splitlines():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:  # the last line of a run killed while writing it
                continue
        lines = [line for line in lines if line.get("device") == device and line.get("processes") == args.processes
                 and line["index"] in chosen and children[line["index"]].params == line["params"]
                 and "error" not in line["result"]]  # a failed child is tried again
        done = {line["index"]: line["result"] for line in lines}
        results.extend(done.values())
        # each earlier run's wall time: when its last child ended
        runs: dict[str, float] = {}
        for line in lines:
            runs[line["run"]] = max(runs.get(line["run"], 0.0), line["after_seconds"])
        earlier_wall = sum(runs.values())
        print(f"resuming from {log}: {len(results)} children done in {duration(earlier_wall)}", flush=True)
    run_id = f"{time.time():.0f}"
    done_before = {r["index"] for r in results}
    todo = [i for i in chosen if i not in done_before]

    def summarise(wall: float) -> dict:
        ok = [r for r in results if "error" not in r]
        train = [r["summary"]["train_seconds"] for r in ok] or [float("nan")]
        return {
            "params": Path(args.params).name, "device": device, "device_name": name, "processes": args.processes,
            "torch": torch.__version__, "grid_points": len(children), "planned": len(chosen), "ran": len(results),
            "failed": [children[r["index"]].name + ": " + r["error"] for r in results if "error" in r],
            "wall_seconds": round(wall, 1), "resumed_children": len(done_before),
            "train_seconds_mean": round(statistics.mean(train), 2),
            "train_seconds_max": round(max(train), 2),
            "extrapolated_grid_wall_seconds": round(wall * len(children) / max(1, len(results)), 1),
            # eager, cuda_graph, or eager with the reason the capture failed (TrainingSteps)
            "training_steps": dict(collections.Counter(str(r.get("training_steps")) for r in ok)),
        }

    def save(report: dict) -> None:
        if args.json:  # after every child, so a run stopped by a time limit still leaves its numbers
            Path(args.json).write_text(json.dumps(report, indent=2))

    start = time.perf_counter()
    stopped = False
    # spawn: a CUDA context does not survive fork. The workers ignore SIGINT: a stop (Ctrl-C, `timeout -s INT`)
    # is this process's, which keeps what has finished, ends the workers at once and still reports.
    pool = multiprocessing.get_context("spawn").Pool(args.processes, initializer=signal.signal,
                                                     initargs=(signal.SIGINT, signal.SIG_IGN))
    try:
        for r in pool.imap_unordered(run_child_args, [(i, children[i].params, device, str(out)) for i in todo]):
            results.append(r)
            after = time.perf_counter() - start
            if log is not None:
                with log.open("a") as f:
                    f.write(json.dumps({"index": r["index"], "params": children[r["index"]].params, "run": run_id,
                                        "device": device, "processes": args.processes,
                                        "after_seconds": round(after, 2), "result": r}) + "\n")
            what = (f"FAILED: {r['error']}" if "error" in r else
                    f"{r['summary']['train_seconds']:.1f} s training, best val error {r['summary']['best_val_error']:.3g}")
            print(f"  [{len(results)}/{len(chosen)}] {children[r['index']].name}: {what}", flush=True)
            save(summarise(earlier_wall + after))
    except KeyboardInterrupt:
        stopped = True
        print(f"stopped with {len(results)} of {len(chosen)} children done"
              + (f"; run again with --results {log} to train the rest" if log else ""), flush=True)
    finally:
        pool.terminate()
        pool.join()
    wall = earlier_wall + time.perf_counter() - start

    report = summarise(wall)
    report["stopped"] = stopped
    if len(chosen) == len(children) and not stopped:
        child_results = [
            ChildResult(r["index"], "sumformer_fit", children[r["index"]].params, "failed", None, [], error=r["error"])
            if "error" in r else
            ChildResult(r["index"], "sumformer_fit", children[r["index"]].params, "succeeded", r["summary"],
                        [Series(*s) for s in r["series"]])
            for r in results]
        parent = aggregate(sweep, child_results, LocalContext(out))
        report["plots"] = [str(out / p) for p in parent.summary["plots"]]

    print()
    print("| sweep | device | processes | grid points run | wall | training per child (mean / max) | whole grid |")
    print("|---|---|---|---|---|---|---|")
    whole = report["extrapolated_grid_wall_seconds"]
    print(f"| {report['params']} | {name} | {args.processes} | {len(results)}/{len(children)} | {duration(wall)} | "
          f"{report['train_seconds_mean']:.1f} s / {report['train_seconds_max']:.1f} s | "
          f"{duration(whole)}{'' if len(chosen) == len(children) else ' (extrapolated)'} |")
    print(f"training steps: {report['training_steps']}")
    for failure in report["failed"]:
        print(f"failed: {failure}")
    for plot in report.get("plots", []):
        print(f"plot: {plot}")
    save(report)


if __name__ == "__main__":
    main()
