"""Liveness and readiness probes (for docker-compose / Kubernetes)."""

from __future__ import annotations

import logging

from flask import Blueprint

from lmscope.api.errors import Problem
from lmscope.api.state import state
from lmscope.db.engine import schema_problem_and_cause
from lmscope.queue import LocalPublisher

bp = Blueprint("health", __name__)
log = logging.getLogger("lmscope.api")


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


_logged: dict[str, str] = {}  # what /readyz last logged of each part: a poller every few seconds logs it once


def _log_once(part: str, message: str | None) -> None:
    if message and _logged.get(part) != message:
        _logged[part] = message
        log.warning("/readyz: %s", message)


@bp.get("/readyz")
def readyz():
    """Ready to serve: the database answers and has this lmscope's schema, the broker (when jobs go through
    one) answers a ping, and under `lmscope up` its worker still takes jobs."""
    st = state()
    checks, failed = {}, []
    # the callers of /readyz (anyone: a load balancer) get the error's type; its message, which names hosts,
    # ports and users, goes to the log, once per change
    problem, driver_message = schema_problem_and_cause(st.engine)
    if driver_message is not None:
        _log_once("database", f"the database does not answer ({driver_message})")
    else:
        _logged.pop("database", None)
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
            checks["broker"] = f"error: {type(e).__name__}; the API's log has its message"
            _log_once("broker", f"the broker does not answer: {type(e).__name__}: {e}".splitlines()[0])
            failed.append("broker")
        else:
            _logged.pop("broker", None)
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
