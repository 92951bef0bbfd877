"""The Alembic migrations build exactly the schema the models declare, on SQLite and PostgreSQL,
and a database made by an older revision is upgraded in place without losing rows."""

from __future__ import annotations

import json

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, text

from lmscope.db.engine import upgrade
from lmscope.db.models import Base


def test_migrated_schema_equals_the_models(db_url):
    """`db_url` is already at head (conftest runs the migrations): nothing left for autogenerate."""
    engine = create_engine(db_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    assert diff == []


@pytest.fixture
def empty_sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'old.db'}"


def test_users_of_revision_0001_keep_their_rows_and_get_server_default_limits(empty_sqlite_url):
    upgrade(empty_sqlite_url, "0001")
    engine = create_engine(empty_sqlite_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO users (name, is_admin, created_at) VALUES ('ann', 0, '2026-01-01 00:00:00')"))
    upgrade(empty_sqlite_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT name, max_active_jobs, max_sweep_points FROM users")).all()
    engine.dispose()
    assert [tuple(r) for r in rows] == [("ann", None, None)]


def test_downgrading_the_limits_keeps_users_tokens_and_jobs(db_url):
    """0002 → 0001 drops two columns in place: on SQLite a table copy would cascade the DROP TABLE to
    the tokens (foreign keys are on) or fail on the jobs."""
    from alembic import command

    from lmscope.api.auth import create_user
    from lmscope.db.engine import alembic_config, make_engine, make_sessionmaker
    from lmscope.db.models import Job

    engine = make_engine(db_url)
    with make_sessionmaker(engine).begin() as session:
        user, _ = create_user(session, "ann", max_sweep_points=9)
        session.add(Job(user_id=user.id, kind="probe", params={}, status="queued"))
    engine.dispose()
    command.downgrade(alembic_config(db_url), "0001")
    engine = create_engine(db_url)
    with engine.connect() as conn:
        counts = [conn.execute(text(f"SELECT count(*) FROM {t}")).scalar() for t in ("users", "api_tokens", "jobs")]
        columns = conn.execute(text("SELECT * FROM users")).keys()
    engine.dispose()
    assert counts == [1, 1, 1] and "max_sweep_points" not in columns
    upgrade(db_url)


def test_schema_problem_says_what_to_do_for_each_state_of_the_database(tmp_path):
    from lmscope.db.engine import head_revision, make_engine, schema_problem

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    engine = make_engine(url)
    assert "no lmscope tables; create them with `lmscope db upgrade`" in schema_problem(engine)
    upgrade(url, "0001")
    assert schema_problem(engine) == (f"the database has schema revision 0001, this lmscope needs {head_revision()}; "
                                      "run `lmscope db upgrade`")
    upgrade(url)
    assert schema_problem(engine) is None
    with engine.begin() as c:  # migrated by a newer lmscope: upgrading the database is not the fix
        c.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    assert "9999, which this lmscope does not know" in schema_problem(engine)
    engine.dispose()


def test_series_stored_before_0003_get_their_lengths(db_url):
    """0003 counts each stored curve's points (x's length) in SQL, on SQLite and PostgreSQL alike; the
    answers that page or cap curves read that count."""
    from alembic import command

    from lmscope.api.auth import create_user
    from lmscope.db.engine import alembic_config, make_engine, make_sessionmaker
    from lmscope.db.models import Job

    engine = make_engine(db_url)
    with make_sessionmaker(engine).begin() as session:
        user, _ = create_user(session, "ann")
        job = Job(user_id=user.id, kind="probe", params={}, status="succeeded")
        session.add(job)
        session.flush()
        job_id = job.id
    engine.dispose()
    command.downgrade(alembic_config(db_url), "0002")
    engine = create_engine(db_url)
    with engine.begin() as conn:
        for name, x in (("a", [1, 2, 3]), ("b", []), ("c", list(range(4096)))):
            conn.execute(text("INSERT INTO series (job_id, name, labels, x, y) VALUES (:j, :n, '{}', :x, :x)"),
                         {"j": job_id, "n": name, "x": json.dumps(x)})
    engine.dispose()
    upgrade(db_url)
    engine = create_engine(db_url)
    with engine.connect() as conn:
        points = dict(conn.execute(text("SELECT name, points FROM series ORDER BY name")).all())
    engine.dispose()
    assert points == {"a": 3, "b": 0, "c": 4096}
