"""Settings, read once from environment variables (the only configuration surface).

Every variable is documented in README.md ("Configuration"); docker-compose.yml sets a subset and a
test checks that it sets only names listed in ``ENV_VARS``.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WIKITEXT2_CANDIDATES = [REPO_ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw",
                        REPO_ROOT / "data" / "wikitext-2-raw" / "wiki.test.raw"]

ENV_VARS = {
    "LMSCOPE_DATA_DIR": "where the embedded database, artifacts and uploads live (default ~/.lmscope)",
    "LMSCOPE_DATABASE_URL": "SQLAlchemy URL (default sqlite:///$LMSCOPE_DATA_DIR/lmscope.db)",
    "LMSCOPE_BROKER_URL": "Celery broker, e.g. redis://redis:6379/0; unset = embedded in-process queue",
    "LMSCOPE_ARTIFACT_DIR": "artifact store directory (default $LMSCOPE_DATA_DIR/artifacts)",
    "LMSCOPE_MODEL_DIRS": "os.pathsep-separated roots under which model directories may be registered",
    "LMSCOPE_AUTH": "1 = bearer tokens required, 0 = single-user mode (also true/false, yes/no, on/off; default: 1 when LMSCOPE_BROKER_URL is set, else 0)",
    "LMSCOPE_MAX_ACTIVE_JOBS": "per-user quota of queued+running jobs (default 20; `lmscope user limits` sets one user's own)",
    "LMSCOPE_MAX_UPLOAD_BYTES": "largest dataset upload accepted (default 64 MiB)",
    "LMSCOPE_MAX_UPLOADED_BYTES_PER_USER": "total size of one user's uploaded datasets (default 1 GiB; deleting one frees its share)",
    "LMSCOPE_MAX_SWEEP_POINTS": "largest sweep grid a user may submit (default 256; `lmscope user limits` sets one user's own)",
    "LMSCOPE_MAX_EVENT_STREAMS": "event streams (GET /v1/jobs/{id}/events) one API process keeps open at once, all users together (default 8; each holds a server thread: keep it below gunicorn's --threads)",
    "LMSCOPE_MAX_EVENT_STREAMS_PER_USER": "event streams one user may keep open at once in one API process (default 4)",
    "LMSCOPE_MAX_ATTEMPTS": "attempts before a job is failed for good (default 3)",
    "LMSCOPE_HEARTBEAT_SECONDS": "how often a running job refreshes its heartbeat (default 5)",
    "LMSCOPE_STALE_AFTER_SECONDS": "heartbeat age after which the reaper re-enqueues a job (default 60; at least 4 heartbeats, else lmscope refuses to start)",
    "LMSCOPE_UNPUBLISHED_AFTER_SECONDS": "age of a never-published queued job before the reaper publishes it (default 30)",
    "LMSCOPE_TASK_TIME_LIMIT": "hard time limit of one job attempt in seconds (default 21600)",
    "LMSCOPE_WIKITEXT2_PATH": "WikiText-2 raw test file registered as dataset 'wikitext-2' (default ../shared/data/..., else data/...)",
    "LMSCOPE_KERNEL_BACKEND": "force the attention kernel backend: triton or reference (default: Triton on CUDA, the reference elsewhere)",
    "LMSCOPE_AUTOTUNE": "0 = Triton kernels launch their first candidate tile instead of autotuning (one compile per shape: GPU test runs); default 1 (on; also true/false, yes/no, on/off); anything else fails the job that launches a kernel",
    "LMSCOPE_DEVICE": "torch device for workers: cpu, cuda or cuda:N (default cuda if available else cpu)",
    "LMSCOPE_ALLOWED_HOSTS": "comma-separated host names a server without authentication answers to besides IP addresses and localhost (e.g. gpubox); other names are refused, so a web page cannot reach it through DNS rebinding",
    "LMSCOPE_HOST": "address `lmscope up` binds (default 127.0.0.1; gunicorn takes its own --bind)",
    "LMSCOPE_PORT": "port `lmscope up` listens on (default 8765)",
    "LMSCOPE_URL": "where the client and CLI find the API (default http://127.0.0.1:$LMSCOPE_PORT, or :8765)",
    "LMSCOPE_TOKEN": "bearer token the client and CLI send",
    "LMSCOPE_EXTRA_KINDS": "test hook: a module each worker imports and calls register() on (extra job kinds)",
}


# LMSCOPE_* names lmscope's own tooling reads that are no setting of the service (the tests' PostgreSQL server).
TOOLING_VARS = {"LMSCOPE_TEST_POSTGRES_URL"}


def unknown_variables(env=None) -> list[str]:
    """One line per LMSCOPE_* variable lmscope does not read (LMSCOPE_HOME, LMSCOPE_DATADIR), which would
    otherwise be ignored without a word: the setting it was meant for keeps its default."""
    import difflib

    env = os.environ if env is None else env
    settings = {name.removeprefix("LMSCOPE_"): name for name in ENV_VARS}
    lines = []
    for name in sorted(env):
        if not name.startswith("LMSCOPE_") or name in ENV_VARS or name in TOOLING_VARS:
            continue
        close = difflib.get_close_matches(name.removeprefix("LMSCOPE_").upper(), settings, n=1, cutoff=0.8)
        hint = f"did you mean {settings[close[0]]}? " if close else ""
        lines.append(f"{name} is not a setting lmscope reads, so it is ignored ({hint}README.md's Configuration "
                     "lists them)")
    return lines


# A job is stale (its worker lost) once its heartbeat is this many heartbeats old, at the least.
STALE_HEARTBEATS = 4


class ConfigError(ValueError):
    """An environment variable holds a value lmscope cannot use; the message names it and what to write."""


def _number(env, name, default, kind, positive=True):
    """A count, a size or a duration: a finite number above 0 (``positive``)."""
    raw = env.get(name)
    if raw is None:
        return default
    what = "a whole number" if kind is int else "a number"
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not {what}; write e.g. {name}={default} (the default)") from None
    if positive and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}={raw!r} must be {what} above 0; write e.g. {name}={default} (the default)")
    return value


def _int(env, name, default, positive=True):
    return _number(env, name, default, int, positive)


def _float(env, name, default):
    return _number(env, name, default, float)


def time_limits(hard: int) -> tuple[int, float]:
    """(Celery's soft limit, the job's own deadline) in seconds for a hard limit of ``hard`` seconds.

    The job checks its deadline at every progress report and stops there, cleanly (a train run keeps
    its curves); Celery's soft limit, a little later, interrupts it wherever it is; the hard limit kills
    the process."""
    margin = max(1, min(60, hard // 20))
    return max(1, hard - margin), max(0.5, hard - 2 * margin)


TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

KERNEL_BACKENDS = ("triton", "reference")


def forced_kernel_backend(env) -> str | None:
    """``LMSCOPE_KERNEL_BACKEND`` (triton or reference, any case), None when unset or empty."""
    raw = env.get("LMSCOPE_KERNEL_BACKEND")
    if raw is None or not raw.strip():
        return None
    value = raw.strip().lower()
    if value not in KERNEL_BACKENDS:
        raise ConfigError(f"LMSCOPE_KERNEL_BACKEND={raw!r} is not a kernel backend; write "
                          f"LMSCOPE_KERNEL_BACKEND={' or '.join(KERNEL_BACKENDS)}, or leave it unset (Triton on "
                          "CUDA, the reference elsewhere)")
    return value


def forced_device(env) -> str | None:
    """``LMSCOPE_DEVICE`` (cpu, cuda or cuda:N; also mps and xpu, which torch runs but lmscope's tests do
    not), None when unset or empty. Checked here rather than left to torch, which would fail every job
    with its own message and not name the variable."""
    raw = env.get("LMSCOPE_DEVICE")
    if raw is None or not raw.strip():
        return None
    value = raw.strip().lower()
    if not re.fullmatch(r"cpu|(cuda|xpu|mps)(:(0|[1-9]\d*))?", value):
        raise ConfigError(f"LMSCOPE_DEVICE={raw!r} is not a device lmscope runs on; write LMSCOPE_DEVICE=cpu, "
                          "LMSCOPE_DEVICE=cuda or LMSCOPE_DEVICE=cuda:N (the Nth GPU), or leave it unset (cuda when "
                          "available, else cpu)")
    return value


def on_off(env, name, default: bool) -> bool:
    """1/true/yes/on or 0/false/no/off (any case; unset or empty: ``default``); anything else is refused
    rather than guessed."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    word = raw.strip().lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise ConfigError(f"{name}={raw!r} is neither on nor off; write {name}=1 (on) or {name}=0 (off)")


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    database_url: str
    broker_url: str | None
    artifact_dir: Path
    model_dirs: list[Path] = field(default_factory=list)
    auth: bool = True
    max_active_jobs: int = 20
    max_upload_bytes: int = 64 * 1024 * 1024
    max_uploaded_bytes_per_user: int = 1024 ** 3
    max_sweep_points: int = 256
    max_event_streams: int = 8
    max_event_streams_per_user: int = 4
    max_attempts: int = 3
    heartbeat_seconds: float = 5.0
    stale_after_seconds: float = 60.0
    unpublished_after_seconds: float = 30.0
    task_time_limit: int = 21600
    wikitext2_path: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8765
    allowed_hosts: tuple[str, ...] = ()

    @property
    def embedded(self) -> bool:
        """No broker configured: the API and a worker thread share one process."""
        return not self.broker_url

    def job_dir(self, job_id: int) -> Path:
        """Where a job's artifacts live (the API serves them, the worker writes them)."""
        return Path(self.artifact_dir) / "jobs" / str(job_id)

    @property
    def time_limit_setting(self) -> str:
        """The limit as messages name it, with its value: "LMSCOPE_TASK_TIME_LIMIT=21600 s"."""
        return f"LMSCOPE_TASK_TIME_LIMIT={self.task_time_limit} s"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> "Settings":
        # An empty variable is an unset one (LMSCOPE_DATA_DIR= would otherwise mean the working directory)
        env = {k: v for k, v in (os.environ if env is None else env).items() if v.strip() != ""}
        # Absolute, so that a relative LMSCOPE_DATA_DIR means the same folder to every component
        # (Flask's send_file, for one, resolves relative paths against the package, not the cwd).
        data_dir = Path(env.get("LMSCOPE_DATA_DIR", Path.home() / ".lmscope")).expanduser().absolute()
        broker = env.get("LMSCOPE_BROKER_URL") or None
        wikitext = env.get("LMSCOPE_WIKITEXT2_PATH")
        # The team's shared copy beside the checkout, else the copy bundled in the repository (data/).
        default_wikitext = next((p for p in WIKITEXT2_CANDIDATES if p.is_file()), None)
        values = dict(
            data_dir=data_dir,
            database_url=env.get("LMSCOPE_DATABASE_URL", f"sqlite:///{data_dir / 'lmscope.db'}"),
            broker_url=broker,
            artifact_dir=Path(env.get("LMSCOPE_ARTIFACT_DIR", data_dir / "artifacts")).expanduser().absolute(),
            model_dirs=[Path(p).expanduser().absolute() for p in env.get("LMSCOPE_MODEL_DIRS", "").split(os.pathsep) if p],
            auth=on_off(env, "LMSCOPE_AUTH", default=bool(broker)),
            max_active_jobs=_int(env, "LMSCOPE_MAX_ACTIVE_JOBS", 20),
            max_upload_bytes=_int(env, "LMSCOPE_MAX_UPLOAD_BYTES", 64 * 1024 * 1024),
            max_uploaded_bytes_per_user=_int(env, "LMSCOPE_MAX_UPLOADED_BYTES_PER_USER", 1024 ** 3),
            max_sweep_points=_int(env, "LMSCOPE_MAX_SWEEP_POINTS", 256),
            max_event_streams=_int(env, "LMSCOPE_MAX_EVENT_STREAMS", 8),
            max_event_streams_per_user=_int(env, "LMSCOPE_MAX_EVENT_STREAMS_PER_USER", 4),
            max_attempts=_int(env, "LMSCOPE_MAX_ATTEMPTS", 3),
            heartbeat_seconds=_float(env, "LMSCOPE_HEARTBEAT_SECONDS", 5.0),
            stale_after_seconds=_float(env, "LMSCOPE_STALE_AFTER_SECONDS", 60.0),
            unpublished_after_seconds=_float(env, "LMSCOPE_UNPUBLISHED_AFTER_SECONDS", 30.0),
            task_time_limit=_int(env, "LMSCOPE_TASK_TIME_LIMIT", 21600),
            wikitext2_path=Path(wikitext) if wikitext else default_wikitext,
            host=env.get("LMSCOPE_HOST", "127.0.0.1"),
            port=_int(env, "LMSCOPE_PORT", 8765, positive=False),  # 0: a free port; `lmscope up` checks the range
            allowed_hosts=tuple(h.strip().lower() for h in env.get("LMSCOPE_ALLOWED_HOSTS", "").split(",") if h.strip()),
        )
        values.update(overrides)
        forced_kernel_backend(env)  # not kept: the worker reads them where it runs a job; checked so that a
        forced_device(env)          # misspelt value stops the command rather than failing every job
        heartbeat, stale = values["heartbeat_seconds"], values["stale_after_seconds"]
        if stale < STALE_HEARTBEATS * heartbeat:
            # else the reaper takes a healthy job for lost between two of its heartbeats, re-queues it, and after
            # LMSCOPE_MAX_ATTEMPTS fails it as worker-lost
            raise ConfigError(
                f"LMSCOPE_STALE_AFTER_SECONDS={stale:g} is less than {STALE_HEARTBEATS} heartbeats "
                f"(LMSCOPE_HEARTBEAT_SECONDS={heartbeat:g}): a running job would be taken for lost between its "
                f"heartbeats; write e.g. LMSCOPE_STALE_AFTER_SECONDS={STALE_HEARTBEATS * heartbeat:g}, or a shorter "
                "LMSCOPE_HEARTBEAT_SECONDS")
        return cls(**values)
