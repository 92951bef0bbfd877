"""The dashboard: one static page that watches jobs, their progress and their plots through /v1."""

from __future__ import annotations

from importlib import resources

from flask import Blueprint, Response

bp = Blueprint("dashboard", __name__)


@bp.get("/")
@bp.get("/dashboard")
def dashboard() -> Response:
    html = resources.files("lmscope.api").joinpath("static/dashboard.html").read_text(encoding="utf-8")
    return Response(html, mimetype="text/html")
