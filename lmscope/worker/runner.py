"""Run one delivery of a job id: claim the row, run the analysis, store the results.

    execute(job_id, settings, session_factory, publisher) -> final status, or None if there was nothing to do

The same function serves the Celery task and the embedded worker thread. Its rules:

- Claim: a conditional UPDATE (``status='queued'`` and the ``attempts`` value we read) makes the row
  ours; whoever loses the race sees no row and returns (a duplicate delivery is acked and dropped).
- A redelivered message whose row is still ``running`` is dropped, unless the row's worker is a
  process on *this* host that no longer exists (the Celery child was SIGKILLed and
  ``task_reject_on_worker_lost`` put the message back at once): then the attempt is taken over at
  once instead of waiting ``stale_after_seconds`` for the reaper. A takeover with no attempt left fails
  the job (``worker-lost``), and one whose attempt ran until the hard time limit (the limit killed it)
  fails it with ``time-limit``: never retried, since every attempt would be killed the same way.
- Results go in one transaction that first re-checks ownership, deletes what an earlier attempt
  wrote and inserts the new series and artifact rows: a retry never duplicates anything.
- A Python exception fails the job (not retried); retries are for lost workers only.
- Sweep parents are never claimed like this: a parent id runs the exactly-once aggregation.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import mimetypes
import os
import re
import shutil
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import delete, exists, insert, select, update
from sqlalchemy.exc import OperationalError, ProgrammingError, SQLAlchemyError
from sqlalchemy.orm import Session, aliased, sessionmaker

from lmscope.analyses import registry
from lmscope.analyses.base import ChildResult, JobCancelled, JobFailed, JobOutput
from lmscope.analyses.base import Series as SeriesData
from lmscope.config import Settings, time_limits
from lmscope.db.models import ACTIVE_STATES, TERMINAL_STATES, Artifact, Job, Series, utcnow
from lmscope.db.progress import children_done, refresh_sweep_progress
from lmscope.queue import Publisher, publish_jobs
from lmscope.params import is_parent_kind
from lmscope.worker import environment
from lmscope.worker.attempt import Attempt, AttemptLost, Heartbeat, WorkerShutdown, is_outage, through_outage
from lmscope.worker.context import WorkerContext
from lmscope.worker.environment import environment_record, worker_device, worker_id
from lmscope.wording import error_line

log = logging.getLogger("lmscope.worker")

# Files a person will want to open; anything else is served as bytes.
MEDIA_TYPES = {
    ".png": "image/png", ".svg": "image/svg+xml", ".pdf": "application/pdf", ".json": "application/json",
    ".jsonl": "application/x-ndjson", ".csv": "text/csv", ".txt": "text/plain", ".md": "text/markdown",
    ".npz": "application/x-npz", ".npy": "application/x-npy", ".safetensors": "application/octet-stream",
    ".bin": "application/octet-stream", ".pt": "application/octet-stream", ".html": "text/html",
}
KEEP_BETWEEN_ATTEMPTS = "checkpoints"

# Set when a job left this process's GPU unusable (``environment.device_failure``): CUDA fails every later
# call in the process, so no later job may run here. The Celery task then ends the pool child (Celery
# starts a fresh one); the embedded worker stops taking jobs until ``lmscope up`` is restarted.
broken_device: str | None = None


def give_back_values(kind: str, **overrides) -> dict[str, Any]:
    """UPDATE values that give a job back for another attempt: a job goes back to the queue (to be
    published again), a sweep parent waits for its aggregation again (it stays ``running``).
    ``overrides``: what the caller adds (e.g. ``published_at`` when it publishes at once)."""
    back = dict(waiting_children=True) if is_parent_kind(kind) else dict(status="queued", published_at=None)
    return {**dict(worker=None, **back), **overrides}


def lost_message(attempts: int, heartbeat_at, worker: str | None) -> str:
    when = heartbeat_at.isoformat(timespec="seconds") if heartbeat_at else "never"
    return (f"worker lost {attempts} time{'s' if attempts != 1 else ''}; last seen at {when}"
            f"{f' on {worker}' if worker else ''}. Gave up after max_attempts; if the job needs more memory or "
            "time than a worker has, use smaller parameters")


def worker_lost_values(attempts: int, heartbeat_at, worker: str | None, now) -> dict[str, Any]:
    """UPDATE values that fail a job whose last attempt's worker was lost, with no attempt left."""
    return dict(status="failed", finished_at=now, error_type="worker-lost",
                error_message=lost_message(attempts, heartbeat_at, worker))


