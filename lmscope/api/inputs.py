"""What a request carries, read strictly: JSON bodies, query parameters, path parts, form fields.

Lenient reading loses input without a word (an unknown query parameter ignored, `1_0` read as 10, a
repeated `name=` cut to its first value) or fails late with a 500 (NaN stored and then served as
invalid JSON, a NUL that PostgreSQL cannot store). Each is refused here, up front, by a problem that
names the place and says what to change.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any, Callable, Iterable

from flask import current_app, request
from werkzeug.datastructures import MultiDict

from lmscope import strict_json
from lmscope.api.errors import Problem, fields_problem, json_too_large
from lmscope.wording import did_you_mean

# Free text in a JSON string may hold tabs and line breaks; no other control character has a use,
# and NUL cannot be stored by PostgreSQL at all. Query parameters and path parts may hold none.
_CONTROL_IN_TEXT = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")  # a lone "\ud800" escape: not a character, cannot be stored
_DIGITS = re.compile(r"[0-9]{1,18}")  # ASCII only: int() would also take "1_0", " 5" and "٣"
_DECIMAL = re.compile(r"[0-9]{1,12}(\.[0-9]{1,12})?")
# A job's params or a registration is a few kilobytes (a sweep's grid a few more). Larger bodies are
# refused before they are parsed: a 60 MB body of list items cost the server 3 GB while it was walked.
JSON_BODY_BYTES = 1024 * 1024


def _bad_character(text: str, control: re.Pattern) -> str | None:
    """Why `text` cannot be stored ("contains the control character U+0000"), or None."""
    if m := control.search(text):
        return f"contains the control character U+{ord(m.group()):04X}; remove it"
    if m := _SURROGATE.search(text):
        return f"contains U+{ord(m.group()):04X}, half of a UTF-16 surrogate pair, which is not a character"
    return None


def _string_errors(value: Any, loc: tuple) -> list[dict[str, Any]]:
    """A field error for every string (or object key) in a parsed JSON value that cannot be stored."""
    errors = []
    if isinstance(value, str):
        if why := _bad_character(value, _CONTROL_IN_TEXT):
            errors.append({"loc": list(loc), "msg": why, "type": "invalid_character"})
    elif isinstance(value, dict):
        for key, item in value.items():
            if why := _bad_character(key, _CONTROL_IN_TEXT):
                errors.append({"loc": [*loc, key], "msg": f"the field name {why}", "type": "invalid_character"})
            errors += _string_errors(item, (*loc, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            errors += _string_errors(item, (*loc, i))
    return errors


def refuse_bad_strings(value: Any, loc: tuple = ()) -> None:
    """422 naming each string of `value` that holds a control character or a lone surrogate."""
    errors = _string_errors(value, loc)
    if errors:
        raise fields_problem("Invalid characters", errors)


def json_body(example: str) -> Any:
    """The request body as strict JSON (lmscope.strict_json): 400 invalid-json saying what is wrong, or 422
    naming a string that holds a control character. `example` shows a good body."""
    if request.content_encoding not in (None, "", "identity"):  # gzip bytes would be "not UTF-8"
        raise Problem(415, "unsupported-media-type", "Compressed body",
                      f"the body is sent with Content-Encoding: {request.content_encoding}; send the JSON uncompressed")
    # a chunked body (no Content-Length) is cut at the limit rather than refused: read one byte more to tell
    chunked_limit = request.max_content_length if request.content_length is None else None
    if chunked_limit is not None:
        request.max_content_length = chunked_limit + 1
    data = request.get_data(cache=True)
    if chunked_limit is not None and len(data) > chunked_limit:
        raise Problem(413, "payload-too-large", "Request Entity Too Large", json_too_large(chunked_limit))
    try:
        value = strict_json.loads(data)
    except strict_json.StrictJsonError as e:
        raise Problem(400, "invalid-json", "Body is not JSON",
                      f"the body is not valid JSON: {e}. Send a JSON object like {example} "
                      "with Content-Type: application/json") from None
    refuse_bad_strings(value)
    return value


# ---------------------------------------------------------------- query parameters

def query_params(*names: str, repeatable: Iterable[str] = ()) -> Callable:
    """Declare the query parameters a view reads (`repeatable`: those that may be given more than once).

    `check_request` refuses every other one on /v1/ routes: a misspelt filter would otherwise be ignored
    and answer as if it had matched everything.
    """
    def mark(view):
        view.query_params = (tuple(names), frozenset(repeatable))
        return view

    return mark


def single_values(fields: MultiDict, where: str, repeatable: Iterable[str] = ()) -> None:
    """422 when a field that takes one value is given several (`?name=a&name=b` would keep one silently)."""
    repeated = [k for k in fields if k not in repeatable and len(fields.getlist(k)) > 1]
    if repeated:
        raise Problem(422, "validation-error", f"Repeated {where} parameter",
                      f"{where} parameter {repeated[0]!r} is given {len(fields.getlist(repeated[0]))} times; "
                      "give it once",
                      errors=[{"loc": [where, k], "msg": "given more than once", "type": "repeated"} for k in repeated])


def takes_upload(view: Callable) -> Callable:
    """Mark a view that reads a file upload: its body may be up to LMSCOPE_MAX_UPLOAD_BYTES (the app's
    MAX_CONTENT_LENGTH), where every other /v1/ body is held to JSON_BODY_BYTES."""
    view.takes_upload = True
    return view


def check_request(view: Callable | None) -> None:
    """Before a /v1/ view runs: its body is at most JSON_BODY_BYTES unless it `takes_upload` (werkzeug
    answers 413 when the view reads more), its query parameters are the ones it declares (`query_params`),
    each given once unless repeatable, and no query parameter or path part holds a control character."""
    if not getattr(view, "takes_upload", False):
        upload_limit = current_app.config.get("MAX_CONTENT_LENGTH")
        request.max_content_length = min(JSON_BODY_BYTES, upload_limit) if upload_limit else JSON_BODY_BYTES
    errors = []
    for key, value in request.args.items(multi=True):
        for text, what in ((key, "the parameter name"), (value, "the value")):
            if why := _bad_character(text, _CONTROL):
                errors.append({"loc": ["query", key], "msg": f"{what} {why}", "type": "invalid_character"})
    for key, value in (request.view_args or {}).items():
        if isinstance(value, str) and (why := _bad_character(value, _CONTROL)):
            errors.append({"loc": ["path", key], "msg": why, "type": "invalid_character"})
    if errors:
        raise fields_problem("Invalid characters", errors)
    if view is None:
        return
    names, repeatable = getattr(view, "query_params", ((), frozenset()))
    unknown = [k for k in request.args if k not in names]
    if unknown:
        allowed = f"{request.path} reads: {', '.join(names)}" if names else f"{request.path} reads no query parameters"
        raise Problem(422, "validation-error", "Unknown query parameter",
                      f"unknown query parameter {unknown[0]!r}{did_you_mean(unknown[0], names)} ({allowed})",
                      errors=[{"loc": ["query", k], "msg": "unknown query parameter", "type": "extra_forbidden"}
                              for k in unknown], allowed=list(names))
    single_values(request.args, "query", repeatable)


def _invalid_query(name: str, rule: str, type_: str) -> Problem:
    return Problem(422, "validation-error", f"Invalid {name}", f"{name} must be {rule}",
                   errors=[{"loc": ["query", name], "msg": rule, "type": type_}])


def parse_id(text: str) -> int | None:
    """A whole number written in ASCII digits (at most 18), or None."""
    return int(text) if _DIGITS.fullmatch(text) else None


def query_list(name: str) -> list[str]:
    """A comma-separated query parameter's values, over its repeats where it may repeat: `queued, running,`
    is queued and running."""
    return [part.strip() for arg in request.args.getlist(name) for part in arg.split(",") if part.strip()]


def query_int(name: str, default: int | None, lo: int, hi: int) -> int | None:
    """The query parameter `name` as an integer in [lo, hi] written in ASCII digits; 422 otherwise."""
    raw = request.args.get(name)
    if raw is None:
        return default
    value = parse_id(raw)
    if value is None or not lo <= value <= hi:
        raise _invalid_query(name, f"an integer from {lo} to {hi}", "int_range")
    return value


def query_seconds(name: str, default: float, most: float) -> float:
    """The query parameter `name` as a number of seconds, more than 0 and at most `most`; 422 otherwise
    (nan, inf, 0, negatives and exponents included)."""
    raw = request.args.get(name)
    if raw is None:
        return default
    value = float(raw) if _DECIMAL.fullmatch(raw) else None
    if value is None or not 0 < value <= most:
        raise _invalid_query(name, f"a number of seconds, more than 0 and at most {most:g} (e.g. 300 or 2.5)",
                             "number_range")
    return value


# ---------------------------------------------------------------- page tokens

def encode_page_token(**position: Any) -> str:
    """An opaque token for where the next page starts (keyset: e.g. before=<id>, after=<name>)."""
    return base64.urlsafe_b64encode(json.dumps(position).encode()).decode().rstrip("=")


def decode_page_token(token: str, key: str, valid: Callable[[Any], bool], route: str) -> Any:
    """The position `key` of a token `encode_page_token` wrote for `route`; 422 for anything else."""
    try:
        value = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))[key]
        if not valid(value):
            raise ValueError(value)
        return value
    except Exception:
        raise Problem(422, "validation-error", "Invalid page_token",
                      f"page_token must be a next_page_token returned by GET {route}; start over without it",
                      errors=[{"loc": ["query", "page_token"], "msg": "not a page token", "type": "page_token"}]) from None
