"""The runner against SQLite and PostgreSQL: claim, progress, cancel, results, failures, environment."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import math
import socket
import threading
import time
from dataclasses import replace
from datetime import timedelta
from types import SimpleNamespace

import pytest
from sqlalchemy import event, select, update

import lmscope
from lmscope.db.models import Artifact, Dataset, Job, Model, Series, utcnow
from lmscope.worker import runner
from lmscope.worker.attempt import Attempt
from lmscope.worker.context import WorkerContext
from tests.conftest import need_module
from tests.worker import fake_kinds
from tests.worker.helpers import start_execute, wait_until


def series_of(sessions, job_id):
    with sessions() as s:
        return s.execute(select(Series).where(Series.job_id == job_id).order_by(Series.name)).scalars().all()


def artifacts_of(sessions, job_id):
    with sessions() as s:
        return {a.name: a for a in s.execute(select(Artifact).where(Artifact.job_id == job_id)).scalars()}


def test_job_runs_and_everything_is_stored(settings, sessions, make_job, job_row, publisher):
    job_id = make_job(params={"steps": 6, "plot": True, "record_backend": "reference"})
    assert runner.execute(job_id, settings, sessions, publisher) == "succeeded"

    job = job_row(job_id)
    assert (job.status, job.attempts, job.error_type) == ("succeeded", 1, None)
    assert job.summary == {"total": sum(range(1, 7)), "attempt": 1}
    assert (job.progress_done, job.progress_total) == (6, 6)
    assert job.finished_at is not None and job.worker == f"{socket.gethostname()}:{__import__('os').getpid()}"

    square, nan = series_of(sessions, job_id)[1], series_of(sessions, job_id)[0]
    assert square.x == [1, 2, 3, 4, 5, 6] and square.y == [x * x for x in range(1, 7)]
    assert square.labels == {"kind": "count"}
    assert nan.y == [None, 1.0]  # NaN is stored as null (PostgreSQL's JSON has no NaN)

    folder = settings.artifact_dir / "jobs" / str(job_id)
    arts = artifacts_of(sessions, job_id)
    assert set(arts) == {"attempt-1.txt", "checkpoints/from-attempt-1.txt", "numbers.json", "plots/square.png"}
    png = (folder / "plots" / "square.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert arts["plots/square.png"].sha256 == hashlib.sha256(png).hexdigest()
    assert arts["plots/square.png"].size == len(png) and arts["plots/square.png"].media_type == "image/png"
    assert arts["numbers.json"].media_type == "application/json"
    assert json.loads((folder / "numbers.json").read_text()) == list(range(1, 7))


def test_environment_is_recorded(settings, sessions, make_job, job_row, publisher):
    import torch  # imported before the job runs: the record then says its thread count

    job_id = make_job(params={"steps": 3, "sleep": 0.05, "record_backend": "triton", "plot": False})
    runner.execute(job_id, settings, sessions, publisher)
    env = job_row(job_id).environment
    assert env["lmscope"] == lmscope.__version__
    assert env["host"] == socket.gethostname()
    assert env["kernel_backend"] == "triton"  # what the job recorded wins
    assert env["attempt"] == 1 and env["device"] in ("cpu", "cuda")
    assert env["device_name"]
    assert env["torch_threads"] == torch.get_num_threads()
    for package in ("torch", "triton", "transformers"):
        if importlib.util.find_spec(package) is not None:
            assert env[package] == importlib.metadata.version(package)
    assert env["stages"]["count"] >= 3 * 0.05
    assert env["stages"]["total"] >= env["stages"]["count"] + env["stages"]["plot"]
    assert env["wall_seconds"] >= env["stages"]["total"]


def test_claim_is_atomic(sessions, make_job, job_row, settings):
    """Several workers receive the same job at the same moment: exactly one claims it."""
    for _ in range(3):
        job_id = make_job()
        barrier = threading.Barrier(4)
        results = {}

        def claimer(name):
            barrier.wait()
            results[name] = runner.claim(sessions, job_id, name, settings=settings)

        threads = [threading.Thread(target=claimer, args=(f"host:{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [name for name, r in results.items() if isinstance(r, Attempt)]
        assert len(winners) == 1, results
        job = job_row(job_id)
        assert (job.status, job.attempts, job.worker) == ("running", 1, winners[0])


def test_duplicate_delivery_is_dropped(settings, sessions, make_job, job_row, publisher):
    job_id = make_job()
    assert runner.execute(job_id, settings, sessions, publisher) == "succeeded"
    assert runner.execute(job_id, settings, sessions, publisher) is None
    assert job_row(job_id).attempts == 1
    assert len(series_of(sessions, job_id)) == 2
    assert runner.execute(10_000, settings, sessions, publisher) is None  # no such job: dropped


def test_progress_is_throttled_and_the_last_report_written(settings, sessions, engine, make_job, job_row, publisher,
                                                          monkeypatch):
    """The throttle is checked by what it decides, on a clock that advances only by the job's steps (each
    step "sleeps" 3 ms of it): a loaded machine (lock waits, CPU stalls) cannot shrink or stretch the gaps."""
    from lmscope.worker import context as worker_context

    step, steps_slept, start = 0.003, [0], time.monotonic()  # the attempt's deadline is set on the real clock

    def sleep(seconds):
        steps_slept[0] += 1

    def monotonic():
        return start + steps_slept[0] * step

    # the clock the context's throttle reads, and the job's per-step sleep that advances it
    monkeypatch.setattr(worker_context, "time", SimpleNamespace(monotonic=monotonic, perf_counter=time.perf_counter))
    monkeypatch.setattr(fake_kinds, "time", SimpleNamespace(sleep=sleep))
    writes = []  # the step whose progress each write reports

    @event.listens_for(engine, "before_cursor_execute")
    def count(conn, cursor, statement, parameters, context, executemany):
        if statement.startswith("UPDATE jobs SET progress_done"):
            writes.append(steps_slept[0])

    job_id = make_job(params={"steps": 400, "sleep": step, "plot": False})
    try:
        assert runner.execute(job_id, settings, sessions, publisher) == "succeeded"
    finally:
        event.remove(engine, "before_cursor_execute", count)

    interval = 1 / worker_context.PROGRESS_WRITES_PER_SECOND
    assert interval == 0.25
    # The stage's start is written (0 done), then the first report, then one each time 0.25 s have passed
    # (every 84 steps: 83 × 3 ms is 0.249 s), and the last one (400 of 400) whatever the time; then the next
    # stage's start (still 400 of 400). Unthrottled, each of the 400 steps writes.
    assert writes == [0, 1, 85, 169, 253, 337, 400, 400], writes
    gaps = [(b - a) * step for a, b in zip(writes[1:], writes[2:-2])]  # the final writes may follow at once
    assert all(g >= interval for g in gaps), gaps
    job = job_row(job_id)
    assert (job.progress_done, job.progress_total, job.progress_stage) == (400, 400, "plot")


def test_cancel_flag_stops_a_running_job(settings, sessions, make_job, job_row, publisher, monkeypatch):
    """A cancel is seen at the next throttled progress write, not at the end: on a clock that advances only
    by the job's steps (3 ms each), the job stops within one throttle interval (0.25 s: 84 steps) of it."""
    from lmscope.worker import context as worker_context

    step, steps_slept, start, cancel_at = 0.003, [0], time.monotonic(), 100

    def sleep(seconds):
        steps_slept[0] += 1
        if steps_slept[0] == cancel_at:  # the API's cancel, as it lands mid-job
            with sessions() as s, s.begin():
                s.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))

    monkeypatch.setattr(worker_context, "time", SimpleNamespace(monotonic=lambda: start + steps_slept[0] * step,
                                                                perf_counter=time.perf_counter))
    monkeypatch.setattr(fake_kinds, "time", SimpleNamespace(sleep=sleep))
    job_id = make_job(params={"steps": 1_000_000, "sleep": step, "plot": False})
    outcome = {"status": runner.execute(job_id, settings, sessions, publisher)}
    interval_steps = math.ceil(1 / worker_context.PROGRESS_WRITES_PER_SECOND / step)
    assert cancel_at <= steps_slept[0] <= cancel_at + interval_steps, steps_slept[0]
    job = job_row(job_id)
    assert outcome["status"] == "cancelled" and job.status == "cancelled" and job.finished_at is not None
    assert job.progress_done < 1_000_000
    assert series_of(sessions, job_id) == []
    # no results, but the files it wrote before the cancel (a train run's checkpoints) can be fetched
    assert set(artifacts_of(sessions, job_id)) == {"attempt-1.txt", "checkpoints/from-attempt-1.txt"}
    assert job.environment["stages"]["count"] > 0


