"""Small helpers shared by the worker tests."""

from __future__ import annotations

import threading
import time


class RecordingPublisher:
    """Remembers what was published; ``fail=True`` behaves like a broker that is down."""

    def __init__(self):
        self.published: list[int] = []
        self.aggregations: list[int] = []  # the ids among them published as a sweep parent's aggregation
        self.tries = 0  # publish calls, failed ones included
        self.fail = False
        self._lock = threading.Lock()

    def publish(self, job_id: int, *, aggregation: bool = False) -> None:
        with self._lock:
            self.tries += 1
        if self.fail:
            raise ConnectionError("broker down (test)")
        with self._lock:
            self.published.append(job_id)
            if aggregation:
                self.aggregations.append(job_id)


def start_execute(job_id: int, settings, sessions, publisher) -> tuple[threading.Thread, dict]:
    """``runner.execute`` in a started thread; the dict gets ``"status"`` (its return value) when it ends."""
    from lmscope.worker import runner

    outcome: dict = {}
    t = threading.Thread(target=lambda: outcome.setdefault("status", runner.execute(job_id, settings, sessions, publisher)))
    t.start()
    return t, outcome


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
