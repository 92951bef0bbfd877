"""The dashboard: one static page that watches jobs, their progress and their plots through /v1."""

from __future__ import annotations

import json
from importlib import resources

from flask import Blueprint, Response

from lmscope.compare import X_MEANINGS

bp = Blueprint("dashboard", __name__)

# The page's charts name their x axis as `lmscope compare` does: the page gets X_MEANINGS in this data block.
X_MEANINGS_BLOCK = '<script id="x-meanings" type="application/json">{}</script>'


@bp.get("/")
def dashboard() -> Response:
    """The dashboard page (jobs, progress, plots); it calls /v1 from the browser."""
    html = resources.files("lmscope.api").joinpath("static/dashboard.html").read_text(encoding="utf-8")
    meanings = json.dumps(X_MEANINGS).replace("</", "<\\/")  # JSON inside <script>: no "</" may end it early
    html = html.replace(X_MEANINGS_BLOCK, X_MEANINGS_BLOCK.replace("{}", meanings), 1)
    return Response(html, mimetype="text/html")
