"""How jobs look over HTTP: the one JSON shape the API, the client and the CLI share."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import quote

from lmscope.db.models import Job, utcnow
from lmscope.db.progress import children_done


def iso(dt: datetime | None) -> str | None:
    # Read back aware and in UTC on every database (lmscope.db.models.UTCDateTime).
    return dt.isoformat().replace("+00:00", "Z") if dt else None


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start).total_seconds(), 3)


def progress_json(job: Job, children: dict[str, int] | None = None,
                  last_child_end: datetime | None = None, running_children: float = 0.0) -> dict[str, Any] | None:
    """{done, total, stage, fraction, updated_at}; a parent's progress is its children finished / total (a
    cancelled or cancelling parent's: the children that ran to an end, which says how far it got), updated
    when the last of them ended (``last_child_end``); its fraction also counts how far its running children
    are (``running_children``: their fractions done, summed)."""
    if children is not None:
        total = children["total"]
        # A sweep being cancelled counts as it will once cancelled: its queued points, cancelled at once,
        # are not progress (else it would show 100 % while its running points stop).
        cancelling = job.status == "cancelled" or (job.status == "running" and bool(job.cancel_requested))
        done = children_done(children, cancelled=cancelling)
        under_way = 0.0 if cancelling or job.status != "running" else running_children  # they stop, not finish
        return {"done": done, "total": total, "stage": "children",
                "fraction": min(1.0, (done + under_way) / total) if total else None,
                "updated_at": iso(last_child_end)}
    if job.progress_total is None and job.progress_done is None and job.progress_stage is None:
        return None
    done, total = job.progress_done, job.progress_total
    fraction = min(1.0, done / total) if done is not None and total else None
    return {"done": done, "total": total, "stage": job.progress_stage, "fraction": fraction,
            "updated_at": iso(job.progress_at)}


def error_json(job: Job) -> dict[str, str | None] | None:
    return {"type": job.error_type, "message": job.error_message} if job.error_type or job.error_message else None


def timings_json(job: Job) -> dict[str, Any]:
    """Queue wait and run time in seconds; per-stage wall times come from the environment record."""
    env = job.environment or {}
    if job.status == "queued":  # waiting, for its first attempt or (re-queued) for another: none runs
        return {"queued_seconds": _seconds(job.created_at, utcnow()), "run_seconds": None,
                "stages": env.get("stages") or env.get("timings")}
    end = job.finished_at or (utcnow() if job.started_at else None)
    return {
        "queued_seconds": _seconds(job.created_at, job.started_at),
        "run_seconds": _seconds(job.started_at, end),
        "stages": env.get("stages") or env.get("timings"),
    }


def job_links(job_id: int) -> dict[str, str]:
    base = f"/v1/jobs/{job_id}"
    return {"self": base, "results": f"{base}/results", "artifacts": f"{base}/artifacts",
            "events": f"{base}/events", "cancel": f"{base}/cancel", "children": f"/v1/jobs?parent={job_id}"}


def job_json(job: Job, *, user_name: str | None = None, children: dict[str, int] | None = None,
             last_child_end: datetime | None = None, running_children: float = 0.0) -> dict[str, Any]:
    """`children`: counts by status when the job is a sweep parent (else None); `last_child_end`: when
    its last child to end so far ended; `running_children`: its running children's fractions done, summed."""
    links = job_links(job.id)
    if children is None:
        links.pop("children")
    return {
        "id": job.id,
        "kind": job.kind,
        "name": job.name,
        "tags": job.tags or [],
        "user": user_name,
        "status": job.status,
        "params": job.params,
        "parent_id": job.parent_id,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "created_at": iso(job.created_at),
        "published_at": iso(job.published_at),
        "started_at": iso(job.started_at),
        "finished_at": iso(job.finished_at),
        "heartbeat_at": iso(job.heartbeat_at),
        "worker": job.worker,
        "progress": progress_json(job, children, last_child_end, running_children),
        "cancel_requested": job.cancel_requested,
        "error": error_json(job),
        "summary": job.summary,
        "environment": job.environment,
        "timings": timings_json(job),
        "children": children,
        "links": links,
    }


def artifact_url(job_id: int, name: str) -> str:
    return f"/v1/jobs/{job_id}/artifacts/{quote(name)}"
