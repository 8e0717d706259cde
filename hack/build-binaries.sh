#!/usr/bin/env bash
# Build the local control plane's binaries from Go modules, into a cache outside
# the repository keyed by version, so that a fresh clone (CI) reuses them.
#
#   etcd                          go.etcd.io/etcd/server/v3 (wrapper module)
#   kube-apiserver, -controller-manager, -scheduler, kubectl
#                                 k8s.io/kubernetes with a replace block for its
#                                 staging modules (read from its own go.mod)
#   kwok                          sigs.k8s.io/kwok/cmd/kwok (+ its stage files)
#   helm                          helm.sh/helm/v3/cmd/helm
#   lws                           sigs.k8s.io/lws/cmd (the LeaderWorkerSet controller and its
#                                 webhooks, as lws-manager) + its CRD and webhook manifests
#   node (not in the default)     kubelet from the same k8s.io/kubernetes module, the
#                                 pause binary from its build/pause/linux/pause.c (static,
#                                 gcc), crictl (sigs.k8s.io/cri-tools) and
#                                 hack/node/gpu-device-plugin (rebuilt when its source
#                                 changes): the real node of hack/node-up.sh
#
# Usage: hack/build-binaries.sh [component...]   (default: etcd kwok helm lws kubernetes)
# Prints nothing but progress; exits non-zero on the first failure.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$HERE/versions.env"
source "$HERE/lib.sh"

export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

log() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

