"""POST /v1/jobs: what is refused (and how the refusal reads), what is stored, what is published."""

from __future__ import annotations

import gzip
import json
import threading
from importlib import resources

import pytest
from sqlalchemy import select

from lmscope.db.models import Dataset, Model
from lmscope.params import KINDS

from .conftest import add_checkpoint, is_problem, small_sweep


def test_submit_stores_validated_params_and_publishes_after_commit(api):
    h = api.user("ann")
    r = api.submit(h, params={"model": "m"}, name="first", tags=["a", "b"])
    assert r.status_code == 202
    job = r.get_json()
    assert r.headers["Location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "queued" and job["kind"] == "probe" and job["tags"] == ["a", "b"]
    # Defaults are filled in, so the row says exactly what will run.
    assert job["params"] == KINDS["probe"].params(model="m").model_dump(mode="json")
    assert api.publisher.published == [job["id"]]
    row = api.job_row(job["id"])
    assert row.published_at is not None and row.max_attempts == api.settings.max_attempts


def test_field_errors_are_422_problems_naming_each_field(api):
    h = api.user("ann")
    r = api.client.post("/v1/jobs", headers=h, json={"kind": "probe", "params": {"model": "m", "dtype": "float64", "colour": 1}})
    body = is_problem(r, 422, "validation-error")
    locs = {tuple(e["loc"]) for e in body["errors"]}
    assert locs == {("params", "dtype"), ("params", "colour")}
    assert "params.dtype" in body["detail"] and "params.colour" in body["detail"]
    # The body itself: a top-level field of the wrong type.
    body = is_problem(api.client.post("/v1/jobs", headers=h, json={"kind": "probe", "tags": "x"}), 422, "validation-error")
    assert body["errors"][0]["loc"] == ["tags"]
    assert api.jobs() == [] and api.publisher.published == []


def test_a_list_field_given_odd_text_is_a_422_with_no_made_up_list(api):
    """The list hint once ran json.loads on whatever looked like digits: 5000 of them raised (a 500), and
    1e999 became Infinity, which is no JSON. Such values get the plain message; a plain one its list."""
    h = api.user("ann")

    def message(latent_dim):
        params = {"study": "sumformer", "grid": {"latent_dim": latent_dim}}
        body = is_problem(api.client.post("/v1/jobs", headers=h, json={"kind": "sweep", "params": params}),
                          422, "validation-error")
        [error] = body["errors"]
        assert error["loc"] == ["params", "grid", "latent_dim"]
        return error["msg"]

    assert message("9" * 5000 + ",2").startswith('expected a list, e.g. [1, 2]; got the string "999')
    assert "(write" not in message("9" * 5000 + ",2") and "Infinity" not in message("1e999,2")
    assert message("2,4").endswith("(write [2, 4])") and message(4).endswith("(a list of one is written [4])")
    assert "a list of one" not in message(True)  # true is no count to put in a list
    assert api.jobs() == []


def test_values_of_the_wrong_json_type_are_refused_not_converted(api):
    """true is not 1 and "5" is not 5 (lax parsing ran jobs on values nobody meant); 2 is a fine float."""
    h = api.user("ann")
    params = {"model": "m", "dataset": "d", "max_samples": True, "max_tokens": "64", "loss_filter": 2}
    body = is_problem(api.client.post("/v1/jobs", headers=h, json={"kind": "norms", "params": params}),
                      422, "validation-error")
    msgs = {e["loc"][-1]: e["msg"] for e in body["errors"]}
    assert set(msgs) == {"max_samples", "max_tokens"}
    # Each says what was given and how to write what is wanted.
    assert msgs["max_samples"] == "expected an integer, e.g. 5; got the boolean true"
    assert msgs["max_tokens"].endswith('got the string "64" (write numbers and true/false without quotes)')
    nested = {"study": "sumformer", "train": {"epochs": "5"}}
    body = is_problem(api.client.post("/v1/jobs", headers=h, json={"kind": "sweep", "params": nested}),
                      422, "validation-error")
    assert [e["loc"] for e in body["errors"]] == [["params", "train", "epochs"]]
    assert body["errors"][0]["msg"].startswith("expected an integer")
    one_model = {"models": "tiny-gpt2", "dataset": "d"}
    body = is_problem(api.client.post("/v1/jobs", headers=h, json={"kind": "entropy", "params": one_model}),
                      422, "validation-error")
    assert body["errors"][0]["msg"] == ('expected a list, e.g. ["a", "b"]; got the string "tiny-gpt2" '
                                        '(a list of one is written ["x"])')
    assert api.jobs() == [] and api.publisher.published == []
    # a whole-number float is that integer (1e4 on a command line, 5.0 from Python); 0.5 is not
    ok = api.client.post("/v1/jobs", headers=h, json={"kind": "norms", "params": {
        "model": "m", "dataset": "d", "max_samples": 1e4, "max_tokens": 64.0, "loss_filter": 2.0}})
    assert ok.status_code == 202, ok.get_json()
    stored = ok.get_json()["params"]
    assert stored["max_samples"] == 10000 and isinstance(stored["max_samples"], int) and stored["loss_filter"] == 2.0
    half = api.client.post("/v1/jobs", headers=h, json={"kind": "norms", "params": {
        "model": "m", "dataset": "d", "max_samples": 0.5}})
    assert is_problem(half, 422, "validation-error")["errors"][0]["loc"] == ["params", "max_samples"]


@pytest.mark.parametrize("field, given, advice", [
    ("max_samples", "5", True), ("max_samples", "-3", True), ("max_samples", "1e3", True),
    ("max_samples", "5.5", False), ("max_samples", "nan", False), ("max_samples", "1_000", False),
    ("max_samples", "abc", False), ("loss_filter", "0.5", True), ("loss_filter", "inf", False),
    ("inner_loss", "true", True), ("inner_loss", "yes", False),
])
def test_a_quoted_value_is_told_to_drop_its_quotes_only_when_that_would_work(api, field, given, advice):
    """"5" for an integer: write 5. The advice comes only when JSON would take the value's type without the
    quotes ("-3" is an integer, whatever the field's limits say); not for "5.5" or "nan"."""
    body = is_problem(api.submit(api.user("ann"), kind="norms", params={"model": "m", "dataset": "d", field: given}),
                      422, "validation-error")
    msg = body["errors"][0]["msg"]
    assert msg.startswith("expected ") and f'got the string "{given}"' in msg
    assert ("without quotes" in msg) == advice


def test_unknown_kind_lists_the_kinds(api):
    body = is_problem(api.submit(api.user("ann"), kind="nope"), 422, "unknown-kind")
    submittable = sorted(k for k, s in KINDS.items() if s.submittable)
    assert body["kinds"] == submittable
    # the list once (a client prints the detail, then each field): in the field's message, not the detail
    assert body["errors"][0]["msg"] == "unknown kind; the kinds are " + ", ".join(submittable)
    assert not any(k in body["detail"] for k in submittable) and "GET /v1/kinds" in body["detail"]
    assert "did you mean" not in body["detail"]
    misspelt = is_problem(api.submit(api.user("ann"), kind="nrms"), 422, "unknown-kind")
    assert misspelt["detail"].startswith("kind 'nrms' does not exist; did you mean 'norms'? GET /v1/kinds")
    # Child-only kinds exist but cannot be submitted directly.
    assert "sumformer_fit" not in body["kinds"]
    child = is_problem(api.submit(api.user("ann"), kind="sumformer_fit", params={}), 422, "unknown-kind")
    assert "made by a sweep job" in child["detail"] and "submit kind 'sweep'" in child["detail"]
    assert child["errors"][0]["type"] == "child_kind" and not api.jobs()


def test_a_training_runs_name_points_to_its_checkpoints(api):
    """`-p model=my-run` only suggested 'my-run@step60'; the run's checkpoints and train_job say more."""
    from lmscope.db.models import Model

    ann, bob = api.user("ann"), api.user("bob")
    run = api.submit(ann, kind="train", params={"dataset": "d", "run_name": "my_run"}).get_json()["id"]
    with api.sessions.begin() as session:
        for step in (300, 100, 200):  # registered out of order: listed by step
            session.add(Model(name=f"my_run@step{step}", source="checkpoint", job_id=run, step=step))
        session.add(Model(name="myXrun@step5", source="checkpoint", job_id=run, step=5))  # '_' is no wildcard
    body = is_problem(api.submit(ann, kind="norms", params={"model": "my_run", "dataset": "d"}), 422,
                      "unknown-reference")
    assert ("'my_run' is a training run, whose checkpoints are the models: my_run@step100, my_run@step200, "
            f"my_run@step300 (3); name one of them, or give train_job={run} to an entropy or pruning job") in body["detail"]
    assert body["errors"][0]["loc"] == ["params", "model"]
    # Another user is told about the checkpoints (model names are global) but not the job id.
    other = is_problem(api.submit(bob, kind="norms", params={"model": "my_run", "dataset": "d"}), 422,
                       "unknown-reference")
    assert "my_run@step100" in other["detail"] and "train_job" not in other["detail"]


def test_unknown_model_or_dataset_is_refused_at_submit(api):
    h = api.user("ann")
    body = is_problem(api.submit(h, kind="norms", params={"model": "ghost", "dataset": "nowhere"}), 422, "unknown-reference")
    assert "'ghost'" in body["detail"] and "'nowhere'" in body["detail"] and "GET /v1/models" in body["detail"]
    assert {tuple(e["loc"]) for e in body["errors"]} == {("params", "model"), ("params", "dataset")}
    assert "did you mean" not in body["detail"]  # nothing close to 'ghost' or 'nowhere'
    # the built-ins (registered at start-up) are the near misses
    near = is_problem(api.submit(h, kind="norms", params={"model": "tiny-gpt", "dataset": "wikitext2"}), 422,
                      "unknown-reference")
    assert "model 'tiny-gpt' is not registered; did you mean 'tiny-gpt2'?" in near["detail"]
    assert "dataset 'wikitext2' is not registered; did you mean 'wikitext-2'?" in near["detail"]
    assert "not a path" not in near["detail"]
    # a path where a name belongs: how to make it one
    paths = is_problem(api.submit(h, kind="norms", params={"model": "/models/my-llama", "dataset": "/tmp/corpus.txt"}),
                       422, "unknown-reference")
    assert ("dataset '/tmp/corpus.txt' is not registered (list datasets: GET /v1/datasets or `lmscope datasets`); "
            "jobs take a registered name, not a path: upload the file first (`lmscope datasets upload NAME FILE`"
            in paths["detail"])
    assert "register the directory first (`lmscope models register NAME DIR`" in paths["detail"]
    named = is_problem(api.submit(h, kind="norms", params={"model": "org/llama-7b", "dataset": "d"}), 422,
                       "unknown-reference")
    assert "not a path" not in named["detail"]  # registered names may hold "/"
    # a train job's tokenizer 'gpt2' (not registered) is the field to blame, not its architecture
    # "gpt2", the default left as it is
    tok = is_problem(api.submit(h, kind="train", params={"dataset": "d", "tokenizer": "gpt2"}), 422, "unknown-reference")
    assert [e["loc"] for e in tok["errors"]] == [["params", "tokenizer"]]
    # An entropy job over another user's train job: that job "does not exist" for this user.
    other = api.submit(api.user("bob"), kind="train", params={"dataset": "d"}).get_json()
    api.set_job(other["id"], status="succeeded")
    add_checkpoint(api, "bobs@step0", other["id"])  # a run registers its step 0 when it starts
    body = is_problem(api.submit(h, kind="entropy", params={"dataset": "d", "train_job": other["id"]}),
                      422, "unknown-reference")
    assert f"job {other['id']} does not exist" in body["detail"]
    assert api.submit(api.user("bob"), kind="entropy",
                      params={"dataset": "d", "train_job": other["id"]}).status_code == 202


def test_an_entropy_job_over_a_train_job_still_running_is_refused_with_its_checkpoints_so_far(api):
    """Its checkpoints would stop where the run stands (step 0 exists at once): say so, and what to do."""
    h = api.user("ann")
    train = api.submit(h, kind="train", params={"dataset": "d", "run_name": "r"}).get_json()["id"]
    entropy = {"dataset": "d", "train_job": train}
    body = is_problem(api.submit(h, kind="entropy", params=entropy), 409, "train-job-unfinished")
    assert body["detail"] == (f"train job {train} is still queued: its checkpoints would stop where it stands; "
                              f"submit this job once it has finished (`lmscope wait {train}`)")
    api.set_job(train, status="running", progress_done=120, progress_total=600)
    with api.sessions.begin() as session:
        for step in (0, 100):
            session.add(Model(name=f"r@step{step}", source="checkpoint", job_id=train, step=step))
    body = is_problem(api.submit(h, kind="entropy", params=entropy), 409, "train-job-unfinished")
    assert body["detail"].startswith(f"train job {train} is still running (step 120 of 600): ")
    assert body["detail"].endswith('or name the checkpoints written so far: models=["r@step0", "r@step100"]')
    assert api.submit(h, kind="entropy", params={"dataset": "d", "models": ["r@step0", "r@step100"]}).status_code == 202
    api.set_job(train, status="failed")  # a run that stopped keeps what it wrote: measurable
    assert api.submit(h, kind="entropy", params=entropy).status_code == 202


def test_windows_longer_than_the_models_context_are_refused_at_submit(api):
    h = api.user("ann")  # the fixture registers model "m" and dataset "d"
    # tiny-gpt2 reads 1024 positions (n_positions in lmscope.catalog.BUILTIN_MODELS)
    body = is_problem(api.submit(h, kind="entropy", params={"model": "tiny-gpt2", "dataset": "d", "seq_len": 1025}),
                      422, "sequence-too-long")
    assert "seq_len=1025 is longer than the 1024 positions model 'tiny-gpt2' can read" in body["detail"]
    assert "at most 1024" in body["detail"] and body["errors"][0]["loc"] == ["params", "seq_len"]
    assert api.submit(h, kind="entropy", params={"model": "tiny-gpt2", "dataset": "d", "seq_len": 1024}).status_code == 202
    # several models: the one that is too short is named
    body = is_problem(api.submit(h, kind="entropy", params={"models": ["tiny-gpt2", "tiny-llama"], "dataset": "d",
                                                             "seq_len": 4096}), 422, "sequence-too-long")
    assert "'tiny-gpt2'" in body["detail"] and "'tiny-llama'" in body["detail"]
    # an attention study: one error, though the parent and every child read the model
    body = is_problem(api.submit(h, kind="sweep", params={"study": "attention", "model": "tiny-llama", "dataset": "d",
                                                           "seq_len": 2048, "seeds": 2}), 422, "sequence-too-long")
    assert len(body["errors"]) == 1 and "the 1024 positions" in body["detail"]
    # left to the model (no seq_len): accepted whatever its context; the worker picks min(512, context)
    assert api.submit(h, kind="sweep", params={"study": "attention", "model": "tiny-llama", "dataset": "d",
                                               "seeds": 1}).status_code == 202
    # a train job's checkpoints read its `context`
    train = api.submit(h, kind="train", params={"dataset": "d", "context": 64}).get_json()
    api.set_job(train["id"], status="succeeded")
    add_checkpoint(api, "ctx@step0", train["id"])
    body = is_problem(api.submit(h, kind="entropy", params={"train_job": train["id"], "dataset": "d", "seq_len": 65}),
                      422, "sequence-too-long")
    assert f"the 64 positions train job {train['id']}'s checkpoints can read" in body["detail"]
    assert api.submit(h, kind="entropy", params={"train_job": train["id"], "dataset": "d", "seq_len": 64}).status_code == 202
    # a model registered without a recorded context (the fixture's "m") is left to the worker's check
    assert api.submit(h, kind="entropy", params={"model": "m", "dataset": "d", "seq_len": 100_000}).status_code == 202
    assert all(j.status == "queued" for j in api.jobs(kind="entropy"))  # nothing refused was stored


def test_not_json_is_400(api):
    r = api.client.post("/v1/jobs", headers=api.user("ann"), data="{nope", content_type="application/json")
    is_problem(r, 400, "invalid-json")


def test_bodies_are_strict_json_on_every_json_endpoint(api):
    """Deep nesting was a 500 (RecursionError); NaN and Infinity were stored, and every later answer
    holding them was invalid JSON (the dashboard's JSON.parse refused the job list); POST /v1/models
    read a body that is not JSON as {} ("name: Field required")."""
    h, root = api.user("ann"), api.user("root", admin=True)
    probe = '{"kind": "probe", "params": {"model": "m"}}'
    norms = '{"kind": "norms", "params": {"model": "m", "dataset": "d", "loss_filter": %s}}'
    bodies = {
        "/v1/jobs": {"[" * 30_000 + "]" * 30_000: "more than 32 deep",  # past Python's recursion limit
                     '{"kind": "probe", "params": {"model": "m", "x": %s}}' % ("[" * 5000 + "]" * 5000): "32 deep",
                     norms % "NaN": "NaN is not a JSON number", norms % "Infinity": "Infinity is not a JSON number",
                     norms % "-Infinity": "-Infinity is not a JSON number", norms % "1e400": "1e400 is too large",
                     "": "empty", probe[:-1]: "line 1", "\xff": "not UTF-8",
                     # the last "kind" used to win without a word
                     '{"kind": "probe", "kind": "norms", "params": {"model": "m"}}': "'kind' appears twice"},
        "/v1/models": {"not json": "line 1", "[" * 60_000: "32 deep", '{"name": "x", "path": NaN}': "NaN"},
    }
    for path, cases in bodies.items():
        for data, says in cases.items():
            raw = data.encode("latin-1") if data == "\xff" else data
            r = api.client.post(path, headers=root if path == "/v1/models" else h, data=raw,
                                content_type="application/json")
            body = is_problem(r, 400, "invalid-json")
            assert says in body["detail"] and "JSON object like" in body["detail"], (path, data[:40], body["detail"])
    assert api.jobs() == [] and api.publisher.published == []
    # an integer literal past a double's range became inf in a float parameter (stored as Infinity),
    # and 1e300 a 301-digit count in an integer one
    attention = '{"kind": "sweep", "params": {"study": "attention", "model": "m", "dataset": "d", "features": [1e300]}}'
    for data, loc in ((norms % ("1" + "0" * 400), ["params", "loss_filter"]), (attention, ["params", "features", 0])):
        body = is_problem(api.client.post("/v1/jobs", headers=h, data=data, content_type="application/json"),
                          422, "validation-error")
        assert body["errors"][0]["loc"] == loc, body["errors"]
    # gzip bytes were "not UTF-8: byte 1 is b'\\x8b'"
    body = is_problem(api.client.post("/v1/jobs", headers={**h, "Content-Encoding": "gzip"},
                                      data=gzip.compress(probe.encode()), content_type="application/json"),
                      415, "unsupported-media-type")
    assert "uncompressed" in body["detail"]
    assert api.jobs() == []
    assert api.client.post("/v1/jobs", headers=h, data=norms % "2.5").status_code == 202  # finite: fine
    listed = api.client.get("/v1/jobs", headers=h).get_data(as_text=True)
    assert json.loads(listed, parse_constant=lambda c: pytest.fail(f"{c} in the job list"))


def test_names_and_tags_are_one_line_of_text(api):
    """A name with a line break broke `lmscope jobs` rows; U+202E displayed "gpj.exe" reversed."""
    h = api.user("ann")
    for body, loc, code in (({"name": "two\nlines"}, ["name"], "U+000A"), ({"name": "x\u202egpj.exe"}, ["name"], "U+202E"),
                            ({"tags": ["ok", "a\tb"]}, ["tags", 1], "U+0009"), ({"name": "a\x85b"}, ["name"], "U+0085"),
                            ({"name": "a\x9b31mred"}, ["name"], "U+009B"), ({"tags": ["a\u2028b"]}, ["tags", 0], "U+2028")):
        r = api.client.post("/v1/jobs", headers=h, json={"kind": "probe", "params": {"model": "m"}, **body})
        problem = is_problem(r, 422, "validation-error")
        assert problem["errors"][0]["loc"] == loc and code in problem["errors"][0]["msg"], problem
    assert api.jobs() == []
    ok = api.client.post("/v1/jobs", headers=h, json={"kind": "probe", "params": {"model": "m"}, "name": "a b – ü",
                                                      "tags": ["x y"]})
    assert ok.status_code == 202


def test_strings_that_cannot_be_stored_are_refused_naming_the_field(api):
    """NUL was a 500 on PostgreSQL (DataError) and stored as is by SQLite; a lone surrogate with an
    Idempotency-Key was a 500 in the request hash."""
    h = api.user("ann")
    for body, loc in (({"kind": "probe", "params": {"model": "m"}, "name": "a\u0000b"}, ["name"]),
                      ({"kind": "probe", "params": {"model": "tiny\u0000"}}, ["params", "model"]),
                      ({"kind": "probe", "params": {"model": "m"}, "tags": ["ok", "a\u001bb"]}, ["tags", 1]),
                      ({"kind": "probe", "params": {"model": "m", "a\u0000": 1}}, ["params", "a\u0000"])):
        r = api.client.post("/v1/jobs", headers=h, data=json.dumps(body), content_type="application/json")
        problem = is_problem(r, 422, "validation-error")
        assert problem["errors"][0]["loc"] == loc, problem
        assert "U+00" in problem["errors"][0]["msg"]
    lone = '{"kind": "probe", "params": {"model": "m"}, "name": "\\ud800"}'
    for headers in (h, {**h, "Idempotency-Key": "k"}):
        r = api.client.post("/v1/jobs", headers=headers, data=lone, content_type="application/json")
        assert is_problem(r, 422, "validation-error")["errors"][0]["loc"] == ["name"]
    assert api.jobs() == []
    # free text keeps its tabs and line breaks
    ok = api.submit(h, params={"model": "m", "prompt": "one\ttwo\nthree"}, name="a b")  # a name is one line
    assert ok.status_code == 202 and ok.get_json()["params"]["prompt"] == "one\ttwo\nthree"


def test_the_request_hash_survives_any_parsed_body():
    from lmscope.api.submit import request_hash

    assert request_hash({"name": "\ud800"}) != request_hash({"name": "\ud801"})
    assert request_hash({"params": {"max_samples": 1.0}}) == request_hash({"params": {"max_samples": 1}})
    assert request_hash({"params": {"lr": 0.5}}) != request_hash({"params": {"lr": 1}})


def test_auth_required_with_a_bearer_challenge(api):
    r = api.client.post("/v1/jobs", json={"kind": "probe", "params": {"model": "m"}})
    is_problem(r, 401, "unauthorized")
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    r = api.client.get("/v1/jobs", headers={"Authorization": "Bearer lms_wrong"})
    assert is_problem(r, 401, "unauthorized")["title"] == "Invalid token"
    assert api.client.get("/v1/jobs", headers={"Authorization": "Basic abc"}).status_code == 401
    assert api.client.get("/v1/jobs", headers=api.user("ann")).status_code == 200


def test_without_auth_requests_act_as_the_local_admin(make_api):
    api = make_api(auth=False)
    api.add_model("m")
    job = api.client.post("/v1/jobs", json={"kind": "probe", "params": {"model": "m"}}).get_json()
    assert job["user"] == "local"
    assert api.client.post("/v1/models", json={"name": "x", "path": "/nowhere"}).status_code == 422  # admin: not 403


def test_without_auth_other_web_sites_cannot_use_the_api(make_api, tmp_path):
    """Every request is the admin then: a page the user visits must not submit, cancel or upload through
    the browser (a cross-site form or text/plain POST needs no preflight), nor read results by DNS
    rebinding (its own name resolving to 127.0.0.1). Nothing they try may change anything."""
    api = make_api(auth=False, allowed_hosts=("gpubox",))
    api.add_model("m")
    job = {"kind": "probe", "params": {"model": "m"}}
    own = api.client.post("/v1/jobs", json=job, headers={"Origin": "http://localhost"})  # the dashboard's own page
    assert own.status_code == 202
    job_id = own.get_json()["id"]
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"}, {"Origin": "http://localhost:9999"},
                    {"Sec-Fetch-Site": "cross-site"}):
        body = is_problem(api.client.post("/v1/jobs", data=json.dumps(job), content_type="text/plain", headers=headers),
                          403, "cross-origin-request")
        assert "LMSCOPE_AUTH=1" in body["detail"]
        is_problem(api.client.post(f"/v1/jobs/{job_id}/cancel", headers=headers), 403, "cross-origin-request")
        is_problem(api.client.post("/v1/datasets?name=x", data=b"some text", content_type="text/plain",
                                   headers=headers), 403, "cross-origin-request")
    assert [j.status for j in api.jobs()] == ["queued"]  # none of those cancels counted
    with api.sessions() as session:
        assert session.scalar(select(Dataset).where(Dataset.name == "x")) is None
    # a page may still link to it (GET), but only under an address that is not its own name
    assert api.client.get(f"/v1/jobs/{job_id}", headers={"Origin": "http://evil.example"}).status_code == 200
    for host in ("evil.example", "evil.example:8765", "127.0.0.1.evil.example"):
        body = is_problem(api.client.get(f"/v1/jobs/{job_id}", headers={"Host": host}), 403, "host-not-allowed")
        assert "LMSCOPE_ALLOWED_HOSTS" in body["detail"]
        is_problem(api.client.get("/", headers={"Host": host}), 403, "host-not-allowed")
    for host in ("127.0.0.1:8765", "[::1]:8765", "10.1.2.3", "localhost:8765", "GPUBOX:8765"):
        assert api.client.get(f"/v1/jobs/{job_id}", headers={"Host": host}).status_code == 200, host
    # a proxy that rewrites Host to localhost, for a page served under an allowed name
    proxied = api.client.post(f"/v1/jobs/{job_id}/cancel", headers={"Host": "localhost:8765",
                                                                  "Origin": "https://gpubox"})
    assert proxied.status_code == 202 and proxied.get_json()["status"] == "cancelled", proxied.get_json()
    # with tokens a page has nothing to send, and a proxy may use any name: none of this applies
    authed = make_api(auth=True)
    assert authed.client.get("/v1/jobs", headers={**authed.user("ann"), "Host": "lmscope.team"}).status_code == 200


