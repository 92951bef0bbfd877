"""What a worker process (and the API) does once at start-up. Light: no torch.

- ``ensure_builtins``: upsert the built-in model rows and the ``wikitext-2`` dataset row
- ``session_factory_for``: one engine per (process, URL); a forked Celery child never reuses the
  connections of its parent
- ``load_extra_kinds``: the test hook ``LMSCOPE_EXTRA_KINDS`` (modules that register job kinds)
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path

from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from lmscope.catalog import BUILTIN_MODELS, config_facts, read_documents, sha256_bytes
from lmscope.config import Settings
from lmscope.db.engine import make_engine, make_sessionmaker
from lmscope.db.models import Dataset, Model

log = logging.getLogger("lmscope.worker")

WIKITEXT2 = "wikitext-2"
# Test hook: comma-separated modules imported by every worker process at start-up; their `register()`
# adds job kinds to lmscope.params.KINDS and lmscope.analyses.registry (tests/worker/fake_kinds.py).
EXTRA_KINDS_ENV = "LMSCOPE_EXTRA_KINDS"


def _upsert(session_factory: sessionmaker[Session], model, name: str, values: dict) -> None:
    """Insert the row, or update it if it exists; a concurrent insert by another process is fine."""
    for _ in range(2):
        try:
            with session_factory() as session, session.begin():
                row = session.execute(select(model).where(model.name == name)).scalar_one_or_none()
                if row is None:
                    session.add(model(name=name, **values))
                else:
                    for key, value in values.items():
                        if getattr(row, key) != value:
                            setattr(row, key, value)
            return
        except IntegrityError:  # someone inserted it between our read and our insert: update it instead
            continue


def ensure_builtins(settings: Settings, session_factory: sessionmaker[Session]) -> None:
    """Upsert rows for ``catalog.BUILTIN_MODELS`` and, when the file exists, dataset ``wikitext-2``."""
    for name, config in BUILTIN_MODELS.items():
        facts = config_facts(config)
        _upsert(session_factory, Model, name, dict(
            source="builtin", path=None, architecture=facts.architecture, num_layers=facts.num_layers,
            num_heads=facts.num_heads, num_kv_heads=facts.num_kv_heads, hidden_size=facts.hidden_size,
            vocab_size=facts.vocab_size, dtype="float32", info={"config": dict(config), "tokenizer": "bytes"}))
    path = settings.wikitext2_path
    if path and Path(path).is_file():
        data = Path(path).read_bytes()
        with session_factory() as session:
            row = session.execute(select(Dataset.sha256, Dataset.path).where(Dataset.name == WIKITEXT2)).one_or_none()
        if row is None or row.sha256 != sha256_bytes(data) or row.path != str(Path(path).resolve()):
            _upsert(session_factory, Dataset, WIKITEXT2, dict(
                source="builtin", path=str(Path(path).resolve()), format="lines",
                num_documents=len(read_documents(Path(path), "lines")), num_bytes=len(data), sha256=sha256_bytes(data),
                description="WikiText-2 (raw) test split; every non-empty line that is not a heading is a document"))


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


def load_extra_kinds(modules: str | None = None) -> list[str]:
    """Import the modules named in ``LMSCOPE_EXTRA_KINDS`` and call their ``register()`` (a test hook)."""
    names = [m.strip() for m in (modules if modules is not None else os.environ.get(EXTRA_KINDS_ENV, "")).split(",")]
    loaded = []
    for name in filter(None, names):
        module = importlib.import_module(name)
        if callable(getattr(module, "register", None)):
            module.register()
        loaded.append(name)
        log.warning("loaded extra job kinds from %s (%s; a test hook)", name, EXTRA_KINDS_ENV)
    return loaded
