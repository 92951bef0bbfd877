# The worker image: the CUDA PyTorch base (torch + triton already installed, so pip keeps them),
# plus lmscope's worker extras. One container per GPU; CUDA is initialised only in the job process.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MPLBACKEND=Agg HF_HUB_OFFLINE=1
WORKDIR /app

COPY pyproject.toml README.md ./
COPY lmscope ./lmscope
RUN pip install ".[worker,triton]" \
 && useradd --uid 1000 --create-home lmscope \
 && mkdir -p /data /models /corpora && chown lmscope /data

USER lmscope
CMD ["lmscope", "worker", "--concurrency", "1"]
