"""Rows every deployment has: the built-in tiny models and, when its file exists, dataset ``wikitext-2``.

The API and every worker call ``ensure_builtins`` at start-up (any number of processes at once).
Light on purpose (SQLAlchemy + ``lmscope.catalog``, no torch): the API image ships it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from lmscope.catalog import (BUILTIN_MODELS, DATASET_FORMATS, CatalogError, builtin_parameter_count, config_facts, parse_documents,
                             sha256_bytes)
from lmscope.config import Settings
from lmscope.db.models import Dataset, Model

WIKITEXT2 = "wikitext-2"
log = logging.getLogger("lmscope.builtins")


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
            vocab_size=facts.vocab_size, num_parameters=builtin_parameter_count(config), dtype="float32",
            info={**facts.info, "config": dict(config), "tokenizer": "bytes"}))
    path = settings.wikitext2_path
    if path and not Path(path).is_file():
        # a wrong mount (CORPORA_DIR) would otherwise show up only as "dataset 'wikitext-2' is not registered"
        log.warning("LMSCOPE_WIKITEXT2_PATH=%s is not a file: the built-in dataset %r is not registered (check the "
                    "mount, e.g. CORPORA_DIR in docker-compose)", path, WIKITEXT2)
    elif path:
        with session_factory() as session:
            row = session.execute(select(Dataset.sha256, Dataset.path).where(Dataset.name == WIKITEXT2)).one_or_none()
        try:
            if row is None or row.path != str(Path(path).resolve()) or row.sha256 != sha256_bytes(_read(Path(path))):
                register_dataset_file(session_factory, WIKITEXT2, Path(path), "lines", source="builtin",
                                      description="WikiText-2 (raw) test split; every non-empty line that is not a "
                                                  "heading is a document")
        except CatalogError as e:  # an empty or unreadable corpus must not stop the service starting
            log.warning("the built-in dataset %r is not registered: %s", WIKITEXT2, e)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:  # a directory, no permission, an I/O error: say which file and why
        raise CatalogError(f"{path} cannot be read: {e.strerror or e}") from e


def register_dataset_file(session_factory: sessionmaker[Session], name: str, path: Path, fmt: str, *,
                          source: str = "file", description: str | None = None) -> Dataset:
    """Register a text file already on the server (no upload, no size limit) as dataset `name`.

    For corpora too large to upload, e.g. WikiText-103: ``lmscope datasets add wikitext-103
    /data/wikitext-103-raw/wiki.train.raw --format lines``. Raises CatalogError when the file cannot be read.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise CatalogError(f"{path} is not a file")
    data = _read(path)
    docs = parse_documents(data, fmt)
    if not docs:  # as an upload would be refused
        raise CatalogError(f"{path} has no documents in format {fmt!r} ({DATASET_FORMATS[fmt]})")
    values = dict(source=source, path=str(path), format=fmt, num_documents=len(docs), num_bytes=len(data),
                  sha256=sha256_bytes(data), description=description)
    _upsert(session_factory, Dataset, name, values)
    with session_factory() as session:
        return session.execute(select(Dataset).where(Dataset.name == name)).scalar_one()