def cancel_while_counting(settings, sessions, make_job, job_row, publisher, **params) -> tuple[str, Job]:
    """Start a long `count` job, cancel it once it has counted, return (execute's outcome, the row)."""
    job_id = make_job(params={"steps": 1_000_000, "sleep": 0.001, "plot": False, **params})
    t, outcome = start_execute(job_id, settings, sessions, publisher)
    wait_until(lambda: (job_row(job_id).progress_done or 0) > 0, what="progress")
    with sessions() as s, s.begin():
        s.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
    t.join(timeout=20)
    return outcome["status"], job_row(job_id)


def test_a_cancelled_job_keeps_the_partial_results_its_analysis_hands_back(settings, sessions, make_job, job_row,
                                                                           publisher):
    status, job = cancel_while_counting(settings, sessions, make_job, job_row, publisher, keep_partial=True)
    assert status == "cancelled" and job.status == "cancelled"
    counted = job.summary["counted"]
    assert 0 < counted < 1_000_000 and job.summary["total"] == counted * (counted + 1) // 2
    (square,) = series_of(sessions, job.id)
    assert list(square.x) == list(range(1, counted + 1)) and list(square.y) == [x * x for x in square.x]
    # The files written before the cancel are artifacts, as for a finished job.
    assert {"attempt-1.txt", "checkpoints/from-attempt-1.txt"} <= set(artifacts_of(sessions, job.id))


