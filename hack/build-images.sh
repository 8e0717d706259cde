#!/usr/bin/env bash
# Build moeguard's images on this machine with buildah (daemonless; Debian's), and
# optionally load them into the real node's containerd (hack/node-up.sh).
#
#   base      localhost/moeguard/python-base:bookworm-<key>   Debian bookworm's python3 (3.11),
#             made with mmdebstrap from Debian's packages: the local stand-in for the published
#             builds' PYTHON_IMAGE (python:3.11.7-slim-bookworm), which no registry here serves
#   operator  localhost/moeguard/operator:<key>   images/operator.Dockerfile, PYTHON_IMAGE=the base
#   worker    localhost/moeguard/worker:<key>     images/worker.Dockerfile, PYTHON_IMAGE=the base,
#             VARIANT=$MOEGUARD_WORKER_VARIANT (default cuda: PyTorch's CPU wheel index is not
#             reachable from this machine, PyPI is; the CUDA torch runs on the CPU)
#   pause     localhost/moeguard/pause:<KUBERNETES_VERSION>   the sandbox image of the node, from
#             the pause binary that hack/build-binaries.sh node compiles from the Kubernetes module
#
# <key> is a hash of every input (Dockerfile, requirements.txt, the copied sources, the base's image
# id, the variant): an image whose key exists is not built again, so a second run takes seconds.
# A changed key is built with buildah's layer cache (--layers): the steps before the first changed input
# are reused, so a change to the worker's code rebuilds its small top layers, not the 6-GB virtualenv
# (the worker Dockerfile's venv stage, which the final image is built FROM: one copy). The cached
# intermediate images are dropped (buildah rmi --prune) when what the cache's lower layers come from
# changes (Dockerfile, requirements.txt, base, variant), before that build.
# Everything else in the Dockerfiles is what the published build runs; the build only mounts this
# machine's CA bundle and a pip.conf naming it (RUN steps reach PyPI through a TLS-intercepting egress
# proxy here); mounts are not part of the image.
#
# --load: also import each image into containerd's k8s.io namespace (CONTAINERD_ADDRESS, default the
# run dir's node socket) unless it is there, and drop that repository's other local tags there and in
# buildah's store, and in containerd the id names (sha256:...) no tag points to any more (disk: a
# worker image is ~6 GB).
# Prints NAME=REF per image on stdout. Usage: hack/build-images.sh [--load] [base|operator|worker|pause]...
set -euo pipefail
# A failed build inside ref=$(build_app ...) must stop the script, not print a ref that does not exist.
shopt -s inherit_errexit
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=versions.env
source "$HERE/versions.env"
source "$HERE/lib.sh"

RUN=$(realpath -m "${MOEGUARD_RUN_DIR:-/tmp/moeguard-run}")
SOCK=${CONTAINERD_ADDRESS:-$RUN/node/containerd/containerd.sock}
IMG_CACHE=$MOEGUARD_CACHE/images
WORKER_VARIANT=${MOEGUARD_WORKER_VARIANT:-cuda}
BASE_SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,python-is-python3,ca-certificates
T0=$(date +%s.%N)
elapsed() { awk -v t0="$T0" -v t1="$(date +%s.%N)" 'BEGIN { printf "%.1f", t1 - t0 }'; }
log() { printf '[build-images %6ss] %s\n' "$(elapsed)" "$*" >&2; }
die() { printf '[build-images %6ss] ERROR: %s\n' "$(elapsed)" "$*" >&2; exit 1; }

load=0 names=()
for a in "$@"; do
  case "$a" in
    --load) load=1 ;;
    base|operator|worker|pause) names+=("$a") ;;
    *) echo "usage: $0 [--load] [base|operator|worker|pause]..." >&2; exit 2 ;;
  esac
