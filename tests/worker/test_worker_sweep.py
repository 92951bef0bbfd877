"""Sweeps: the parent is aggregated exactly once, after its last child, even when workers race."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import select

from lmscope.db.models import Series, utcnow
from lmscope.worker import runner
from tests.worker import fake_kinds
from tests.worker.helpers import start_execute, wait_until


@pytest.fixture
def sweep(make_job):
    """A parent as the API inserts it (running, waiting for children) and its queued children."""

    def make(children: list[dict], cancel: bool = False, **params) -> tuple[int, list[int]]:
        parent = make_job(kind="fake_sweep", params={"steps": [c.get("steps", 5) for c in children], **params},
                          status="running", waiting_children=True, started_at=utcnow(), cancel_requested=cancel)
        kids = [make_job(params={"plot": False, **c}, parent_id=parent) for c in children]
        return parent, kids

    return make


def test_aggregation_runs_exactly_once_when_workers_race(settings, sessions, sweep, job_row, publisher):
    parent, kids = sweep([{"steps": 2}, {"steps": 3}, {"steps": 4}, {"steps": 5, "fail": "exception", "fail_at": 1}])
    before = fake_kinds.aggregate_calls
    results = []
    lock = threading.Lock()

    def worker(child_id):
        runner.execute(child_id, settings, sessions, publisher)
        # Each worker then receives the parent id that finishing its child published.
        status = runner.execute(parent, settings, sessions, publisher)
        with lock:
            results.append(status)

    threads = [threading.Thread(target=worker, args=(k,)) for k in kids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    # ... and a few late duplicate deliveries race each other too.
    barrier = threading.Barrier(3)
    late = []
    extra = [threading.Thread(target=lambda: (barrier.wait(), late.append(
        runner.execute(parent, settings, sessions, publisher)))) for _ in range(3)]
    for t in extra:
        t.start()
    for t in extra:
        t.join(timeout=30)

    assert fake_kinds.aggregate_calls - before == 1
    assert results.count("succeeded") == 1 and late == [None, None, None]
    assert publisher.aggregations.count(parent) == len(kids)  # every child published its parent's aggregation
    job = job_row(parent)
    assert job.status == "succeeded" and not job.waiting_children
    assert job.summary["sum"] == sum(range(1, 3)) + sum(range(1, 4)) + sum(range(1, 5))
    assert job.summary["failed_children"] == [kids[3]]
    assert job.summary["children"] == {"succeeded": 3, "failed": 1, "cancelled": 0}
    assert (job.progress_done, job.progress_total) == (4, 4)


def test_parent_waits_for_its_last_child_and_shows_progress(settings, sessions, sweep, job_row, publisher):
    parent, kids = sweep([{"steps": 2}, {"steps": 3}])
    runner.execute(kids[0], settings, sessions, publisher)
    assert runner.execute(parent, settings, sessions, publisher) is None  # one child still queued
    job = job_row(parent)
    assert job.waiting_children and (job.progress_done, job.progress_total) == (1, 2)
    runner.execute(kids[1], settings, sessions, publisher)
    assert runner.execute(parent, settings, sessions, publisher) == "succeeded"
    assert job_row(parent).summary["sum"] == 3 + 6


def _cancel(sessions, *job_ids):
    """What the API's cancel does to a running job: set the flag."""
    from sqlalchemy import update

    from lmscope.db.models import Job

    with sessions() as s, s.begin():
        s.execute(update(Job).where(Job.id.in_(job_ids)).values(cancel_requested=True))


def test_a_cancelled_sweep_keeps_the_results_of_the_children_that_finished(settings, sessions, sweep, job_row,
                                                                          publisher):
    parent, kids = sweep([{"steps": 2}, {"steps": 3}, {"steps": 4}], cancel=True)
    runner.execute(kids[0], settings, sessions, publisher)
    # The API cancels the queued children (cancel_requested): a delivery then ends each at once.
    _cancel(sessions, kids[1], kids[2])
    assert runner.execute(kids[1], settings, sessions, publisher) == "cancelled"
    assert runner.execute(kids[2], settings, sessions, publisher) == "cancelled"
    before = fake_kinds.aggregate_calls
    assert runner.execute(parent, settings, sessions, publisher) == "cancelled"
    assert fake_kinds.aggregate_calls == before + 1  # aggregated once, over what finished
    job = job_row(parent)
    assert job.status == "cancelled" and not job.waiting_children
    assert job.summary["children"] == {"succeeded": 1, "failed": 0, "cancelled": 2} and job.summary["partial"]
    assert job.summary["sum"] == 1 + 2  # the finished child's total: 1 + 2 for steps=2
    assert (job.progress_done, job.progress_total) == (1, 3)  # how far it got, not 100 %
    with sessions() as s:
        [totals] = s.scalars(select(Series).where(Series.job_id == parent)).all()
    assert (totals.name, totals.x, totals.y) == ("totals", [kids[0]], [3])
    assert runner.execute(parent, settings, sessions, publisher) is None  # and only once


