"""/v1/jobs: submit, list, show, cancel. Results, artifacts and events live in their own modules."""

from __future__ import annotations

import logging
import shutil
from datetime import datetime
from pathlib import Path

from flask import Blueprint, request
from pydantic_core import to_jsonable_python
from sqlalchemy import delete, exists, func, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from lmscope.api.auth import Caller, current_caller
from lmscope.api.errors import Problem
from lmscope.api.inputs import (decode_page_token, encode_page_token, json_body, parse_id, query_int, query_list,
                                 query_params)
from lmscope.api.registry import uploaded_bytes
from lmscope.api.render import iso, job_json
from lmscope.api.state import state
from lmscope.api.submit import SubmitBody, active_jobs, create_job, find_replay, parse_body, request_hash
from lmscope.db.models import ACTIVE_STATES, JOB_STATES, TERMINAL_STATES, Artifact, Job, Model, Series, User, utcnow
from lmscope.db.progress import refresh_sweep_progress
from lmscope.params import KINDS, MAX_JOB_ID, is_parent_kind, parent_kinds
from lmscope.queue import publish_jobs
from lmscope.wording import did_you_mean

bp = Blueprint("jobs", __name__, url_prefix="/v1")
log = logging.getLogger("lmscope.api")

DEFAULT_LIMIT, MAX_LIMIT = 50, 500


# ---------------------------------------------------------------- helpers

def children_counts(session, parent_ids: list[int]) -> dict[int, dict[str, int]]:
    """{parent_id: {"total": n, "queued": ..., "succeeded": ...}} in one grouped query."""
    counts = {p: {"total": 0, **{s: 0 for s in JOB_STATES}} for p in parent_ids}
    if parent_ids:
        rows = session.execute(select(Job.parent_id, Job.status, func.count())
                               .where(Job.parent_id.in_(parent_ids)).group_by(Job.parent_id, Job.status))
        for parent_id, status, n in rows:
            counts[parent_id][status] = n
            counts[parent_id]["total"] += n
    return counts


def last_child_ends(session, parent_ids: list[int]) -> dict[int, datetime]:
    """{parent_id: when its last child to end so far ended}, for the parents with an ended child."""
    if not parent_ids:
        return {}
    return dict(session.execute(select(Job.parent_id, func.max(Job.finished_at))
                                .where(Job.parent_id.in_(parent_ids), Job.finished_at.is_not(None))
                                .group_by(Job.parent_id)).all())


def running_children_progress(session, parent_ids: list[int]) -> dict[int, float]:
    """{parent_id: the fractions done of its running children, summed} (a grid point at 80 % adds 0.8), so that
    a sweep of a few long points does not sit at 0 % while they run."""
    if not parent_ids:
        return {}
    rows = session.execute(select(Job.parent_id, Job.progress_done, Job.progress_total)
                           .where(Job.parent_id.in_(parent_ids), Job.status == "running", Job.progress_total > 0))
    share: dict[int, float] = {}
    for parent_id, done, total in rows:
        share[parent_id] = share.get(parent_id, 0.0) + min(1.0, max(0, done or 0) / total)
    return share


def children_of(session, job: Job) -> tuple[dict[str, int] | None, datetime | None, float]:
    """A sweep parent's (children counts, when its last child to end so far ended, its running children's
    summed fractions done); (None, None, 0.0) for any other job."""
    if not is_parent_kind(job.kind):
        return None, None, 0.0
    return (children_counts(session, [job.id])[job.id], last_child_ends(session, [job.id]).get(job.id),
            running_children_progress(session, [job.id]).get(job.id, 0.0))


def load_visible_job(session, caller: Caller, job_id: int) -> Job:
    """The job, or 404 when it does not exist *or* belongs to someone else (no existence leak)."""
    # No job has an id past the column's range (PostgreSQL would answer the query with an error).
    job = session.get(Job, job_id) if job_id <= MAX_JOB_ID else None
    if job is None or not caller.can_see(job.user_id):
        raise Problem(404, "not-found", "Job not found",
                      f"there is no job {job_id} of yours; list your jobs with GET /v1/jobs or `lmscope jobs`")
    if job.deleted_at is not None:
        raise job_deleted(job)
    return job


def job_deleted(job: Job) -> Problem:
    return Problem(410, "job-deleted", "Job deleted",
                   f"job {job.id} ({job.kind}) was deleted on {job.deleted_at:%Y-%m-%d %H:%M} UTC: its results and "
                   "files are gone; list your jobs with GET /v1/jobs or `lmscope jobs`", deleted_at=iso(job.deleted_at))


