"""``lmscope up``: the API and a worker thread in one process, SQLite, no other server.

The composition root of the embedded mode: it serves lmscope.api's app and runs
lmscope.worker.embedded.EmbeddedWorker beside it (the worker package knows nothing of the API).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

from lmscope.config import Settings
from lmscope.queue import LocalPublisher
from lmscope.worker.embedded import EmbeddedWorker
from lmscope.worker.reaper import recover_interrupted

log = logging.getLogger("lmscope.up")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


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
    # Private to its user when made here: the database, uploads and results are one person's (other
    # accounts on a shared host could read them otherwise). An existing folder keeps its mode.
    settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    settings.artifact_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with hold_data_dir(settings.data_dir):
        _serve_holding_the_data_dir(settings)


def url_host(host: str) -> str:
    """The host as a URL writes it: an IPv6 address in brackets (http://[::1]:8765/)."""
    return f"[{host}]" if ":" in host else host


def _serve_holding_the_data_dir(settings: Settings) -> None:
    from werkzeug.serving import make_server

    from lmscope.api import create_app
    from lmscope.db.builtins import ensure_builtins
    from sqlalchemy.engine import make_url

    from lmscope.db.engine import SchemaUnavailable, make_engine, make_sessionmaker, upgrade
    from lmscope.worker.startup import load_extra_kinds

    try:
        upgrade(settings.database_url)
    except SchemaUnavailable as e:
        raise SystemExit(f"{make_url(settings.database_url).render_as_string(hide_password=True)}: {e}") from None
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
    app.extensions["lmscope"].worker_stopped = worker.stopped_reason

    def _shutdown(signum, _frame):
        log.info("signal %s: shutting down", signum)
        worker.stopping.set()  # running jobs return to the queue at their next progress report
        threading.Thread(target=server.shutdown, daemon=True).start()

    previous = {s: signal.signal(s, _shutdown) for s in (signal.SIGINT, signal.SIGTERM)}
    base = f"http://{url_host(settings.host)}:{server.port}"
    if settings.broker_url:  # likely left over from a team deployment's environment: it does nothing here
        print("lmscope up: LMSCOPE_BROKER_URL is ignored: this process queues and runs its jobs itself "
              "(unset it to silence this)", flush=True)
    print(f"lmscope up: dashboard {base}/  API docs {base}/docs  (data in {settings.data_dir}; "
          f"{len(recovered['requeued'])} interrupted job(s) re-queued)", flush=True)
    if settings.auth:
        # LMSCOPE_AUTH defaults to 1 with a broker URL, also the ignored one: say why tokens are on
        why = ", its default while LMSCOPE_BROKER_URL is set" if settings.broker_url else ""
        print(f"lmscope up: bearer tokens required (LMSCOPE_AUTH=1{why}); make one with "
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
