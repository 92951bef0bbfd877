"""The dashboard: one static page that watches jobs, their progress and their plots through /v1."""

from __future__ import annotations

import json
from importlib import resources

from flask import Blueprint, Response

from lmscope.compare import X_MEANINGS, Y_MEANINGS

bp = Blueprint("dashboard", __name__)

# The page's charts name their axes as `lmscope compare --plot` does: the page gets X_MEANINGS and Y_MEANINGS in
# this data block.
MEANINGS_BLOCK = '<script id="meanings" type="application/json">{}</script>'


@bp.get("/")
def dashboard() -> Response:
    """The dashboard page (jobs, progress, plots); it calls /v1 from the browser."""
    html = resources.files("lmscope.api").joinpath("static/dashboard.html").read_text(encoding="utf-8")
    meanings = json.dumps({"x": X_MEANINGS, "y": Y_MEANINGS}).replace("</", "<\\/")  # no "</" may end the <script>
    html = html.replace(MEANINGS_BLOCK, MEANINGS_BLOCK.replace("{}", meanings), 1)
    return Response(html, mimetype="text/html")
