"""What the app factory puts on `app.extensions["lmscope"]`: settings, DB sessions, the publisher."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from flask import current_app
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from lmscope.config import Settings
from lmscope.queue import Publisher


CONSUMERS_TTL = 15.0  # seconds a census of the workers is reused
CENSUS_WAIT = 1.5  # seconds a request waits for a census under way (the census itself waits 1 s for answers)


@dataclass
class ApiState:
    settings: Settings
    engine: Engine
    sessions: sessionmaker
    publisher: Publisher
    metrics: Any = None
    # `lmscope up` only: why its worker takes no more jobs (None while it takes them). Set by lmscope.up,
    # which wires the worker beside the API (the API never imports the worker).
    worker_stopped: Callable[[], str | None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    _census: tuple[float, int | None] | None = field(default=None, repr=False)
    _census_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _census_running: threading.Event | None = field(default=None, repr=False)

    def consumers(self) -> int | None:
        """Workers taking jobs from the broker's queue (None: no broker, or it cannot say yet), asked at most
        every CONSUMERS_TTL seconds. The census runs in a thread of its own (it waits a second for the
        workers' answers): a page shows the last count while a new one is taken, and only the first waits
        for one, at most CENSUS_WAIT seconds. A broker that hangs never holds up a page."""
        ask = getattr(self.publisher, "consumers", None)
        if ask is None:
            return None
        with self._census_lock:
            first = self._census is None
            stale = first or time.monotonic() - self._census[0] > CONSUMERS_TTL
            if stale and self._census_running is None:
                self._census_running = threading.Event()
                threading.Thread(target=self._take_census, args=(ask, self._census_running), daemon=True,
                                 name="lmscope-worker-census").start()
            running = self._census_running
        if first and running is not None:
            running.wait(CENSUS_WAIT)
        with self._census_lock:
            return self._census[1] if self._census else None

    def _take_census(self, ask: Callable[[], int | None], done: threading.Event) -> None:
        try:
            value = ask()
        except Exception:  # the publisher logs its own failures; a census that fails knows nothing
            value = None
        with self._census_lock:
            self._census, self._census_running = (time.monotonic(), value), None
        done.set()

    def worker_stop_reason(self) -> str | None:
        """Why `lmscope up`'s worker takes no more jobs; None while it takes them, or with no worker here."""
        return self.worker_stopped() if self.worker_stopped else None


def state() -> ApiState:
    return current_app.extensions["lmscope"]
