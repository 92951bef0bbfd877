"""The JobContext an analysis gets inside a worker (protocol: ``lmscope.analyses.base.JobContext``).

Progress is written at most ``PROGRESS_WRITES_PER_SECOND`` times a second (the last report, where
``done == total``, always), and the same write reads ``cancel_requested`` back, so a cancel is seen
at the next batch boundary without extra queries. Every database access is a short transaction of
its own: nothing is held open while the analysis computes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from lmscope.analyses.base import JobCancelled, JobFailed, LoadedModel
from lmscope.catalog import config_facts, parse_documents, safetensors_parameter_count, sha256_bytes
from lmscope.db.models import Dataset, Job, Model, utcnow
from lmscope.worker.attempt import Attempt, AttemptLost, Heartbeat, OutageLog, WorkerShutdown, through_outage

PROGRESS_WRITES_PER_SECOND = 4
MODEL_CACHE_CAPACITY = 2

log = logging.getLogger("lmscope.worker")

_model_cache = None
_model_cache_lock = threading.Lock()


def model_cache():
    """The process-wide ``ModelCache``: consecutive jobs on the same model load it once."""
    global _model_cache
    with _model_cache_lock:
        if _model_cache is None:
            from lmscope.modeling.loading import ModelCache  # torch: only where a job needs a model

            _model_cache = ModelCache(MODEL_CACHE_CAPACITY)
        return _model_cache


def shown_stage(name: str) -> str:
    """A stage's timing key as its progress shows it: "load_model" → "load model"."""
    return name.replace("_", " ")