def queue_position(session, job: Job) -> dict[str, int | str]:
    """What a queued job waits behind: the queued jobs submitted before it (anyone's: the queue is shared,
    first in, first out) and the jobs running now (sweep parents waiting for children hold no worker);
    under `lmscope up`, also why its worker takes no more jobs, if it does not; with a broker, whether
    the job is still to be handed to it (a broker that was down when it was submitted) and how many
    workers take jobs from its queue (0: none is running, and the job waits for one)."""
    ahead = session.scalar(select(func.count()).where(Job.status == "queued", Job.id < job.id))
    running = session.scalar(select(func.count()).where(Job.status == "running", Job.waiting_children.is_(False)))
    queue: dict[str, int | str | bool] = {"ahead": ahead, "running": running}
    st = state()
    stopped = st.worker_stop_reason()
    if stopped:
        queue["worker_stopped"] = stopped
    if job.published_at is None and st.worker_stopped is None:  # with a broker (`lmscope up` reads SQL)
        queue["unsent"] = True  # the broker did not take it (yet): the reaper sends it again when it answers
    workers = st.consumers()
    if workers is not None:  # 0: nothing takes jobs from the queue; the job waits until a worker starts
        queue["workers"] = workers
    return queue


def unsent_children(session, job: Job) -> int:
    """How many of a sweep's queued children the broker has not taken yet (0 under `lmscope up`, which
    reads its queue from SQL)."""
    if state().worker_stopped is not None:
        return 0
    return session.scalar(select(func.count()).where(Job.parent_id == job.id, Job.status == "queued",
                                                     Job.published_at.is_(None)))


def render_job(session, job: Job) -> dict:
    children, last_end, running = children_of(session, job)
    body = job_json(job, user_name=session.scalar(select(User.name).where(User.id == job.user_id)), children=children,
                    last_child_end=last_end, running_children=running)
    if job.status == "queued":
        body["queue"] = queue_position(session, job)
    if children and children["queued"] and (unsent := unsent_children(session, job)):
        # A sweep submitted while the broker was down is itself running; only its children wait for it.
        body["children_unsent"] = unsent
    return body


def publish(ids: list[int], *, aggregation: bool = False) -> list[int]:
    """Publish job ids after the commit; a failure leaves published_at NULL for the reaper to retry.
    ``aggregation``: sweep parents, which go ahead of the queued jobs."""
    st = state()
    return publish_jobs(st.publisher, st.sessions, ids, aggregation=aggregation)


# ---------------------------------------------------------------- filters

def tag_filter(session, tag: str):
    """`tag` is an element of the JSON list `jobs.tags`; each database spells that differently."""
    if session.get_bind().dialect.name == "postgresql":
        return Job.tags.cast(JSONB).contains([tag])
    each = func.json_each(Job.tags).table_valued("value")
    return exists(select(1).select_from(each).where(each.c.value == tag))


# ---------------------------------------------------------------- routes

@bp.post("/jobs")
def submit_job():
    """Submit a job: validate kind + params, insert, publish; 202 with the job."""
    st, caller = state(), current_caller()
    raw = json_body('{"kind": "probe", "params": {"model": "tiny-gpt2"}}')
    key = request.headers.get("Idempotency-Key")
    if key is not None and (not 1 <= len(key) <= 200 or not key.isprintable()):
        raise Problem(422, "validation-error", "Invalid Idempotency-Key",
                      "the Idempotency-Key header must be 1 to 200 printable characters")
    body_hash = request_hash(raw) if key else None

    def replayed(session, job: Job):
        return render_job(session, job), 200, {"Location": f"/v1/jobs/{job.id}", "Idempotent-Replayed": "true"}

    if key:
        with st.sessions() as session:
            replay = find_replay(session, caller, key, body_hash)
            if replay is not None:
                return replayed(session, replay)

    body: SubmitBody = parse_body(raw)
    try:
        with st.sessions() as session, session.begin():
            job, to_publish = create_job(session, caller, st.settings, body, idempotency_key=key, body_hash=body_hash)
            job_id = job.id
    except IntegrityError:
        if not key:
            raise
        # A concurrent request with the same key won the insert: answer with its job.
        with st.sessions() as session:
            replay = find_replay(session, caller, key, body_hash)
            if replay is None:
                raise
            return replayed(session, replay)

    publish(to_publish)
    with st.sessions() as session:
        return render_job(session, session.get(Job, job_id)), 202, {"Location": f"/v1/jobs/{job_id}"}


def _use_one_of(word: str, names) -> str:
    """"; did you mean 'cancelled'? Use one of: queued, …" (or "; use one of: …" when nothing is close)."""
    close = did_you_mean(word, names)
    return (f"{close} Use" if close else "; use") + f" one of: {', '.join(names)}"


