"""What the app factory puts on `app.extensions["lmscope"]`: settings, DB sessions, the publisher."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from flask import current_app
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from lmscope.config import Settings
from lmscope.queue import Publisher


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

    def worker_stop_reason(self) -> str | None:
        """Why `lmscope up`'s worker takes no more jobs; None while it takes them, or with no worker here."""
        return self.worker_stopped() if self.worker_stopped else None


def state() -> ApiState:
    return current_app.extensions["lmscope"]
