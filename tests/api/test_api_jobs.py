"""GET /v1/jobs[/{id}] and POST /v1/jobs/{id}/cancel."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from lmscope.db.models import utcnow

from .conftest import Api, is_problem, small_sweep


def test_job_document(api):
    h = api.user("ann")
    job_id = api.submit(h, name="n1").get_json()["id"]
    api.set_job(job_id, created_at=utcnow() - timedelta(seconds=30))
    timings = api.client.get(f"/v1/jobs/{job_id}", headers=h).get_json()["timings"]
    assert 29 < timings["queued_seconds"] < 600 and timings["run_seconds"] is None  # waiting so far
    started = utcnow() - timedelta(seconds=10)
    api.set_job(job_id, status="running", attempts=1, started_at=started, heartbeat_at=utcnow(),
                progress_done=30, progress_total=120, progress_stage="forward")
    job = api.client.get(f"/v1/jobs/{job_id}", headers=h).get_json()
    assert job["status"] == "running" and job["attempts"] == 1 and job["user"] == "ann" and job["name"] == "n1"
    assert job["progress"]["done"] == 30 and job["progress"]["total"] == 120 and job["progress"]["stage"] == "forward"
    assert job["progress"]["fraction"] == 30 / 120
    assert 9 < job["timings"]["run_seconds"] < 600 and 19 < job["timings"]["queued_seconds"] < 21
    # given back to the queue by the reaper (started_at stays the last attempt's): it runs no more
    api.set_job(job_id, status="queued", worker=None)
    assert api.client.get(f"/v1/jobs/{job_id}", headers=h).get_json()["timings"]["run_seconds"] is None
    api.set_job(job_id, status="running", attempts=1)
    assert job["links"] == {"self": f"/v1/jobs/{job_id}", "results": f"/v1/jobs/{job_id}/results",
                            "artifacts": f"/v1/jobs/{job_id}/artifacts", "events": f"/v1/jobs/{job_id}/events",
                            "cancel": f"/v1/jobs/{job_id}/cancel"}
    api.set_job(job_id, status="failed", finished_at=utcnow(), error_type="invalid-input", error_message="no text")
    job = api.client.get(f"/v1/jobs/{job_id}", headers=h).get_json()
    assert job["error"] == {"type": "invalid-input", "message": "no text"} and job["finished_at"].endswith("Z")


def test_a_queued_job_says_what_it_waits_behind(api):
    """`queue`: queued jobs submitted before it (anyone's: one shared queue) and jobs running now; a sweep
    parent holds no worker, its queued children are ahead like any job."""
    ann, bob = api.user("ann"), api.user("bob")
    running = api.submit(ann).get_json()["id"]
    api.set_job(running, status="running", attempts=1, started_at=utcnow())
    sweep = api.submit(bob, kind="sweep", params=small_sweep(2)).get_json()["id"]  # parent running, 2 children queued
    done = api.submit(bob).get_json()["id"]
    api.set_job(done, status="succeeded")
    first, second = api.submit(ann).get_json()["id"], api.submit(ann).get_json()["id"]

    def queue(job_id):
        return api.client.get(f"/v1/jobs/{job_id}", headers=ann).get_json().get("queue")

    assert api.job_row(sweep).status == "running"
    assert queue(first) == {"ahead": 2, "running": 1} and queue(second) == {"ahead": 3, "running": 1}
    api.client.post(f"/v1/jobs/{first}/cancel", headers=ann)
    assert queue(second) == {"ahead": 2, "running": 1}
    assert queue(running) is None and queue(first) is None  # only queued jobs wait
    listed = api.client.get("/v1/jobs?status=queued", headers=ann).get_json()["items"]
    assert [j["id"] for j in listed] == [second] and "queue" not in listed[0]


def test_other_users_jobs_are_404_and_admins_see_all(api):
    ann, bob, root = api.user("ann"), api.user("bob"), api.user("root", admin=True)
    job_id = api.submit(ann).get_json()["id"]
    for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/results", f"/v1/jobs/{job_id}/artifacts",
                 f"/v1/jobs/{job_id}/artifacts/plots/x.png", f"/v1/jobs/{job_id}/events"):
        # The job check answers, not a missing row further on (the artifact path would 404 either way).
        assert is_problem(api.client.get(path, headers=bob), 404, "not-found")["title"] == "Job not found", path
    is_problem(api.client.post(f"/v1/jobs/{job_id}/cancel", headers=bob), 404, "not-found")
    assert api.client.get("/v1/jobs", headers=bob).get_json()["items"] == []
    assert api.client.get(f"/v1/jobs/{job_id}", headers=root).status_code == 200
    assert [j["id"] for j in api.client.get("/v1/jobs", headers=root).get_json()["items"]] == [job_id]
    assert api.client.get("/v1/jobs?user=bob", headers=root).get_json()["items"] == []
    is_problem(api.client.get("/v1/jobs/999999", headers=root), 404, "not-found")


def test_pagination_walks_every_job_once_newest_first(api):
    h = api.user("ann")
    ids = []
    for i in range(7):
        ids.append(api.submit(h, tags=["even" if i % 2 == 0 else "odd"]).get_json()["id"])
        api.set_job(ids[-1], status="succeeded")  # stay under the quota
    api.submit(api.user("bob"))  # never in ann's pages
    seen, token, pages = [], None, 0
    while True:
        url = "/v1/jobs?limit=3" + (f"&page_token={token}" if token else "")
        page = api.client.get(url, headers=h).get_json()
        seen += [j["id"] for j in page["items"]]
        pages += 1
        if pages == 1:  # a job that arrives while paging shows on a fresh first page, never inside these
            newer = api.submit(h).get_json()["id"]
        token = page["next_page_token"]
        if not token:
            break
    assert seen == sorted(ids, reverse=True) and pages == 3
    assert api.client.get("/v1/jobs?limit=1", headers=h).get_json()["items"][0]["id"] == newer
    # Filters compose with paging.
    evens = api.client.get("/v1/jobs?tag=even&limit=2", headers=h).get_json()
    rest = api.client.get(f"/v1/jobs?tag=even&limit=2&page_token={evens['next_page_token']}", headers=h).get_json()
    assert [j["id"] for j in evens["items"] + rest["items"]] == sorted(ids[0::2], reverse=True)
    assert rest["next_page_token"] is None
    is_problem(api.client.get("/v1/jobs?limit=0", headers=h), 422, "validation-error")
    is_problem(api.client.get("/v1/jobs?limit=501", headers=h), 422, "validation-error")
    is_problem(api.client.get("/v1/jobs?page_token=garbage!", headers=h), 422, "validation-error")


def test_filters(api):
    h = api.user("ann")
    probe = api.submit(h, tags=["x"]).get_json()["id"]
    train = api.submit(h, kind="train", params={"dataset": "d"}, tags=["x", "y"]).get_json()["id"]
    sweep = api.submit(h, kind="sweep", params=small_sweep(2)).get_json()
    children = [c.id for c in api.jobs(parent_id=sweep["id"])]
    api.set_job(probe, status="running")

    def ids(query):
        r = api.client.get(f"/v1/jobs?{query}", headers=h)
        assert r.status_code == 200, r.get_data(as_text=True)
        return [j["id"] for j in r.get_json()["items"]]

    assert ids("kind=train") == [train]
    assert ids("status=running") == [sweep["id"], probe]  # a sweep parent runs while its children do
    assert ids("status=queued,running") == sorted([probe, train, sweep["id"], *children], reverse=True)
    assert ids("tag=y") == [train] and ids("tag=x") == [train, probe] and ids("tag=nope") == []
    assert ids("tag=x&tag=y") == [train] and ids("tag=y&tag=nope") == []  # jobs with every tag given
    assert ids(f"parent={sweep['id']}") == sorted(children, reverse=True)
    assert ids("parent=none") == [sweep["id"], train, probe]
    assert ids("") == sorted([probe, train, sweep["id"], *children], reverse=True)  # default: children included
    body = is_problem(api.client.get("/v1/jobs?status=done", headers=h), 422, "validation-error")
    assert "succeeded" in body["detail"]
    body = is_problem(api.client.get("/v1/jobs?status=canceled", headers=h), 422, "validation-error")
    assert "unknown status 'canceled'; did you mean 'cancelled'? Use one of: queued," in body["detail"]
    body = is_problem(api.client.get("/v1/jobs?kind=norm", headers=h), 422, "validation-error")
    assert "no job kind 'norm'; did you mean 'norms'? Use one of: " in body["detail"]


def test_a_broker_that_never_answers_holds_up_no_page(api, monkeypatch):
    """The census of workers (queue.workers) asks the broker; a paused broker held its PING for ever and,
    with it, every page of a queued job. Now the first page waits at most CENSUS_WAIT for the census, then
    answers without the count; later pages do not wait, and show the count once the census has come back."""
    import threading
    import time

    from lmscope.api import state

    monkeypatch.setattr(state, "CONSUMERS_TTL", 60.0)
    monkeypatch.setattr(state, "CENSUS_WAIT", 0.2)
    release, asked = threading.Event(), []
    monkeypatch.setattr(api.publisher, "consumers", lambda: (asked.append(1), release.wait(30), 2)[-1], raising=False)
    ann = api.user("ann")
    job_id = api.submit(ann).get_json()["id"]

    def queue():
        return api.client.get(f"/v1/jobs/{job_id}", headers=ann).get_json()["queue"]

    start = time.monotonic()
    assert queue() == {"ahead": 0, "running": 0} and queue() == {"ahead": 0, "running": 0}
    assert time.monotonic() - start < 5 and len(asked) == 1  # one census at a time, the pages not held
    release.set()
    deadline = time.monotonic() + 10
    while "workers" not in queue() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert queue() == {"ahead": 0, "running": 0, "workers": 2} and len(asked) == 1  # reused for CONSUMERS_TTL


def test_cancel_a_queued_job_cancels_it_now(api):
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    r = api.client.post(f"/v1/jobs/{job_id}/cancel", headers=h)
    assert r.status_code == 202 and r.get_json()["status"] == "cancelled"
    row = api.job_row(job_id)
    assert row.status == "cancelled" and row.finished_at is not None and row.cancel_requested
    is_problem(api.client.post(f"/v1/jobs/{job_id}/cancel", headers=h), 409, "job-finished")


def test_cancel_a_running_job_asks_the_worker(api):
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    api.set_job(job_id, status="running", attempts=1, started_at=utcnow())
    r = api.client.post(f"/v1/jobs/{job_id}/cancel", headers=h)
    assert r.status_code == 202
    assert r.get_json()["status"] == "running" and r.get_json()["cancel_requested"] is True
    row = api.job_row(job_id)
    assert row.status == "running" and row.cancel_requested and row.finished_at is None


def test_cancel_a_sweep(api):
    h = api.user("ann")
    parent = api.submit(h, kind="sweep", params=small_sweep(3)).get_json()["id"]
    first, second, third = [c.id for c in api.jobs(parent_id=parent)]
    api.set_job(first, status="succeeded", finished_at=utcnow())
    api.set_job(second, status="running", started_at=utcnow())
    api.publisher.published.clear()
    r = api.client.post(f"/v1/jobs/{parent}/cancel", headers=h)
    assert r.status_code == 202
    assert r.get_json()["cancel_requested"] and r.get_json()["children"]["cancelled"] == 1
    assert [(j.status, j.cancel_requested) for j in api.jobs(parent_id=parent)] == \
           [("succeeded", False), ("running", True), ("cancelled", True)]
    # The parent is published so that the aggregation runs once the running child stops.
    assert api.publisher.published == api.publisher.aggregations == [parent]
    # While its running point stops, the sweep shows how far it got (1 of 3), not its cancelled point as done.
    progress = r.get_json()["progress"]
    assert (progress["done"], progress["total"], progress["fraction"]) == (1, 3, 1 / 3)
    row = api.job_row(parent)
    assert (row.progress_done, row.progress_total) == (1, 3)  # the stored count agrees
    api.set_job(second, status="cancelled", finished_at=utcnow())
    api.set_job(parent, status="cancelled", finished_at=utcnow())
    progress = api.client.get(f"/v1/jobs/{parent}", headers=h).get_json()["progress"]
    assert (progress["done"], progress["total"]) == (1, 3)  # how far it got: one child ran, not 3/3


def test_a_sweep_that_is_aggregating_cannot_be_cancelled(api):
    """Every child is done and a worker has claimed the aggregation (short): a cancel would only throw its
    results away, so it is refused with 409 job-finishing and the flag stays unset. A sweep already
    cancelling (its partial aggregation running) accepts a repeated cancel."""
    h = api.user("ann")
    parent = api.submit(h, kind="sweep", params=small_sweep(2)).get_json()["id"]
    for child in api.jobs(parent_id=parent):
        api.set_job(child.id, status="succeeded", finished_at=utcnow())
    api.set_job(parent, waiting_children=False, attempts=1, worker="gpu-0:7", heartbeat_at=utcnow())  # claimed
    api.publisher.published.clear()
    body = is_problem(api.client.post(f"/v1/jobs/{parent}/cancel", headers=h), 409, "job-finishing")
    assert "aggregating" in body["detail"]
    row = api.job_row(parent)
    assert row.status == "running" and not row.cancel_requested and api.publisher.published == []

    api.set_job(parent, cancel_requested=True)
    assert api.client.post(f"/v1/jobs/{parent}/cancel", headers=h).status_code == 202
    api.set_job(parent, status="succeeded", finished_at=utcnow())
    is_problem(api.client.post(f"/v1/jobs/{parent}/cancel", headers=h), 409, "job-finished")


@pytest.mark.redis
def test_a_sweep_submitted_while_redis_is_down_is_answered_at_once(make_api, redis_server):
    """Each publish against a dead broker costs the retry policy (about a second): the API tries once and
    leaves every child unpublished for the reaper, so a big sweep is still answered promptly (a client
    that timed out would submit it a second time)."""
    from lmscope.api import create_app
    from lmscope.queue import CeleryPublisher

    settings = make_api(broker_url=redis_server.url, max_sweep_points=16, max_active_jobs=100).settings

    class CountingPublisher(CeleryPublisher):
        tries = 0

        def publish(self, job_id, *, aggregation=False):
            CountingPublisher.tries += 1
            super().publish(job_id, aggregation=aggregation)  # against the stopped redis-server: the retry policy, then a refusal

    app = create_app(settings, publisher=CountingPublisher(settings=settings))
    api = Api(app, settings, None)
    api.add_model("m")
    h = api.user("ann")
    redis_server.stop()
    r = api.submit(h, kind="sweep", params=small_sweep(16))
    assert r.status_code == 202, r.get_json()
    children = api.jobs(parent_id=r.get_json()["id"])
    assert len(children) == 16 and all(c.status == "queued" and c.published_at is None for c in children)
    assert CountingPublisher.tries == 1  # one refused try (about a second), not one per child (about 16 s)


def test_cancelling_a_child_publishes_its_parent(api):
    h = api.user("ann")
    parent = api.submit(h, kind="sweep", params=small_sweep(2)).get_json()["id"]
    child = api.jobs(parent_id=parent)[0].id
    api.publisher.published.clear()
    assert api.client.post(f"/v1/jobs/{child}/cancel", headers=h).get_json()["status"] == "cancelled"
    assert api.publisher.published == api.publisher.aggregations == [parent]
    parent_doc = api.client.get(f"/v1/jobs/{parent}", headers=h).get_json()
    assert parent_doc["progress"]["done"] == 1 and parent_doc["progress"]["total"] == 2
    # its progress moved when the child ended, and says so, in the job and in the list alike
    ended = api.client.get(f"/v1/jobs/{child}", headers=h).get_json()["finished_at"]
    assert ended is not None and parent_doc["progress"]["updated_at"] == ended
    listed = {j["id"]: j for j in api.client.get("/v1/jobs", headers=h).get_json()["items"]}
    assert listed[parent]["progress"] == parent_doc["progress"]
    # the stored column too (what SQL users and the metrics read), not only the rendered counts
    row = api.job_row(parent)
    assert (row.progress_done, row.progress_total, row.progress_stage) == (1, 2, "children")


def test_a_sweeps_fraction_counts_how_far_its_running_points_are(api):
    """Four long grid points at 0/4 showed 0 % for their whole run: the fraction counts each running point's own
    fraction (one at 50 % is half a point), in the job, the list and the event stream's snapshot alike; the
    count of points done stays whole; a cancelling sweep's running points stop, so they add nothing."""
    from lmscope.api.events import snapshot

    h = api.user("ann")
    parent = api.submit(h, kind="sweep", params=small_sweep(4)).get_json()["id"]
    kids = [j.id for j in api.jobs(parent_id=parent)]
    api.set_job(parent, status="running")
    api.set_job(kids[0], status="succeeded")
    api.set_job(kids[1], status="running", progress_done=5, progress_total=10)
    api.set_job(kids[2], status="running", progress_done=30, progress_total=20)  # a count past its total: 1
    doc = api.client.get(f"/v1/jobs/{parent}", headers=h).get_json()["progress"]
    assert (doc["done"], doc["total"]) == (1, 4) and doc["fraction"] == pytest.approx((1 + 0.5 + 1.0) / 4)
    listed = {j["id"]: j for j in api.client.get("/v1/jobs", headers=h).get_json()["items"]}
    assert listed[parent]["progress"] == doc
    assert snapshot(api.sessions, parent)["progress"] == doc
    api.set_job(parent, cancel_requested=True)
    assert api.client.get(f"/v1/jobs/{parent}", headers=h).get_json()["progress"]["fraction"] == pytest.approx(1 / 4)


def test_an_unknown_kind_filter_is_refused_with_the_kinds(api):
    """`lmscope jobs --kind nrms` used to print an empty table, as if there were no such jobs."""
    from lmscope.params import KINDS

    h = api.user("ann")
    api.submit(h)
    body = is_problem(api.client.get("/v1/jobs?kind=nrms", headers=h), 422, "validation-error")
    assert "'nrms'" in body["detail"] and body["kinds"] == sorted(KINDS)
    assert "sumformer_fit" in body["detail"]  # child kinds are listed too: they can be filtered on
    assert api.client.get("/v1/jobs?kind=sumformer_fit", headers=h).get_json()["items"] == []
    assert len(api.client.get("/v1/jobs?kind=probe", headers=h).get_json()["items"]) == 1


def test_a_bad_parent_filter_says_none_is_accepted(api):
    h = api.user("ann")
    body = is_problem(api.client.get("/v1/jobs?parent=abc", headers=h), 422, "validation-error")
    assert "'abc'" in body["detail"] and "`none`" in body["detail"]
    assert api.client.get("/v1/jobs?parent=none", headers=h).status_code == 200


def test_a_missing_job_names_the_cli_command_too(api):
    body = is_problem(api.client.get("/v1/jobs/4242", headers=api.user("ann")), 404, "not-found")
    assert "GET /v1/jobs" in body["detail"] and "`lmscope jobs`" in body["detail"]


def test_ids_past_the_id_column_are_unknown_jobs_not_errors(api):
    """Ids are 32-bit INTEGER columns: a larger one used to be a 500 (OverflowError in SQLite,
    "integer out of range" in PostgreSQL)."""
    import base64

    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    assert api.client.get(f"/v1/jobs/{job_id}", headers=h).status_code == 200
    # ids are ASCII digits as written by the API: not "٣" (Arabic-Indic 3) nor "01" for job 1
    for other in (chr(0x0660 + job_id), f"0{job_id}", f"+{job_id}", "9" * 5000):  # 5000 digits: int() raised
        is_problem(api.client.get(f"/v1/jobs/{other}", headers=h), 404, "not-found")
    for big in (2**31, 2**63, 99999999999999999999):
        for path in (f"/v1/jobs/{big}", f"/v1/jobs/{big}/results", f"/v1/jobs/{big}/artifacts",
                     f"/v1/jobs/{big}/artifacts/x", f"/v1/jobs/{big}/events"):
            assert is_problem(api.client.get(path, headers=h), 404, "not-found")["title"] == "Job not found", path
        is_problem(api.client.post(f"/v1/jobs/{big}/cancel", headers=h), 404, "not-found")
        token = base64.urlsafe_b64encode(json.dumps({"before": big}).encode()).decode().rstrip("=")
        body = is_problem(api.client.get(f"/v1/jobs?page_token={token}", headers=h), 422, "validation-error")
        assert body["errors"][0]["loc"] == ["query", "page_token"]
        body = is_problem(api.client.get(f"/v1/jobs?parent={big}", headers=h), 422, "validation-error")
        assert body["errors"][0]["loc"] == ["query", "parent"]
    is_problem(api.client.get(f"/v1/compare?jobs={job_id},{2**31}", headers=h), 404, "not-found")
    for before in ("5", 5.0, True, None):  # only what next_page_token holds: an id
        token = base64.urlsafe_b64encode(json.dumps({"before": before}).encode()).decode()
        is_problem(api.client.get(f"/v1/jobs?page_token={token}", headers=h), 422, "validation-error")
    assert api.client.get(f"/v1/jobs?parent={2**31 - 1}", headers=h).get_json()["items"] == []


def test_query_integers_are_ascii_digits_only(api):
    """int() reads "1_0", " 5" and "٣" (Arabic-Indic three) as numbers; "²" passed isdigit() and then
    failed int() with a 500."""
    h = api.user("ann")
    api.submit(h)
    for query in ("limit=1_0", "limit=%D9%A3", "limit=%20%205", "limit=5.0", "limit=-1", "limit=0", "limit=501",
                  "limit=", "parent=%C2%B2", "parent=1_0", "parent=%D9%A3", "parent=-3"):
        name = query.split("=")[0]
        body = is_problem(api.client.get(f"/v1/jobs?{query}", headers=h), 422, "validation-error")
        assert body["errors"][0]["loc"] == ["query", name], query
    assert len(api.client.get("/v1/jobs?limit=07", headers=h).get_json()["items"]) == 1


def test_unknown_and_repeated_query_parameters_are_refused(api):
    """A misspelt filter (`stauts=running`) used to be ignored: the answer listed every job."""
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    body = is_problem(api.client.get("/v1/jobs?stauts=running", headers=h), 422, "validation-error")
    assert "'stauts'" in body["detail"] and "did you mean 'status'?" in body["detail"]
    assert body["errors"] == [{"loc": ["query", "stauts"], "msg": "unknown query parameter", "type": "extra_forbidden"}]
    assert body["allowed"] == ["kind", "status", "tag", "parent", "user", "limit", "page_token"]
    # an endpoint that reads none says so
    body = is_problem(api.client.get(f"/v1/jobs/{job_id}?verbose=1", headers=h), 422, "validation-error")
    assert "reads no query parameters" in body["detail"]
    # a single-valued parameter given twice would keep one of the values silently
    body = is_problem(api.client.get("/v1/jobs?kind=probe&kind=train", headers=h), 422, "validation-error")
    assert body["errors"][0]["loc"] == ["query", "kind"] and "2 times" in body["detail"]
    # repeatable ones stay repeatable
    r = api.client.get(f"/v1/jobs/{job_id}/results?series=a&series=b", headers=h)
    assert r.status_code == 200 and r.get_json()["missing"] == ["a", "b"]


def test_the_user_filter_names_a_user_that_exists_and_is_for_admins(api):
    ann, root = api.user("ann"), api.user("root", admin=True)
    api.user("bob")
    api.submit(ann)
    body = is_problem(api.client.get("/v1/jobs?user=an", headers=root), 422, "validation-error")
    assert "no user 'an'" in body["detail"] and "did you mean 'ann'?" in body["detail"]
    assert len(api.client.get("/v1/jobs?user=ann", headers=root).get_json()["items"]) == 1
    # not an admin: someone else's name is refused (it used to be dropped, listing the caller's jobs)
    body = is_problem(api.client.get("/v1/jobs?user=bob", headers=ann), 403, "forbidden")
    assert "only admins" in body["detail"]
    is_problem(api.client.get("/v1/jobs?user=nobody", headers=ann), 403, "forbidden")  # no hint who exists
    assert len(api.client.get("/v1/jobs?user=ann", headers=ann).get_json()["items"]) == 1


def test_control_characters_in_query_and_path_are_refused(api):
    """NUL in a filter used to be a 500 on PostgreSQL (DataError) and was stored or matched on SQLite."""
    h, root = api.user("ann"), api.user("root", admin=True)
    job_id = api.submit(h).get_json()["id"]
    for path, loc in (("/v1/jobs?tag=%00", ["query", "tag"]), ("/v1/jobs?kind=a%00", ["query", "kind"]),
                      ("/v1/jobs?user=a%00", ["query", "user"]), ("/v1/jobs?tag=a%0Ab", ["query", "tag"]),
                      (f"/v1/jobs/{job_id}/results?series=a%00", ["query", "series"]),
                      (f"/v1/jobs/{job_id}/artifacts/a%00", ["path", "name"])):
        body = is_problem(api.client.get(path, headers=root), 422, "validation-error")
        assert body["errors"][0]["loc"] == loc and "U+00" in body["errors"][0]["msg"], path


def test_a_doubled_slash_in_an_artifact_name_is_a_404_problem(api):
    """`%2Fetc%2Fpasswd` decodes to `//etc/passwd`: werkzeug answered with an HTML redirect to another path."""
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    r = api.client.get(f"/v1/jobs/{job_id}/artifacts/%2Fetc%2Fpasswd", headers=h)
    assert is_problem(r, 404, "not-found") and "Location" not in r.headers
    is_problem(api.client.get("//v1/jobs", headers=h), 404, "not-found")


def test_a_path_with_something_that_is_not_a_job_id_says_what_a_job_id_is(api):
    h = api.user("ann")
    for path, segment in (("/v1/jobs/-1", "-1"), ("/v1/jobs/abc", "abc"), ("/v1/jobs/1.5/results", "1.5"),
                          ("/v1/jobs/+3/cancel", "+3")):
        response = api.client.post(path, headers=h) if path.endswith("cancel") else api.client.get(path, headers=h)
        detail = is_problem(response, 404, "not-found")["detail"]
        assert f"job ids are whole numbers from 1 ({segment!r} is not one)" in detail, (path, detail)
    # a job id with a path under it that does not exist is not told its id is wrong
    job_id = api.submit(h).get_json()["id"]
    detail = is_problem(api.client.get(f"/v1/jobs/{job_id}/nope", headers=h), 404, "not-found")["detail"]
    assert "job ids" not in detail and "/openapi.json" in detail
