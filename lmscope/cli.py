"""The `lmscope` command.

Server side:  lmscope up | worker | db upgrade | datasets add NAME PATH
              lmscope user create NAME [--admin] | token NAME | tokens NAME | revoke NAME | limits NAME | list
Client side:  lmscope submit KIND --param k=v ... [--wait] | jobs | show | cancel | wait | results | fetch
              lmscope compare ID ID ... | whoami | kinds [KIND]
              lmscope models [list | register NAME PATH] | datasets [list | upload NAME FILE]
(`lmscope COMMAND --help` for each.)

Client commands talk to LMSCOPE_URL with LMSCOPE_TOKEN. Heavy imports (torch, the worker, the
database) happen only inside the commands that need them, so `lmscope jobs` starts in a blink.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import click

import lmscope
from lmscope import strict_json
from lmscope.catalog import DATASET_FORMATS, INT32_MAX
from lmscope.client import TERMINAL_STATES, Client, LmscopeError, field_line
from lmscope.config import ConfigError, unknown_variables
from lmscope.wording import article, byte_size, did_you_mean


# ---------------------------------------------------------------- errors

class ApiFailure(click.ClickException):
    """An API problem shown as `Error: title: detail` plus each bad field; exit status 1."""

    def __init__(self, error: LmscopeError):
        super().__init__(str(error))
        self.error = error

    def show(self, file=None):
        errors = self.error.errors
        detail = self.error.problem.get("detail") or ""
        # Where the detail only joins the field errors (a validation problem's "fix these fields: loc: msg;
        # ...", or an unknown reference's "msg; msg"), show the title and each field once, with its place.
        # Any other detail says more (e.g. the valid values) and is shown whole.
        only_fields = bool(errors) and (detail.startswith("fix these fields: ")
                                        or detail == "; ".join(str(e.get("msg")) for e in errors))
        title = self.error.problem.get("title") or f"HTTP {self.error.status}"
        click.echo(f"Error: {title}" if only_fields else f"Error: {self.error.headline}", err=True)
        for e in errors:
            if only_fields or str(e.get("msg")) not in detail:
                click.echo(f"  {field_line(e)}", err=True)
            else:  # the detail above says it already: only where
                click.echo(f"  (field {'.'.join(str(p) for p in e.get('loc', [])) or '(body)'})", err=True)


class LmscopeGroup(click.Group):
    def invoke(self, ctx):
        for line in unknown_variables():  # a misnamed setting would keep its default without a word
            click.echo(f"lmscope: {line}", err=True)
        try:
            return super().invoke(ctx)
        except LmscopeError as e:
            raise ApiFailure(e) from None
        except ConfigError as e:  # a malformed LMSCOPE_* variable: say which, not a traceback
            raise click.ClickException(str(e)) from None


def client() -> Client:
    return Client()


# ---------------------------------------------------------------- params

def parse_value(text: str) -> Any:
    """JSON when it parses (5, 0.1, true, [1,2], {"a":1}, null), else the string itself.

    NaN and Infinity are refused (a usage error): the API takes strict JSON only.
    """
    return _parse_json_or_text(text)[0]


def _parse_json_or_text(text: str) -> tuple[Any, strict_json.StrictJsonError | None]:
    """`parse_value` and, when the text is no JSON, why it did not parse."""
    try:
        return strict_json.loads(text), None
    except strict_json.NonFiniteNumber as e:
        raise click.BadParameter(f"{text!r}: {e}", param_hint="--param") from None
    except strict_json.StrictJsonError as e:
        return text, e


def field_schema(schema: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    """The JSON schema of the (dotted) params field `key` in a kind's params schema, or None."""
    node = schema
    for part in key.split("."):
        node = _deref(schema, node)
        props = (node or {}).get("properties")
        if not isinstance(props, dict) or part not in props:
            return None
        node = props[part]
    return _deref(schema, node)


def _deref(root: dict[str, Any] | None, node: Any) -> Any:
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/$defs/"):
        node = (root or {}).get("$defs", {}).get(node["$ref"].split("/")[-1])
    return node


def json_types(root: dict[str, Any] | None, node: Any) -> set[str]:
    """The JSON types a schema accepts ({"string", "null"} for `str | None`); "any" when it cannot tell."""
    node = _deref(root, node)
    if not isinstance(node, dict):
        return {"any"}
    if "anyOf" in node or "oneOf" in node:
        return set().union(*(json_types(root, n) for n in node.get("anyOf", node.get("oneOf"))))
    if "type" in node:
        return set(node["type"]) if isinstance(node["type"], list) else {node["type"]}
    values = node.get("enum", [node["const"]] if "const" in node else None)
    if values is not None:
        return {"string" if isinstance(v, str) else "null" if v is None else "any" for v in values}
    return {"any"}


def parse_param(raw: str, schema: dict[str, Any] | None, key: str) -> Any:
    """`parse_value`, except that a field the kind declares a string keeps the text: `model=123` is "123"."""
    prop = field_schema(schema, key) if schema is not None else None
    types = json_types(schema, prop) if prop is not None else {"any"}
    text_field = types - {"null"} == {"string"}
    try:
        value, not_json = _parse_json_or_text(raw)
    except click.BadParameter:
        if text_field:  # `run_name=NaN` is a name
            return raw
        raise
    if text_field and not isinstance(value, str) and not (value is None and "null" in types):
        return raw
    # only where the kind's schema says the field is no text (without one, "[INST] hi" may be a prompt)
    if not_json is not None and prop is not None and not text_field and raw.strip()[:1] in ("[", "{"):
        items = list_item_types(schema, prop) - {"null"}
        strings = items == {"string"}
        quoted = quoted_list(raw, strings) if items & {"string", "any"} else None  # bare words: no numbers
        if quoted is not None:  # `[a,b]`: the shell's way of writing a list, not JSON's
            raise click.BadParameter(f"{key}={raw} is not JSON: strings in a list need double quotes: {quoted}",
                                     param_hint="--param")
        # `[1,2` meant a list: say where it stops parsing, not that a string is no list
        example = '["a", "b"]' if strings else "[1, 2]"
        raise click.BadParameter(f"{key}={raw} starts like JSON but does not parse: {not_json} "
                                 f"(a list is written {example}, an object {{\"a\": 1}})", param_hint="--param")
    return value


def list_item_types(root: dict[str, Any] | None, node: Any) -> set[str]:
    """The JSON types of the items of the list a field takes (`list[int] | None` → {"integer"}); {"any"} when
    the schema does not say."""
    node = _deref(root, node)
    if not isinstance(node, dict):
        return {"any"}
    if "anyOf" in node or "oneOf" in node:
        arrays = [n for n in node.get("anyOf", node.get("oneOf")) if "array" in json_types(root, n)]
        return set().union(*(list_item_types(root, n) for n in arrays)) if arrays else {"any"}
    return json_types(root, node["items"]) if "items" in node else {"any"}


def quoted_list(raw: str, strings: bool) -> str | None:
    """`[a, 'b', 3]` as the JSON list it means (["a", "b", 3]; every item a string when `strings`), or None
    when the text is no flat list with a bare word in it."""
    text = raw.strip()
    if not (text.startswith("[") and text.endswith("]")) or any(c in text[1:-1] for c in '[]{}"'):
        return None
    parts = [p.strip() for p in text[1:-1].split(",")]
    if not all(parts):
        return None
    items, bare = [], False
    for part in parts:
        try:
            item = strict_json.loads(part)
        except strict_json.StrictJsonError:
            item, bare = part.strip("'"), True
        items.append(part if strings and not isinstance(item, str) else item)
    return json.dumps(items, ensure_ascii=False) if bare else None


def set_dotted(target: dict[str, Any], key: str, value: Any) -> None:
    """`train.epochs` = 5 → target["train"]["epochs"] = 5."""
    parts = key.split(".")
    if not all(parts):
        raise click.BadParameter(f"{key!r} has an empty part; write keys like train.epochs", param_hint="--param")
    node = target
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise click.BadParameter(f"{key!r}: {part!r} is already set to a value, not an object", param_hint="--param")
        node = child
    node[parts[-1]] = value


def params_file_bytes(value: str) -> bytes:
    """--params: a JSON file, or `example:NAME` for a bundled one (works from any directory)."""
    from lmscope import examples

    if value.startswith("example:"):
        name = value[len("example:"):].removesuffix(".json")
        try:
            return examples.read_bytes(name)
        except KeyError:
            raise click.BadParameter(f"no bundled example {name!r}; they are {', '.join(examples.names())}",
                                     param_hint="--params") from None
    path = Path(value)
    if not path.exists():
        stem = path.name.removesuffix(".json")
        hint = (f"; the bundled example is --params example:{stem} (the path {value} works only from a checkout's "
                "root)" if stem in examples.names() else "")
        raise click.BadParameter(f"file {value!r} does not exist" + hint, param_hint="--params")
    if path.is_dir():
        raise click.BadParameter(f"{value!r} is a directory, not a JSON file", param_hint="--params")
    return path.read_bytes()  # also /dev/null or a pipe (<(...)): not regular files, but readable


# The fields of a POST /v1/jobs body: a --params file with "kind" and "params" among only these is a whole request.
REQUEST_FIELDS = {"kind", "params", "name", "tags", "idempotency_key"}