# ---------------------------------------------------------------- claim

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child not yet reaped by its parent is a zombie: dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def worker_gone_here(worker: str | None) -> bool:
    """True when ``worker`` (host:pid) names a process on this host that no longer runs."""
    if not worker or ":" not in worker:
        return False
    host, _, pid = worker.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    return not _pid_alive(int(pid))


@dataclass
class Finished:
    """The claim ended the job without running it (cancelled before start, out of attempts or time)."""

    status: str
    parent_id: int | None


def time_limit_slack(settings: Settings) -> float:
    """How far short of the hard time limit an attempt's last heartbeat may be when the limit killed it:
    two heartbeat intervals (the heartbeat thread writes once per interval, and the claim that sets
    ``started_at`` comes a little after Celery starts the task's clock); at most a quarter of the limit."""
    return min(2 * settings.heartbeat_seconds, settings.task_time_limit / 4)


def ran_into_time_limit(settings: Settings, kind: str, started_at, last_seen) -> bool:
    """True when a lost attempt ran until the hard time limit (``LMSCOPE_TASK_TIME_LIMIT``): its worker
    process was most likely killed by that limit (a long call that reports no progress cannot be
    interrupted by the soft limit), and another attempt would only be killed again. ``last_seen``: the
    attempt's last heartbeat (or now). A sweep parent's ``started_at`` is the sweep's, not its
    aggregation's: never judged here."""
    limit = settings.task_time_limit
    if not limit or started_at is None or last_seen is None or is_parent_kind(kind):
        return False
    return (last_seen - started_at).total_seconds() >= limit - time_limit_slack(settings)


def time_limit_values(settings: Settings, attempts: int, now) -> dict[str, Any]:
    """UPDATE values that fail a job killed by the hard time limit (it is not retried)."""
    return dict(status="failed", finished_at=now, error_type="time-limit", error_message=(
        f"the job ran into the hard time limit ({settings.time_limit_setting}) and its worker process was "
        f"killed (attempt {attempts}): it did not stop at a progress report before the limit (a long call "
        "without progress reports cannot be interrupted). Not retried; use smaller parameters, or ask an "
        "operator to raise LMSCOPE_TASK_TIME_LIMIT"))


def end_keeping_files(settings: Settings, session_factory: sessionmaker[Session], job_id: int, where,
                      values: dict[str, Any]) -> bool:
    """End a job that will not run again (a conditional UPDATE: False when ``where`` no longer holds),
    listing the files its attempts kept as its artifacts."""
    # Listed before the transaction (hashing checkpoints takes a while; SQLite would be locked meanwhile).
    files = files_kept(job_id, settings.job_dir(job_id))
    with session_factory() as session, session.begin():
        if session.execute(update(Job).where(where).values(**values)).rowcount != 1:
            return False
        store_artifacts(session, job_id, files)
    return True


