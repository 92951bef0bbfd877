"""lmscope.client.Client against the API on a real port (werkzeug's threaded server)."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from types import SimpleNamespace

import pytest

from lmscope.client import Client, LmscopeError
from lmscope.db.models import Artifact, Series, utcnow

from tests.api.conftest import small_sweep
from tests.conftest import free_port
from tests.worker.helpers import wait_until


@pytest.fixture
def db_url(sqlite_url):
    """SQLite only: these tests are about HTTP plumbing; the SQL behind it is tested on both databases."""
    return sqlite_url


@pytest.fixture
def ann(api, live):
    api.user("ann")
    return Client(live.url, api.tokens["ann"])


def test_errors_carry_the_problem(api, live, ann):
    with pytest.raises(LmscopeError) as e:
        ann.submit("probe", {"model": "m", "dtype": "float64"})
    assert e.value.status == 422 and e.value.type.endswith("/validation-error")
    assert [x["loc"] for x in e.value.errors] == [["params", "dtype"]]
    assert str(e.value).startswith("Invalid parameters for kind 'probe': fix these fields: params.dtype")
    assert "\n" not in str(e.value)  # the detail says each field already: once
    # a field message the detail does not hold is said too: an unknown kind's list of the kinds
    with pytest.raises(LmscopeError) as e:
        ann.submit("nrms", {})
    headline, fields = str(e.value).split("\n")
    assert headline.startswith("Unknown job kind: kind 'nrms' does not exist; did you mean 'norms'?")
    from lmscope.params import KINDS

    assert fields == "  kind: unknown kind; the kinds are " + ", ".join(sorted(k for k, s in KINDS.items() if s.submittable))
    with pytest.raises(LmscopeError) as e:
        ann.get(424242)
    assert e.value.status == 404 and str(e.value).startswith("Job not found: there is no job 424242")
    with pytest.raises(LmscopeError) as e:
        Client(live.url, "lms_not-a-token").get(1)
    assert e.value.status == 401 and "Invalid token" in str(e.value)


def test_unreachable_server_is_status_0_with_a_hint():
    with pytest.raises(LmscopeError) as e:
        Client(f"http://127.0.0.1:{free_port()}", "t", timeout=2).get(1)
    assert e.value.status == 0 and "LMSCOPE_URL" in str(e.value)


def test_client_defaults_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("LMSCOPE_URL", "http://example.invalid:1/")
    monkeypatch.setenv("LMSCOPE_TOKEN", "lms_x")
    c = Client()
    assert c.url == "http://example.invalid:1" and c.http.headers["Authorization"] == "Bearer lms_x"


def test_a_token_a_header_cannot_carry_is_refused_up_front(api, live, monkeypatch):
    """A control character or one outside Latin-1 raised InvalidHeader / UnicodeEncodeError at the first
    request; a token pasted with its newline (or spaces) works."""
    for token, shown in (("lms_a\rb", r"'\r' at position 5"), ("lms_\x1b[0m", r"'\x1b' at position 4"),
                         ("lms_€", "'€' at position 4")):
        says = f"the token holds a character a header cannot carry ({shown})"
        with pytest.raises(LmscopeError, match=re.escape(says)):
            Client(live.url, token)
        monkeypatch.setenv("LMSCOPE_TOKEN", token)
        with pytest.raises(LmscopeError, match="LMSCOPE_TOKEN holds a character .*copy the token again") as e:
            Client(live.url)
        assert e.value.status == 0
    api.user("ann")
    monkeypatch.setenv("LMSCOPE_TOKEN", f" {api.tokens['ann']}\r\n")
    assert Client(live.url).me()["name"] == "ann"


def test_submit_list_cancel_and_idempotency(api, ann):
    ids = [ann.submit("probe", {"model": "m"}, tags=["t"])["id"] for _ in range(3)]
    again = ann.submit("probe", {"model": "m"}, idempotency_key="k")
    assert ann.submit("probe", {"model": "m"}, idempotency_key="k")["id"] == again["id"]
    listed = [j["id"] for j in ann.list(page_size=2)]  # four jobs over two pages
    assert listed == sorted(ids + [again["id"]], reverse=True)
    assert [j["id"] for j in ann.list(tag="t")] == sorted(ids, reverse=True)
    assert ann.cancel(ids[0])["status"] == "cancelled"
    assert [j["id"] for j in ann.list(status="cancelled")] == [ids[0]]


def test_one_tag_a_list_of_statuses_and_bad_job_ids_mean_what_a_researcher_meant(api, ann):
    """A string is one tag (not one per letter); a list of statuses is any of them; compare wants a list of ids."""
    tagged = ann.submit("probe", {"model": "m"}, tags="smoke")
    assert tagged["tags"] == ["smoke"] and [j["id"] for j in ann.list(tag="smoke")] == [tagged["id"]]
    other = ann.submit("probe", {"model": "m"})["id"]
    ann.cancel(other)
    assert [j["id"] for j in ann.list(status=["queued", "cancelled"])] == [other, tagged["id"]]
    assert ann.compare(j["id"] for j in ann.list()).ids == [other, tagged["id"]]  # a generator of ids is fine
    for wrong in (tagged["id"], f"{tagged['id']},{other}", [str(other)], 1.5):
        with pytest.raises(TypeError, match=r"list of job ids, e.g. compare\(\[12, 14\]\)"):
            ann.compare(wrong)


def test_numpy_and_torch_values_are_sent_as_numbers_and_nan_names_its_field(api, ann):
    """A notebook's params hold numpy and torch numbers; the server gets their Python values. NaN and
    Infinity, which JSON cannot carry, are refused before anything is sent, naming the field."""
    import json

    import numpy as np
    import torch

    from lmscope.client import json_body

    values = {"a": np.int64(7), "b": np.float32(0.5), "c": np.arange(3), "d": torch.tensor(2.5), "e": np.bool_(True),
              "f": (1, "x", None), "g": {"h": [np.float64(1.25), torch.tensor([1, 2])]}}
    assert json.loads(json_body(values)) == {"a": 7, "b": 0.5, "c": [0, 1, 2], "d": 2.5, "e": True,
                                             "f": [1, "x", None], "g": {"h": [1.25, [1, 2]]}}
    job = ann.submit("norms", {"model": "m", "dataset": "d", "max_samples": np.int64(10),
                               "loss_filter": np.float32(0.5), "seed": torch.tensor(3)})
    assert (job["params"]["max_samples"], job["params"]["loss_filter"], job["params"]["seed"]) == (10, 0.5, 3)
    before = len(api.jobs())
    for bad, shown in ((float("nan"), "nan"), (np.float32("inf"), "inf"), (torch.tensor(-float("inf")), "-inf")):
        with pytest.raises(LmscopeError) as e:
            ann.submit("norms", {"model": "m", "dataset": "d", "loss_filter": bad})
        assert e.value.status == 0 and e.value.errors[0]["loc"] == ["params", "loss_filter"]
        assert str(e.value).startswith(f"Invalid value: params.loss_filter is {shown}, which JSON cannot carry")
    assert "\n" not in str(e.value)  # the field's message is the detail's: said once
    with pytest.raises(LmscopeError, match=r"^Invalid value: params.layers is a builtins.set, which JSON cannot carry"):
        ann.submit("norms", {"model": "m", "dataset": "d", "layers": {1, 2}})
    with pytest.raises(LmscopeError, match=r"^Invalid value: params.x is a numpy.longdouble"):  # its tolist is itself
        ann.submit("norms", {"model": "m", "dataset": "d", "x": np.longdouble(0.5)})
    looped = []
    looped.append(looped)
    with pytest.raises(LmscopeError, match=r"^Invalid value: params.x.0 is a list or object that holds itself"):
        ann.submit("norms", {"model": "m", "dataset": "d", "x": looped})
    assert len(api.jobs()) == before  # nothing was sent


def test_a_quota_answer_says_when_to_retry(api, ann):
    for _ in range(api.settings.max_active_jobs):
        ann.submit("probe", {"model": "m"})
    with pytest.raises(LmscopeError) as e:
        ann.submit("probe", {"model": "m"})
    assert e.value.status == 429 and e.value.type.endswith("/quota-exceeded")
    assert e.value.retry_after is not None and e.value.retry_after > 0
    assert e.value.retry_after == int(e.value.headers["retry-after"])  # the headers' names in any case
    import pickle

    again = pickle.loads(pickle.dumps(e.value))  # as a process pool hands it back
    assert (again.status, again.problem, again.retry_after, str(again)) == (429, e.value.problem, e.value.retry_after,
                                                                           str(e.value))


def test_several_kinds_a_large_page_size_and_top_level_jobs(api, ann):
    probe = ann.submit("probe", {"model": "m"})["id"]
    norms = ann.submit("norms", {"model": "m", "dataset": "d"})["id"]
    entropy = ann.submit("entropy", {"model": "m", "dataset": "d"})["id"]
    assert [j["id"] for j in ann.list(kind=["probe", "entropy"])] == [entropy, probe]
    assert [j["id"] for j in ann.list(kind="norms,probe")] == [norms, probe]
    with pytest.raises(LmscopeError) as e:  # every kind is checked: a typo would list nothing
        list(ann.list(kind=["probe", "nrms"]))
    assert e.value.status == 422 and "there is no job kind 'nrms'; did you mean 'norms'?" in str(e.value)
    # the page size is how many each request brings; more than the API's 500 is no error
    from lmscope.api.jobs import MAX_LIMIT
    from lmscope.client import MAX_JOB_PAGE

    assert MAX_JOB_PAGE == MAX_LIMIT  # the client's copy (it imports nothing of the server)
    assert [j["id"] for j in ann.list(page_size=10_000)] == [entropy, norms, probe]
    ann.cancel(probe)
    ann.cancel(norms)
    sweep = ann.submit("sweep", small_sweep(2))["id"]
    assert [j["id"] for j in ann.list(parent="none")] == [sweep, entropy, norms, probe]  # not the sweep's children
    assert len(list(ann.list())) == 6
    # spaces and empty parts in a comma-separated filter are as if left out
    assert [j["id"] for j in ann.list(kind=" probe, norms,", status="cancelled,")] == [norms, probe]


def test_wait_reports_progress_and_times_out(api, ann):
    job_id = ann.submit("probe", {"model": "m"})["id"]
    with pytest.raises(TimeoutError):
        ann.wait(job_id, timeout=0.2, poll=0.05)

    def worker():
        for done in range(1, 4):
            time.sleep(0.15)
            api.set_job(job_id, status="running", progress_done=done, progress_total=3, progress_stage="s")
        saw_running.wait(10)  # finish only once a poll has seen the job running, however slow the machine
        api.set_job(job_id, status="succeeded", finished_at=utcnow(), summary={"ok": 1})

    def on_progress(j):
        seen.append((j["status"], (j["progress"] or {}).get("done")))
        if j["status"] == "running":
            saw_running.set()

    saw_running, seen = threading.Event(), []
    thread = threading.Thread(target=worker)
    thread.start()
    final = ann.wait(job_id, on_progress=on_progress, timeout=20, poll=0.05)
    thread.join()
    assert final["status"] == "succeeded" and final["summary"] == {"ok": 1}
    assert seen[0] == ("queued", None) and seen[-1][0] == "succeeded"
    assert any(s == "running" for s, _ in seen)
    assert [d for s, d in seen if s == "running"] == sorted({d for s, d in seen if s == "running"})


def test_wait_reports_a_queued_jobs_place_as_it_moves_up(api, ann):
    first, job_id = ann.submit("probe", {"model": "m"})["id"], ann.submit("probe", {"model": "m"})["id"]
    seen, moved = [], threading.Event()

    def on_progress(j):
        seen.append((j["status"], j.get("queue")))
        if len(seen) == 2:
            moved.set()

    def worker():
        wait_until(lambda: seen, timeout=10, what="the first report")
        ann.cancel(first)  # the job ahead leaves the queue
        moved.wait(10)
        api.set_job(job_id, status="succeeded", finished_at=utcnow())

    thread = threading.Thread(target=worker)
    thread.start()
    ann.wait(job_id, on_progress=on_progress, timeout=20, poll=0.05)
    thread.join()
    assert seen == [("queued", {"ahead": 1, "running": 0}), ("queued", {"ahead": 0, "running": 0}),
                    ("succeeded", None)]


def test_wait_reports_a_sweeps_children_as_the_broker_takes_them(api, ann):
    """A sweep submitted while the broker was down: its progress does not move when the reaper hands its
    children over, but what `wait` reports (the CLI's line) must."""
    from .conftest import small_sweep
    api.publisher.fail = True
    sweep = ann.submit("sweep", small_sweep(2))["id"]
    api.publisher.fail = False
    seen, reported = [], threading.Event()

    def on_progress(j):
        seen.append((j["status"], j.get("children_unsent")))
        reported.set()

    def reaper():
        reported.wait(10)
        reported.clear()
        for kid in api.jobs(parent_id=sweep):  # published, as the reaper marks them
            api.set_job(kid.id, published_at=utcnow())
        reported.wait(10)
        api.set_job(sweep, status="succeeded", finished_at=utcnow())

    thread = threading.Thread(target=reaper)
    thread.start()
    ann.wait(sweep, on_progress=on_progress, timeout=20, poll=0.05)
    thread.join()
    assert seen == [("running", 2), ("running", None), ("succeeded", None)]


def test_results_download_and_fetch(api, ann, tmp_path):
    job_id = ann.submit("probe", {"model": "m"})["id"]
    files = {"plots/a.png": b"\x89PNG" + bytes(1000), "b.npz": b"PK" + bytes(range(200))}
    with api.sessions.begin() as session:
        session.add(Series(job_id=job_id, name="s1", labels={"layer": 1}, x=[1, 2], y=[3.5, 4.5]))
        session.add(Series(job_id=job_id, name="s2", labels={}, x=[], y=[]))
        for name, data in files.items():
            path = api.settings.artifact_dir / "jobs" / str(job_id) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            session.add(Artifact(job_id=job_id, name=name, media_type="application/octet-stream", size=len(data),
                                 sha256=hashlib.sha256(data).hexdigest()))
    assert ann.results(job_id, "s1")["series"] == [{"name": "s1", "labels": {"layer": 1}, "x": [1, 2], "y": [3.5, 4.5],
                                                    "x_meaning": "x"}]  # a series lmscope does not know
    assert len(ann.results(job_id)["series"]) == 2
    from lmscope.api import results

    results.RESULT_PAGE_POINTS, before = 1, results.RESULT_PAGE_POINTS  # the live server's thread reads it
    try:  # one series per page: the client joins the pages into the one answer
        assert ann.results(job_id) == {"job_id": job_id, "status": "queued", "series": [
            {"name": "s1", "labels": {"layer": 1}, "x": [1, 2], "y": [3.5, 4.5], "x_meaning": "x"},
            {"name": "s2", "labels": {}, "x": [], "y": [], "x_meaning": "x"}]}
    finally:
        results.RESULT_PAGE_POINTS = before
    written = ann.fetch(job_id, tmp_path / "out")
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in written) == sorted(files)
    for name, data in files.items():
        assert (tmp_path / "out" / name).read_bytes() == data
    assert ann.download(job_id, "b.npz", tmp_path).read_bytes() == files["b.npz"]
    into = f"{tmp_path / 'new-folder'}/"  # a trailing slash names a folder, made if missing
    assert ann.download(job_id, "plots/a.png", into) == tmp_path / "new-folder" / "a.png"
    assert (tmp_path / "new-folder" / "a.png").read_bytes() == files["plots/a.png"]


