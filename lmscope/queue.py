"""Publishing a job id to the workers: Celery over Redis (team deployment) or in-process (embedded).

A message carries only the job id; the SQL row is the source of truth. Delivery is at-least-once:
a duplicate or a stale message is harmless because the worker claims the row with a conditional
UPDATE, and a lost message is re-sent by the reaper (``lmscope.worker.reaper``).

Who sets ``jobs.published_at``: whoever publishes, *after* the broker accepted the message
(``publish_jobs`` below does both; the API and the runner go through it). The reaper sets it first,
as its claim on a re-publish (concurrent reapers send each message once), then sends through
``send_each`` like ``publish_jobs`` does. A failed publish leaves ``published_at`` NULL so the reaper
sends it again later; the job is never lost.

Light module (imported by the API): celery is imported only when a Celery publisher is made.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Iterable, Protocol

from lmscope.config import time_limits
from lmscope.repeated_failures import RepeatedFailures

if TYPE_CHECKING:  # pragma: no cover
    from celery import Celery
    from sqlalchemy.orm import Session, sessionmaker

    from lmscope.config import Settings

TASK_NAME = "lmscope.run_job"
QUEUE_NAME = "lmscope"
# Message priorities on Redis: kombu keeps one list per priority step (0, 3, 6, 9) and a worker takes
# from the lowest number first. A sweep parent's id (its aggregation: seconds of work that ends a job
# its owner is waiting for) goes ahead of the queued jobs, so the next free worker process takes it
# rather than the one after the whole backlog. (RabbitMQ would ignore both: its queue has no priorities.)
AGGREGATION_PRIORITY = 0
JOB_PRIORITY = 3
# Redis re-delivers a message that is unacknowledged this long after delivery. The hard time limit
# of a job stays below it, so a running job's message is never handed to a second worker.
VISIBILITY_MARGIN_SECONDS = 3600

log = logging.getLogger("lmscope.queue")


class Publisher(Protocol):
    def publish(self, job_id: int, *, aggregation: bool = False) -> None:
        """Hand a job id to the workers; raises if the queue did not accept it. ``aggregation``: the id is
        a sweep parent's, to be aggregated, and goes ahead of the queued jobs."""

    # Optional, where the queue can lose messages: ``waiting() -> int | None``, the messages it holds
    # (None when it cannot say). The reaper republishes only as many long-waiting jobs as are missing.
    # Optional too: ``consumers() -> int | None``, the workers taking jobs from the queue now.


# ---------------------------------------------------------------- Celery

def celery_config(settings: "Settings") -> dict:
    """Celery settings of DESIGN.md §2 (shared by publishers and workers so both agree)."""
    hard_limit = settings.task_time_limit
    return dict(
        broker_url=settings.broker_url,
        # JSON only: a pickle message from anyone who can reach Redis would be code execution.
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        # SQL is the truth: no result backend, nothing stored per task in Redis.
        result_backend=None,
        task_ignore_result=True,
        # Ack after the task returns; a child that dies mid-job puts its message back at once.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # One job in hand per worker process: a long job never holds a second one hostage.
        worker_prefetch_multiplier=1,
        # A soft limit raises inside the job (recorded as failed, not retried); the hard limit
        # kills the child if that did not work. Both below the visibility timeout.
        task_time_limit=hard_limit,
        task_soft_time_limit=time_limits(hard_limit)[0],
        broker_transport_options={"visibility_timeout": hard_limit + VISIBILITY_MARGIN_SECONDS},
        task_default_queue=QUEUE_NAME,
        task_routes={TASK_NAME: {"queue": QUEUE_NAME}},
        broker_connection_retry_on_startup=True,
        # A publish against a dead broker fails within seconds (the API answers, the reaper retries).
        task_publish_retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5,
                                   "interval_max": 1.0},
        broker_connection_timeout=5,
        worker_hijack_root_logger=False,
        # Lost connection: keep running jobs; their messages come back and the claim sorts it out.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        task_send_sent_event=False,
        worker_send_task_events=False,
    )


