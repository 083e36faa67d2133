# One image for the Dagster code location and the trainer.
#   CPU (default):  docker build -t habitus .
#   GPU (CUDA 12):  docker build -t habitus-gpu \
#                     --build-arg BASE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04 \
#                     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 .
#   Kubernetes:     add --build-arg EXTRAS=k8s (dagster-k8s; docs/clusters.md); EXTRAS=k8s,snowflake, ...
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DEBIAN_FRONTEND=noninteractive \
    HABITUS_CONFIG=/app/examples/demo.yaml DAGSTER_HOME=/home/habitus/dagster

# CUDA bases come without Python: install it there (a no-op on python:3.11-slim)
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
      && rm -rf /var/lib/apt/lists/*; fi \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
# dependencies first (a layer that survives source edits), then the source
RUN pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
RUN mkdir -p pipelines assets resources models \
 && touch pipelines/__init__.py assets/__init__.py resources/__init__.py models/__init__.py \
 && pip install ".${EXTRAS:+[$EXTRAS]}" && pip uninstall -y habitus
COPY pipelines pipelines
COPY assets assets
COPY resources resources
COPY models models
COPY examples examples
COPY workspace.yaml ./
RUN pip install --no-deps .

RUN useradd --create-home --uid 10001 habitus && mkdir -p /data && chown habitus /data
USER habitus
ENV HABITUS_WORKSPACE=/data/workspace HABITUS_DEMO_WAREHOUSE=/data/demo_warehouse.duckdb
EXPOSE 4000
# the code location, served to a Dagster webserver/daemon; `habitus demo` or `dagster dev` also work
CMD ["dagster", "api", "grpc", "-h", "0.0.0.0", "-p", "4000", "-m", "pipelines.definitions"]
