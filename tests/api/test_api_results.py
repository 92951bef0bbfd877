"""Results, artifacts and the event stream of a job."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

from sqlalchemy import insert

from lmscope.db.models import Artifact, Series, utcnow

from .conftest import add_results, is_problem


def test_results_filtered_by_series(api):
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    add_results(api, job_id, {})
    all_ = api.client.get(f"/v1/jobs/{job_id}/results", headers=h).get_json()
    assert [s["name"] for s in all_["series"]] == ["norm.mean", "norm.std", "entropy.head"]
    assert all_["series"][0] == {"name": "norm.mean", "labels": {"layer": None}, "x": [0, 1, 2], "y": [1.0, 1.5, 2.25],
                                 "x_meaning": "hidden state h_l (l = 0: embedding output, l: output of block l)"}
    assert all_["series"][2]["x_meaning"] == "training step"  # entropy.*: one point per model
    one = api.client.get(f"/v1/jobs/{job_id}/results?series=norm.std&series=entropy.head", headers=h).get_json()
    assert [s["name"] for s in one["series"]] == ["norm.std", "entropy.head"]
    prefix = api.client.get(f"/v1/jobs/{job_id}/results?series=norm.*", headers=h).get_json()
    assert [s["name"] for s in prefix["series"]] == ["norm.mean", "norm.std"]


def test_a_large_jobs_series_come_in_pages_of_whole_series(api, monkeypatch):
    """Whole series up to RESULT_PAGE_POINTS x values per answer (a series alone may pass it: it is never
    split), next_page_token continuing in order; together, the pages are the one-answer result, and a
    missing name is said on every page."""
    from lmscope.api import results

    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    add_results(api, job_id, {})  # norm.mean (3 points), norm.std (3), entropy.head (1)
    whole = api.client.get(f"/v1/jobs/{job_id}/results", headers=h).get_json()
    assert whole["next_page_token"] is None

    def pages(query: str) -> list[list[str]]:
        names, token = [], None
        while True:
            doc = api.client.get(f"/v1/jobs/{job_id}/results?{query}" + (f"&page_token={token}" if token else ""),
                                 headers=h).get_json()
            names.append([s["name"] for s in doc["series"]])
            if query.startswith("series=nope"):
                assert doc["missing"] == ["nope"]
            if not (token := doc["next_page_token"]):
                return names, doc

    monkeypatch.setattr(results, "RESULT_PAGE_POINTS", 4)
    assert pages("")[0] == [["norm.mean"], ["norm.std", "entropy.head"]]  # 3, then 3 + 1
    monkeypatch.setattr(results, "RESULT_PAGE_POINTS", 2)
    got, _ = pages("")
    assert got == [["norm.mean"], ["norm.std"], ["entropy.head"]]  # each of 3 points over the 2 on its own
    assert [n for page in got for n in page] == [s["name"] for s in whole["series"]]
    assert pages("series=nope&series=norm.*")[0] == [["norm.mean"], ["norm.std"]]
    # a row stored without its count (a worker of an older lmscope during an upgrade): sized by its x
    with api.sessions.begin() as session:
        session.execute(insert(Series).values(job_id=job_id, name="old.curve", labels={}, x=[0] * 5, y=[0] * 5,
                                              points=None))
    monkeypatch.setattr(results, "RESULT_PAGE_POINTS", 6)
    assert pages("")[0] == [["norm.mean", "norm.std"], ["entropy.head", "old.curve"]]  # 3 + 3, then 1 + 5
    monkeypatch.setattr(results, "RESULT_PAGE_POINTS", 5)
    assert pages("")[0] == [["norm.mean"], ["norm.std", "entropy.head"], ["old.curve"]]  # not 0 points
    bad = api.client.get(f"/v1/jobs/{job_id}/results?page_token=abc", headers=h)
    assert is_problem(bad, 422, "validation-error")["errors"][0]["loc"] == ["query", "page_token"]


def test_artifacts_list_and_download(api):
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
    npz = b"PK\x03\x04" + b"\x00" * 300
    add_results(api, job_id, {"plots/norms.png": png, "trajectories.npz": npz})
    items = api.client.get(f"/v1/jobs/{job_id}/artifacts", headers=h).get_json()["items"]
    assert [(a["name"], a["size"], a["sha256"]) for a in items] == [
        ("plots/norms.png", len(png), hashlib.sha256(png).hexdigest()),
        ("trajectories.npz", len(npz), hashlib.sha256(npz).hexdigest())]
    for item, data in zip(items, (png, npz)):
        r = api.client.get(item["url"], headers=h)
        assert r.status_code == 200 and r.data == data and r.mimetype == item["media_type"]
    is_problem(api.client.get(f"/v1/jobs/{job_id}/artifacts/nope.png", headers=h), 404, "not-found")


def test_only_passive_artifacts_are_shown_inline(api):
    """A PNG or JSON opens in the browser; an SVG or HTML file (scripts that would run on the API's origin)
    and bytes are downloads; no answer lets a browser guess another type."""
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    add_results(api, job_id, {"a.png": b"\x89PNG\r\n\x1a\n", "b.json": b"{}",
                              "c.svg": b"<svg xmlns='http://www.w3.org/2000/svg'><script>alert(1)</script></svg>",
                              "d.html": b"<script>alert(1)</script>", "e.npz": b"PK"})
    disposition = {}
    for name in ("a.png", "b.json", "c.svg", "d.html", "e.npz"):
        r = api.client.get(f"/v1/jobs/{job_id}/artifacts/{name}", headers=h)
        assert r.status_code == 200 and r.headers["X-Content-Type-Options"] == "nosniff"
        disposition[name] = r.headers["Content-Disposition"].split(";")[0]
    assert disposition == {"a.png": "inline", "b.json": "inline", "c.svg": "attachment", "d.html": "attachment",
                           "e.npz": "attachment"}
    assert api.client.get("/v1/jobs", headers=h).headers["X-Content-Type-Options"] == "nosniff"


def test_artifact_paths_cannot_escape_the_job_folder(api):
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    secret = api.settings.artifact_dir / "secret.txt"
    # The job folder exists, so a plain join of jobs/<id>/../../secret.txt would reach the file.
    (api.settings.artifact_dir / "jobs" / str(job_id)).mkdir(parents=True)
    secret.write_text("do not serve")
    # Even a recorded name that climbs out (a corrupt or hostile row) is not served.
    with api.sessions.begin() as session:
        session.add(Artifact(job_id=job_id, name="../../secret.txt", media_type="text/plain", size=12, sha256="0" * 64))
    for path in ("../../secret.txt", "..%2F..%2Fsecret.txt", "%2E%2E/%2E%2E/secret.txt"):
        r = api.client.get(f"/v1/jobs/{job_id}/artifacts/{path}", headers=h)
        assert r.status_code == 404 and b"do not serve" not in r.data


def parse_events(text: str) -> list[tuple[str, dict]]:
    """(event, data) of each complete event in an SSE text (comments and `retry:` left out)."""
    return [(e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1].removeprefix("data: ")))
            for e in text.split("\n\n")[:-1] if e.startswith("event:")]


def test_events_stream_until_terminal(api):
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    api.app.config["LMSCOPE_SSE_POLL_SECONDS"] = 0.05
    # The stream reports what it sees at each poll, so the "worker" changes the row only once the stream
    # has sent the previous state (however slow the machine): each intermediate state must be streamed.
    seen = {key: threading.Event() for key in ("queued", "running", (1, 2), (2, 2))}
    waited_in_vain = []

    def after(key):
        if not seen[key].wait(10):
            waited_in_vain.append(key)  # go on: the stream then ends without it and the asserts say so

    def worker():  # what a worker does to the row, a little later
        after("queued")
        api.set_job(job_id, status="running", attempts=1, started_at=utcnow())
        after("running")
        for done in (1, 2):
            api.set_job(job_id, progress_done=done, progress_total=2, progress_stage="forward")
            after((done, 2))
        api.set_job(job_id, status="succeeded", finished_at=utcnow(), summary={"layers": 4})

    thread = threading.Thread(target=worker)
    thread.start()
    r = api.client.get(f"/v1/jobs/{job_id}/events?timeout=20", headers=h)
    try:
        assert r.status_code == 200 and r.mimetype == "text/event-stream"
        text = ""
        for chunk in r.response:  # read as it is streamed (it polls SQL) while the "worker" runs
            text += chunk.decode() if isinstance(chunk, bytes) else chunk
            for kind, data in parse_events(text):
                if kind == "status" and data["status"] in seen:
                    seen[data["status"]].set()
                elif kind == "progress" and (data["done"], data["total"]) in seen:
                    seen[data["done"], data["total"]].set()
    finally:
        r.close()
        for event in seen.values():  # a failed assert above must not leave the thread waiting
            event.set()
        thread.join()
    events = parse_events(text)
    kinds = [k for k, _ in events]
    assert [d["status"] for k, d in events if k == "status"] == ["queued", "running", "succeeded"]
    assert [(d["done"], d["total"]) for k, d in events if k == "progress"] == [(1, 2), (2, 2)]
    # it ended at the terminal state, not at its timeout (which sends `timeout` and no `end`)
    assert kinds[-1] == "end" and events[-1][1]["status"] == "succeeded" and events[-1][1]["summary"] == {"layers": 4}
    assert waited_in_vain == []


def test_a_jobs_last_progress_comes_before_its_terminal_status(api):
    """The worker writes the last progress with the terminal status; a client that stops at that status (as
    the trial's did) missed the progress when the stream sent the status first."""
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    api.set_job(job_id, status="succeeded", attempts=1, started_at=utcnow(), finished_at=utcnow(),
                progress_done=5, progress_total=5, progress_stage="plots")
    r = api.client.get(f"/v1/jobs/{job_id}/events?timeout=5", headers=h)
    events = parse_events(r.get_data(as_text=True))
    assert [k for k, _ in events] == ["progress", "status", "end"]
    assert (events[0][1]["done"], events[0][1]["total"]) == (5, 5) and events[1][1]["status"] == "succeeded"


def test_events_stream_is_bounded(api):
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    api.app.config["LMSCOPE_SSE_POLL_SECONDS"] = 0.05
    r = api.client.get(f"/v1/jobs/{job_id}/events?timeout=0.3", headers=h)
    text = r.get_data(as_text=True)
    assert "event: status" in text and "event: timeout" in text and "event: end" not in text



def test_events_timeout_must_be_a_positive_number_of_seconds(api):
    """`timeout=nan` was accepted and never timed out (min(nan, 3600) is nan); 0 and -5 were accepted."""
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    for bad in ("nan", "inf", "-5", "0", "3601", "1e3", "1_0", "%205", ""):
        body = is_problem(api.client.get(f"/v1/jobs/{job_id}/events?timeout={bad}", headers=h), 422, "validation-error")
        assert body["errors"][0]["loc"] == ["query", "timeout"] and "at most 3600" in body["detail"], bad


def test_artifacts_download_when_the_artifact_dir_is_relative(make_api, tmp_path, monkeypatch):
    """A relative artifact folder (e.g. `LMSCOPE_DATA_DIR=.demo`): the files are found, not a 500."""
    monkeypatch.chdir(tmp_path)
    api = make_api(artifact_dir=Path("relative-data/artifacts"))
    api.add_model("m")
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    png = b"\x89PNG\r\n\x1a\n" + b"\x01" * 64
    add_results(api, job_id, {"norms.png": png})
    r = api.client.get(f"/v1/jobs/{job_id}/artifacts/norms.png", headers=h)
    assert r.status_code == 200 and r.data == png


def test_a_series_name_that_matches_nothing_lists_the_names_that_exist(api):
    """`--series nonexistent` used to answer an empty list, indistinguishable from a job without series."""
    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    add_results(api, job_id, {})
    r = api.client.get(f"/v1/jobs/{job_id}/results?series=norm.mean&series=nrm.std&series=attn.*", headers=h).get_json()
    assert [s["name"] for s in r["series"]] == ["norm.mean"]
    assert r["missing"] == ["nrm.std", "attn.*"]
    assert r["available"] == ["entropy.head", "norm.mean", "norm.std"]
    # Everything found: no such fields.
    assert "missing" not in api.client.get(f"/v1/jobs/{job_id}/results?series=norm.*", headers=h).get_json()


def test_compare_joins_jobs_on_both_databases(api):
    h = api.user("ann")
    api.add_model("m2")
    a = api.submit(h, params={"model": "m"}).get_json()["id"]
    b = api.submit(h, params={"model": "m2"}).get_json()["id"]
    add_results(api, a, {})
    with api.sessions.begin() as session:
        session.add(Series(job_id=b, name="norm.mean", labels={"layer": None}, x=[0, 1], y=[2.0, 3.0]))
    api.set_job(a, status="succeeded", summary={"pair_pct": 75.0, "layers": 3})
    api.set_job(b, status="succeeded", summary={"pair_pct": 80.0, "layers": 3})
    doc = api.client.get(f"/v1/compare?jobs={a},{b}&series=norm.*", headers=h).get_json()
    assert [j["id"] for j in doc["jobs"]] == [a, b]
    assert doc["params"] == {"model": {str(a): "m", str(b): "m2"}}  # only what differs
    assert doc["summary"] == {"pair_pct": {str(a): 75.0, str(b): 80.0}, "layers": {str(a): 3, str(b): 3}}
    assert doc["shared_series"] == ["norm.mean"]
    mean = next(s for s in doc["series"] if s["name"] == "norm.mean")
    assert mean["jobs"] == {str(a): {"x": [0, 1, 2], "y": [1.0, 1.5, 2.25]}, str(b): {"x": [0, 1], "y": [2.0, 3.0]}}
    std = next(s for s in doc["series"] if s["name"] == "norm.std")
    assert list(std["jobs"]) == [str(a)]
    # repeated `jobs`, and a series nobody has
    again = api.client.get(f"/v1/compare?jobs={a}&jobs={b}&series=nope", headers=h).get_json()
    assert again["series"] == [] and again["missing"] == ["nope"]


def test_compare_refuses_bad_job_lists_and_other_users_jobs(api):
    h = api.user("ann")
    a = api.submit(h).get_json()["id"]
    b = api.submit(h).get_json()["id"]
    for query in (f"jobs={a}", f"jobs={a},{a}", "jobs=x,y", "", "jobs=" + ",".join(map(str, range(1, 23))),
                  f"jobs=²,{a}", f"jobs={a},{'9' * 25}"):
        body = is_problem(api.client.get(f"/v1/compare?{query}", headers=h), 422, "validation-error")
        assert body["errors"][0]["loc"] == ["query", "jobs"] and "jobs=3,5" in body["detail"]
    body = is_problem(api.client.get(f"/v1/compare?jobs={a},x", headers=h), 422, "validation-error")
    assert body["detail"].endswith("; 'x' is not a job id")  # the value to change, named
    assert "'x', 'y' are not" in is_problem(api.client.get("/v1/compare?jobs=x,y", headers=h), 422, "validation-error")["detail"]
    theirs = api.submit(api.user("bob")).get_json()["id"]
    is_problem(api.client.get(f"/v1/compare?jobs={a},{theirs}", headers=h), 404, "not-found")
    assert api.client.get(f"/v1/compare?jobs={a},{b}", headers=h).status_code == 200


def test_compare_refuses_an_answer_too_large_to_use(api, monkeypatch):
    from lmscope.api import results

    h = api.user("ann")
    a, b = (api.submit(h).get_json()["id"] for _ in range(2))
    for job_id in (a, b):
        add_results(api, job_id, {})  # three curves each
    monkeypatch.setattr(results, "MAX_COMPARED_SERIES", 5)
    body = is_problem(api.client.get(f"/v1/compare?jobs={a},{b}&series=*", headers=h), 422, "too-many-series")
    assert "matches 6 curves of 14 points in all over these jobs, more than 5 curves" in body["detail"]
    assert "name fewer series" in body["detail"] and (body["curves"], body["points"]) == (6, 14)
    assert api.client.get(f"/v1/compare?jobs={a},{b}&series=norm.*", headers=h).status_code == 200
    # few curves of many points: norm.* is 4 curves of 3 + 3 points each, 12 in all
    monkeypatch.setattr(results, "MAX_COMPARED_SERIES", 5000)
    monkeypatch.setattr(results, "MAX_COMPARED_POINTS", 11)
    body = is_problem(api.client.get(f"/v1/compare?jobs={a},{b}&series=norm.*", headers=h), 422, "too-many-series")
    assert "4 curves of 12 points in all" in body["detail"] and "or 11 points" in body["detail"]
    monkeypatch.setattr(results, "MAX_COMPARED_POINTS", 12)
    assert api.client.get(f"/v1/compare?jobs={a},{b}&series=norm.*", headers=h).status_code == 200


def test_events_stream_rides_out_a_database_outage(api, monkeypatch):
    """The database stopped under a watched job: the stream ended in a server traceback (an OperationalError
    from its poll). It says `unavailable` once, keeps the connection, and goes on to the end when it answers."""
    from sqlalchemy.exc import OperationalError

    from lmscope.api import events

    h = api.user("ann")
    job_id = api.submit(h).get_json()["id"]
    api.app.config["LMSCOPE_SSE_POLL_SECONDS"] = 0.01
    monkeypatch.setattr(events, "OUTAGE_POLL_SECONDS", 0.01)
    real, calls = events.snapshot, []

    def flaky(sessions, job):
        calls.append(job)
        if 2 <= len(calls) <= 4:  # the second to fourth polls: the database is down
            raise OperationalError("SELECT", {}, Exception("server closed the connection unexpectedly"))
        if len(calls) == 6:
            api.set_job(job_id, status="succeeded", finished_at=utcnow())
        return real(sessions, job)

    monkeypatch.setattr(events, "snapshot", flaky)
    text = api.client.get(f"/v1/jobs/{job_id}/events?timeout=20", headers=h).get_data(as_text=True)
    kinds = [k for k, _ in parse_events(text)]
    assert kinds.count("unavailable") == 1 and kinds[-1] == "end", kinds
    assert kinds.index("unavailable") < kinds.index("end")


def test_event_streams_are_limited_per_user_and_per_process(make_api):
    """Each open stream holds a server thread: a user's streams past their limit, and anyone's past the
    process's, are 429 too-many-streams (saying which limit), the rest of the API still answers, and a
    stream closed gives its slot back."""
    api = make_api(max_event_streams=3, max_event_streams_per_user=2)
    api.add_model("m")
    ann, bob = api.user("ann"), api.user("bob")
    ann_job = api.submit(ann).get_json()["id"]
    bob_job = api.submit(bob).get_json()["id"]

    def stream(headers, job_id):
        return api.client.get(f"/v1/jobs/{job_id}/events?timeout=60", headers=headers)

    opened = [stream(ann, ann_job), stream(ann, ann_job)]
    try:
        assert [r.status_code for r in opened] == [200, 200]
        third = is_problem(stream(ann, ann_job), 429, "too-many-streams")
        assert "LMSCOPE_MAX_EVENT_STREAMS_PER_USER=2" in third["detail"] and f"/v1/jobs/{ann_job}" in third["detail"]
        opened.append(stream(bob, bob_job))
        assert opened[-1].status_code == 200  # bob has his own two; the process has one more
        full = stream(bob, bob_job)
        assert is_problem(full, 429, "too-many-streams")["detail"].startswith("this server holds 3 event streams")
        assert full.headers["Retry-After"] == "30"
        assert api.client.get("/v1/me", headers=ann).status_code == 200  # the rest of the API answers
        closed = opened.pop(0)
        closed.close()
        closed.close()  # closed twice, given back once
        opened.append(stream(ann, ann_job))
        assert opened[-1].status_code == 200  # the closed stream's slot was given back
        is_problem(stream(ann, ann_job), 429, "too-many-streams")  # and only it
    finally:
        for r in opened:
            r.close()
    assert all(stream(h, j).status_code == 200 for h, j in ((ann, ann_job), (bob, bob_job)))
