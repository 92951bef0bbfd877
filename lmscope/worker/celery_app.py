"""The Celery worker: ``celery -A lmscope.worker.celery_app worker -c 1 -Q lmscope`` (one per GPU).

Settings come from the environment (``LMSCOPE_BROKER_URL``, ``LMSCOPE_DATABASE_URL``, ...); the Celery
configuration is ``lmscope.queue.celery_config`` (JSON only, late acks, requeue on a lost child,
prefetch 1, hard time limit below Redis' visibility timeout, no result backend).

Processes: the main process consumes messages and never opens the database or imports torch (so
CUDA is initialised only in the prefork child that runs the job, and no SQLite state is copied into
the children it forks). The child runs ``lmscope.run_job(job_id)`` → ``runner.execute``. The reaper
runs in a process of its own (``python -m lmscope.worker.reaper``), started when the worker is ready
and started again if it dies. A worker whose database does not answer or lacks the schema refuses
to start; a delivery that finds the database down before claiming its job puts the message back.

``run_worker(concurrency=1)`` is what ``lmscope worker`` calls.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

from celery import signals
from celery.exceptions import Reject

from lmscope.config import Settings
from lmscope.queue import QUEUE_NAME, TASK_NAME, CeleryPublisher, make_celery
from lmscope.worker import runner
from lmscope.worker.startup import forget_inherited_engines, load_extra_kinds, session_factory_for

log = logging.getLogger("lmscope.worker")

settings = Settings.from_env()
if not settings.broker_url:
    raise RuntimeError("LMSCOPE_BROKER_URL is not set; a Celery worker needs the broker, e.g. "
                       "LMSCOPE_BROKER_URL=redis://localhost:6379/0 (for one process without Redis use `lmscope up`)")
celery = make_celery(settings)
load_extra_kinds()

REDELIVER_AFTER_SECONDS = 5.0  # a database outage must not turn into a hot loop of deliveries
EXIT_BROKEN_DEVICE = 70  # the pool child's exit status after a job left its GPU unusable
REAPER_CHECK_SECONDS = 5.0
REAPER_MAX_BACKOFF_SECONDS = 300.0

_reaper = None
_stopping = threading.Event()
_reaper_lock = threading.Lock()  # the watcher's restart and the shutdown's stop


@celery.task(name=TASK_NAME)
def run_job(job_id: int) -> None:
    """Run one delivery of a job id. Never raises for a job's own failure: the row records it."""
    try:
        runner.execute(int(job_id), settings, session_factory_for(settings), CeleryPublisher(app=celery))
    except runner.DatabaseLostDuringJob as e:
        log.error("%s", e)  # acked: the row, still running, is the reaper's to re-queue
    except runner.DatabaseUnavailable as e:
        # Acked, the message would be gone and the job left queued until the reaper's late republish.
        log.error("%s", e)
        time.sleep(REDELIVER_AFTER_SECONDS)
        raise Reject(str(e), requeue=True) from None
    finally:
        if runner.broken_device:
            # A child whose CUDA context is broken would fail every later job, so it ends here (also when
            # storing the failure failed) and Celery forks a fresh one. The unacked message goes back to the
            # queue (task_reject_on_worker_lost); its redelivery finds the job finished and is dropped, or
            # runs it again on a sound device if its failure could not be stored.
            log.critical("job %s left the GPU unusable in this process (%s); ending the process so that "
                         "Celery starts a fresh one", job_id, runner.broken_device)
            logging.shutdown()
            os._exit(EXIT_BROKEN_DEVICE)


@signals.worker_init.connect
def _check_database(**_) -> None:
    """Refuse to start (before any message is taken) on a database that cannot run jobs. Its own
    engine, disposed at once: this process forks the pool's children and must hold no connection."""
    from lmscope.db.engine import make_engine, schema_problem

    try:
        engine = make_engine(settings.database_url)
        try:
            problem = schema_problem(engine)
        finally:
            engine.dispose()
    except Exception as e:  # no driver, an unwritable SQLite folder, …: a worker that starts would drop jobs
        problem = f"{type(e).__name__}: {e}"
    if problem is not None:  # SystemExit, not an error: Celery's signal dispatch would log and go on
        raise SystemExit(f"lmscope worker cannot start: {problem} (LMSCOPE_DATABASE_URL)")


@signals.worker_process_init.connect
def _child_started(**_) -> None:
    # A fresh prefork child: connections inherited from the main process belong to it.
    forget_inherited_engines()


def _start_reaper_process() -> None:
    global _reaper
    _reaper = subprocess.Popen([sys.executable, "-m", "lmscope.worker.reaper", "--parent", str(os.getpid())])
    log.info("reaper process %s started", _reaper.pid)


def _watch_reaper() -> None:
    """A reaper that dies (OOM killer, a bug) is started again: without it lost jobs stay lost. One that
    keeps dying is restarted less and less often (up to every REAPER_MAX_BACKOFF_SECONDS)."""
    wait = REAPER_CHECK_SECONDS
    while not _stopping.wait(wait):
        with _reaper_lock:
            if _stopping.is_set() or _reaper.poll() is None:
                wait = REAPER_CHECK_SECONDS
                continue
            log.error("reaper process %s exited with status %s; starting a new one", _reaper.pid, _reaper.returncode)
            try:
                _start_reaper_process()
            except OSError as e:  # no memory or processes left: try again later rather than stop watching
                log.error("could not start a reaper process: %s", e)
            wait = min(wait * 2, REAPER_MAX_BACKOFF_SECONDS)


@signals.worker_ready.connect
def _start_reaper(**_) -> None:
    """Start this worker's reaper process (every worker runs one; it is safe). It also upserts the
    built-ins. A process, not a thread: this process forks the pool's children and must never hold a
    database connection when it does (see ``lmscope.worker.reaper.run_reaper_process``). A thread here
    only watches it."""
    _start_reaper_process()
    threading.Thread(target=_watch_reaper, name="lmscope-reaper-watch", daemon=True).start()


@signals.worker_shutting_down.connect
def _stop_reaper(**_) -> None:
    # Celery sends this again on a second SIGTERM or Ctrl+C, possibly inside this very call (its signal
    # handler): only the first stops the reaper, and no lock is held while it waits.
    if _stopping.is_set():
        return
    _stopping.set()
    with _reaper_lock:  # the watcher has finished any restart; it starts no other now
        reaper = _reaper
    if reaper is not None and reaper.poll() is None:
        reaper.terminate()
        try:
            reaper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            reaper.kill()


def worker_argv(concurrency: int = 1, loglevel: str = "info", name: str | None = None) -> list[str]:
    return ["worker", "-c", str(concurrency), "-P", "prefork", "-Q", QUEUE_NAME,
            "--without-gossip", "--without-mingle", "-l", loglevel, *(["-n", f"{name}@%h"] if name else [])]


def run_worker(concurrency: int = 1, loglevel: str = "info", name: str | None = None) -> None:
    """Start a worker in this process (blocks). One per GPU: set CUDA_VISIBLE_DEVICES per worker;
    ``name`` tells workers of one host apart (``NAME@host``)."""
    celery.worker_main(worker_argv(concurrency, loglevel, name))