def params_of_job(c: Client, ref: str, kind: str | None) -> dict[str, Any]:
    """--params job:ID: the params job ID ran with, as its row keeps them (defaults filled in), to run it
    again, changed by any --param. Only the params: not its name or tags."""
    number = ref[len("job:"):].strip()
    if not (number.isascii() and number.isdigit()):
        raise click.BadParameter(f"{ref!r}: job:ID takes a job's number, e.g. job:42", param_hint="--params")
    job = c.get(int(number))
    if job.get("parent_id"):
        raise click.BadParameter(f"job {job['id']} is a grid point of sweep {job['parent_id']}, which runs again as a "
                                 f"whole: `lmscope submit sweep --params job:{job['parent_id']}`", param_hint="--params")
    if kind is not None and job["kind"] != kind:
        raise click.BadParameter(f"job {job['id']} is {article(job['kind'])} {job['kind']} job, not {kind}: run it again with "
                                 f"`lmscope submit {job['kind']} --params job:{job['id']}`", param_hint="--params")
    return job.get("params") or {}


def params_of_file(params_file: str, kind: str | None, c: Client | None = None) -> dict[str, Any]:
    """The params object a --params file holds. A whole request body ({"kind": ..., "params": {...}}) of the
    same `kind`, and nothing else, gives its "params"; any other request body is refused, saying why.
    `job:ID` (with a client `c`) gives that job's params."""
    if params_file.startswith("job:") and c is not None:
        return params_of_job(c, params_file, kind)
    try:
        data = params_file_bytes(params_file)
        if not data.strip():
            raise click.BadParameter(f"{params_file} is empty; it must hold a JSON object of parameters, "
                                     'e.g. {"model": "tiny-gpt2"}', param_hint="--params")
        loaded = strict_json.loads(data)
    except (OSError, ValueError) as e:
        raise click.BadParameter(f"cannot read {params_file}: {e}", param_hint="--params") from None
    if not isinstance(loaded, dict):
        what = {list: "a list", str: "a string", bool: "true or false", type(None): "null"}.get(type(loaded), "a number")
        raise click.BadParameter(f"{params_file} holds {what}, not a JSON object of parameters", param_hint="--params")
    if "kind" in loaded and isinstance(loaded.get("params"), dict) and set(loaded) <= REQUEST_FIELDS:
        if loaded["kind"] != kind:
            raise click.BadParameter(f"{params_file} is a whole request for kind {loaded['kind']!r}; --params "
                                     "takes only a params object (its \"params\")", param_hint="--params")
        others = sorted(set(loaded) - {"kind", "params"})
        if others:  # dropped unseen they would be lost: the command line has its own options for them
            raise click.BadParameter(f"{params_file} is a whole request with {', '.join(others)}; --params takes "
                                     "only its \"params\" object (give --name, --tag, --idempotency-key instead)",
                                     param_hint="--params")
        return loaded["params"]
    return loaded


def build_params(pairs: tuple[str, ...], params_file: str | None,
                 schema: dict[str, Any] | None = None, kind: str | None = None,
                 c: Client | None = None) -> dict[str, Any]:
    """--params FILE first, then each --param key=value on top (dotted keys make nested objects).

    `schema` (the kind's params JSON schema) keeps values of string fields as text; `kind` lets a file that
    holds a whole request of that kind stand for its params (`params_of_file`); `c` reads `job:ID`'s.
    """
    params: dict[str, Any] = {}
    if params_file:
        params = params_of_file(params_file, kind, c)
    given: dict[str, str] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not key=value (e.g. --param model=tiny-gpt2)", param_hint="--param")
        # A later -p must not overwrite an earlier one unseen, wholly (the same key), in part (`-p train={…}
        # -p train.epochs=5`) or by dropping it (`-p model.x=1 -p model=m`). Replacing or editing what came
        # from --params is fine: the file is the base.
        if key in given:
            raise click.BadParameter(f"{key!r} is given twice ({given[key]!r} and {pair!r}); give it once",
                                     param_hint="--param")
        overlap = next((g for g in given if g.startswith(key + ".") or key.startswith(g + ".")), None)
        if overlap:
            outer, inner = sorted((key, overlap), key=len)
            raise click.BadParameter(f"{outer!r} is given a value and also {inner!r}; give {outer}=VALUE or "
                                     f"{inner}=VALUE, not both", param_hint="--param")
        set_dotted(params, key, parse_param(raw, schema, key))
        given[key] = pair
    return params


# ---------------------------------------------------------------- progress

def unsent_children_text(n: int) -> str:
    """A sweep submitted while the broker was down: the sweep runs, its children wait for the broker."""
    return f"{'1 child' if n == 1 else f'{n} children'} not handed to the broker yet"


UNSENT_CHILDREN_ADVICE = "the reaper sends them when the broker answers (GET /readyz says whether it does)"


NEXT_IN_LINE = "next: a worker takes it in a moment"


def next_in_line(queue: dict[str, Any]) -> bool:
    """Nothing ahead of a queued job, nothing running, and it is with the broker: it is next ("0 ahead,
    0 running" read as a contradiction)."""
    return not (queue["ahead"] or queue["running"] or queue.get("unsent"))


class ProgressLine:
    """One line on stderr: `job 12 running [#####.....] 45% 450/1000 stage`, redrawn on a terminal.

    Off a terminal (a log file, CI) each update is a new line, so only a change of status (or a cancel
    request, a stopped worker or none, a job or children handed to the broker) or, while it stays, one
    every ``LOG_EVERY`` seconds: a train job's ETA changes at every poll.
    """

    WIDTH = 30
    LOG_EVERY = 30.0

    def __init__(self, job_id: int, stream=None, clock=time.monotonic):
        self.job_id = job_id
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.clock = clock
        self.last_text = None
        self.last_status, self.last_logged = None, 0.0

    def render(self, job: dict[str, Any], *, head: bool = True) -> str:
        p = job.get("progress") or {}
        fraction = p.get("fraction")
        text = f"job {self.job_id} {job['status']}" if head else ""
        if job.get("cancel_requested") and job["status"] == "running":
            text += " (cancelling)"
        queue = job.get("queue")
        if queue and job["status"] == "queued" and head:  # `show` prints it on its own line
            text += (f" (no worker takes jobs: {queue['worker_stopped']})" if queue.get("worker_stopped")
                     else f" (no worker takes jobs from the queue: {NO_WORKER_ADVICE})" if queue.get("workers") == 0
                     else f" ({NEXT_IN_LINE})" if next_in_line(queue)
                     else f" ({queue['ahead']} ahead, {queue['running']} running"
                          + ("; not handed to the broker yet: it is sent when the broker answers)" if queue.get("unsent")
                             else ")"))
        if job["status"] == "queued" and job.get("attempts") and fraction is not None:  # re-queued: the last attempt's
            done = f" ({p.get('done') or 0}/{p['total']})" if p.get("total") is not None else ""
            return "; ".join(filter(None, [text, f"its last attempt got to {fraction * 100:.1f}%{done}"]))
        if fraction is not None:
            filled = int(round(fraction * self.WIDTH))
            text += f" [{'#' * filled}{'.' * (self.WIDTH - filled)}] {fraction * 100:5.1f}%"
        if p.get("total") is not None:
            text += f" {p.get('done') or 0}/{p['total']}"
        if p.get("stage") and job["status"] not in TERMINAL_STATES:  # a finished job's stage (and ETA) is stale
            text += f" {p['stage']}"
        if job.get("children_unsent") and head:
            text += f"; {unsent_children_text(job['children_unsent'])}"
        return text.strip()

    def __call__(self, job: dict[str, Any]) -> None:
        text = self.render(job)
        if text == self.last_text:
            return
        if self.tty:
            pad = max(0, len(self.last_text or "") - len(text))
            self.stream.write("\r" + text + " " * pad)
        else:
            now = self.clock()
            queue = job.get("queue") or {}
            state = (job["status"], bool(job.get("cancel_requested")), bool(queue.get("worker_stopped")),
                     queue.get("workers") == 0, bool(queue.get("unsent") or job.get("children_unsent")))
            if state == self.last_status and now - self.last_logged < self.LOG_EVERY:
                return
            self.stream.write(text + "\n")
            self.last_status, self.last_logged = state, now
        self.stream.flush()
        self.last_text = text

    def close(self):
        if self.tty and self.last_text:
            self.stream.write("\n")
            self.stream.flush()
            self.last_text = None  # a later update starts a fresh line


# what `queue.workers == 0` means to whoever submitted: the job waits until a worker starts
NO_WORKER_ADVICE = "it waits until one starts (`lmscope worker`, docs/operations.md)"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def summary_value(value: Any) -> str:
    """A summary value as JSON (null, true), floats to 6 significant digits (in lists and objects too),
    strings bare."""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:.6g}"
    return json.dumps(_six_digits(value), ensure_ascii=False)


def _six_digits(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.6g}")
    if isinstance(value, list):
        return [_six_digits(v) for v in value]
    if isinstance(value, dict):
        return {k: _six_digits(v) for k, v in value.items()}
    return value