def test_quota_counts_active_top_level_jobs(api):
    h = api.user("ann")
    keyed = api.client.post("/v1/jobs", headers={**h, "Idempotency-Key": "retry-me"},
                            json={"kind": "probe", "params": {"model": "m"}}).get_json()["id"]
    ids = [keyed] + [api.submit(h).get_json()["id"] for _ in range(api.settings.max_active_jobs - 1)]
    r = api.submit(h)
    body = is_problem(r, 429, "quota-exceeded")
    assert int(r.headers["Retry-After"]) > 0 and body["limit"] == api.settings.max_active_jobs
    # A retry of an accepted request is answered, full quota or not.
    replay = api.client.post("/v1/jobs", headers={**h, "Idempotency-Key": "retry-me"},
                             json={"kind": "probe", "params": {"model": "m"}})
    assert replay.status_code == 200 and replay.get_json()["id"] == keyed
    # Another user has their own quota.
    assert api.submit(api.user("bob")).status_code == 202
    # A finished job frees its slot; a running one does not.
    api.set_job(ids[0], status="succeeded")
    api.set_job(ids[1], status="running")
    assert api.submit(h).status_code == 202
    is_problem(api.submit(h), 429, "quota-exceeded")


def test_a_sweep_counts_once_towards_the_quota(make_api):
    api = make_api(max_active_jobs=2)
    h = api.user("ann")
    sweep = api.submit(h, kind="sweep", params=small_sweep(3)).get_json()
    assert sweep["children"]["total"] == 3
    assert api.submit(h, kind="sweep", params=small_sweep(1)).status_code == 202
    is_problem(api.submit(h, kind="sweep", params=small_sweep(1)), 429, "quota-exceeded")