def test_a_cancelled_job_whose_partial_results_cannot_be_stored_stays_cancelled(settings, sessions, make_job,
                                                                               job_row, publisher):
    status, job = cancel_while_counting(settings, sessions, make_job, job_row, publisher, keep_partial=True,
                                        bad_series=True)
    assert status == "cancelled" and job.status == "cancelled"  # the user's cancel, not a failure
    assert job.error_message.startswith("storing the results failed")


def test_cancel_requested_before_the_claim_cancels_at_once(settings, sessions, make_job, job_row, publisher):
    job_id = make_job(cancel_requested=True)
    assert runner.execute(job_id, settings, sessions, publisher) == "cancelled"
    job = job_row(job_id)
    assert job.status == "cancelled" and job.started_at is None and job.attempts == 0


def _a_dead_worker_here() -> str:
    """host:pid of a process of this host that has exited (a pool child the OOM killer took)."""
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return f"{socket.gethostname()}:{proc.pid}"


def _a_killed_attempt(settings, make_job, *, started_ago: float, **fields) -> int:
    """A row as a killed pool child leaves it (running, fresh heartbeat), and the files it wrote."""
    now = utcnow()
    job_id = make_job(status="running", worker=_a_dead_worker_here(), started_at=now - timedelta(seconds=started_ago),
                      heartbeat_at=now - timedelta(seconds=0.1), **fields)
    folder = settings.job_dir(job_id)
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "step-5.txt").write_text("kept between attempts\n")
    (folder / "attempt-1.txt").write_text("attempt 1\n")
    return job_id


@pytest.mark.parametrize("how", ["out-of-attempts", "cancelled", "time-limit"])
def test_a_job_the_takeover_ends_without_running_lists_its_files(settings, sessions, make_job, job_row, publisher,
                                                                 how):
    """The message of a killed pool child comes back at once and the claim takes the attempt over. When
    that ends the job (out of attempts, cancelled meanwhile, or killed by the hard time limit), the files
    its attempts kept are its artifacts, as when the reaper gives up on it."""
    settings = replace(settings, task_time_limit=20)
    fields = {"out-of-attempts": dict(attempts=2, max_attempts=2, started_ago=5),
              "cancelled": dict(attempts=1, cancel_requested=True, started_ago=5),
              "time-limit": dict(attempts=1, started_ago=19.9)}[how]  # the limit (20 s) killed it: not retried
    job_id = _a_killed_attempt(settings, make_job, **fields)
    lost = job_row(job_id).worker
    status = runner.execute(job_id, settings, sessions, publisher)

    job = job_row(job_id)
    assert status == job.status == ("cancelled" if how == "cancelled" else "failed")
    assert job.error_type == {"out-of-attempts": "worker-lost", "cancelled": None, "time-limit": "time-limit"}[how]
    assert job.attempts == fields["attempts"] and job.finished_at is not None  # it did not run again
    if how == "time-limit":
        assert "LMSCOPE_TASK_TIME_LIMIT=20 s" in job.error_message
    if how == "out-of-attempts":  # as the reaper says it: how often, when and where it was last seen
        assert job.error_message.startswith("worker lost 2 times; last seen at ") and f" on {lost}" in job.error_message
    assert set(artifacts_of(sessions, job_id)) == {"attempt-1.txt", "checkpoints/step-5.txt"}


def test_a_takeover_within_the_time_limit_runs_the_job_again(settings, sessions, make_job, job_row, publisher):
    settings = replace(settings, task_time_limit=20)
    job_id = _a_killed_attempt(settings, make_job, attempts=1, started_ago=15, params={"steps": 3, "plot": False})
    assert runner.execute(job_id, settings, sessions, publisher) == "succeeded"
    assert job_row(job_id).attempts == 2


def test_results_are_replaced_not_duplicated_by_a_retry(settings, sessions, make_job, job_row, publisher):
    job_id = make_job(params={"steps": 4, "plot": False})
    runner.execute(job_id, settings, sessions, publisher)
    first = artifacts_of(sessions, job_id)
    # As the reaper does after a lost worker: the row goes back to the queue and runs again.
    with sessions() as s, s.begin():
        s.execute(update(Job).where(Job.id == job_id).values(status="queued", worker=None))
    assert runner.execute(job_id, settings, sessions, publisher) == "succeeded"

    assert job_row(job_id).attempts == 2 and job_row(job_id).summary["attempt"] == 2
    names = sorted(s.name for s in series_of(sessions, job_id))
    assert names == ["nan", "square"]
    arts = artifacts_of(sessions, job_id)
    # The folder was emptied for attempt 2 except checkpoints/, which a resuming job needs.
    assert set(arts) == {"attempt-2.txt", "numbers.json", "checkpoints/from-attempt-1.txt",
                         "checkpoints/from-attempt-2.txt"}
    assert "attempt-1.txt" in first and not (settings.artifact_dir / "jobs" / str(job_id) / "attempt-1.txt").exists()