def claim(session_factory: sessionmaker[Session], job_id: int, worker: str, *,
          settings: Settings) -> Attempt | Finished | None:
    """Make the row ours (atomically), or say why not. None: nothing to do (ack and drop).

    ``settings``: the time limit, and the artifact store whose files a job ended here without running
    (cancelled, out of attempts, killed by the time limit) keeps."""
    now = utcnow()
    with session_factory() as session:
        row = session.execute(select(Job.status, Job.attempts, Job.max_attempts, Job.worker, Job.heartbeat_at,
                                     Job.started_at, Job.cancel_requested, Job.kind, Job.params, Job.parent_id)
                              .where(Job.id == job_id)).one_or_none()
    if row is None:
        return None  # (execute logs a missing id)
    if row.status == "queued":
        same = (Job.status == "queued")
    elif row.status == "running" and worker_gone_here(row.worker):  # (execute never claims a sweep parent)
        same = (Job.status == "running") & (Job.worker == row.worker)
        log.warning("job %s: its worker %s is gone; taking over", job_id, row.worker)
    else:
        return None  # running elsewhere, or already finished: a duplicate delivery
    # Every write below is conditional on the row being as read: a concurrent claim makes it change nothing.
    same = (Job.id == job_id) & same & (Job.attempts == row.attempts)

    ending = None  # values that end the job here, without running it
    if row.cancel_requested:
        ending = dict(status="cancelled", finished_at=now, worker=worker)
    elif row.status == "running" and ran_into_time_limit(settings, row.kind, row.started_at, row.heartbeat_at or now):
        log.warning("job %s: its attempt %s ran into the hard time limit; failing it (time-limit)", job_id, row.attempts)
        ending = time_limit_values(settings, row.attempts, now)
    elif row.attempts >= row.max_attempts and row.status == "running":
        ending = worker_lost_values(row.attempts, row.heartbeat_at, row.worker, now)
    elif row.attempts >= row.max_attempts:
        ending = dict(status="failed", finished_at=now, error_type="worker-lost", error_message=(
            f"the job was already attempted {row.attempts} times (max_attempts={row.max_attempts})"))
    if ending is not None:
        if not end_keeping_files(settings, session_factory, job_id, same, ending):
            return None
        return Finished(ending["status"], row.parent_id)

    with session_factory() as session, session.begin():
        done = session.execute(update(Job).where(same).values(
            status="running", attempts=Job.attempts + 1, started_at=now, heartbeat_at=now, worker=worker,
            finished_at=None, error_type=None, error_message=None, summary=None,
            progress_done=None, progress_total=None, progress_stage=None, progress_at=None)).rowcount == 1
    if not done:
        return None  # someone else claimed it between our read and our write
    return Attempt(job_id=job_id, number=row.attempts + 1, worker=worker, kind=row.kind,
                   params=dict(row.params or {}), parent_id=row.parent_id, max_attempts=row.max_attempts)


# ---------------------------------------------------------------- results

def jsonable(value: Any) -> Any:
    """Plain JSON values: numpy/torch scalars and arrays to Python, NaN/inf to null (PostgreSQL's JSON refuses them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # numpy arrays/scalars, torch tensors
        return jsonable(value.tolist())
    if hasattr(value, "item"):
        return jsonable(value.item())
    return str(value)


def prepare_artifact_dir(path: Path) -> None:
    """Empty the job's folder for a new attempt, keeping ``checkpoints/`` so training can resume."""
    path.mkdir(parents=True, exist_ok=True)
    for entry in path.iterdir():
        if entry.name == KEEP_BETWEEN_ATTEMPTS and entry.is_dir():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def scan_artifacts(path: Path) -> list[dict[str, Any]]:
    """One row per file under the job's folder (recursive): relative posix name, media type, size, sha256."""
    rows = []
    if not path.is_dir():
        return rows
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        media = MEDIA_TYPES.get(file.suffix.lower()) or mimetypes.guess_type(file.name)[0] or "application/octet-stream"
        rows.append(dict(name=file.relative_to(path).as_posix(), media_type=media, size=file.stat().st_size,
                         sha256=digest.hexdigest()))
    return rows


def _series_rows(job_id: int, series: list[SeriesData]) -> list[dict[str, Any]]:
    rows = []
    for s in series:
        x, y = jsonable(list(s.x)), jsonable(list(s.y))
        if len(x) != len(y):
            raise ValueError(f"series {s.name!r} has {len(x)} x values but {len(y)} y values")
        rows.append(dict(job_id=job_id, name=str(s.name)[:200], labels=jsonable(dict(s.labels or {})), x=x, y=y))
    return rows


def finish(session_factory: sessionmaker[Session], attempt: Attempt, status: str, *,
           output: JobOutput | None = None, artifact_dir: Path | None = None, **values) -> bool:
    """Flip the row to a terminal status (and store results) in one transaction, if still ours."""
    return store_outcome(session_factory, attempt, status, *outcome_rows(attempt, status, output, artifact_dir, values))


