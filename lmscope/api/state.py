"""What the app factory puts on `app.extensions["lmscope"]`: settings, DB sessions, the publisher."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    extra: dict[str, Any] = field(default_factory=dict)


def state() -> ApiState:
    return current_app.extensions["lmscope"]
