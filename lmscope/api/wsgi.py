"""gunicorn entry point: `gunicorn lmscope.api.wsgi:app` (settings from LMSCOPE_* variables).

This is the team deployment's API: its jobs go to Celery workers through LMSCOPE_BROKER_URL. Without a
broker nothing would ever run them (the in-process queue has workers only inside `lmscope up`), and
tokens would be off: refuse to start instead.
"""

from lmscope.api import create_app
from lmscope.config import Settings

settings = Settings.from_env()
if settings.embedded:
    raise RuntimeError("gunicorn lmscope.api.wsgi:app needs LMSCOPE_BROKER_URL (e.g. redis://redis:6379/0): "
                       "without a broker no worker would receive its jobs. On one machine, run `lmscope up`.")
app = create_app(settings)
