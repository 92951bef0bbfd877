"""Probes and metrics."""

from __future__ import annotations

import json
import logging
import re
import socket
import sqlite3

import pytest

from .conftest import is_problem


def test_health_and_readiness(api):
    assert api.client.get("/healthz").get_json() == {"status": "ok"}
    r = api.client.get("/readyz")
    assert r.status_code == 200 and r.get_json()["checks"] == {"database": "ok"}


def test_readiness_pings_only_a_broker_the_jobs_go_through(make_api, settings_factory, db_url):
    """`lmscope up` (an in-process queue) with LMSCOPE_BROKER_URL set stayed 503 "broker: Connection refused"."""
    from lmscope.api import create_app
    from lmscope.queue import LocalPublisher

    nobody = "redis://127.0.0.1:1/0"  # nothing listens there
    embedded = create_app(settings_factory(database_url=db_url, broker_url=nobody), publisher=LocalPublisher())
    r = embedded.test_client().get("/readyz")
    assert r.status_code == 200 and r.get_json()["checks"] == {"database": "ok"}
    body = is_problem(make_api(broker_url=nobody).client.get("/readyz"), 503, "not-ready")  # a publisher to it
    assert body["checks"]["broker"].startswith("error") and "LMSCOPE_BROKER_URL points at it" in body["detail"]


@pytest.mark.redis
def test_readiness_pings_the_broker(make_api, redis_server, caplog):
    api = make_api(broker_url=redis_server.url)
    r = api.client.get("/readyz")
    assert r.status_code == 200 and r.get_json()["checks"] == {"database": "ok", "broker": "ok"}
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="lmscope.api"):
        r = api.client.get("/readyz")
        is_problem(api.client.get("/readyz"), 503, "not-ready")
    said = [m for r_ in caplog.records if (m := r_.getMessage()).startswith("/readyz: ")]
    assert len(said) == 1 and said[0].startswith("/readyz: the broker does not answer: ") and \
        str(redis_server.port) in said[0], said  # where it is, for the operator: once, not at every probe
    body = is_problem(r, 503, "not-ready")
    assert body["checks"]["database"] == "ok" and body["checks"]["broker"].startswith("error")
    assert "the broker is up and LMSCOPE_BROKER_URL points at it" in body["detail"] and r.headers["Retry-After"]
    assert str(redis_server.port) not in json.dumps(body)  # where the broker is: in the log only
    assert "DATABASE_URL" not in body["detail"]


def test_an_unmigrated_or_unreachable_database_is_a_503_that_says_what_to_do(make_api, tmp_path, caplog):
    """Not "a bug" (500): the operator forgot `lmscope db upgrade`, or the database is down."""
    with caplog.at_level(logging.WARNING, logger="lmscope.api"):
        empty = make_api(database_url=f"sqlite:///{tmp_path / 'empty.db'}", auth=False)
    # start-up says so in one line, not with a SQLAlchemy traceback
    [started] = [r for r in caplog.records if r.name == "lmscope.api"]
    assert "no lmscope tables; create them with `lmscope db upgrade`" in started.getMessage()
    assert started.exc_info is None
    body = is_problem(empty.client.get("/readyz"), 503, "not-ready")
    assert "no lmscope tables" in body["checks"]["database"] and "lmscope db upgrade" in body["detail"]
    assert "LMSCOPE_DATABASE_URL points at it" not in body["detail"]  # it does; the schema is what is missing
    r = empty.client.get("/v1/jobs")
    body = is_problem(r, 503, "database-unavailable")
    assert "no lmscope tables; create them with `lmscope db upgrade`" in body["detail"] and r.headers["Retry-After"]

    # migrated by a newer lmscope: its URL is right, the message says what to do instead
    from lmscope.db.engine import upgrade

    newer = tmp_path / "newer.db"
    upgrade(f"sqlite:///{newer}")
    with sqlite3.connect(newer) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    body = is_problem(make_api(database_url=f"sqlite:///{newer}", auth=False).client.get("/readyz"), 503, "not-ready")
    assert "run the newer lmscope" in body["detail"] and "LMSCOPE_DATABASE_URL points at it" not in body["detail"]

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = make_api(database_url=f"postgresql+psycopg://lmscope@127.0.0.1:{port}/lmscope")
    caplog.clear()
    body = is_problem(down.client.get("/v1/jobs", headers={"Authorization": "Bearer x"}), 503, "database-unavailable")
    assert body["detail"].startswith("the database does not answer (OperationalError")
    body = is_problem(down.client.get("/readyz"), 503, "not-ready")
    assert body["checks"]["database"].startswith("error") and "LMSCOPE_DATABASE_URL points at it" in body["detail"]
    # Anyone may ask (a bogus token, /readyz): the driver's message, which names the host, port and user, is
    # in the log, not in the answers
    for answer in (body, is_problem(down.client.get("/v1/jobs", headers={"Authorization": "Bearer x"}), 503,
                                         "database-unavailable")):
        assert f"{port}" not in json.dumps(answer) and "lmscope@" not in json.dumps(answer), answer
    assert f"{port}" in caplog.text
    # /readyz, which a load balancer asks every few seconds, logs the message once, not at every probe
    is_problem(down.client.get("/readyz"), 503, "not-ready")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("/readyz: ")]
    assert len(said) == 1 and said[0].startswith("/readyz: the database does not answer (") and f"{port}" in said[0]


