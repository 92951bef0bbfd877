"""Shared fixtures: real PostgreSQL and Redis servers started for the test session, fresh databases.

PostgreSQL: a throwaway cluster in a temp dir (initdb + pg_ctl), run as the `postgres` user when
the tests run as root, or the server named by LMSCOPE_TEST_POSTGRES_URL. Redis: `redis-server` on a
free port with AOF on. Tests that need one skip with a reason when the binary is missing, except in
CI (CI=true), where a missing server is an error.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

# Triton kernels run on the CPU through the interpreter; it must be set before triton is imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # the API-only install has no torch
    os.environ.setdefault("TRITON_INTERPRET", "1")

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(autouse=True)
def _no_outage_carried_over():
    """What this process logged of a broker or database outage is per process: one test's outage is not
    the next test's."""
    yield
    from lmscope import queue

    queue.broker_outage.reset()
    if "lmscope.api.health" in sys.modules:
        sys.modules["lmscope.api.health"]._logged.clear()


def need(binary_ok: bool, reason: str):
    if not binary_ok:
        if IN_CI:
            pytest.fail(f"CI must provide this: {reason}")
        pytest.skip(reason)


def need_module(name: str):
    """The module a test needs: skipped where it does not import, an error in CI (unlike importorskip)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        need(False, f"{name} does not import ({e})")


def computes_attention_itself(model) -> bool:
    """Whether the model's modeling code computes attention without transformers' AttentionInterface (Falcon,
    BLOOM, GPT-Neo; GPT-J before transformers 5.24): read from that code, not from the flag lmscope reads."""
    import inspect
    import sys

    return "ALL_ATTENTION_FUNCTIONS" not in inspect.getsource(sys.modules[type(model).__module__])


def runs_through_lmscope_attention(model) -> bool:
    """Whether lmscope's attention function runs the model: its code calls transformers' AttentionInterface
    and its class declares so (``_supports_attention_backend``). Falcon's code calls the interface from
    transformers 5.25 on without declaring it: lmscope goes by the declaration and reads its attention
    matrices instead."""
    return not computes_attention_itself(model) and getattr(type(model), "_supports_attention_backend", False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


# ---------------------------------------------------------------- PostgreSQL

def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True):
        return str(candidate)
    return None


class PostgresCluster:
    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="lmscope-pg-"))
        self.as_root = os.geteuid() == 0
        try:
            self.port = free_port()
            if self.as_root:
                shutil.chown(self.dir, "postgres", "postgres")
            self._run([_pg_bin("initdb"), "-D", str(self.dir / "data"), "-U", "postgres", "-A", "trust", "--no-sync"])
            self.resume()
        except BaseException:
            # pg_ctl -w gives up waiting on a slow start and leaves the server running: stop it, if any, and
            # remove the folder; the original error is the one raised.
            with contextlib.suppress(Exception):
                self._run([_pg_bin("pg_ctl"), "-D", str(self.dir / "data"), "-m", "immediate", "stop"])
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def pause(self):
        """Stop the server (connections dropped), keeping its data: ``resume`` starts it again."""
        self._run([_pg_bin("pg_ctl"), "-D", str(self.dir / "data"), "-m", "fast", "-w", "stop"])

    def resume(self):
        self._run([_pg_bin("pg_ctl"), "-D", str(self.dir / "data"), "-l", str(self.dir / "log"), "-w", "start",
                   "-o", f"-p {self.port} -k {self.dir} -h 127.0.0.1 -F -c max_connections=200"])

    def _run(self, argv):
        if self.as_root:
            argv = ["runuser", "-u", "postgres", "--"] + argv
        subprocess.run(argv, check=True, capture_output=True)

    def stop(self):
        try:
            self._run([_pg_bin("pg_ctl"), "-D", str(self.dir / "data"), "-m", "immediate", "stop"])
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server_url():
    """URL of the maintenance database of a PostgreSQL server for this test session."""
    url = os.environ.get("LMSCOPE_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    need(_pg_bin("initdb") is not None and _pg_bin("pg_ctl") is not None, "PostgreSQL (initdb, pg_ctl) not installed")
    cluster = PostgresCluster()
    try:
        yield cluster.url
    finally:
        cluster.stop()


_db_counter = itertools.count()


@pytest.fixture
def postgres_url(postgres_server_url):
    """A fresh, migrated PostgreSQL database for one test."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from lmscope.db.engine import upgrade

    name = f"t{os.getpid()}_{next(_db_counter)}"
    admin = create_engine(postgres_server_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f"CREATE DATABASE {name}"))
        try:
            url = make_url(postgres_server_url).set(database=name).render_as_string(hide_password=False)
            upgrade(url)  # a failed migration must not leave the database behind
            yield url
        finally:
            with admin.connect() as c:
                c.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    finally:
        admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path):
    """A fresh, migrated SQLite database file for one test."""
    from lmscope.db.engine import upgrade

    url = f"sqlite:///{tmp_path / 'lmscope.db'}"
    upgrade(url)
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request):
    """The same test against SQLite and against PostgreSQL."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def device():
    """Where kernels and analyses run: the GPU when there is one (compiled Triton kernels), else the CPU
    (Triton through the interpreter). The tests compare results on the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- Redis

class RedisServer:
    """A real redis-server with AOF on; `restart()` keeps its data directory."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.port = free_port()
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self):
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "noeviction",
             "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(self.port)
        except BaseException:  # it never listened: do not leave it running
            self.proc.kill()
            self.proc.wait(timeout=20)
            raise

    def stop(self, sig=signal.SIGTERM):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=20)

    def restart(self):
        self.stop()
        self.start()


@pytest.fixture
def redis_server(tmp_path):
    need(shutil.which("redis-server") is not None, "redis-server not installed (apt-get install redis-server)")
    d = tmp_path / "redis"
    d.mkdir()
    server = RedisServer(d)
    yield server
    server.stop(signal.SIGKILL)


# ---------------------------------------------------------------- settings

@pytest.fixture
def settings_factory(tmp_path):
    """Settings pointing at temp dirs; pass overrides (database_url=..., broker_url=...)."""
    from lmscope.config import Settings

    def make(**overrides):
        env = {"LMSCOPE_DATA_DIR": str(tmp_path / "data")}
        return Settings.from_env(env, **overrides)

    return make


# ---------------------------------------------------------------- a real `lmscope up`

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def running_lmscope_up(folder: Path) -> Iterator[dict[str, str]]:
    """`lmscope up` in its own process with its data under `folder`; yields its environment (LMSCOPE_URL, ...)."""
    import requests

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSCOPE_")}
    env.update(LMSCOPE_DATA_DIR=str(folder / "data"), LMSCOPE_PORT=str(port), LMSCOPE_AUTH="0",
               LMSCOPE_URL=f"http://127.0.0.1:{port}", PYTHONPATH=str(ROOT))
    log = open(folder / "up.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "lmscope.cli", "up"], env=env, cwd=ROOT, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{env['LMSCOPE_URL']}/readyz", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None, (folder / "up.log").read_text()
            assert time.monotonic() < deadline, "lmscope up did not become ready"
            time.sleep(0.2)
        yield env
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture
def lmscope_up(tmp_path):
    """`lmscope up` in its own process: the embedded API + worker on SQLite, real jobs on tiny-gpt2."""
    with running_lmscope_up(tmp_path) as env:
        yield env