def outcome_rows(attempt: Attempt, status: str, output: JobOutput | None, artifact_dir: Path | None,
                 values: dict[str, Any]) -> tuple[dict[str, Any], list | None, list | None]:
    """(row values, series rows or None, artifact rows or None) of an outcome, made once: hashing a
    train run's checkpoints is not redone at each try through a database outage."""
    values = {k: jsonable(v) if k in ("summary", "environment") else v for k, v in values.items()}
    values.setdefault("finished_at", utcnow())  # one time for every try: it tells this write apart
    series = _series_rows(attempt.job_id, output.series) if output is not None else None
    # An attempt that ran keeps the files it wrote, however it ended: a cancelled or timed-out train run
    # its checkpoints, a failed job what it got to (for diagnosis), with or without results. Only a
    # succeeded job must list them; any other still ends when the store cannot be read.
    artifacts = None
    if artifact_dir is not None:
        artifacts = scan_artifacts(artifact_dir) if status == "succeeded" else files_kept(attempt.job_id, artifact_dir)
    return values, series, artifacts


def store_outcome(session_factory: sessionmaker[Session], attempt: Attempt, status: str, values: dict[str, Any],
                  series: list | None, artifacts: list | None) -> bool:
    """``outcome_rows`` written in one transaction, if the row is still this attempt's."""
    with session_factory() as session, session.begin():
        done = session.execute(update(Job).where(attempt.owned()).values(status=status, **values))
        if done.rowcount != 1:
            return False  # nothing was changed; the (empty) transaction commits
        if series is not None:
            session.execute(delete(Series).where(Series.job_id == attempt.job_id))
            if series:
                session.execute(insert(Series), series)
        if artifacts is not None:
            store_artifacts(session, attempt.job_id, artifacts)
    return True


def outcome_stored(session_factory: sessionmaker[Session], attempt: Attempt, status: str, finished_at) -> bool:
    """Whether the row already holds this outcome (``outcome_rows``' own `finished_at`): a commit whose
    answer the connection lost, not the reaper's failure of the same attempt."""
    with session_factory() as session:
        found = session.execute(select(Job.id).where(
            Job.id == attempt.job_id, Job.status == status, Job.worker == attempt.worker,
            Job.attempts == attempt.number, Job.finished_at == finished_at)).first()
    return found is not None


def files_kept(job_id: int, folder: Path) -> list[dict[str, Any]]:
    """The artifact rows of the files an ended job kept; none, with a warning, if the store cannot be read."""
    try:
        return scan_artifacts(folder)
    except OSError as e:
        log.warning("job %s: its files could not be listed (%s); it ends without them", job_id, e)
        return []


def store_artifacts(session: Session, job_id: int, rows: list[dict[str, Any]]) -> None:
    """Replace the job's artifact rows (a retry's files replace an earlier attempt's)."""
    session.execute(delete(Artifact).where(Artifact.job_id == job_id))
    if rows:
        session.execute(insert(Artifact), [dict(job_id=job_id, created_at=utcnow(), **r) for r in rows])


def after_terminal(session_factory: sessionmaker[Session], publisher: Publisher, parent_id: int | None) -> None:
    """A child became terminal: update the parent's progress (children finished / total), publish the parent."""
    if parent_id is None:
        return
    try:
        with session_factory() as session, session.begin():
            refresh_sweep_progress(session, parent_id)
    except Exception as e:  # cosmetic; the aggregation does not depend on it
        log.warning("could not update progress of sweep %s: %s", parent_id, e)
    publish_jobs(publisher, session_factory, [parent_id], aggregation=True)


# ---------------------------------------------------------------- running

def _failure(e: BaseException, settings: Settings, kind: str | None = None) -> tuple[str, str]:
    """(error_type, message) for an exception that ended a job."""
    from pydantic import ValidationError

    from lmscope.params import UnknownKind

    if isinstance(e, UnknownKind):
        return "unknown-kind", f"this worker does not know job kind {str(e)!r}; run a worker of the same lmscope version as the API"
    if isinstance(e, JobFailed):
        return e.error_type, str(e)
    if isinstance(e, ValidationError):
        return "invalid-params", f"the job's parameters are invalid: {e}"
    name = type(e).__name__
    if name in ("SoftTimeLimitExceeded", "TimeLimitExceeded"):
        return "time-limit", f"the job ran past its time limit ({settings.time_limit_setting}); use smaller parameters"
    host = isinstance(e, MemoryError) or (name == "RuntimeError" and bool(_CPU_OOM.search(str(e))))
    if name == "OutOfMemoryError" or host:  # torch's, named: the Celery parent never loads torch
        return "out-of-memory", out_of_memory_message(str(e) or name, kind, host=host)
    return name, str(e) or name