def report_final(c: Client, job: dict[str, Any]) -> None:
    """Status, summary, error and where the plots are."""
    click.echo(f"job {job['id']} ({job['kind']}) {job['status']}")
    if job.get("error"):
        click.echo(f"error: {job['error'].get('type')}: {job['error'].get('message')}")
    if job.get("children"):
        counts = job["children"]
        click.echo("children: " + ", ".join(f"{counts[s]} {s}" for s in ("succeeded", "failed", "cancelled") if counts.get(s)))
    for key, value in (job.get("summary") or {}).items():
        if key == "children" and job.get("children"):  # a sweep's counts, said on the line above
            continue
        click.echo(f"  {key}: {summary_value(value)}")
    echo_artifacts(c, job)


def echo_artifacts(c: Client, job: dict[str, Any]) -> None:
    """How many files an ended job kept, how to fetch them, and where its plots are."""
    if job["status"] not in TERMINAL_STATES:  # a failed or cancelled job keeps the files it wrote too
        return
    artifacts = c.artifacts(job["id"])
    plots = [a for a in artifacts if a["media_type"] == "image/png"]
    if artifacts:
        size = byte_size(sum(a.get("size") or 0 for a in artifacts))
        click.echo(f"{plural(len(artifacts), 'artifact')} ({plural(len(plots), 'plot')}, {size}): "
                   f"lmscope fetch {job['id']} DIR")
        if c.token and plots:  # a browser sends no token: the plots' URLs would answer 401
            click.echo(f"  plots: {', '.join(a['name'] for a in plots)} (also on {c.url}/#job={job['id']}, "
                       "with your token in the page's token field)")
        elif plots:
            for a in plots:
                click.echo(f"  {c.url}{a['url']}")


def left_as(status: str | None) -> str:
    """What a job that is no longer watched goes on doing: a queued one does not run yet."""
    return {"queued": "stays queued", "running": "keeps running"}.get(status or "", "is left as it is")


def wait_and_report(c: Client, job_id: int, timeout: float | None) -> None:
    line = ProgressLine(job_id)
    seen: dict[str, Any] = {}

    def progress(job: dict[str, Any]) -> None:
        seen["status"] = job["status"]
        line(job)

    def outage(e: LmscopeError) -> None:
        line.close()
        click.echo(f"the API stopped answering ({e}); still waiting for job {job_id}…", err=True)

    try:
        job = c.wait(job_id, on_progress=progress, timeout=timeout, on_outage=outage)
    except LmscopeError:
        line.close()
        raise
    except TimeoutError as e:
        line.close()
        raise click.ClickException(f"{e}; it {left_as(seen.get('status'))}: `lmscope wait {job_id}` or "
                                   f"`lmscope show {job_id}`")
    except KeyboardInterrupt:
        line.close()
        stop = "drop" if seen.get("status") == "queued" else "stop"
        click.echo(f"\nstopped watching; job {job_id} {left_as(seen.get('status'))} (`lmscope cancel {job_id}` "
                   f"to {stop} it)", err=True)
        raise SystemExit(130)
    line.close()
    report_final(c, job)
    if job["status"] != "succeeded":
        raise SystemExit(1)


# ---------------------------------------------------------------- the group

@click.group(cls=LmscopeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=lmscope.__version__, message="lmscope %(version)s")
def main():
    """lmscope: measure how transformer language models work."""


# ---------------------------------------------------------------- server side

PORTS = click.IntRange(0, 65535)  # 0: the system picks a free port, which the ready line shows


@main.command()
@click.option("--host", default=None, help="address to bind (default LMSCOPE_HOST or 127.0.0.1)")
@click.option("--port", type=PORTS, default=None, help="port (default LMSCOPE_PORT or 8765; 0 picks a free one)")
def up(host, port):
    """Run the embedded service: API + worker in one process, SQLite, no other server."""
    from lmscope.config import Settings
    from lmscope.up import serve

    overrides = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    settings = Settings.from_env(**overrides)
    # --port is checked by click; LMSCOPE_PORT only as a whole number (config._int). Out of range, the
    # socket layer either raised OverflowError or quietly bound another port (70000 → 4464).
    if port is None and settings.port not in range(PORTS.min, PORTS.max + 1):
        raise click.ClickException(f"LMSCOPE_PORT={settings.port} is not a port (0 to 65535); write e.g. "
                                   "LMSCOPE_PORT=8765 (the default); `lmscope up --port 0` picks a free one")
    serve(settings)


@main.command()
@click.option("--concurrency", "-c", type=int, default=1, show_default=True, help="job processes (keep 1 per GPU)")
@click.option("--loglevel", default="info", show_default=True)
@click.option("--name", help="node name, e.g. gpu0: the worker is gpu0@HOST (tells two workers of one host apart)")
def worker(concurrency, loglevel, name):
    """Run a Celery worker (team deployment; one per GPU, CUDA_VISIBLE_DEVICES picks it)."""
    from lmscope.worker.celery_app import run_worker

    run_worker(concurrency=concurrency, loglevel=loglevel, name=name)


@main.group()
def db():
    """Database schema."""


@db.command("upgrade")
def db_upgrade():
    """Create or migrate the schema to the latest version."""
    from sqlalchemy.engine import make_url

    from lmscope.config import Settings
    from lmscope.db.engine import SchemaUnavailable, upgrade

    settings = Settings.from_env()
    try:
        before, after = upgrade(settings.database_url)
    except SchemaUnavailable as e:  # one line, the password hidden (as the `user` commands say it)
        raise click.ClickException(f"{make_url(settings.database_url).render_as_string(hide_password=True)}: {e}")
    if before == after:
        click.echo(f"database is up to date (revision {after})")
    else:
        click.echo(f"database {'created' if before is None else f'migrated from revision {before}'}: "
                   f"now at revision {after}")


def _sessions():
    """Sessions on the service's database, for the server-side commands (`user`, `datasets add`).

    Refuses, in one line, a database that does not exist, does not answer, has no lmscope tables or is
    at another schema revision (`schema_problem`, as the API and workers say it): the usual cause is
    a shell without the service's LMSCOPE_DATA_DIR / LMSCOPE_DATABASE_URL (and connecting to a SQLite
    path that does not exist would leave an empty file behind)."""
    from sqlalchemy.engine import make_url

    from lmscope.config import Settings
    from lmscope.db.engine import make_engine, make_sessionmaker, schema_problem

    url = make_url(Settings.from_env().database_url)
    shown = url.render_as_string(hide_password=True)
    which = ("LMSCOPE_DATA_DIR or LMSCOPE_DATABASE_URL must be the service's (as `lmscope up` or the workers "
             "have it)")
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:") \
            and not Path(url.database).exists():
        raise click.ClickException(f"no database at {shown}; {which}, or create one with `lmscope db upgrade`")
    engine = make_engine(url.render_as_string(hide_password=False))
    if problem := schema_problem(engine):
        engine.dispose()
        raise click.ClickException(f"{shown}: {problem}" + ("" if "revision" in problem else f" ({which})"))
    return make_sessionmaker(engine)


@main.group()
def user():
    """Users and tokens (run on the server: talks to the database directly)."""


class _Limit(click.ParamType):
    """A per-user limit: a positive integer, or `default` for the server's (LMSCOPE_...) value."""

    name = "N|default"

    MAX = INT32_MAX  # the column is a 32-bit integer in PostgreSQL

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value is None:
            return value
        text = value.strip()
        if text.lower() == "default":
            return "default"
        if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= self.MAX:
            self.fail(f"{value!r} is not a positive integer (at most {self.MAX}) or 'default'", param, ctx)
        return int(text)


_LIMIT_OPTIONS = (
    ("max_active_jobs", "--max-active-jobs", "queued + running top-level jobs (default LMSCOPE_MAX_ACTIVE_JOBS)"),
    ("max_sweep_points", "--max-sweep-points", "grid points per sweep (default LMSCOPE_MAX_SWEEP_POINTS)"),
)


def _limit_options(f):
    for dest, flag, help_ in reversed(_LIMIT_OPTIONS):
        f = click.option(flag, dest, type=_Limit(), default=None, help=help_)(f)
    return f


def _limits_text(u) -> str:
    from lmscope.config import Settings

    settings = Settings.from_env()
    parts = []
    for dest, _, _ in _LIMIT_OPTIONS:
        own = getattr(u, dest)
        parts.append(f"{dest}={own}" if own is not None else f"{dest}={getattr(settings, dest)} (server default)")
    return ", ".join(parts)


@user.command("create")
@click.argument("name")
@click.option("--admin", is_flag=True, help="may register models and see every job")
@_limit_options
def user_create(name, admin, max_active_jobs, max_sweep_points):
    """Make a user and print its first token (shown once)."""
    from lmscope.api.auth import create_user

    limits = {k: (None if v == "default" else v) for k, v in
              (("max_active_jobs", max_active_jobs), ("max_sweep_points", max_sweep_points))}
    with _sessions().begin() as session:
        try:
            _, token = create_user(session, name, admin=admin, **limits)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    click.echo(f"created {'admin' if admin else 'user'} {name}; token (shown once, keep it secret):", err=True)
    click.echo(token)


@user.command("limits")
@click.argument("name")
@_limit_options
def user_limits(name, max_active_jobs, max_sweep_points):
    """Show a user's limits, or set them (`default` goes back to the server's value)."""
    with _sessions().begin() as session:
        u = _user_named(session, name)
        for dest, value in (("max_active_jobs", max_active_jobs), ("max_sweep_points", max_sweep_points)):
            if value is not None:
                setattr(u, dest, None if value == "default" else value)
        click.echo(f"{u.name}: {_limits_text(u)}")