def test_idempotency_key(api):
    h = {**api.user("ann"), "Idempotency-Key": "k-1"}
    first = api.client.post("/v1/jobs", headers=h, json={"kind": "probe", "params": {"model": "m"}, "tags": ["x"]})
    assert first.status_code == 202
    # Same key, same body (key order does not matter) → the first job, not a new one.
    again = api.client.post("/v1/jobs", headers=h, json={"tags": ["x"], "params": {"model": "m"}, "kind": "probe"})
    assert again.status_code == 200 and again.get_json()["id"] == first.get_json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    # Same key, different body → 422 naming the first job.
    body = is_problem(api.client.post("/v1/jobs", headers=h, json={"kind": "probe", "params": {"model": "m"}}),
                      422, "idempotency-key-reused")
    assert body["job_id"] == first.get_json()["id"]
    # Keys are per user.
    other = api.client.post("/v1/jobs", headers={**api.user("bob"), "Idempotency-Key": "k-1"},
                            json={"kind": "probe", "params": {"model": "m"}})
    assert other.status_code == 202 and other.get_json()["id"] != first.get_json()["id"]
    assert len(api.jobs()) == 2 and api.publisher.published == [first.get_json()["id"], other.get_json()["id"]]


def test_an_idempotency_key_replays_a_body_whose_floats_are_whole_numbers(api):
    """5.0 and 5 are the same value (the params say so); the same key with each was refused as reused."""
    h = {**api.user("ann"), "Idempotency-Key": "k-floats"}
    params = {"model": "m", "dataset": "d", "max_samples": 1.0}
    first = api.client.post("/v1/jobs", headers=h, json={"kind": "norms", "params": params})
    assert first.status_code == 202, first.get_json()
    again = api.client.post("/v1/jobs", headers=h, json={"kind": "norms", "params": {**params, "max_samples": 1}})
    assert again.status_code == 200 and again.get_json()["id"] == first.get_json()["id"]
    is_problem(api.client.post("/v1/jobs", headers=h, json={"kind": "norms", "params": {**params, "max_samples": 2}}),
               422, "idempotency-key-reused")
    bad_key = {**h, "Idempotency-Key": "k\x01"}
    is_problem(api.client.post("/v1/jobs", headers=bad_key, json={"kind": "probe", "params": {"model": "m"}}),
               422, "validation-error")
    assert len(api.jobs()) == 1