def test_a_missing_artifact_leaves_no_folder_behind(api, ann, tmp_path):
    job_id = ann.submit("probe", {"model": "m"})["id"]
    with pytest.raises(LmscopeError) as e:
        ann.download(job_id, "nope.png", f"{tmp_path / 'new-folder'}/")
    assert e.value.status == 404 and not (tmp_path / "new-folder").exists()


def test_datasets_and_models(api, ann, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n')
    d = ann.upload_dataset("c", path, "jsonl")
    assert d["documents"] == 2 and d["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert "c" in [x["name"] for x in ann.datasets()]
    assert "m" in [x["name"] for x in ann.models()]
    with pytest.raises(LmscopeError) as e:
        ann.register_model("x", tmp_path)
    assert e.value.status == 403
    with pytest.raises(LmscopeError) as e:  # a misspelt source is the server's 422, not an empty list
        ann.models(source="checkpoints")
    assert e.value.status == 422 and "source 'checkpoints' is none of builtin, directory, checkpoint" in str(e.value)


def test_wait_rides_out_an_api_restart(api, live, monkeypatch):
    """A rollout or restart of the API must not fail every user's `--wait`; a long outage says the job runs on."""
    from werkzeug.serving import make_server

    api.user("ann")
    c = Client(live.url, api.tokens["ann"])
    job_id, other = (c.submit("probe", {"model": "m"})["id"] for _ in range(2))
    port = live.server.server_port
    outcome, outages = {}, []
    waiter = threading.Thread(target=lambda: outcome.update(job=c.wait(job_id, poll=0.1, on_outage=outages.append)))
    waiter.start()
    time.sleep(0.5)
    live.stop()
    live.server.server_close()  # the API is gone: connections are refused
    api.set_job(job_id, status="succeeded", finished_at=utcnow())
    time.sleep(2.0)
    assert waiter.is_alive()  # still waiting through the outage
    again = make_server("127.0.0.1", port, api.app, threaded=True)
    threading.Thread(target=again.serve_forever, daemon=True).start()
    try:
        waiter.join(20)
        assert outcome["job"]["status"] == "succeeded"
        assert [o.status for o in outages] == [0]  # told once, when the outage began
    finally:
        again.shutdown()
        again.server_close()
    # A server never reached fails at once: no outage begins, the client never waits to try again.
    import lmscope.client

    def no_sleep(seconds):
        raise AssertionError(f"the client waited {seconds} s to try a server it never reached")

    monkeypatch.setattr(lmscope.client, "time", SimpleNamespace(monotonic=time.monotonic, sleep=no_sleep))
    unreached = []
    with pytest.raises(LmscopeError) as e:
        Client(f"http://127.0.0.1:{port}", api.tokens["ann"]).wait(other, on_outage=unreached.append)
    assert e.value.status == 0 and unreached == []


def test_a_long_outage_says_the_job_keeps_running(api, live):
    api.user("ann")
    c = Client(live.url, api.tokens["ann"], timeout=None)  # no request timeout of its own: the outage bounds it
    job_id = c.submit("probe", {"model": "m"})["id"]
    seen = threading.Event()
    outcome = {}

    def wait():
        try:
            c.wait(job_id, poll=0.1, outage=1.5, on_progress=lambda job: seen.set())
        except LmscopeError as e:
            outcome["error"] = e

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert seen.wait(10)
    live.stop()
    live.server.server_close()
    waiter.join(30)
    e = outcome["error"]
    assert e.status == 0 and f"job {job_id} keeps running on the server: `lmscope wait {job_id}`" in str(e)


def test_models_of_a_run_from_a_server_without_the_filters(api, live, monkeypatch):
    """A server older than GET /v1/models?run=&source= refuses them as unknown query parameters (422): the
    client then lists every model and keeps the run's checkpoints itself, as the server would have."""
    import lmscope.api.registry as registry
    from lmscope.db.models import Model

    api.user("ann")
    with api.sessions.begin() as session:
        for name, step in (("r@step0", 0), ("r@step10", 10), ("r2@step0", 0), ("r@stepx", None)):
            session.add(Model(name=name, source="checkpoint", path="/nonexistent", step=step))
    c = Client(live.url, api.tokens["ann"])
    new = sorted(m["name"] for m in c.models(run="r"))
    new_builtin = {m["name"] for m in c.models(source="builtin")}
    monkeypatch.setattr(registry.list_models, "query_params", ((), frozenset()))  # reads no query parameters
    with pytest.raises(LmscopeError) as refused:
        c._json("GET", "/v1/models", params={"run": "r"})
    assert refused.value.status == 422 and refused.value.errors[0]["loc"] == ["query", "run"]
    assert sorted(m["name"] for m in c.models(run="r")) == new == ["r@step0", "r@step10"]
    assert {m["name"] for m in c.models(source="builtin")} == new_builtin >= {"tiny-gpt2", "tiny-llama"}
