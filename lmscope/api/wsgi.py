"""gunicorn entry point: `gunicorn lmscope.api.wsgi:app` (settings from LMSCOPE_* variables).

This is the team deployment's API: its jobs go to Celery workers through LMSCOPE_BROKER_URL. Without a
broker nothing would ever run them (the in-process queue has workers only inside `lmscope up`), and
tokens would be off: refuse to start instead.
"""

import logging

from lmscope.api import create_app
from lmscope.config import Settings, unknown_variables

settings = Settings.from_env()
for line in unknown_variables():  # a misnamed setting would keep its default without a word
    logging.getLogger("lmscope.api").warning(line)
if settings.embedded:
    raise RuntimeError("gunicorn lmscope.api.wsgi:app needs LMSCOPE_BROKER_URL (e.g. redis://redis:6379/0): "
                       "without a broker no worker would receive its jobs. On one machine, run `lmscope up`.")
if not settings.auth:
    # gunicorn's --bind is not ours to see (`lmscope up` refuses a non-loopback address without tokens): say
    # it loudly instead, once per process
    logging.getLogger("lmscope.api").warning(
        "LMSCOPE_AUTH=0: tokens are off, and every caller that reaches this API acts as the admin `local` "
        "(every user's jobs, cancels, model registration); bind gunicorn to 127.0.0.1 or keep its port private, "
        "or set LMSCOPE_AUTH=1 and create users with `lmscope user create NAME`")
app = create_app(settings)
