"""The reaper against SQLite and PostgreSQL: lost workers, lost messages, stuck sweeps, concurrent reapers,
jobs killed by the hard time limit, a database outage."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import replace
from datetime import timedelta

from sqlalchemy import select, text, update

from lmscope.db.models import Artifact, Job, utcnow
from lmscope.worker import reaper, runner
from tests.worker.helpers import RecordingPublisher


def test_stale_running_jobs_are_requeued_and_published(settings, sessions, make_job, job_row, publisher):
    now = utcnow()
    stale = make_job(status="running", attempts=1, worker="gone:1", started_at=now - timedelta(seconds=30),
                     heartbeat_at=now - timedelta(seconds=settings.stale_after_seconds + 1))
    fresh = make_job(status="running", attempts=1, worker="alive:2", started_at=now - timedelta(seconds=30),
                     heartbeat_at=now - timedelta(seconds=settings.stale_after_seconds - 1))
    report = reaper.reap(settings, sessions, publisher, now=now)

    assert report["requeued"] == [stale] and report["failed"] == []
    assert publisher.published == [stale] and publisher.aggregations == []  # an ordinary job, queued in turn
    job = job_row(stale)
    assert (job.status, job.attempts, job.worker) == ("queued", 1, None)
    assert job.published_at >= now - timedelta(seconds=1)
    assert job_row(fresh).status == "running"
    # The requeued job then runs as attempt 2.
    assert runner.execute(stale, settings, sessions, publisher) == "succeeded"
    assert job_row(stale).attempts == 2


def test_out_of_attempts_fails_with_a_reason(settings, sessions, make_job, job_row, publisher):
    now = utcnow()
    seen = now - timedelta(seconds=600)
    parent = make_job(kind="fake_sweep", params={}, status="running", waiting_children=True)
    job_id = make_job(status="running", attempts=3, max_attempts=3, worker="gpu-7:4242", heartbeat_at=seen,
                      started_at=seen, parent_id=parent)
    step = settings.job_dir(job_id) / "checkpoints" / "step-50"  # what the lost attempts wrote
    step.mkdir(parents=True)
    (step / "config.json").write_text("{}")
    report = reaper.reap(settings, sessions, publisher, now=now)

    assert report["failed"] == [job_id]
    job = job_row(job_id)
    assert (job.status, job.error_type) == ("failed", "worker-lost")
    assert job.error_message.startswith(f"worker lost 3 times; last seen at {seen.isoformat(timespec='seconds')} on gpu-7:4242")
    assert job.finished_at is not None
    assert parent in publisher.aggregations  # its sweep can now be aggregated, ahead of the queued jobs
    with sessions() as session:  # its files can be fetched, as any ended job's
        names = session.execute(select(Artifact.name).where(Artifact.job_id == job_id)).scalars().all()
    assert names == ["checkpoints/step-50/config.json"]


def test_lost_and_never_sent_messages_are_published_again(settings, sessions, make_job, job_row, publisher):
    now = utcnow()
    never = make_job(created_at=now - timedelta(seconds=settings.unpublished_after_seconds + 1))
    just_made = make_job(created_at=now)  # the API is about to publish it
    lost = make_job(published_at=now - timedelta(seconds=reaper.republish_after(settings) + 1))
    waiting = make_job(published_at=now - timedelta(seconds=5))  # in a deep queue: leave it

    report = reaper.reap(settings, sessions, publisher, now=now)
    assert sorted(report["republished"]) == sorted(publisher.published) == sorted([never, lost])
    assert job_row(just_made).published_at is None and job_row(never).published_at == now
    # A second pass right after publishes nothing again.
    assert reaper.reap(settings, sessions, publisher, now=now)["republished"] == []
    assert sorted(publisher.published) == sorted([never, lost]) and job_row(waiting).status == "queued"


def test_a_long_backlog_is_not_sent_again_while_the_broker_holds_its_messages(settings, sessions, make_job, job_row):
    """Waiting long is no loss where the broker can say what it holds: with as many messages as published
    queued jobs, nothing goes again; two short, the two jobs published longest ago do (the FIFO queue would
    have delivered them first). Re-sending every long-waiting job each pass piled a message per queued job
    into Redis every ten minutes."""
    now = utcnow()
    long_ago = reaper.republish_after(settings) + 1
    backlog = [make_job(published_at=now - timedelta(seconds=long_ago + age)) for age in (30, 10, 50, 20, 40)]
    recent = make_job(published_at=now - timedelta(seconds=5))
    never = make_job(created_at=now - timedelta(seconds=settings.unpublished_after_seconds + 1))

    class Broker(RecordingPublisher):
        held = 6  # messages in the queue: one per published queued job

        def publish(self, job_id, *, aggregation=False):
            super().publish(job_id, aggregation=aggregation)
            self.held += 1

        def waiting(self):
            return self.held

    broker = Broker()
    assert reaper.reap(settings, sessions, broker, now=now)["republished"] == [never]  # never sent: always
    broker.held -= 2  # two of the seven published jobs' messages are gone
    report = reaper.reap(settings, sessions, broker, now=now)
    assert sorted(report["republished"]) == sorted([backlog[2], backlog[4]])  # published 50 and 40 s before the rest
    assert job_row(backlog[2]).published_at == now and job_row(recent).published_at < now
    broker.waiting = lambda: None  # a broker that cannot say: every long-waiting job goes again, as before
    assert sorted(reaper.reap(settings, sessions, broker, now=now + timedelta(seconds=long_ago))["republished"]) == \
        sorted(backlog + [recent, never])


def test_broker_down_loses_nothing(settings, sessions, make_job, job_row):
    now = utcnow()
    job_ids = [make_job(created_at=now - timedelta(seconds=10)) for _ in range(5)]
    stale = make_job(status="running", attempts=1, worker="gone:1", started_at=now - timedelta(seconds=30),
                     heartbeat_at=now - timedelta(seconds=30), created_at=now - timedelta(seconds=30))
    down = RecordingPublisher()
    down.fail = True
    report = reaper.reap(settings, sessions, down, now=now)
    assert report["republished"] == [] and report["requeued"] == [stale]
    # One try per step, not one per job: each failed try costs the publish retry policy (about a second).
    assert down.tries == 2
    for job_id in job_ids + [stale]:
        assert job_row(job_id).published_at is None and job_row(job_id).status == "queued"
    up = RecordingPublisher()
    assert sorted(reaper.reap(settings, sessions, up, now=now)["republished"]) == sorted(job_ids + [stale])
    assert sorted(up.published) == sorted(job_ids + [stale])


def test_concurrent_reapers_act_once_per_job(settings, sessions, make_job, job_row):
    now = utcnow()
    stale = [make_job(status="running", attempts=1, worker="gone:1", started_at=now - timedelta(seconds=60),
                      heartbeat_at=now - timedelta(seconds=60)) for _ in range(6)]
    unpublished = [make_job(created_at=now - timedelta(seconds=60)) for _ in range(6)]
    publisher = RecordingPublisher()
    barrier = threading.Barrier(4)
    errors = []

    def run():
        barrier.wait()
        try:
            reaper.reap(settings, sessions, publisher, now=now)
        except Exception as e:  # pragma: no cover - shown in the assertion
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert Counter(publisher.published) == Counter(stale + unpublished)  # each exactly once
    assert all(job_row(j).status == "queued" and job_row(j).attempts == 1 for j in stale)


def test_a_waiting_sweep_whose_children_are_done_is_published(settings, sessions, make_job, job_row, publisher):
    now = utcnow()
    done_parent = make_job(kind="fake_sweep", params={}, status="running", waiting_children=True)
    for status in ("succeeded", "failed"):
        make_job(status=status, parent_id=done_parent, finished_at=now - timedelta(seconds=5),
                 summary={"total": 10} if status == "succeeded" else None)
    busy_parent = make_job(kind="fake_sweep", params={}, status="running", waiting_children=True)
    make_job(status="succeeded", parent_id=busy_parent, finished_at=now)
    make_job(status="running", parent_id=busy_parent, heartbeat_at=now, started_at=now, attempts=1, worker="w:1")

    assert reaper.reap(settings, sessions, publisher, now=now)["parents"] == [done_parent]
    assert reaper.reap(settings, sessions, publisher, now=now)["parents"] == []  # published once
    assert publisher.published == publisher.aggregations == [done_parent]
    # ... and the published parent is aggregated.
    assert runner.execute(done_parent, settings, sessions, publisher) == "succeeded"
    assert job_row(done_parent).summary["children"] == {"succeeded": 1, "failed": 1, "cancelled": 0}


def test_a_stuck_aggregation_is_retried(settings, sessions, make_job, job_row, publisher):
    now = utcnow()
    parent = make_job(kind="fake_sweep", params={}, status="running", waiting_children=False, attempts=1,
                      worker="gone:1", heartbeat_at=now - timedelta(seconds=60))
    make_job(status="succeeded", parent_id=parent, summary={"total": 3}, finished_at=now - timedelta(seconds=60))
    assert reaper.reap(settings, sessions, publisher, now=now)["requeued"] == [parent]
    job = job_row(parent)
    assert job.waiting_children and job.status == "running" and publisher.published == publisher.aggregations == [parent]
    assert runner.execute(parent, settings, sessions, publisher) == "succeeded"
    assert job_row(parent).summary["sum"] == 3 and job_row(parent).attempts == 2


def test_recover_interrupted_after_a_restart(settings, sessions, make_job, job_row):
    now = utcnow()
    again = make_job(status="running", attempts=1, worker="old:1", heartbeat_at=now, started_at=now)
    spent = make_job(status="running", attempts=3, max_attempts=3, worker="old:1", heartbeat_at=now, started_at=now)
    queued = make_job()
    for job_id in (again, spent):
        settings.job_dir(job_id).mkdir(parents=True)
        (settings.job_dir(job_id) / "loss.png").write_bytes(b"png")
    report = reaper.recover_interrupted(settings, sessions)
    assert report == {"requeued": [again], "failed": [spent]}
    assert (job_row(again).status, job_row(again).attempts) == ("queued", 1)
    assert job_row(spent).status == "failed" and "worker lost 3 times" in job_row(spent).error_message
    assert job_row(queued).status == "queued"
    with sessions() as session:  # the failed job's files are listed; the requeued one's await its next attempt
        rows = session.execute(select(Artifact.job_id, Artifact.name)).all()
    assert [tuple(r) for r in rows] == [(spent, "loss.png")]


def test_a_job_that_ran_into_the_hard_time_limit_fails_and_is_not_retried(settings, sessions, make_job, job_row,
                                                                          publisher):
    """The hard limit killed the process (a long call the soft limit could not interrupt): the row stays
    running, its heartbeat goes stale. Another attempt would be killed again: time-limit, not a requeue."""
    settings = replace(settings, task_time_limit=20)
    now = utcnow()
    parent = make_job(kind="fake_sweep", params={}, status="running", waiting_children=True)
    killed = make_job(status="running", attempts=1, worker="gpu-1:7", parent_id=parent,
                      started_at=now - timedelta(seconds=25), heartbeat_at=now - timedelta(seconds=5.1))
    (settings.job_dir(killed) / "checkpoints").mkdir(parents=True)
    (settings.job_dir(killed) / "checkpoints" / "step-10.txt").write_text("x")
    # lost after 10 s, 25 s ago: a lost worker; the time it ran is judged by its last heartbeat, not by now
    short = make_job(status="running", attempts=1, worker="gpu-2:7",
                     started_at=now - timedelta(seconds=25), heartbeat_at=now - timedelta(seconds=15))
    # An aggregation's started_at is its sweep's: it is never taken for a job killed by the limit.
    aggregating = make_job(kind="fake_sweep", params={}, status="running", waiting_children=False, attempts=1,
                           worker="gpu-3:7", started_at=now - timedelta(hours=2), heartbeat_at=now - timedelta(seconds=5))
    report = reaper.reap(settings, sessions, publisher, now=now)

    assert report["failed"] == [killed] and sorted(report["requeued"]) == sorted([short, aggregating])
    job = job_row(killed)
    assert (job.status, job.error_type, job.attempts) == ("failed", "time-limit", 1)
    assert "LMSCOPE_TASK_TIME_LIMIT=20 s" in job.error_message and "Not retried" in job.error_message
    assert parent in publisher.published and killed not in publisher.published
    with sessions() as session:
        names = session.execute(select(Artifact.name).where(Artifact.job_id == killed)).scalars().all()
    assert names == ["checkpoints/step-10.txt"]


def _database_down(db_url):
    """The jobs table out of reach (as the delivery tests do): every reaper query fails until ``up()``."""
    from lmscope.db.engine import make_engine

    engine = make_engine(db_url)
    with engine.begin() as c:
        c.execute(text("ALTER TABLE jobs RENAME TO jobs_away"))

    def up():
        with engine.begin() as c:
            c.execute(text("ALTER TABLE jobs_away RENAME TO jobs"))
        engine.dispose()

    return up


def test_a_database_outage_does_not_restart_healthy_jobs(settings, sessions, make_job, job_row, publisher, db_url,
                                                         caplog):
    """Nobody can write a heartbeat while the database is down: right after it, every heartbeat looks stale.
    Lost workers are looked for again only stale_after after the database answered again."""
    stale_after = timedelta(seconds=settings.stale_after_seconds)
    t0 = utcnow()
    healthy = make_job(status="running", attempts=1, worker="gpu-1:7", started_at=t0, heartbeat_at=t0)
    dead = make_job(status="running", attempts=1, worker="gpu-2:7", started_at=t0, heartbeat_at=t0)
    clock = [0.0]
    passes = reaper.ReaperPasses(settings, sessions, publisher, clock=lambda: clock[0])
    assert passes.run_pass(now=t0) is not None

    up = _database_down(db_url)
    try:
        with caplog.at_level(logging.INFO, logger="lmscope.reaper"):
            assert passes.run_pass(now=t0 + timedelta(seconds=1)) is None  # failed; tried again next pass
            for seconds in (20, 25):
                clock[0] += 30
                assert passes.run_pass(now=t0 + timedelta(seconds=seconds)) is None
    finally:
        up()
    back = t0 + timedelta(seconds=30)  # both heartbeats are now 30 s old, 15 × stale_after
    with caplog.at_level(logging.INFO, logger="lmscope.reaper"):
        assert passes.run_pass(now=back)["requeued"] == []
    # said when the outage starts, a minute later (the second failure, 30 s in, is not said) and when it ends
    said = [r.getMessage() for r in caplog.records if "reaper pass" in r.getMessage()]
    assert len(said) == 3 and said[0].startswith("reaper pass failed; retrying every"), said
    assert said[1].startswith("reaper passes still fail (3 in a row): "), said
    assert said[2].startswith("reaper passes work again after 3 failed passes;"), said
    assert passes.run_pass(now=back + stale_after / 2)["requeued"] == []
    # The healthy job's heartbeat thread writes again; the dead one's never does.
    with sessions() as s, s.begin():
        s.execute(update(Job).where(Job.id == healthy).values(heartbeat_at=back + stale_after / 2))
    assert passes.run_pass(now=back + stale_after + timedelta(seconds=0.1))["requeued"] == [dead]
    assert job_row(healthy).status == "running" and job_row(dead).status == "queued"


def test_a_gap_between_reaper_passes_counts_as_an_outage(settings, sessions, make_job, job_row, publisher):
    """A reaper stopped (or starved) for longer than stale_after cannot tell a dead worker from a
    database it could not reach: it waits stale_after before calling any worker lost."""
    t0 = utcnow()
    job_id = make_job(status="running", attempts=1, worker="gpu-1:7", started_at=t0, heartbeat_at=t0)
    passes = reaper.ReaperPasses(settings, sessions, publisher)
    assert passes.run_pass(now=t0)["requeued"] == []
    later = t0 + timedelta(seconds=settings.stale_after_seconds * 10)
    assert passes.run_pass(now=later)["requeued"] == []
    assert job_row(job_id).status == "running"
    assert passes.run_pass(now=later + timedelta(seconds=settings.stale_after_seconds / 2))["requeued"] == []
    assert passes.run_pass(now=later + timedelta(seconds=settings.stale_after_seconds + 0.1))["requeued"] == [job_id]


def test_jobs_waiting_for_a_broker_that_refuses_are_never_shown_as_sent(monkeypatch, settings, sessions, make_job,
                                                                      job_row):
    """A pass claimed every unsent job (published_at = now) before trying the broker, and gave them back after
    the refused try: for that second, at every pass, their pages said the broker had them (a sweep's
    children_unsent blinked off). While this process's publishing fails, one job tries the broker first."""
    from lmscope import queue

    monkeypatch.setattr(queue, "broker_outage", queue.BrokerOutageLog())
    unsent = [make_job(status="queued", published_at=None) for _ in range(3)]
    marked_during_tries = []

    class Broker:
        down = True
        sent: list[int] = []

        def publish(self, job_id, *, aggregation=False):
            marked_during_tries.append([job_row(j).published_at is not None for j in unsent])
            if self.down:
                raise ConnectionError("Connection refused")
            self.sent.append(job_id)

    broker = Broker()
    passes = reaper.ReaperPasses(replace(settings, unpublished_after_seconds=0.0), sessions, broker)
    assert passes.run_pass()["republished"] == []  # the first refusal: this process did not know yet
    assert queue.broker_outage.failing
    marked_during_tries.clear()
    for _ in range(3):
        assert passes.run_pass()["republished"] == []
    assert marked_during_tries == [[False, False, False]] * 3  # one try a pass, nothing marked as sent meanwhile
    assert [job_row(j).published_at for j in unsent] == [None, None, None]

    broker.down = False  # it answers: the first goes unclaimed, the others claimed, each once
    assert passes.run_pass()["republished"] == unsent
    assert broker.sent == unsent and all(job_row(j).published_at is not None for j in unsent)
    assert not queue.broker_outage.failing


