"""benchmarks/gpu_suite.sh's control flow, without a GPU: a GPU session has 15 minutes of device time, so the
one call it makes (`session`) must run its steps in order, stop each at its limit, skip what no longer fits,
and bring back at most 8 plainly named files. A stand-in python records the steps instead of running them
(and passes the suite's import checks, `python -c ...`, at once)."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAND_IN = """#!/usr/bin/env bash
if [[ "$1" == "-c" ]]; then [[ "$2" == *"imports: ok"* ]] && echo "lmscope imports: ok"; exit 0; fi
echo "$*" >> "$STEPS_LOG"
exec sleep "${STAND_IN_SECONDS:-0}"
"""
SESSION_ORDER = [
    "-m pytest .* -m gpu tests/analyses/test_sweep.py -k cuda_graph or captured or failed_capture$",
    "benchmarks/sumformer_steps.py --epochs 60 ",
    "benchmarks/sweep.py --device cuda --processes 16 ",
    r"-m pytest .* -m gpu -k not \(cuda_graph or captured or failed_capture\) tests/analyses$",
    "-m pytest .* -m not slow tests/kernels$",
    "benchmarks/attention.py --dims 64 128 --ns 4096 16384 --no-options$",
    "benchmarks/norms.py --model bench-gpt2 --device cuda ",
    "benchmarks/entropy.py --model bench-llama-1b --device cuda ",
]


def run_suite(tmp_path: Path, part: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    out, steps = tmp_path / "out", tmp_path / "steps.log"
    steps.touch()
    environment = {**os.environ, "PYTHON": str(stand_in), "OUT": str(out), "STEPS_LOG": str(steps),
                   "SUITE_WORK": str(tmp_path / "work"), "SWEEP_RESULTS": str(tmp_path / "children.jsonl"),
                   "SWEEP_OUT": str(tmp_path / "figures"), **env}
    done = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_suite.sh"), part], env=environment,
                          capture_output=True, text=True, timeout=120)
    return done, steps.read_text().splitlines(), out


def test_session_runs_every_step_in_order_and_brings_back_few_plain_files(tmp_path):
    done, steps, out = run_suite(tmp_path, "session")
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(steps) == len(SESSION_ORDER), steps
    for line, pattern in zip(steps, SESSION_ORDER):
        assert re.search(pattern, line), (pattern, line)
    assert "lmscope imports: ok" in (out / "device.txt").read_text()
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"device.txt", "session.log", "results.tgz"} <= {p.name for p in files}
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files)
    with tarfile.open(out / "results.tgz") as packed:  # the per-step logs travel packed
        names = {Path(n).name for n in packed.getnames()}
    assert {"tests.log", "sweep.log", "attention.md"} <= names
    assert "skipped" not in (out / "session.log").read_text()


def test_session_skips_what_no_longer_fits_and_names_it(tmp_path):
    """33 s in all, 30 s the least a step may have: the first step runs (4 s), then every other one is skipped."""
    done, steps, out = run_suite(tmp_path, "session", SUITE_SECONDS="33", MIN_STEP_SECONDS="30", SUITE_RESERVE="0",
                                 STAND_IN_SECONDS="4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(steps) == 1 and "test_sweep.py" in steps[0]
    log = (out / "session.log").read_text()
    assert "== sumformer-steps: skipped" in log and "== bench-entropy-1b: skipped" in log
    assert "skipped for time: sumformer-steps sweep analyses-tests kernel-tests" in log
    assert (out / "results.tgz").exists()


def test_a_step_past_its_limit_is_stopped_and_the_rest_still_run(tmp_path):
    limits = {name: "1" for name in ("ANALYSES_TIMEOUT", "KERNELS_TIMEOUT", "BENCH_TIMEOUT", "SWEEP_TIMEOUT")}
    done, steps, out = run_suite(tmp_path, "session", SUITE_SECONDS="0", STAND_IN_SECONDS="30", **limits)
    assert done.returncode == 124, done.stdout + done.stderr  # timeout's status: the suite says a step failed
    assert len(steps) == len(SESSION_ORDER)
    assert (out / "session.log").read_text().count(": exit 124") == len(SESSION_ORDER)


def test_unknown_part_is_refused_with_the_parts_named(tmp_path):
    done, steps, _ = run_suite(tmp_path, "everything")
    assert done.returncode == 2 and "give session, tests" in done.stderr and not steps


TINY_SWEEP = {"study": "sumformer", "target": "fig2_poly", "architectures": ["mlp_sumformer"],
              "grid": {"latent_dim": [1, 2, 4, 8, 16, 32, 64, 128], "token_dim": [1, 2], "seq_len": [3], "seed": [0]},
              "train": {"samples": 200, "epochs": 40, "batch_size": 32, "hidden": 8, "depth": 2, "eval_every": 10}}


@pytest.mark.slow
def test_the_sweep_benchmark_stops_at_sigint_and_a_second_run_trains_the_rest(tmp_path):
    """The suite stops a step with SIGINT: benchmarks/sweep.py must then end at once (its pool's workers ran on
    before), keep every finished child in --results, and a run given that file trains only the others."""
    import json
    import sys
    import time

    params, results, report = tmp_path / "sweep.json", tmp_path / "children.jsonl", tmp_path / "report.json"
    params.write_text(json.dumps(TINY_SWEEP))
    command = [sys.executable, str(ROOT / "benchmarks/sweep.py"), "--params", str(params), "--processes", "2",
               "--device", "cpu", "--results", str(results), "--json", str(report), "--out", str(tmp_path / "plots")]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while (not results.exists() or not results.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)  # until the first child has finished
    assert results.exists(), "no child finished in 2 minutes"
    run.send_signal(2)  # SIGINT, as `timeout -s INT` sends it
    stopped_at = time.monotonic()
    output, _ = run.communicate(timeout=30)
    assert time.monotonic() - stopped_at < 15, output
    assert "stopped with" in output and json.loads(report.read_text())["stopped"] is True, output
    first = [json.loads(line) for line in results.read_text().splitlines()]
    assert 1 <= len(first) < 16, output

    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming from {results}: {len(first)} children done" in again.stdout
    done = [json.loads(line)["index"] for line in results.read_text().splitlines()]
    assert sorted(done) == list(range(16))  # each child once: the first run's are not trained again
    final = json.loads(report.read_text())
    assert final["stopped"] is False and final["ran"] == 16 and final["resumed_children"] == len(first)
    assert (tmp_path / "plots" / "fig2_latent_dim.png").exists()  # the whole grid: the parent's figure