def test_a_bad_query_on_a_healthy_database_is_a_bug_not_an_outage(make_api, caplog):
    """SQLite raises OperationalError for "no such column" too: that must stay a 500 with its traceback logged."""
    from sqlalchemy import text

    api = make_api(auth=False)

    @api.app.get("/v1/broken")
    def broken():
        with api.app.extensions["lmscope"].sessions() as session:
            session.execute(text("SELECT no_such_column FROM jobs"))

    is_problem(api.client.get("/v1/broken"), 500, "internal-error")
    assert "unhandled error on GET /v1/broken" in caplog.text and "no_such_column" in caplog.text  # with its traceback


def test_metrics_count_requests_and_jobs(api):
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    api.submit(h, kind="nope")
    api.client.get(f"/v1/jobs/{job_id}", headers=h)
    api.client.get(f"/v1/jobs/{job_id}", headers=h)
    text = api.client.get("/metrics").get_data(as_text=True)
    assert 'lmscope_http_requests_total{method="POST",route="/v1/jobs",status="202"} 1' in text
    assert 'lmscope_http_requests_total{method="POST",route="/v1/jobs",status="422"} 1' in text
    # Routes are labelled by their rule, not the raw path (bounded label values).
    assert 'lmscope_http_requests_total{method="GET",route="/v1/jobs/<int:job_id>",status="200"} 2' in text
    assert 'lmscope_jobs{kind="probe",status="queued"} 1' in text
    # A method a route does not take is counted under that route; a path no route has, as unmatched.
    api.client.put(f"/v1/jobs/{job_id}", headers=h)
    api.client.get("/v1/nowhere", headers=h)
    text = api.client.get("/metrics").get_data(as_text=True)
    assert 'lmscope_http_requests_total{method="PUT",route="/v1/jobs/<int:job_id>",status="405"} 1' in text
    assert 'lmscope_http_requests_total{method="GET",route="(unmatched)",status="404"} 1' in text
    # Every sample line parses as `name{labels} value`.
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert re.fullmatch(r'[a-z_]+(\{[^}]*\})? -?[0-9.e+-]+', line), line


def test_job_durations_histogram(api):
    from datetime import timedelta

    from lmscope.db.models import utcnow

    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    now = utcnow()
    api.set_job(job_id, status="succeeded", started_at=now - timedelta(seconds=42), finished_at=now)
    text = api.client.get("/metrics").get_data(as_text=True)
    assert 'lmscope_job_duration_seconds_bucket{kind="probe",status="succeeded",le="15"} 0' in text
    assert 'lmscope_job_duration_seconds_bucket{kind="probe",status="succeeded",le="60"} 1' in text
    assert re.search(r'lmscope_job_duration_seconds_sum\{kind="probe",status="succeeded"\} 42\.0', text)
    # more: half a second, exactly a bound (le means at most), past the last bound, a clock that went back
    # (counted as 0 s), and a sweep still waiting for its children (not finished: not counted)
    for seconds in (0.5, 60, 100_000, -5):
        other = api.submit(h).get_json()["id"]
        api.set_job(other, status="succeeded", started_at=now - timedelta(seconds=seconds), finished_at=now)
    waiting = api.submit(h).get_json()["id"]
    api.set_job(waiting, status="succeeded", waiting_children=True, started_at=now - timedelta(seconds=9),
                finished_at=now)
    text = api.client.get("/metrics").get_data(as_text=True)
    got = dict(re.findall(r'lmscope_job_duration_seconds_bucket\{kind="probe",status="succeeded",le="([^"]+)"\} (\d+)',
                          text))
    durations = [42, 0.5, 60, 100_000, 0]  # the test's own bucketing, cumulative as Prometheus wants it
    assert got == {**{str(b): str(sum(d <= b for d in durations)) for b in (1, 5, 15, 60, 300, 900, 3600, 14400,
                                                                           43200, 86400)}, "+Inf": "5"}
    assert 'lmscope_job_duration_seconds_count{kind="probe",status="succeeded"} 5' in text
    total = re.search(r'lmscope_job_duration_seconds_sum\{kind="probe",status="succeeded"\} ([0-9.]+)', text)
    assert float(total.group(1)) == pytest.approx(sum(durations), abs=1e-3)


def test_gunicorns_app_without_tokens_warns_that_every_caller_is_the_admin(db_url, tmp_path):
    """`lmscope up` refuses a non-loopback address without tokens; gunicorn's bind is not the app's to see, so
    its entry point says so at start (a trial's LMSCOPE_AUTH=0 gunicorn on 0.0.0.0 made every caller an admin
    without a word)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, LMSCOPE_DATABASE_URL=db_url, LMSCOPE_DATA_DIR=str(tmp_path),
               LMSCOPE_BROKER_URL="redis://127.0.0.1:1/0")
    for auth, warned in (("0", True), ("1", False)):
        r = subprocess.run([sys.executable, "-c", "import lmscope.api.wsgi"], env=dict(env, LMSCOPE_AUTH=auth),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert ("LMSCOPE_AUTH=0: tokens are off, and every caller that reaches this API acts as the admin"
                in r.stderr) is warned, r.stderr
