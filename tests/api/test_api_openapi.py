"""The OpenAPI document, the /docs page and the generic HTTP errors (no SQL behaviour: SQLite only)."""

from __future__ import annotations

import re

import pytest

from .conftest import is_problem


@pytest.fixture
def db_url(sqlite_url):
    return sqlite_url


def test_openapi_is_valid_and_lists_every_endpoint(api):
    from openapi_spec_validator import validate

    spec = api.client.get("/openapi.json").get_json()
    validate(spec)
    assert spec["openapi"].startswith("3.1")
    documented = {(path, method.upper()) for path, item in spec["paths"].items() for method in item}
    for rule in api.app.url_map.iter_rules():
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            assert (path, method) in documented, (path, method)
    for must in [("/v1/jobs", "POST"), ("/v1/jobs", "GET"), ("/v1/jobs/{job_id}", "GET"),
                 ("/v1/jobs/{job_id}/cancel", "POST"), ("/v1/jobs/{job_id}/results", "GET"),
                 ("/v1/jobs/{job_id}/artifacts", "GET"), ("/v1/jobs/{job_id}/artifacts/{name}", "GET"),
                 ("/v1/jobs/{job_id}/events", "GET"), ("/v1/models", "GET"), ("/v1/models", "POST"),
                 ("/v1/datasets", "GET"), ("/v1/datasets", "POST"), ("/healthz", "GET"), ("/readyz", "GET"),
                 ("/metrics", "GET"), ("/openapi.json", "GET"), ("/docs", "GET")]:
        assert must in documented, must
    # Each operation's summary is its view's whole first paragraph, a sentence that wraps included (the /docs
    # page showed "…the broker (when jobs go through" when it took the first line).
    import inspect

    for rule in api.app.url_map.iter_rules():
        first = inspect.cleandoc(api.app.view_functions[rule.endpoint].__doc__ or "").split("\n\n")[0]
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            summary = spec["paths"][path][method.lower()]["summary"]
            assert summary == " ".join(first.split()) and "\n" not in summary, (path, summary)
    summary = spec["paths"]["/readyz"]["get"]["summary"]
    assert summary.count("(") == summary.count(")") and summary.endswith((".", ")")), summary
    # The submit body is one of the kinds, each with its pydantic params schema.
    from lmscope.params import KINDS

    schemas = spec["components"]["schemas"]
    variants = schemas["SubmitJob"]["oneOf"]
    submittable = sorted(k for k, s in KINDS.items() if s.submittable)
    assert sorted(schemas[v["$ref"].split("/")[-1]]["properties"]["kind"]["const"] for v in variants) == submittable
    for kind in submittable:
        params = schemas[KINDS[kind].params.__name__]
        assert set(params["properties"]) == set(KINDS[kind].params.model_fields)


def test_the_documented_query_parameters_are_the_ones_each_endpoint_reads(api):
    """The API refuses any other query parameter (lmscope.api.inputs.query_params), so the two must agree."""
    spec = api.client.get("/openapi.json").get_json()
    for rule in api.app.url_map.iter_rules():
        if not rule.rule.startswith("/v1/"):
            continue
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        reads = getattr(api.app.view_functions[rule.endpoint], "query_params", ((), frozenset()))[0]
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            documented = [p["name"] for p in spec["paths"][path][method.lower()].get("parameters", [])
                          if p["in"] == "query"]
            assert sorted(documented) == sorted(reads), (method, path)


def test_the_statuses_the_server_answers_are_the_documented_ones(api, make_api):
    """A client generated from /openapi.json knows each answer: a gzip body (415), a bad events timeout (422),
    an artifact the caller has (304), a request addressed to a name without tokens (403)."""
    import gzip
    import hashlib

    from lmscope.db.models import Artifact

    spec = api.client.get("/openapi.json").get_json()

    def documented(path, method, response, status):
        assert response.status_code == status
        assert str(status) in spec["paths"][path][method]["responses"], (path, method, status)

    h = api.user("ann")
    documented("/v1/jobs", "post", api.client.post("/v1/jobs", headers={**h, "Content-Encoding": "gzip"},
                                                  data=gzip.compress(b'{"kind": "probe"}'), content_type="application/json"), 415)
    job = api.submit(h).get_json()["id"]
    documented("/v1/jobs/{job_id}/events", "get", api.client.get(f"/v1/jobs/{job}/events?timeout=0", headers=h), 422)
    data = b"\x89PNG" + bytes(64)
    path = api.settings.artifact_dir / "jobs" / str(job) / "a.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    with api.sessions.begin() as session:
        session.add(Artifact(job_id=job, name="a.png", media_type="image/png", size=len(data),
                             sha256=hashlib.sha256(data).hexdigest()))
    etag = api.client.get(f"/v1/jobs/{job}/artifacts/a.png", headers=h).headers["ETag"]
    documented("/v1/jobs/{job_id}/artifacts/{name}", "get",
               api.client.get(f"/v1/jobs/{job}/artifacts/a.png", headers={**h, "If-None-Match": etag}), 304)
    open_api = make_api(auth=False)
    for path, method in (("/v1/jobs", "get"), ("/v1/jobs", "post"), ("/healthz", "get")):
        documented(path, method, getattr(open_api.client, method)(path, headers={"Host": "evil.example:5000"}), 403)
    assert "x_meaning" in spec["components"]["schemas"]["Comparison"]["properties"]["series"]["items"]["properties"]


def test_docs_page_is_self_contained(api):
    r = api.client.get("/docs")
    assert r.status_code == 200 and r.mimetype == "text/html"
    html = r.get_data(as_text=True)
    assert "/openapi.json" in html
    # No CDN: nothing loaded from another host.
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', html)


def test_generic_http_errors_are_problems(api):
    h = api.user("ann")
    body = is_problem(api.client.get("/nowhere"), 404, "not-found")
    assert body["instance"] == "/nowhere"
    r = api.client.delete("/v1/jobs", headers=h)
    body = is_problem(r, 405, "method-not-allowed")
    assert "GET" in r.headers["Allow"] and "POST" in body["detail"]


def test_unexpected_errors_are_500_problems(api, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("secret internals")

    monkeypatch.setattr("lmscope.api.jobs.load_visible_job", boom)
    api.app.testing = False  # as in production: the handler answers instead of re-raising
    r = api.client.get("/v1/jobs/1", headers=api.user("ann"))
    is_problem(r, 500, "internal-error")
    assert "secret internals" not in r.get_data(as_text=True)


def test_kinds_lists_every_kind_and_marks_child_kinds(api):
    """Child kinds show up in `lmscope jobs`, so /v1/kinds names them too, as not submittable."""
    from lmscope.params import KINDS

    items = api.client.get("/v1/kinds", headers=api.user("ann")).get_json()["items"]
    assert [k["name"] for k in items] == sorted(KINDS)
    by_name = {k["name"]: k for k in items}
    for kind, spec in KINDS.items():
        assert by_name[kind]["submittable"] is spec.submittable
    assert by_name["sumformer_fit"]["child_of"] == ["sweep"] and by_name["attention_approx"]["child_of"] == ["sweep"]
    assert by_name["probe"]["child_of"] is None
    sweep = by_name["sweep"]
    assert sweep["sweep"] is True and "properties" in sweep["params_schema"]
