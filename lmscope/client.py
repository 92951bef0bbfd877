"""The Python client of the lmscope API (only `requests` and the standard library; no torch).

    from lmscope.client import Client
    c = Client()                      # LMSCOPE_URL, LMSCOPE_TOKEN
    job = c.submit("probe", {"model": "tiny-gpt2"})
    job = c.wait(job["id"], on_progress=lambda j: print(j["progress"]))
    c.fetch(job["id"], "out/")        # plots, npz files

Every error the server answers is raised as `LmscopeError(status, problem)`; its message is the
problem's title and detail, which say what to change (then any field message the detail leaves out).
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import re
import time
import unicodedata
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator
from urllib.parse import quote

import requests

if TYPE_CHECKING:
    from lmscope.compare import Comparison

DEFAULT_URL = "http://127.0.0.1:8765"
TERMINAL_STATES = ("succeeded", "failed", "cancelled")
MAX_JOB_PAGE = 500  # GET /v1/jobs answers at most this many jobs at once (lmscope.api.jobs.MAX_LIMIT)


def default_url() -> str:
    """Without LMSCOPE_URL: the local `lmscope up`, on LMSCOPE_PORT when that is set."""
    port = os.environ.get("LMSCOPE_PORT", "").strip()
    if not port:
        return DEFAULT_URL
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise LmscopeError(0, {"title": "Invalid LMSCOPE_PORT",
                               "detail": f"LMSCOPE_PORT={port!r} is not a port (1 to 65535); write e.g. "
                                         "LMSCOPE_PORT=8765 (the default), or set LMSCOPE_URL to the API's address"})
    return f"http://127.0.0.1:{int(port)}"


def field_line(error: dict[str, Any]) -> str:
    """One field error of a problem as the client and the CLI print it: "params.model: msg"."""
    return f"{'.'.join(str(p) for p in error.get('loc', [])) or '(body)'}: {error.get('msg')}"


class LmscopeError(Exception):
    """An error answered by the API (a problem document), or status 0: the API was not reached, or the
    client refused to send the request (a value JSON cannot carry, a bad address or token).

    ``str(e)`` is "title: detail" (``e.headline``), then a line per field error the detail does not say;
    ``e.headers`` the answer's headers (``e.retry_after``: the seconds a 429 or 503 asks to wait)."""

    def __init__(self, status: int, problem: dict[str, Any], headers: Mapping[str, str] | None = None):
        self.status = status
        self.problem = problem
        self.headers = requests.structures.CaseInsensitiveDict(headers or {})
        title, detail = problem.get("title") or f"HTTP {status}", problem.get("detail")
        self.headline = f"{title}: {detail}" if detail else title
        # and each field message the detail does not already hold (an unknown kind's list of the kinds)
        unsaid = [field_line(e) for e in problem.get("errors") or [] if str(e.get("msg")) not in (detail or "")]
        super().__init__("\n  ".join([self.headline, *unsaid]))

    @property
    def type(self) -> str | None:
        return self.problem.get("type")

    @property
    def errors(self) -> list[dict[str, Any]]:
        return self.problem.get("errors") or []

    def __reduce__(self):  # pickled with its problem (a process pool hands errors back so)
        return type(self), (self.status, self.problem, dict(self.headers))

    @property
    def retry_after(self) -> int | None:
        """Retry-After in seconds (429 quota-exceeded, 503), or None: none given, or an HTTP date."""
        value = self.headers.get("Retry-After", "").strip()
        return int(value) if value.isascii() and value.isdigit() else None


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: float = 60.0,
                 session: requests.Session | None = None):
        # its paths start with /v1: a URL given with it (http://host:8765/v1) asked for /v1/v1/jobs
        self.url = re.sub(r"(/v1)?/*$", "", url or os.environ.get("LMSCOPE_URL") or default_url())
        source = "the token" if token is not None else "LMSCOPE_TOKEN"
        token = token if token is not None else os.environ.get("LMSCOPE_TOKEN")
        # A pasted token often brings a newline or spaces along; inside, they mean a broken copy.
        self.token = token.strip() if token else token
        bad = _unsendable(self.token or "")
        if bad:  # requests would raise InvalidHeader or UnicodeEncodeError on the first request
            raise LmscopeError(0, {"title": "Invalid API token",
                                   "detail": f"{source} holds a character a header cannot carry ({bad}); "
                                             "copy the token again (it looks like lms_ followed by letters, "
                                             "digits, - and _)"})
        self.timeout = timeout
        self.http = session or requests.Session()
        if self.token:
            self.http.headers["Authorization"] = f"Bearer {self.token}"

    # ------------------------------------------------------------ plumbing

    def request(self, method: str, path: str, *, stream: bool = False, **kwargs) -> requests.Response:
        kwargs.setdefault("timeout", self.timeout)
        if (body := kwargs.pop("json", None)) is not None:  # encoded here: numpy / torch numbers pass, NaN is
            if kwargs.get("data") is not None:                # named (requests raises its own errors on both)
                raise TypeError("request() takes json= or data=, not both")
            kwargs["data"] = json_body(body)
            kwargs["headers"] = {"Content-Type": "application/json", **(kwargs.get("headers") or {})}
        try:
            response = self.http.request(method, self.url + path, stream=stream, **kwargs)
        except requests.ConnectionError as e:
            raise LmscopeError(0, {"title": "Cannot reach the lmscope API",
                                   "detail": f"{self.url}: {e.__class__.__name__}. Is the server running "
                                             "(`lmscope up`, or your team's API)? Set LMSCOPE_URL to its "
                                             "address."}) from None
        except requests.Timeout:
            raise LmscopeError(0, {"title": "The lmscope API did not answer",
                                   "detail": f"{method} {path} took longer than {kwargs['timeout']} s"}) from None
        except (requests.exceptions.MissingSchema, requests.exceptions.InvalidSchema, requests.exceptions.InvalidURL):
            raise LmscopeError(0, {"title": "Invalid API address",
                                   "detail": f"{self.url!r} is not an address like http://host:port; "
                                             f"set LMSCOPE_URL to the API's address, e.g. {DEFAULT_URL}"}) from None
        if response.status_code >= 400:
            raise LmscopeError(response.status_code, _problem_of(response), response.headers)
        return response

    def _json(self, method: str, path: str, **kwargs) -> Any:
        return self.request(method, path, **kwargs).json()

    # ------------------------------------------------------------ jobs

    def submit(self, kind: str, params: dict[str, Any] | None = None, *, name: str | None = None,
               tags: list[str] | None = None, idempotency_key: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": kind, "params": params or {}}
        if name is not None:
            body["name"] = name
        if tags:
            body["tags"] = [tags] if isinstance(tags, str) else list(tags)  # "smoke" is one tag, not five
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        r = self.request("POST", "/v1/jobs", json=body, headers=headers)
        job = r.json()
        if r.headers.get("Idempotent-Replayed") == "true":
            job["replayed"] = True  # an earlier submission with this key made the job: nothing new was queued
        return job

    def get(self, job_id: int) -> dict[str, Any]:
        return self._json("GET", f"/v1/jobs/{int(job_id)}")

    def page(self, *, limit: int = 50, page_token: str | None = None, **filters) -> dict[str, Any]:
        """One page of jobs (limit: 1 to 500): {"items": [...], "next_page_token": str | None} (filters as
        in `list`)."""
        params = {k: v for k, v in filters.items() if v is not None}
        for name in ("kind", "status"):  # the API takes one "queued,running"
            if isinstance(params.get(name), Iterable) and not isinstance(params[name], str):
                params[name] = ",".join(map(str, params[name]))
        params["limit"] = limit
        if page_token:
            params["page_token"] = page_token
        return self._json("GET", "/v1/jobs", params=params)

    def list(self, *, page_size: int = 100, **filters) -> Iterator[dict[str, Any]]:
        """Every job matching the filters, newest first, across pages: kind and status (one or a list: any
        of them), tag (one or a list: all of them), parent (a sweep's id: its children; the string "none":
        top-level jobs only), user (admins). A filter left at None filters nothing."""
        token = None
        while True:  # page_size only sets how many jobs each request brings: the API's most is 500
            page = self.page(limit=min(page_size, MAX_JOB_PAGE), page_token=token, **filters)
            yield from page["items"]
            token = page.get("next_page_token")
            if not token:
                return

    def cancel(self, job_id: int) -> dict[str, Any]:
        return self._json("POST", f"/v1/jobs/{int(job_id)}/cancel")

    def delete(self, job_id: int) -> dict[str, Any]:
        """Delete an ended job with its series and files (a sweep: its grid points too); `{id, deleted,
        freed_bytes}`. Its id is never another job's; GET answers 410 `job-deleted` from then on."""
        return self._json("DELETE", f"/v1/jobs/{int(job_id)}")

    def wait(self, job_id: int, *, on_progress: Callable[[dict[str, Any]], None] | None = None,
             timeout: float | None = None, poll: float = 0.5, outage: float = 120.0,
             on_outage: Callable[[LmscopeError], None] | None = None) -> dict[str, Any]:
        """Poll until the job is terminal; `on_progress(job)` is called whenever status or progress changes
        (or, while queued, what the job waits behind: its `queue` field; for a sweep, how many of its
        children the broker has not taken yet: `children_unsent`).

        Raises TimeoutError after `timeout` seconds (the job keeps running). Once the job has been
        seen, an API that stops answering (a restart, a rollout: no answer, 502, 503, 504) is polled
        again for up to `outage` seconds (`on_outage(error)` is called when that starts) before the
        error is raised, saying that the job keeps running. A server never reached fails at once.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        last = None
        down_since = None
        while True:
            # no single request may outlast the deadline, nor (while the API is down) the outage allowance
            limits = [self.timeout] if self.timeout is not None else []
            if deadline is not None:
                limits.append(max(1.0, deadline - time.monotonic()))
            if down_since is not None:
                limits.append(max(1.0, outage - (time.monotonic() - down_since)))
            try:
                job = self._json("GET", f"/v1/jobs/{int(job_id)}", timeout=min(limits) if limits else None)
            except LmscopeError as e:
                if e.status not in (0, 502, 503, 504) or (last is None and e.status == 0):
                    raise  # an answer that is no outage, or a server never reached
                if down_since is None:
                    down_since = time.monotonic()
                    if on_outage:
                        on_outage(e)
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    state = f"still {last[0]}" if last else "not seen yet"
                    raise TimeoutError(f"job {job_id} was {state} when the API stopped answering; "
                                       f"{timeout} s have passed") from None
                if now - down_since >= outage:
                    raise LmscopeError(e.status, {**e.problem, "detail": f"{e.problem.get('detail') or e} (for "
                                                  f"{now - down_since:.0f} s); job {job_id} keeps running on the "
                                                  f"server: `lmscope wait {job_id}` once it answers"},
                                       e.headers) from None
                time.sleep(min(5.0, max(poll, 1.0)))
                continue
            down_since = None
            seen = (job["status"], job.get("progress"), job.get("cancel_requested"), job.get("queue"),
                    job.get("children_unsent"))
            if on_progress and seen != last:
                on_progress(job)
            last = seen
            if job["status"] in TERMINAL_STATES:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {job['status']} after {timeout} s")
            time.sleep(poll)

    def results(self, job_id: int, series: str | list[str] | None = None) -> dict[str, Any]:
        """{job_id, status, series: [{name, labels, x_meaning, x, y}]}; `series` picks names (`prefix*` matches a
        prefix). A job that has not finished (`status`) has none yet: they land when it ends.

        A picked name that matches nothing is listed in `missing`, the job's series names in `available`.
        A large job's series come from the server in pages of whole series: all of them are fetched.
        """
        names = [series] if isinstance(series, str) else list(series or [])
        params = [("series", n) for n in names]
        doc = self._json("GET", f"/v1/jobs/{int(job_id)}/results", params=params)
        page = doc
        while token := page.pop("next_page_token", None):  # a large job's series come in pages of whole series
            page = self._json("GET", f"/v1/jobs/{int(job_id)}/results", params=params + [("page_token", token)])
            doc["series"].extend(page["series"])
        return doc

    def compare(self, job_ids: list[int], series: str | list[str] | None = None) -> Comparison:
        """Jobs side by side (GET /v1/compare → lmscope.compare.Comparison): the parameters that differ,
        their summaries, the names of the curves all of them have, and the curves `series` picks
        (as in `results`), matched by series name and labels."""
        from lmscope.compare import Comparison

        # a list, a tuple or a generator (read once) of ints; not "12,14", not 12
        ids = list(job_ids) if isinstance(job_ids, Iterable) and not isinstance(job_ids, (str, bytes)) else None
        if ids is None or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
            raise TypeError(f"compare takes a list of job ids, e.g. compare([12, 14]), not {job_ids!r}")
        names = [series] if isinstance(series, str) else list(series or [])
        params = [("jobs", ",".join(str(int(i)) for i in ids))] + [("series", n) for n in names]
        return Comparison.from_json(self._json("GET", "/v1/compare", params=params))

    def artifacts(self, job_id: int) -> list[dict[str, Any]]:
        return self._json("GET", f"/v1/jobs/{int(job_id)}/artifacts")["items"]

    def download(self, job_id: int, name: str, dest: str | Path) -> Path:
        """Save one artifact; `dest` is a file path or a directory (one that exists, or a path ending in "/",
        made if needed). Returns the path written."""
        as_dir = str(dest).endswith(("/", os.sep))
        dest = Path(dest)
        if as_dir or dest.is_dir():
            dest = dest / Path(name).name
        response = self.request("GET", f"/v1/jobs/{int(job_id)}/artifacts/{quote(name)}", stream=True)
        try:  # only once the artifact is there: a wrong name leaves no empty folder behind
            dest.parent.mkdir(parents=True, exist_ok=True)
        except BaseException:
            response.close()
            raise
        tmp = dest.with_name(dest.name + ".part")
        try:
            with response, open(tmp, "wb") as f:
                for chunk in response.iter_content(1 << 20):
                    f.write(chunk)
            tmp.replace(dest)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)  # no half-written file left behind
            raise
        return dest

    def fetch(self, job_id: int, directory: str | Path) -> list[Path]:
        """Download every artifact of a job into `directory`, keeping sub-folders (e.g. plots/)."""
        root = Path(directory).resolve()
        written = []
        for artifact in self.artifacts(job_id):
            target = (root / artifact["name"]).resolve()
            if not target.is_relative_to(root):  # never write outside the folder the user named
                raise LmscopeError(0, {"title": "Unsafe artifact name",
                                       "detail": f"{artifact['name']!r} would be written outside {root}"})
            written.append(self.download(job_id, artifact["name"], target))
        return written

    # ------------------------------------------------------------ models and datasets

    def models(self, *, run: str | None = None, source: str | None = None) -> list[dict[str, Any]]:
        """Registered models by name, across pages; `run`: one training run's checkpoints, `source`:
        builtin, directory or checkpoint."""
        params = {k: v for k, v in (("run", run), ("source", source)) if v is not None}
        try:
            items = self._model_pages(params)
        except LmscopeError as e:
            # a server older than these filters refuses the parameters themselves; a bad value (a source
            # that does not exist) is the caller's to fix
            if not (e.status == 422 and any(err.get("loc") in (["query", "run"], ["query", "source"])
                                             and err.get("type") == "extra_forbidden" for err in e.errors)):
                raise
            items = self._model_pages({})  # a server older than these filters: every model, filtered below
        checkpoint = re.compile(re.escape(run) + r"@step\d+") if run is not None else None
        return [m for m in items if (source is None or m.get("source") == source)
                and (checkpoint is None or (m.get("source") == "checkpoint" and checkpoint.fullmatch(m["name"])))]

    def _model_pages(self, params: dict[str, str]) -> list[dict[str, Any]]:
        items, token = [], None
        while True:
            page = self._json("GET", "/v1/models", params={**params, **({"page_token": token} if token else {})})
            items += page["items"]
            token = page.get("next_page_token")
            if not token:
                return items

    def register_model(self, name: str, path: str | Path) -> dict[str, Any]:
        return self._json("POST", "/v1/models", json={"name": name, "path": str(path)})

    def delete_model(self, name: str) -> None:
        """Remove a model from the registry, freeing its name (a checkpoint of your run; admins: any
        but the built-ins). Its files stay."""
        self.request("DELETE", f"/v1/models/{quote(name, safe='')}")

    def datasets(self) -> list[dict[str, Any]]:
        return self._json("GET", "/v1/datasets")["items"]

    def delete_dataset(self, name: str) -> None:
        """Remove a dataset from the registry, freeing its name (your upload; admins: any but the
        built-in). An upload's file goes with the last name that uses it; a file added in place stays."""
        self.request("DELETE", f"/v1/datasets/{quote(name, safe='')}")

    def upload_dataset(self, name: str, path: str | Path, format: str = "text", *,
                       description: str | None = None) -> dict[str, Any]:
        """Upload a text file (format: text | lines | jsonl) as a dataset."""
        data = {"name": name, "format": format}
        if description:
            data["description"] = description
        with open(path, "rb") as f:
            return self._json("POST", "/v1/datasets", data=data, files={"file": (Path(path).name, f)})

    def kinds(self) -> list[dict[str, Any]]:
        return self._json("GET", "/v1/kinds")["items"]

    def me(self) -> dict[str, Any]:
        """Who the token belongs to: name, admin flag, active jobs and limits."""
        return self._json("GET", "/v1/me")


def json_body(value: Any) -> bytes:
    """`value` as strict JSON: numpy and torch numbers and arrays as their Python values; NaN and
    ±Infinity (which JSON has not) refused with the field that holds one, as an LmscopeError (status 0)."""

    def refuse(loc: tuple, what: str, instead: str = "numbers, strings, booleans, null, and lists and objects "
                                                         "of them") -> LmscopeError:
        where = ".".join(map(str, loc)) or "(body)"
        return LmscopeError(0, {"title": "Invalid value", "detail": f"{where} is {what}; give {instead}",
                                "errors": [{"loc": list(loc), "msg": what}]})

    def plain(v: Any, loc: tuple, inside: frozenset = frozenset()) -> Any:
        if isinstance(v, (str, bool, int, type(None))):
            return v
        if isinstance(v, float):
            if not math.isfinite(v):
                raise refuse(loc, f"{v}, which JSON cannot carry", "a finite number (or null where the field allows one)")
            return v
        if id(v) in inside:
            raise refuse(loc, "a list or object that holds itself")
        if isinstance(v, Mapping):
            return {plain(k, (*loc, k)) if not isinstance(k, str) else k: plain(item, (*loc, k), inside | {id(v)})
                    for k, item in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(item, (*loc, i), inside | {id(v)}) for i, item in enumerate(v)]
        listed = v.tolist() if callable(getattr(v, "tolist", None)) else v  # numpy / torch scalars and arrays
        if type(listed) is type(v):  # a set, a Path, numpy's longdouble (whose tolist is itself)
            raise refuse(loc, f"a {type(v).__module__}.{type(v).__qualname__}, which JSON cannot carry")
        return plain(listed, loc, inside | {id(v)})

    return json.dumps(plain(value, ()), allow_nan=False).encode()


def _unsendable(text: str) -> str | None:
    """Where `text` has a character no HTTP header can carry (a control character, or one outside
    Latin-1), e.g. "'\\n' at position 12"; None when it can be sent."""
    for i, ch in enumerate(text):
        if ord(ch) > 0xFF or unicodedata.category(ch) == "Cc":
            return f"{ch!r} at position {i}"
    return None


def _problem_of(response: requests.Response) -> dict[str, Any]:
    """The problem document of an error response, or one made up from a non-JSON body (e.g. a proxy's)."""
    try:
        body = response.json()
        if isinstance(body, dict):
            return body
    except ValueError:
        pass
    text = response.text.strip()
    return {"title": f"HTTP {response.status_code} {response.reason or ''}".strip(),
            "status": response.status_code, "detail": text[:500] or None}