def test_publishing_failures_are_said_when_they_start_each_minute_and_when_they_end(monkeypatch, caplog, settings,
                                                                                    sessions, make_job, job_row):
    """A reaper re-publishes unsent jobs every few seconds: while the broker is down that was two lines a pass
    per worker (2000 lines for 10 minutes on 8 workers)."""
    from lmscope import queue

    clock = [1000.0]
    monkeypatch.setattr(queue, "broker_outage", queue.BrokerOutageLog(clock=lambda: clock[0]))

    class Broker:
        down = True

        def publish(self, job_id, *, aggregation=False):
            if self.down:
                raise ConnectionError("Error 111 connecting to 127.0.0.1:6391. Connection refused.")

    broker = Broker()
    unsent = [make_job(status="queued", published_at=None) for _ in range(2)]
    passes = reaper.ReaperPasses(replace(settings, unpublished_after_seconds=0.0), sessions, broker)
    with caplog.at_level(logging.INFO, logger="lmscope"):
        for _ in range(12):  # a pass every 5 s for a minute
            assert queue.send_each(broker, [8, 9]) == ([], [8, 9])  # nothing lost: both still to send
            clock[0] += 5
        assert passes.run_pass()["republished"] == []  # the reaper's pass: the same outage
        assert [job_row(j).published_at for j in unsent] == [None, None]
        broker.down = False
        assert passes.run_pass()["republished"] == unsent
        queue.send_each(broker, [10])  # after the outage: nothing to say
    said = [r.getMessage() for r in caplog.records if r.name in ("lmscope.queue", "lmscope.reaper")]
    assert len(said) == 4, said
    assert said[0].startswith("could not publish job 8 (ConnectionError: Error 111") and "1 more left" in said[0]
    assert said[1].startswith("publishing still fails after 13 tries in 60 s")
    assert said[2] == "publishing works again after 13 failed tries"
    assert said[3] == f"published jobs {unsent}, which waited for the broker"

    # An outage long over (no publish in this process since) does not run into the next one: that one is said
    # as new, with its job, and the reaper names what it publishes meanwhile.
    broker.down = True
    queue.send_each(broker, [11])
    clock[0] += 3600
    assert not queue.broker_outage.failing
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmscope.queue"):
        queue.send_each(broker, [12])
    assert [r.getMessage()[:26] for r in caplog.records] == ["could not publish job 12 ("]