@user.command("token")
@click.argument("name")
def user_token(name):
    """Make another token for a user (shown once)."""
    from lmscope.api.auth import issue_token

    with _sessions().begin() as session:
        click.echo(issue_token(session, _user_named(session, name)))


def _user_named(session, name: str):
    from sqlalchemy import select

    from lmscope.db.models import User

    u = session.scalar(select(User).where(User.name == name))
    if u is None:
        raise click.ClickException(f"no user {name!r}; `lmscope user list` shows who exists, "
                                   f"`lmscope user create {name}` makes one")
    return u


@user.command("tokens")
@click.argument("name")
def user_tokens(name):
    """A user's tokens: prefix, made, last used (the tokens themselves are not stored)."""
    from sqlalchemy import select

    from lmscope.db.models import ApiToken

    with _sessions()() as session:
        u = _user_named(session, name)
        rows = session.scalars(select(ApiToken).where(ApiToken.user_id == u.id).order_by(ApiToken.id)).all()
        if not rows:
            click.echo(f"{name} has no tokens; make one with `lmscope user token {name}`", err=True)
        for t in rows:
            used = t.last_used_at.strftime("%Y-%m-%d %H:%M") if t.last_used_at else "never"
            click.echo(f"{t.prefix}…  made {t.created_at:%Y-%m-%d %H:%M}  last used {used}")


@user.command("revoke")
@click.argument("name")
@click.option("--token", "prefix", metavar="PREFIX", help="the token to revoke: its first 12 characters, as "
              "`lmscope user tokens NAME` shows them (or the whole token)")
@click.option("--all", "revoke_all", is_flag=True, help="revoke every token of the user")
def user_revoke(name, prefix, revoke_all):
    """Revoke a user's token (or all of them): requests with it are refused from then on (401)."""
    from sqlalchemy import delete, select

    from lmscope.api.auth import SHOWN_PREFIX_CHARS, hash_token
    from lmscope.db.models import ApiToken

    if bool(prefix) == revoke_all:
        raise click.UsageError("give exactly one of --token PREFIX or --all")
    with _sessions().begin() as session:
        u = _user_named(session, name)
        tokens = session.scalars(select(ApiToken).where(ApiToken.user_id == u.id)).all()
        if prefix:
            prefix = prefix.rstrip("…")
            whole = hash_token(prefix)  # a whole token pasted in is matched exactly
            tokens = [t for t in tokens if t.token_hash == whole
                      or (len(prefix) == SHOWN_PREFIX_CHARS and t.prefix == prefix)]
            if not tokens and len(prefix) != SHOWN_PREFIX_CHARS:
                # 'lms_' starts every token: a shorter prefix that happened to match one token revoked it
                raise click.UsageError(f"--token takes a token's first {SHOWN_PREFIX_CHARS} characters, as "
                                       f"`lmscope user tokens {name}` shows them, or the whole token; "
                                       f"{prefix!r} is {len(prefix)} characters and no whole token of {name}'s")
            if not tokens:
                raise click.ClickException(f"{name} has no token starting {prefix!r}; "
                                           f"`lmscope user tokens {name}` lists them")
            if len(tokens) > 1:
                raise click.ClickException(f"{len(tokens)} of {name}'s tokens start {prefix!r}; give more characters")
        session.execute(delete(ApiToken).where(ApiToken.id.in_([t.id for t in tokens])))
        click.echo(f"revoked {len(tokens)} token(s) of {name}", err=True)


@user.command("list")
def user_list():
    """List users."""
    from sqlalchemy import select

    from lmscope.db.models import User

    with _sessions()() as session:
        users = list(session.scalars(select(User).order_by(User.name)))
        labels = [u.name + ("  (admin)" if u.is_admin else "") for u in users]
        width = max(map(len, labels), default=0)
        for u, label in zip(users, labels):
            click.echo(f"{label:{width}}  {_limits_text(u)}")


# ---------------------------------------------------------------- jobs

def _timeout(ctx, param, value: float | None) -> float | None:
    """Seconds to watch: 0 or more (a negative one used to end at once with "still running after -5.0 s")."""
    if value is not None and not value >= 0:  # `not >=` refuses nan too, which would never time out
        raise click.BadParameter(f"{value} is not a number of seconds 0 or more; write e.g. --timeout 600")
    return value


def _idempotency_key(ctx, param, value: str | None) -> str | None:
    """The key as the API takes it (1 to 200 printable characters), refused here rather than sent wrong.

    An empty key used to send no key at all (no protection against a double submit), and one that a
    header cannot carry (a newline, €) a traceback. Surrounding spaces are dropped, as HTTP would.
    """
    if value is None:
        return None
    key = value.strip()
    if not key:
        raise click.BadParameter("the key is empty; give one (e.g. a run name) or leave the option out")
    if len(key) > 200 or not key.isprintable() or max(map(ord, key)) > 0xFF:
        raise click.BadParameter(f"{key[:40]!r}{'…' if len(key) > 40 else ''} is not 1 to 200 printable "
                                 "Latin-1 characters; use letters, digits and -_.: (e.g. run-2024-06-01)")
    return key


@main.command()
@click.argument("kind")
@click.option("--param", "-p", "pairs", multiple=True, metavar="KEY=VALUE",
              help="a parameter; VALUE is JSON if it parses, else a string (a string field always keeps the "
                   "text: model=123); dotted keys nest (train.epochs=5)")
@click.option("--params", "params_file", metavar="SOURCE",
              help="a JSON file of parameters; example:NAME, a bundled example (example:fig2; see "
                   "lmscope/examples/); or job:ID, the params an earlier job of KIND ran with, to run it again. "
                   "Each --param changes them")
@click.option("--name", help="a label for the job")
@click.option("--tag", "tags", multiple=True, help="a tag (repeatable)")
@click.option("--idempotency-key", callback=_idempotency_key,
              help="resubmitting with the same key returns the first job")
@click.option("--wait", "wait_", is_flag=True, help="show progress until the job finishes")
@click.option("--timeout", type=float, default=None, callback=_timeout,
              help="with --wait: stop watching after this many seconds")
def submit(kind, pairs, params_file, name, tags, idempotency_key, wait_, timeout):
    """Submit a job of KIND (see `lmscope kinds`)."""
    if timeout is not None and not wait_:  # refused before anything is submitted
        raise click.UsageError("--timeout limits --wait: add --wait, or leave --timeout out and "
                               "watch later with `lmscope wait JOB --timeout SECONDS`")
    c = client()
    schema = kind_schema(c, kind) if pairs else None
    job = c.submit(kind, build_params(pairs, params_file, schema, kind, c), name=name, tags=list(tags),
                   idempotency_key=idempotency_key)
    children = f" with {job['children']['total']} children" if job.get("children") else ""
    if job.get("replayed"):
        click.echo(f"already submitted with this idempotency key: job {job['id']} ({job['kind']}, {job['status']})",
                   err=True)
    else:
        unsent = ("; the broker has not taken it yet (it did not answer): the reaper hands it over when it does "
                  "(GET /readyz says whether it answers)" if (job.get("queue") or {}).get("unsent")
                  else f"; {unsent_children_text(job['children_unsent'])} (the broker did not answer): "
                       f"{UNSENT_CHILDREN_ADVICE}"
                  if job.get("children_unsent") else "")
        click.echo(f"submitted job {job['id']} ({job['kind']}){children}{unsent}", err=True)
    if not wait_:
        click.echo(job["id"])
        return
    wait_and_report(c, job["id"], timeout)


def kind_schema(c: Client, kind: str) -> dict[str, Any] | None:
    """The params schema of `kind` (GET /v1/kinds), or None: then the server's answer says what is wrong."""
    try:
        return next((k["params_schema"] for k in c.kinds() if k["name"] == kind), None)
    except LmscopeError:
        return None


@main.command()
@click.argument("job_id", type=int)
@click.option("--timeout", type=float, default=None, callback=_timeout, help="stop watching after this many seconds")
def wait(job_id, timeout):
    """Show a job's progress until it finishes."""
    wait_and_report(client(), job_id, timeout)


def _fmt_progress(job: dict[str, Any]) -> str:
    p = job.get("progress") or {}
    return f"{p['fraction'] * 100:.0f}%" if p.get("fraction") is not None else ""


def _child_kinds(c: Client) -> set[str]:
    """Kinds made only by a parent (a sweep's grid points): listing them means listing children."""
    return {k["name"] for k in c.kinds() if not k.get("submittable", True)}