@bp.get("/jobs")
@query_params("kind", "status", "tag", "parent", "user", "limit", "page_token", repeatable=("tag",))
def list_jobs():
    """List your jobs, newest first; filters kind and status (comma-separated: any of them), tag
    (repeatable: jobs with every one), parent (an id or `none`), user (admins)."""
    st, caller = state(), current_caller()
    limit = query_int("limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    q = (select(Job, User.name).join(User, User.id == Job.user_id).where(Job.deleted_at.is_(None))
         .order_by(Job.id.desc()).limit(limit + 1))
    user = request.args.get("user")
    if not caller.is_admin:
        if user and user != caller.name:
            raise Problem(403, "forbidden", "Admins only",
                          f"only admins may list another user's jobs; leave out user={user} (you see your own jobs)")
        q = q.where(Job.user_id == caller.id)
    elif user:
        q = q.where(User.name == user)
    if kinds := query_list("kind"):
        q = q.where(Job.kind.in_(kinds))
    if wanted := query_list("status"):
        if bad := [s for s in wanted if s not in JOB_STATES]:
            raise Problem(422, "validation-error", "Invalid status filter",
                          f"unknown status {bad[0]!r}{_use_one_of(bad[0], JOB_STATES)} (comma-separated)",
                          errors=[{"loc": ["query", "status"], "msg": "unknown status", "type": "enum"}])
        q = q.where(Job.status.in_(wanted))
    parent = request.args.get("parent")
    if parent is not None:
        if parent.lower() in ("none", "null", ""):
            q = q.where(Job.parent_id.is_(None))
        elif (parent_id := parse_id(parent)) is not None and 1 <= parent_id <= MAX_JOB_ID:
            q = q.where(Job.parent_id == parent_id)
        else:
            raise Problem(422, "validation-error", "Invalid parent",
                          f"parent {parent!r} is neither a job id nor `none`; give a sweep's id to list its "
                          "children, or `none` for top-level jobs only",
                          errors=[{"loc": ["query", "parent"], "msg": "a job id or none", "type": "parent"}])
    if token := request.args.get("page_token"):
        q = q.where(Job.id < decode_page_token(token, "before", lambda v: type(v) is int and 1 <= v <= MAX_JOB_ID,
                                                       "/v1/jobs"))

    with st.sessions() as session:
        if caller.is_admin and user and session.scalar(select(User.id).where(User.name == user)) is None:
            # A typo would otherwise list nothing, as if the user had no jobs.
            names = list(session.scalars(select(User.name)))
            raise Problem(422, "validation-error", "Unknown user",
                          f"there is no user {user!r}" + did_you_mean(user, names)
                          + " (`lmscope user list` on the server lists them)",
                          errors=[{"loc": ["query", "user"], "msg": "unknown user", "type": "unknown_user"}])
        for kind in kinds:
            if kind not in KINDS and session.scalar(select(Job.id).where(Job.kind == kind).limit(1)) is None:
                # A typo (`nrms`) would otherwise list nothing, as if there were no such jobs.
                known = sorted(KINDS)
                raise Problem(422, "validation-error", "Unknown kind filter",
                              f"there is no job kind {kind!r}{_use_one_of(kind, known)} (comma-separated)",
                              errors=[{"loc": ["query", "kind"], "msg": "unknown kind", "type": "enum"}], kinds=known)
        for tag in filter(None, request.args.getlist("tag")):  # every one of them (an empty one: no filter)
            q = q.where(tag_filter(session, tag))
        rows = session.execute(q).all()
        page, more = rows[:limit], len(rows) > limit
        parents = [job.id for job, _ in page if is_parent_kind(job.kind)]
        counts, ends = children_counts(session, parents), last_child_ends(session, parents)
        running = running_children_progress(session, parents)
        items = [job_json(job, user_name=name, children=counts.get(job.id), last_child_end=ends.get(job.id),
                          running_children=running.get(job.id, 0.0)) for job, name in page]
    return {"items": items, "next_page_token": encode_page_token(before=page[-1][0].id) if more else None}


@bp.get("/jobs/<int:job_id>")
def get_job(job_id: int):
    """One job: status, progress, params, attempts, timings, environment, error, summary, links."""
    with state().sessions() as session:
        return render_job(session, load_visible_job(session, current_caller(), job_id))