def test_seeds_and_job_ids_are_refused_outside_what_the_workers_take(api):
    """A negative seed failed in the worker (numpy's default_rng), a seed past 2**64 in torch's
    manual_seed; a train_job past the id column was a 500."""
    h = api.user("ann")
    cases = [("norms", {"model": "m", "dataset": "d", "seed": -5}, ["params", "seed"]),
             ("entropy", {"model": "m", "dataset": "d", "seed": -1}, ["params", "seed"]),
             ("train", {"dataset": "d", "seed": 2**63}, ["params", "seed"]),
             ("sweep", {"study": "sumformer", "grid": {"seed": [0, 10**20]}}, ["params", "grid", "seed", 1]),
             ("entropy", {"train_job": 99999999999999999999, "dataset": "d"}, ["params", "train_job"])]
    for kind, params, loc in cases:
        body = is_problem(api.submit(h, kind=kind, params=params), 422, "validation-error")
        assert loc in [e["loc"] for e in body["errors"]], (kind, body["errors"])
    attention = {"study": "attention", "model": "m", "dataset": "d", "seq_len": 16}
    body = is_problem(api.submit(h, kind="sweep", params={**attention, "seeds": [1, -1]}), 422, "validation-error")
    assert "greater than or equal to 0" in body["detail"] and body["errors"][0]["loc"][:2] == ["params", "seeds"]
    assert api.jobs() == []
    assert api.submit(h, kind="norms", params={"model": "m", "dataset": "d", "seed": 2**63 - 1}).status_code == 202