def print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in [header, *rows]:
        click.echo("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())


SUBJECT_WIDTH = 48  # characters of the jobs list's ON column


def job_subject(job: dict[str, Any]) -> str:
    """What a job looked at, from its params, as the dashboard's list says it: its model (several: first … last),
    train job or sweep study, and its dataset (a sumformer study or grid point: its target)."""
    p, kind, parts = job.get("params") or {}, job.get("kind"), []
    if kind == "sweep":
        parts.append(f"{p.get('study') or 'sumformer'} study")
    if p.get("architecture") and p.get("target"):  # a sumformer grid point
        parts.append(p["architecture"])
    if p.get("method"):  # an attention grid point
        parts.append(p["method"])
    models = p.get("models") if isinstance(p.get("models"), list) else []
    if p.get("model"):
        parts.append(p["model"])
    elif models:
        parts.append(", ".join(map(str, models)) if len(models) <= 2 else
                     f"{models[0]} … {models[-1]} ({len(models)} models)")
    elif p.get("train_job") is not None:
        parts.append(f"train job {p['train_job']}")
    if p.get("dataset"):
        parts.append(p["dataset"])
    elif p.get("target") and (kind == "sweep" or p.get("architecture")):
        target = p["target"]
        parts.append(", ".join(map(str, target)) if isinstance(target, list) else target)
    return " · ".join(map(str, parts))


@main.command()
@click.option("--kind", help="e.g. norms or norms,entropy")
@click.option("--status", help="e.g. running or queued,running")
@click.option("--tag", "tags", multiple=True, help="jobs with this tag (repeatable: with every one)")
@click.option("--parent", help="a sweep's id: its children")
@click.option("--children", "with_children", is_flag=True, help="also list sweeps' children (hidden by default)")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="at most this many jobs")
@click.option("--all", "all_", is_flag=True, help="every job, however many")
@click.option("--user", help="admins: only this user's jobs")
@click.option("--json", "as_json", is_flag=True)
def jobs(kind, status, tags, parent, with_children, limit, all_, user, as_json):
    """List your jobs (an admin: everyone's), newest first (a sweep's children only with --children,
    --parent ID or a child --kind)."""
    c = client()
    if parent is None and not with_children and (kind is None or not {k.strip() for k in kind.split(",")} & _child_kinds(c)):
        parent = "none"  # one row per sweep, not one per grid point
    filters = {"kind": kind, "status": status, "tag": list(tags) or None, "parent": parent, "user": user}
    if all_:
        items, more = list(c.list(page_size=500, **filters)), False
    else:  # one job past the limit tells whether the list was cut off
        items = list(itertools.islice(c.list(page_size=min(limit + 1, 500), **filters), limit + 1))
        items, more = items[:limit], len(items) > limit
    if as_json:
        click.echo(json.dumps(items, indent=2))
    else:
        users = {j.get("user") for j in items}
        extra = [("PARENT", lambda j: j.get("parent_id") or "")] if parent != "none" else []
        extra += [("USER", lambda j: j.get("user") or "")] if len(users) > 1 else []  # an admin sees everyone's
        from lmscope.compare import clip

        print_table([[j["id"], j["kind"], j["status"], _fmt_progress(j), clip(job_subject(j), SUBJECT_WIDTH),
                      (j["created_at"] or "")[:19].replace("T", " "),
                      *(f(j) for _, f in extra), j.get("name") or "", ",".join(j.get("tags") or [])] for j in items],
                    ["ID", "KIND", "STATUS", "PROGRESS", "ON", "CREATED (UTC)", *(h for h, _ in extra), "NAME", "TAGS"])
    if more:  # cut off by --limit: say so, and how to see the rest
        again = [f"--{k} {shlex.quote(str(v))}" for k, vs in filters.items()
                 if vs is not None and not (k == "parent" and vs == "none") for v in (vs if isinstance(vs, list) else [vs])]
        again += ["--children"] * with_children + ["--json"] * as_json + [f"--limit {limit * 2}"]
        click.echo(f"… more jobs: lmscope jobs {' '.join(again)} (or --all)", err=True)
    elif not items and any("," in t for t in tags):  # the TAGS column joins a job's tags with commas
        split = [part.strip() for t in tags for part in t.split(",") if part.strip()]
        click.echo(f"a tag is matched whole: give --tag once per tag ({' '.join('--tag ' + shlex.quote(t) for t in split)}: "
                   "jobs with every one)", err=True)
    elif not items and parent not in (None, "none") and parent.isdigit():
        job = c.get(int(parent))  # a missing job is a 404 that names it
        if not job.get("children"):
            click.echo(f"job {parent} is {article(job['kind'])} {job['kind']} job, not a sweep: it has no children", err=True)


@main.command()
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True)
def show(job_id, as_json):
    """A job's status, progress, params, summary, error and (once it ended) its files."""
    c = client()
    job = c.get(job_id)
    if as_json:
        click.echo(json.dumps(job, indent=2))
        return
    # published_at on a queued job: handed to the queue (waiting for a worker) or not yet (the reaper sends it)
    keys = ("id", "kind", "name", "status", "user", "parent_id", "attempts", "created_at",
            *(("published_at",) if job.get("status") == "queued" else ()), "started_at", "finished_at")
    for key in keys:
        if job.get(key) is not None:
            click.echo(f"{key:12} {job[key]}")
    if job.get("progress"):
        label = "last progress" if job["status"] in TERMINAL_STATES else "progress"
        click.echo(f"{label:12} {ProgressLine(job_id).render(job, head=False)}")
    if job.get("queue") and job["status"] == "queued":
        q = job["queue"]
        click.echo(f"{'queue':12} " + (NEXT_IN_LINE if next_in_line(q)
                                       else f"behind {plural(q['ahead'], 'queued job')}, {q['running']} running"))
        if job["queue"].get("unsent"):
            click.echo(f"{'':12} not handed to the broker yet: it is sent when the broker answers "
                       "(GET /readyz says whether it does)")
        if job["queue"].get("worker_stopped"):
            click.echo(f"{'':12} no worker takes jobs: {job['queue']['worker_stopped']}")
        if job["queue"].get("workers") == 0:
            click.echo(f"{'':12} no worker takes jobs from the queue: {NO_WORKER_ADVICE}")
    if job.get("children"):
        click.echo(f"{'children':12} " + ", ".join(f"{v} {k}" for k, v in job["children"].items() if v))
        if job.get("children_unsent"):
            click.echo(f"{'':12} {unsent_children_text(job['children_unsent'])}: {UNSENT_CHILDREN_ADVICE}")
    if not job.get("parent_id"):  # (a sweep's grid point is run again with its sweep)
        click.echo(f"{'run again':12} lmscope submit {job['kind']} --params job:{job['id']}  (-p KEY=VALUE changes one)")
    for key in ("params", "summary", "error", "environment"):
        if job.get(key):
            text = json.dumps(job[key], indent=2, ensure_ascii=False)
            click.echo(f"{key}:\n" + "\n".join("  " + line for line in text.splitlines()))
    echo_artifacts(c, job)


@main.command()
@click.argument("job_id", type=int)
def cancel(job_id):
    """Cancel a job (a sweep: all its children)."""
    job = client().cancel(job_id)
    if job["status"] == "cancelled":
        state = "cancelled"
    elif job["kind"] == "sweep":
        state = ("cancel requested (its queued grid points are cancelled now, running ones at their next batch; "
                 "it ends once they have)")
    else:
        # it may end before it reads the flag: then it keeps its result, and only `wait` can tell
        state = (f"cancel requested (stops at its next batch; one that finishes first keeps its result: "
                 f"`lmscope wait {job_id}` says how it ended)")
    click.echo(f"job {job_id}: {state}")


@main.command()
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--kind", help="instead of ids: your ended jobs of these kinds, e.g. norms or norms,entropy")
@click.option("--status", help="instead of ids: your jobs that ended so, e.g. failed or failed,cancelled")
@click.option("--tag", "tags", multiple=True, help="instead of ids: your ended jobs with this tag (repeatable: every one)")
@click.option("--yes", is_flag=True, help="with --kind/--status/--tag: do not ask first")
def delete(job_ids, kind, status, tags, yes):
    """Delete ended jobs with their series, plots and files, for good (a sweep: all its grid points). A job
    still queued or running, a grid point, or a train run whose checkpoints are registered models is kept,
    saying what to do (each job is tried). With --kind, --status or --tag instead of ids: every ended job of
    yours that matches them all, listed, then deleted once you say yes."""
    c, kept = client(), 0
    if job_ids and (kind or status or tags):
        raise click.UsageError("give job ids or --kind/--status/--tag, not both")
    if not job_ids:
        job_ids = matching_ended_jobs(c, kind, status, list(tags), yes)
    for job_id in job_ids:
        try:
            done = c.delete(job_id)
        except LmscopeError as e:
            if e.status == 0:  # no answer at all: nothing to go on with
                raise
            kept += 1
            what = {404: f"no job {job_id}", 410: f"job {job_id} was already deleted"}.get(e.status, f"kept job {job_id}")
            click.echo(f"{what}: {e.headline}", err=True)
            continue
        points = len(done["deleted"]) - 1
        click.echo(f"deleted job {job_id}" + (f" and its {plural(points, 'grid point')}" if points else "")
                   + f" ({byte_size(done['freed_bytes'])} of files freed)")
    if kept:
        raise SystemExit(1)