# torch's CPU allocator fails with a plain RuntimeError: "[enforce fail at alloc_cpu.cpp:117] data.
# DefaultCPUAllocator: not enough memory: you tried to allocate …" (or "can't allocate memory")
_CPU_OOM = re.compile(r"DefaultCPUAllocator|can't allocate memory")
# torch's message goes on, on the same line, about other processes and the allocator's settings
_OOM_TAIL = re.compile(r"\s+(Process \d|Including non-PyTorch|Of the allocated|If reserved)")
# what a job's peak memory grows with (rows per batch, tokens per row); each kind is told those it has
_SIZE_FIELDS = ("batch_size", "seq_len", "max_tokens", "context")


def out_of_memory_message(text: str, kind: str | None, host: bool = False) -> str:
    """"the device ran out of memory: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has …; lower
    batch_size or seq_len, or dtype bfloat16": torch's first sentences and the kind's own size fields."""
    from lmscope.params import KINDS

    asked = re.search(r"you tried to allocate (\d+) bytes", text)
    if host:  # torch's CPU wording starts with the C++ assertion that failed; Python's MemoryError says nothing
        head = "the host has no room for " + (f"{int(asked.group(1)) / 2**30:.3g} GiB more" if asked else "more")
    else:
        head = _OOM_TAIL.split(text, maxsplit=1)[0].strip().rstrip(".")
    fields = KINDS[kind].params.model_fields if kind in KINDS else {}
    lower = [f for f in _SIZE_FIELDS if f in fields]
    advice = [("lower " + " or ".join(lower)) if lower else "use smaller parameters"]
    if "dtype" in fields:
        advice.append("set dtype bfloat16")
    where = "the host" if host else "the device"
    return f"{where} ran out of memory: {head}; {', or '.join(advice)}"


def record_start_environment(session_factory: sessionmaker[Session], attempt: Attempt, device: str) -> None:
    """Where the attempt runs, written before it computes: a job whose worker dies (and that the reaper
    fails as worker-lost) still says on which host, device and versions it last ran. The record written
    at the end (with stages and wall time) replaces it."""
    env = environment_record(device, {}, 0.0, {}, attempt=attempt.number, worker=attempt.worker)
    for key in ("stages", "wall_seconds"):
        env.pop(key, None)
    try:
        with session_factory() as session, session.begin():
            session.execute(update(Job).where(attempt.owned()).values(environment=jsonable(env)))
    except SQLAlchemyError as e:  # cosmetic: the job runs anyway and writes its full record at the end
        log.warning("job %s: could not record the environment at start: %s", attempt.job_id, e)


