"""The reaper: no job is lost to a dead worker, a lost message or a restart.

One pass (``reap``) does three things, each with conditional UPDATEs so that any number of reapers
(a reaper process beside every Celery worker, or the embedded worker between jobs) can run at once and
each job is acted on by exactly one of them:

1. running jobs whose heartbeat is older than ``stale_after_seconds``: ``failed`` with ``time-limit``
   when the attempt had run into the hard time limit (the limit killed its process: a retry would be
   killed again), else back to ``queued`` and published again while ``attempts < max_attempts``,
   else ``failed`` ("worker lost N times; last seen at ..."). A sweep parent stuck in its aggregation
   waits for its aggregation again. Not within ``stale_after_seconds`` of a database outage (nobody
   could write a heartbeat during it; see ``ReaperPasses``).
2. queued jobs never published (``published_at`` NULL for ``unpublished_after_seconds``), and those
   published so long ago that their message may be lost (``REPUBLISH_FACTOR`` × the larger of the two
   thresholds): published again. A long wait alone is no loss (a backlog of jobs that take hours): where
   the broker says how many messages it holds, only as many of the longest-waiting jobs as the queued
   jobs outnumber its messages are. A duplicate message is harmless (the claim drops it) but not free:
   re-sending the whole backlog every pass had piled one more message per queued job into Redis.
3. sweep parents still waiting although every child is terminal: published (the aggregation claim
   makes it run exactly once).

``recover_interrupted`` is the start-up step of the embedded mode: one process owns every job, so
whatever is ``running`` in the database belonged to a process that is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta

from sqlalchemy import and_, exists, func, or_, select, update
from sqlalchemy.orm import Session, aliased, sessionmaker

from lmscope.config import Settings
from lmscope.db.models import ACTIVE_STATES, Job, utcnow
from lmscope.params import is_parent_kind
from lmscope import queue as job_queue
from lmscope.queue import Publisher, send_each
from lmscope.repeated_failures import RepeatedFailures
from lmscope.worker.runner import (after_terminal, end_keeping_files, give_back_values, ran_into_time_limit,
                                   time_limit_values, worker_lost_values)

log = logging.getLogger("lmscope.reaper")

# A queued job published this many thresholds ago without being claimed: its message is presumed
# lost. Generous, because a deep queue legitimately holds messages for a long time.
REPUBLISH_FACTOR = 10


def republish_after(settings: Settings) -> float:
    return max(settings.unpublished_after_seconds, settings.stale_after_seconds) * REPUBLISH_FACTOR


def reap_interval(settings: Settings) -> float:
    """How often a reaper runs: often enough to notice each threshold within a fraction of it."""
    return max(0.5, min(settings.heartbeat_seconds, settings.unpublished_after_seconds / 2,
                        settings.stale_after_seconds / 4, 30.0))


def _publish_claimed(publisher: Publisher, session_factory: sessionmaker[Session], job_ids: list[int], *,
                     aggregation: bool = False) -> list[int]:
    """Publish ids whose ``published_at`` we already set; undo it for those the broker refused."""
    sent, failed = send_each(publisher, job_ids, aggregation=aggregation)
    if failed:
        with session_factory() as session, session.begin():
            session.execute(update(Job).where(Job.id.in_(failed)).values(published_at=None))
    return sent


def reap(settings: Settings, session_factory: sessionmaker[Session], publisher: Publisher,
         now: datetime | None = None, database_back_at: datetime | None = None) -> dict[str, list[int]]:
    """One pass. Returns the job ids acted on: requeued, failed, republished, parents.

    ``database_back_at``: when the database answered again after an outage (``ReaperPasses``). Until
    ``stale_after_seconds`` after it, no worker is called lost: heartbeats could not be written before."""
    now = now or utcnow()
    report: dict[str, list[int]] = {"requeued": [], "failed": [], "republished": [], "parents": []}
    stale_cut = now - timedelta(seconds=settings.stale_after_seconds)

    # 1. lost workers
    stale = (Job.status == "running") & Job.waiting_children.is_(False) & or_(
        Job.heartbeat_at < stale_cut, and_(Job.heartbeat_at.is_(None), Job.started_at < stale_cut))
    rows = []
    if database_back_at is None or database_back_at < stale_cut:
        with session_factory() as session:
            rows = session.execute(select(Job.id, Job.kind, Job.attempts, Job.max_attempts, Job.heartbeat_at,
                                          Job.started_at, Job.worker, Job.parent_id).where(stale).order_by(Job.id)).all()
    to_publish, to_aggregate, failed_children = [], [], []
    for r in rows:
        still = (Job.id == r.id) & (Job.attempts == r.attempts) & stale  # re-checked atomically
        if ran_into_time_limit(settings, r.kind, r.started_at, r.heartbeat_at or now):
            # The hard limit killed it (a long call the soft limit could not interrupt): not retried.
            values, key = time_limit_values(settings, r.attempts, now), "failed"
        elif r.attempts < r.max_attempts:
            values = give_back_values(r.kind, published_at=now)  # published right below
            key = "requeued"
        else:
            values, key = worker_lost_values(r.attempts, r.heartbeat_at, r.worker, now), "failed"
        if key == "failed":
            changed = end_keeping_files(settings, session_factory, r.id, still, values)
        else:
            with session_factory() as session, session.begin():
                changed = session.execute(update(Job).where(still).values(**values)).rowcount == 1
        if not changed:
            continue  # another reaper got there, or the job came back to life
        report[key].append(r.id)
        log.warning("job %s: worker %s stale since %s → %s%s (attempt %s of %s)", r.id, r.worker, r.heartbeat_at,
                    key, f" ({values['error_type']})" if key == "failed" else "", r.attempts, r.max_attempts)
        if key == "requeued":  # a parent lost mid-aggregation waits for its aggregation again
            (to_aggregate if is_parent_kind(r.kind) else to_publish).append(r.id)
        elif r.parent_id is not None:
            failed_children.append(r.parent_id)
    _publish_claimed(publisher, session_factory, to_publish)
    _publish_claimed(publisher, session_factory, to_aggregate, aggregation=True)
    for parent_id in dict.fromkeys(failed_children):
        after_terminal(session_factory, publisher, parent_id)

    # 2. never-sent and lost messages
    queued = Job.status == "queued"
    never_sent = queued & Job.published_at.is_(None) & (
        Job.created_at < now - timedelta(seconds=settings.unpublished_after_seconds))
    long_waiting = queued & (Job.published_at < now - timedelta(seconds=republish_after(settings)))
    report["republished"] = _claim_and_publish(session_factory, publisher, never_sent, now)
    with session_factory() as session:  # the broker is asked only when some job has waited that long
        any_long_waiting = session.scalar(select(Job.id).where(long_waiting).limit(1)) is not None
    if any_long_waiting:
        report["republished"] += _claim_and_publish(session_factory, publisher, long_waiting, now,
                                                    most=messages_missing(session_factory, publisher))

    # 3. sweep parents whose children are all done but that nobody aggregated
    child = aliased(Job)
    active = exists().where(child.parent_id == Job.id, child.status.in_(ACTIVE_STATES))
    ready = (Job.status == "running") & Job.waiting_children.is_(True) & ~active & or_(
        Job.published_at.is_(None), Job.published_at < now - timedelta(seconds=republish_after(settings)),
        Job.published_at < _last_child_finished())
    report["parents"] = _claim_and_publish(session_factory, publisher, ready, now, aggregation=True)
    return report


def _last_child_finished():
    child = aliased(Job)
    return select(func.max(child.finished_at)).where(child.parent_id == Job.id).scalar_subquery()


def messages_missing(session_factory: sessionmaker[Session], publisher: Publisher) -> int | None:
    """How many queued jobs' messages the broker may have lost: the published queued jobs less the messages
    it holds (duplicates and cancelled jobs' messages count as held, so a loss can show only once the queue
    has drained that far: when the lost job's turn would have come). None when the broker cannot say."""
    waiting = publisher.waiting() if hasattr(publisher, "waiting") else None
    if waiting is None:
        return None
    with session_factory() as session:
        published = session.scalar(select(func.count()).select_from(Job)
                                    .where(Job.status == "queued", Job.published_at.is_not(None)))
    return max(0, published - waiting)


CLAIM_CHUNK = 500  # ids per claiming UPDATE


def _claim_and_publish(session_factory: sessionmaker[Session], publisher: Publisher, condition, now, *,
                       aggregation: bool = False, most: int | None = None) -> list[int]:
    """Publish the jobs matching `condition` (at most `most`, those published longest ago first), each
    claimed by setting ``published_at`` under the same condition, so concurrent reapers never both send one."""
    if most == 0:
        return []
    with session_factory() as session:
        ids = session.execute(select(Job.id).where(condition).order_by(Job.published_at, Job.id)
                              .limit(most)).scalars().all()
    in_outage = job_queue.broker_outage.failing
    first: list[int] = []
    if ids and in_outage:
        # While the broker refuses, try it with one job before claiming any: a claim marks the jobs sent
        # for the second a refused try takes, and their pages said, at every pass, that the broker had them.
        # Sent unclaimed, it may go twice when two reapers see the broker come back: the claim drops one.
        first, _ = send_each(publisher, ids[:1], aggregation=aggregation)
        if not first:
            return []
        with session_factory() as session, session.begin():
            session.execute(update(Job).where((Job.id == first[0]) & condition).values(published_at=now))
        ids = ids[1:]
    claimed = []
    for start in range(0, len(ids), CLAIM_CHUNK):
        with session_factory() as session, session.begin():
            claimed += session.execute(update(Job).where(Job.id.in_(ids[start:start + CLAIM_CHUNK]) & condition)
                                       .values(published_at=now).returning(Job.id)).scalars().all()
    claimed.sort()
    # during an outage the same jobs come back at every pass, and send_each sums its failures up; the pass
    # after it names what it sent
    if claimed and not in_outage:
        log.info("publishing jobs %s (never sent, or their message was lost)", claimed)
    sent = first + _publish_claimed(publisher, session_factory, claimed, aggregation=aggregation)
    if sent and in_outage:
        log.info("published jobs %s, which waited for the broker", sorted(sent))
    return sorted(sent)


def recover_interrupted(settings: Settings, session_factory: sessionmaker[Session]) -> dict[str, list[int]]:
    """Embedded start-up: jobs left ``running`` by a previous process are queued again (the attempt
    counts) or failed when out of attempts; interrupted aggregations wait again."""
    report: dict[str, list[int]] = {"requeued": [], "failed": []}
    running = (Job.status == "running") & Job.waiting_children.is_(False)
    with session_factory() as session:
        rows = session.execute(select(Job.id, Job.kind, Job.attempts, Job.max_attempts, Job.heartbeat_at, Job.worker)
                               .where(running)).all()
    for r in rows:
        same = (Job.id == r.id) & (Job.attempts == r.attempts) & running
        if r.attempts >= r.max_attempts:
            values = worker_lost_values(r.attempts, r.heartbeat_at, r.worker, utcnow())
            if end_keeping_files(settings, session_factory, r.id, same, values):
                report["failed"].append(r.id)
            continue
        with session_factory() as session, session.begin():
            if session.execute(update(Job).where(same).values(**give_back_values(r.kind))).rowcount == 1:
                report["requeued"].append(r.id)
    if rows:
        log.warning("recovered jobs interrupted by the previous run: %s", report)
    return report


class ReaperPasses:
    """A reaper's passes, one after another, and what they remember between them.

    During a database outage no worker can write a heartbeat, so when the database is back every running
    job's heartbeat looks stale, healthy ones too. After a pass that failed (or a gap between two passes
    longer than ``stale_after_seconds``: the reaper was stopped or starved), the moment the database
    answered again stands in for every heartbeat older than it: no worker is called lost until
    ``stale_after_seconds`` after that moment, time enough for live attempts to beat again.
    A failure is logged with its traceback once per outage, then one line a minute while it lasts.
    """

    def __init__(self, settings: Settings, session_factory: sessionmaker[Session], publisher: Publisher,
                 clock=time.monotonic):
        self.settings = settings
        self.session_factory = session_factory
        self.publisher = publisher
        self.failed_passes = RepeatedFailures(clock)  # in this outage
        self.last_pass: datetime | None = None  # when the last pass that worked started
        self.database_back_at: datetime | None = None  # when the database answered again after an outage

    @property
    def failing(self) -> bool:
        return self.failed_passes.failing

    def run_pass(self, now: datetime | None = None) -> dict[str, list[int]] | None:
        """One pass; its report, or None if it failed (it is tried again at the next)."""
        now = now or utcnow()
        gap = self.last_pass is not None and (now - self.last_pass).total_seconds() > self.settings.stale_after_seconds
        if self.failing or gap:
            self.database_back_at = now  # (set again at every pass until one works)
        try:
            report = reap(self.settings, self.session_factory, self.publisher, now=now,
                          database_back_at=self.database_back_at)
        except Exception as e:  # the database may be briefly unreachable; try again next pass
            when = self.failed_passes.note_failure()
            if when == "first":  # the traceback once per outage, then a line a minute, not every few seconds
                log.exception("reaper pass failed; retrying every %.1f s (logged again each minute until a pass "
                              "works)", reap_interval(self.settings))
            elif when == "again":
                log.warning("reaper passes still fail (%d in a row): %s: %s", self.failed_passes.failures,
                            type(e).__name__, (str(e).splitlines() or [""])[0])
            return None
        if (failed := self.failed_passes.note_success()) or gap:
            log.info("reaper passes work again%s; no worker is called lost before %s (heartbeats could not be "
                     "written meanwhile)", f" after {failed} failed passes" if failed
                     else f" after a gap since {self.last_pass}",
                     now + timedelta(seconds=self.settings.stale_after_seconds))
        self.last_pass = now
        return report


def run_reaper_process(parent_pid: int) -> None:
    """A Celery worker's reaper, in a process of its own (``python -m lmscope.worker.reaper``).

    Not a thread of the worker's main process: that process forks the pool's children, and fork
    copies SQLite's in-process lock bookkeeping. A child forked while a reaper thread was inside a
    transaction found the database "locked" for ever (seen in CI-like runs). With the reaper here,
    the main process never holds a database connection. It exits when the worker does (its parent
    changes) or on SIGTERM.
    """
    import os
    import signal

    from lmscope.db.builtins import ensure_builtins
    from lmscope.queue import CeleryPublisher
    from lmscope.worker.startup import load_extra_kinds, session_factory_for

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s/Reaper] %(message)s")
    settings = Settings.from_env()
    load_extra_kinds()  # give_back_values needs to know every kind (sweep parents)
    sessions = session_factory_for(settings)
    try:
        ensure_builtins(settings, sessions)
    except Exception:
        log.exception("could not upsert built-in models/datasets (is the database migrated? `lmscope db upgrade`)")
    passes = ReaperPasses(settings, sessions, CeleryPublisher(settings=settings))
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    interval = reap_interval(settings)
    log.info("reaper running every %.1f s (pid %s, worker %s)", interval, os.getpid(), parent_pid)
    while not stopping.wait(interval):
        if os.getppid() != parent_pid:
            log.info("the worker (pid %s) is gone; the reaper stops", parent_pid)
            return
        passes.run_pass()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="The reaper of a Celery worker (started by the worker).")
    parser.add_argument("--parent", type=int, required=True, help="the worker's pid: stop when it is gone")
    run_reaper_process(parser.parse_args().parent)
