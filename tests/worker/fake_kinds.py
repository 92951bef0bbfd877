"""Test-only job kinds that need no torch model. Worker subprocesses register them through the test
hook ``LMSCOPE_EXTRA_KINDS=tests.worker.fake_kinds`` (import + ``register()``); the worker tests register
them around each test (tests/worker/conftest.py), so the rest of the suite never sees them.

- ``count``: counts to ``steps`` with progress (optionally sleeping per step), writes a plot, a scratch
  file per attempt and a file under ``checkpoints/``; series ``square`` is y = x² for x = 1..steps.
  With ``keep_partial``, a cancel, a refusal (``fail="jobfailed"``) or the time limit keeps what was
  counted, as ``train`` keeps its loss curve. With ``block``, it first spends that many seconds in one
  call that reports no progress and that Celery's soft time limit cannot interrupt (as a long C or
  CUDA call: SIGUSR1 is blocked meanwhile); only the hard limit stops it. ``fail="broken_device"`` fails
  as a kernel that leaves the GPU unusable does: the worker's device check
  (``environment.device_failure``) is made to report CUDA's error in this process (a pool child that is
  about to end, in the Celery tests), then a RuntimeError is raised. ``fail="database"`` raises the
  error a dropped database connection gives. With ``checkpoint_at``, that step registers a checkpoint
  (``count-<job>@step<N>``) as ``train`` does.
- ``fake_sweep``: a parent kind whose children are ``count`` jobs; its aggregator reports progress as
  ``analyses.sweep.aggregate`` does (0 of 1, then 1 of 1), adds their totals (taking ``aggregate_sleep``
  seconds) and counts how often it was called (in this process).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Literal

from pydantic import Field

from lmscope.analyses import registry
from lmscope.analyses.base import JobCancelled, JobFailed, JobOutput, Series
from lmscope.params import KINDS
from lmscope.params.base import ChildSpec, JobParams, KindSpec

MODULE = __name__
ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


class CountParams(JobParams):
    steps: int = Field(5, ge=1, le=10_000_000)
    sleep: float = Field(0.0, ge=0.0, le=5.0)
    fail: Literal["jobfailed", "exception", "oom", "broken_device", "database"] | None = None
    fail_at: int = 0  # step at which to fail
    plot: bool = True
    record_backend: str | None = None
    bad_series: bool = False  # x and y of different lengths: the results cannot be stored
    record_shares_process: bool = False  # record ctx.shares_process in the environment
    keep_partial: bool = False  # a cancel or failure keeps what was counted (summary, series `square`)
    block: float = Field(0.0, ge=0.0, le=600.0)  # seconds in a call the soft time limit cannot interrupt
    checkpoint_at: int = 0  # the step that registers a checkpoint (0: none)


def run_count(params: CountParams, ctx) -> JobOutput:
    (ctx.artifact_dir / f"attempt-{ctx.attempt}.txt").write_text(f"attempt {ctx.attempt}\n")
    checkpoints = ctx.artifact_dir / "checkpoints"
    checkpoints.mkdir(exist_ok=True)
    (checkpoints / f"from-attempt-{ctx.attempt}.txt").write_text("kept between attempts\n")
    if params.record_backend:
        ctx.record("kernel_backend", params.record_backend)
    if params.record_shares_process:
        ctx.record("shares_process", ctx.shares_process)
    if params.block:  # Celery's soft limit is SIGUSR1: held back, as a long C call holds back Python's handlers
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        try:
            time.sleep(params.block)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    xs = []

    def partial() -> JobOutput:
        return JobOutput(summary={"total": sum(xs), "counted": len(xs)},
                         series=[Series("square", xs, [x * x for x in xs])]
                         + ([Series("bad", [1, 2], [1])] if params.bad_series else []))

    with ctx.stage("count"):
        for i in range(1, params.steps + 1):
            if params.fail and i >= params.fail_at:
                if params.fail == "jobfailed":
                    raise JobFailed(f"step {i} refuses to count; use fewer steps", error_type="bad-count",
                                    partial=partial() if params.keep_partial else None)
                if params.fail == "oom":
                    import torch

                    # one line, as torch writes it
                    raise torch.OutOfMemoryError(
                        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB "
                        "of which 1.20 GiB is free. Process 1234 has 77.90 GiB memory in use. Of the allocated "
                        "memory 70.00 GiB is allocated by PyTorch. If reserved but unallocated memory is large try "
                        "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
                if params.fail == "broken_device":
                    from lmscope.worker import environment

                    environment.device_failure = lambda device: ILLEGAL_ADDRESS
                    raise RuntimeError(ILLEGAL_ADDRESS)
                if params.fail == "database":
                    from sqlalchemy.exc import OperationalError

                    raise OperationalError("SELECT 1", {}, Exception("server closed the connection unexpectedly"))
                raise RuntimeError(f"boom at step {i}")  # a plain bug in an analysis
            if params.sleep:
                time.sleep(params.sleep)
            xs.append(i)
            if i == params.checkpoint_at:
                folder = checkpoints / f"step{i}"
                folder.mkdir(exist_ok=True)
                (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 1,
                                                                "n_embd": 8, "vocab_size": 16}))
                ctx.register_model(f"count-{ctx.job_id}@step{i}", folder, step=i)
            try:
                ctx.progress(i, params.steps, "counting")
            except JobCancelled:
                if not params.keep_partial:
                    raise
                raise JobCancelled(partial=partial()) from None
            except JobFailed as e:  # the time limit
                if not params.keep_partial:
                    raise
                raise JobFailed(str(e), error_type=e.error_type, partial=partial()) from None
    with ctx.stage("plot"):
        (ctx.artifact_dir / "numbers.json").write_text(json.dumps(xs[:1000]))
        if params.plot:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(4, 3))
            ax.plot(xs, [x * x for x in xs], label="x²")
            ax.set(title="count", xlabel="step", ylabel="step²")
            ax.legend()
            (ctx.artifact_dir / "plots").mkdir(exist_ok=True)
            fig.savefig(ctx.artifact_dir / "plots" / "square.png")
            plt.close(fig)
    series = [Series("square", xs, [x * x for x in xs], {"kind": "count"}), Series("nan", [0, 1], [float("nan"), 1.0])]
    if params.bad_series:
        series.append(Series("bad", [1, 2], [1]))
    return JobOutput(summary={"total": sum(xs), "attempt": ctx.attempt}, series=series)


class FakeSweepParams(JobParams):
    steps: list[int] = Field(default_factory=lambda: [2, 3])
    aggregate_sleep: float = Field(0.2, ge=0.0, le=30.0)


def expand(params: FakeSweepParams) -> list[ChildSpec]:
    return [ChildSpec("count", {"steps": n, "plot": False}, name=f"steps={n}") for n in params.steps]


aggregate_calls = 0
_calls_lock = threading.Lock()


def aggregate(params: FakeSweepParams, children, ctx) -> JobOutput:
    global aggregate_calls
    with _calls_lock:
        aggregate_calls += 1
    ctx.progress(0, 1, "aggregating")  # as analyses.sweep.aggregate reports
    time.sleep(params.aggregate_sleep)  # widen the window in which a second aggregation could sneak in
    done = [c for c in children if c.status == "succeeded"]
    totals = [c.summary["total"] for c in done]
    ctx.progress(1, 1, "aggregate")
    return JobOutput(summary={"sum": sum(totals), "failed_children": [c.job_id for c in children if c.status == "failed"]},
                     series=[Series("totals", [c.job_id for c in done], totals)])


def register() -> None:
    """Add the test kinds (called by the LMSCOPE_EXTRA_KINDS hook, and around each worker test)."""
    KINDS["count"] = KindSpec("count", CountParams, "test: count with progress")
    KINDS["fake_sweep"] = KindSpec("fake_sweep", FakeSweepParams, "test: a sweep of count jobs", expand=expand)
    registry.RUNNERS["count"] = f"{MODULE}:run_count"
    registry.AGGREGATORS["fake_sweep"] = f"{MODULE}:aggregate"


def unregister() -> None:
    """Leave the kind tables as the other tests expect them."""
    for table, key in ((KINDS, "count"), (KINDS, "fake_sweep"), (registry.RUNNERS, "count"),
                       (registry.AGGREGATORS, "fake_sweep")):
        table.pop(key, None)
