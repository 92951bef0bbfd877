"""The HTTP API (Flask). `create_app(settings=None, publisher=None)` is the one entry point:
gunicorn serves `lmscope.api.wsgi:app`, `lmscope up` embeds it with an in-process publisher."""

from lmscope.api.app import create_app

__all__ = ["create_app"]
