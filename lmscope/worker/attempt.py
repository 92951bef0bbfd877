"""One attempt at a job and its hold on the job row.

An attempt owns the row while ``status='running'``, ``worker`` is this process and ``attempts`` is
its number. Every write an attempt makes (heartbeat, progress, results) is conditional on that, so
an attempt the reaper already gave up on (stale heartbeat → re-queued) can never overwrite what
its successor does: it notices (``AttemptLost``) and stops quietly.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from sqlalchemy import update
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from lmscope.db.models import Job, utcnow
from lmscope.repeated_failures import RepeatedFailures

log = logging.getLogger("lmscope.worker")

# How long a step that needs the database (storing results, registering a checkpoint, looking up a model)
# waits for it through an outage before the attempt gives up (its row stays running; the reaper re-queues it).
OUTAGE_PATIENCE_SECONDS = 300.0

T = TypeVar("T")


class AttemptLost(Exception):
    """This attempt no longer owns its job row (re-queued by the reaper or taken over)."""


class WorkerShutdown(Exception):
    """The embedded worker is stopping; the job goes back to the queue."""


def is_outage(e: BaseException) -> bool:
    """A database that does not answer (down, restarting, connection dropped, SQLite locked), not a bad
    statement: SQLite also raises OperationalError for "no such table" or a read-only file, and waiting
    would not mend those."""
    if isinstance(e, InterfaceError) or getattr(e, "connection_invalidated", False):
        return True
    if not isinstance(e, OperationalError):
        return False
    # psycopg: 08… connection exceptions, 57P… the server going away, 40001/40P01 a serialisation failure
    # or deadlock (retrying is what they ask for)
    state = getattr(e.orig, "sqlstate", None)
    if state is not None:
        return state.startswith(("08", "57P", "40001", "40P01"))
    text = str(e.orig or e).lower()
    return any(sign in text for sign in ("connect", "server closed", "database is locked", "timeout", "timed out"))


class OutageLog(RepeatedFailures):
    """Logs a retried write's failures during a database outage when it starts, once a minute while it
    lasts and when the write works again, not at every try (a heartbeat and progress reports try several
    times a second). Other database errors (a value out of range, a wrong schema) are logged every time."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def failed(self, e: BaseException) -> None:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        if not is_outage(e):
            log.warning("%s failed: %s", self.what, reason)  # not an outage: said every time, not counted
            return
        when = self.note_failure()
        if when == "first":
            log.warning("%s failed: %s; retrying (logged again each minute until it works)", self.what, reason)
        elif when == "again":
            log.warning("%s still fails after %d tries in %.0f s: %s", self.what, self.failures, self.seconds, reason)

    def worked(self) -> None:
        if ended := self.note_success():
            log.warning("%s works again after %d failed tries", self.what, ended)


@dataclass
class Attempt:
    job_id: int
    number: int  # the row's `attempts` after this attempt's claim
    worker: str  # host:pid
    kind: str
    params: dict[str, Any]
    parent_id: int | None
    max_attempts: int

    def owned(self):
        """SQL condition: the row is still this attempt's."""
        return (Job.id == self.job_id) & (Job.status == "running") & (Job.worker == self.worker) & \
            (Job.attempts == self.number)


def through_outage(what: str, work: Callable[[], T], *, stop: threading.Event | None = None,
                   patience: float | None = None) -> T:
    """``work()``, tried again while the database does not answer (up to ``patience`` seconds, by default
    OUTAGE_PATIENCE_SECONDS, or until ``stop`` is set): a job storing its results or registering a
    checkpoint while PostgreSQL restarts goes on instead of failing for good. Any other error is raised."""
    outage = OutageLog(what)
    give_up = time.monotonic() + (OUTAGE_PATIENCE_SECONDS if patience is None else patience)
    wait = 0.5
    while True:
        try:
            result = work()
        except SQLAlchemyError as e:
            if not is_outage(e) or (stop is not None and stop.is_set()) or time.monotonic() + wait > give_up:
                raise
            outage.failed(e)
            if stop is not None:
                if stop.wait(wait):  # a shutdown is not kept waiting, nor made to wait for one more try
                    raise
            else:
                time.sleep(wait)
            wait = min(2 * wait, 10.0)
            continue
        outage.worked()
        return result


class Heartbeat(threading.Thread):
    """Refreshes ``heartbeat_at`` every ``interval`` seconds in its own short transactions.

    Each beat also reads ``cancel_requested`` (so a job that reports progress rarely still learns of a
    cancel within one interval) and notices a lost row.
    """

    def __init__(self, session_factory: sessionmaker[Session], attempt: Attempt, interval: float):
        super().__init__(name=f"heartbeat-{attempt.job_id}", daemon=True)
        self.session_factory = session_factory
        self.attempt = attempt
        self.interval = max(0.05, float(interval))
        self.cancel_requested = False
        self.lost = False
        self._stopping = threading.Event()
        self._outage = OutageLog(f"heartbeat of job {attempt.job_id}")

    def beat(self) -> None:
        try:
            with self.session_factory() as session, session.begin():
                row = session.execute(
                    update(Job).where(self.attempt.owned()).values(heartbeat_at=utcnow())
                    .returning(Job.cancel_requested)).one_or_none()
        except SQLAlchemyError as e:  # a database blip must not kill a long job; the next beat retries
            self._outage.failed(e)
            return
        self._outage.worked()
        if row is None:
            self.lost = True
        elif row.cancel_requested:
            self.cancel_requested = True

    def run(self) -> None:
        while not self._stopping.wait(self.interval):
            self.beat()
            if self.lost:
                return

    def stop(self) -> None:
        self._stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=self.interval + 5)
