"""The embedded mode: the in-process worker, SQLite under concurrent writers, restarts of `lmscope up`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import select, update

from lmscope.db.engine import make_engine, make_sessionmaker
from lmscope.db.models import Job, User, utcnow
from lmscope.queue import LocalPublisher
from lmscope.worker.embedded import EmbeddedWorker
from lmscope.worker.reaper import recover_interrupted
from tests.conftest import need_module
from tests.worker import fake_kinds
from tests.worker.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def embedded(settings, sessions):
    workers = []

    def start(threads: int = 1) -> EmbeddedWorker:
        w = EmbeddedWorker(settings, sessions, LocalPublisher(), threads=threads, poll_seconds=0.2).start()
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop(timeout=10)


def statuses(sessions, ids):
    with sessions() as s:
        return dict(s.execute(select(Job.id, Job.status).where(Job.id.in_(ids))).all())


def test_runs_queued_jobs_oldest_first_and_aggregates_sweeps(settings, sessions, make_job, job_row, embedded):
    jobs = [make_job(params={"steps": 3, "plot": False}) for _ in range(3)]
    parent = make_job(kind="fake_sweep", params={}, status="running", waiting_children=True)
    kids = [make_job(params={"steps": n, "plot": False}, parent_id=parent) for n in (2, 3)]
    before = fake_kinds.aggregate_calls
    embedded()
    wait_until(lambda: job_row(parent).status == "succeeded", timeout=30, what="the sweep")
    assert set(statuses(sessions, jobs + kids).values()) == {"succeeded"}
    started = [job_row(j).started_at for j in jobs + kids]
    assert started == sorted(started)  # oldest first
    assert job_row(parent).summary["sum"] == 3 + 6 and fake_kinds.aggregate_calls - before == 1


def test_after_a_job_left_the_gpu_unusable_no_other_job_runs_in_the_process(settings, sessions, make_job, job_row,
                                                                            embedded):
    """Every later job would fail on a broken CUDA context: they stay queued for the restart instead."""
    broken = make_job(params={"plot": False, "fail": "broken_device", "fail_at": 1})
    later = make_job(params={"steps": 2, "plot": False})
    worker = embedded()
    wait_until(lambda: job_row(broken).status == "failed", timeout=30, what="the job that breaks the device")
    wait_until(lambda: not any(t.is_alive() for t in worker._threads), timeout=10, what="the worker to stop")
    assert job_row(broken).error_type == "device-error" and "restart" in job_row(broken).error_message
    assert job_row(later).status == "queued"  # not run on the broken device, nor lost


@pytest.mark.parametrize("threads", [1, 2])
def test_a_job_knows_whether_other_jobs_share_its_process(settings, sessions, make_job, job_row, embedded, threads):
    job_id = make_job(params={"steps": 1, "plot": False, "record_shares_process": True})
    embedded(threads)
    wait_until(lambda: job_row(job_id).status == "succeeded", timeout=30, what="the job")
    assert job_row(job_id).environment["shares_process"] is (threads > 1)


def test_stop_gives_the_running_job_back_and_the_next_start_finishes_it(settings, sessions, make_job, job_row, embedded):
    job_id = make_job(params={"steps": 3000, "sleep": 0.001, "plot": False})
    first = embedded()
    wait_until(lambda: (job_row(job_id).progress_done or 0) > 0, what="progress")
    assert first.stop(timeout=10)
    job = job_row(job_id)
    assert (job.status, job.attempts, job.worker) == ("queued", 0, None)  # a clean stop costs no attempt
    embedded()
    wait_until(lambda: job_row(job_id).status == "succeeded", timeout=30, what="the job after restart")
    assert job_row(job_id).attempts == 1


def test_a_crashed_process_s_jobs_are_recovered(settings, sessions, make_job, job_row, embedded):
    job_id = make_job(status="running", attempts=1, worker="somewhere:999999", heartbeat_at=utcnow(),
                      started_at=utcnow())
    assert recover_interrupted(settings, sessions)["requeued"] == [job_id]
    embedded()
    wait_until(lambda: job_row(job_id).status == "succeeded", timeout=30, what="the recovered job")
    assert job_row(job_id).attempts == 2


def test_sqlite_api_writer_and_worker_never_see_database_locked(settings_factory, sqlite_url):
    """The API and two worker threads write the same SQLite file at once (progress at full rate)."""
    settings = settings_factory(database_url=sqlite_url, heartbeat_seconds=0.05)
    worker_engine, api_engine = make_engine(sqlite_url), make_engine(sqlite_url)  # the API has its own engine
    worker_sessions, api_sessions = make_sessionmaker(worker_engine), make_sessionmaker(api_engine)
    with api_sessions() as s, s.begin():
        user = User(name="alice")
        s.add(user)
        s.flush()
        user_id = user.id
        long = Job(user_id=user_id, kind="count", params={"steps": 2500, "sleep": 0.001, "plot": False})
        s.add(long)
        s.flush()
        long_job = long.id
    rounds = 60  # a fixed amount of writing, however fast or slow the machine: no throughput is asserted
    w = EmbeddedWorker(settings, worker_sessions, LocalPublisher(), threads=2, poll_seconds=0.05).start()
    errors, submitted = [], []
    try:
        for _ in range(rounds):  # an API-like writer: submit, flag, list
            try:
                with api_sessions() as s, s.begin():
                    job = Job(user_id=user_id, kind="count", params={"steps": 20, "plot": False}, status="queued")
                    s.add(job)
                    s.flush()
                    submitted.append(job.id)
                with api_sessions() as s, s.begin():
                    s.execute(update(Job).where(Job.id == submitted[0]).values(tags=["seen"]))
                with api_sessions() as s:
                    s.execute(select(Job).order_by(Job.id.desc()).limit(50)).scalars().all()
            except Exception as e:
                errors.append(repr(e))
            time.sleep(0.01)
        wait_until(lambda: not {"queued", "running"} & set(statuses(worker_sessions, submitted + [long_job]).values()),
                   timeout=60, what="all jobs")
        with worker_sessions() as s:
            failed = s.execute(select(Job.id, Job.error_message).where(Job.status != "succeeded")).all()
    finally:
        w.stop(timeout=10)
        worker_engine.dispose()
        api_engine.dispose()
    assert errors == []
    assert len(submitted) == rounds
    assert failed == []


# ---------------------------------------------------------------- `lmscope up` (serve) end to end

def _serve(data_dir: Path, port: int, log) -> subprocess.Popen:
    env = dict(os.environ, LMSCOPE_DATA_DIR=str(data_dir), LMSCOPE_PORT=str(port), LMSCOPE_DEVICE="cpu",
               LMSCOPE_EXTRA_KINDS="tests.worker.fake_kinds", PYTHONPATH=str(ROOT), LMSCOPE_HEARTBEAT_SECONDS="0.5")
    env.pop("LMSCOPE_BROKER_URL", None)
    env.pop("LMSCOPE_DATABASE_URL", None)
    code = "from lmscope.config import Settings; from lmscope.up import serve; serve(Settings.from_env())"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def _serving(data_dir: Path, log):
    """`lmscope up` on data_dir in its own process; yields (process, base URL) once it listens."""
    from tests.conftest import free_port, wait_for_port

    port = free_port()
    proc = _serve(data_dir, port, log)
    try:
        wait_for_port(port, timeout=60)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _http(method: str, url: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _start_long_job(base: str) -> int:
    """A `count` job that runs for a few seconds; returns once it has reported progress."""
    job = _http("POST", f"{base}/v1/jobs", {"kind": "count", "params": {"steps": 4000, "sleep": 0.001, "plot": False}})
    wait_until(lambda: (_http("GET", f"{base}/v1/jobs/{job['id']}").get("progress") or {}).get("done"),
               timeout=30, what="the long job's progress")
    return job["id"]


def test_serve_keeps_jobs_across_a_restart(tmp_path):
    need_module("flask")
    data = tmp_path / "data"
    with open(tmp_path / "serve.log", "w") as log:
        with _serving(data, log) as (proc, base):
            assert data.stat().st_mode & 0o077 == 0  # created private: one user's database and results
            done = _http("POST", f"{base}/v1/jobs", {"kind": "count", "params": {"steps": 4, "plot": False}})
            wait_until(lambda: _http("GET", f"{base}/v1/jobs/{done['id']}")["status"] == "succeeded", timeout=30,
                       what="the first job")
            long = _start_long_job(base)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        sessions = make_sessionmaker(make_engine(f"sqlite:///{data / 'lmscope.db'}"))
        with sessions() as s:
            assert s.get(Job, long).status == "queued"

        with _serving(data, log) as (_, base):
            wait_until(lambda: _http("GET", f"{base}/v1/jobs/{long}")["status"] == "succeeded", timeout=60,
                       what="the interrupted job after the restart")
        with sessions() as s:
            assert s.get(Job, long).summary["total"] == sum(range(1, 4001))


def test_after_a_device_error_up_says_on_queued_jobs_and_readyz_that_a_restart_is_needed(tmp_path):
    """Its worker stops taking jobs: a queued job's page and /readyz say why and what to do; the restart runs it."""
    need_module("flask")
    data = tmp_path / "data"
    with open(tmp_path / "serve.log", "w") as log:
        with _serving(data, log) as (_, base):
            assert _http("GET", f"{base}/readyz")["checks"]["worker"] == "ok"
            broken = _http("POST", f"{base}/v1/jobs", {"kind": "count",
                                                       "params": {"plot": False, "fail": "broken_device", "fail_at": 1}})
            wait_until(lambda: _http("GET", f"{base}/v1/jobs/{broken['id']}")["status"] == "failed", timeout=30,
                       what="the job that breaks the device")
            later = _http("POST", f"{base}/v1/jobs", {"kind": "count", "params": {"steps": 2, "plot": False}})
            queue = _http("GET", f"{base}/v1/jobs/{later['id']}")["queue"]
            assert fake_kinds.ILLEGAL_ADDRESS in queue["worker_stopped"]
            assert "restart `lmscope up`" in queue["worker_stopped"]
            with pytest.raises(urllib.error.HTTPError) as refused:
                _http("GET", f"{base}/readyz")
            problem = json.loads(refused.value.read())
            assert refused.value.code == 503 and problem["checks"]["worker"].startswith("error: the GPU is unusable")
            assert "LMSCOPE_DATABASE_URL" not in problem["detail"]  # the database is fine: not its advice
        with _serving(data, log) as (_, base):
            wait_until(lambda: _http("GET", f"{base}/v1/jobs/{later['id']}")["status"] == "succeeded", timeout=60,
                       what="the queued job after the restart")