@pytest.mark.parametrize("params, error_type, message", [
    ({"fail": "jobfailed", "fail_at": 2}, "bad-count", "step 2 refuses to count; use fewer steps"),
    ({"fail": "exception", "fail_at": 3}, "RuntimeError", "boom at step 3"),
    # torch's OutOfMemoryError: its sentences about this device, not the allocator's settings, and what to
    # change among the kind's own fields (the count kind has none of batch_size, seq_len, …)
    ({"fail": "oom", "fail_at": 2}, "out-of-memory", "the device ran out of memory: CUDA out of memory. Tried to "
     "allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.20 GiB is free; use smaller parameters"),
    ({"steps": -1}, "invalid-params", "steps"),
    ({"colour": "red"}, "invalid-params", "colour"),
    ({"bad_series": True}, "ValueError", "storing the results failed: series 'bad' has 2 x values but 1 y values"),
    # partial results that cannot be stored: the job's own failure stays the reason
    ({"fail": "jobfailed", "fail_at": 4, "keep_partial": True, "bad_series": True}, "bad-count",
     "step 4 refuses to count; use fewer steps (storing its partial results failed too: series 'bad' has 2 x"),
])
def test_failures_are_recorded_not_retried(settings, sessions, make_job, job_row, publisher, params, error_type, message):
    job_id = make_job(params={"plot": False, **params})
    assert runner.execute(job_id, settings, sessions, publisher) == "failed"
    job = job_row(job_id)
    assert (job.status, job.error_type, job.attempts) == ("failed", error_type, 1)
    assert message in job.error_message
    assert job.environment["lmscope"] == lmscope.__version__
    assert series_of(sessions, job_id) == [] and publisher.published == []
    assert runner.execute(job_id, settings, sessions, publisher) is None  # a redelivery does not retry it


def test_a_job_that_leaves_the_gpu_unusable_says_so_and_marks_the_process(settings, sessions, make_job, job_row,
                                                                           publisher, monkeypatch):
    """After a failure the worker checks the device; CUDA's sticky errors (an illegal address) fail every
    later call in the process, so the job says so and the process is marked to run no other job."""
    from lmscope.worker import environment

    checked = []
    monkeypatch.setattr(environment, "device_failure", lambda device: checked.append(device) or None)
    job_id = make_job(params={"plot": False, "fail": "exception", "fail_at": 2})
    assert runner.execute(job_id, settings, sessions, publisher) == "failed"
    assert checked == [environment.worker_device()]  # "cpu" here, "cuda" on a GPU machine
    assert job_row(job_id).error_type == "RuntimeError" and runner.broken_device is None
    # out of memory is no broken device: not even checked (the probe could run out of memory too)
    job_id = make_job(params={"plot": False, "fail": "oom", "fail_at": 2})
    assert runner.execute(job_id, settings, sessions, publisher) == "failed"
    assert len(checked) == 1 and job_row(job_id).error_type == "out-of-memory" and runner.broken_device is None

    monkeypatch.setattr(environment, "device_failure", lambda device: fake_kinds.ILLEGAL_ADDRESS)
    job_id = make_job(params={"plot": False, "fail": "exception", "fail_at": 2})
    assert runner.execute(job_id, settings, sessions, publisher) == "failed"
    job = job_row(job_id)
    assert (job.error_type, job.attempts) == ("device-error", 1)
    assert job.error_message.startswith("boom at step 2 — and the GPU is unusable in the worker process that ran "
                                        "the job (CUDA error: an illegal memory access was encountered)")
    assert runner.broken_device == fake_kinds.ILLEGAL_ADDRESS


def test_the_device_check_leaves_a_cpu_alone():
    from lmscope.worker.environment import device_failure

    assert device_failure("cpu") is None


