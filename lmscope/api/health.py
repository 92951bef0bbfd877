"""Liveness and readiness probes (for docker-compose / Kubernetes)."""

from __future__ import annotations

from flask import Blueprint

from lmscope.api.errors import Problem
from lmscope.api.state import state
from lmscope.db.engine import schema_problem
from lmscope.queue import LocalPublisher

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz():
    """The process is alive (no dependencies checked)."""
    return {"status": "ok"}


def ping_broker(url: str, timeout: float = 2.0) -> None:
    """Raise if the broker does not answer. Redis is pinged directly; other brokers through kombu."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            client.ping()
        finally:
            client.close()
        return
    from kombu import Connection

    with Connection(url, connect_timeout=timeout) as conn:
        conn.ensure_connection(max_retries=1)


@bp.get("/readyz")
def readyz():
    """Ready to serve: the database answers and has this lmscope's schema, the broker (when jobs go through
    one) answers a ping, and under `lmscope up` its worker still takes jobs."""
    st = state()
    checks, failed = {}, []
    problem = schema_problem(st.engine)
    checks["database"] = "ok" if problem is None else f"error: {problem}"
    if problem is not None:
        failed.append("database")
    # `lmscope up` queues in-process whatever LMSCOPE_BROKER_URL says: a broker it never uses is no reason to
    # report it unready
    if st.settings.broker_url and not isinstance(st.publisher, LocalPublisher):
        try:
            ping_broker(st.settings.broker_url)
            checks["broker"] = "ok"
        except Exception as e:
            checks["broker"] = f"error: {type(e).__name__}: {e}".splitlines()[0]
            failed.append("broker")
    if st.worker_stopped:  # `lmscope up`: its worker is part of being ready
        stopped = st.worker_stop_reason()
        checks["worker"] = "ok" if not stopped else f"error: {stopped}"
        if stopped:
            failed.append("worker")
    if failed:
        detail = "; ".join(f"{name}: {checks[name]}" for name in failed)
        # a schema to migrate (or migrated by a newer lmscope) says what to do itself; an unreachable
        # service needs its URL checked
        unreachable = [n for n in ("database", "broker")
                       if n in failed and (n == "broker" or "does not answer" in checks[n])]
        if unreachable:
            detail += " — check that " + "; ".join(f"the {n} is up and LMSCOPE_{n.upper()}_URL points at it"
                                                    for n in unreachable)
        raise Problem(503, "not-ready", "Not ready", detail, headers={"Retry-After": "5"}, checks=checks)
    return {"status": "ready", "checks": checks}