def test_a_grid_point_cancelled_on_its_own_leaves_the_sweep_partial(settings, sessions, sweep, job_row, publisher):
    """`lmscope cancel CHILD`: the sweep was not cancelled, so it ends succeeded with the others' results, but
    they miss a point someone stopped, which it says as a cancelled sweep does (it read as complete)."""
    parent, kids = sweep([{"steps": 2}, {"steps": 3}])
    runner.execute(kids[0], settings, sessions, publisher)
    _cancel(sessions, kids[1])
    assert runner.execute(kids[1], settings, sessions, publisher) == "cancelled"
    assert runner.execute(parent, settings, sessions, publisher) == "succeeded"
    job = job_row(parent)
    assert job.summary["children"] == {"succeeded": 1, "failed": 0, "cancelled": 1} and job.summary["partial"] is True
    assert job.summary["sum"] == 1 + 2


def test_a_cancelled_sweep_with_nothing_finished_is_cancelled_without_aggregating(settings, sessions, sweep,
                                                                                 job_row, publisher):
    parent, kids = sweep([{"steps": 2}, {"steps": 3}], cancel=True)
    _cancel(sessions, *kids)
    for kid in kids:
        assert runner.execute(kid, settings, sessions, publisher) == "cancelled"
    before = fake_kinds.aggregate_calls
    assert runner.execute(parent, settings, sessions, publisher) == "cancelled"
    assert fake_kinds.aggregate_calls == before
    job = job_row(parent)
    assert job.summary == {"children": {"succeeded": 0, "failed": 0, "cancelled": 2}}
    assert (job.progress_done, job.progress_total) == (0, 2)


@pytest.mark.parametrize("second", [{"steps": 3}, {"steps": 3, "fail": "exception", "fail_at": 1}])
def test_a_cancel_that_cut_no_child_short_leaves_a_complete_sweep(settings, sessions, sweep, job_row, publisher,
                                                                  second):
    """The cancel came after the last child had ended (before the aggregation was claimed; or while it
    finished its last step): nothing is partial, so the sweep ends as if not cancelled — succeeded, with a
    failed child listed as usual — where a cancelled sweep would say partial."""
    parent, kids = sweep([{"steps": 2}, second])
    for kid in kids:
        runner.execute(kid, settings, sessions, publisher)
    _cancel(sessions, parent)  # what the API does now: the parent has no active child left to flag
    assert runner.execute(parent, settings, sessions, publisher) == "succeeded"
    job = job_row(parent)
    assert job.status == "succeeded" and "partial" not in job.summary
    failed = "fail" in second
    assert job.summary["sum"] == 3 + (0 if failed else 6)
    assert job.summary["children"] == {"succeeded": 2 - failed, "failed": int(failed), "cancelled": 0}
    assert job.summary.get("failed_children", []) == ([kids[1]] if failed else [])
    assert (job.progress_done, job.progress_total) == (2, 2)


def test_a_cancel_during_the_aggregation_does_not_throw_its_results_away(settings, sessions, sweep, job_row,
                                                                         publisher):
    """Once claimed, the aggregation (short; every child is done) is not cancellable: a cancel flag that
    arrives meanwhile (the API answers 409 then; an older API, or SQL, may still set it) is ignored and
    the parent ends with what the aggregation produced."""
    parent, kids = sweep([{"steps": 2}, {"steps": 3}], aggregate_sleep=1.0)
    for kid in kids:
        runner.execute(kid, settings, sessions, publisher)
    t, outcome = start_execute(parent, settings, sessions, publisher)
    wait_until(lambda: job_row(parent).progress_stage == "aggregating", what="the aggregation to start")
    _cancel(sessions, parent)
    t.join(timeout=30)
    assert outcome["status"] == "succeeded"
    job = job_row(parent)
    assert job.status == "succeeded" and job.summary["sum"] == 3 + 6 and "partial" not in job.summary
    with sessions() as s:
        assert s.scalars(select(Series.name).where(Series.job_id == parent)).all() == ["totals"]


def test_a_sweeps_progress_never_goes_back_while_it_aggregates(settings, sessions, sweep, job_row, publisher):
    """The aggregator reports 0 of 1, then 1 of 1 (analyses.sweep.aggregate does): the parent keeps its
    children's count (4 of 4) and shows only the stage."""
    parent, kids = sweep([{"steps": 2}, {"steps": 3}, {"steps": 4}, {"steps": 5}], aggregate_sleep=1.0)
    for kid in kids:
        runner.execute(kid, settings, sessions, publisher)
    assert (job_row(parent).progress_done, job_row(parent).progress_total) == (4, 4)
    seen = []
    t, outcome = start_execute(parent, settings, sessions, publisher)
    while t.is_alive():
        job = job_row(parent)
        seen.append((job.progress_done, job.progress_total, job.progress_stage))
        time.sleep(0.02)
    t.join()
    assert outcome["status"] == "succeeded"
    assert (4, 4, "aggregating") in seen  # the aggregator's first report was written ...
    assert {(done, total) for done, total, _ in seen} == {(4, 4)}, seen  # ... without going back to 0 of 1
    job = job_row(parent)
    assert (job.progress_done, job.progress_total) == (4, 4)