def _run_attempt(attempt: Attempt, settings: Settings, session_factory: sessionmaker[Session],
                 compute, shutdown: threading.Event | None, *, shares_process: bool = False,
                 final_values: dict[str, Any] | None = None, after_cancel: bool = False,
                 cancellable: bool = True, fixed_progress: tuple[int, int] | None = None) -> str | None:
    """Heartbeat + context around ``compute(params, ctx) -> JobOutput``; store the outcome.

    ``final_values``: written with the terminal status whatever it is (after the attempt's own progress);
    a ``summary`` in it is merged into the job's summary. ``after_cancel``: the job is already cancelled
    and ``compute`` saves what it can; its results are stored, and the status is ``cancelled`` whatever
    the outcome. ``cancellable=False``: a cancel requested meanwhile does not stop ``compute`` (a sweep's
    aggregation). ``fixed_progress``: (done, total) that the job's progress reports keep; they change
    only the stage (a sweep parent's progress stays its children's count while it aggregates)."""
    from lmscope.params import validate_params

    final = dict(final_values or {})
    final_summary = final.pop("summary", None)

    folder = settings.job_dir(attempt.job_id)
    prepare_artifact_dir(folder)
    heartbeat = Heartbeat(session_factory, attempt, settings.heartbeat_seconds)
    device = worker_device()
    record_start_environment(session_factory, attempt, device)
    # before Celery's soft limit, so the job stops at a progress report rather than anywhere
    deadline = time.monotonic() + time_limits(settings.task_time_limit)[1] if settings.task_time_limit else None
    ctx = WorkerContext(attempt, session_factory, folder, device, heartbeat=heartbeat, shutdown=shutdown,
                        deadline=deadline, time_limit_setting=settings.time_limit_setting,
                        shares_process=shares_process, cancellable=cancellable,
                        fixed_progress=fixed_progress)
    started = time.perf_counter()
    heartbeat.start()
    try:  # the heartbeat goes on while the results are stored (hashing big files takes a while)
        status, values, output = None, {}, None
        try:
            with ctx.stage("total", announce=False):
                params = validate_params(attempt.kind, attempt.params, internal=True)
                try:
                    output = compute(params, ctx)
                finally:  # the next job on this model in this process may start while the results are stored
                    ctx.release_model()
            if not isinstance(output, JobOutput):
                raise TypeError(f"the {attempt.kind} analysis returned {type(output).__name__}, not JobOutput")
            status, values = "succeeded", dict(summary=output.summary)
        except AttemptLost:
            log.warning("job %s attempt %s lost its row (re-queued elsewhere); stopping",
                        attempt.job_id, attempt.number)
            return None
        except WorkerShutdown:
            # Give the job back without counting the attempt: a sweep parent waits for aggregation again.
            with session_factory() as session, session.begin():
                session.execute(update(Job).where(attempt.owned()).values(
                    **give_back_values(attempt.kind, attempts=Job.attempts - 1, heartbeat_at=None)))
            log.info("job %s returned to the queue (worker shutting down)", attempt.job_id)
            return None
        except JobCancelled as e:
            status, output = "cancelled", e.partial  # what the analysis chose to keep, if anything
            if output is not None:
                values = dict(summary=output.summary)
        except Exception as e:
            if is_outage(e):  # no failure of the job's, even if the database answers again by now
                raise DatabaseLostDuringJob(attempt, e) from e
            status, output = "failed", e.partial if isinstance(e, JobFailed) else None
            error_type, message = _failure(e, settings, attempt.kind)
            values = dict(error_type=error_type[:64], error_message=message)
            if output is not None:
                values["summary"] = output.summary
            if not isinstance(e, JobFailed):
                log.exception("job %s (%s) failed", attempt.job_id, attempt.kind)
                ctx.record("traceback", "".join(traceback.format_exception(e))[-8000:])
            # out of memory is no sticky error, and the probe could run out of memory itself
            broken = environment.device_failure(device) if error_type != "out-of-memory" else None
            if broken:
                global broken_device
                broken_device = broken
                values.update(error_type="device-error", error_message=(
                    f"{message} — and the GPU is unusable in the worker process that ran the job ({broken}); "
                    "that process runs no other job (a Celery worker starts a fresh one; `lmscope up` needs a "
                    "restart). Often a kernel bug: submit the job again, and report it if it fails the same way"))
        if values.get("error_type") == "out-of-memory":  # the exception, and the tensors its frames held, are gone
            from lmscope.modeling.memory import free_memory  # torch is loaded: the job ran out of device memory

            free_memory()
        if after_cancel:
            status = "cancelled"  # the results (if compute returned any) are stored with it

        if ctx.last_progress is not None:
            done, total, stage = ctx.last_progress
            values.update(progress_done=done, progress_total=total, progress_stage=stage, progress_at=utcnow())
        values.update(final)
        if final_summary is not None:
            values["summary"] = {**(values.get("summary") or {}), **final_summary}
        values["environment"] = environment_record(device, ctx.timings, time.perf_counter() - started, ctx.environment,
                                                   attempt=attempt.number, worker=attempt.worker)
        values["heartbeat_at"] = utcnow()
        try:
            # hours of work should not fail on a database restart: wait for it (stopping for a shutdown)
            # a row that is no longer ours may hold this very outcome: a commit whose answer was lost
            rows = outcome_rows(attempt, status, output, folder, values)

            def store() -> bool:
                return (store_outcome(session_factory, attempt, status, *rows)
                        or outcome_stored(session_factory, attempt, status, rows[0]["finished_at"]))

            stored = through_outage(f"storing the results of job {attempt.job_id}", store, stop=shutdown)
        except Exception as e:  # results that cannot be stored (e.g. malformed series) fail the job
            if is_outage(e):  # the database is unreachable: the row stays running and the reaper retries the job
                raise DatabaseLostDuringJob(attempt, e) from e
            if output is None:
                raise
            log.exception("job %s: storing results failed", attempt.job_id)
            error_type, message = _failure(e, settings)
            if status == "failed":  # the job's own failure stays the reason
                values.update(error_message=f"{values['error_message']} (storing its partial results failed too: "
                                            f"{message})", summary=final_summary)
            else:
                status = "cancelled" if after_cancel or status == "cancelled" else "failed"
                values.update(error_type=error_type[:64], error_message=f"storing the results failed: {message}",
                              summary=final_summary)
            stored = finish(session_factory, attempt, status, artifact_dir=folder, **values)
        if not stored:
            log.warning("job %s attempt %s: row taken by another attempt; results discarded",
                        attempt.job_id, attempt.number)
            return None
        return status
    finally:
        heartbeat.stop()


