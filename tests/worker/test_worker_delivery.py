"""Delivery with real parts: a redis-server (AOF on) and a Celery worker subprocess, on SQLite and PostgreSQL.

(a) a job submitted over HTTP runs and its results are readable over HTTP (and a running job is
cancelled over HTTP); (b) SIGKILL of the worker's child mid-job → retried,
one set of results, attempts == 2; (c) a message that was never sent → the reaper publishes it;
(d) Redis restarted with a job queued and no worker running → the job still runs; (e) a worker refuses to
start on an unmigrated database; (f) a delivery that finds the database failing gives its message back;
(g) a reaper that dies is started again; (h) the job's own deadline fires before Celery's soft limit;
(i) a job in a call the soft limit cannot interrupt, killed by the hard limit, fails with time-limit and
is not retried; (j) a child killed on its last attempt fails at once, with its files listed; (k) a job that
leaves the GPU unusable ends its pool child, and the next job runs in a fresh one; (l) a sweep's aggregation
is taken ahead of the jobs queued behind its children.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update
from sqlalchemy.engine import make_url

from lmscope.db.models import Artifact, Job, Series, utcnow
from lmscope.queue import CeleryPublisher, publish_jobs
from tests.worker.helpers import wait_until

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


class CeleryWorker:
    """``celery -A lmscope.worker.celery_app worker -c 1 -P prefork -Q lmscope ...`` in its own process group."""

    def __init__(self, env: dict[str, str], log_path: Path):
        self.log_path = log_path
        self.log = open(log_path, "a")
        argv = [sys.executable, "-m", "celery", "-A", "lmscope.worker.celery_app", "worker", "-c", "1", "-P", "prefork",
                "-Q", "lmscope", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"]
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the worker exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            return " ready." in self.log_path.read_text()

        wait_until(ready, timeout=timeout, interval=0.1, what="the Celery worker to be ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture
def delivery(db_url, redis_server, tmp_path, settings_factory):
    """Settings shared by this test process and its worker subprocess; ``start()`` starts a worker."""
    env = dict(os.environ, LMSCOPE_BROKER_URL=redis_server.url, LMSCOPE_DATABASE_URL=db_url,
               LMSCOPE_DATA_DIR=str(tmp_path / "data"), LMSCOPE_EXTRA_KINDS="tests.worker.fake_kinds",
               PYTHONPATH=str(ROOT), LMSCOPE_DEVICE="cpu", LMSCOPE_HEARTBEAT_SECONDS="0.5",
               LMSCOPE_STALE_AFTER_SECONDS="5", LMSCOPE_UNPUBLISHED_AFTER_SECONDS="1", LMSCOPE_TASK_TIME_LIMIT="120")
    settings = settings_factory(database_url=db_url, broker_url=redis_server.url)
    workers: list[CeleryWorker] = []

    class Delivery:
        publisher = CeleryPublisher(settings=settings)

        @staticmethod
        def start() -> CeleryWorker:
            w = CeleryWorker(env, tmp_path / "worker.log")
            workers.append(w)
            w.wait_ready()
            return w

    Delivery.settings = settings
    Delivery.env = env
    yield Delivery
    for w in workers:
        w.stop()


def wait_for_status(job_row, job_id, status="succeeded", timeout=60.0, worker_log: Path | None = None):
    """Wait for the job's status; on a timeout, say where the job stands and what the worker logged."""
    def done():
        job = job_row(job_id)
        if job.status in ("failed", "cancelled") and status != job.status:
            raise AssertionError(f"job {job_id} {job.status}: {job.error_type}: {job.error_message}")
        return job.status == status

    try:
        wait_until(done, timeout=timeout, interval=0.1, what=f"job {job_id} to be {status}")
    except TimeoutError as e:
        job = job_row(job_id)
        state = {k: getattr(job, k) for k in ("status", "attempts", "worker", "heartbeat_at", "published_at",
                                              "progress_done", "progress_total")}
        log = worker_log.read_text()[-4000:] if worker_log is not None and worker_log.exists() else "(no log)"
        raise AssertionError(f"{e}; the job: {state}\nworker log (tail):\n{log}") from None
    return job_row(job_id)


def _is_reaper_of(proc: Path, parent: int) -> bool:
    try:
        cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    return b"lmscope.worker.reaper" in cmdline and ppid == parent


