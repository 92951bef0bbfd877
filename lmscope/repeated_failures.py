"""When to log a try that keeps failing (an outage): at its first failure, once a minute while the
failures go on and when a try works again, not at every try. A heartbeat or a progress write tries
several times a second, a reaper every few seconds: a 10-minute outage on 8 workers was 2000 lines.

The users (worker writes, publishing, reaper passes) say what failed in their own words; this only
counts and keeps time.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Literal


class RepeatedFailures:
    """A run of failed tries of one thing. ``forget_seconds``: a failure this long after the last one
    starts a new run (for a process that tries only now and then and may never see a try work in between)."""

    REMIND_SECONDS = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic, forget_seconds: float | None = None):
        self._clock = clock
        self._forget_seconds = forget_seconds
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.failures = 0  # in this run
        self._started = self._reminded = self._last_failed = 0.0

    @property
    def failing(self) -> bool:
        """The last try failed (and, with ``forget_seconds``, not longer ago than that)."""
        return self.failures > 0 and (self._forget_seconds is None
                                      or self._clock() - self._last_failed < self._forget_seconds)

    @property
    def seconds(self) -> float:
        """Since the run's first failure."""
        return self._clock() - self._started

    def note_failure(self) -> Literal["first", "again"] | None:
        """Count a failed try; "first" when the run starts, "again" a minute after it was last said,
        None when it is not to be said."""
        with self._lock:
            now = self._clock()
            if self.failures and self._forget_seconds is not None and now - self._last_failed >= self._forget_seconds:
                self.failures = 0
            self.failures += 1
            self._last_failed = now
            if self.failures == 1:
                self._started = self._reminded = now
                return "first"
            if now - self._reminded >= self.REMIND_SECONDS:
                self._reminded = now
                return "again"
            return None

    def note_success(self) -> int:
        """A try worked: the number of failures it ends (0 when none was failing)."""
        with self._lock:
            ended, self.failures = self.failures, 0
            return ended
