"""Fixtures for the API tests: an app on a fresh database (SQLite and PostgreSQL), users, rows.

The queue is the seam: `RecordingPublisher` records the job ids the API publishes, so these tests
check what the API promises (rows, statuses, messages sent) without a worker.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import select, update

from lmscope.api import create_app
from lmscope.api.auth import create_user
from lmscope.db.models import Artifact, Dataset, Job, Model, Series


class RecordingPublisher:
    def __init__(self):
        self.published: list[int] = []
        self.aggregations: list[int] = []  # the ids among them published as a sweep parent's aggregation
        self.fail = False

    def publish(self, job_id: int, *, aggregation: bool = False) -> None:
        if self.fail:
            raise ConnectionError("broker is down")
        self.published.append(job_id)
        if aggregation:
            self.aggregations.append(job_id)


@dataclass
class Api:
    app: object
    settings: object
    publisher: RecordingPublisher
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def client(self):
        return self.app.test_client()

    @property
    def sessions(self):
        return self.app.extensions["lmscope"].sessions

    def user(self, name: str, *, admin: bool = False) -> dict[str, str]:
        """Authorization headers of a (new) user."""
        if name not in self.tokens:
            with self.sessions.begin() as session:
                _, self.tokens[name] = create_user(session, name, admin=admin)
        return {"Authorization": f"Bearer {self.tokens[name]}"}

    def add_model(self, name: str = "m", layers: int | None = 2, heads: int | None = 2, architecture: str = "gpt2",
                  info: dict | None = None) -> None:
        with self.sessions.begin() as session:
            session.add(Model(name=name, source="builtin", architecture=architecture, num_layers=layers, num_heads=heads,
                              info=info or {}))

    def add_dataset(self, name: str = "d") -> None:
        with self.sessions.begin() as session:
            session.add(Dataset(name=name, source="upload", path="/nonexistent", format="text",
                                num_documents=1, num_bytes=1, sha256="0" * 64))

    def set_job(self, job_id: int, **values) -> None:
        with self.sessions.begin() as session:
            session.execute(update(Job).where(Job.id == job_id).values(**values))

    def job_row(self, job_id: int) -> Job:
        with self.sessions() as session:
            return session.get(Job, job_id)

    def jobs(self, **where) -> list[Job]:
        with self.sessions() as session:
            q = select(Job).order_by(Job.id)
            for k, v in where.items():
                q = q.where(getattr(Job, k) == v)
            return list(session.scalars(q))

    def submit(self, headers, kind="probe", params=None, **body):
        return self.client.post("/v1/jobs", json={"kind": kind, "params": params or {"model": "m"}, **body},
                                headers=headers)


@pytest.fixture
def publisher():
    return RecordingPublisher()


@pytest.fixture
def make_api(db_url, settings_factory, tmp_path, publisher):
    def make(**overrides) -> Api:
        (tmp_path / "models").mkdir(exist_ok=True)
        values = dict(database_url=db_url, auth=True, max_active_jobs=5, max_sweep_points=8,
                      max_upload_bytes=4096, model_dirs=[tmp_path / "models"])
        values.update(overrides)
        settings = settings_factory(**values)
        return Api(create_app(settings, publisher=publisher), settings, publisher)

    return make


@pytest.fixture
def api(make_api) -> Api:
    api = make_api()
    api.add_model("m")
    api.add_dataset("d")
    return api


def add_results(api, job_id: int, files: dict[str, bytes]):
    """What a worker leaves behind: series rows, artifact rows and their files."""
    folder = api.settings.artifact_dir / "jobs" / str(job_id)
    with api.sessions.begin() as session:
        session.add(Series(job_id=job_id, name="norm.mean", labels={"layer": None}, x=[0, 1, 2], y=[1.0, 1.5, 2.25]))
        session.add(Series(job_id=job_id, name="norm.std", labels={}, x=[0, 1, 2], y=[0.1, 0.2, 0.3]))
        session.add(Series(job_id=job_id, name="entropy.head", labels={"layer": 0, "head": 1}, x=[0], y=[0.5]))
        for name, data in files.items():
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            media = {".png": "image/png", ".svg": "image/svg+xml", ".html": "text/html",
                     ".json": "application/json"}.get(Path(name).suffix, "application/octet-stream")
            session.add(Artifact(job_id=job_id, name=name, media_type=media, size=len(data),
                                 sha256=hashlib.sha256(data).hexdigest()))


def add_checkpoint(api, name: str, job_id: int) -> None:
    """What a train job leaves in the registry: a model `<run_name>@step<N>` owned by the job."""
    with api.sessions.begin() as session:
        session.add(Model(name=name, source="checkpoint", architecture="gpt2", num_layers=2, num_heads=2,
                          job_id=job_id, step=int(name.rsplit("@step", 1)[1])))


def small_sweep(points: int) -> dict:
    """Params of a sumformer sweep with exactly `points` grid points (latent_dim 1..points)."""
    return {"study": "sumformer", "grid": {"latent_dim": list(range(1, points + 1)), "token_dim": [1], "seed": [0]}}


def is_problem(response, status: int, slug: str) -> dict:
    """Assert an RFC 9457 problem of this status and type; return its body."""
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/problem+json"
    body = response.get_json(force=True)
    assert body["type"] == f"https://lmscope.dev/problems/{slug}", body
    assert body["status"] == status and body["title"] and body["detail"]
    return body


class LiveServer:
    """The Flask app on a real port (werkzeug's threaded server), for the client and the CLI."""

    def __init__(self, app):
        from werkzeug.serving import make_server

        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        try:
            self.server.shutdown()
            self.thread.join(5)
        finally:
            self.server.server_close()  # the listening socket


@pytest.fixture
def live(api):
    server = LiveServer(api.app)
    yield server
    server.stop()