build_etcd() {
  local out; out=$(bin_dir etcd)
  [ -x "$out/etcd" ] && return 0
  log "etcd $ETCD_VERSION"
  mkdir -p "$WORK/etcd" "$out.tmp" && cd "$WORK/etcd"
  go mod init moeguard.local/etcdbuild >/dev/null 2>&1
  go get -tool "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >/dev/null
  go build -trimpath -o "$out.tmp/etcd" go.etcd.io/etcd/server/v3
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_kwok() {
  local out; out=$(bin_dir kwok)
  [ -x "$out/kwok" ] && return 0
  log "kwok $KWOK_VERSION"
  mkdir -p "$out.tmp"
  GOBIN="$out.tmp" go install -trimpath "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  local src; src=$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION
  mkdir -p "$out.tmp/stage"
  cp -r "$src/kustomize/stage/." "$out.tmp/stage/"
  chmod -R u+w "$out.tmp/stage"
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_helm() {
  local out; out=$(bin_dir helm)
  [ -x "$out/helm" ] && return 0
  log "helm $HELM_VERSION"
  mkdir -p "$out.tmp"
  GOBIN="$out.tmp" go install -trimpath \
    -ldflags "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_lws() {
  local out; out=$(bin_dir lws)
  [ -x "$out/lws-manager" ] && [ -f "$out/crd/leaderworkerset.x-k8s.io_leaderworkersets.yaml" ] &&
    [ -f "$out/webhook/validating-patch.yaml" ] && return 0
  log "lws $LWS_VERSION"
  # A temp module requiring the pinned version: `go install pkg@version` and `go get` first ask the
  # proxy for the module's version list (deprecation check), which proxy.golang.org refuses for lws.
  mkdir -p "$WORK/lws" "$out.tmp/crd" "$out.tmp/webhook" && cd "$WORK/lws"
  go mod init moeguard.local/lwsbuild >/dev/null 2>&1
  go mod edit -require="sigs.k8s.io/lws@$LWS_VERSION"
  go build -trimpath -ldflags "-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion=$LWS_VERSION" \
    -o "$out.tmp/lws-manager" sigs.k8s.io/lws/cmd
  local src; src=$(go env GOMODCACHE)/sigs.k8s.io/lws@$LWS_VERSION
  cp "$src/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" "$out.tmp/crd/"
  # the webhooks and the kustomize patches that narrow the pod webhooks to LWS's pods (hack/lws_webhooks.py)
  cp "$src/config/webhook/"{manifests,mutating-patch,validating-patch}.yaml "$out.tmp/webhook/"
  chmod -R u+w "$out.tmp"
  rm -rf "$out" && mv "$out.tmp" "$out"
}

# k8s_module DIR: a main module in DIR that builds k8s.io/kubernetes commands at
# $KUBERNETES_VERSION, with its staging modules at their matching tags.
k8s_module() {
  mkdir -p "$1" && cd "$1"
  go mod init moeguard.local/k8sbuild >/dev/null 2>&1
  local staging="v0.${KUBERNETES_VERSION#v1.}"
  local gomod
  gomod=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
  # Every staging module that kubernetes replaces with ./staging/... gets its matching tag.
  local mod
  for mod in $(sed -n 's#^[[:space:]]*\(k8s.io/[^[:space:]]*\) => ./staging/.*#\1#p' "$gomod"); do
    go mod edit -replace="$mod=$mod@$staging"
  done
  # godebug applies only in the main module: copy kubernetes' own.
  local gd
  gd=$(sed -n 's/^godebug[[:space:]]\+\(.*\)$/\1/p' "$gomod")
  [ -n "$gd" ] && go mod edit -godebug="$gd"
  return 0
}

# k8s_ldflags: the version stamps that `make` in kubernetes would set.
k8s_ldflags() {
  local major minor ld="" p
  major=$(echo "$KUBERNETES_VERSION" | sed 's/^v\([0-9]*\)\..*/\1/')
  minor=$(echo "$KUBERNETES_VERSION" | sed 's/^v[0-9]*\.\([0-9]*\)\..*/\1/')
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $p.gitVersion=$KUBERNETES_VERSION -X $p.gitMajor=$major -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  echo "-s -w$ld"
}

build_kubernetes() {
  local out; out=$(bin_dir kubernetes)
  [ -x "$out/kube-apiserver" ] && [ -x "$out/kubectl" ] && return 0
  log "kubernetes $KUBERNETES_VERSION (cold: tens of minutes)"
  mkdir -p "$out.tmp"
  k8s_module "$WORK/k8s"
  local cmds="kube-apiserver kube-controller-manager kube-scheduler kubectl"
  local c pkgs=""
  for c in $cmds; do pkgs="$pkgs k8s.io/kubernetes/cmd/$c@$KUBERNETES_VERSION"; done
  # shellcheck disable=SC2086
  go get -tool $pkgs >/dev/null
  local ld; ld=$(k8s_ldflags)
  for c in $cmds; do
    log "  go build $c"
    go build -trimpath -ldflags "$ld" -o "$out.tmp/$c" "k8s.io/kubernetes/cmd/$c"
  done
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_node() {
  local out; out=$(bin_dir node)
  local plugin_src="$HERE/node/gpu-device-plugin/main.go" plugin_sum
  plugin_sum=$(sha256sum "$plugin_src" | cut -c1-16)
  if [ -x "$out/kubelet" ] && [ -x "$out/pause" ] && [ -x "$out/crictl-$CRICTL_VERSION" ] && [ -x "$out/gpu-device-plugin" ] &&
    [ "$(cat "$out/gpu-device-plugin.sum" 2>/dev/null)" = "$plugin_sum" ]; then
    return 0
  fi
  log "node: kubelet, pause, crictl, gpu-device-plugin $KUBERNETES_VERSION (cold: minutes)"
  mkdir -p "$out"
  k8s_module "$WORK/k8snode"
  go get -tool "k8s.io/kubernetes/cmd/kubelet@$KUBERNETES_VERSION" >/dev/null
  if [ ! -x "$out/kubelet" ]; then
    log "  go build kubelet"
    go build -trimpath -ldflags "$(k8s_ldflags)" -o "$out/kubelet.tmp" k8s.io/kubernetes/cmd/kubelet
    mv "$out/kubelet.tmp" "$out/kubelet"
  fi
  if [ ! -x "$out/pause" ]; then  # the sandbox image's binary, from the same module's build/pause
    log "  gcc pause"
    gcc -Os -Wall -Werror -static -DVERSION="$KUBERNETES_VERSION-moeguard" -o "$out/pause.tmp" \
      "$(go env GOMODCACHE)/k8s.io/kubernetes@$KUBERNETES_VERSION/build/pause/linux/pause.c"
    strip "$out/pause.tmp" && mv "$out/pause.tmp" "$out/pause"
  fi
  if [ ! -x "$out/crictl-$CRICTL_VERSION" ]; then  # node-down stops the pods through the CRI (CNI teardown)
    log "  go install crictl $CRICTL_VERSION"
    (cd "$WORK" && GOBIN="$out" go install -trimpath "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION")
    mv "$out/crictl" "$out/crictl-$CRICTL_VERSION"
  fi
  log "  go build gpu-device-plugin"
  mkdir -p "$WORK/k8snode/gpu-device-plugin" && cp "$plugin_src" "$WORK/k8snode/gpu-device-plugin/"
  go build -trimpath -ldflags "-s -w" -o "$out/gpu-device-plugin.tmp" ./gpu-device-plugin
  mv "$out/gpu-device-plugin.tmp" "$out/gpu-device-plugin"
  echo "$plugin_sum" >"$out/gpu-device-plugin.sum"
}

want=${*:-etcd kwok helm lws kubernetes}
for c in $want; do "build_$c"; done
log "done: $(for c in $want; do bin_dir "$c"; done | tr '\n' ' ')"
