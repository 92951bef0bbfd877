"""The dashboard: one static page that watches jobs, their progress and their plots through /v1."""

from __future__ import annotations

from importlib import resources

from flask import Blueprint, Response

bp = Blueprint("dashboard", __name__)


@bp.get("/")
def dashboard() -> Response:
    """The dashboard page (jobs, progress, plots); it calls /v1 from the browser."""
    html = resources.files("lmscope.api").joinpath("static/dashboard.html").read_text(encoding="utf-8")
    return Response(html, mimetype="text/html")
