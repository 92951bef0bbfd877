"""SQLAlchemy 2 typed models. The job row is the source of truth for a job's life (DESIGN.md §2)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.types import TypeDecorator
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

JOB_STATES = ("queued", "running", "succeeded", "failed", "cancelled")
ACTIVE_STATES = ("queued", "running")
TERMINAL_STATES = ("succeeded", "failed", "cancelled")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """``DateTime(timezone=True)`` that always reads back an aware UTC datetime.

    Everything is stored in UTC; PostgreSQL returns aware values, SQLite naive ones (it keeps no zone).
    The same DDL as ``DateTime(timezone=True)``, so migrations see no change.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: UTCDateTime}


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Per-user limits; null = the server's LMSCOPE_MAX_ACTIVE_JOBS / LMSCOPE_MAX_SWEEP_POINTS.
    max_active_jobs: Mapped[int | None] = mapped_column(Integer, default=None)
    max_sweep_points: Mapped[int | None] = mapped_column(Integer, default=None)

    tokens: Mapped[list[ApiToken]] = relationship(back_populates="user", cascade="all, delete-orphan")


class ApiToken(Base):
    """Tokens are shown once; only their sha256 is stored."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]

    user: Mapped[User] = relationship(back_populates="tokens")


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("user_id", "idempotency_key", name="uq_jobs_user_idempotency_key"),
        Index("ix_jobs_user_id_id", "user_id", "id"),
        Index("ix_jobs_status", "status"),
        # the job list's filters, newest first, without walking a user's (or everyone's) whole history
        Index("ix_jobs_kind_id", "kind", "id"),
        Index("ix_jobs_user_id_kind_id", "user_id", "kind", "id"),
        Index("ix_jobs_user_id_status_id", "user_id", "status", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    kind: Mapped[str] = mapped_column(String(32))
    name: Mapped[str | None] = mapped_column(String(200))
    tags: Mapped[list[Any]] = mapped_column(default=list)
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)

    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    published_at: Mapped[datetime | None]  # when a queue message was last sent
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    # DELETE /v1/jobs/{id}: the row stays so that the id is never given again (SQLite reuses the largest
    # rowid); its series, artifacts and files are gone, and every route answers 410 for it.
    deleted_at: Mapped[datetime | None]
    worker: Mapped[str | None] = mapped_column(String(200))  # host:pid of the current attempt

    progress_done: Mapped[int | None] = mapped_column(BigInteger)
    progress_total: Mapped[int | None] = mapped_column(BigInteger)
    progress_stage: Mapped[str | None] = mapped_column(String(200))
    progress_at: Mapped[datetime | None]

    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # A sweep parent waits for its children; cleared exactly once, by whoever runs the aggregation.
    waiting_children: Mapped[bool] = mapped_column(Boolean, default=False)

    error_type: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    summary: Mapped[dict[str, Any] | None]
    environment: Mapped[dict[str, Any] | None]
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    request_hash: Mapped[str | None] = mapped_column(String(64))

    user: Mapped[User] = relationship()


def _points_of(ctx) -> int:
    try:
        return len(ctx.get_current_parameters().get("x") or [])
    except KeyError:  # SQLAlchemy cannot give a multi-VALUES insert's row to a default (insert().values([...]))
        raise ValueError("insert series rows as a list of parameters (session.execute(insert(Series), rows)) or "
                         "give each its points") from None


class Series(Base):
    """One curve of a job's results: small, queryable, plot-ready."""

    __tablename__ = "series"
    __table_args__ = (Index("ix_series_job_id_name", "job_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    x: Mapped[list[Any]] = mapped_column(default=list)
    y: Mapped[list[Any]] = mapped_column(default=list)
    # len(x), counted at insert: the size of an answer, known before any curve is loaded. NULL (a row a
    # worker of an older lmscope wrote during an upgrade, or raw SQL) is counted when read: series_points()
    points: Mapped[int | None] = mapped_column(Integer, default=_points_of)


class Artifact(Base):
    """A file in the artifact store (``<artifact_dir>/jobs/<job_id>/<name>``)."""

    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "name", name="uq_artifacts_job_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(500))
    media_type: Mapped[str] = mapped_column(String(100))
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Model(Base):
    """A model jobs can name: a built-in tiny config, a local HF directory, or a training checkpoint."""

    __tablename__ = "models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    source: Mapped[str] = mapped_column(String(16))  # builtin | directory | checkpoint
    path: Mapped[str | None] = mapped_column(Text)
    architecture: Mapped[str | None] = mapped_column(String(64))
    num_layers: Mapped[int | None]
    num_heads: Mapped[int | None]
    num_kv_heads: Mapped[int | None]
    hidden_size: Mapped[int | None]
    vocab_size: Mapped[int | None]
    num_parameters: Mapped[int | None] = mapped_column(BigInteger)
    dtype: Mapped[str | None] = mapped_column(String(16))
    info: Mapped[dict[str, Any]] = mapped_column(default=dict)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), index=True)
    step: Mapped[int | None]
    created_by: Mapped[int | None] = mapped_column(ForeignKey("users.id"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Dataset(Base):
    """A text corpus: plain text (documents separated by blank lines) or JSONL ({"text": ...})."""

    __tablename__ = "datasets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    source: Mapped[str] = mapped_column(String(16))  # builtin | upload | file (`lmscope datasets add`)
    path: Mapped[str] = mapped_column(Text)
    format: Mapped[str] = mapped_column(String(16))  # text | lines | jsonl (lmscope.catalog.DATASET_FORMATS)
    num_documents: Mapped[int] = mapped_column(Integer)
    num_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    description: Mapped[str | None] = mapped_column(Text)
    created_by: Mapped[int | None] = mapped_column(ForeignKey("users.id"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


__all__ = ["Base", "User", "ApiToken", "Job", "Series", "Artifact", "Model", "Dataset",
           "JOB_STATES", "ACTIVE_STATES", "TERMINAL_STATES", "utcnow", "Float"]
