"""`make demo`: the embedded service end to end on WikiText-2.

Starts `lmscope up` (SQLite, in-process worker) in a subprocess, trains a small GPT-2-style model on
the built-in `wikitext-2` dataset, then runs the analyses on it — norm trajectories, attention
entropy over the training checkpoints, head pruning and the attention map's input dependence over the
checkpoints, and a reduced Sumformer sweep
plus the Performer/Linformer attention study — and prints where every result and plot is.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from lmscope import examples
from lmscope.cli import ProgressLine
from lmscope.client import Client, LmscopeError
from lmscope.config import Settings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def example(name: str) -> dict:
    return json.loads(examples.read_bytes(name))


DOCS = {"train": "docs/models-and-datasets.md", "norms": "docs/analyses/norms.md", "entropy": "docs/analyses/entropy.md",
        "pruning": "docs/analyses/pruning.md", "operator": "docs/analyses/operator.md", "sweep": "docs/analyses/sweep.md"}


def _head(h: dict, key: str) -> str:
    return f"layer {h['layer']} head {h['head']} ({h[key]:.2f})"


def headline(job: dict, children: list[dict] | None = None) -> list[str]:
    """What a researcher reads off the job's summary, in a sentence or two (the full summary: `lmscope show ID`)."""
    s, kind = job.get("summary") or {}, job["kind"]
    if kind == "train":
        return [f"validation loss {s['val_loss']:.2f} nats after {s['steps']} steps ({s['num_parameters'] / 1e6:.1f}M "
                f"parameters); a unigram model's cross-entropy on the same text is {s['unigram_entropy']:.2f} nats, so "
                f"the {s['unigram_entropy'] - s['val_loss']:.2f} nats below it come from reading the context",
                f"checkpoints: {', '.join(s['checkpoints'])}"]
    if kind == "norms":
        lines = [f"the current token's norm grows at every layer in {s['sequence_pct']:.1f} % of {s['samples']} samples "
                 f"(chance: {s['null_sequence_pct']:.1f} %); {s['pair_pct']:.1f} % of consecutive layer pairs grow",
                 *([f"inner loss through the last block, from the last layer: {s['inner_loss_final_mean']:.2f} nats"]
                   if s.get("inner_loss_final_mean") is not None else [])]
        if s.get("gram_condition_pct") is not None:
            lines.append(f"Proposition 1's Gram condition holds in {s['gram_condition_pct']:.0f} % of "
                         f"{s['gram_condition_pairs']} (sample, layer) pairs")
        return lines
    if kind == "entropy":
        per_layer = ", ".join(f"{v:.2f}" for v in s["mean_entropy_per_layer"])
        return [f"at {s.get('summary_of', 'the model')}: mean attention entropy {s['mean_entropy']:.2f} nats, "
                f"{100 * s['normalized_mean_entropy']:.0f} % of uniform attention's; by layer {per_layer}",
                f"most focused head: {_head(s['lowest_entropy_head'], 'value')}; closest to mean pooling: "
                f"{_head(s['highest_entropy_head'], 'value')}; curves over {len(s.get('models', [1]))} checkpoints "
                "in entropy_over_training.png"]
    if kind == "pruning":
        units = s["units"]
        shares = ", ".join(f"{order} {round(share * units)}" for order, share in s["prunable_fraction"].items())
        what = {"head": "heads", "kv_group": "key/value groups", "layer": "layers' attention"}.get(s.get("unit"), "units")
        lines = [f"at {s['model']}: unpruned loss {s['baseline_loss']:.3f} nats; of its {units} {what}, removable with "
                 f"the loss within +{s['tolerance']:.0%}: {shares}"]
        rho = (s.get("single_head") or {}).get("rank_correlation")
        if rho is not None:
            lines.append(f"a head's term size ranks the heads as removing each alone does: Spearman ρ = {rho:.2f}")
        return lines
    if kind == "operator":
        means = ", ".join(f"{r} {v:.2f}" for r, v in s["mean_input_dependence"].items() if v is not None)
        least = s["least_input_dependent_heads"][0]
        return [f"at {s['model']}: how far each head's map W'(x) changes with its input (0: the same map for every "
                f"input), mean over heads: {means}",
                f"least input-dependent head: {_head(least, 'input_dependence')}"]
    if kind == "sweep":
        points = ""
        if children:
            ids = sorted(c["id"] for c in children)
            points = f"{len(ids)} grid points (jobs {ids[0]}–{ids[-1]}); "
        if s.get("study") == "attention":
            errors = ", ".join(f"{m} {v:.2g}" for m, v in s["rel_error_at_max_features"].items())
            times = ", ".join(f"{m} {v:.2f}×" for m, v in s["time_ratio_at_max_features"].items())
            return [points + f"relative error against exact attention at the most features: {errors}; "
                    f"time against the exact kernel: {times}"]
        best = "; ".join(f"{b['architecture']} d={b['token_dim']} n={b['seq_len']}: {b['best_val_error']:.3g} at "
                         f"d′={b['best_latent_dim']}" for b in s.get("best", [])[:4])
        return [points + f"best validation error per line: {best}"]
    return [json.dumps({k: v for k, v in s.items() if not isinstance(v, (list, dict))})[:300]]