def matching_ended_jobs(c: Client, kind: str | None, status: str | None, tags: list[str], yes: bool) -> list[int]:
    """`lmscope delete --kind/--status/--tag`: the caller's ended top-level jobs that match, once confirmed."""
    if not (kind or status or tags):
        raise click.UsageError("name the jobs to delete (ids), or choose them with --kind, --status or --tag")
    wanted = [s.strip() for s in (status or ",".join(TERMINAL_STATES)).split(",") if s.strip()]
    if unended := [s for s in wanted if s not in TERMINAL_STATES]:
        raise click.UsageError(f"--status {','.join(unended)}: only ended jobs can be deleted "
                               f"({', '.join(TERMINAL_STATES)}); cancel a queued or running one first (`lmscope cancel ID`)")
    me = c.me()["name"]  # an admin lists everyone's jobs: a clean-up by filter stays within one's own
    items = list(c.list(page_size=500, kind=kind, status=",".join(wanted), tag=tags or None, parent="none", user=me))
    if not items:
        click.echo("no ended job of yours matches", err=True)
        return []
    print_table([[j["id"], j["kind"], j["status"], (j["created_at"] or "")[:19].replace("T", " "), j.get("name") or "",
                  ",".join(j.get("tags") or [])] for j in items], ["ID", "KIND", "STATUS", "CREATED (UTC)", "NAME", "TAGS"])
    points = sum((j.get("children") or {}).get("total", 0) for j in items)
    also = f" (and {plural(points, 'grid point')})" if points else ""
    if not yes and not click.confirm(f"Delete {plural(len(items), 'job')}{also} with their results and files, for good?"):
        raise SystemExit(1)
    return [j["id"] for j in items]


def series_listing(names: list[str], limit: int = 30) -> str:
    """The first `limit` series names, and how many there are in all when there are more."""
    return ", ".join(names[:limit]) + (f", … ({len(names)} in all)" if len(names) > limit else "")


@main.command()
@click.argument("job_id", type=int)
@click.option("--format", "fmt", type=click.Choice(["json", "csv"]), default="json", show_default=True)
@click.option("--series", multiple=True, help="series name (repeatable; `prefix*` matches a prefix)")
def results(job_id, fmt, series):
    """A job's series as JSON, or CSV rows: series, one column per label (layer, head, ...), x_meaning, x, y."""
    data = client().results(job_id, list(series))
    if data.get("missing"):
        names = data.get("available") or []
        click.echo(f"no series matched {', '.join(map(repr, data['missing']))}; "
                   + (f"job {job_id} has: {series_listing(names)}" if names else f"job {job_id} has no series"),
                   err=True)
        if not data["series"]:
            raise SystemExit(1)
    if not data["series"] and not series:
        job = client().get(job_id)
        why = {"queued": "it has not started", "running": "it writes its series when it finishes",
               "failed": f"it failed ({(job.get('error') or {}).get('type')}); `lmscope show {job_id}`",
               "cancelled": "it was cancelled before it finished"}.get(job["status"], "it recorded none")
        click.echo(f"job {job_id} ({job['status']}) has no series: {why}", err=True)
    if fmt == "json":
        click.echo(json.dumps(data, indent=2))
        return
    out = csv.writer(sys.stdout)
    keys = label_columns(data["series"])
    out.writerow(["series", *keys.values(), "x_meaning", "x", "y"])
    for s in data["series"]:
        labels = [csv_value(s["labels"].get(k)) for k in keys]
        meaning = s.get("x_meaning", "x")  # an older server does not say
        for x, y in zip(s["x"], s["y"]):
            out.writerow([s["name"], *labels, meaning, x, y])


CSV_FIXED_COLUMNS = ("series", "x_meaning", "x", "y")


def label_columns(curves: list[dict]) -> dict[str, str]:
    """The labels of all the curves, in the order first seen, each to its CSV column: its own name (`layer`,
    `head`, `order`, ...), or `label.NAME` where that would be one of the fixed columns. A curve without a
    label leaves its cell empty, so a spreadsheet or pandas reads each label as a column of its own."""
    keys: dict[str, str] = {}
    for curve in curves:
        for k in curve["labels"]:
            keys.setdefault(k, f"label.{k}" if k in CSV_FIXED_COLUMNS else k)
    return keys


@main.command()
@click.argument("job_ids", nargs=-1, type=int, required=True)
@click.option("--series", multiple=True, help="curves to compare (repeatable; `prefix*` matches a prefix)")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True,
              help="csv: without --series one row per field (kind, status, params.*, summary.*) and one column "
                   "per job; with --series the curves (series, a column per label, x_meaning, x, a column per job)")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="also draw the curves into this file (.png, .pdf, .svg, ...: its extension picks the format)")
@click.option("--logx", is_flag=True, help="with --plot: a log x axis")
@click.option("--logy", is_flag=True, help="with --plot: a log y axis")
def compare(job_ids, series, fmt, plot_path, logx, logy):
    """Jobs side by side: the parameters that differ, the summaries, and (--series) the curves."""
    if len(set(job_ids)) < 2:
        raise click.UsageError("give at least two different job ids, e.g. `lmscope compare 3 5`")
    if plot_path:
        check_plot_path(plot_path, series)
    from lmscope.compare import plot_comparison, x_meaning

    c = client().compare(list(job_ids), list(series))
    if c.missing:  # as `lmscope results`: say which exist; nothing matched at all is a failure
        shared = c.shared_series
        click.echo(f"no job has series {', '.join(map(repr, c.missing))}; "
                   + (f"the series all of them have: {series_listing(shared)}" if shared
                      else "they have no series in common"), err=True)
        if not c.curves:
            if plot_path:
                _nothing_to_plot(c, series)
            raise SystemExit(1)
    if fmt == "json":
        click.echo(json.dumps(c.to_json(), indent=2))
    elif fmt == "csv" and series:
        out = csv.writer(sys.stdout)
        keys = label_columns([{"labels": curve.labels} for curve in c.curves])
        out.writerow(["series", *keys.values(), "x_meaning", "x", *(f"job {i}" for i in c.ids)])
        for curve in c.curves:
            labels = [csv_value(curve.labels.get(k)) for k in keys]
            for x, ys in curve.aligned(c.ids):
                out.writerow([curve.name, *labels, x_meaning(curve.name), x, *("" if y is None else y for y in ys)])
    elif fmt == "csv":
        out = csv.writer(sys.stdout)
        out.writerow(["field", *(f"job {i}" for i in c.ids)])
        out.writerows([name, *(csv_value(v) for v in values)] for name, values in comparison_rows(c))
        _hint_shared_series(c)
    else:
        _print_comparison(c, bool(series))
    if plot_path:
        if not c.curves:
            _nothing_to_plot(c, series)
        try:
            click.echo(f"plot: {plot_comparison(c, plot_path, logx=logx, logy=logy)}", err=True)
        except (RuntimeError, ValueError) as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            raise click.ClickException(f"cannot write the plot to {plot_path}: {why_not_written(e, plot_path)}") from None


def _nothing_to_plot(c, series) -> None:
    shared = ", ".join(c.shared_series[:20]) or "none"
    raise click.ClickException(f"nothing to plot: these jobs have no series {', '.join(map(repr, series))} "
                               f"(series all of them have: {shared})")


def check_plot_path(plot_path: str, series: tuple[str, ...]) -> None:
    """Refuse a --plot that cannot work before asking the server anything: no --series, or a file
    extension matplotlib cannot write (none at all means .png)."""
    from lmscope.compare import plot_formats

    if not series:
        raise click.UsageError("--plot draws the curves --series names, e.g. --series 'norm.mean'")
    try:
        formats = plot_formats()
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
    ext = Path(plot_path).suffix
    if ext and ext[1:].lower() not in formats:
        raise click.UsageError(f"--plot {plot_path}: cannot draw a {ext} file; end the name with one of "
                               f"{', '.join('.' + f for f in sorted(formats))} (e.g. cmp.png)")


def comparison_rows(c) -> list[tuple[str, list[Any]]]:
    """The side-by-side fields: kind, status, name (when a job has one), the params that differ
    (`params.KEY`), the summary values (`summary.KEY`); each with one value per job."""
    rows = [("kind", [j["kind"] for j in c.jobs]), ("status", [j["status"] for j in c.jobs])]
    if any(j.get("error") for j in c.jobs):  # why a job failed belongs beside its status
        rows.append(("error", [f"{j['error'].get('type')}: {j['error'].get('message')}" if j.get("error") else None
                               for j in c.jobs]))
    if any(j.get("name") for j in c.jobs):
        rows.append(("name", [j.get("name") for j in c.jobs]))
    rows += [(f"params.{k}", [v.get(i, ABSENT) for i in c.ids]) for k, v in c.params.items()]
    rows += [(f"summary.{k}", [v.get(i, ABSENT) for i in c.ids]) for k, v in c.summary.items()]
    return rows