@bp.post("/jobs/<int:job_id>/cancel")
def cancel_job(job_id: int):
    """Cancel: a queued job now, a running one at its next batch boundary, a sweep with all its children.

    409 `job-finished` for a finished job, 409 `job-finishing` for a sweep that is aggregating its children's
    results (no child left to cancel; it ends within moments with its results)."""
    st, caller = state(), current_caller()
    now = utcnow()
    notify_parent = None
    with st.sessions() as session, session.begin():
        job = load_visible_job(session, caller, job_id)
        if job.status in TERMINAL_STATES:
            raise Problem(409, "job-finished", "Job already finished",
                          f"job {job_id} has already finished ({job.status}); only queued or running jobs can be cancelled")
        # Conditional updates: the worker's claim (`WHERE status='queued'`) and ours cannot both win.
        if is_parent_kind(job.kind):
            # A sweep whose aggregation a worker has claimed (all its children are done) is no longer
            # cancellable: the aggregation is short and ends with its results. Conditional on the same
            # `waiting_children` the claim clears, so either the aggregation sees the cancel or we see it
            # claimed. A repeated cancel of a sweep already cancelling is accepted (nothing changes).
            asked = session.execute(update(Job).where(
                Job.id == job_id, Job.status == "running",
                Job.waiting_children.is_(True) | Job.cancel_requested.is_(True)).values(cancel_requested=True)).rowcount
            if not asked:
                session.refresh(job)
                if job.status in TERMINAL_STATES:
                    raise Problem(409, "job-finished", "Job already finished",
                                  f"job {job_id} finished while it was being cancelled")
                raise Problem(409, "job-finishing", "Sweep is finishing",
                              f"sweep {job_id} has no child left to run and is aggregating their results; it can no "
                              f"longer be cancelled and ends within moments (GET /v1/jobs/{job_id})")
            session.execute(update(Job).where(Job.parent_id == job_id, Job.status == "queued")
                            .values(status="cancelled", cancel_requested=True, finished_at=now))
            session.execute(update(Job).where(Job.parent_id == job_id, Job.status == "running")
                            .values(cancel_requested=True))
            refresh_sweep_progress(session, job_id)
            notify_parent = job_id
        else:
            cancelled = session.execute(update(Job).where(Job.id == job_id, Job.status == "queued")
                                        .values(status="cancelled", cancel_requested=True, finished_at=now)).rowcount
            if cancelled:
                notify_parent = job.parent_id
                if job.parent_id is not None:
                    refresh_sweep_progress(session, job.parent_id)
            elif not session.execute(update(Job).where(Job.id == job_id, Job.status == "running")
                                     .values(cancel_requested=True)).rowcount:
                raise Problem(409, "job-finished", "Job already finished",
                              f"job {job_id} finished while it was being cancelled")
    if notify_parent is not None:
        # Whoever makes a child terminal publishes the parent, so the aggregation runs after the last one.
        publish([notify_parent], aggregation=True)
    with st.sessions() as session:
        return render_job(session, session.get(Job, job_id)), 202




@bp.delete("/jobs/<int:job_id>")
def delete_job(job_id: int):
    """Delete an ended job: its series, artifacts and files; a sweep's grid points with it.

    The row stays, marked deleted, so that its id is never another job's: the job's routes answer 410
    `job-deleted`, and lists leave it out. 409 `job-active` for a queued or running job (cancel it first),
    `job-in-sweep` for a grid point (delete its sweep), `job-has-models` for a `train` job whose checkpoints
    are still registered models (`lmscope models delete --run R` first)."""
    st, caller = state(), current_caller()
    with st.sessions() as session, session.begin():
        job = load_visible_job(session, caller, job_id)
        if job.parent_id is not None:
            raise Problem(409, "job-in-sweep", "A grid point of a sweep",
                          f"job {job_id} is a grid point of sweep {job.parent_id}, whose results it belongs to; "
                          f"delete the sweep (`lmscope delete {job.parent_id}`), which deletes all its grid points")
        ids = [job_id, *session.scalars(select(Job.id).where(Job.parent_id == job_id).order_by(Job.id))]
        active = session.scalars(select(Job.id).where(Job.id.in_(ids), Job.status.in_(ACTIVE_STATES))).all()
        if active:
            which = (f"job {job_id} is {job.status}" if job_id in active
                     else f"grid points {', '.join(map(str, active))} of sweep {job_id} have not ended")
            raise Problem(409, "job-active", "Job not ended",
                          f"{which}; cancel it (`lmscope cancel {job_id}`) and delete it once it has ended")
        models = session.scalars(select(Model.name).where(Model.job_id.in_(ids)).order_by(Model.step)).all()
        if models:
            run = models[0].rsplit("@step", 1)[0]  # the run's name, also where run_name was left to its default
            shown = ", ".join(models) if len(models) <= 4 else f"{models[0]}, …, {models[-1]}"
            how = f"`lmscope models delete --run {run}`"
            raise Problem(409, "job-has-models", "Its checkpoints are registered models",
                          f"job {job_id}'s checkpoints are models jobs can name ({shown}: {len(models)}); remove them "
                          f"from the registry first ({how}), then delete the job", models=list(models))
        # Conditional on not being deleted yet: of two deletes at once, one deletes and the other answers 410.
        now = utcnow()
        if not session.execute(update(Job).where(Job.id == job_id, Job.deleted_at.is_(None))
                               .values(deleted_at=now, idempotency_key=None)).rowcount:
            session.refresh(job)
            raise job_deleted(job)
        session.execute(update(Job).where(Job.id.in_(ids[1:])).values(deleted_at=now, idempotency_key=None))
        session.execute(delete(Series).where(Series.job_id.in_(ids)))
        session.execute(delete(Artifact).where(Artifact.job_id.in_(ids)))
    freed = sum(remove_job_files(st.settings.job_dir(i)) for i in ids)
    return {"id": job_id, "deleted": ids, "freed_bytes": freed}


