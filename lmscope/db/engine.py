"""Engine and session setup for SQLite (embedded) and PostgreSQL (team deployment).

SQLite: WAL so readers never block the writer, a busy timeout so writers wait instead of failing,
and ``BEGIN IMMEDIATE`` for every transaction, because a deferred transaction that reads and then
writes can fail with SQLITE_BUSY at once (no waiting) when another connection wrote in between —
the API and a worker thread writing at the same time would otherwise see "database is locked".
Keep transactions short: never hold a session open across a long computation.
"""

from __future__ import annotations

import functools
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from lmscope.wording import error_line

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
CONNECT_TIMEOUT_SECONDS = 10


def make_engine(url: str, **kwargs) -> Engine:
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            # private when made here (`lmscope db upgrade`, `user create`, `up`): the file holds everyone's
            # results and token hashes; an existing folder keeps its mode
            Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):
            dbapi_connection.isolation_level = None  # we issue BEGIN ourselves, below
            cur = dbapi_connection.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin_immediate(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    if u.get_backend_name() == "postgresql" and "connect_timeout" not in u.query:
        # an unreachable host fails in seconds, not after the kernel's two-minute TCP timeout
        kwargs.setdefault("connect_args", {"connect_timeout": CONNECT_TIMEOUT_SECONDS})
    return create_engine(url, **kwargs)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


@functools.cache
def _migration_scripts():
    """This code's migration scripts (read once)."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("sqlite://"))


def head_revision() -> str:
    """The newest schema revision this code has."""
    return _migration_scripts().get_current_head()


def known_revisions() -> frozenset[str]:
    return frozenset(s.revision for s in _migration_scripts().walk_revisions())


def schema_revisions(engine: Engine) -> tuple[str | None, str]:
    """(the database's Alembic revision, None for an empty one; the newest this code has)."""
    from alembic.migration import MigrationContext

    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
    return current, head_revision()


def schema_problem(engine: Engine, *, cause: bool = True) -> str | None:
    """Why the database cannot serve this lmscope (it does not answer, has no tables, has an older
    schema), in words that say what to do; None when it can. Without `cause`, a database that does not
    answer is named with the error's type only: the driver's message names hosts, ports and users, which
    the API does not tell its callers (it logs it)."""
    problem, driver_message = schema_problem_and_cause(engine)
    if driver_message is not None and cause:
        return f"the database does not answer ({driver_message})"
    return problem


def schema_problem_and_cause(engine: Engine) -> tuple[str | None, str | None]:
    """`schema_problem` without the cause, and the driver's message when the database does not answer
    (else None): one try to connect for both."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        current, head = schema_revisions(engine)
    except SQLAlchemyError as e:
        return (f"the database does not answer ({type(e).__name__}; the API's log has the driver's message)",
                error_line(e))
    if current is None:
        return "the database has no lmscope tables; create them with `lmscope db upgrade`", None
    if current not in known_revisions():
        return _unknown_revision(current, head), None
    if current != head:
        return f"the database has schema revision {current}, this lmscope needs {head}; run `lmscope db upgrade`", None
    return None, None


def _unknown_revision(current: str, head: str) -> str:
    return (f"the database has schema revision {current}, which this lmscope does not know (a newer "
            f"lmscope migrated it, this one needs {head}); run the newer lmscope")


class SchemaUnavailable(Exception):
    """The database cannot be migrated by this lmscope: it does not answer, or a newer lmscope migrated it.
    The message says which, in one line."""


def upgrade(url: str, revision: str = "head") -> tuple[str | None, str | None]:
    """Bring the schema up to date (`lmscope db upgrade`; also run by `lmscope up`).
    Returns the revisions before and after; raises SchemaUnavailable where it cannot."""
    from alembic import command
    from sqlalchemy.exc import SQLAlchemyError

    engine = make_engine(url)
    try:
        try:
            before, head = schema_revisions(engine)
        except SQLAlchemyError as e:
            raise SchemaUnavailable(f"the database does not answer ({error_line(e)})") from None
        if before is not None and before not in known_revisions():
            raise SchemaUnavailable(_unknown_revision(before, head))
        command.upgrade(alembic_config(url), revision)
        return before, schema_revisions(engine)[0]
    finally:
        engine.dispose()