def test_a_second_up_that_cannot_serve_leaves_running_jobs_alone(tmp_path):
    """A second `lmscope up` on a served data dir, or on a port in use, exits and re-queues nothing."""
    need_module("flask")
    from lmscope.config import Settings
    from lmscope.db.engine import upgrade
    from lmscope.up import serve
    from tests.conftest import free_port

    data = tmp_path / "data"
    with open(tmp_path / "serve.log", "w") as log, _serving(data, log) as (proc, base):
        long = _start_long_job(base)
        with pytest.raises(SystemExit, match=rf"already served by `lmscope up` \(pid {proc.pid}\)"):
            serve(Settings.from_env({"LMSCOPE_DATA_DIR": str(data)}, port=free_port()))

        # another data dir whose previous run left a job `running`, started on the busy port
        other = tmp_path / "other"
        other.mkdir()
        upgrade(f"sqlite:///{other / 'lmscope.db'}")
        other_sessions = make_sessionmaker(make_engine(f"sqlite:///{other / 'lmscope.db'}"))
        with other_sessions() as s, s.begin():
            s.add(user := User(name="bob"))
            s.flush()
            s.add(Job(user_id=user.id, kind="count", params={"plot": False}, status="running", attempts=1,
                      max_attempts=3, started_at=utcnow()))
        busy = int(base.rsplit(":", 1)[1])
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{busy}.*--port or LMSCOPE_PORT"):
            serve(Settings.from_env({"LMSCOPE_DATA_DIR": str(other)}, port=busy))
        with other_sessions() as s:
            assert tuple(s.execute(select(Job.status, Job.attempts)).one()) == ("running", 1)  # for its own `up`

        wait_until(lambda: _http("GET", f"{base}/v1/jobs/{long}")["status"] == "succeeded", timeout=60,
                   what="the first server's job")
        assert _http("GET", f"{base}/v1/jobs/{long}")["attempts"] == 1  # never taken for interrupted


def test_without_tokens_it_listens_on_loopback_only(settings_factory, tmp_path):
    from lmscope.up import serve

    with pytest.raises(SystemExit, match="LMSCOPE_AUTH=1"):
        serve(settings_factory(auth=False, host="0.0.0.0", database_url=f"sqlite:///{tmp_path / 'never.db'}"))
    assert not (tmp_path / "never.db").exists()  # refused before anything was created