def remove_job_files(folder: Path) -> int:
    """Remove a deleted job's folder; the bytes its files held. What cannot be removed now (a disk error) is
    logged, and removed when the API next starts (`tidy_deleted_jobs`)."""
    size = 0
    for path in folder.rglob("*") if folder.is_dir() else ():
        try:
            if path.is_file() and not path.is_symlink():
                size += path.stat().st_size
        except OSError:
            pass
    try:
        shutil.rmtree(folder)
    except FileNotFoundError:
        pass
    except OSError as e:  # the job is deleted either way; what is left only takes space until the next start
        log.warning("could not remove all of %s, the files of a deleted job: %s", folder, e)
    return size


def tidy_deleted_jobs(sessions, settings) -> None:
    """At start-up, remove what `remove_job_files` could not: the folders of jobs marked deleted."""
    root = Path(settings.artifact_dir) / "jobs"
    if not root.is_dir():  # no job has written a file yet (nor is there a database to ask, on a new install)
        return
    try:
        with sessions() as session:  # the deleted ones are few; the folders may be hundreds of thousands
            deleted = session.scalars(select(Job.id).where(Job.deleted_at.is_not(None))).all()
    except SQLAlchemyError as e:  # tidying must not stop the API from starting
        log.warning("could not look for deleted jobs' files: %s", e)
        return
    for i in deleted:
        if settings.job_dir(i).exists():
            remove_job_files(settings.job_dir(i))


@bp.get("/me")
def whoami():
    """The caller: name, admin or not, active jobs, the bytes of their uploads and of their jobs' files, and
    limits (the user's own, else the server's)."""
    st, caller = state(), current_caller()
    with st.sessions() as session:
        active = active_jobs(session, caller.id)
        uploaded = uploaded_bytes(session, caller.id)
        stored = session.scalar(select(func.sum(Artifact.size)).join(Job, Job.id == Artifact.job_id)
                                .where(Job.user_id == caller.id))
    return {
        "name": caller.name, "is_admin": caller.is_admin, "active_jobs": active, "uploaded_bytes": uploaded,
        "job_file_bytes": int(stored or 0),  # SUM is NULL over no rows, and a Decimal on PostgreSQL
        "limits": {"max_active_jobs": caller.active_jobs_limit(st.settings),
                   "max_sweep_points": caller.sweep_points_limit(st.settings),
                   "max_uploaded_bytes": st.settings.max_uploaded_bytes_per_user},
        "per_user_limits": [k for k in ("max_active_jobs", "max_sweep_points") if getattr(caller, k) is not None],
    }


@bp.get("/kinds")
def list_kinds():
    """Every job kind, with a description and the JSON schema of its params; child kinds are `submittable: false`.

    Child kinds (a sweep's grid points) appear in job listings but are made only by their parent kind
    (`child_of`).
    """
    parents = parent_kinds()
    return {"items": [{"name": kind, "description": spec.description, "sweep": is_parent_kind(kind),
                       "submittable": spec.submittable, "child_of": None if spec.submittable else parents,
                       "params_schema": spec.params.model_json_schema(), "defaults": param_defaults(spec.params),
                       "example": spec.example}
                      for kind, spec in sorted(KINDS.items())]}


def param_defaults(model) -> dict:
    """{field: default} for every field that has one, nested models as dicts (what the schema's
    `default` keys miss for fields with a default factory)."""
    out = {}
    for name, field in model.model_fields.items():
        if not field.is_required():
            out[name] = to_jsonable_python(field.get_default(call_default_factory=True))
    return out
