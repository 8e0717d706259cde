# syntax=docker/dockerfile:1.7
# The moeguard worker (torch MoE inference server), in two variants from one file:
#   docker build -f images/worker.Dockerfile --build-arg VARIANT=cpu  -t ghcr.io/moeguard/worker:0.1.0-cpu .
#   docker build -f images/worker.Dockerfile --build-arg VARIANT=cuda -t ghcr.io/moeguard/worker:0.1.0-cuda .
# cpu installs torch from PyTorch's CPU wheel index (no CUDA libraries, ~1 GB smaller); cuda installs the
# PyPI torch of requirements.txt, whose CUDA libraries come as nvidia-* wheels, so the base needs no CUDA
# toolkit: the driver is mounted by the NVIDIA container toolkit on the GPU node.
# The base is pinned by exact tag; pin it by digest in your registry mirror for reproducible builds.
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

# --- venv: the worker's dependencies, the final image's lower layers ----------------------------------
# Its own stage, and the final stage is built FROM it: the 6-GB virtualenv is one layer chain shared by the
# build and final stages (no second copy), and a layer cache (docker's, or buildah's --layers as in
# hack/build-images.sh) reuses it whenever requirements.txt and this stage are unchanged, so a change to the
# worker's code rebuilds only the layers above it.
FROM ${PYTHON_IMAGE} AS venv
ARG VARIANT=cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
# requirements.txt under /tmp and removed after the install: this stage is the final image's base, so it keeps
# no work dir (tests/node/test_node_images.py checks the final image has none).
COPY requirements.txt /tmp/requirements.txt
# The worker's dependencies at the pins of requirements.txt; test and bench tools are left out.
WORKDIR /tmp
RUN set -eu; \
    grep -vE '^(pytest|pytest-asyncio|pytest-timeout|hypothesis|schemathesis|ruff|mypy|matplotlib|kopf|openai)==' \
      requirements.txt > worker-requirements.txt; \
    if [ "$VARIANT" = "cpu" ]; then \
      torch_pin=$(grep -E '^torch==' worker-requirements.txt); \
      grep -vE '^(torch|nvidia-[a-z0-9-]+|triton|cuda-[a-z0-9-]+)==' worker-requirements.txt > cpu.txt; \
      /opt/venv/bin/pip install --index-url "$TORCH_CPU_INDEX" "${torch_pin}+cpu"; \
      /opt/venv/bin/pip install --no-deps -r cpu.txt; \
    elif [ "$VARIANT" = "cuda" ]; then \
      /opt/venv/bin/pip install --no-deps -r worker-requirements.txt; \
    else \
      echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 1; \
    fi; \
    rm -f requirements.txt worker-requirements.txt cpu.txt

# --- build: the worker's code, its native kernel built, its bytecode compiled ---------------------------
FROM venv AS build
# g++ for the worker's own few-row expert kernel (moeguard_runtime.model.stream_kernel), built below into the
# package: the final stage has no compiler. -mavx2: the worker loads it only on a CPU with AVX2.
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "g++=4:12.2.0-3" >/dev/null \
    && rm -rf /var/lib/apt/lists/*
COPY core/moeguard_core/ /opt/app/moeguard_core/
COPY runtime/moeguard_runtime/ /opt/app/moeguard_runtime/
# PYTHONDONTWRITEBYTECODE: importing torch here writes nothing into /opt/venv, the final stage's lower layers.
RUN PYTHONPATH=/opt/app PYTHONDONTWRITEBYTECODE=1 /opt/venv/bin/python -m moeguard_runtime.model.stream_kernel --prebuild \
    && /opt/venv/bin/python -m compileall -q /opt/app

# --- final: the venv stage and the built code; no compilers, no pip cache, non-root ------------------
FROM venv
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="moeguard-worker" \
      org.opencontainers.image.source="https://github.com/moeguard/moeguard" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.moeguard.variant="${VARIANT}"
COPY --from=build /opt/app /opt/app
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/app \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    MOEGUARD_PORT=8000
WORKDIR /opt/app
USER 65532:65532
EXPOSE 8000
# The operator sets the command (python -m moeguard_runtime) and the whole configuration as env.
ENTRYPOINT ["python", "-m", "moeguard_runtime"]