class _Absent:
    """A field a job does not have (`-` in a table), apart from one whose value is null."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


def csv_value(v: Any) -> Any:
    """A CSV cell: strings and numbers as they are (in full), null empty, anything else as JSON."""
    if v is None or v is ABSENT:
        return ""
    if isinstance(v, str) or (isinstance(v, (int, float)) and not isinstance(v, bool)):
        return v
    return json.dumps(v)


TABLE_CELL_WIDTH = 40  # characters of a value in `lmscope compare`'s table (csv and json keep all)


def _hint_shared_series(c) -> None:
    shared = c.shared_series
    if shared:
        click.echo(f"\ncurves all of them have: {', '.join(shared[:20])}{' …' if len(shared) > 20 else ''}"
                   "\n(compare them with --series NAME, draw them with --plot FILE)", err=True)


def _print_comparison(c, with_curves: bool) -> None:
    from lmscope.compare import clip, clip_apart, labels_text

    def cell(v):  # a curve's y: None where the job has no value at that x
        return "-" if v is None else clip(summary_value(v), TABLE_CELL_WIDTH)

    def field(v, digits=True):  # a parameter or summary value: null where the job's value is null
        if v is ABSENT or v is None:
            return "-" if v is ABSENT else "null"
        return summary_value(v) if digits or isinstance(v, str) else json.dumps(v, ensure_ascii=False)

    head = [f"job {j['id']}" for j in c.jobs]
    rows, same = [], []
    for name, values in comparison_rows(c):
        row = [name.removeprefix("summary."), *(clip(field(v), TABLE_CELL_WIDTH) if name.startswith(("params.", "summary."))
                                                else clip(v or "", TABLE_CELL_WIDTH) for v in values)]
        # summary values every job shares go last, under their own heading: what differs comes first
        alike = name.startswith("summary.") and ABSENT not in values and all(v == values[0] for v in values)
        if not alike and name.startswith(("params.", "summary.")) and len(set(row[1:])) == 1:
            # they differ past 6 digits or 40 characters: in full, and cut only where that keeps them apart
            row[1:] = clip_apart([field(v, digits=False) for v in values], TABLE_CELL_WIDTH)
        (same if alike else rows).append(row)
    if same:
        rows += [["(the same in every job)", *[""] * len(head)], *same]
    print_table(rows, ["", *head])
    if not with_curves:
        _hint_shared_series(c)
        return
    for curve in c.curves:
        tag = labels_text(curve.labels, sorted(curve.labels))
        click.echo(f"\n{curve.name}" + (f" [{tag}]" if tag else ""))
        print_table([[summary_value(x), *(cell(y) for y in ys)] for x, ys in curve.aligned(c.ids)],
                    ["x", *head])


def why_not_written(e: OSError, target: str | Path) -> str:
    """One line on why `target` (a file or folder to write) could not be: a file standing where a folder
    of its path should be is named as such, not as "File exists"."""
    if isinstance(e, (FileExistsError, NotADirectoryError)):
        for folder in [Path(target), *Path(target).parents]:
            if folder.exists() and not folder.is_dir():
                return f"{folder} is a file, not a folder"
    return f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")


@main.command()
@click.argument("job_id", type=int)
@click.argument("directory", type=click.Path(file_okay=False))
def fetch(job_id, directory):
    """Download a job's artifacts (plots, npz) into DIRECTORY."""
    c = client()
    try:
        paths = c.fetch(job_id, directory)
    except OSError as e:  # a file where a folder should be, no permission, a full disk
        raise click.ClickException(f"cannot save job {job_id}'s artifacts in {directory}: "
                                   f"{why_not_written(e, directory)}") from None
    for path in paths:
        click.echo(path)
    if not paths:
        status = c.get(job_id)["status"]
        click.echo(f"job {job_id} ({status}) has no artifacts{'' if status in TERMINAL_STATES else ' yet'}", err=True)


@main.command()
@click.argument("kind", required=False)
def kinds(kind):
    """The job kinds and what they do; with KIND, its parameters (type, default, limits, meaning)."""
    items = client().kinds()
    if kind is None:
        width = max((len(k["name"]) for k in items), default=0)
        for k in items:
            note = ""
            if not k.get("submittable", True):
                note = f"  (child of {' / '.join(k.get('child_of') or ['another kind'])}; not submittable)"
            click.echo(f"{k['name']:{width}}  {k['description']}{note}")
        click.echo("\n`lmscope kinds KIND` lists a kind's parameters.", err=True)
        return
    found = next((k for k in items if k["name"] == kind), None)
    if found is None:
        names = [k["name"] for k in items]
        raise click.ClickException(f"no kind {kind!r}{did_you_mean(kind, names) or '.'} The kinds are: {', '.join(names)}")
    click.echo(f"{found['name']}: {found['description']}")
    if not found.get("submittable", True):
        click.echo(f"(made by {' / '.join(found.get('child_of') or [])}; not submitted on its own)")
    rows = schema_rows(found["params_schema"], found.get("defaults") or {})
    # a long default (a grid of fractions, a list of orders) would widen every row: written in full below
    long_defaults = [(name, default) for name, _, default, _ in rows if len(default) > DEFAULT_CELL_WIDTH]
    rows = [(name, type_, "(below)" if len(default) > DEFAULT_CELL_WIDTH else default, notes)
            for name, type_, default, notes in rows]
    widths = [max([len(r[i]) for r in rows] + [len(h)]) for i, h in enumerate(("PARAMETER", "TYPE", "DEFAULT"))]
    click.echo(f"\n{'PARAMETER':{widths[0]}}  {'TYPE':{widths[1]}}  {'DEFAULT':{widths[2]}}  LIMITS AND MEANING")
    for name, type_, default, notes in rows:
        click.echo(f"{name:{widths[0]}}  {type_:{widths[1]}}  {default:{widths[2]}}  {notes}".rstrip())
    if long_defaults:
        click.echo("\nDefaults in full:")
        for name, default in long_defaults:
            click.echo(f"  {name} = {default}")
    if found.get("submittable", True):
        click.echo(f"\nSet them with `lmscope submit {kind} -p NAME=VALUE` (dotted names for nested ones) or "
                   "--params FILE.", err=True)
    else:  # its jobs are made by another kind, from that kind's parameters
        parents = found.get("child_of") or []
        see = f": see `lmscope kinds {parents[0]}`" if parents else ""
        click.echo(f"\n{kind}'s jobs are made by {' / '.join(parents) or 'another kind'}, which sets these from its own "
                   f"parameters{see}.", err=True)
    if found.get("example"):
        click.echo(f"A small one on the built-ins (under a minute on a CPU):\n  {example_command(kind, found['example'])}")


DEFAULT_CELL_WIDTH = 40  # characters of a default in `lmscope kinds KIND`'s table; longer ones follow it in full


def example_command(kind: str, example: dict[str, Any]) -> str:
    """`lmscope submit KIND -p a=1 -p grid.b='[1,2]'`: `example` as -p pairs, quoted for a POSIX shell."""
    def pairs(obj: dict[str, Any], prefix: str = "") -> list[str]:
        out = []
        for key, value in obj.items():
            if isinstance(value, dict) and value:
                out += pairs(value, prefix + key + ".")
            else:
                text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
                out.append(f"-p {shlex.quote(f'{prefix}{key}={text}')}")
        return out
    return " ".join(["lmscope submit", kind, *pairs(example)])


def schema_rows(schema: dict, defaults: dict, prefix: str = "", defs: dict | None = None,
                study: str | None = None) -> list[tuple[str, ...]]:
    """(dotted name, type, default, limits and description) per parameter of a JSON schema; nested
    models (e.g. a sweep's `grid`, `train`) are listed field by field, and a field that belongs to one
    study of a sweep (`x-study`) says which."""
    defs = schema.get("$defs", {}) if defs is None else defs
    required = set(schema.get("required", []))
    rows = []
    for name, prop in schema.get("properties", {}).items():
        own_study = prop.get("x-study") or study
        ref = prop.get("$ref") or next((a["$ref"] for a in prop.get("allOf", []) if "$ref" in a), None)
        if ref:
            nested = defs.get(ref.rsplit("/", 1)[-1], {})
            rows += schema_rows(nested, defaults.get(name) or {}, f"{prefix}{name}.", defs, own_study)
            continue
        if name in defaults:
            default = json.dumps(defaults[name], ensure_ascii=False)
        else:
            default = "required" if name in required else ""
        limits = [f"{sign} {prop[key]}" for key, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"),
                                                           ("maximum", "≤"), ("exclusiveMaximum", "<"))
                  if key in prop]
        limits += [f"{prop[key]} {what}" for key, what in (("minItems", "item(s) at least"),
                                                           ("maxItems", "items at most")) if key in prop]
        choices = prop.get("enum") or prop.get("items", {}).get("enum") or []
        if len(choices) > 3:  # long lists of choices go with the notes, not in the type column
            limits.insert(0, "one of " + ", ".join(map(str, choices)))
        notes = "; ".join(limits + ([prop["description"]] if prop.get("description") else []))
        notes = f"[study={own_study}] {notes}".rstrip() if own_study else notes
        rows.append((prefix + name, _schema_type(prop), default, notes))
    return rows


def _schema_type(prop: dict) -> str:
    if "enum" in prop:
        return "choice" if len(prop["enum"]) > 3 else " | ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    if "anyOf" in prop:
        return " | ".join(_schema_type(p) for p in prop["anyOf"])
    if prop.get("type") == "array":
        return f"list of {_schema_type(prop.get('items', {}))}"
    return prop.get("type", "any")


@main.command()
def whoami():
    """Who your token belongs to, your active jobs, what your uploads and your jobs' files take, and your limits."""
    me = client().me()
    own = set(me.get("per_user_limits") or [])
    limits = ", ".join(f"{k}={byte_size(v) if k.endswith('_bytes') else v}" + ("" if k in own else " (server default)")
                       for k, v in me["limits"].items())
    uploads = f", {byte_size(me['uploaded_bytes'])} of uploads" if "uploaded_bytes" in me else ""
    if "job_file_bytes" in me:  # (a server older than `lmscope delete` does not say)
        uploads += f", {byte_size(me['job_file_bytes'])} of job files"
    click.echo(f"{me['name']}{' (admin)' if me['is_admin'] else ''}: {me['active_jobs']} active job(s){uploads}; {limits}")