done
[ ${#names[@]} -gt 0 ] || names=(operator worker)
command -v buildah >/dev/null || die "missing buildah: run hack/install-node-deps.sh"
mkdir -p "$IMG_CACHE"
WORK=$(mktemp -d "$IMG_CACHE/work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# key ITEM...: a short hash of strings and of files' paths and contents (folders: every file below,
# bytecode left out).
key() {
  local item f
  for item in "$@"; do
    if [ -e "$ROOT/$item" ]; then
      find "$ROOT/$item" -type f -not -name '*.pyc' -not -path '*/__pycache__/*' | LC_ALL=C sort |
        while read -r f; do printf '%s ' "${f#"$ROOT"/}"; sha256sum <"$f"; done
    else
      printf '%s\n' "$item"
    fi
  done | sha256sum | cut -c1-16
}
in_buildah() { buildah inspect --type image "$1" >/dev/null 2>&1; }
in_containerd() { ctr --address "$SOCK" -n k8s.io images ls -q "name==$1" 2>/dev/null | grep -qxF "$1"; }

# load REF: into containerd's k8s.io namespace, through an uncompressed OCI archive.
load() {
  local ref=$1 repo=${1%:*} old
  ctr --address "$SOCK" version >/dev/null 2>&1 || die "no containerd at $SOCK: run hack/node-up.sh first"
  if ! in_containerd "$ref"; then
    log "loading $ref into containerd"
    buildah push -q --disable-compression "$ref" "oci-archive:$WORK/image.tar:$ref" >/dev/null
    ctr --address "$SOCK" -n k8s.io images import "$WORK/image.tar" >/dev/null
    rm -f "$WORK/image.tar"
  fi
  for old in $(ctr --address "$SOCK" -n k8s.io images ls -q | grep "^$repo:" | grep -vxF "$ref" || true); do
    log "dropping $old from containerd"
    ctr --address "$SOCK" -n k8s.io images rm "$old" >/dev/null || true
  done
  drop_orphan_ids
}
# drop_orphan_ids: the CRI plugin names every image it has seen by its id too (sha256:<config digest>);
# that name outlives the tag dropped above and keeps the old image's layers (~6 GB for a worker) in
# the store. Drop each id name whose manifest no tag points to; --sync: the space is freed on return.
drop_orphan_ids() {
  local listing tagged id
  listing=$(ctr --address "$SOCK" -n k8s.io images ls) || return 0
  tagged=$(awk 'NR > 1 && $1 !~ /^sha256:/ { print $3 }' <<<"$listing")
  for id in $(awk 'NR > 1 && $1 ~ /^sha256:/ { print $1 " " $3 }' <<<"$listing" |
              while read -r name digest; do grep -qxF "$digest" <<<"$tagged" || echo "$name"; done); do
    log "dropping $id (no tag left) from containerd"
    ctr --address "$SOCK" -n k8s.io images rm --sync "$id" >/dev/null || true
  done
}
prune_buildah() {  # prune_buildah REF: the repository's other tags in buildah's store
  local ref=$1 repo=${1%:*} old
  for old in $(buildah images --format '{{.Name}}:{{.Tag}}' 2>/dev/null | grep "^$repo:" | grep -vxF "$ref" || true); do
    log "dropping $old from buildah's store"
    buildah rmi "$old" >/dev/null 2>&1 || true
  done
}

build_base() {
  local k ref tar
  k=$(key "$BASE_SUITE" "$BASE_PACKAGES" "mmdebstrap --variant=apt")
  ref=localhost/moeguard/python-base:$BASE_SUITE-$k
  if ! in_buildah "$ref"; then
    command -v mmdebstrap >/dev/null || die "missing mmdebstrap: run hack/install-node-deps.sh"
    tar=$IMG_CACHE/python-base-$BASE_SUITE-$k.tar
    if [ ! -f "$tar" ]; then
      log "mmdebstrap $BASE_SUITE ($BASE_PACKAGES)"
      # --format=tar: mmdebstrap picks the format from the target's name otherwise, and "*.tar.tmp" made a
      # directory (a cold build then failed at ln); remove what such a run left.
      rm -rf "$tar" "$tar.tmp"
      mmdebstrap --quiet --format=tar --variant=apt --include="$BASE_PACKAGES" --components=main "$BASE_SUITE" "$tar.tmp" \
        "deb http://deb.debian.org/debian $BASE_SUITE main" \
        "deb http://deb.debian.org/debian $BASE_SUITE-updates main" \
        "deb http://deb.debian.org/debian-security $BASE_SUITE-security main" >&2
      mv "$tar.tmp" "$tar"
    fi
    mkdir -p "$WORK/base" && ln -f "$tar" "$WORK/base/rootfs.tar"
    printf '%s\n' 'FROM scratch' 'ADD rootfs.tar /' 'ENV LANG=C.UTF-8' 'CMD ["python3"]' >"$WORK/base/Containerfile"
    log "buildah: $ref"
    buildah bud -q -f "$WORK/base/Containerfile" -t "$ref" "$WORK/base" >/dev/null
    prune_buildah "$ref"
  fi
  echo "$ref"
}

build_pause() {
  local ref=localhost/moeguard/pause:$KUBERNETES_VERSION bin
  bin=$(bin_dir node)/pause
  if ! in_buildah "$ref"; then
    [ -x "$bin" ] || die "missing $bin: run hack/build-binaries.sh node"
    mkdir -p "$WORK/pause" && cp "$bin" "$WORK/pause/pause"
    printf '%s\n' 'FROM scratch' 'COPY pause /pause' 'USER 65535:65535' 'ENTRYPOINT ["/pause"]' >"$WORK/pause/Containerfile"
    log "buildah: $ref"
    buildah bud -q -f "$WORK/pause/Containerfile" -t "$ref" "$WORK/pause" >/dev/null
  fi
  echo "$ref"
}

# build_app NAME VARIANT SOURCES...: images/NAME.Dockerfile on the local base.
build_app() {
  local name=$1 variant=$2; shift 2
  local base base_id k ref lower stamp args=()
  base=$(build_base)
  base_id=$(buildah inspect --type image -f '{{.FromImageID}}' "$base")
  k=$(key "images/$name.Dockerfile" requirements.txt "$@" "$base_id" "variant=$variant")
  ref=localhost/moeguard/$name:$k
  if ! in_buildah "$ref"; then
    [ -n "$variant" ] && args+=(--build-arg "VARIANT=$variant")
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$WORK/pip.conf"
    lower=$(key "images/$name.Dockerfile" requirements.txt "$base_id" "variant=$variant")
    stamp=$IMG_CACHE/$name.layers
    if [ "$(cat "$stamp" 2>/dev/null)" != "$lower" ]; then
      log "dropping buildah's cached intermediate images (images/$name.Dockerfile, requirements.txt, base or variant changed)"
      buildah rmi --prune >/dev/null 2>&1 || true
    fi
    log "buildah: $ref (images/$name.Dockerfile${variant:+, VARIANT=$variant}; layers cached; cold: minutes)"
    buildah bud --layers --pull=false --network host -f "$ROOT/images/$name.Dockerfile" -t "$ref" \
      --build-arg "PYTHON_IMAGE=$base" "${args[@]}" \
      --volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
      --volume "$WORK/pip.conf:/etc/pip.conf:ro" "$ROOT" >&2
    echo "$lower" >"$stamp"
    prune_buildah "$ref"
  fi
  echo "$ref"
}

for n in "${names[@]}"; do
  case "$n" in
    base) ref=$(build_base) ;;
    pause) ref=$(build_pause) ;;
    operator) ref=$(build_app operator "" operator/moeguard_operator core/moeguard_core) ;;
    worker) ref=$(build_app worker "$WORKER_VARIANT" runtime/moeguard_runtime core/moeguard_core) ;;
  esac
  [ "$load" = 1 ] && [ "$n" != base ] && load "$ref"
  echo "$n=$ref"
done
log "done"