def reaper_pids(worker) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _is_reaper_of(p, worker.proc.pid)]


def series_names(sessions, job_id):
    with sessions() as s:
        return sorted(s.execute(select(Series.name).where(Series.job_id == job_id)).scalars())


def test_a_job_submitted_over_http_runs_and_its_results_are_readable(delivery, sessions):
    """HTTP → SQL → Redis → the Celery child → SQL → HTTP. On the way, a running job cancelled over HTTP
    stops at its next batch and the worker takes the next job."""
    import hashlib

    from lmscope.api import create_app
    from lmscope.api.auth import create_user

    app = create_app(replace(delivery.settings, auth=True))  # publishes through Celery to the real Redis
    with sessions.begin() as s:
        _, token = create_user(s, "ann")
    http, h = app.test_client(), {"Authorization": f"Bearer {token}"}

    def job(job_id):
        r = http.get(f"/v1/jobs/{job_id}", headers=h)
        assert r.status_code == 200, r.get_json()
        return r.get_json()

    def submit(params):
        r = http.post("/v1/jobs", headers=h, json={"kind": "count", "params": params})
        assert r.status_code == 202, r.get_json()
        return r.get_json()["id"]

    worker = delivery.start()
    slow = submit({"steps": 2000, "sleep": 0.01, "plot": False})
    wait_until(lambda: ((job(slow)["progress"] or {}).get("done") or 0) >= 5, timeout=60, what="the slow job's progress")
    r = http.post(f"/v1/jobs/{slow}/cancel", headers=h)
    assert r.status_code == 202 and r.get_json()["cancel_requested"]
    wait_until(lambda: job(slow)["status"] == "cancelled", timeout=30, what="the running job to be cancelled")
    assert job(slow)["progress"]["done"] < 2000  # it stopped at a batch boundary, not at its end

    job_id = submit({"steps": 5, "plot": True})
    wait_until(lambda: job(job_id)["status"] in ("succeeded", "failed"), timeout=60, what=f"job {job_id} to finish")
    done = job(job_id)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 1 and done["summary"] == {"total": 15, "attempt": 1} and done["published_at"]
    assert int(done["worker"].rsplit(":", 1)[1]) != worker.proc.pid  # ran in the prefork child
    # The main process consumes but never loads torch (CUDA is initialised only in the child) and never
    # holds the database open: a SQLite connection's lock state copied into a forked child (the main
    # process forks a new child after a crash) made the database "locked" for that child for ever.
    assert "libtorch" not in Path(f"/proc/{worker.proc.pid}/maps").read_text()
    fds = Path(f"/proc/{worker.proc.pid}/fd")
    open_files = [os.readlink(fd) for fd in fds.iterdir() if fd.is_symlink()]
    database = make_url(delivery.settings.database_url).database or ""
    assert not [f for f in open_files if database and f.startswith(database)], open_files
    assert len(reaper_pids(worker)) == 1, "the worker's reaper runs in a process of its own"
    env = done["environment"]
    assert env["lmscope"] and env["device"] == "cpu" and env["device_name"] and env["attempt"] == 1
    assert set(env["stages"]) >= {"count", "plot", "total"} and env["wall_seconds"] >= env["stages"]["total"]

    series = http.get(f"/v1/jobs/{job_id}/results?series=square", headers=h).get_json()["series"]
    assert [(s["x"], s["y"]) for s in series] == [([1, 2, 3, 4, 5], [1, 4, 9, 16, 25])]
    items = {a["name"]: a for a in http.get(f"/v1/jobs/{job_id}/artifacts", headers=h).get_json()["items"]}
    png = http.get(items["plots/square.png"]["url"], headers=h)
    assert png.status_code == 200 and png.data.startswith(b"\x89PNG")
    assert hashlib.sha256(png.data).hexdigest() == items["plots/square.png"]["sha256"]