def test_sweep_values_out_of_range_are_named_where_they_are(api):
    """A grid value or layer out of its range: `errors[].loc` points at that value (a form or script can
    mark it), not at the whole params object."""
    h = api.user("ann")
    attention = {"study": "attention", "model": "m", "dataset": "d", "seq_len": 16}
    # each with the value given ("; got 50"): the message names the bound, the value shows which one broke it
    cases = [({"grid": {"token_dim": [2, 50]}}, ["params", "grid", "token_dim", 1], "less than or equal to 32; got 50"),
             ({"grid": {"seq_len": [1]}}, ["params", "grid", "seq_len", 0], "greater than or equal to 2; got 1"),
             ({"grid": {"latent_dim": [None, 0]}}, ["params", "grid", "latent_dim", 1], "greater than or equal to 1; got 0"),
             ({**attention, "layers": [0, -1]}, ["params", "layers", 1], "greater than or equal to 0; got -1"),
             ({**attention, "layers": []}, ["params", "layers"], "at least 1 item"),
             ({**attention, "features": [0]}, ["params", "features", 0], "greater than or equal to 1; got 0")]
    for params, loc, msg in cases:
        body = is_problem(api.submit(h, kind="sweep", params=params), 422, "validation-error")
        assert [e["loc"] for e in body["errors"]] == [loc] and msg in body["errors"][0]["msg"], body["errors"]
    theory = {"architectures": ["poly_sumformer"], "grid": {"latent_dim": [None], "token_dim": [10], "seq_len": [6]}}
    body = is_problem(api.submit(h, kind="sweep", params=theory), 422, "validation-error")
    assert "latent_dim=null (the theory) needs d'=8007" in body["detail"]  # as the user wrote it: JSON null
    assert api.jobs() == []


