"""GET /v1/jobs/{id}/events: server-sent events while a job runs.

The SQL row is the source of truth, so the stream polls it (a short session per poll, never one
held open) and sends `status` / `progress` events when they change and `end` at a terminal state.
A stream lasts at most `timeout` seconds (default 300); clients reconnect or poll after that.

Each open stream holds a server thread, so an API process keeps at most LMSCOPE_MAX_EVENT_STREAMS open
(LMSCOPE_MAX_EVENT_STREAMS_PER_USER per user); past that a stream is refused with 429, and the rest of
the API keeps answering.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Callable

from flask import Blueprint, Response, current_app
from sqlalchemy.exc import SQLAlchemyError

from lmscope.api.auth import current_caller
from lmscope.api.errors import Problem
from lmscope.api.inputs import query_params, query_seconds
from lmscope.api.jobs import children_of, load_visible_job
from lmscope.api.render import error_json, iso, progress_json
from lmscope.api.state import state
from lmscope.db.models import TERMINAL_STATES, Job

bp = Blueprint("events", __name__, url_prefix="/v1")

DEFAULT_TIMEOUT, MAX_TIMEOUT = 300.0, 3600.0
KEEPALIVE_SECONDS = 15.0
OUTAGE_POLL_SECONDS = 1.0  # how often a stream asks a database that does not answer


class StreamSlots:
    """The event streams this API process holds open, per user (each one holds a server thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: Counter[int] = Counter()

    def take(self, user_id: int, *, most: int, most_per_user: int) -> tuple[Callable[[], None] | None, str | None]:
        """(release, None) with a slot held for the user's stream, release giving it back once however
        often it is called; or (None, why not), nothing held."""
        with self._lock:
            if self._open[user_id] >= most_per_user:
                return None, (f"you have {self._open[user_id]} event streams open here, the most one user may "
                              f"(LMSCOPE_MAX_EVENT_STREAMS_PER_USER={most_per_user})")
            if sum(self._open.values()) >= most:
                return None, f"this server holds {most} event streams open, its most (LMSCOPE_MAX_EVENT_STREAMS={most})"
            self._open[user_id] += 1
        held = [True]

        def release() -> None:
            with self._lock:
                if held[0]:
                    held[0] = False
                    self._open[user_id] -= 1
                    if self._open[user_id] <= 0:
                        del self._open[user_id]
        return release, None


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def snapshot(sessions, job_id: int) -> dict:
    with sessions() as session:
        job = session.get(Job, job_id)
        if job is None:  # deleted while watched
            return {"id": job_id, "status": "cancelled", "attempts": 0, "cancel_requested": True, "progress": None,
                    "error": {"type": "deleted", "message": "the job was deleted"}, "summary": None, "finished_at": None}
        children, last_end, running = children_of(session, job)
        return {
            "id": job.id, "status": job.status, "attempts": job.attempts, "cancel_requested": job.cancel_requested,
            "progress": progress_json(job, children, last_end, running),
            "error": error_json(job),
            "summary": job.summary, "finished_at": iso(job.finished_at),
        }


@bp.get("/jobs/<int:job_id>/events")
@query_params("timeout")
def job_events(job_id: int):
    """Server-sent events: `status` and `progress` as they change, `end` at a terminal state."""
    st = state()
    caller = current_caller()
    with st.sessions() as session:
        load_visible_job(session, caller, job_id)
    timeout = query_seconds("timeout", DEFAULT_TIMEOUT, MAX_TIMEOUT)
    poll = current_app.config.get("LMSCOPE_SSE_POLL_SECONDS", 0.5)
    sessions = st.sessions  # the generator runs after the request context is gone
    slots = st.extra.setdefault("event_streams", StreamSlots())
    release, refused = slots.take(caller.id, most=st.settings.max_event_streams,
                                  most_per_user=st.settings.max_event_streams_per_user)
    if refused is not None:
        raise Problem(429, "too-many-streams", "Too many event streams",
                      f"{refused}; close one (a stream ends at the job's end or its timeout), or poll "
                      f"GET /v1/jobs/{job_id} instead", headers={"Retry-After": "30"})

    def stream():
        deadline = time.monotonic() + timeout
        last_status = last_progress = None
        last_sent = time.monotonic()
        yield "retry: 2000\n\n"
        outage = False
        while True:
            try:
                snap = snapshot(sessions, job_id)
            except SQLAlchemyError:
                # the database does not answer (the rest of the API says 503 database-unavailable): say so
                # once, keep the stream, and go on when it answers again
                if not outage:
                    yield sse("unavailable", {"id": job_id, "type": "database-unavailable",
                                              "detail": "the database does not answer; the stream goes on when it does"})
                    outage, last_sent = True, time.monotonic()
                if time.monotonic() >= deadline:
                    yield sse("timeout", {"id": job_id, "detail": "stream time limit reached; reconnect to keep watching"})
                    return
                time.sleep(max(poll, OUTAGE_POLL_SECONDS))
                continue
            outage = False
            # progress first: a job's last progress comes with its terminal status (one write), and a client
            # that stops at that status must have seen it
            progress = snap["progress"]
            if progress is not None and progress != last_progress:
                yield sse("progress", {"id": job_id, **progress})
                last_progress, last_sent = progress, time.monotonic()
            status_key = (snap["status"], snap["cancel_requested"], snap["attempts"])
            if status_key != last_status:
                yield sse("status", snap)
                last_status, last_sent = status_key, time.monotonic()
            if snap["status"] in TERMINAL_STATES:
                yield sse("end", snap)
                return
            if time.monotonic() >= deadline:
                yield sse("timeout", {"id": job_id, "detail": "stream time limit reached; reconnect to keep watching"})
                return
            if time.monotonic() - last_sent > KEEPALIVE_SECONDS:
                yield ": keep-alive\n\n"  # proxies close idle connections
                last_sent = time.monotonic()
            time.sleep(poll)

    response = Response(stream(), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    # when the server closes the response: at the stream's end, a client that went away, or one that never read
    response.call_on_close(release)
    return response
