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

    def consumers(self) -> int | None:
        """Workers taking jobs from the broker's queue (None: no broker, or it cannot say), asked at most
        every CONSUMERS_TTL seconds: the census waits half a second for the workers' answers."""
        ask = getattr(self.publisher, "consumers", None)
        if ask is None:
            return None
        now = time.monotonic()
        with self._census_lock:
            if self._census is None or now - self._census[0] > CONSUMERS_TTL:
                self._census = (now, ask())
            return self._census[1]

    def worker_stop_reason(self) -> str | None:
        """Why `lmscope up`'s worker takes no more jobs; None while it takes them, or with no worker here."""
        return self.worker_stopped() if self.worker_stopped else None


def state() -> ApiState:
    return current_app.extensions["lmscope"]