def make_celery(settings: "Settings") -> "Celery":
    """A Celery app configured from Settings, without task bodies (the worker adds those)."""
    if not settings.broker_url:
        raise ValueError("LMSCOPE_BROKER_URL is not set; Celery needs a broker such as redis://redis:6379/0")
    from celery import Celery

    app = Celery("lmscope", set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


CONSUMERS_TIMEOUT = 1.0  # seconds a census of the workers waits for their answers (a live one answers in ms)
# A broker that accepts connections and never answers (a paused container) held Redis' PING for ever.
BOUNDED_SOCKETS = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0}


class CeleryPublisher:
    """Sends task ``lmscope.run_job`` with args ``[job_id]`` (JSON) to queue ``lmscope``, at
    ``AGGREGATION_PRIORITY`` for a sweep parent's aggregation, else ``JOB_PRIORITY``."""

    def __init__(self, *, settings: "Settings | None" = None, app: "Celery | None" = None):
        if app is None:
            if settings is None:
                raise TypeError("CeleryPublisher needs settings= (with a broker_url) or app=")
            app = make_celery(settings)
        self.app = app

    def publish(self, job_id: int, *, aggregation: bool = False) -> None:
        self.app.send_task(TASK_NAME, args=[int(job_id)], queue=QUEUE_NAME,
                           priority=AGGREGATION_PRIORITY if aggregation else JOB_PRIORITY)

    def waiting(self) -> int | None:
        """Messages waiting in the queue, every priority (not those a worker holds); None if the broker
        cannot be asked. A declare, not a passive one: Redis drops an empty queue's lists, and a passive
        declare of it fails instead of saying 0."""
        try:
            with self.app.connection_for_write(transport_options=BOUNDED_SOCKETS) as conn:
                conn.ensure_connection(max_retries=1)  # a broker that is down: say so within ~2 s, not retry on
                return int(conn.default_channel.queue_declare(QUEUE_NAME, durable=True, auto_delete=False)
                           .message_count)
        except Exception as e:
            log.warning("could not ask the broker how many messages it holds (%s: %s)", type(e).__name__, e)
            return None

    def consumers(self, timeout: float = CONSUMERS_TIMEOUT) -> int | None:
        """Workers consuming queue ``lmscope`` now: those that answer Celery's remote control within
        ``timeout`` seconds. None if the broker cannot be asked."""
        try:
            with self.app.connection_for_write(transport_options=BOUNDED_SOCKETS) as conn:
                conn.ensure_connection(max_retries=1)
                replies = self.app.control.inspect(timeout=timeout, connection=conn).active_queues() or {}
        except Exception as e:
            log.warning("could not ask the workers which queues they consume (%s: %s)", type(e).__name__, e)
            return None
        return sum(1 for queues in replies.values() if any(q.get("name") == QUEUE_NAME for q in queues or ()))


# ---------------------------------------------------------------- embedded

class LocalPublisher:
    """Embedded mode: wakes the in-process worker thread(s).

    The embedded worker claims queued jobs straight from SQL, so a wake-up that is missed (or a
    publish before the worker started) loses nothing; published ids are kept only so that a sweep
    parent whose last child finished is aggregated without waiting for the next reaper pass (the
    worker aggregates the drained ids before it claims its next job, whatever ``aggregation`` says).
    """

    def __init__(self):
        self._ids: deque[int] = deque(maxlen=100_000)  # bounded: SQL and the reaper are the real record
        self._lock = threading.Lock()
        self.wakeup = threading.Event()

    def publish(self, job_id: int, *, aggregation: bool = False) -> None:
        with self._lock:
            self._ids.append(int(job_id))
        self.wakeup.set()

    def drain(self) -> list[int]:
        """Ids published since the last call (each once, in order)."""
        with self._lock:
            ids = list(dict.fromkeys(self._ids))
            self._ids.clear()
        return ids