class DatabaseLostDuringJob(Exception):
    """The database stopped answering while the job ran (longer than the context waits for it): the row
    stays ``running``, its heartbeat goes stale and the reaper re-queues it (the attempt counts)."""

    def __init__(self, attempt: Attempt, error: Exception):
        super().__init__(f"job {attempt.job_id} attempt {attempt.number}: the database failed during the job "
                         f"({error_line(error)}); it stays running, and the reaper re-queues it "
                         "once its heartbeat is stale")


class DatabaseUnavailable(Exception):
    """The database failed before this delivery claimed its job: nothing was changed, so the message
    can go back to the queue (the Celery task rejects it for redelivery) instead of being lost."""

    def __init__(self, job_id: int, error: Exception):
        super().__init__(f"job {job_id}: the database failed before the job was claimed ({error_line(error)}); "
                         f"giving its message back to the queue")


@contextlib.contextmanager
def _before_the_claim(job_id: int) -> Iterator[None]:
    # unreachable, or (ProgrammingError) a missing table: an unmigrated or wrong database
    try:
        yield
    except (OperationalError, ProgrammingError) as e:
        raise DatabaseUnavailable(job_id, e) from e


def execute(job_id: int, settings: Settings, session_factory: sessionmaker[Session], publisher: Publisher, *,
            worker: str | None = None, shutdown: threading.Event | None = None,
            shares_process: bool = False) -> str | None:
    """Run one delivery of ``job_id``. Returns the job's final status, or None when there was nothing to do.
    ``shares_process``: other jobs may run in this process at the same time (``JobContext.shares_process``)."""
    worker = worker or worker_id()
    with _before_the_claim(job_id), session_factory() as session:
        kind = session.execute(select(Job.kind).where(Job.id == job_id)).scalar_one_or_none()
    if kind is None:
        log.warning("job %s does not exist; dropping its message", job_id)
        return None
    if is_parent_kind(kind):
        return aggregate(job_id, settings, session_factory, worker=worker, shutdown=shutdown,
                         shares_process=shares_process)

    with _before_the_claim(job_id):
        claimed = claim(session_factory, job_id, worker, settings=settings)
    if claimed is None:
        return None
    if isinstance(claimed, Finished):
        after_terminal(session_factory, publisher, claimed.parent_id)
        return claimed.status

    log.info("job %s (%s) attempt %s started on %s", job_id, claimed.kind, claimed.number, worker)

    def compute(params, ctx):
        if claimed.kind not in registry.RUNNERS:
            raise JobFailed(f"this worker has no function for job kind {claimed.kind!r}; run a worker of the same "
                            "lmscope version as the API", error_type="unknown-kind")
        return registry.runner_for(claimed.kind)(params, ctx)

    status = _run_attempt(claimed, settings, session_factory, compute, shutdown, shares_process=shares_process)
    if status is not None:
        log.info("job %s (%s) attempt %s %s", job_id, claimed.kind, claimed.number, status)
        after_terminal(session_factory, publisher, claimed.parent_id)
    return status


# ---------------------------------------------------------------- sweeps

