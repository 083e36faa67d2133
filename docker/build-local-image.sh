#!/bin/bash
# Build the project's CPU image with buildah (no Docker daemon) FROM the local base of
# docker/build-local-base.sh, then run `habitus demo --customers 2000` in it as the image's non-root
# user with podman. What it measured on the build machine: docs/journal/operations.md.
#
#   sudo docker/build-local-image.sh            # build localhost/habitus:cpu and run the demo
#   sudo docker/build-local-image.sh build      # build only
#   sudo docker/build-local-image.sh demo       # run the demo in the image built before
#
# The build context is `git archive` of REF (default HEAD) under $WORK, not the working tree: what
# is built is a commit. TORCH_WHEEL: a local CPU wheel of torch, bind-mounted into the build
# (buildah bud -v), for machines where download.pytorch.org cannot be reached; unset, the
# Dockerfile's default (the CPU index) is used. Logs and timings go to $WORK/*.log.
set -euo pipefail
WORK=${WORK:-/tmp/habitus-image}
BASE=${BASE:-localhost/habitus-base:bookworm}
TAG=${TAG:-localhost/habitus:cpu}
REF=${REF:-HEAD}
TORCH_WHEEL=${TORCH_WHEEL-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}
ISOLATION=${ISOLATION:-oci}      # buildah --isolation: oci | chroot | rootless
RUNTIME=${RUNTIME:-runc}         # the OCI runtime of buildah's RUN steps and of the demo (crun refused here)
# pip's CA bundle for the RUN steps (a TLS-intercepting proxy's CA lives in the host's bundle, not in
# the base's); empty: pip's own bundle
BUILD_CA=${BUILD_CA-${PIP_CERT:-}}
NETWORK=${NETWORK:-host}         # the RUN steps' network: host (the build machine's resolver), or a CNI one
CUSTOMERS=${CUSTOMERS:-2000}
REPO=$(cd "$(dirname "$0")/.." && pwd)
STEP=${1:-all}

build() {
  rm -rf "$WORK/context" && mkdir -p "$WORK/context"
  git -C "$REPO" archive "$REF" | tar -x -C "$WORK/context"
  set -- --layers --isolation "$ISOLATION" --runtime "$RUNTIME" --network "$NETWORK" --build-arg BASE="$BASE"
  if [ -n "$BUILD_CA" ]; then
    set -- "$@" -v "$BUILD_CA:/run/habitus-build-ca.crt:ro" --build-arg PIP_CERT=/run/habitus-build-ca.crt
  fi
  if [ -n "$TORCH_WHEEL" ]; then
    dir=$(dirname "$TORCH_WHEEL")
    set -- "$@" -v "$dir:/wheels:ro" --build-arg TORCH_SPEC="/wheels/$(basename "$TORCH_WHEEL")" \
      --build-arg TORCH_INDEX=https://pypi.org/simple
  fi
  start=$(date +%s)
  nice -n 10 buildah bud "$@" -t "$TAG" -f "$WORK/context/Dockerfile" "$WORK/context" 2>&1 | tee "$WORK/build.log"
  echo "build: $(( $(date +%s) - start )) s" | tee -a "$WORK/build.log"
  buildah images "$TAG" | tee -a "$WORK/build.log"
}

demo() {
  # `buildah run` on a container of the image: its own USER (habitus, uid 10001), WORKDIR, ENV and
  # workspace (/data, owned by that user), no network. (`podman run` is refused on the build machine
  # docs/journal/operations.md says why; where it works: podman run --rm --network none "$TAG" habitus demo ...)
  ctr=$(buildah from "$TAG")
  start=$(date +%s)
  nice -n 10 buildah run --runtime "$RUNTIME" --network none "$ctr" -- \
    sh -c "id; habitus demo --customers $CUSTOMERS; echo exit status \$?" 2>&1 | tee "$WORK/demo.log"
  echo "demo: $(( $(date +%s) - start )) s" | tee -a "$WORK/demo.log"
  buildah rm "$ctr" >/dev/null
}

case "$STEP" in
  build) build ;;
  demo) demo ;;
  all) build; demo ;;
  *) echo "usage: $0 [build|demo|all]" >&2; exit 2 ;;
esac
