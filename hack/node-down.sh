#!/usr/bin/env bash
# Stop the real node of hack/node-up.sh in the run dir: the device plugin and the
# kubelet, then every pod through the CRI (crictl: containers stopped, CNI torn
# down, network namespaces removed), then containerd; unmount what is left under
# the node's folder, remove its cgroups, the bridge, the DNAT chain and the Node
# object. containerd's image store ($MOEGUARD_CACHE/node/containerd) is kept.
# Idempotent; also run by hack/cluster-down.sh before it stops the control plane.
# Usage: hack/node-down.sh
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$HERE/versions.env"
source "$HERE/lib.sh"
RUN=$(realpath -m "${MOEGUARD_RUN_DIR:-/tmp/moeguard-run}")
N=$RUN/node
SOCK=$N/containerd/containerd.sock
CRICTL=$(bin_dir node)/crictl-$CRICTL_VERSION
NODE_NAME=${MOEGUARD_NODE_NAME:-moeguard-node-0}
BRIDGE=mgnode0 CGROUP_ROOT=/moeguard-node OWNER=/run/moeguard-node.owner
log() { printf '[node-down] %s\n' "$*" >&2; }

[ -d "$N" ] || { log "no node in $RUN"; exit 0; }
stop_named() {  # SIGTERM, up to 15 s, then SIGKILL
  local name=$1 f="$RUN/pids/$1.pid" pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if ours "$pid"; then
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 75); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && { log "SIGKILL $name"; kill -KILL "$pid" 2>/dev/null || true; }
  fi
  rm -f "$f"
}

stop_named gpu-device-plugin
stop_named kubelet
if [ -S "$SOCK" ] && [ -x "$CRICTL" ] && ctr --address "$SOCK" version >/dev/null 2>&1; then
  cri=("$CRICTL" --runtime-endpoint "unix://$SOCK" --image-endpoint "unix://$SOCK" --timeout 30s)
  pods=$("${cri[@]}" pods -q 2>/dev/null || true)
  if [ -n "$pods" ]; then
    log "stopping $(echo "$pods" | wc -l) pod sandbox(es)"
    # shellcheck disable=SC2086
    "${cri[@]}" stopp $pods >/dev/null 2>&1 || true
    # shellcheck disable=SC2086
    "${cri[@]}" rmp -f $pods >/dev/null 2>&1 || true
  fi
fi
stop_named containerd
# containerd-shims outlive containerd; anything else still pointing into the node folder goes too.
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" = $$ ] && continue
  if [ -r "$d/cmdline" ] && tr '\0' ' ' <"$d/cmdline" | grep -qF "$N/"; then
    log "stopping straggler $p: $(tr '\0' ' ' <"$d/cmdline" | cut -c1-100)"
    kill -KILL "$p" 2>/dev/null || true
  fi
done
# Mounts below the node folder (the kubelet's root dir, pods' volumes, containers' rootfs), deepest first.
for m in $(awk -v n="$N/" 'index($2, n) == 1 || $2 == substr(n, 1, length(n) - 1) { print $2 }' /proc/self/mounts | sort -r); do
  umount -l "$m" 2>/dev/null || log "could not unmount $m"
done
# Cgroups (pods of a killed node may be left): deepest first.
for d in /sys/fs/cgroup/*"$CGROUP_ROOT" /sys/fs/cgroup"$CGROUP_ROOT"; do
  [ -d "$d" ] || continue
  find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || log "could not remove cgroup $d"
done
if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE" || true; fi
while iptables -t nat -D PREROUTING -i "$BRIDGE" -j MOEGUARD-NODE 2>/dev/null; do :; done
iptables -t nat -F MOEGUARD-NODE 2>/dev/null || true
iptables -t nat -X MOEGUARD-NODE 2>/dev/null || true
if [ -f "$RUN/kubeconfig" ]; then
  "$(bin_dir kubernetes)/kubectl" --kubeconfig="$RUN/kubeconfig" --request-timeout=5s \
    delete node "$NODE_NAME" --ignore-not-found >/dev/null 2>&1 || true
fi
# The device-plugin folder is fixed (/var/lib/kubelet/device-plugins): the kubelet's and the plugin's
# sockets and the kubelet's checkpoint of allocations go with the node.
rm -f /var/lib/kubelet/device-plugins/kubelet.sock /var/lib/kubelet/device-plugins/kubelet_internal_checkpoint \
  /var/lib/kubelet/device-plugins/moeguard-*.sock
[ "$(cat "$OWNER" 2>/dev/null)" = "$RUN" ] && rm -f "$OWNER"
rm -rf "$N"
log "stopped"