def run_job(client: Client, kind: str, params: dict, name: str) -> dict:
    print(f"\n== {kind}: {name}")
    job = client.submit(kind, params, name=name, tags=["demo"])
    progress = ProgressLine(job["id"], sys.stdout)
    try:
        job = client.wait(job["id"], on_progress=progress)
    finally:
        progress.close()
    if job["status"] != "succeeded":
        err = job.get("error") or {}
        raise SystemExit(f"job {job['id']} {job['status']}: {err.get('type')}: {err.get('message')}")
    took = (job.get("timings") or {}).get("run_seconds")
    if took is not None:
        print(f"  took {took:.0f} s")
    say(client, job)
    return job


def say(client: Client, job: dict) -> None:
    """The job's headline, and where to read more."""
    children = list(client.list(parent=job["id"])) if job["kind"] == "sweep" else None
    try:
        lines = headline(job, children)
    except (KeyError, TypeError, IndexError):  # a summary of another shape: its plain values, rather than no demo
        lines = headline({**job, "kind": "other"})
    for line in lines:
        print("  " + line)
    print(f"  (all of it: `lmscope show {job['id']}`; what the numbers mean: {DOCS.get(job['kind'], 'README.md')})")


def previous_training(client: Client, params: dict) -> dict | None:
    """A demo training run that already succeeded in this data directory, so a second `make demo` skips it."""
    for job in client.list(kind="train", status="succeeded", tag="demo"):  # full job documents
        # one trained before train wrote a step-0 checkpoint would leave the entropy curves without their start
        from_init = any(c.endswith("@step0") for c in (job.get("summary") or {}).get("checkpoints", []))
        if from_init and all(job["params"].get(k) == v for k, v in params.items() if k != "run_name"):
            print(f"\n== train: reusing job {job['id']} (delete {os.environ.get('LMSCOPE_DATA_DIR', '.demo')} to retrain)")
            say(client, job)
            return job
    return None