def test_the_device_check_calls_a_probe_that_runs_out_of_memory_no_broken_device(monkeypatch):
    """The probe's one-element tensor can meet a full device (another job's memory): not a sticky error.
    A process that never touched CUDA is not probed at all; a failing synchronize is CUDA's error."""
    import torch

    from lmscope.worker.environment import device_failure

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: pytest.fail("probed a device never used"))
    assert device_failure("cuda") is None

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(torch, "ones", full)
    assert device_failure("cuda") is None

    def sticky(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ...")

    monkeypatch.setattr(torch.cuda, "synchronize", sticky)
    assert device_failure("cuda") == "CUDA error: an illegal memory access was encountered"


def test_out_of_memory_names_the_fields_of_the_job_kind_that_shrink_it():
    """torch's one-line message keeps its sentences about this device; the advice names only fields the
    kind has (train has no dtype, probe no batch_size)."""
    from lmscope.worker.runner import out_of_memory_message

    torch_text = ("CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
                  "1.20 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the "
                  "allocated memory 70.00 GiB is allocated by PyTorch (https://pytorch.org/docs/stable/notes/cuda.html)")
    head = ("the device ran out of memory: CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total "
            "capacity of 79.10 GiB of which 1.20 GiB is free; ")
    assert out_of_memory_message(torch_text, "entropy") == head + "lower batch_size or seq_len, or set dtype bfloat16"
    assert out_of_memory_message(torch_text, "norms") == head + "lower batch_size or max_tokens, or set dtype bfloat16"
    assert out_of_memory_message(torch_text, "train") == head + "lower batch_size or context"
    assert out_of_memory_message(torch_text, "probe") == head + "use smaller parameters, or set dtype bfloat16"


def test_the_host_running_out_of_memory_is_out_of_memory_not_a_bug():
    """torch's CPU allocator raises a plain RuntimeError (a train run too large for the host's memory): it is
    reported as out-of-memory with the kind's advice, not as a RuntimeError the docs call a bug."""
    import torch

    from lmscope.config import Settings
    from lmscope.worker.runner import _failure

    settings = Settings.from_env({})
    try:
        torch.empty(2**60, dtype=torch.uint8)  # an exabyte: no host has it
    except RuntimeError as e:
        error_type, message = _failure(e, settings, "train")
    assert error_type == "out-of-memory"
    assert message == "the host ran out of memory: the host has no room for 1.07e+09 GiB more; lower batch_size or context"
    assert _failure(MemoryError(), settings, "norms") == (
        "out-of-memory", "the host ran out of memory: the host has no room for more; lower batch_size or max_tokens, "
                         "or set dtype bfloat16")
    assert _failure(RuntimeError("shape mismatch"), settings, "norms")[0] == "RuntimeError"  # other errors stay theirs


def test_unknown_kind_fails_with_a_clear_message(settings, sessions, make_job, job_row, publisher):
    job_id = make_job(kind="no_such_kind", params={})
    assert runner.execute(job_id, settings, sessions, publisher) == "failed"
    job = job_row(job_id)
    assert job.error_type == "unknown-kind" and "no_such_kind" in job.error_message


def test_time_limit_fails_the_job(settings, sessions, make_job, job_row, publisher):
    job_id = make_job(params={"steps": 1000, "sleep": 0.01, "plot": False})
    assert runner.execute(job_id, replace(settings, task_time_limit=1), sessions, publisher) == "failed"
    job = job_row(job_id)
    assert job.error_type == "time-limit" and "LMSCOPE_TASK_TIME_LIMIT" in job.error_message
    assert job.summary is None and series_of(sessions, job_id) == []
    # the files it wrote before the limit can still be fetched
    assert {"attempt-1.txt", "checkpoints/from-attempt-1.txt"} <= set(artifacts_of(sessions, job_id))


@pytest.mark.parametrize("how", ["time-limit", "refusal"])
def test_a_failed_job_keeps_the_partial_results_its_analysis_hands_back(settings, sessions, make_job, job_row,
                                                                       publisher, how):
    params = {"steps": 1_000_000, "sleep": 0.001} if how == "time-limit" else {"steps": 50, "fail": "jobfailed",
                                                                                "fail_at": 31}
    job_id = make_job(params={**params, "plot": False, "keep_partial": True})
    assert runner.execute(job_id, replace(settings, task_time_limit=2), sessions, publisher) == "failed"
    job = job_row(job_id)
    assert job.error_type == ("time-limit" if how == "time-limit" else "bad-count")
    counted = job.summary["counted"]
    assert counted == 30 if how == "refusal" else 0 < counted < 1_000_000
    assert job.summary["total"] == counted * (counted + 1) // 2
    (square,) = series_of(sessions, job_id)
    assert list(square.x) == list(range(1, counted + 1)) and list(square.y) == [x * x for x in square.x]
    assert {"attempt-1.txt", "checkpoints/from-attempt-1.txt"} <= set(artifacts_of(sessions, job_id))


def test_a_failed_job_whose_files_cannot_be_listed_still_fails_with_its_own_error(settings, sessions, make_job,
                                                                                 job_row, publisher, monkeypatch):
    """An unreadable artifact store (NFS ESTALE) must not leave the row running for the reaper to misreport."""
    def unreadable(path):
        raise OSError(116, "Stale file handle")

    monkeypatch.setattr(runner, "scan_artifacts", unreadable)
    job_id = make_job(params={"plot": False, "fail": "jobfailed", "fail_at": 2})
    assert runner.execute(job_id, settings, sessions, publisher) == "failed"
    job = job_row(job_id)
    assert job.error_type == "bad-count" and artifacts_of(sessions, job_id) == {}


def test_an_attempt_that_lost_its_row_writes_nothing(settings, sessions, make_job, job_row, publisher):
    """The reaper gave up on a slow attempt and another worker took the job: the old attempt stops quietly."""
    job_id = make_job(params={"steps": 1_000_000, "sleep": 0.001, "plot": False})
    t, outcome = start_execute(job_id, settings, sessions, publisher)
    wait_until(lambda: (job_row(job_id).progress_done or 0) > 0, what="progress")
    with sessions() as s, s.begin():
        s.execute(update(Job).where(Job.id == job_id).values(attempts=Job.attempts + 1, worker="elsewhere:1"))
    t.join(timeout=20)
    assert not t.is_alive() and outcome["status"] is None
    job = job_row(job_id)
    assert (job.status, job.worker, job.attempts) == ("running", "elsewhere:1", 2)
    assert series_of(sessions, job_id) == []


def test_heartbeat_is_refreshed_while_running(settings, sessions, make_job, job_row, publisher):
    job_id = make_job(params={"steps": 1_000_000, "sleep": 0.001, "plot": False})
    t, _ = start_execute(job_id, settings, sessions, publisher)
    first = wait_until(lambda: job_row(job_id).heartbeat_at, what="heartbeat")
    wait_until(lambda: job_row(job_id).heartbeat_at > first, timeout=5, what="a newer heartbeat")
    # Where it runs is on the row while it runs (a worker that dies leaves that behind for the reaper's failure).
    env = job_row(job_id).environment
    assert env["attempt"] == 1 and env["host"] == socket.gethostname() and env["lmscope"] == lmscope.__version__
    assert env["device"] in ("cpu", "cuda") and env["device_name"] and "stages" not in env
    with sessions() as s, s.begin():
        s.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
    t.join(timeout=20)
    assert job_row(job_id).status == "cancelled"


def test_a_database_outage_is_logged_when_it_starts_and_ends_not_at_every_try(settings, sessions, make_job,
                                                                             job_row, tmp_path, caplog,
                                                                             monkeypatch):
    """The heartbeat and progress reports retry several times a second through an outage: one warning
    (the error's first line, not the SQL) when it starts, a reminder each minute, one when writes work
    again. An error that is not an outage (a value the column refuses) is said at every try."""
    import logging
    import re

    from sqlalchemy.exc import DataError, OperationalError

    from lmscope.worker.attempt import Heartbeat, OutageLog

    job_id = make_job()
    attempt = runner.claim(sessions, job_id, "test:1", settings=settings)
    failure = None
    monkeypatch.setattr(OutageLog, "REMIND_SECONDS", 0.5)

    def flaky_sessions():
        if failure is not None:
            raise failure
        return sessions()

    beat, ctx = Heartbeat(flaky_sessions, attempt, 1.0), WorkerContext(attempt, flaky_sessions, tmp_path / "a", "cpu")

    def write(i):
        beat.beat()
        ctx.last_progress = (i, 10, "measure")
        ctx.flush_progress()

    with caplog.at_level(logging.WARNING, logger="lmscope.worker"):
        failure = OperationalError("UPDATE jobs ...", {}, Exception("connection refused\nIs the server running?"))
        for i in range(5):  # at once, then after the reminder interval
            write(i)
        time.sleep(0.6)
        write(5)
        failure = None
        write(6)
        failure = DataError("UPDATE jobs ...", {}, Exception("value out of range\nDETAIL: ..."))
        write(7)
        write(8)
        # an outage after such errors still says when it starts (they are not counted as its tries)
        failure = OperationalError("UPDATE jobs ...", {}, Exception("connection refused"))
        write(9)
    said = [re.sub(r"in \d+ s:", "in T s:", r.getMessage()) for r in caplog.records if r.name == "lmscope.worker"]
    refused, out_of_range = "(builtins.Exception) connection refused", "(builtins.Exception) value out of range"
    assert said == [
        f"heartbeat of job {job_id} failed: {refused}; retrying (logged again each minute until it works)",
        f"progress write of job {job_id} failed: {refused}; retrying (logged again each minute until it works)",
        f"heartbeat of job {job_id} still fails after 6 tries in T s: {refused}",
        f"progress write of job {job_id} still fails after 6 tries in T s: {refused}",
        f"heartbeat of job {job_id} works again after 6 failed tries",
        f"progress write of job {job_id} works again after 6 failed tries",
        *[f"{what} of job {job_id} failed: {out_of_range}" for _ in range(2) for what in ("heartbeat", "progress write")],
        f"heartbeat of job {job_id} failed: {refused}; retrying (logged again each minute until it works)",
        f"progress write of job {job_id} failed: {refused}; retrying (logged again each minute until it works)"]
    assert job_row(job_id).progress_done == 6  # the write that worked wrote


# ---------------------------------------------------------------- the context's models, datasets, checkpoints

@pytest.fixture
def context(settings, sessions, make_job, tmp_path):
    job_id = make_job()
    attempt = runner.claim(sessions, job_id, "test:1", settings=settings)
    return WorkerContext(attempt, sessions, tmp_path / "art", "cpu")


def test_a_stage_shows_as_the_jobs_progress_as_soon_as_it_begins(context, job_row):
    """Loading a model or a first batch of 64 long windows took 40 s in which the job showed no progress at all:
    each stage is written when it begins, with the count so far; the runner's own "total" only times."""
    with context.stage("total", announce=False):
        assert job_row(context.job_id).progress_stage is None
        with context.stage("load_model"):
            row = job_row(context.job_id)
            assert (row.progress_done, row.progress_total, row.progress_stage) == (0, None, "load model")
        with context.stage("measure"):
            context.progress(3, 10)
            row = job_row(context.job_id)
            assert (row.progress_done, row.progress_total, row.progress_stage) == (3, 10, "measure")
        with context.stage("write"):  # the next one at once, though within the throttle's interval
            row = job_row(context.job_id)
            assert (row.progress_done, row.progress_total, row.progress_stage) == (3, 10, "write")
    assert set(context.timings) == {"total", "load_model", "measure", "write"}


def test_stages_entered_every_batch_are_throttled_like_reports(context, engine, job_row, monkeypatch):
    """norms enters "forward" and "inner loss" in every batch: said at once each time, 200 batches made 600
    writes in well under a second. Each stage is said at once the first time only, then as throttled as any
    report; the last count is still written."""
    from lmscope.worker import context as worker_context

    clock = [1000.0]
    monkeypatch.setattr(worker_context, "time", SimpleNamespace(monotonic=lambda: clock[0], perf_counter=time.perf_counter))
    writes = []

    @event.listens_for(engine, "before_cursor_execute")
    def count(conn, cursor, statement, parameters, context_, executemany):
        if statement.startswith("UPDATE jobs SET progress_done"):
            writes.append(statement)

    try:
        for i in range(1, 201):  # 200 batches in 0.2 s, less than one throttle interval (0.25 s)
            with context.stage("forward"):
                pass
            with context.stage("inner loss"):
                pass
            context.progress(i, 200)
            clock[0] += 0.001
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert len(writes) == 4, len(writes)  # "forward" and "inner loss" once each, the first count, the last
    row = job_row(context.job_id)
    assert (row.progress_done, row.progress_total) == (200, 200)


def test_register_model_is_an_idempotent_upsert(context, sessions, tmp_path):
    from lmscope.analyses.base import JobFailed

    ckpt = tmp_path / "run" / "step10"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 3, "n_head": 2, "n_embd": 16,
                                                  "vocab_size": 259}))
    context.register_model("run@step10", ckpt, step=10)
    context.register_model("run@step10", ckpt, step=10)
    (ckpt.parent / "step20").mkdir()
    (ckpt.parent / "step20" / "config.json").write_text((ckpt / "config.json").read_text())
    context.register_model("run@step20", ckpt.parent / "step20", step=20)
    with sessions() as s:
        rows = s.execute(select(Model).where(Model.source == "checkpoint").order_by(Model.step)).scalars().all()
    assert [(r.name, r.step, r.job_id, r.num_layers, r.num_heads, r.hidden_size) for r in rows] == [
        ("run@step10", 10, context.job_id, 3, 2, 16), ("run@step20", 20, context.job_id, 3, 2, 16)]
    assert context.checkpoints_of(context.job_id) == [(10, "run@step10"), (20, "run@step20")]
    assert context.checkpoints_of(context.job_id + 1) == []

    with sessions() as s, s.begin():
        s.add(Model(name="taken", source="builtin"))
    with pytest.raises(JobFailed, match="already taken"):
        context.register_model("taken", ckpt, step=10)


