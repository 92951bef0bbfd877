"""The Flask app factory: settings → database sessions, publisher, blueprints, error handlers."""

from __future__ import annotations

import logging
import time

from flask import Flask, g, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed
from werkzeug.routing import IntegerConverter

from lmscope.api.auth import authenticate, check_browser_request
from lmscope.api.errors import register_error_handlers
from lmscope.api.inputs import check_request
from lmscope.api.metrics import RequestMetrics
from lmscope.api.state import ApiState, Publisher
from lmscope.config import Settings
from lmscope.db.builtins import ensure_builtins
from lmscope.db.engine import make_engine, make_sessionmaker, schema_problem
from lmscope.queue import make_publisher

log = logging.getLogger("lmscope.api")

# Multipart framing around an upload; the exact file-size check is in the upload view.
UPLOAD_OVERHEAD_BYTES = 64 * 1024


def upsert_builtins(settings: Settings, sessions, engine) -> None:
    """Upsert the built-in models/datasets at start-up (workers do the same). A failure (e.g. an
    unmigrated database) is logged and does not stop the API: /readyz and the job routes say more."""
    try:
        ensure_builtins(settings, sessions)
    except Exception:
        problem = schema_problem(engine)
        if problem is not None:  # the usual cause, in one line: no traceback to read through
            log.warning("could not upsert the built-in models/datasets: %s", problem)
        else:
            log.exception("could not upsert the built-in models/datasets")


class AsciiIntegerConverter(IntegerConverter):
    """`<int:job_id>` as ASCII digits without leading zeros: werkzeug's `\\d+` also matches "٣" (job 3)
    and "01" (job 1), where the query parameters refuse such integers."""

    regex = r"(?:0|[1-9][0-9]{0,99})"  # longer is no route (past 4300 digits int() raised: a 500)


def create_app(settings: Settings | None = None, publisher: Publisher | None = None) -> Flask:
    settings = settings or Settings.from_env()
    app = Flask("lmscope.api", static_folder=None)  # /docs reads its page itself; no /static route
    app.config["MAX_CONTENT_LENGTH"] = settings.max_upload_bytes + UPLOAD_OVERHEAD_BYTES
    app.json.sort_keys = False  # keep the documents' field order (id, kind, ... links)
    # `//` in a path (an artifact named `%2Fetc%2Fpasswd`) is a 404 problem, not an HTML redirect to another
    # path; set before the blueprints' rules are bound to the map.
    app.url_map.merge_slashes = False
    app.url_map.converters["int"] = AsciiIntegerConverter
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    app.extensions["lmscope"] = ApiState(settings=settings, engine=engine, sessions=sessions,
                                         publisher=publisher or make_publisher(settings), metrics=RequestMetrics())

    from lmscope.api import dashboard, events, health, jobs, metrics, openapi, registry, results

    for module in (jobs, results, events, registry, health, metrics, openapi, dashboard):
        app.register_blueprint(module.bp)
    register_error_handlers(app)

    @app.before_request
    def _authenticate():
        g.started = time.perf_counter()
        check_browser_request(request.method, request.headers, auth_enabled=settings.auth,
                              allowed_hosts=settings.allowed_hosts)
        if request.path.startswith("/v1/"):
            g.caller = authenticate(request.headers.get("Authorization"), auth_enabled=settings.auth, sessions=sessions)
            check_request(app.view_functions.get(request.endpoint) if request.endpoint else None)

    @app.after_request
    def _count(response):
        response.headers.setdefault("X-Content-Type-Options", "nosniff")  # a file is what its type says
        route = _route_of(app, request)
        started = g.get("started")
        if started is not None:
            app.extensions["lmscope"].metrics.observe(request.method, route, response.status_code,
                                                      time.perf_counter() - started)
        return response

    upsert_builtins(settings, sessions, engine)
    registry.tidy_deleted_uploads(sessions, settings.data_dir / "datasets")
    jobs.tidy_deleted_jobs(sessions, settings)
    return app


def _route_of(app: Flask, request) -> str:
    """The URL rule a request is counted under: its own, the rule of a path asked with a method it does not
    take (a 405: PUT /v1/jobs/1 is the job route's), or "(unmatched)" (a 404)."""
    if request.url_rule is not None:
        return request.url_rule.rule
    error = request.routing_exception
    if isinstance(error, MethodNotAllowed) and error.valid_methods:
        try:
            rule, _ = app.url_map.bind_to_environ(request.environ).match(method=error.valid_methods[0],
                                                                          return_rule=True)
            return rule.rule
        except HTTPException:
            pass
    return "(unmatched)"