def test_a_queued_job_says_whether_any_worker_takes_jobs_from_the_queue(delivery, sessions, job_row, monkeypatch):
    """With a broker, a queued job's `queue.workers` counts the Celery workers consuming queue lmscope (asked
    over Celery's remote control): 0 before a worker starts — the job waits, and the CLI can say why — and
    1 once one runs."""
    from lmscope.api import create_app, state
    from lmscope.api.auth import create_user

    monkeypatch.setattr(state, "CONSUMERS_TTL", 0.0)  # a census per request, not one per 15 s
    app = create_app(replace(delivery.settings, auth=True))
    with sessions.begin() as s:
        _, token = create_user(s, "ann")
    http, h = app.test_client(), {"Authorization": f"Bearer {token}"}

    def submit(params):
        r = http.post("/v1/jobs", headers=h, json={"kind": "count", "params": params})
        assert r.status_code == 202, r.get_json()
        return r.get_json()["id"]

    first = submit({"steps": 40, "sleep": 0.25, "plot": False})
    assert http.get(f"/v1/jobs/{first}", headers=h).get_json()["queue"]["workers"] == 0
    worker = delivery.start()
    wait_until(lambda: job_row(first).status == "running", timeout=60, what="the first job to start")
    second = submit({"steps": 1, "plot": False})  # behind the first: the only worker is busy with it

    def workers():  # a page shows the last census while the next is taken (a second): ask until it changes
        body = http.get(f"/v1/jobs/{second}", headers=h).get_json()
        assert body["status"] == "queued"
        return body["queue"].get("workers")

    wait_until(lambda: workers() == 1, timeout=20, what="the census to count the worker")
    worker.stop()
    wait_until(lambda: workers() == 0, timeout=20, what="the census to miss the stopped worker")


# A first attempt this slow (300 steps of 0.25 s: 75 s) is still running when the test, however starved, kills it.
SLOW_FIRST_ATTEMPT = {"steps": 300, "sleep": 0.25, "plot": False}


def kill_mid_job(sessions, job_row, job_id: int) -> int:
    """SIGKILL the worker child that runs `job_id` (a SLOW_FIRST_ATTEMPT job) once it has counted a few
    steps; its retry then runs at 10 ms a step: a claim reads the params afresh, the running attempt keeps
    those it read. Returns the killed pid."""
    wait_until(lambda: (job_row(job_id).progress_done or 0) >= 4, timeout=60, what="the first attempt's progress")
    with sessions() as s, s.begin():
        s.execute(update(Job).where(Job.id == job_id).values(params={**SLOW_FIRST_ATTEMPT, "sleep": 0.01}))
    job = job_row(job_id)
    assert (job.status, job.attempts) == ("running", 1) and job.progress_done < 300  # mid-job
    killed = int(job.worker.rsplit(":", 1)[1])
    os.kill(killed, signal.SIGKILL)
    return killed


def test_a_killed_child_is_retried_with_one_set_of_results(delivery, sessions, make_job, job_row):
    worker = delivery.start()
    job_id = make_job(params=SLOW_FIRST_ATTEMPT)
    publish_jobs(delivery.publisher, sessions, [job_id])
    killed = kill_mid_job(sessions, job_row, job_id)

    job = wait_for_status(job_row, job_id, timeout=180, worker_log=worker.log_path)
    assert job.attempts == 2 and job.summary["attempt"] == 2 and job.environment["attempt"] == 2
    assert int(job.worker.rsplit(":", 1)[1]) != killed
    assert series_names(sessions, job_id) == ["nan", "square"]  # exactly one set
    checkpoints = Path(delivery.settings.artifact_dir) / "jobs" / str(job_id) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["from-attempt-1.txt", "from-attempt-2.txt"]


def test_a_job_that_leaves_the_gpu_unusable_ends_its_pool_child(delivery, sessions, make_job, job_row):
    """CUDA fails every call after an illegal address in that process: the job fails (device-error, not
    retried), the child ends, and the next job runs in the fresh child Celery forks."""
    worker = delivery.start()
    broken = make_job(params={"plot": False, "fail": "broken_device", "fail_at": 1})
    publish_jobs(delivery.publisher, sessions, [broken])
    failed = wait_for_status(job_row, broken, "failed", timeout=60, worker_log=worker.log_path)
    assert failed.error_type == "device-error" and "illegal memory access" in failed.error_message
    later = make_job(params={"steps": 3, "plot": False})
    publish_jobs(delivery.publisher, sessions, [later])
    done = wait_for_status(job_row, later, timeout=60, worker_log=worker.log_path)
    assert int(done.worker.rsplit(":", 1)[1]) != int(failed.worker.rsplit(":", 1)[1])
    assert "ending the process so that Celery starts a fresh one" in worker.log_path.read_text()
    # the job's message came back with the ended child; its redelivery found the job finished and was dropped
    first_task = re.search(r"Task lmscope\.run_job\[([0-9a-f-]+)\] received", worker.log_path.read_text()).group(1)
    wait_until(lambda: f"Task lmscope.run_job[{first_task}] succeeded" in worker.log_path.read_text(), timeout=30,
               what="the redelivery of the failed job's message")
    assert (job_row(broken).status, job_row(broken).attempts) == ("failed", 1)


