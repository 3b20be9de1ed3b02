# syntax=docker/dockerfile:1
# zeroqueue: one image for the inference replica, the metering service and the ledger commands.
#
#   docker build -t zeroqueue:0.1.0 .                                    # CPU (the default)
#   docker build --build-arg VARIANT=cuda -t zeroqueue:0.1.0-cuda .      # NVIDIA GPUs
#
# VARIANT picks the torch wheel index (cpu: PyTorch's CPU wheels; cuda: PyPI, whose torch 2.13.0 Linux wheels
# are CUDA 13.0 builds that bring the CUDA user-space libraries with them; the host's NVIDIA driver, >= 580, is
# mounted by the NVIDIA Container Toolkit). TORCH_INDEX_URL overrides the index (another CUDA build, a mirror);
# PYTHON_IMAGE overrides the base of both stages. Usage: docs/OPERATIONS.md, "Docker".
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG VARIANT=cpu

# ---- build: a venv with torch for the variant, the project, and the compiled CPU kernels -----------------------
FROM ${PYTHON_IMAGE} AS build
ARG VARIANT
ARG TORCH_INDEX_URL=
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# g++ compiles services/inference/device/kernels; it stays in this stage.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
 && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv "$VIRTUAL_ENV"
ENV PATH="/opt/venv/bin:$PATH"
# torch first, from the variant's index, so that installing the project finds its pin (==2.13.0) satisfied.
RUN case "$VARIANT" in \
      cpu)  index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;; \
      cuda) index="${TORCH_INDEX_URL:-https://pypi.org/simple}" ;; \
      *)    echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac \
 && pip install --no-cache-dir --index-url "$index" torch==2.13.0
WORKDIR /src
COPY pyproject.toml ./
COPY protos/ protos/
COPY services/ services/
COPY billing/ billing/
COPY migrations/ migrations/
RUN pip install --no-cache-dir /src
# The bundled model, readable by the service user whatever modes the build context gave its files.
COPY services/inference/bundled/zq-python-tiny/ /opt/zeroqueue/models/zq-python-tiny/
RUN chmod -R a+rX /opt/zeroqueue/models
# From outside /src, so `services` is the installed package: the kernels land in its kernels/_build, built for
# this builder's CPU (AVX-512 or AVX2; docs/OPERATIONS.md). A build failure fails the image, except on a builder
# CPU with neither ISA, which cannot check the kernels: that image runs on plain torch (the replica logs why).
WORKDIR /opt
RUN python -m services.inference.device.kernels build --strict \
 || python -c "import sys; from services.inference.device.kernels import runnable_isas; sys.exit(bool(runnable_isas()[0]))"
RUN mkdir -p /opt/venv/lib/python3.11/site-packages/services/inference/device/kernels/_build

# ---- runtime: no compiler, non-root ------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime-base
RUN groupadd --system --gid 10001 zeroqueue \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/zeroqueue \
      --shell /usr/sbin/nologin zeroqueue \
 && mkdir -p /var/lib/zeroqueue /models \
 && chown 10001:10001 /var/lib/zeroqueue
COPY --from=build /opt/venv /opt/venv
# The kernel loader re-checks the build and takes a lock file in _build at start: the service user must own it.
COPY --from=build --chown=10001:10001 /opt/venv/lib/python3.11/site-packages/services/inference/device/kernels/_build \
     /opt/venv/lib/python3.11/site-packages/services/inference/device/kernels/_build
# The bundled model; mount another one under /models and pass --model /models/NAME.
COPY --from=build /opt/zeroqueue/models/ /opt/zeroqueue/models/
# TORCH_DONT_CHECK_COMPILER_ABI: the loader finds the kernels built and needs no compiler; without it torch
# warns at every start that none is installed.
ENV PATH="/opt/venv/bin:$PATH" \
    ZEROQUEUE_HOME=/var/lib/zeroqueue \
    PYTHONUNBUFFERED=1 \
    TORCH_DONT_CHECK_COMPILER_ABI=1
# The outbox (and the embedded SQLite ledger, when no --metering or --ledger is given) lives here.
VOLUME ["/var/lib/zeroqueue"]
WORKDIR /var/lib/zeroqueue
USER 10001:10001
# 50051 inference gRPC (with health), 8000 its OpenAI- and Anthropic-compatible HTTP API (--http-port), 9464
# Prometheus /metrics, 50052 metering gRPC (`zeroqueue metering`).
EXPOSE 50051 8000 9464 50052
# Warm-up and calibration answer NOT_SERVING (exit 1); the start period covers them (docs/OPERATIONS.md).
# Each check is a Python process (about 0.6 s of CPU), so only every 30 s once started: the engine's cores
# are the latency the admission controller predicts.
HEALTHCHECK --interval=30s --timeout=10s --start-period=180s --start-interval=5s --retries=3 \
  CMD ["zeroqueue", "health", "--address", "127.0.0.1:50051"]
ENTRYPOINT ["zeroqueue"]
# Migrations are their own command: `docker run ... IMAGE migrate --ledger URL` before the first serve.
CMD ["serve", "--model", "/opt/zeroqueue/models/zq-python-tiny", "--host", "0.0.0.0", "--port", "50051", \
     "--http-port", "8000", "--metrics-port", "9464"]

FROM runtime-base AS runtime-cpu

FROM runtime-base AS runtime-cuda
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# The image: runtime-cpu or runtime-cuda.
# hadolint ignore=DL3006
FROM runtime-${VARIANT} AS runtime
