"""Jobs in one process share the worker's cached models: with several embedded worker threads, a job holds its
model while it runs (the analyses hook it and switch its attention), and the next job on it waits."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import update

from lmscope.analyses.base import JobCancelled
from lmscope.db.builtins import ensure_builtins
from lmscope.db.models import Job
from lmscope.queue import LocalPublisher
from lmscope.worker import runner
from lmscope.worker.context import WorkerContext
from lmscope.worker.embedded import EmbeddedWorker
from tests.worker.helpers import wait_until

PRUNING = {"model": "tiny-gpt2", "dataset": "wikitext-2", "seq_len": 64, "num_segments": 4, "eval_segments": 4,
           "batch_size": 4, "random_orders": 3}


def claimed_context(sessions, settings, make_job, tmp_path, name: str) -> WorkerContext:
    attempt = runner.claim(sessions, make_job(), f"test:{name}", settings=settings)
    return WorkerContext(attempt, sessions, tmp_path / name, "cpu", shares_process=True)


def test_a_job_waits_for_the_model_another_job_in_this_process_is_running(settings, sessions, make_job, job_row,
                                                                          tmp_path):
    """The second job's load waits while the first holds the model, says so in its progress, stops for a cancel
    but not for its time limit (the wait is not its work); the model is free again once the first releases it (or
    loads another)."""
    ensure_builtins(settings, sessions)
    first = claimed_context(sessions, settings, make_job, tmp_path, "first")
    second = claimed_context(sessions, settings, make_job, tmp_path, "second")
    first.load_model("tiny-gpt2")
    second._deadline = time.monotonic() + 0.3  # a time limit the wait outlasts
    outcome: list = []
    waiting = threading.Thread(target=lambda: outcome.append(_load(second, "tiny-gpt2")))
    waiting.start()
    wait_until(lambda: (job_row(second.job_id).progress_stage or "").startswith("waiting for model tiny-gpt2"),
               timeout=20, what="the second job to say it waits")
    time.sleep(1.0)
    assert waiting.is_alive() and outcome == []
    with sessions() as s, s.begin():
        s.execute(update(Job).where(Job.id == second.job_id).values(cancel_requested=True))
    waiting.join(timeout=20)
    assert outcome == ["cancelled"]  # a cancel stops the wait; the first job still holds the model

    third = claimed_context(sessions, settings, make_job, tmp_path, "third")
    first.load_model("tiny-llama")  # the first job moves on to another model: tiny-gpt2 is free
    assert _load(third, "tiny-gpt2") == "loaded"
    third.release_model()
    first.release_model()
    assert _load(third, "tiny-llama") == "loaded"  # and so is the one the first job loaded last
    third.release_model()


def _load(ctx: WorkerContext, name: str) -> str:
    try:
        ctx.load_model(name)
    except JobCancelled:
        return "cancelled"
    return "loaded"


def test_two_threads_running_jobs_on_one_model_give_each_the_results_it_gets_alone(settings, sessions, make_job,
                                                                                    job_row):
    """Two pruning jobs on tiny-gpt2 claimed at once by a two-thread embedded worker: each job's hooks measure and
    remove heads on the shared cached model, so run together they would count each other's passes and apply each
    other's masks. Each must equal the same job run alone afterwards."""
    ensure_builtins(settings, sessions)
    together = [make_job(kind="pruning", params=PRUNING) for _ in range(2)]
    worker = EmbeddedWorker(settings, sessions, LocalPublisher(), threads=2, poll_seconds=0.05).start()
    try:
        wait_until(lambda: all(job_row(j).status not in ("queued", "running") for j in together), timeout=300,
                   what="the two jobs")
    finally:
        worker.stop(timeout=30)
    alone = make_job(kind="pruning", params=PRUNING)
    assert EmbeddedWorker(settings, sessions, LocalPublisher()).run_once()
    expected = job_row(alone)
    assert expected.status == "succeeded", expected.error_message
    for job_id in together:
        row = job_row(job_id)
        assert row.status == "succeeded", row.error_message
        for key in ("baseline_loss", "contribution_by_layer", "mean_loss_increase", "prunable_fraction"):
            assert row.summary[key] == pytest.approx(expected.summary[key], rel=1e-9, abs=1e-12), key
