"""The embedded mode (``lmscope up``): API and worker in one process, SQLite, no other server.

The worker thread claims queued jobs straight from SQL, oldest first, with the same runner as a
Celery worker (so the same claim, heartbeat, progress, cancel and result rules hold), and runs a
reaper pass every few seconds. Publishing only wakes it up (``lmscope.queue.LocalPublisher``): a
lost wake-up costs at most ``poll_seconds``. Jobs queued or running when the process stops are
picked up again at the next start (``reaper.recover_interrupted``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from lmscope.config import Settings
from lmscope.db.models import Job
from lmscope.params import KINDS, is_parent_kind
from lmscope.queue import LocalPublisher
from lmscope.worker import runner
from lmscope.worker.environment import worker_id
from lmscope.worker.reaper import ReaperPasses, reap_interval, recover_interrupted

log = logging.getLogger("lmscope.worker")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


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
            self.publisher.wakeup.clear()
            try:
                worked = self.run_once()
            except Exception:  # e.g. the database is briefly unavailable
                log.exception("embedded worker loop failed; retrying")
                worked = False
            self._maybe_reap()
            if not worked:
                self.publisher.wakeup.wait(self.poll_seconds)


def hold_data_dir(data_dir: Path) -> IO[str]:
    """Lock the data directory for this process, or exit naming the process that holds it.

    A second ``lmscope up`` on the same directory would otherwise take the first one's running jobs
    for interrupted and re-queue them (costing them an attempt), even if it then failed to bind its port.
    The lock goes with the process, also when it is killed.
    """
    lock = open(data_dir / "lmscope-up.lock", "a+")
    if fcntl is None:  # not a POSIX system: no lock to take
        log.warning("cannot lock %s on this platform: do not start a second `lmscope up` on it", data_dir)
        return lock
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if not isinstance(e, BlockingIOError):  # e.g. a network file system without locks
            log.warning("cannot lock %s (%s): do not start a second `lmscope up` on it", data_dir, e)
            return lock
        lock.seek(0)
        holder = lock.read().strip()
        lock.close()
        raise SystemExit(f"{data_dir} is already served by `lmscope up`{f' (pid {holder})' if holder else ''}: "
                         "stop that one, or give this one its own LMSCOPE_DATA_DIR") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def serve(settings: Settings) -> None:
    """``lmscope up``: migrate, upsert built-ins, recover interrupted jobs, serve the API + worker."""
    if not settings.auth and settings.host not in LOOPBACK:
        raise SystemExit(f"refusing to listen on {settings.host} without tokens: set LMSCOPE_AUTH=1 (and create a "
                         "user with `lmscope user create NAME`) or keep LMSCOPE_HOST=127.0.0.1")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Alembic announces every plugin and migration step at INFO: noise before the ready line.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    settings.artifact_dir.mkdir(parents=True, exist_ok=True)
    with hold_data_dir(settings.data_dir):
        _serve_holding_the_data_dir(settings)


def url_host(host: str) -> str:
    """The host as a URL writes it: an IPv6 address in brackets (http://[::1]:8765/)."""
    return f"[{host}]" if ":" in host else host


def _serve_holding_the_data_dir(settings: Settings) -> None:
    from werkzeug.serving import make_server

    from lmscope.api import create_app
    from lmscope.db.builtins import ensure_builtins
    from lmscope.db.engine import make_engine, make_sessionmaker, upgrade
    from lmscope.worker.startup import load_extra_kinds

    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    ensure_builtins(settings, sessions)
    load_extra_kinds()

    publisher = LocalPublisher()
    app = create_app(settings, publisher=publisher)
    # Bind before recovering: a start that cannot serve must leave the jobs as they are.
    try:
        server = make_server(settings.host, settings.port, app, threaded=True)
    except (OSError, SystemExit):  # werkzeug prints why (e.g. the port is in use) and exits
        raise SystemExit(f"cannot listen on {url_host(settings.host)}:{settings.port}: give another port with --port or "
                         "LMSCOPE_PORT; no job was touched") from None
    recovered = recover_interrupted(settings, sessions)
    worker = EmbeddedWorker(settings, sessions, publisher).start()

    def _shutdown(signum, _frame):
        log.info("signal %s: shutting down", signum)
        worker.stopping.set()  # running jobs return to the queue at their next progress report
        threading.Thread(target=server.shutdown, daemon=True).start()

    previous = {s: signal.signal(s, _shutdown) for s in (signal.SIGINT, signal.SIGTERM)}
    base = f"http://{url_host(settings.host)}:{server.port}"
    print(f"lmscope up: dashboard {base}/  API docs {base}/docs  (data in {settings.data_dir}; "
          f"{len(recovered['requeued'])} interrupted job(s) re-queued)", flush=True)
    if settings.auth:
        print("lmscope up: bearer tokens required (LMSCOPE_AUTH=1); make one with "
              f"`LMSCOPE_DATA_DIR={settings.data_dir} lmscope user create NAME`", flush=True)
    try:
        server.serve_forever()
    finally:
        if not worker.stop(timeout=30):
            log.warning("a job was still running at shutdown; it is re-queued at the next start")
        server.server_close()
        for s, handler in previous.items():
            signal.signal(s, handler)
        engine.dispose()
