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
