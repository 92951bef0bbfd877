"""Fixtures for the worker tests: sessions on a fresh database, job rows, a recording publisher."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # worker subprocesses import tests.worker.fake_kinds from the repo root
    sys.path.insert(0, str(ROOT))

FAKE_KINDS = "tests.worker.fake_kinds"
fake_kinds = importlib.import_module(FAKE_KINDS)
helpers = importlib.import_module("tests.worker.helpers")


@pytest.fixture(autouse=True)
def test_kinds(monkeypatch):
    """The test-only job kinds exist for the duration of each worker test. The process-wide marks a
    `fail="broken_device"` job leaves (a broken device, a replaced device check) end with the test."""
    from lmscope.worker import environment, runner

    monkeypatch.setattr(runner, "broken_device", None)
    monkeypatch.setattr(environment, "device_failure", environment.device_failure)
    fake_kinds.register()
    yield
    fake_kinds.unregister()


@pytest.fixture
def publisher():
    return helpers.RecordingPublisher()


@pytest.fixture
def engine(db_url):
    from lmscope.db.engine import make_engine

    engine = make_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def sessions(engine):
    from lmscope.db.engine import make_sessionmaker

    return make_sessionmaker(engine)


@pytest.fixture
def settings(settings_factory, db_url):
    return settings_factory(database_url=db_url, heartbeat_seconds=0.2, stale_after_seconds=2.0,
                            unpublished_after_seconds=1.0)


@pytest.fixture
def make_job(sessions):
    """Insert a job row (default: a queued `count` job) and return its id."""
    from sqlalchemy import select

    from lmscope.db.models import Job, User

    def make(kind: str = "count", params: dict | None = None, **fields) -> int:
        with sessions() as s, s.begin():
            user = s.execute(select(User).where(User.name == "alice")).scalar_one_or_none()
            if user is None:
                user = User(name="alice")
                s.add(user)
                s.flush()
            fields.setdefault("status", "queued")
            fields.setdefault("max_attempts", 3)
            job = Job(user_id=user.id, kind=kind, params=params if params is not None else {"plot": False}, **fields)
            s.add(job)
            s.flush()
            return job.id

    return make


@pytest.fixture
def job_row(sessions):
    from lmscope.db.models import Job

    def get(job_id: int) -> Job:
        with sessions() as s:
            return s.get(Job, job_id)

    return get