def test_a_sweep_child_killed_mid_run_counts_once_in_its_parent(delivery, sessions, make_job, job_row):
    """A sweep's child whose worker process is SIGKILLed is retried; the parent then sees each child
    once: one aggregation whose input holds each child once, and one set of the retried child's series."""
    worker = delivery.start()
    parent = make_job(kind="fake_sweep", params={"steps": [300, 4]}, status="running", waiting_children=True,
                      started_at=utcnow())
    slow = make_job(params=SLOW_FIRST_ATTEMPT, parent_id=parent)
    quick = make_job(params={"steps": 4, "plot": False}, parent_id=parent)
    publish_jobs(delivery.publisher, sessions, [slow, quick])
    kill_mid_job(sessions, job_row, slow)

    job = wait_for_status(job_row, parent, timeout=180, worker_log=worker.log_path)
    assert job_row(slow).attempts == 2 and job_row(quick).attempts == 1
    assert job.attempts == 1
    assert job.summary["children"] == {"succeeded": 2, "failed": 0, "cancelled": 0}
    assert job.summary["sum"] == sum(range(1, 301)) + sum(range(1, 5))
    with sessions() as s:
        totals = s.execute(select(Series).where(Series.job_id == parent, Series.name == "totals")).scalar_one()
    assert sorted(totals.x) == sorted([slow, quick])  # each child once in the aggregation's input
    assert series_names(sessions, slow) == ["nan", "square"]


def test_a_sweeps_aggregation_goes_ahead_of_the_jobs_queued_behind_its_children(delivery, sessions, make_job,
                                                                                  job_row):
    """The last child publishes its parent's id ahead of the queue (Redis priority): with one worker
    process and a backlog queued after the sweep, the sweep ends before any job of the backlog starts,
    not after all of them; and the backlog then runs as usual."""
    worker = delivery.start()
    parent = make_job(kind="fake_sweep", params={"steps": [2, 3]}, status="running", waiting_children=True,
                      started_at=utcnow())
    children = [make_job(params={"steps": n, "plot": False}, parent_id=parent) for n in (2, 3)]
    backlog = [make_job(params={"steps": 4, "sleep": 0.2, "plot": False}) for _ in range(3)]
    publish_jobs(delivery.publisher, sessions, children + backlog)

    sweep = wait_for_status(job_row, parent, timeout=120, worker_log=worker.log_path)
    assert sweep.summary["sum"] == 3 + 6 and sweep.summary["children"]["succeeded"] == 2
    done = [wait_for_status(job_row, j, timeout=120, worker_log=worker.log_path) for j in backlog]
    assert all(j.summary["total"] == 10 for j in done)
    assert sweep.finished_at <= min(j.started_at for j in done), (
        f"the sweep ended at {sweep.finished_at}, after the backlog began at {min(j.started_at for j in done)}")


def test_a_message_never_sent_is_published_by_the_reaper(delivery, sessions, make_job, job_row):
    job_id = make_job(params={"steps": 3, "plot": False}, created_at=utcnow() - timedelta(seconds=5))
    delivery.start()  # its reaper thread finds the queued, never-published row
    job = wait_for_status(job_row, job_id, timeout=60)
    assert job.published_at is not None and job.attempts == 1


def test_a_queued_job_survives_a_redis_restart(delivery, sessions, make_job, job_row, redis_server):
    job_id = make_job(params={"steps": 3, "plot": False})
    assert publish_jobs(delivery.publisher, sessions, [job_id]) == [job_id]  # no worker yet: it waits in Redis
    published_at = job_row(job_id).published_at
    redis_server.restart()
    delivery.start()
    job = wait_for_status(job_row, job_id, timeout=60)
    # Delivered from Redis' AOF: the reaper did not publish it again (it would have set published_at).
    assert job.attempts == 1 and job.published_at == published_at


