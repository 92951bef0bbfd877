"""The embedded mode's worker (``lmscope up``, lmscope.up: API and worker in one process, SQLite).

The worker thread claims queued jobs straight from SQL, oldest first, with the same runner as a
Celery worker (so the same claim, heartbeat, progress, cancel and result rules hold), and runs a
reaper pass every few seconds. Publishing only wakes it up (``lmscope.queue.LocalPublisher``): a
lost wake-up costs at most ``poll_seconds``. Jobs queued or running when the process stops are
picked up again at the next start (``reaper.recover_interrupted``).
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from lmscope.config import Settings
from lmscope.db.models import Job
from lmscope.params import KINDS, is_parent_kind
from lmscope.queue import LocalPublisher
from lmscope.worker import runner
from lmscope.worker.environment import worker_id
from lmscope.worker.reaper import ReaperPasses, reap_interval

log = logging.getLogger("lmscope.worker")


class EmbeddedWorker:
    """``threads`` worker threads in this process (default one: one device, one job at a time)."""

    def __init__(self, settings: Settings, session_factory: sessionmaker[Session],
                 publisher: LocalPublisher | None = None, *, threads: int = 1, poll_seconds: float = 1.0):
        self.settings = settings
        self.session_factory = session_factory
        self.publisher = publisher or LocalPublisher()
        self.poll_seconds = poll_seconds
        self.stopping = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name=f"lmscope-worker-{i}", daemon=True)
                         for i in range(threads)]
        self._reap_every = reap_interval(settings)
        self._last_reap = 0.0
        # the same outage grace as the Celery reaper's (a PostgreSQL behind `lmscope up` can restart too)
        self._reaper = ReaperPasses(settings, session_factory, self.publisher)
        self._reap_lock = threading.Lock()

    def start(self) -> "EmbeddedWorker":
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 30.0) -> bool:
        """Ask the threads to stop; a running job goes back to the queue at its next progress report.
        Returns False if a thread was still busy after ``timeout`` (its job is recovered at next start)."""
        self.stopping.set()
        self.publisher.wakeup.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def stopped_reason(self) -> str | None:
        """Why this worker takes no more jobs, in words for the job page and /readyz; None while it takes them."""
        if runner.broken_device:
            return (f"the GPU is unusable in this process ({runner.broken_device}); restart `lmscope up`: "
                    "queued jobs stay queued and run after the restart")
        return None

    # ------------------------------------------------------------ the loop

    def next_queued(self) -> int | None:
        """The oldest queued job that is not a sweep parent."""
        with self.session_factory() as session:
            return session.execute(select(Job.id).where(Job.status == "queued",
                                                        Job.kind.not_in([k for k in KINDS if is_parent_kind(k)]))
                                   .order_by(Job.id).limit(1)).scalar_one_or_none()

    def run_once(self) -> bool:
        """Aggregate published parents, then run one queued job. True if there was work."""
        worked = False
        for job_id in self.publisher.drain():
            with self.session_factory() as session:
                kind = session.execute(select(Job.kind).where(Job.id == job_id)).scalar_one_or_none()
            if kind is not None and is_parent_kind(kind):
                worked |= self._execute(job_id) is not None
        job_id = self.next_queued()
        if job_id is not None:
            self._execute(job_id)
            worked = True
        return worked

    def _execute(self, job_id: int) -> str | None:
        try:
            return runner.execute(job_id, self.settings, self.session_factory, self.publisher,
                                  worker=worker_id(), shutdown=self.stopping,
                                  shares_process=len(self._threads) > 1)
        except runner.DatabaseLostDuringJob as e:
            log.error("%s", e)
            return None
        except Exception:  # keep serving; the job's row tells what happened (or the reaper recovers it)
            log.exception("job %s: the worker failed outside the job", job_id)
            return None

    def _maybe_reap(self) -> None:
        if time.monotonic() - self._last_reap < self._reap_every or not self._reap_lock.acquire(blocking=False):
            return
        try:
            self._last_reap = time.monotonic()
            self._reaper.run_pass()  # logs its own failures
        finally:
            self._reap_lock.release()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            stopped = self.stopped_reason()
            if stopped:  # every job would fail on it; queued jobs wait for the restart
                log.critical("this worker takes no more jobs: %s", stopped)
                return
            self.publisher.wakeup.clear()
            try:
                worked = self.run_once()
            except Exception:  # e.g. the database is briefly unavailable
                log.exception("embedded worker loop failed; retrying")
                worked = False
            self._maybe_reap()
            if not worked:
                self.publisher.wakeup.wait(self.poll_seconds)