# ---------------------------------------------------------------- models and datasets

@main.group(invoke_without_command=True)
@click.option("--run", metavar="NAME", help="only the checkpoints of training run NAME (NAME@step<N>)")
@click.pass_context
def models(ctx, run):
    """Registered models (`lmscope models` lists them)."""
    ctx.obj = {"run": run}  # `lmscope models --run R list|delete` means the subcommand's --run R
    if ctx.invoked_subcommand is None:
        ctx.invoke(models_list, run=run)


def group_run(run: str | None) -> str | None:
    """A subcommand's --run, else the one given to `lmscope models --run R …`."""
    return run if run is not None else ((click.get_current_context().obj or {}).get("run"))


def natural_key(text: str) -> tuple:
    """Sort key putting numbers in order as numbers: cx@step20 before cx@step100."""
    parts = re.split(r"(\d+)", text)
    return tuple((0, int(p)) if i % 2 else (1, p.lower()) for i, p in enumerate(parts)), text


@models.command("list")
@click.option("--run", metavar="NAME", help="only the checkpoints of training run NAME (NAME@step<N>)")
def models_list(run=None):
    """List registered models, names in natural order (cx@step20 before cx@step100)."""
    run = group_run(run)
    items = sorted(client().models(run=run), key=lambda m: natural_key(m["name"]))
    if run is not None:
        if not items:
            click.echo(f"no checkpoints of a training run {run!r} (models named {run}@step<N>)", err=True)
    print_table([[m["name"], m["source"], m.get("architecture") or "", m.get("layers") or "", m.get("heads") or "",
                  m.get("kv_heads") or "", m.get("hidden") or "", m.get("context") or "", m.get("params") or ""]
                 for m in items],
                ["NAME", "SOURCE", "ARCH", "LAYERS", "HEADS", "KV", "HIDDEN", "CONTEXT", "PARAMS"])


@models.command("register")
@click.argument("name")
@click.argument("path")
def models_register(name, path):
    """Register a Hugging Face directory (on the server, under LMSCOPE_MODEL_DIRS) as NAME (admins). PATH is
    the server's: a relative one is looked up under its model roots; if none holds it and it is a directory
    here, it is tried again as this directory's absolute path (the embedded service, a shared disk)."""
    c = client()
    try:
        m = c.register_model(name, path)
    except LmscopeError as e:
        here = local_directory(path)
        if e.status != 422 or here is None or here == path:
            raise
        m = c.register_model(name, here)
    click.echo(f"registered model {m['name']}: {m.get('architecture')}, {m.get('layers')} layers, {m.get('params')} params")


def local_directory(path: str) -> str | None:
    """A relative PATH that is a directory where the CLI runs, made absolute; else None."""
    try:
        p = Path(path).expanduser()
        return str(p.absolute()) if path and not p.is_absolute() and p.is_dir() else None
    except (RuntimeError, ValueError, OSError):  # ~nosuchuser: the server says what is wrong with it
        return None


@models.command("delete")
@click.argument("names", nargs=-1)
@click.option("--run", metavar="NAME", help="every checkpoint of training run NAME (NAME@step<N>)")
def models_delete(names, run=None):
    """Remove models from the registry and free their names (their files stay): checkpoints of your own
    runs (`--run NAME` for all of a run's), or, for admins, any registered model but the built-ins. A model
    that a queued or running job reads, or whose run is still training, is kept (each is tried)."""
    c = client()
    names, run = list(names), group_run(run)
    if run is not None:
        found = sorted((m["name"] for m in c.models(run=run)), key=natural_key)
        if not found:  # not a usage mistake: a clean-up run twice finds nothing the second time
            raise click.ClickException(f"no checkpoints of a training run {run!r} (models named {run}@step<N>); "
                                       "`lmscope models` lists the models")
        names += found
    if not names:
        raise click.UsageError("name the models to remove, or give --run NAME")
    kept = remove_each("model", names, c.delete_model)
    if kept and run is not None:
        active: dict[int, str] = {}  # the run's train jobs that have not ended: id → status
        for e in kept.values():  # the API's 409 for such a checkpoint names the job and its status
            m = re.match(r"job (\d+) is (queued|running) and writes ", e.problem.get("detail") or "")
            if e.status == 409 and m:
                active[int(m[1])] = m[2]
        if active:
            training = ", ".join(f"train job {i} is {status}" for i, status in active.items())
            cancel = " and ".join(f"`lmscope cancel {i}`" for i in active)
            raise click.ClickException(f"run {run!r} has not ended ({training}): {cancel} first, or wait for it "
                                       f"to end; then `lmscope models delete --run {run}` again")
        not_yours = any(e.status == 403 for e in kept.values())
        then = ("they are another user's: ask their owner or an admin to remove them" if not_yours else
                f"`lmscope models delete --run {run}` again once they are free")
        raise click.ClickException(f"run {run!r} keeps {plural(len(kept), 'checkpoint')} ({', '.join(kept)}), "
                                   f"so its name stays taken; {then}")
    if kept:
        raise SystemExit(1)


def remove_each(what: str, names: list[str], remove) -> dict[str, LmscopeError]:
    """Try to remove every name (one refusal does not stop the rest); say what happened to each; the
    names kept, with why."""
    kept = {}
    for name in names:
        try:
            remove(name)
        except LmscopeError as e:
            if e.status == 0:  # no answer at all: nothing to go on with
                raise
            kept[name] = e
            click.echo(f"kept {what} {name}: {e.headline}", err=True)
        else:
            click.echo(f"removed {what} {name}")
    return kept


@main.group(invoke_without_command=True)
@click.pass_context
def datasets(ctx):
    """Text datasets (`lmscope datasets` lists them)."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(datasets_list)


@datasets.command("add")
@click.argument("name")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(list(DATASET_FORMATS)), default="text", show_default=True,
              help="text: paragraphs split by blank lines; lines: one document per line (WikiText); jsonl: {\"text\": ...}")
@click.option("--description", help="what the corpus is")
def datasets_add(name, path, fmt, description):
    """Register a file on the server as dataset NAME, without uploading it (run on the server: talks to the
    database directly). For corpora larger than LMSCOPE_MAX_UPLOAD_BYTES, e.g. WikiText-103."""
    from sqlalchemy import select

    from lmscope.catalog import CatalogError, check_name
    from lmscope.db.builtins import register_dataset_file
    from lmscope.db.models import Dataset

    try:
        check_name(name)  # the rule the API applies to uploads
    except CatalogError as e:
        raise click.ClickException(str(e)) from None
    sessions = _sessions()
    with sessions() as session:
        if session.scalar(select(Dataset.id).where(Dataset.name == name)) is not None:
            raise click.ClickException(f"a dataset named {name!r} exists; pick another name")
    try:
        d = register_dataset_file(sessions, name, path, fmt, description=description)
    except CatalogError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"registered dataset {d.name}: {plural(d.num_documents, 'document')}, {d.num_bytes} bytes, sha256 {d.sha256[:12]}…")
    hint_one_document(path, fmt, d.num_documents, f"`lmscope datasets delete {name}`, then add it again")


def hint_one_document(path, fmt: str, documents: int, again: str) -> None:
    """Say so when the text format (paragraphs split at blank lines) made one document of a file of many lines:
    WikiText's raw files, one paragraph per line, with no blank line between, are read so."""
    if fmt != "text" or documents != 1:
        return
    lines = 0
    try:
        with open(path, "rb") as f:  # the first MiB tells: a 500-MB corpus is not read a second time
            lines = f.read(2**20).count(b"\n")
    except OSError:  # moved since: the upload itself went through
        return
    if lines >= 10:
        click.echo(f"note: one document: --format text splits documents at blank lines, and {path} has none "
                   f"between its lines. If each line is a document (WikiText), {again} with --format lines",
                   err=True)


@datasets.command("list")
def datasets_list():
    """List datasets."""
    items = client().datasets()
    print_table([[d["name"], d["source"], d["format"], d["documents"], d["bytes"], d.get("uploaded_by") or ""]
                 for d in items], ["NAME", "SOURCE", "FORMAT", "DOCUMENTS", "BYTES", "UPLOADED BY"])


@datasets.command("upload")
@click.argument("name")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(list(DATASET_FORMATS)), default="text", show_default=True,
              help="text: paragraphs; lines: one document per line; jsonl: {\"text\": ...} per line")
@click.option("--description")
def datasets_upload(name, file, fmt, description):
    """Upload FILE as dataset NAME."""
    d = client().upload_dataset(name, file, fmt, description=description)
    click.echo(f"uploaded dataset {d['name']}: {plural(d['documents'], 'document')}, {d['bytes']} bytes, sha256 {d['sha256'][:12]}")
    hint_one_document(file, fmt, d["documents"], f"`lmscope datasets delete {name}`, then upload it again")


@datasets.command("delete")
@click.argument("names", nargs=-1, required=True)
def datasets_delete(names):
    """Remove datasets from the registry and free their names (your uploads; admins: any but the built-in).
    An upload's file goes with the last name that uses it; a file added in place stays. A dataset a queued or
    running job reads is kept (each name is tried)."""
    if remove_each("dataset", list(names), client().delete_dataset):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