def test_layers_a_model_does_not_have_are_refused_at_submit(api):
    """An attention study naming layer 99 of a 2-layer model was accepted, and every child failed."""
    h = api.user("ann")  # the fixture's model "m" has 2 layers
    attention = {"study": "attention", "model": "m", "dataset": "d", "seq_len": 16, "seeds": 2}
    body = is_problem(api.submit(h, kind="sweep", params={**attention, "layers": [1, 99, 7]}), 422, "validation-error")
    assert "model 'm' has 2 layers (0 to 1); there is no layer 7, 99" in body["detail"]
    assert [e["loc"] for e in body["errors"]] == [["params", "layers"]]  # once, though every child reads it
    assert api.jobs() == []
    assert api.submit(h, kind="sweep", params={**attention, "layers": [0, 1]}).status_code == 202


def test_an_attention_study_of_a_model_it_cannot_read_is_refused_at_submit(api):
    """Falcon-like models (attention in their own modules) and Gemma 2 (soft-capped scores): every child
    failed in the worker after a queue wait; now one 422 says why and what to study instead."""
    h = api.user("ann")
    api.add_model("falcon-7b", architecture="falcon")
    api.add_model("gemma-2", architecture="gemma2")
    for name, says in (("falcon-7b", "computes its attention in its own modules"), ("gemma-2", "soft-caps")):
        params = {"study": "attention", "model": name, "dataset": "d", "seq_len": 16}
        body = is_problem(api.submit(h, kind="sweep", params=params), 422, "validation-error")
        assert says in body["detail"] and "the entropy job runs this one" in body["detail"], body
        assert body["errors"][0]["loc"] == ["params", "model"]
    assert api.jobs() == []
    assert api.submit(h, kind="entropy", params={"model": "falcon-7b", "dataset": "d"}).status_code == 202
    # a Gemma 2 whose config turns the cap off (recorded at registration: catalog.config_facts) is studied
    from lmscope.catalog import config_facts

    uncapped = config_facts({"model_type": "gemma2", "attn_logit_softcapping": None}).info
    assert uncapped["attention_softcap"] is False and config_facts({"model_type": "gemma2"}).info["attention_softcap"]
    api.add_model("gemma-2-uncapped", architecture="gemma2", info=uncapped)
    assert api.submit(h, kind="sweep", params={"study": "attention", "model": "gemma-2-uncapped", "dataset": "d",
                                               "seq_len": 16}).status_code == 202
    assert api.submit(h, kind="sweep", params={"study": "attention", "model": "m", "dataset": "d",
                                               "seq_len": 16}).status_code == 202
    # GPT-J goes through the AttentionInterface since transformers 5.24: only an older worker refuses it
    api.add_model("gpt-j", architecture="gptj")
    assert api.submit(h, kind="sweep", params={"study": "attention", "model": "gpt-j", "dataset": "d",
                                               "seq_len": 16}).status_code == 202


def test_dimension_wise_entropy_of_a_model_computing_its_own_attention_is_refused_at_submit(api):
    """The dimension-wise part reads q and k from lmscope's attention function, which Falcon-like models never
    call: the worker refused it after a queue wait and a model load; now a 422 names the model and the fix."""
    h = api.user("ann")
    api.add_model("falcon-7b", architecture="falcon")
    for params in ({"model": "falcon-7b"}, {"models": ["m", "falcon-7b"]}):
        body = is_problem(api.submit(h, kind="entropy", params={**params, "dataset": "d", "dimension_wise": True}),
                          422, "validation-error")
        assert "model 'falcon-7b' (falcon) computes its attention in its own modules" in body["detail"], body
        assert "set dimension_wise=false" in body["detail"] and "'m'" not in body["detail"]
        assert body["errors"][0]["loc"] == ["params", "dimension_wise"]
    assert api.jobs() == []
    # the per-head entropies of the same model, and the dimension-wise part of a model it can read, are accepted
    assert api.submit(h, kind="entropy", params={"model": "falcon-7b", "dataset": "d"}).status_code == 202
    assert api.submit(h, kind="entropy", params={"model": "m", "dataset": "d", "dimension_wise": True}).status_code == 202
    api.add_model("gpt-j", architecture="gptj")  # transformers 5.24 moved it onto the AttentionInterface
    assert api.submit(h, kind="entropy", params={"model": "gpt-j", "dataset": "d", "dimension_wise": True}).status_code == 202


def test_an_operator_job_on_a_model_computing_its_own_attention_is_refused_at_submit(api):
    """The operator job reads the attention weights from lmscope's attention function, which Falcon-like models
    never call: refused at submit, naming the model, not after a queue wait and a model load."""
    h = api.user("ann")
    api.add_model("falcon-7b", architecture="falcon")
    for params, field in (({"model": "falcon-7b"}, "model"), ({"models": ["m", "falcon-7b"]}, "models")):
        body = is_problem(api.submit(h, kind="operator", params={**params, "dataset": "d"}), 422, "validation-error")
        assert body["title"] == "The operator job cannot read this model's attention", body
        assert "model 'falcon-7b' (falcon) computes its attention in its own modules" in body["detail"], body
        assert "AttentionInterface" in body["detail"] and "dimension_wise" not in body["detail"]
        assert body["errors"][0]["loc"] == ["params", field]
    assert api.jobs() == []
    assert api.submit(h, kind="operator", params={"model": "m", "dataset": "d"}).status_code == 202


def test_an_operator_mean_too_large_for_the_model_is_refused_at_submit(api):
    """`mean` sums L × H × seq_len² weights in float64: 32 layers × 32 heads at seq_len 1024 is 8 × 32 × 32 × 1024²
    bytes = 8.0 GiB, over the 4 GiB limit: refused now with what to change, not after a queue wait and a load."""
    h = api.user("ann")
    api.add_model("big", layers=32, heads=32, architecture="llama", info={"max_positions": 4096})
    body = is_problem(api.submit(h, kind="operator", params={"model": "big", "dataset": "d", "seq_len": 1024}),
                      422, "validation-error")
    assert "model 'big': the mean attention pattern of 32 layers × 32 heads at seq_len 1024 takes 8.0 GiB" in body["detail"]
    assert "lower seq_len or drop 'mean'" in body["detail"] and body["errors"][0]["loc"] == ["params", "replacements"]
    assert api.jobs() == []
    for params in ({"seq_len": 1024, "replacements": ["other_window", "uniform"]}, {}):  # default seq_len: 256
        assert api.submit(h, kind="operator", params={"model": "big", "dataset": "d", **params}).status_code == 202
    api.add_model("unrecorded", layers=None, heads=None)  # the worker checks it
    assert api.submit(h, kind="operator", params={"model": "unrecorded", "dataset": "d", "seq_len": 16384}
                      ).status_code == 202


