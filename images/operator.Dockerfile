# syntax=docker/dockerfile:1.7
# The moeguard operator (kopf). Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/moeguard/operator:0.1.0 .
# The base is pinned by exact tag; pin it by digest in your registry mirror for reproducible builds
# (PYTHON_IMAGE=python:3.11.7-slim-bookworm@sha256:...).
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

# --- build: a virtualenv with the operator's dependencies at the pins of requirements.txt ----------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/venv
COPY requirements.txt ./
# Only the operator's direct dependencies; requirements.txt constrains every version (no torch here).
RUN /opt/venv/bin/pip install --constraint requirements.txt \
      kopf kubernetes pydantic prometheus-client prometheus-api-client pyyaml httpx
COPY operator/moeguard_operator/ /opt/app/moeguard_operator/
# The operator imports only the torch-free layer it shares with the worker: the contract, the model presets,
# the memory model and admission, the UCX rules (core/moeguard_core, copied whole).
COPY core/moeguard_core/ /opt/app/moeguard_core/
RUN /opt/venv/bin/python -m compileall -q /opt/app

# --- final: no compilers, no pip cache, non-root -------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="moeguard-operator" \
      org.opencontainers.image.source="https://github.com/moeguard/moeguard" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/app /opt/app
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/app \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /opt/app
USER 65532:65532
EXPOSE 8080 8081
# The chart sets command and args (python -m moeguard_operator --namespace ... --liveness ...).
ENTRYPOINT ["python", "-m", "moeguard_operator"]
CMD ["--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz"]