def claim_aggregation(session_factory: sessionmaker[Session], parent_id: int, worker: str) -> Attempt | None:
    """Exactly once: clear ``waiting_children`` if no child is active; the one who cleared it aggregates."""
    child = aliased(Job)
    active = exists().where(child.parent_id == parent_id, child.status.in_(ACTIVE_STATES))
    now = utcnow()
    with session_factory() as session, session.begin():
        row = session.execute(
            update(Job).where(Job.id == parent_id, Job.status == "running", Job.waiting_children.is_(True), ~active)
            .values(waiting_children=False, attempts=Job.attempts + 1, worker=worker, heartbeat_at=now)
            .returning(Job.attempts, Job.kind, Job.params, Job.max_attempts)).one_or_none()
    if row is None:
        return None
    return Attempt(job_id=parent_id, number=row.attempts, worker=worker, kind=row.kind, params=dict(row.params or {}),
                   parent_id=None, max_attempts=row.max_attempts)


def child_results(session_factory: sessionmaker[Session], parent_id: int) -> list[ChildResult]:
    with session_factory() as session:
        children = session.execute(select(Job).where(Job.parent_id == parent_id).order_by(Job.id)).scalars().all()
        series: dict[int, list[SeriesData]] = {c.id: [] for c in children}
        if children:
            for s in session.execute(select(Series).where(Series.job_id.in_(list(series))).order_by(Series.id)).scalars():
                series[s.job_id].append(SeriesData(name=s.name, x=s.x, y=s.y, labels=s.labels or {}))
        return [ChildResult(job_id=c.id, kind=c.kind, params=c.params, status=c.status, summary=c.summary,
                            series=series[c.id], error=c.error_message) for c in children]


def aggregate(parent_id: int, settings: Settings, session_factory: sessionmaker[Session], *,
              worker: str | None = None, shutdown: threading.Event | None = None,
              shares_process: bool = False) -> str | None:
    """Run a sweep's aggregator once its children are all terminal (exactly once across workers)."""
    worker = worker or worker_id()
    with _before_the_claim(parent_id):
        attempt = claim_aggregation(session_factory, parent_id, worker)
    if attempt is None:
        return None  # children still active, or another worker aggregates
    children = child_results(session_factory, parent_id)
    counts = {state: sum(c.status == state for c in children) for state in TERMINAL_STATES}
    with session_factory() as session:
        cancel = session.execute(select(Job.cancel_requested).where(Job.id == parent_id)).scalar_one()
    # A cancel that cut no child short (it came as the last ones finished) leaves a complete sweep:
    # it ends as if never cancelled, as a train run's cancel that arrives with its last step does.
    cancel = cancel and counts["cancelled"] > 0
    progress = dict(progress_done=len(children), progress_total=len(children), progress_stage="children")

    def compute(params, ctx):
        return registry.aggregator_for(attempt.kind)(params, children, ctx)

    if cancel:
        progress["progress_done"] = children_done(counts, cancelled=True)  # how far the sweep got
    # The aggregation is short and its children are all done: once claimed it is not cancellable (the
    # API answers a cancel with 409 from now on), and the parent's progress stays the children's count
    # while the aggregator reports its stages (it never goes back to 0 of 1).
    run = dict(shares_process=shares_process, cancellable=False,
               fixed_progress=(progress["progress_done"], progress["progress_total"]))
    if cancel:
        if not counts["succeeded"] or attempt.number > attempt.max_attempts:
            return "cancelled" if finish(session_factory, attempt, "cancelled", summary={"children": counts},
                                         **progress) else None
        # Cancelled part-way: the children that finished are aggregated, so their results are not lost.
        status = _run_attempt(attempt, settings, session_factory, compute, shutdown,
                              final_values=dict(summary={"children": counts, "partial": True}, **progress),
                              after_cancel=True, **run)
        log.info("sweep %s cancelled; aggregated what finished: %s", parent_id, counts)
        return status
    if attempt.number > attempt.max_attempts:
        finish(session_factory, attempt, "failed", error_type="worker-lost", summary={"children": counts},
               error_message=f"the aggregation was attempted {attempt.number - 1} times without finishing", **progress)
        return "failed"

    # Whatever the outcome, the parent's summary counts its children and its progress shows them all done;
    # grid points cancelled on their own leave it partial, as a cancelled sweep is
    summary = {"children": counts, **({"partial": True} if counts["cancelled"] else {})}
    status = _run_attempt(attempt, settings, session_factory, compute, shutdown,
                          final_values=dict(summary=summary, **progress), **run)
    log.info("sweep %s aggregated: %s (%s)", parent_id, status, counts)
    return status
