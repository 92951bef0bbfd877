"""A job's results: its series (JSON curves) and its artifact files (plots, npz, checkpoints)."""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, request, send_file
from sqlalchemy import func, or_, select
from werkzeug.security import safe_join

from lmscope.api.auth import current_caller
from lmscope.api.errors import Problem
from lmscope.api.inputs import decode_page_token, encode_page_token, parse_id, query_list, query_params
from lmscope.api.jobs import load_visible_job
from lmscope.api.render import artifact_url, error_json, iso
from lmscope.api.state import state
from lmscope.catalog import INT32_MAX
from lmscope.compare import compare, x_meaning
from lmscope.db.models import Artifact, Series

bp = Blueprint("results", __name__, url_prefix="/v1")

# Shown in the browser; anything else (an SVG or HTML file, which can hold scripts that would run with
# the API's origin) is a download.
INLINE_MEDIA_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "application/json", "text/plain", "text/csv",
                                "text/markdown"})


def series_filter(wanted: list[str]):
    """SQL for "the name is one of `wanted`" (a name ending in `*` matches a prefix)."""
    exact = [w for w in wanted if not w.endswith("*")]
    prefixes = [w[:-1] for w in wanted if w.endswith("*")]
    return or_(Series.name.in_(exact), *(Series.name.startswith(p, autoescape=True) for p in prefixes))


def series_points():
    """A series' length in SQL: its stored count, or (a row written without one) the length of its x."""
    return func.coalesce(Series.points, func.json_array_length(Series.x))


def pick_series(session, job_id: int, wanted: list[str], *, after: int,
                budget: int) -> tuple[list[Series], list[str], int | None]:
    """The job's series whose names are in `wanted` (a name ending in `*` matches a prefix; none: all),
    from the one after id `after`, as many whole series as fit `budget` points (at least one); the wanted
    names that matched nothing; and the id to continue after when more are left (else None).

    The series are sized by their stored `points` before any is loaded: a job over a hundred checkpoints
    can hold millions of points (an entropy job's by-position curves)."""
    chosen = [Series.job_id == job_id] + ([series_filter(wanted)] if wanted else [])
    index = session.execute(select(Series.id, series_points(), Series.name).where(*chosen).order_by(Series.id)).all()
    missing = unmatched(wanted, {name for _, _, name in index})
    index = [(sid, points) for sid, points, _ in index if sid > after]
    taken, total = 0, 0
    for _, points in index:
        if taken and total + points > budget:
            break
        taken, total = taken + 1, total + points
    if not taken:
        return [], missing, None
    first, last = index[0][0], index[taken - 1][0]
    rows = session.scalars(select(Series).where(*chosen, Series.id >= first, Series.id <= last)
                           .order_by(Series.id)).all()
    return rows, missing, (last if taken < len(index) else None)


def unmatched(wanted: list[str], found: set[str]) -> list[str]:
    """The wanted names (or `prefix*`) that match none of `found`."""
    return [w for w in wanted if not any(n.startswith(w[:-1]) if w.endswith("*") else n == w for n in found)]


def series_json(rows: list[Series]) -> list[dict]:
    return [{"name": r.name, "labels": r.labels, "x": r.x, "y": r.y} for r in rows]


RESULT_PAGE_POINTS = 250_000  # x values per answer (about 10 MB of JSON); a series is never split


@bp.get("/jobs/<int:job_id>/results")
@query_params("series", "page_token", repeatable=["series"])
def get_results(job_id: int):
    """The job's series; repeat `series=NAME` to pick some (a name ending in `*` matches a prefix).

    A requested name that matches nothing is listed in `missing`, with every series name of the job in
    `available`. Whole series up to RESULT_PAGE_POINTS points per answer; `next_page_token` continues.
    """
    wanted = request.args.getlist("series")
    after = 0
    if token := request.args.get("page_token"):
        after = decode_page_token(token, "after", lambda v: type(v) is int and 0 <= v <= INT32_MAX,
                                  f"/v1/jobs/{job_id}/results")
    with state().sessions() as session:
        status = load_visible_job(session, current_caller(), job_id).status
        rows, missing, more_after = pick_series(session, job_id, wanted, after=after, budget=RESULT_PAGE_POINTS)
        # A requested name (or prefix*) that matched nothing: say so, and which names exist.
        available = (sorted(set(session.scalars(select(Series.name).where(Series.job_id == job_id).distinct())))
                     if missing else None)
    # x_meaning: what x is (a layer, a head, a training step, ...), as `compare` says it
    curves = [{**s, "x_meaning": x_meaning(s["name"])} for s in series_json(rows)]
    body = {"job_id": job_id, "status": status, "series": curves,
            "next_page_token": encode_page_token(after=more_after) if more_after is not None else None}
    if missing:
        body.update(missing=missing, available=available)
    return body