def test_the_reaper_sends_again_only_messages_redis_no_longer_holds(delivery, sessions, make_job, job_row,
                                                                      redis_server):
    """Real Redis, no worker: two jobs that have waited past the republish time while their messages sit in
    the queue are left alone (a backlog, not a loss); once Redis has lost them (FLUSHALL), both go again,
    and the queue then holds one message each."""
    import redis

    from lmscope.worker import reaper

    ids = [make_job(params={"steps": 3, "plot": False}) for _ in range(2)]
    assert publish_jobs(delivery.publisher, sessions, ids) == ids
    assert delivery.publisher.waiting() == 2
    long_ago = utcnow() - timedelta(seconds=reaper.republish_after(delivery.settings) + 1)
    with sessions.begin() as session:
        session.execute(update(Job).where(Job.id.in_(ids)).values(published_at=long_ago))
    assert reaper.reap(delivery.settings, sessions, delivery.publisher)["republished"] == []
    assert delivery.publisher.waiting() == 2 and job_row(ids[0]).published_at == long_ago

    redis.Redis.from_url(redis_server.url).flushall()
    assert delivery.publisher.waiting() == 0
    assert sorted(reaper.reap(delivery.settings, sessions, delivery.publisher)["republished"]) == ids
    assert delivery.publisher.waiting() == 2
    redis_server.stop()
    assert delivery.publisher.waiting() is None  # a broker that cannot be asked


def test_a_worker_refuses_to_start_on_a_database_without_the_schema(delivery, tmp_path):
    """Started, it would take messages off the queue and drop them (every claim fails)."""
    log = tmp_path / "unmigrated-worker.log"
    env = dict(delivery.env, LMSCOPE_DATABASE_URL=f"sqlite:///{tmp_path / 'empty.db'}")
    worker = CeleryWorker(env, log)
    try:
        assert worker.proc.wait(timeout=60) != 0
    finally:
        worker.stop()
    assert "no lmscope tables; create them with `lmscope db upgrade`" in log.read_text()
    assert " ready." not in log.read_text()


def test_a_delivery_that_finds_the_database_failing_puts_its_message_back(delivery, sessions, make_job, job_row,
                                                                          db_url):
    """The jobs table is out of reach (renamed) when the message arrives: the message must come back, not
    be acked and lost; once the table is back, the same message runs the job (the reaper did not republish)."""
    from sqlalchemy import text

    from lmscope.db.engine import make_engine

    published_at = utcnow()  # recent: the reaper has no reason to publish it again within the test
    job_id = make_job(params={"steps": 3, "plot": False}, published_at=published_at)
    worker = delivery.start()
    engine = make_engine(db_url)
    with engine.begin() as c:
        c.execute(text("ALTER TABLE jobs RENAME TO jobs_away"))
    delivery.publisher.publish(job_id)
    wait_until(lambda: "giving its message back to the queue" in worker.log_path.read_text(), timeout=60,
               what="the worker to give the message back")
    with engine.begin() as c:
        c.execute(text("ALTER TABLE jobs_away RENAME TO jobs"))
    engine.dispose()
    job = wait_for_status(job_row, job_id, timeout=60, worker_log=worker.log_path)
    assert job.attempts == 1 and job.summary["total"] == 6 and job.published_at == published_at


def test_a_reaper_that_dies_is_started_again(delivery):
    worker = delivery.start()
    wait_until(lambda: len(reaper_pids(worker)) == 1, timeout=30, what="the worker's reaper")
    (first,) = reaper_pids(worker)
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: reaper_pids(worker) not in ([], [first]), timeout=30, what="a new reaper")
    assert "exited with status -9; starting a new one" in worker.log_path.read_text()


