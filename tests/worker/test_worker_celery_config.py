"""The Celery settings of DESIGN.md §2, on the app that publishers and workers build from Settings.

(Their behaviour with a real Redis and worker is in test_worker_delivery.py; this pins the invariants
that only show up in production: no pickle, a hard limit below Redis' redelivery timeout.)
"""

from __future__ import annotations

import pytest

from lmscope.config import time_limits
from lmscope.queue import QUEUE_NAME, TASK_NAME, make_celery


@pytest.mark.parametrize("time_limit", [2, 30, 120, 21600])
def test_celery_settings(settings_factory, time_limit):
    conf = make_celery(settings_factory(broker_url="redis://127.0.0.1:6379/0", task_time_limit=time_limit)).conf
    # JSON only: a pickle message from anyone who can write to Redis would run code in the worker.
    assert conf.task_serializer == "json" and list(conf.accept_content) == ["json"]
    # A child that dies mid-job gives its message back; one message in hand per process.
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
    assert conf.task_ignore_result and not conf.result_backend  # SQL is the truth
    # The soft limit fails the job before the hard limit kills it, and both come before Redis hands the
    # still-running job's message to a second worker.
    assert 0 < conf.task_soft_time_limit < conf.task_time_limit == time_limit
    # and the job's own deadline, checked at its progress reports, comes before the soft limit
    assert 0 < time_limits(time_limit)[1] < conf.task_soft_time_limit
    assert conf.broker_transport_options["visibility_timeout"] > conf.task_time_limit
    assert conf.task_routes[TASK_NAME]["queue"] == QUEUE_NAME == conf.task_default_queue


def test_celery_needs_a_broker(settings_factory):
    with pytest.raises(ValueError, match="LMSCOPE_BROKER_URL"):
        make_celery(settings_factory(broker_url=None))


REAPER_SUPERVISION = r"""
import threading
from lmscope.worker import celery_app as app

class FakeReaper:
    def __init__(self, alive=True):
        self.alive, self.pid, self.returncode, self.terminated = alive, 4242, None if alive else -9, 0
    def poll(self):
        return None if self.alive else self.returncode
    def terminate(self):
        self.terminated += 1
    def wait(self, timeout=None):
        app._stop_reaper()  # a second SIGTERM arrives while the first stop waits (Celery sends the signal again)
        self.alive = False
    def kill(self):
        pass

# 1. a nested stop returns instead of deadlocking on the lock, and the reaper is stopped once
app._reaper = reaper = FakeReaper()
done = threading.Event()
threading.Thread(target=lambda: (app._stop_reaper(), done.set()), daemon=True).start()
assert done.wait(5), "the nested stop deadlocked"
assert reaper.terminated == 1

# 2. a reaper that keeps dying is restarted with a doubling pause up to the cap, a failed start does not end
# the watching, and one that stays up brings the pause back to the check interval. No real waiting: the
# stop event's wait records each pause and says "stop" after eight.
class Pauses:
    def __init__(self):
        self.seen = []
    def wait(self, seconds):
        self.seen.append(seconds)
        return len(self.seen) > 8
    def is_set(self):
        return len(self.seen) > 8

app._stopping = pauses = Pauses()
app.REAPER_CHECK_SECONDS, app.REAPER_MAX_BACKOFF_SECONDS = 0.05, 0.4
starts = []
def start():
    starts.append(1)
    if len(starts) == 1:
        raise OSError(12, "Cannot allocate memory")
    app._reaper = FakeReaper(alive=len(starts) >= 5)
app._start_reaper_process = start
app._reaper = FakeReaper(alive=False)
app._watch_reaper()
assert pauses.seen == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4, 0.05, 0.05, 0.05], pauses.seen
assert len(starts) == 5, starts
print("ok")
"""


def test_the_reaper_supervision_survives_nested_stops_and_crashing_reapers(tmp_path):
    """Run in a subprocess: importing the worker module connects Celery signals and builds its app."""
    import os
    import subprocess
    import sys

    from tests.worker.conftest import ROOT

    env = dict(os.environ, LMSCOPE_BROKER_URL="redis://127.0.0.1:1/0", LMSCOPE_DATA_DIR=str(tmp_path),
               PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", REAPER_SUPERVISION], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