def test_an_attempt_the_reaper_gave_up_on_registers_no_model(context, sessions, tmp_path):
    """Its job failed as worker-lost (and may since have been deleted, with its files): a model row would
    point at files no job keeps."""
    from sqlalchemy import update

    from lmscope.db.models import Job
    from lmscope.worker.attempt import AttemptLost

    ckpt = tmp_path / "run" / "step10"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8}))
    with sessions() as s, s.begin():
        s.execute(update(Job).where(Job.id == context.job_id).values(status="failed", error_type="worker-lost"))
    with pytest.raises(AttemptLost):
        context.register_model("lost@step10", ckpt, step=10)
    with sessions() as s:
        assert s.scalar(select(Model).where(Model.name == "lost@step10")) is None


def test_documents_and_unknown_names(context, sessions, tmp_path):
    from lmscope.analyses.base import JobFailed
    from lmscope.catalog import read_documents

    text = tmp_path / "corpus.txt"
    text.write_text("first line\n\n = Heading = \nsecond line\n")
    with sessions() as s, s.begin():
        s.add(Dataset(name="tiny", source="upload", path=str(text), format="lines", num_documents=2, num_bytes=10,
                      sha256="0" * 64))
    assert context.load_documents("tiny") == read_documents(text, "lines") == ["first line", "second line"]
    # the row's sha256 ("0" * 64) is not the file's: the job records the bytes it read, and the registered hash
    import hashlib

    assert context.environment["datasets"]["tiny"] == {
        "sha256": hashlib.sha256(text.read_bytes()).hexdigest(), "registered_sha256": "0" * 64}
    with pytest.raises(JobFailed, match="dataset 'nope' is not registered"):
        context.load_documents("nope")
    with pytest.raises(JobFailed, match="model 'nope' is not registered"):
        context.load_model("nope")