MAX_COMPARED = 20
MAX_COMPARED_SERIES = 5000  # curves in one answer, over all the jobs
MAX_COMPARED_POINTS = 1_000_000  # and their x values (about 40 MB of JSON)


@bp.get("/compare")
@query_params("jobs", "series", repeatable=["jobs", "series"])
def compare_jobs():
    """Jobs side by side: the parameters that differ, scalar summaries, and (`series=`) their curves
    matched by name and labels; `shared_series` names the curves every one of them has."""
    raw = query_list("jobs")
    parsed = [parse_id(part) for part in raw]
    if None in parsed or not 2 <= len(ids := list(dict.fromkeys(parsed))) <= MAX_COMPARED:
        msg = f"give 2 to {MAX_COMPARED} different job ids separated by commas, e.g. jobs=3,5"
        if bad := [part for part, i in zip(raw, parsed) if i is None]:
            shown = ", ".join(repr(part if len(part) <= 24 else part[:24] + "…") for part in bad[:3])
            msg += f"; {shown}{' …' if len(bad) > 3 else ''} {'is' if len(bad) == 1 else 'are'} not a job id"
        raise Problem(422, "validation-error", "Invalid query", f"jobs: {msg}",
                      errors=[{"loc": ["query", "jobs"], "msg": msg, "type": "value_error"}])
    wanted = request.args.getlist("series")
    caller = current_caller()
    with state().sessions() as session:
        # compare() reads only these fields of a job: no full rendering (progress, user, children)
        jobs = [{"id": j.id, "kind": j.kind, "name": j.name, "status": j.status, "error": error_json(j),
                 "params": j.params, "summary": j.summary} for j in (load_visible_job(session, caller, i) for i in ids)]
        rows = []
        if wanted:
            chosen = (Series.job_id.in_(ids), series_filter(wanted))
            count, points = session.execute(select(func.count(), func.coalesce(func.sum(series_points()), 0))
                                            .where(*chosen)).one()
            if count > MAX_COMPARED_SERIES or points > MAX_COMPARED_POINTS:  # counted in SQL, before any is loaded
                raise Problem(422, "too-many-series", "Too many curves to compare",
                              f"series={','.join(wanted)} matches {count} curves of {points} points in all over "
                              f"these jobs, more than {MAX_COMPARED_SERIES} curves or {MAX_COMPARED_POINTS} points; "
                              "name fewer series (e.g. entropy.layer_mean rather than entropy.* or "
                              "entropy.by_position) or compare fewer jobs", curves=count, points=int(points))
            rows = session.scalars(select(Series).where(*chosen).order_by(Series.id)).all()
        names: dict[int, set[str]] = {i: set() for i in ids}
        for job_id, name in session.execute(select(Series.job_id, Series.name).where(Series.job_id.in_(ids))
                                            .distinct()):
            names[job_id].add(name)
    result = compare(jobs, [series_json([r for r in rows if r.job_id == i]) for i in ids])
    result.missing = unmatched(wanted, {r.name for r in rows})  # names no job has
    result.shared_series = sorted(set.intersection(*names.values()))
    return result.to_json()


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
    path = safe_join(str(state().settings.job_dir(job_id)), name)
    if path is None or not Path(path).is_file():
        raise Problem(404, "not-found", "Artifact file missing",
                      f"artifact {name!r} of job {job_id} is recorded but its file is not in the artifact store")
    return send_file(Path(path).absolute(), mimetype=artifact.media_type, download_name=Path(name).name,
                     as_attachment=artifact.media_type not in INLINE_MEDIA_TYPES, conditional=True,
                     etag=artifact.sha256)