class WorkerContext:
    def __init__(self, attempt: Attempt, session_factory: sessionmaker[Session], artifact_dir: Path, device: str,
                 *, heartbeat: Heartbeat | None = None, shutdown: threading.Event | None = None,
                 deadline: float | None = None, time_limit_setting: str = "LMSCOPE_TASK_TIME_LIMIT",
                 shares_process: bool = False, cancellable: bool = True,
                 fixed_progress: tuple[int, int] | None = None):
        self.job_id = attempt.job_id
        self.attempt = attempt.number
        self.artifact_dir = Path(artifact_dir)
        self.device = device
        # True only in an embedded worker with several threads; a Celery prefork child runs one job at a time.
        self.shares_process = shares_process
        self.environment: dict[str, Any] = {}
        self.timings: dict[str, float] = {}
        self.last_progress: tuple[int, int | None, str | None] | None = None
        self._attempt = attempt
        self._sf = session_factory
        self._heartbeat = heartbeat
        self._shutdown = shutdown
        self._deadline = deadline  # time.monotonic() after which the attempt fails (time limit)
        self._time_limit_setting = time_limit_setting  # "LMSCOPE_TASK_TIME_LIMIT=… s", for the message
        self._interval = 1.0 / PROGRESS_WRITES_PER_SECOND
        self._last_write = float("-inf")  # monotonic time of the last progress write / cancel read
        self._written: tuple[int, int | None, str | None] | None = None
        self._cancel_requested = False
        self._progress_outage = OutageLog(f"progress write of job {attempt.job_id}")
        self._cancel_outage = OutageLog(f"cancel check of job {attempt.job_id}")
        # False: a cancel does not stop the work (a sweep's aggregation: short, and what a cancel leaves to do)
        self._cancellable = cancellable
        # (done, total) that progress reports keep (a sweep parent aggregating: its children's count); they
        # then change only the stage, so the parent's progress never goes backwards
        self._fixed_progress = fixed_progress
        self._stages: list[str] = []
        self._announced: set[str] = set()  # the stages said at once (each the first time it began)
        self._model_lock: threading.Lock | None = None  # the model this job runs, with shares_process

    # ------------------------------------------------------------ progress and cancel

    def progress(self, done: int, total: int, stage: str | None = None) -> None:
        stage = stage if stage is not None else (shown_stage(self._stages[-1]) if self._stages else None)
        final = total is not None and done >= total
        if self._fixed_progress is not None:
            done, total = self._fixed_progress
        self.last_progress = (int(done), None if total is None else int(total), stage)  # None: a stage's start
        if final or time.monotonic() - self._last_write >= self._interval:
            self.flush_progress()
        self.check_cancelled()

    def _announce(self, stage: str) -> None:
        """A stage begun the first time is said at once, with the count so far: loading a model or a first
        batch can take a minute, and a job that shows no progress at all looks stuck. A stage entered again
        (norms enters "forward" and "inner loss" every batch) is throttled like any report."""
        done, total, _ = self.last_progress or (0, None, None)
        if self._fixed_progress is not None:
            done, total = self._fixed_progress
        self.last_progress = (done, total, shown_stage(stage))
        if stage in self._announced:
            if time.monotonic() - self._last_write >= self._interval:
                self.flush_progress()
            return
        self._announced.add(stage)
        self.flush_progress()
        self._last_write = float("-inf")  # the stage's first count is written at once too

    def flush_progress(self) -> None:
        """Write the latest progress now (if it changed); also reads the cancel flag."""
        if self.last_progress is None or self.last_progress == self._written:
            return
        done, total, stage = self.last_progress
        values = dict(progress_done=done, progress_total=total, progress_at=utcnow())
        if stage is not None:
            values["progress_stage"] = stage[:200]
        self._last_write = time.monotonic()
        try:
            with self._sf() as session, session.begin():
                row = session.execute(update(Job).where(self._attempt.owned()).values(**values)
                                      .returning(Job.cancel_requested)).one_or_none()
        except SQLAlchemyError as e:  # keep computing through a database blip; the next write retries
            self._progress_outage.failed(e)
            return
        self._progress_outage.worked()
        if row is None:
            raise AttemptLost(self.job_id)
        self._written = self.last_progress
        self._cancel_requested = self._cancel_requested or row.cancel_requested

    def check_cancelled(self) -> None:
        if self._shutdown is not None and self._shutdown.is_set():
            raise WorkerShutdown()
        if self._heartbeat is not None:
            if self._heartbeat.lost:
                raise AttemptLost(self.job_id)
            self._cancel_requested = self._cancel_requested or self._heartbeat.cancel_requested
        if not self._cancel_requested and time.monotonic() - self._last_write >= self._interval:
            self._last_write = time.monotonic()
            self._read_cancel_flag()
        if self._cancel_requested and self._cancellable:
            raise JobCancelled()
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise JobFailed(f"the job ran past its time limit ({self._time_limit_setting}; it stops at "
                            "its last progress report before the limit); use smaller parameters or ask an operator "
                            "to raise the limit", error_type="time-limit")

    def _read_cancel_flag(self) -> None:
        try:
            with self._sf() as session, session.begin():
                row = session.execute(select(Job.cancel_requested).where(self._attempt.owned())).one_or_none()
        except SQLAlchemyError as e:
            self._cancel_outage.failed(e)
            return
        self._cancel_outage.worked()
        if row is None:
            raise AttemptLost(self.job_id)
        self._cancel_requested = bool(row.cancel_requested)

    @contextmanager
    def stage(self, name: str, *, announce: bool = True) -> Iterator[None]:
        """Time what runs inside as `name` (the environment's timings); `announce`: also show it as the job's
        progress stage at once (the runner's own "total" is only timed)."""
        start = time.perf_counter()
        self._stages.append(name)
        if announce:
            self._announce(name)
        try:
            yield
        finally:
            self._stages.pop()
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start

    def record(self, key: str, value: Any) -> None:
        self.environment[key] = value

    # ------------------------------------------------------------ models and data

    def _read(self, what: str, statement, *, one: bool = False):
        """The rows of `statement` (its one row or None with `one`), waiting through a database outage."""
        def read():
            with self._sf() as session:
                result = session.execute(statement)
                return result.one_or_none() if one else result.all()

        return through_outage(f"{what} of job {self.job_id}", read, stop=self._shutdown)

    def _model_row(self, name: str):
        """(the model's row, its path on this worker)."""
        row = self._read("model lookup", select(Model.name, Model.source, Model.path, Model.job_id)
                         .where(Model.name == name), one=True)
        if row is None:
            raise JobFailed(f"model {name!r} is not registered; list models with GET /v1/models or register a "
                            "Hugging Face directory with POST /v1/models", error_type="unknown-model")
        path = row.path
        if row.source == "checkpoint" and path and not Path(path).is_absolute():
            path = str(self.artifact_root / path)  # stored relative to the artifact store (see register_model)
        return row, path

    def load_tokenizer(self, name: str):
        from lmscope.modeling.loading import ModelLoadError, load_tokenizer

        row, path = self._model_row(name)
        try:
            tokenizer = load_tokenizer(row.source, path)
        except (ModelLoadError, OSError, ValueError) as e:
            raise JobFailed(f"the tokenizer of model {name!r} cannot be loaded: {e}", error_type="model-load") from None
        record = {"source": row.source, "tokenizer_only": True}
        if row.source != "builtin":
            record.update(path=row.path, **({"job_id": row.job_id} if row.job_id is not None else {}))
        self.environment.setdefault("models", {})[name] = record
        return tokenizer

    def load_model(self, name: str, *, dtype: str = "float32") -> LoadedModel:
        row, path = self._model_row(name)
        cache = model_cache()
        from lmscope.modeling.loading import ModelLoadError

        if self.shares_process:
            self._use_model(cache.use_lock(row.name, dtype=dtype, device=self.device), name)

        try:
            loaded = cache.get(row.name, row.source, path, dtype=dtype, device=self.device)
        except ModelLoadError as e:  # a broken directory is the user's to fix, not a worker bug
            raise JobFailed(f"model {name!r} cannot be loaded: {e}", error_type="model-load") from None
        record = {"source": row.source, "dtype": dtype}
        if row.source != "builtin":  # which weights: a name freed and used again names others later
            record.update(path=row.path, **({"job_id": row.job_id} if row.job_id is not None else {}))
        self.environment.setdefault("models", {})[name] = record
        count = loaded.info.get("num_parameters")
        if count:  # a directory with only *.bin weights is registered without a count: known once loaded
            try:
                with self._sf() as session, session.begin():
                    session.execute(update(Model).where(Model.name == name, Model.num_parameters.is_(None))
                                    .values(num_parameters=int(count)))
            except SQLAlchemyError as e:  # a catalogue detail: the job needs the model, not the count
                log.warning("model %r: could not record its parameter count: %s", name, e)
        return loaded

    def _use_model(self, lock: threading.Lock, name: str) -> None:
        """Hold the model's lock for the rest of the job (or until it loads its next model): the analyses hook
        the cached model and switch its attention, which another job running it in this process would see.
        While another job holds it, wait, saying so, and still stop for a cancel or a shutdown."""
        self.release_model()
        if lock.acquire(blocking=False):
            self._model_lock = lock
            return
        before, deadline, start = self.last_progress, self._deadline, time.monotonic()
        self._deadline = None  # the time limit is the job's own work: the wait does not count against it
        done, total = before[:2] if before else (0, 1)
        self.progress(done, total, f"waiting for model {name}: another job in this worker is running it")
        while not lock.acquire(timeout=0.5):
            self.check_cancelled()
        self._model_lock = lock
        self._deadline = None if deadline is None else deadline + time.monotonic() - start
        self.last_progress = before  # the job's own stage again ("load model"), not the wait, while it loads
        self.flush_progress()

    def release_model(self) -> None:
        """Let other jobs in this process run the model this job loaded last (the runner calls it at the end)."""
        lock, self._model_lock = self._model_lock, None
        if lock is not None:
            lock.release()

    def load_documents(self, dataset: str) -> list[str]:
        row = self._read("dataset lookup", select(Dataset.path, Dataset.format, Dataset.sha256)
                         .where(Dataset.name == dataset), one=True)
        if row is None:
            raise JobFailed(f"dataset {dataset!r} is not registered; list datasets with GET /v1/datasets or "
                            "upload one with POST /v1/datasets", error_type="unknown-dataset")
        path = Path(row.path)
        if not path.is_file():
            raise JobFailed(f"dataset {dataset!r}: its file {path} is missing on this worker; mount the data "
                            "directory into the worker or upload the dataset again", error_type="dataset-missing")
        data = path.read_bytes()
        # the provenance is the bytes read: a file registered in place (`datasets add`) can change later
        record = {"sha256": sha256_bytes(data)}
        if record["sha256"] != row.sha256:
            record["registered_sha256"] = row.sha256
            log.warning("dataset %r: %s changed since it was registered (sha256 %s, registered %s)",
                        dataset, path, record["sha256"][:12], row.sha256[:12])
        self.environment.setdefault("datasets", {})[dataset] = record
        return parse_documents(data, row.format)

    @property
    def artifact_root(self) -> Path:
        """The artifact store (this job's folder is ``Settings.job_dir``: ``<root>/jobs/<job id>``)."""
        return self.artifact_dir.parent.parent

    def register_model(self, name: str, path: Path, *, step: int | None = None) -> None:
        path = Path(path).resolve()
        # Inside the artifact store the path is kept relative to it, so the store can be moved or
        # mounted elsewhere (another data directory, another container path) without breaking models.
        root = self.artifact_root.resolve()
        stored = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise JobFailed(f"cannot register {name!r}: {path}/config.json is missing or not JSON ({e})",
                            error_type="invalid-checkpoint") from None
        facts = config_facts(config)
        weights = sorted(path.glob("*.safetensors"))
        values = dict(
            source="checkpoint", path=stored, architecture=facts.architecture, num_layers=facts.num_layers,
            num_heads=facts.num_heads, num_kv_heads=facts.num_kv_heads, hidden_size=facts.hidden_size,
            vocab_size=facts.vocab_size, dtype=facts.dtype, info=facts.info, job_id=self.job_id, step=step,
            num_parameters=sum(safetensors_parameter_count(w) for w in weights) if weights else None,
        )

        def upsert() -> None:
            with self._sf() as session, session.begin():
                # An attempt the reaper has given up on (or whose job was then deleted) registers nothing: a
                # model row would point at files that a later attempt rewrites, or that a delete removed.
                if session.execute(select(Job.id).where(self._attempt.owned()).with_for_update()).first() is None:
                    raise AttemptLost(self.job_id)
                row = session.execute(select(Model).where(Model.name == name)).scalar_one_or_none()
                if row is None:
                    session.add(Model(name=name, **values))
                elif row.source != "checkpoint" or (row.job_id not in (None, self.job_id)):
                    raise JobFailed(f"model name {name!r} is already taken by another model; choose another "
                                    "run name", error_type="name-taken")
                else:
                    for key, value in values.items():
                        setattr(row, key, value)

        for _ in range(2):  # a concurrent insert of the same name: the second round updates it
            try:
                through_outage(f"checkpoint registration of job {self.job_id}", upsert, stop=self._shutdown)
                break
            except IntegrityError:
                continue
        if _model_cache is not None:  # a retried train job may rewrite a checkpoint under the same name
            _model_cache.forget(name)

    def checkpoints_of(self, train_job_id: int) -> list[tuple[int, str]]:
        rows = self._read("checkpoint lookup", select(Model.step, Model.name)
                          .where(Model.job_id == train_job_id, Model.source == "checkpoint")
                          .order_by(Model.step, Model.id))
        return [(int(r.step if r.step is not None else 0), r.name) for r in rows]