def test_load_model_goes_through_the_registry_and_the_cache(settings, context, sessions):
    if settings.database_url.startswith("postgresql"):
        pytest.skip("model loading does not depend on the database; checked once, on SQLite")
    need_module("torch")
    need_module("transformers")
    from lmscope.catalog import BUILTIN_MODELS
    from lmscope.db.builtins import ensure_builtins

    ensure_builtins(settings, sessions)
    loaded = context.load_model("tiny-gpt2")
    assert loaded.model.config.n_layer == BUILTIN_MODELS["tiny-gpt2"]["n_layer"]
    assert context.load_model("tiny-gpt2") is loaded  # cached in the process
    assert context.environment["models"] == {"tiny-gpt2": {"source": "builtin", "dtype": "float32"}}
    # Built-ins are registered without torch; the first load fills in their parameter count.
    unique = {id(p): p.numel() for p in loaded.model.parameters()}
    with sessions() as session:
        assert session.scalar(select(Model.num_parameters).where(Model.name == "tiny-gpt2")) == sum(unique.values())


def test_checkpoints_survive_moving_the_artifact_store(settings, sessions, make_job, tmp_path):
    """Checkpoint paths are stored relative to the artifact store: copy the store elsewhere (another data
    directory, another mount point) and the model still loads, with the same weights."""
    if settings.database_url.startswith("postgresql"):
        pytest.skip("path handling does not depend on the database; checked once, on SQLite")
    torch = need_module("torch")
    transformers = need_module("transformers")
    import shutil

    job_id = make_job()
    attempt = runner.claim(sessions, job_id, "test:1", settings=settings)
    old_root = tmp_path / "old-store"
    context = WorkerContext(attempt, sessions, old_root / "jobs" / str(job_id), "cpu")
    ckpt = context.artifact_dir / "checkpoints" / "step-5"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=259))
    model.save_pretrained(ckpt)
    context.register_model("moved@step5", ckpt, step=5)
    with sessions() as s:
        stored = s.scalar(select(Model.path).where(Model.name == "moved@step5"))
    assert stored == f"jobs/{job_id}/checkpoints/step-5"

    new_root = tmp_path / "new-store"
    shutil.copytree(old_root, new_root)
    shutil.rmtree(old_root)
    moved = WorkerContext(attempt, sessions, new_root / "jobs" / str(job_id), "cpu")
    # a train job reusing its tokenizer reads the tokenizer alone: no weights enter the process's model cache
    from lmscope.worker.context import model_cache

    assert len(moved.load_tokenizer("moved@step5")) == 259
    assert not any(name == "moved@step5" for name, *_ in model_cache()._models)
    assert moved.environment["models"]["moved@step5"]["tokenizer_only"] is True
    loaded = moved.load_model("moved@step5")
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(loaded.model(ids).logits, model.eval()(ids).logits)
    # the job records which weights it read: the run that wrote them and where (a name can be freed and reused)
    assert moved.environment["models"]["moved@step5"] == {
        "source": "checkpoint", "dtype": "float32", "path": f"jobs/{job_id}/checkpoints/step-5", "job_id": job_id}


def test_a_store_whose_commit_answer_is_lost_ends_the_job_once(settings, sessions, make_job, job_row, publisher,
                                                                monkeypatch, caplog):
    """The connection drops after the results' COMMIT, before its answer: the worker tries again, finds its
    own outcome there, and reports the job succeeded (not "taken by another attempt"), results stored once."""
    import logging

    from sqlalchemy.exc import OperationalError

    real, calls = runner.store_outcome, []

    def commit_then_drop(*args):
        calls.append(1)
        stored = real(*args)
        if len(calls) == 1:
            raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))
        return stored

    monkeypatch.setattr(runner, "store_outcome", commit_then_drop)
    monkeypatch.setattr("lmscope.worker.attempt.time", SimpleNamespace(sleep=lambda s: None, monotonic=time.monotonic))
    job_id = make_job(params={"steps": 3, "plot": False})
    with caplog.at_level(logging.WARNING, logger="lmscope.worker"):
        assert runner.execute(job_id, settings, sessions, publisher) == "succeeded"
    assert len(calls) == 2 and job_row(job_id).status == "succeeded"
    assert [s.name for s in series_of(sessions, job_id)] == ["nan", "square"]  # once each
    assert not any("results discarded" in r.getMessage() for r in caplog.records)
