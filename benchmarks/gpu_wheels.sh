#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the wheels that the GPU machine's image lacks, into .whl/
# (ignored by git; carried to the device). The image has torch, triton, transformers, numpy,
# matplotlib, safetensors, accelerate and pytest; lmscope also needs its light core and the API/worker
# parts. Versions are the ones installed here (what the CPU test suite ran with). The image also has
# werkzeug, click, jinja2, markupsafe and typing-extensions, but maybe older than flask, celery and
# pydantic need (pip installs these with --no-deps, so nothing checks): they come along too, as do
# sentencepiece and protobuf (the worker reads tokenizer.model-only directories with them).
#
#   bash benchmarks/gpu_wheels.sh        # then, on the device (carry .whl):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site:$PWD LMSCOPE_WIKITEXT2_PATH=$PWD/.whl/wiki.test.raw bash benchmarks/gpu_suite.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION="${PY_VERSION:-3.12}"  # the GPU image's python3
PACKAGES=(pydantic pydantic_core annotated-types typing-inspection sqlalchemy alembic mako flask itsdangerous
          blinker celery kombu billiard vine amqp click-didyoumean click-repl click-plugins prompt_toolkit wcwidth
          redis psycopg psycopg-binary tzlocal werkzeug click jinja2 markupsafe typing_extensions sentencepiece protobuf)
pins=()
for name in "${PACKAGES[@]}"; do
  version=$(python3 -m pip show "$name" 2>/dev/null | sed -n "s/^Version: //p" || true)
  pins+=("$name${version:+==$version}")
done
rm -rf .whl && mkdir -p .whl
platforms=()
for n in 17 27 28 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
# ../shared does not travel to the device: the GPU tests and the job benchmarks read WikiText-2 from here
wikitext=$(python3 -c "from lmscope.config import Settings; print(Settings.from_env().wikitext2_path or '')")
[[ -n "$wikitext" ]] && cp "$wikitext" .whl/wiki.test.raw
ls .whl | wc -l
du -sh .whl
