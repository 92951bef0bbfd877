"""gunicorn entry point: `gunicorn lmscope.api.wsgi:app` (settings from LMSCOPE_* variables)."""

from lmscope.api import create_app

app = create_app()