def test_entropy_over_models_of_different_shapes_is_refused_at_submit(api):
    """The job follows each (layer, head) across its models: a 2-layer and a 3-layer model failed in
    the worker with an IndexError, after measuring the first."""
    h = api.user("ann")
    api.add_model("deeper", layers=3)
    api.add_model("unknown-shape", layers=None, heads=None)  # not recorded: the worker checks it
    body = is_problem(api.submit(h, kind="entropy", params={"models": ["m", "unknown-shape", "deeper"], "dataset": "d"}),
                      422, "validation-error")
    assert "model 'deeper' has 3 layers × 2 heads but 'm' has 2 × 2" in body["detail"]
    assert body["errors"][0]["loc"] == ["params", "models"] and api.jobs() == []
    assert api.submit(h, kind="entropy", params={"models": ["m", "unknown-shape"], "dataset": "d"}).status_code == 202


def test_sweep_inserts_parent_and_children_and_publishes_the_children(api):
    h = api.user("ann")
    r = api.submit(h, kind="sweep", params=small_sweep(4), tags=["s"])
    assert r.status_code == 202
    parent = r.get_json()
    assert parent["status"] == "running" and parent["children"]["total"] == 4 and parent["children"]["queued"] == 4
    assert parent["progress"] == {"done": 0, "total": 4, "stage": "children", "fraction": 0.0, "updated_at": None}
    row = api.job_row(parent["id"])
    assert row.waiting_children and row.started_at is not None
    # The parent keeps its study's fields only (a sumformer sweep lists no attention-study defaults).
    assert set(row.params) == {"study", "target", "architectures", "grid", "train"}
    assert KINDS["sweep"].params.model_validate(row.params) == KINDS["sweep"].params.model_validate(small_sweep(4))
    children = api.jobs(parent_id=parent["id"])
    # The children are the kind's grid points, in order, with their params validated (defaults filled in).
    expected = KINDS["sweep"].expand(KINDS["sweep"].params.model_validate(small_sweep(4)))
    assert [(c.kind, c.name) for c in children] == [(e.kind, e.name) for e in expected]
    assert [c.params for c in children] == [
        KINDS[e.kind].params.model_validate(e.params).model_dump(mode="json") for e in expected]
    assert len({c.params["latent_dim"] for c in children}) == 4
    assert all(c.status == "queued" and c.user_id == row.user_id and "s" in c.tags for c in children)
    assert api.publisher.published == [c.id for c in children]  # the children, never the parent
    assert api.publisher.aggregations == []  # ordinary jobs, in the queue's order


def test_sweep_size_limit(api):
    body = is_problem(api.submit(api.user("ann"), kind="sweep", params=small_sweep(9)), 422, "sweep-too-large")
    assert body["points"] == 9 and "9 points" in body["detail"] and "8" in body["detail"]
    assert api.jobs() == []


def test_limits_are_per_user_with_the_server_default_otherwise(api):
    """`lmscope user limits` sets a user's own sweep size and active-jobs limits, lower or higher
    than the server's (8 points and 5 jobs here); others keep the server's. GET /v1/me shows them."""
    from sqlalchemy import update

    from lmscope.db.models import User

    ann, bob, cat = api.user("ann"), api.user("bob"), api.user("cat")
    with api.sessions.begin() as session:
        session.execute(update(User).where(User.name == "bob").values(max_sweep_points=2, max_active_jobs=1))
        session.execute(update(User).where(User.name == "cat").values(max_sweep_points=20))
    assert api.submit(ann, kind="sweep", params=small_sweep(3)).status_code == 202
    body = is_problem(api.submit(bob, kind="sweep", params=small_sweep(3)), 422, "sweep-too-large")
    assert body["points"] == 3 and body["limit"] == 2 and "set for user 'bob' by an admin" in body["detail"]
    assert api.submit(bob, kind="sweep", params=small_sweep(2)).status_code == 202
    assert is_problem(api.submit(bob), 429, "quota-exceeded")["limit"] == 1
    assert api.submit(cat, kind="sweep", params=small_sweep(9)).status_code == 202  # above the server's 8
    assert is_problem(api.submit(ann, kind="sweep", params=small_sweep(9)), 422, "sweep-too-large")["limit"] == 8

    me = {who: api.client.get("/v1/me", headers=h).get_json() for who, h in (("ann", ann), ("bob", bob), ("cat", cat))}
    assert me["bob"] == {"name": "bob", "is_admin": False, "active_jobs": 1, "uploaded_bytes": 0, "job_file_bytes": 0,
                         "limits": {"max_active_jobs": 1, "max_sweep_points": 2,
                                    "max_uploaded_bytes": api.settings.max_uploaded_bytes_per_user},
                         "per_user_limits": ["max_active_jobs", "max_sweep_points"]}
    assert me["ann"]["limits"] == {"max_active_jobs": 5, "max_sweep_points": 8, "max_uploaded_bytes": 1024 ** 3}
    assert me["ann"]["per_user_limits"] == []
    assert me["cat"]["limits"]["max_sweep_points"] == 20 and me["cat"]["per_user_limits"] == ["max_sweep_points"]
    assert api.client.get("/v1/me").status_code == 401


def test_publish_failure_still_accepts_the_job_for_the_reaper(api):
    api.publisher.fail = True
    r = api.submit(api.user("ann"))
    assert r.status_code == 202
    row = api.job_row(r.get_json()["id"])
    assert row.status == "queued" and row.published_at is None


def test_a_reused_run_name_is_refused_at_submit(api):
    """A taken run_name used to fail at the first checkpoint, after training (or, for a short run,
    to add `demo@step5` beside another job's `demo@step150`)."""
    h = api.user("ann")
    first = api.submit(h, kind="train", params={"dataset": "d", "run_name": "demo"}).get_json()["id"]
    # While the first job is active and has no checkpoint yet, its run name is already taken.
    body = is_problem(api.submit(h, kind="train", params={"dataset": "d", "run_name": "demo", "steps": 5,
                                                          "warmup_steps": 1}), 409, "name-taken")
    assert f"job {first}" in body["detail"] and "run_name" in body["detail"]
    assert body["errors"][0]["loc"] == ["params", "run_name"]
    # Another user is refused too, without learning the job's id (jobs are private)
    body = is_problem(api.submit(api.user("bob"), kind="train", params={"dataset": "d", "run_name": "demo"}),
                      409, "name-taken")
    assert "another user's job (still active)" in body["detail"] and f"job {first}" not in body["detail"]
    # Once it finished, its checkpoints hold the name; another user cannot take it either.
    api.set_job(first, status="failed")
    add_checkpoint(api, "demo@step150", first)
    body = is_problem(api.submit(api.user("bob"), kind="train", params={"dataset": "d", "run_name": "demo"}),
                      409, "name-taken")
    assert "'demo@step150' exists (a checkpoint of another user's run)" in body["detail"] and "'demo'" in body["detail"]
    assert f"job {first}" not in body["detail"]
    body = is_problem(api.submit(h, kind="train", params={"dataset": "d", "run_name": "demo"}), 409, "name-taken")
    assert f"'demo@step150' exists (a checkpoint of job {first})" in body["detail"]  # its owner is told which
    assert len(api.jobs()) == 1 and api.publisher.published == [first]
    # Other names are free: a longer name with the same start, and one whose `_` a LIKE would match.
    add_checkpoint(api, "axb@step1", first)
    for name in ("demo2", "a_b", None):
        assert api.submit(h, kind="train", params={"dataset": "d", "run_name": name}).status_code == 202, name