def main() -> None:
    data_dir = Path(os.environ.get("LMSCOPE_DATA_DIR", Path.cwd() / ".demo")).resolve()
    port = int(os.environ.get("LMSCOPE_PORT", _free_port()))
    env = dict(os.environ, LMSCOPE_DATA_DIR=str(data_dir), LMSCOPE_PORT=str(port), LMSCOPE_AUTH="0")
    for elsewhere in ("LMSCOPE_BROKER_URL", "LMSCOPE_DATABASE_URL", "LMSCOPE_ARTIFACT_DIR"):
        env.pop(elsewhere, None)  # the demo keeps everything in data_dir, where it says its files are
    log = open(data_dir.with_suffix(".log"), "w") if data_dir.parent.exists() else subprocess.DEVNULL
    print(f"lmscope demo: embedded service on http://127.0.0.1:{port}, data in {data_dir}")
    print("  seven jobs, one after another: train a 1.1M-parameter GPT-2-style model on WikiText-2 (about 2 minutes on "
          "two cores; a second `make demo` reuses it), then norms, entropy, pruning and operator on it, a reduced "
          "Sumformer sweep and a Performer/Linformer attention study; about 5 minutes in all")
    server = subprocess.Popen([sys.executable, "-m", "lmscope.cli", "up"], env=env, stdout=log, stderr=subprocess.STDOUT)
    client = Client(f"http://127.0.0.1:{port}", token=None)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                client.request("GET", "/readyz")
                break
            except Exception:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"lmscope up did not start; see {data_dir.with_suffix('.log')}")
                time.sleep(0.5)

        datasets = {d["name"] for d in client.datasets()}
        if "wikitext-2" not in datasets:
            raise SystemExit("the built-in dataset wikitext-2 is missing: set LMSCOPE_WIKITEXT2_PATH to wiki.test.raw")

        params = example("train_demo.json")
        train = previous_training(client, params)
        if train is None:
            # An earlier demo run that did not finish left `demo@step…` checkpoints: train under a new name.
            taken = {m["name"].split("@")[0] for m in client.models() if m.get("source") == "checkpoint"}
            n = 1
            while params["run_name"] in taken:
                n += 1
                params["run_name"] = f"demo-{n}"
            train = run_job(client, "train", params, "demo: GPT-2-style model on WikiText-2")
        checkpoints = train["summary"]["checkpoints"]
        final_model = checkpoints[-1]
        jobs = [train]
        jobs.append(run_job(client, "norms", dict(example("norms_demo.json"), model=final_model),
                            f"demo: norm trajectories of {final_model}"))
        jobs.append(run_job(client, "entropy", dict(example("entropy_demo.json"), train_job=train["id"]),
                            "demo: attention entropy over training"))
        jobs.append(run_job(client, "pruning", dict(example("pruning_demo.json"), train_job=train["id"]),
                            "demo: removing attention heads, across training"))
        jobs.append(run_job(client, "operator", dict(example("operator_demo.json"), train_job=train["id"]),
                            "demo: input dependence of the attention map, across training"))
        jobs.append(run_job(client, "sweep", example("fig2.json"), "demo: reduced Sumformer Fig. 2 sweep"))
        jobs.append(run_job(client, "sweep", dict(example("attention_study_demo.json"), model=final_model),
                            f"demo: Performer/Linformer vs softmax attention on {final_model}"))

        print("\nResults:")
        served = Settings.from_env(env)  # the server's settings: where it wrote the files
        for job in jobs:
            folder = served.job_dir(job["id"])
            plots = sorted(a["name"] for a in client.artifacts(job["id"]) if a["name"].endswith(".png"))
            print(f"  job {job['id']:>3} {job['kind']:<8} {folder}")
            for p in plots:
                print(f"             {folder / p}")
        again = os.environ.get("LMSCOPE_PORT", "8765")  # what `lmscope up` binds, as the demo's own server did
        print(f"\nThe demo's service stops now. To browse the results, start it again on the same data:\n"
              f"  LMSCOPE_DATA_DIR={data_dir} LMSCOPE_AUTH=0 lmscope up\n"
              f"then open http://127.0.0.1:{again}/ (the dashboard: plots, curves, comparisons), or in another shell "
              "`lmscope jobs`, `lmscope show ID`, `lmscope results ID --format csv`"
              + ("" if again == "8765" else f" with LMSCOPE_URL=http://127.0.0.1:{again}"))
    except LmscopeError as e:
        raise SystemExit(f"demo failed: {e}")
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        if log is not subprocess.DEVNULL:
            log.close()


if __name__ == "__main__":
    main()
