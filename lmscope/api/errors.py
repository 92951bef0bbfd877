"""Every error is `application/problem+json` (RFC 9457): a stable `type`, a `title`, and a `detail`
that says what to change.

Views raise `Problem(...)`; Werkzeug's HTTP errors (404, 405, 413, ...) and unexpected exceptions are
turned into problems by the handlers registered in `register_error_handlers`.
"""

from __future__ import annotations

import logging
import math
import re
import time
import typing
from typing import Any

from flask import Flask, Response, json, request
from pydantic import BaseModel
from sqlalchemy.exc import OperationalError, ProgrammingError
from werkzeug.exceptions import HTTPException

from lmscope.catalog import NAME_PATTERN, NAME_RULE
from lmscope.db.engine import schema_problem
from lmscope.wording import did_you_mean

PROBLEM_BASE = "https://lmscope.dev/problems/"
PROBLEM_MEDIA_TYPE = "application/problem+json"

log = logging.getLogger("lmscope.api")

# Werkzeug's errors → our stable problem types (anything else: its status phrase, slugified).
_HTTP_TYPES = {
    400: "bad-request",
    401: "unauthorized",
    403: "forbidden",
    404: "not-found",
    405: "method-not-allowed",
    413: "payload-too-large",
    415: "unsupported-media-type",
    429: "quota-exceeded",
    500: "internal-error",
    503: "not-ready",
}


class Problem(Exception):
    """Raise from a view to answer with a problem document."""

    def __init__(self, status: int, type: str, title: str, detail: str, *,
                 errors: list[dict[str, Any]] | None = None, headers: dict[str, str] | None = None,
                 **extra: Any):
        super().__init__(f"{title}: {detail}")
        self.status = status
        self.type = type
        self.title = title
        self.detail = detail
        self.errors = errors
        self.headers = headers or {}
        self.extra = extra


def problem_response(status: int, type: str, title: str, detail: str, *,
                     errors: list[dict[str, Any]] | None = None, headers: dict[str, str] | None = None,
                     **extra: Any) -> Response:
    body: dict[str, Any] = {
        "type": PROBLEM_BASE + type,
        "title": title,
        "status": status,
        "detail": detail,
        "instance": request.path if request else None,
    }
    if errors is not None:
        body["errors"] = errors
    body.update(extra)
    response = Response(json.dumps(body), status=status, mimetype=PROBLEM_MEDIA_TYPE)
    for k, v in (headers or {}).items():
        response.headers[k] = v
    return response


# pydantic's own prefixes, which say nothing to a user ("Value error, warmup_steps must be ...").
_MSG_PREFIXES = ("Value error, ", "Assertion failed, ")


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (`Grid`, `Grid | None`, `list[Grid]`, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def model_at(model: type[BaseModel] | None, loc: tuple) -> type[BaseModel] | None:
    """The nested model a `loc` points into (("train",) in SweepParams → TrainSettings), or None."""
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):  # an index into a list of models: the same model
            continue
        field = model.model_fields.get(part)
        found = _models_in(field.annotation) if field is not None else []
        model = found[0] if found else None
    return model


def unknown_field_message(model: type[BaseModel] | None, loc: tuple) -> str:
    """'unknown field; did you mean 'max_samples'?' — or the valid names when nothing is close."""
    parent = model_at(model, loc[:-1])
    if parent is None or not loc:
        return "unknown field"
    names = sorted(parent.model_fields)
    return "unknown field" + (did_you_mean(str(loc[-1]), names) or "; the fields are: " + ", ".join(names))


def missing_field_message(model: type[BaseModel] | None, loc: tuple) -> str:
    """'required (no default): registered model name' — pydantic says 'Field required'. The description's
    first clause only: a detail joins the fields with "; "."""
    parent = model_at(model, loc[:-1]) if loc else None
    field = parent.model_fields.get(str(loc[-1])) if parent is not None else None
    what = field.description.split(";")[0].strip() if field is not None and field.description else ""
    return "required (no default)" + (f": {what}" if what else "")


# pydantic's type errors say what was wanted; these also say what was given and how to write it.
_TYPE_HINTS = {
    "int_type": "an integer, e.g. 5", "int_parsing": "an integer, e.g. 5", "int_from_float": "a whole number, e.g. 5",
    "float_type": "a number, e.g. 0.5", "float_parsing": "a number, e.g. 0.5",
    "bool_type": "true or false", "bool_parsing": "true or false",
    "string_type": "a string", "list_type": 'a list, e.g. ["a", "b"]',
    "dict_type": 'an object, {"field": value, ...}', "model_type": 'an object, {"field": value, ...}',
}


_BOUND_TYPES = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of")

_JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