def test_under_celery_the_jobs_own_deadline_comes_before_the_soft_limit(delivery, sessions, make_job, job_row,
                                                                         tmp_path):
    """With LMSCOPE_TASK_TIME_LIMIT=20 the job's deadline (18 s) fires at a progress report before Celery's soft
    limit (19 s) would interrupt it anywhere: the job fails with time-limit and keeps what it counted."""
    log = tmp_path / "limited-worker.log"
    worker = CeleryWorker(dict(delivery.env, LMSCOPE_TASK_TIME_LIMIT="20"), log)
    try:
        worker.wait_ready()
        job_id = make_job(params={"steps": 1_000_000, "sleep": 0.001, "plot": False, "keep_partial": True})
        publish_jobs(delivery.publisher, sessions, [job_id])
        job = wait_for_status(job_row, job_id, status="failed", timeout=90, worker_log=log)
    finally:
        worker.stop()
    assert job.error_type == "time-limit" and 0 < job.summary["counted"] < 1_000_000
    assert "(LMSCOPE_TASK_TIME_LIMIT=20 s;" in job.error_message  # which limit, and its value
    assert series_names(sessions, job_id) == ["square"] and "SoftTimeLimitExceeded" not in log.read_text()


def artifact_names(sessions, job_id):
    with sessions() as s:
        return sorted(s.execute(select(Artifact.name).where(Artifact.job_id == job_id)).scalars())


def test_a_job_killed_by_the_hard_time_limit_fails_with_time_limit_and_is_not_retried(delivery, sessions, make_job,
                                                                                    job_row, tmp_path):
    """LMSCOPE_TASK_TIME_LIMIT=4: the job spends its time in one call that reports no progress and that the
    soft limit (3 s) cannot interrupt; the hard limit (4 s) kills the pool child before anything is stored.
    The row stays running until its heartbeat goes stale; then it fails with time-limit (not requeued: every
    attempt would be killed the same way), with the files it wrote as artifacts."""
    log = tmp_path / "hard-limit-worker.log"
    worker = CeleryWorker(dict(delivery.env, LMSCOPE_TASK_TIME_LIMIT="4"), log)
    try:
        worker.wait_ready()
        job_id = make_job(params={"steps": 3, "block": 60, "plot": False})
        publish_jobs(delivery.publisher, sessions, [job_id])

        def ended_or_retried():
            job = job_row(job_id)
            return job.status in ("succeeded", "failed", "cancelled") or job.attempts > 1

        wait_until(ended_or_retried, timeout=90, interval=0.2, what="the job to fail or be retried")
        job = job_row(job_id)
    finally:
        worker.stop()
    assert "Hard time limit (4s) exceeded" in log.read_text()  # killed, not stopped by the soft limit
    assert (job.status, job.error_type, job.attempts) == ("failed", "time-limit", 1), (job.error_type, job.error_message)
    assert "LMSCOPE_TASK_TIME_LIMIT=4 s" in job.error_message
    assert artifact_names(sessions, job_id) == ["attempt-1.txt", "checkpoints/from-attempt-1.txt"]


def test_a_child_killed_on_its_last_attempt_fails_with_its_files_listed(delivery, sessions, make_job, job_row,
                                                                         tmp_path):
    """The killed child's message comes back at once; the claim takes the attempt over, finds no attempt
    left and fails the job (worker-lost) without waiting for the reaper. Its files (a train run's
    checkpoints) are its artifacts, as when the reaper gives up."""
    # The reaper must not get there first: on a loaded machine a new pool child can take longer to start
    # than the fixture's 5-s staleness.
    worker = CeleryWorker(dict(delivery.env, LMSCOPE_STALE_AFTER_SECONDS="300"), tmp_path / "last-attempt-worker.log")
    try:
        worker.wait_ready()
        job_id = make_job(params={"steps": 300, "sleep": 0.01, "plot": False}, max_attempts=1)
        publish_jobs(delivery.publisher, sessions, [job_id])
        wait_until(lambda: (job_row(job_id).progress_done or 0) >= 20, timeout=60, what="the attempt's progress")
        os.kill(int(job_row(job_id).worker.rsplit(":", 1)[1]), signal.SIGKILL)
        job = wait_for_status(job_row, job_id, status="failed", timeout=120, worker_log=worker.log_path)
    finally:
        worker.stop()
    assert (job.error_type, job.attempts) == ("worker-lost", 1)
    assert "is gone; taking over" in worker.log_path.read_text()  # the claim, not the reaper, ended it
    assert artifact_names(sessions, job_id) == ["attempt-1.txt", "checkpoints/from-attempt-1.txt"]