def test_racing_submits_of_one_new_run_name_let_exactly_one_through(api, monkeypatch):
    """Two users submit the same new run_name at once. The first is held between its name check and
    its insert; the second must wait for it (advisory lock on PostgreSQL, BEGIN IMMEDIATE on SQLite)
    and then be refused, instead of passing the check while the first row does not exist yet."""
    import lmscope.api.submit as submit

    checked, release = threading.Event(), threading.Event()
    real_check_quota = submit.check_quota

    def held_check_quota(session, caller, settings):
        if not checked.is_set():  # the first submit: its name check has passed
            checked.set()
            assert release.wait(20)
        return real_check_quota(session, caller, settings)

    monkeypatch.setattr(submit, "check_quota", held_check_quota)
    heads = {who: api.user(who) for who in ("ann", "bob")}
    results: dict[str, object] = {}

    def post(who):
        results[who] = api.submit(heads[who], kind="train", params={"dataset": "d", "run_name": "shared"})

    first = threading.Thread(target=post, args=("ann",))
    first.start()
    assert checked.wait(20)
    second = threading.Thread(target=post, args=("bob",))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second submit went ahead while the first held the name"
    release.set()
    first.join(20)
    second.join(20)
    assert results["ann"].status_code == 202
    body = is_problem(results["bob"], 409, "name-taken")
    assert "another user's job (still active)" in body["detail"]
    assert [j.user_id for j in api.jobs()] == [api.job_row(results["ann"].get_json()["id"]).user_id]


def test_run_names_like_the_default_are_reserved(api):
    body = is_problem(api.submit(api.user("ann"), kind="train", params={"dataset": "d", "run_name": "run7"}),
                      422, "validation-error")
    assert "run<job id>" in body["detail"] and "Value error" not in body["detail"]


def test_a_missing_field_says_it_has_no_default_and_what_it_takes(api):
    """pydantic's own words were "Field required"."""
    h = api.user("ann")
    body = is_problem(api.submit(h, kind="norms", params={"dataset": "d"}), 422, "validation-error")
    assert body["errors"] == [{"loc": ["params", "model"], "type": "missing",
                               "msg": "required (no default): registered model name"}]
    # a description's first clause: the detail joins the fields with "; " (dataset's says more after one)
    body = is_problem(api.submit(h, kind="norms", params={"max_samples": 10}), 422, "validation-error")
    assert body["detail"] == ("fix these fields: params.model: required (no default): registered model name; "
                              "params.dataset: required (no default): registered dataset name")
    body = is_problem(api.client.post("/v1/jobs", headers=h, json={"params": {"model": "m"}}), 422, "validation-error")
    assert [(e["loc"], e["msg"]) for e in body["errors"]] == [
        (["kind"], "required (no default): the job kind (GET /v1/kinds lists them)")]


def test_unknown_fields_suggest_the_intended_name(api):
    h = api.user("ann")
    body = is_problem(api.submit(h, kind="norms", params={"model": "m", "dataset": "d", "max_sample": 50}),
                      422, "validation-error")
    assert body["errors"] == [{"loc": ["params", "max_sample"], "type": "extra_forbidden",
                               "msg": "unknown field; did you mean 'max_samples'?"}]
    assert "params.max_sample: unknown field; did you mean 'max_samples'?" in body["detail"]
    # Nested models (a sweep's train. and grid.) and the body itself.
    body = is_problem(api.submit(h, kind="sweep", params={"train": {"epoch": 5}, "grid": {"seeds": [0]}}),
                      422, "validation-error")
    msgs = {tuple(e["loc"]): e["msg"] for e in body["errors"]}
    assert msgs[("params", "train", "epoch")] == "unknown field; did you mean 'epochs'?"
    assert msgs[("params", "grid", "seeds")] == "unknown field; did you mean 'seed'?"
    body = is_problem(api.client.post("/v1/jobs", headers=h, json={"kind": "probe", "params": {"model": "m"},
                                                                    "tag": ["x"]}), 422, "validation-error")
    assert body["errors"][0]["msg"] == "unknown field; did you mean 'tags'?"
    # a mistake in the body and one in the params: both in one answer
    both = {"kind": "norms", "params": {"model": "m", "dataset": "d", "max_sample": 5}, "tag": ["x"]}
    body = is_problem(api.client.post("/v1/jobs", headers=h, json=both), 422, "validation-error")
    assert {tuple(e["loc"]): e["msg"] for e in body["errors"]} == {
        ("tag",): "unknown field; did you mean 'tags'?",
        ("params", "max_sample"): "unknown field; did you mean 'max_samples'?"}
    body = is_problem(api.client.post("/v1/jobs", headers=h, json={**both, "kind": "nrms"}), 422, "validation-error")
    assert [e["loc"] for e in body["errors"]] == [["tag"], ["kind"]]  # and a kind that does not exist
    # Nothing close: the valid names.
    body = is_problem(api.submit(h, params={"model": "m", "colour": 1}), 422, "validation-error")
    assert body["errors"][0]["msg"] == "unknown field; the fields are: " + ", ".join(sorted(KINDS["probe"].params.model_fields))
    # Another kind's fields (the bundled fig2 sweep sent as norms): the kind is wrong, not the spelling
    # ("target" is close to norms' "dataset").
    fig2 = json.loads(resources.files("lmscope.examples").joinpath("fig2.json").read_text())
    body = is_problem(api.submit(h, kind="norms", params={**fig2, "model": "m", "dataset": "d"}), 422,
                      "validation-error")
    msgs = {tuple(e["loc"]): e["msg"] for e in body["errors"]}
    assert msgs[("params", "target")] == "not a field of 'norms' but of 'sweep': parameters meant for another kind?"
    assert "did you mean" not in body["detail"]
    # ... unless it is a near miss of this kind's own field: both said
    body = is_problem(api.submit(h, kind="sweep", params={"seed": 1}), 422, "validation-error")
    assert body["errors"][0]["msg"] == ("unknown field; did you mean 'seeds'? ('seed' is a field of 'entropy' / "
                                        "'norms' / 'pruning' / 'train')")


def test_value_errors_read_without_pydantics_prefix(api):
    body = is_problem(api.submit(api.user("ann"), kind="train", params={"dataset": "d", "warmup_steps": 60, "steps": 5}),
                      422, "validation-error")
    msg = ("warmup_steps (60) must be less than steps (5); for a short run lower it too, e.g. warmup_steps=0, "
           "or leave it out")
    assert body["errors"][0]["msg"] == msg
    assert body["detail"] == "fix these fields: params: " + msg
