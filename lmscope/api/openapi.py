"""GET /openapi.json (OpenAPI 3.1, generated from the routes and the pydantic params models) and /docs.

Paths, methods, path parameters and summaries come from Flask's url_map and the views' docstrings,
so a new route is documented as soon as it exists; query parameters, bodies and responses that the
url_map cannot know are added from `EXTRA` below.
"""

from __future__ import annotations

import inspect
import re
from importlib import resources
from typing import Any

from flask import Blueprint, Flask, Response, current_app

import lmscope
from lmscope.api.registry import RegisterModelBody
from lmscope.api.submit import SubmitBody
from lmscope.catalog import DATASET_FORMATS
from lmscope.params import KINDS

bp = Blueprint("openapi", __name__)

REF = "#/components/schemas/{model}"
PROBLEM = {"description": "a problem (RFC 9457)",
           "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}}


def _json(schema_ref: str, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema_ref}"}}}}


def _query(name: str, schema: dict, description: str) -> dict:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


# What the url_map cannot know: (method, endpoint) → OpenAPI operation fields.
EXTRA: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "jobs.submit_job"): {
        "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string", "maxLength": 200},
                        "description": "same key + same body → the first job (200); a different body → 422"}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SubmitJob"}}}},
        "responses": {"202": _json("Job", "accepted; Location names the job"), "200": _json("Job", "an idempotent replay"),
                      "400": PROBLEM, "409": PROBLEM, "413": PROBLEM, "415": PROBLEM, "422": PROBLEM, "429": PROBLEM},
    },
    ("get", "jobs.list_jobs"): {
        "parameters": [
            _query("kind", {"type": "string"}, "comma-separated kinds, e.g. norms,entropy"),
            _query("status", {"type": "string"}, "comma-separated statuses: queued,running,succeeded,failed,cancelled"),
            {**_query("tag", {"type": "array", "items": {"type": "string"}},
                      "only jobs with this tag (repeat: jobs with every one)"), "explode": True},
            _query("parent", {"type": "string"}, "a sweep's id lists its children; `none` lists top-level jobs only"),
            _query("user", {"type": "string"}, "admins: only this user's jobs"),
            _query("limit", {"type": "integer", "minimum": 1, "maximum": 500, "default": 50}, "page size"),
            _query("page_token", {"type": "string"}, "next_page_token of the previous page"),
        ],
        "responses": {"200": _json("JobPage"), "422": PROBLEM},
    },
    ("get", "jobs.get_job"): {"responses": {"200": _json("Job")}},
    ("get", "registry.list_models"): {
        "parameters": [
            _query("run", {"type": "string"}, "only the checkpoints of this training run (`<run>@step<N>`)"),
            _query("source", {"type": "string", "enum": ["builtin", "directory", "checkpoint"]}, "only this kind of model"),
            _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 1000}, "page size"),
            _query("page_token", {"type": "string"}, "next_page_token of the previous page"),
        ],
        "responses": {"200": {"description": "`{items: [model], next_page_token}`, by name"}, "422": PROBLEM},
    },
    ("delete", "registry.delete_model"): {"responses": {"204": {"description": "removed"}, "409": PROBLEM}},
    ("delete", "registry.delete_dataset"): {"responses": {"204": {"description": "removed"}, "409": PROBLEM}},
    ("get", "jobs.list_kinds"): {"responses": {"200": _json("KindList")}},
    ("get", "jobs.whoami"): {"responses": {"200": _json("Me")}},
    ("post", "jobs.cancel_job"): {"responses": {"202": _json("Job"), "409": PROBLEM}},
    ("delete", "jobs.delete_job"): {"responses": {"200": _json("JobDeleted"), "409": PROBLEM}},
    ("get", "results.get_results"): {
        "parameters": [{**_query("series", {"type": "array", "items": {"type": "string"}},
                                 "series names to return (repeat; `prefix*` matches a prefix)"), "explode": True},
                       _query("page_token", {"type": "string"}, "next_page_token of the previous page")],
        "responses": {"200": _json("Results"), "422": PROBLEM},
    },
    ("get", "results.compare_jobs"): {
        "parameters": [
            {**_query("jobs", {"type": "string"}, "2 to 20 job ids, comma-separated (or repeated)"), "required": True},
            {**_query("series", {"type": "array", "items": {"type": "string"}},
                      "curves to compare (repeat; `prefix*` matches a prefix)"), "explode": True}],
        "responses": {"200": _json("Comparison"), "404": PROBLEM, "422": PROBLEM},
    },
    ("get", "results.download_artifact"): {
        "responses": {"200": {
            "description": "the file, with the media type it was recorded with; PNG/JPEG/GIF images, JSON, plain text, "
                           "CSV and Markdown are served inline, anything else (SVG and HTML too) as an attachment",
            "content": {media: {"schema": {"type": "string", "format": "binary"}}
                        for media in ("image/png", "application/json", "text/plain", "text/csv", "application/octet-stream")}},
        "304": {"description": "If-None-Match named the file's ETag (its sha256): you have it already"}}},
    ("get", "events.job_events"): {
        "parameters": [_query("timeout", {"type": "number", "default": 300, "exclusiveMinimum": 0, "maximum": 3600},
                              "longest stream in seconds")],
        "responses": {"200": {"description": "events `status`, `progress`, `end` (and `timeout`)",
                              "content": {"text/event-stream": {"schema": {"type": "string"}}}}, "422": PROBLEM,
                      "429": PROBLEM},
    },
    ("post", "registry.register_model"): {
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RegisterModelBody"}}}},
        "responses": {"201": {"description": "registered"}, "400": PROBLEM, "403": PROBLEM, "409": PROBLEM,
                      "413": PROBLEM, "415": PROBLEM, "422": PROBLEM},
    },
    ("post", "registry.upload_dataset"): {
        "parameters": [_query("name", {"type": "string"}, "dataset name (raw-body uploads)"),
                       _query("format", {"type": "string", "enum": list(DATASET_FORMATS)}, "file format (raw-body uploads)"),
                       _query("description", {"type": "string"}, "what the corpus is (raw-body uploads)")],
        "requestBody": {"required": True, "content": {
            "multipart/form-data": {"schema": {"type": "object", "required": ["file", "name"], "properties": {
                "file": {"type": "string", "format": "binary"}, "name": {"type": "string"},
                "format": {"type": "string", "enum": list(DATASET_FORMATS), "default": "text"},
                "description": {"type": "string"}}}},
            "text/plain": {"schema": {"type": "string"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        "responses": {"201": {"description": "stored"}, "409": PROBLEM, "413": PROBLEM, "422": PROBLEM},
    },
    ("get", "health.readyz"): {"responses": {"503": PROBLEM}},
    ("get", "metrics.metrics"): {"responses": {"200": {"description": "Prometheus text format",
                                                        "content": {"text/plain": {"schema": {"type": "string"}}}}}},
    ("get", "openapi.docs_page"): {"responses": {"200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}}},
    ("get", "dashboard.dashboard"): {"responses": {"200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}}},
}

# No token needed (the authentication hook guards /v1/ only).
PUBLIC = {"health.healthz", "health.readyz", "metrics.metrics", "openapi.openapi_json", "openapi.docs_page",
          "dashboard.dashboard"}

_CONVERTER = re.compile(r"<(?:(\w+)(?:\([^)]*\))?:)?(\w+)>")


def _hoist(schema: dict, components: dict) -> dict:
    """Move pydantic's `$defs` into components.schemas (refs already point there)."""
    for name, sub in schema.pop("$defs", {}).items():
        components[name] = sub
    return schema


def build_spec(app: Flask) -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    submit_variants, mapping = [], {}
    for kind, spec in sorted(KINDS.items()):
        model_name = spec.params.__name__
        schemas[model_name] = _hoist(spec.params.model_json_schema(ref_template=REF), schemas)
        schemas[model_name].setdefault("description", spec.description)
        if not spec.submittable:
            continue  # child kinds: made by sweeps, never submitted
        variant = f"Submit_{kind}"
        base = SubmitBody.model_json_schema(ref_template=REF)
        props = dict(base["properties"])
        props["kind"] = {"const": kind, "type": "string", "description": spec.description}
        props["params"] = {"$ref": REF.format(model=model_name)}
        schemas[variant] = {"type": "object", "title": variant, "properties": props, "required": ["kind"],
                            "additionalProperties": False}
        submit_variants.append({"$ref": REF.format(model=variant)})
        mapping[kind] = REF.format(model=variant)
    schemas["SubmitJob"] = {"oneOf": submit_variants, "discriminator": {"propertyName": "kind", "mapping": mapping}}
    schemas["RegisterModelBody"] = _hoist(RegisterModelBody.model_json_schema(ref_template=REF), schemas)
    schemas.update(STATIC_SCHEMAS)

    paths: dict[str, dict] = {}
    used_ids: set[str] = set()
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: r.rule):
        path = _CONVERTER.sub(lambda m: "{" + m.group(2) + "}", rule.rule)
        params = [{"name": arg, "in": "path", "required": True,
                   "schema": {"type": "integer"} if f"<int:{arg}>" in rule.rule else {"type": "string"}}
                  for arg in sorted(rule.arguments)]
        view = app.view_functions[rule.endpoint]
        # the docstring's first paragraph is the summary (a sentence may wrap onto several lines), the rest
        # the description
        summary, _, description = inspect.cleandoc(view.__doc__ or rule.endpoint).partition("\n\n")
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            m = method.lower()
            extra = EXTRA.get((m, rule.endpoint), {})
            operation_id = rule.endpoint.replace(".", "_") + ("" if m == "get" else f"_{m}")
            if operation_id in used_ids:  # one view on several paths: operation ids must stay unique
                operation_id += "_" + (re.sub(r"\W+", "_", path).strip("_") or "root")
            used_ids.add(operation_id)
            op: dict[str, Any] = {
                "operationId": operation_id,
                "summary": " ".join(summary.split()),
                "tags": [rule.endpoint.split(".")[0]],
                "parameters": params + extra.get("parameters", []),
                "responses": dict(extra.get("responses", {})),
            }
            if not any(code.startswith("2") for code in op["responses"]):
                op["responses"]["200"] = {"description": "OK"}
            if description.strip():
                op["description"] = description.strip()
            if "requestBody" in extra:
                op["requestBody"] = extra["requestBody"]
            # without tokens (LMSCOPE_AUTH=0): host-not-allowed on any route, cross-origin-request on a change
            op["responses"].setdefault("403", PROBLEM)
            if rule.endpoint not in PUBLIC:
                op["responses"].setdefault("401", PROBLEM)
                if rule.arguments:
                    op["responses"].setdefault("404", PROBLEM)
                if "job_id" in rule.arguments:  # a deleted job (`job-deleted`)
                    op["responses"].setdefault("410", PROBLEM)
            else:
                op["security"] = []
            if not op["parameters"]:
                del op["parameters"]
            paths.setdefault(path, {})[m] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "lmscope", "version": lmscope.__version__,
                 "description": "Submit analyses of transformer language models, watch them run, fetch their results. "
                                "Errors are application/problem+json (RFC 9457)."},
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "a token from `lmscope user create NAME`"}}},
    }


_NULLABLE_STR = {"type": ["string", "null"]}
STATIC_SCHEMAS: dict[str, Any] = {
    "Problem": {"type": "object", "required": ["type", "title", "status", "detail"], "properties": {
        "type": {"type": "string", "format": "uri"}, "title": {"type": "string"}, "status": {"type": "integer"},
        "detail": {"type": "string", "description": "what to change"}, "instance": {"type": "string"},
        "errors": {"type": "array", "items": {"type": "object", "properties": {
            "loc": {"type": "array", "items": {"type": ["string", "integer"]}}, "msg": {"type": "string"},
            "type": {"type": "string"}}}}}},
    "Progress": {"type": ["object", "null"], "properties": {
        "done": {"type": ["integer", "null"]}, "total": {"type": ["integer", "null"]}, "stage": _NULLABLE_STR,
        "fraction": {"type": ["number", "null"]}, "updated_at": _NULLABLE_STR}},
    "Job": {"type": "object", "properties": {
        "id": {"type": "integer"}, "kind": {"type": "string"}, "name": _NULLABLE_STR,
        "tags": {"type": "array", "items": {"type": "string"}}, "user": _NULLABLE_STR,
        "status": {"type": "string", "enum": ["queued", "running", "succeeded", "failed", "cancelled"]},
        "params": {"type": "object"}, "parent_id": {"type": ["integer", "null"]},
        "attempts": {"type": "integer"}, "max_attempts": {"type": "integer"},
        "created_at": {"type": "string"}, "published_at": _NULLABLE_STR, "started_at": _NULLABLE_STR,
        "finished_at": _NULLABLE_STR, "heartbeat_at": _NULLABLE_STR, "worker": _NULLABLE_STR,
        "progress": {"$ref": "#/components/schemas/Progress"}, "cancel_requested": {"type": "boolean"},
        "error": {"type": ["object", "null"], "properties": {"type": _NULLABLE_STR, "message": _NULLABLE_STR}},
        "summary": {"type": ["object", "null"]}, "environment": {"type": ["object", "null"]},
        "timings": {"type": "object"}, "children": {"type": ["object", "null"], "description": "counts by status (sweeps)"},
        "children_unsent": {"type": "integer", "description": "only on one sweep (not in lists), with a broker: "
                            "how many of its queued children the broker has not taken yet (it was down at submit; "
                            "the reaper sends them when it answers); absent when none"},
        "queue": {"type": "object", "description": "only on one queued job (not in lists): queued jobs submitted "
                  "before it, anyone's, and jobs running now; under `lmscope up`, worker_stopped says why its worker "
                  "takes no more jobs (e.g. an unusable GPU) when it does not; unsent: true while the broker has "
                  "not taken the job (it was down at submit; the reaper sends it when it answers); workers: with a "
                  "broker, how many Celery workers consume its queue (0: none runs, the job waits for one; absent "
                  "when the broker cannot say)",
                  "properties": {"ahead": {"type": "integer"}, "running": {"type": "integer"},
                                 "worker_stopped": {"type": "string"}, "unsent": {"type": "boolean"},
                                 "workers": {"type": "integer"}}},
        "links": {"type": "object", "additionalProperties": {"type": "string"}}}},
    "JobPage": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"$ref": "#/components/schemas/Job"}},
        "next_page_token": _NULLABLE_STR}},
    "KindList": {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "description": {"type": "string"}, "sweep": {"type": "boolean"},
        "submittable": {"type": "boolean", "description": "false: a child kind, made only by its parent kind"},
        "child_of": {"type": ["array", "null"], "items": {"type": "string"}},
        "params_schema": {"type": "object"},
        "defaults": {"type": "object", "description": "each parameter's default (nested models as objects)"},
        "example": {"type": ["object", "null"],
                    "description": "params of a small job of this kind on the built-ins (under a minute on a CPU)"}}}}}},
    "JobDeleted": {"type": "object", "properties": {
        "id": {"type": "integer"},
        "deleted": {"type": "array", "items": {"type": "integer"}, "description": "the job and its grid points"},
        "freed_bytes": {"type": "integer", "description": "the size of the files removed"}}},
    "Me": {"type": "object", "properties": {
        "name": {"type": "string"}, "is_admin": {"type": "boolean"}, "active_jobs": {"type": "integer"},
        "uploaded_bytes": {"type": "integer", "description": "what your uploads count against max_uploaded_bytes"},
        "job_file_bytes": {"type": "integer", "description": "the size of your jobs' files in the artifact store "
                                                             "(`lmscope delete` frees it)"},
        "limits": {"type": "object", "properties": {"max_active_jobs": {"type": "integer"},
                                                    "max_sweep_points": {"type": "integer"},
                                                    "max_uploaded_bytes": {"type": "integer"}}},
        "per_user_limits": {"type": "array", "items": {"type": "string"},
                            "description": "the limits set for this user (the others are the server's)"}}},
    "Comparison": {"type": "object", "properties": {
        "jobs": {"type": "array", "items": {"type": "object", "description": "id, kind, name, status"}},
        "params": {"type": "object", "description": "parameter → {job id: value}, only those that differ"},
        "summary": {"type": "object", "description": "summary key → {job id: value}: every scalar, and lists and objects up to 4,000 characters of JSON"},
        "series": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "labels": {"type": "object"},
            "x_meaning": {"type": "string", "description": "what x is, as an axis label (\"x\" when unknown)"},
            "jobs": {"type": "object", "description": "job id → {x, y}"}}}},
        "missing": {"type": "array", "items": {"type": "string"}, "description": "requested names no job has"},
        "shared_series": {"type": "array", "items": {"type": "string"}, "description": "names every job has"}}},
    "Results": {"type": "object", "properties": {"job_id": {"type": "integer"}, "status": {
        "type": "string", "description": "the job's status: series land when it ends (none before)"},
        "series": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "labels": {"type": "object"},
                                         "x_meaning": {"type": "string", "description": "what x is, as an axis "
                                                       "label (\"x\" when unknown)"},
                                         "x": {"type": "array"}, "y": {"type": "array"}}}},
        "missing": {"type": "array", "items": {"type": "string"}, "description": "requested names that matched nothing"},
        "available": {"type": "array", "items": {"type": "string"}, "description": "with `missing`: the job's series names"},
        "next_page_token": {**_NULLABLE_STR, "description": "more series: whole series up to 250,000 points per answer (a longer one alone)"}}},
}


def spec_for(app: Flask) -> dict[str, Any]:
    cache = app.extensions["lmscope"].extra
    if "openapi" not in cache:
        cache["openapi"] = build_spec(app)
    return cache["openapi"]


@bp.get("/openapi.json")
def openapi_json():
    """The OpenAPI 3.1 document of this API."""
    return spec_for(current_app._get_current_object())


@bp.get("/docs")
def docs_page():
    """A browsable page of the endpoints and schemas (rendered from /openapi.json, no CDN)."""
    html = resources.files("lmscope.api").joinpath("static/docs.html").read_text()
    return Response(html, mimetype="text/html")
