"""The embedded service for the analyses' end-to-end tests: Flask test client + in-process worker."""

from __future__ import annotations

import pytest


@pytest.fixture
def service(settings_factory, sqlite_url):
    """(test client, embedded worker, settings) on a fresh SQLite database with the built-ins registered."""
    from lmscope.api import create_app
    from lmscope.db.builtins import ensure_builtins
    from lmscope.db.engine import make_engine, make_sessionmaker
    from lmscope.queue import LocalPublisher
    from lmscope.worker.embedded import EmbeddedWorker

    settings = settings_factory(database_url=sqlite_url, auth=False)
    engine = make_engine(sqlite_url)
    sessions = make_sessionmaker(engine)
    ensure_builtins(settings, sessions)
    publisher = LocalPublisher()
    app = create_app(settings, publisher=publisher)
    yield app.test_client(), EmbeddedWorker(settings, sessions, publisher), settings
    engine.dispose()
