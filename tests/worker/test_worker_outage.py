"""A database outage while a job runs: the job waits for the database where it needs it (a checkpoint's
registration, storing its results) and goes on, rather than failing for good on a restart; one that
outlasts the wait leaves the row running for the reaper. A real PostgreSQL server, stopped and started."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import DataError, OperationalError

from lmscope.db.models import Job, Model, utcnow
from lmscope.worker import attempt as attempt_module
from lmscope.worker import reaper, runner
from tests.conftest import PostgresCluster, _pg_bin, need
from tests.worker import fake_kinds
from tests.worker.helpers import start_execute


@pytest.fixture(scope="module")
def cluster():
    """A PostgreSQL server of this module's own, so that stopping it disturbs no other test."""
    need(_pg_bin("initdb") is not None and _pg_bin("pg_ctl") is not None, "PostgreSQL (initdb, pg_ctl) not installed")
    from lmscope.db.engine import upgrade

    server = PostgresCluster()
    try:
        upgrade(server.url)
        yield server
    finally:
        server.stop()


@pytest.fixture
def db_url(cluster):
    return cluster.url


@pytest.mark.postgres
def test_a_database_restart_during_a_job_does_not_fail_it(cluster, settings, sessions, make_job, job_row, publisher,
                                                          caplog, monkeypatch):
    """The server stops while the job counts and is still down when the job registers its checkpoint:
    the registration waits for it, and the job succeeds in its first attempt with the checkpoint there."""
    at_checkpoint, stopped = threading.Event(), threading.Event()
    sleeps = [0]

    def sleep(seconds):  # the job's step; the sixth is the one that registers the checkpoint
        sleeps[0] += 1
        if sleeps[0] == 6:
            at_checkpoint.set()
            stopped.wait(60)  # the registration comes only once the server is down
        time.sleep(seconds)

    monkeypatch.setattr(fake_kinds, "time", SimpleNamespace(sleep=sleep))
    job_id = make_job(params={"steps": 12, "sleep": 0.05, "checkpoint_at": 6, "plot": False})
    with caplog.at_level(logging.WARNING, logger="lmscope.worker"):
        t, outcome = start_execute(job_id, settings, sessions, publisher)
        try:
            assert at_checkpoint.wait(60), "the job did not reach its checkpoint"
            cluster.pause()
        finally:
            stopped.set()
        time.sleep(3)
        cluster.resume()
        t.join(timeout=60)
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"checkpoint registration of job {job_id} failed:") for m in said), said
    assert f"checkpoint registration of job {job_id} works again after" in " ".join(said)
    row = job_row(job_id)
    assert (outcome["status"], row.status, row.attempts, row.error_type) == ("succeeded", "succeeded", 1, None)
    assert row.summary["total"] == sum(range(1, 13))
    with sessions() as s:
        model = s.execute(select(Model).where(Model.name == f"count-{job_id}@step6")).scalar_one()
    assert (model.step, model.job_id, model.source) == (6, job_id, "checkpoint")


@pytest.mark.postgres
def test_a_job_that_loses_the_database_is_left_running_for_the_reaper(settings, sessions, make_job, job_row,
                                                                     publisher):
    """A dropped connection that reaches the runner is no failure of the job's, even with the database
    back by then: the row stays running (nothing stored as its error), and the reaper re-queues it."""
    job_id = make_job(params={"steps": 3, "fail": "database", "fail_at": 2, "plot": False})
    with pytest.raises(runner.DatabaseLostDuringJob, match=f"job {job_id} attempt 1: the database failed"):
        runner.execute(job_id, settings, sessions, publisher)
    row = job_row(job_id)
    assert (row.status, row.attempts, row.error_type, row.finished_at) == ("running", 1, None, None)
    later = utcnow() + timedelta(seconds=settings.stale_after_seconds + 1)
    assert reaper.reap(settings, sessions, publisher, now=later)["requeued"] == [job_id]
    assert job_row(job_id).status == "queued"


def test_waiting_through_an_outage_gives_up_at_its_patience_and_not_on_other_errors(monkeypatch):
    sleeps: list[float] = []
    # this module's clock only: other threads' time.sleep stays the real one
    monkeypatch.setattr(attempt_module, "time", SimpleNamespace(sleep=sleeps.append, monotonic=time.monotonic))
    down = OperationalError("SELECT 1", {}, Exception("connection refused"))
    tries = iter([down, down, down, "answer"])

    def work():
        result = next(tries)
        if isinstance(result, Exception):
            raise result
        return result

    assert attempt_module.through_outage("lookup", work) == "answer"
    assert sleeps == [0.5, 1.0, 2.0]  # backing off
    bad_value = DataError("INSERT ...", {}, Exception("value out of range"))
    with pytest.raises(DataError):  # a statement the database refuses is no outage: not tried again
        attempt_module.through_outage("insert", lambda: (_ for _ in ()).throw(bad_value))
    assert len(sleeps) == 3
    # SQLite says "no such table" with an OperationalError too: no outage, said at once
    missing = OperationalError("SELECT * FROM nope", {}, sqlite3.OperationalError("no such table: nope"))
    assert not attempt_module.is_outage(missing) and attempt_module.is_outage(down)
    with pytest.raises(OperationalError, match="no such table"):
        attempt_module.through_outage("lookup", lambda: (_ for _ in ()).throw(missing))
    assert len(sleeps) == 3
    with pytest.raises(OperationalError):  # still down after its patience
        attempt_module.through_outage("lookup", lambda: (_ for _ in ()).throw(down), patience=0.0)
    assert len(sleeps) == 3


@pytest.mark.postgres
def test_results_whose_commit_lost_its_answer_count_as_stored(settings, sessions, make_job, job_row):
    """The connection drops after COMMIT, before its answer: the retry finds the row already ended. It is
    this attempt's outcome (same status, worker, attempt), not "taken by another attempt"."""
    job_id = make_job()
    attempt = runner.claim(sessions, job_id, "test:1", settings=settings)
    rows = runner.outcome_rows(attempt, "succeeded", None, None, {"summary": {"total": 3}})
    assert runner.store_outcome(sessions, attempt, "succeeded", *rows)
    assert not runner.store_outcome(sessions, attempt, "succeeded", *rows)  # the retry: the row is no longer running
    finished_at = rows[0]["finished_at"]
    assert runner.outcome_stored(sessions, attempt, "succeeded", finished_at)
    assert not runner.outcome_stored(sessions, attempt, "failed", finished_at)
    assert job_row(job_id).summary == {"total": 3}
    # the reaper failing the same attempt (its own finished_at) is no outcome of this write
    with sessions() as s, s.begin():
        s.execute(update(Job).where(Job.id == job_id).values(status="failed", finished_at=utcnow()))
    assert not runner.outcome_stored(sessions, attempt, "failed", finished_at)