def make_publisher(settings: "Settings") -> Publisher:
    """Celery when a broker is configured, else an in-process publisher (embedded mode)."""
    if settings.embedded:
        return LocalPublisher()
    return CeleryPublisher(settings=settings)


# ---------------------------------------------------------------- publish + record

class BrokerOutageLog(RepeatedFailures):
    """Publishing failures of this process, logged when they start, once a minute while they go on and
    when publishing works again. A failure more than a minute after the last one starts a new outage (a
    process that publishes now and then, as the API does, may never see the broker answer in between)."""

    def __init__(self, clock=time.monotonic):
        super().__init__(clock, forget_seconds=self.REMIND_SECONDS)

    def failed(self, job_id: int, e: BaseException, rest: int) -> None:
        reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        when = self.note_failure()
        if when == "first":
            log.warning("could not publish job %s (%s)%s; it waits in the database, and the reaper publishes "
                        "it when the broker answers (failures that follow are summed up once a minute)",
                        job_id, reason, f"; {rest} more left unpublished without trying" if rest else "")
        elif when == "again":
            log.warning("publishing still fails after %d tries in %.0f s (%s); the jobs wait, none is lost",
                        self.failures, self.seconds, reason)

    def worked(self) -> None:
        if ended := self.note_success():
            log.warning("publishing works again after %d failed tries", ended)


broker_outage = BrokerOutageLog()


def send_each(publisher: Publisher, job_ids: Iterable[int], *, aggregation: bool = False) -> tuple[list[int], list[int]]:
    """Publish the ids in order; returns (sent, not sent). A failure is logged, not raised (the reaper retries).
    ``aggregation``: the ids are sweep parents' (``Publisher.publish``).

    The first failure stops the round: the broker is down (each try costs the publish retry policy,
    about a second), and trying every id of a 128-point sweep would keep the API's answer (or a reaper
    pass) waiting for minutes. The ids not tried are returned as not sent, to be published later.
    """
    ids = list(job_ids)
    for i, job_id in enumerate(ids):
        try:
            publisher.publish(job_id, aggregation=aggregation)
        except Exception as e:  # broker down: the reaper will retry
            broker_outage.failed(job_id, e, len(ids) - i - 1)
            return ids[:i], ids[i:]
    if ids:
        broker_outage.worked()
    return ids, []


def publish_jobs(publisher: Publisher, session_factory: "sessionmaker[Session]", job_ids: Iterable[int], *,
                 aggregation: bool = False) -> list[int]:
    """Publish each id, then set ``published_at`` for those the queue accepted. ``aggregation``: the ids
    are sweep parents whose children have ended (they go ahead of the queued jobs).

    Returns the ids that were published. A failure is logged, not raised: the committed row stays
    queued with ``published_at`` NULL and the reaper publishes it later; so do the ids after it, which
    are not tried (``send_each``).
    """
    from sqlalchemy import update

    from lmscope.db.models import Job, utcnow

    sent, failed = send_each(publisher, job_ids, aggregation=aggregation)
    try:
        with session_factory() as session, session.begin():
            if sent:
                session.execute(update(Job).where(Job.id.in_(sent)).values(published_at=utcnow()))
            if failed:
                session.execute(update(Job).where(Job.id.in_(failed)).values(published_at=None))
    except Exception as e:  # the message went out; a missing timestamp only means an extra re-publish
        log.warning("could not record published_at for jobs %s: %s", sent + failed, e)
    return sent


__all__ = ["Publisher", "CeleryPublisher", "LocalPublisher", "make_celery", "celery_config", "make_publisher",
           "publish_jobs", "send_each", "TASK_NAME", "QUEUE_NAME", "AGGREGATION_PRIORITY", "JOB_PRIORITY"]