def _quoted_literal(text: str, error_type: str) -> bool:
    """Whether `text` is what was wanted, only written as a string ("5" for 5, "true" for true)."""
    if error_type.startswith("bool"):
        return text.strip() in ("true", "false")
    if not _JSON_NUMBER.fullmatch(text.strip()):
        return False
    return error_type.startswith("float") or float(text).is_integer()


def _scalars(annotation) -> set[type]:
    """The scalar types (int, float, str, bool) an annotation allows outside lists (`Annotated[int, ...] | None`)."""
    if annotation in (int, float, str, bool):
        return {annotation}
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return {type(a) for a in args if a is not None}
    if origin is typing.Annotated:
        return _scalars(args[0])
    if origin in (list, tuple, set, frozenset, dict):
        return set()
    return set().union(*map(_scalars, args)) if args else set()


def _list_items(annotation) -> set[type]:
    """The scalar types of the items of the list an annotation allows (`list[LatentDim | None]` → {int})."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, set, frozenset):
        return _scalars(args[0]) if args else set()
    if origin is typing.Annotated:
        return _list_items(args[0])
    return set().union(*map(_list_items, args)) if args else set()


def list_item_types(model: type[BaseModel] | None, loc: tuple) -> set[type]:
    """What the list field at `loc` holds ({int} for a sweep grid's latent_dim); empty when unknown."""
    parent = model_at(model, loc[:-1]) if loc else None
    field = parent.model_fields.get(str(loc[-1])) if parent is not None else None
    return _list_items(field.annotation) if field is not None else set()


def written_as_list(given: Any, numbers: bool) -> str | None:
    """The JSON list `given` meant: "a,b" → ["a", "b"], "1,2" → [1, 2] (`numbers`: the items are numbers), 4 → [4];
    None when there is no such list to show (text that is already bracketed, a non-finite number), and cut
    to 40 characters as the value it came from is."""
    if isinstance(given, str) and given.lstrip().startswith("["):
        return None
    parts = [p.strip().strip("'\"") for p in given.split(",")] if isinstance(given, str) else [given]
    items = []
    for p in parts:
        if numbers and isinstance(p, str):
            if len(p) > 30 or not _JSON_NUMBER.fullmatch(p):  # no number the field could take: no hint
                return None
            p = json.loads(p)
        if isinstance(p, float) and not math.isfinite(p):
            return None
        items.append(p)
    text = json.dumps(items, ensure_ascii=False, default=str)
    return text if len(text) <= 40 else text[:37] + "…"


def type_error_message(error_type: str, given: Any, items: set[type] = frozenset()) -> str:
    """'expected an integer, e.g. 5; got the string "5" (write numbers without quotes)'. `items`: for a list,
    the types of its items (list_item_types), which pick the example."""
    shown = json.dumps(given, ensure_ascii=False, default=str)
    if len(shown) > 40:
        shown = shown[:37] + "…"
    kind = {str: "the string", bool: "the boolean", int: "the integer", float: "the number", list: "the list",
            dict: "the object", type(None): ""}.get(type(given), "")
    numbers = bool(items & {int, float}) and str not in items
    hint = "a list, e.g. [1, 2]" if error_type == "list_type" and numbers else _TYPE_HINTS[error_type]
    msg = f"expected {hint}; got {kind + ' ' if kind else ''}{shown}"
    if error_type == "list_type":
        meant = written_as_list(given, numbers) if isinstance(given, (str, int, float)) and not isinstance(given, bool) \
            else None
        if isinstance(given, str) and "," in given and meant:  # `-p models=a,b`: the list it meant
            msg += f" (write {meant})"
        elif isinstance(given, str) and not numbers and not given.lstrip().startswith("["):
            msg += " (a list of one is written [\"x\"])"
        elif meant:  # `grid.latent_dim=4`: [4]
            msg += f" (a list of one is written {meant})"
    elif isinstance(given, str) and _quoted_literal(given, error_type):
        msg += " (write numbers and true/false without quotes)"
    return msg


def pydantic_errors(exc, prefix: tuple = (), model: type[BaseModel] | None = None) -> list[dict[str, Any]]:
    """pydantic ValidationError → [{loc, msg, type}], with `prefix` (e.g. ("params",)) in front of each loc.

    `model` (the model that raised) lets an unknown field name its likely intended spelling.
    """
    out = []
    for e in exc.errors():
        msg = e["msg"]
        for noise in _MSG_PREFIXES:
            msg = msg.removeprefix(noise)
        if e["type"] == "extra_forbidden":
            msg = unknown_field_message(model, tuple(e["loc"]))
        elif e["type"] == "missing":
            msg = missing_field_message(model, tuple(e["loc"]))
        elif e["type"] == "string_pattern_mismatch" and (e.get("ctx") or {}).get("pattern") == NAME_PATTERN:
            msg = NAME_RULE  # the rule in words, not the regular expression
        elif e["type"] in _TYPE_HINTS and "input" in e:
            items = list_item_types(model, tuple(e["loc"])) if e["type"] == "list_type" else set()
            msg = type_error_message(e["type"], e["input"], items)
        elif e["type"] in _BOUND_TYPES and isinstance(e.get("input"), (int, float)):
            msg += f"; got {json.dumps(e['input'])}"  # "Input should be greater than or equal to 1; got 0"
        out.append({"loc": [*prefix, *e["loc"]], "msg": msg, "type": e["type"]})
    return out


def describe_errors(errors: list[dict[str, Any]]) -> str:
    """A one-line `detail` naming each bad field: "params.layers: Input should be ≤ 48; ..."."""
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '(body)'}: {e['msg']}" for e in errors[:5]]
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more


