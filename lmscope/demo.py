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


def run_job(client: Client, kind: str, params: dict, name: str) -> dict:
    print(f"\n== {kind}: {name}")
    job = client.submit(kind, params, name=name, tags=["demo"])
    print(f"  job {job['id']} queued")
    progress = ProgressLine(job["id"], sys.stdout)
    try:
        job = client.wait(job["id"], on_progress=progress)
    finally:
        progress.close()
    if job["status"] != "succeeded":
        err = job.get("error") or {}
        raise SystemExit(f"job {job['id']} {job['status']}: {err.get('type')}: {err.get('message')}")
    summary = job.get("summary") or {}
    print("  summary: " + json.dumps({k: v for k, v in summary.items() if not isinstance(v, (list, dict))})[:600])
    return job


def previous_training(client: Client, params: dict) -> dict | None:
    """A demo training run that already succeeded in this data directory, so a second `make demo` skips it."""
    for job in client.list(kind="train", status="succeeded", tag="demo"):  # full job documents
        # one trained before train wrote a step-0 checkpoint would leave the entropy curves without their start
        from_init = any(c.endswith("@step0") for c in (job.get("summary") or {}).get("checkpoints", []))
        if from_init and all(job["params"].get(k) == v for k, v in params.items() if k != "run_name"):
            print(f"\n== train: reusing job {job['id']} (delete {os.environ.get('LMSCOPE_DATA_DIR', '.demo')} to retrain)")
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

        print("\nResults (also at http://127.0.0.1:%d/v1/jobs):" % port)
        served = Settings.from_env(env)  # the server's settings: where it wrote the files
        for job in jobs:
            folder = served.job_dir(job["id"])
            plots = sorted(a["name"] for a in client.artifacts(job["id"]) if a["name"].endswith(".png"))
            print(f"  job {job['id']:>3} {job['kind']:<8} {folder}")
            for p in plots:
                print(f"             {folder / p}")
        print("\nBrowse them with `lmscope jobs`, `lmscope show ID`, `lmscope results ID`, or restart the service "
              f"with LMSCOPE_DATA_DIR={data_dir} lmscope up")
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
