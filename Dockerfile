# One image for the Dagster code location and the trainer.
#   CPU (default):  docker build -t habitus .
#   GPU (CUDA 12):  docker build -t habitus-gpu \
#                     --build-arg BASE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 \
#                     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 .
#                   (Ubuntu 24.04 brings Python 3.12; on an ubuntu22.04 base, whose python3 is 3.10, the
#                   build installs python3.11 from Ubuntu's universe; a base with neither fails the build
#                   naming its Python)
#   Kubernetes:     add --build-arg EXTRAS=k8s (dagster-k8s; docs/clusters.md); EXTRAS=k8s,snowflake, ...
#   No registry:    docker/build-local-base.sh makes a Debian bookworm base with debootstrap, and
#                   docker/build-local-image.sh builds this file FROM it with buildah (docs/guide/deploying.md):
#                   BASE=localhost/habitus-base:bookworm, TORCH_SPEC=a local CPU wheel, PIP_CERT=the CA
#                   bundle of a TLS-intercepting proxy (the build's RUN steps only; not kept in the image)
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
# unset unless given: pip's CA bundle during the build (e.g. a proxy's CA, bind-mounted into the build)
ARG PIP_CERT
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DEBIAN_FRONTEND=noninteractive \
    HABITUS_CONFIG=/app/examples/demo.yaml DAGSTER_HOME=/home/habitus/dagster

# CUDA bases come without Python, or with one older than 3.11 (ubuntu22.04: 3.10): install one
# there (a no-op on python:3.11-slim), then check it before anything is built on it
RUN set -e; PY=python3; \
    if ! command -v python3 >/dev/null || ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
      apt-get update; \
      if apt-cache show python3.11-venv >/dev/null 2>&1; then \
        apt-get install -y --no-install-recommends python3.11 python3.11-venv; PY=python3.11; \
      else \
        apt-get install -y --no-install-recommends python3 python3-venv; fi; \
      rm -rf /var/lib/apt/lists/*; fi; \
    $PY -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 11) else f"this base has Python {v.major}.{v.minor}; habitus needs 3.11+ (use a base with it, e.g. nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04)")'; \
    $PY -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# dependencies first (a layer that survives source edits): pyproject's requirements and those of EXTRAS;
# then the source, installed as habitus.* (not editable). /app holds only the configs and workspace.yaml,
# so no folder there can shadow the installed package.
WORKDIR /src
RUN pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = [e for e in '${EXTRAS}'.split(',') if e]; \
print('\n'.join(p['dependencies'] + [r for e in extras for r in p['optional-dependencies'][e]]))" > requirements.txt \
 && pip install -r requirements.txt
COPY habitus habitus
COPY pipelines pipelines
COPY assets assets
COPY resources resources
COPY models models
RUN pip install --no-deps . && rm -rf /src

WORKDIR /app
COPY examples examples
COPY workspace.yaml ./

RUN useradd --create-home --uid 10001 habitus && mkdir -p /data && chown habitus /data
USER habitus
ENV HABITUS_WORKSPACE=/data/workspace HABITUS_DEMO_WAREHOUSE=/data/demo_warehouse.duckdb
# The code location, served to a Dagster webserver/daemon over gRPC; `habitus demo` or `dagster dev` also
# work. The gRPC server has no authentication: whoever reaches port 4000 can run this code location's
# jobs. It listens on HABITUS_GRPC_HOST (all of the container's interfaces by default, which a
# container needs to be reached by the webserver's); publish it only on a private network
# (`docker run -p 127.0.0.1:4000:4000`, a user-defined docker network, or on Kubernetes behind
# deploy/k8s/network-policy.yaml), never on a public address. docs/guide/deploying.md, "The code server".
ENV HABITUS_GRPC_HOST=0.0.0.0
EXPOSE 4000
CMD ["sh", "-c", "exec dagster api grpc -h \"$HABITUS_GRPC_HOST\" -p 4000 -m habitus.pipelines.definitions"]