def fields_problem(title: str, errors: list[dict[str, Any]]) -> Problem:
    """422 validation-error whose detail joins the field errors ("fix these fields: loc: msg; …"): the CLI
    recognises that prefix and prints each field once."""
    return Problem(422, "validation-error", title, "fix these fields: " + describe_errors(errors), errors=errors)


def validation_problem(exc, prefix: tuple = (), title: str = "Invalid request",
                       model: type[BaseModel] | None = None) -> Problem:
    return fields_problem(title, pydantic_errors(exc, prefix, model))


def json_too_large(limit: int | None) -> str:
    """The 413 detail for a JSON body past its limit."""
    return (f"the request body is larger than {limit} bytes; a request here is a few kilobytes of JSON (a job's "
            "params, a registration): check what is being sent; datasets are uploaded to POST /v1/datasets")


# /v1/jobs/<segment>... whose segment is not a job id (the routes take <int:job_id>): -1, 1.5, abc
_NOT_A_JOB_ID = re.compile(r"/v1/jobs/(?![0-9]+(?:/|$))([^/]+)")


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(Problem)
    def _problem(p: Problem):
        return problem_response(p.status, p.type, p.title, p.detail, errors=p.errors, headers=p.headers, **p.extra)

    @app.errorhandler(HTTPException)
    def _http(e: HTTPException):
        status = e.code or 500
        allowed = sorted(getattr(e, "valid_methods", None) or [])
        headers = {"Allow": ", ".join(allowed)} if status == 405 and allowed else {}
        if status == 404 and (bad_id := _NOT_A_JOB_ID.match(request.path)):
            detail = (f"there is nothing at {request.path}: job ids are whole numbers from 1 ({bad_id[1]!r} is not "
                      "one); list your jobs with GET /v1/jobs or `lmscope jobs`")
        elif status == 404:
            detail = f"there is nothing at {request.path}; see /openapi.json or /docs for the endpoints"
        elif status == 405 and allowed:
            detail = f"{request.method} is not allowed on {request.path}; allowed: {', '.join(allowed)}"
        elif status == 413:
            limit = request.max_content_length
            view = app.view_functions.get(request.endpoint) if request.endpoint else None
            detail = (f"the request body is larger than {limit} bytes; send a smaller file (uploads are limited by "
                      "LMSCOPE_MAX_UPLOAD_BYTES)" if getattr(view, "takes_upload", False) else json_too_large(limit))
        else:
            detail = e.description or e.name
        slug = _HTTP_TYPES.get(status, (e.name or "error").lower().replace(" ", "-"))
        return problem_response(status, slug, e.name or "Error", detail, headers=headers)

    last_check = [float("-inf"), None]  # (when, schema_problem): one probe per few seconds, not per request

    @app.errorhandler(OperationalError)
    @app.errorhandler(ProgrammingError)
    def _database(e: Exception):
        # Not a bug of this request when the database is down, or not (yet) migrated to this lmscope's schema.
        if time.monotonic() - last_check[0] > 5.0:
            last_check[:] = [time.monotonic(), schema_problem(app.extensions["lmscope"].engine, cause=False)]
        problem = last_check[1]
        if problem is None and not getattr(e, "connection_invalidated", False):
            return _unexpected(e)  # the database answers with the right schema: a bad query, a bug
        log.warning("%s %s: the database failed: %s", request.method, request.path, str(e).splitlines()[0])
        detail = problem or "the connection to the database was lost; retry shortly"
        return problem_response(503, "database-unavailable", "Database unavailable",
                                f"{detail} (GET /readyz says when the service is ready again)",
                                headers={"Retry-After": "5"})

    @app.errorhandler(Exception)
    def _unexpected(e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return problem_response(500, "internal-error", "Internal Server Error",
                                "the server failed to handle this request; the error is in the server log. "
                                "Retry, and report it if it persists.")
