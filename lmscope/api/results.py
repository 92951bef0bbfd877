"""A job's results: its series (JSON curves) and its artifact files (plots, npz, checkpoints)."""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, request, send_file
from sqlalchemy import or_, select
from werkzeug.security import safe_join

from lmscope.api.auth import current_caller
from lmscope.api.errors import Problem
from lmscope.api.jobs import load_visible_job
from lmscope.api.render import artifact_url, iso
from lmscope.api.state import state
from lmscope.db.models import Artifact, Series

bp = Blueprint("results", __name__, url_prefix="/v1")


def job_dir(job_id: int) -> Path:
    return state().settings.artifact_dir / "jobs" / str(job_id)


@bp.get("/jobs/<int:job_id>/results")
def get_results(job_id: int):
    """The job's series; repeat `series=NAME` to pick some (a name ending in `*` matches a prefix).

    A requested name that matches nothing is listed in `missing`, with every series name of the job in
    `available`.
    """
    wanted = request.args.getlist("series")
    with state().sessions() as session:
        load_visible_job(session, current_caller(), job_id)
        q = select(Series).where(Series.job_id == job_id).order_by(Series.id)
        if wanted:
            exact = [w for w in wanted if not w.endswith("*")]
            prefixes = [w[:-1] for w in wanted if w.endswith("*")]
            q = q.where(or_(Series.name.in_(exact), *(Series.name.startswith(p, autoescape=True) for p in prefixes)))
        rows = session.scalars(q).all()
        found = {r.name for r in rows}
        # A requested name (or prefix*) that matched nothing: say so, and which names exist.
        missing = [w for w in wanted if not any(n.startswith(w[:-1]) if w.endswith("*") else n == w for n in found)]
        available = (sorted(set(session.scalars(select(Series.name).where(Series.job_id == job_id).distinct())))
                     if missing else None)
    body = {"job_id": job_id, "series": [{"name": r.name, "labels": r.labels, "x": r.x, "y": r.y} for r in rows]}
    if missing:
        body.update(missing=missing, available=available)
    return body


@bp.get("/jobs/<int:job_id>/artifacts")
def list_artifacts(job_id: int):
    """The job's files: name, media type, size, sha256 and a download url."""
    with state().sessions() as session:
        load_visible_job(session, current_caller(), job_id)
        rows = session.scalars(select(Artifact).where(Artifact.job_id == job_id).order_by(Artifact.name)).all()
    return {"job_id": job_id, "items": [
        {"name": a.name, "media_type": a.media_type, "size": a.size, "sha256": a.sha256,
         "created_at": iso(a.created_at), "url": artifact_url(job_id, a.name)} for a in rows]}


@bp.get("/jobs/<int:job_id>/artifacts/<path:name>")
def download_artifact(job_id: int, name: str):
    """One file. Only names recorded for the job are served, and only from inside the job's folder."""
    with state().sessions() as session:
        load_visible_job(session, current_caller(), job_id)
        artifact = session.scalar(select(Artifact).where(Artifact.job_id == job_id, Artifact.name == name))
    if artifact is None:
        raise Problem(404, "not-found", "Artifact not found",
                      f"job {job_id} has no artifact {name!r}; list them with GET /v1/jobs/{job_id}/artifacts")
    path = safe_join(str(job_dir(job_id)), name)
    if path is None or not Path(path).is_file():
        raise Problem(404, "not-found", "Artifact file missing",
                      f"artifact {name!r} of job {job_id} is recorded but its file is not in the artifact store")
    return send_file(Path(path).absolute(), mimetype=artifact.media_type, download_name=Path(name).name,
                     as_attachment=not artifact.media_type.startswith(("image/", "text/", "application/json")),
                     conditional=True, etag=artifact.sha256)
