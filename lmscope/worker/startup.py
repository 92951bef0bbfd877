"""What a worker process does once at start-up. Light: no torch.

- ``session_factory_for``: one engine per (process, URL); a forked Celery child never reuses the
  connections of its parent
- ``load_extra_kinds``: the test hook ``LMSCOPE_EXTRA_KINDS`` (modules that register job kinds)
"""

from __future__ import annotations

import importlib
import logging
import os

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from lmscope.config import Settings
from lmscope.db.engine import make_engine, make_sessionmaker

log = logging.getLogger("lmscope.worker")

# Test hook: comma-separated modules imported by every worker process at start-up; their `register()`
# adds job kinds to lmscope.params.KINDS and lmscope.analyses.registry (tests/worker/fake_kinds.py).
EXTRA_KINDS_ENV = "LMSCOPE_EXTRA_KINDS"

__all__ = ["session_factory_for", "forget_inherited_engines", "load_extra_kinds"]


_engines: dict[tuple[int, str], tuple[Engine, sessionmaker[Session]]] = {}


def session_factory_for(settings: Settings) -> sessionmaker[Session]:
    """This process's session factory for ``settings.database_url`` (made on first use)."""
    key = (os.getpid(), settings.database_url)
    if key not in _engines:
        engine = make_engine(settings.database_url)
        _engines[key] = (engine, make_sessionmaker(engine))
    return _engines[key][1]


def forget_inherited_engines() -> None:
    """In a forked child: drop the parent's pooled connections without closing them (they are the
    parent's sockets), so the child opens its own."""
    for (pid, url), (engine, _) in list(_engines.items()):
        if pid != os.getpid():
            engine.dispose(close=False)
            del _engines[(pid, url)]


def load_extra_kinds() -> None:
    """Import the modules named in ``LMSCOPE_EXTRA_KINDS`` and call their ``register()`` (a test hook)."""
    for name in filter(None, (m.strip() for m in os.environ.get(EXTRA_KINDS_ENV, "").split(","))):
        module = importlib.import_module(name)
        if callable(getattr(module, "register", None)):
            module.register()
        log.warning("loaded extra job kinds from %s (%s; a test hook)", name, EXTRA_KINDS_ENV)
