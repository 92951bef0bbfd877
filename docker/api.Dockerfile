# The API image: Flask + gunicorn, no torch (the API never imports it; see tests/test_layering.py).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

COPY pyproject.toml README.md ./
COPY lmscope ./lmscope
RUN pip install ".[api]" \
 && useradd --uid 1000 --create-home lmscope \
 && mkdir -p /data /models /corpora && chown lmscope /data

USER lmscope
EXPOSE 8000
# The same command as the api service in docker-compose.yml.
CMD ["gunicorn", "--bind", "0.0.0.0:8000", "--worker-class", "gthread", "--workers", "2", \
     "--threads", "16", "--timeout", "120", "--access-logfile", "-", "lmscope.api.wsgi:app"]
