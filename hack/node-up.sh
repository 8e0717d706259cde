#!/usr/bin/env bash
# Start one real node beside the fake ones of hack/cluster-up.sh: containerd and
# runc (Debian's), a kubelet built from the control plane's own Kubernetes module
# (hack/build-binaries.sh node) and hack/node/gpu-device-plugin, which advertises
# nvidia.com/gpu. It joins the control plane of the run dir (start that first).
#
#   ${MOEGUARD_RUN_DIR:-/tmp/moeguard-run}/
#     node/containerd/    config.toml, state, containerd.sock
#     node/kubelet/       config.yaml, kubeconfig, the kubelet's root dir (pods' volumes)
#     node/cni/net.d/     the pod network: bridge mgnode0, 10.85.0.0/24, host-local IPAM
#     node/node.env       NODE_NAME, CONTAINERD_ADDRESS, CRICTL (for scripts and tests)
#     logs/{containerd,kubelet,gpu-device-plugin}.log   pids/<same>.pid
#
# containerd's image store (root) is $MOEGUARD_CACHE/node/containerd: images loaded
# once (hack/build-images.sh --load) survive node-down and cluster-down.
#
# The node is ${MOEGUARD_NODE_NAME:-moeguard-node-0}, labelled moeguard.dev/node=real,
# tainted moeguard.dev/node=real:NoSchedule (only pods that tolerate it land there:
# the fake nodes stay the default), node IP 10.85.0.1 (the bridge's address; a
# node IP may not be loopback). The kubelet listens there on 10250+offset
# (anonymous, AlwaysAllow: port-forward and logs through the API server).
#
# No kube-proxy. Pods reach the API server at the `kubernetes` Service's
# 10.96.0.1:443 through one DNAT rule to 127.0.0.1:<apiserver port> (chain
# MOEGUARD-NODE, route_localnet on the bridge); other Services are not proxied:
# clients use `kubectl port-forward`.
#
# What this VM needed (docs/real-node.md): cgroup v1 (failCgroupV1: false,
# cgroupfs, the pods under /moeguard-node), no CAP_SYS_RESOURCE (containerd's
# restrict_oom_score_adj), no swap check, no dummy interface module.
#
# One real node per machine: the device-plugin socket folder of a kubelet is fixed
# (/var/lib/kubelet/device-plugins), so a second run dir is refused while one runs.
# Idempotent: a healthy node is left alone. Root only. Usage: hack/node-up.sh
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=versions.env
source "$HERE/versions.env"
source "$HERE/lib.sh"

RUN=$(realpath -m "${MOEGUARD_RUN_DIR:-/tmp/moeguard-run}")
off=${MOEGUARD_PORT_OFFSET:-0}
APISERVER_PORT=$((16443 + off)) KUBELET_PORT=$((10250 + off)) KUBELET_HEALTHZ_PORT=$((10248 + off))
NODE_NAME=${MOEGUARD_NODE_NAME:-moeguard-node-0}
GPUS=${MOEGUARD_NODE_GPUS:-8}
NODE_BIN=$(bin_dir node)
K8S=$(bin_dir kubernetes)
CRICTL=$NODE_BIN/crictl-$CRICTL_VERSION
N=$RUN/node
CTRD_ROOT=$MOEGUARD_CACHE/node/containerd
SOCK=$N/containerd/containerd.sock
BRIDGE=mgnode0 NODE_IP=10.85.0.1 POD_SUBNET=10.85.0.0/24 SERVICE_IP=10.96.0.1
CGROUP_ROOT=/moeguard-node
DP_DIR=/var/lib/kubelet/device-plugins
OWNER=/run/moeguard-node.owner
KUBECTL=("$K8S/kubectl" --kubeconfig="$RUN/kubeconfig" --request-timeout=10s)
T0=$(date +%s.%N)

elapsed() { awk -v t0="$T0" -v t1="$(date +%s.%N)" 'BEGIN { printf "%.1f", t1 - t0 }'; }
log() { printf '[node-up %6ss] %s\n' "$(elapsed)" "$*" >&2; }
die() { printf '[node-up %6ss] ERROR: %s\n' "$(elapsed)" "$*" >&2; exit 1; }

# alive, start, wait_for: hack/lib.sh

containerd_ok() { ctr --address "$SOCK" version >/dev/null 2>&1; }
kubelet_ok() { curl -sf --max-time 2 "http://127.0.0.1:$KUBELET_HEALTHZ_PORT/healthz" >/dev/null; }
node_ready() {
  [ "$("${KUBECTL[@]}" get node "$NODE_NAME" \
    -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}
gpus_ok() {
  [ "$("${KUBECTL[@]}" get node "$NODE_NAME" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}' 2>/dev/null)" = "$GPUS" ]
}
healthy() {
  local c
  for c in containerd kubelet gpu-device-plugin; do alive "$c" || return 1; done
  containerd_ok && kubelet_ok && node_ready && gpus_ok
}

[ "$(id -u)" = 0 ] || die "the real node needs root (containerd, runc, cgroups, the pod network)"
[ -f "$RUN/kubeconfig" ] && "${KUBECTL[@]}" get --raw /readyz >/dev/null 2>&1 ||
  die "no healthy control plane in $RUN: run hack/cluster-up.sh (or NODE=1 make cluster-up) first"
if [ -f "$OWNER" ] && [ "$(cat "$OWNER")" != "$RUN" ] &&
  MOEGUARD_RUN_DIR=$(cat "$OWNER") bash -c '[ -f "$MOEGUARD_RUN_DIR/pids/kubelet.pid" ] && kill -0 "$(cat "$MOEGUARD_RUN_DIR/pids/kubelet.pid")"' 2>/dev/null; then
  die "a real node of $(cat "$OWNER") runs on this machine (one per machine): stop it with MOEGUARD_RUN_DIR=$(cat "$OWNER") hack/node-down.sh"
fi
if [ -f "$OWNER" ] && [ "$(cat "$OWNER")" != "$RUN" ]; then
  # A node of another run dir that is not running (killed, say, with the session that started it):
  # its mounts, cgroups and stragglers go before this one starts (node-down is idempotent).
  log "cleaning up after the stopped node of $(cat "$OWNER")"
  MOEGUARD_RUN_DIR=$(cat "$OWNER") "$HERE/node-down.sh" || log "node-down of $(cat "$OWNER") failed: going on"
  rm -f "$OWNER"
fi
if healthy; then
  log "node $NODE_NAME of $RUN is already healthy"
  exit 0
fi
for b in containerd runc ctr iptables; do command -v "$b" >/dev/null || die "missing $b: run hack/install-node-deps.sh"; done
[ -x /usr/lib/cni/bridge ] || die "missing /usr/lib/cni/bridge: run hack/install-node-deps.sh"
for b in "$NODE_BIN/kubelet" "$NODE_BIN/gpu-device-plugin" "$CRICTL"; do
  [ -x "$b" ] || die "missing $b: run hack/build-binaries.sh node"
done
echo "$RUN" >"$OWNER"
mkdir -p "$N"/{containerd/state,kubelet/root,cni/net.d} "$RUN"/{pids,logs} "$CTRD_ROOT" "$DP_DIR"

# --- cgroups: the kubelet's cgroupRoot must exist in every hierarchy -------------------------
cgroup_v1=false
if [ -d /sys/fs/cgroup/memory ]; then
  cgroup_v1=true
  for d in /sys/fs/cgroup/*/; do
    case "$d" in */unified/) continue ;; esac
    [ -f "$d/cgroup.procs" ] || continue
    mkdir -p "$d${CGROUP_ROOT#/}"
  done
  c=/sys/fs/cgroup/cpuset${CGROUP_ROOT}  # a v1 cpuset child starts empty
  [ -n "$(cat "$c/cpuset.cpus")" ] || cat /sys/fs/cgroup/cpuset/cpuset.cpus >"$c/cpuset.cpus"
  [ -n "$(cat "$c/cpuset.mems")" ] || cat /sys/fs/cgroup/cpuset/cpuset.mems >"$c/cpuset.mems"
else
  mkdir -p "/sys/fs/cgroup${CGROUP_ROOT}"
fi

# --- the pod network --------------------------------------------------------------------------
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
  ip link add "$BRIDGE" type bridge
fi
ip addr show dev "$BRIDGE" | grep -qF " $NODE_IP/" || ip addr add "$NODE_IP/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
sysctl -qw net.ipv4.ip_forward=1 "net.ipv4.conf.$BRIDGE.route_localnet=1"
iptables -t nat -N MOEGUARD-NODE 2>/dev/null || iptables -t nat -F MOEGUARD-NODE
iptables -t nat -A MOEGUARD-NODE -d "$SERVICE_IP/32" -p tcp --dport 443 \
  -j DNAT --to-destination "127.0.0.1:$APISERVER_PORT"
iptables -t nat -C PREROUTING -i "$BRIDGE" -j MOEGUARD-NODE 2>/dev/null ||
  iptables -t nat -I PREROUTING -i "$BRIDGE" -j MOEGUARD-NODE
cat >"$N/cni/net.d/10-moeguard.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "moeguard-node",
  "plugins": [
    {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_SUBNET", "gateway": "$NODE_IP"}]],
              "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$N/cni/ipam"}},
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "loopback"}
  ]
}
EOF

# --- containerd -------------------------------------------------------------------------------
cat >"$N/containerd/config.toml" <<EOF
version = 2
root = "$CTRD_ROOT"
state = "$N/containerd/state"
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
[debug]
  address = "$N/containerd/debug.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/moeguard/pause:$KUBERNETES_VERSION"
  enable_unprivileged_ports = true
  # This VM gives root no CAP_SYS_RESOURCE: runc may not lower oom_score_adj below containerd's own
  # (the kubelet asks -997 for Guaranteed pods), so containerd clamps it to its own score.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$N/cni/net.d"
EOF
start containerd containerd --config "$N/containerd/config.toml"
wait_for containerd 30 containerd_ok
cat >"$N/node.env" <<EOF
NODE_NAME=$NODE_NAME
CONTAINERD_ADDRESS=$SOCK
CRICTL=$CRICTL
CONTAINER_RUNTIME_ENDPOINT=unix://$SOCK
EOF
# The sandbox image and any image already built (hack/build-images.sh caches them).
"$HERE/build-images.sh" --load pause >&2

# --- the kubelet's credentials: a ServiceAccount bound to system:node -------------------------
# (cluster-up's API server has no client CA; its token file is read once at start)
"${KUBECTL[@]}" apply -f - >/dev/null <<EOF
apiVersion: v1
kind: ServiceAccount
metadata: {name: moeguard-node, namespace: kube-system}
---
apiVersion: v1
kind: Secret
metadata:
  name: moeguard-node-token
  namespace: kube-system
  annotations: {kubernetes.io/service-account.name: moeguard-node}
type: kubernetes.io/service-account-token
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: moeguard-node}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: system:node}
subjects:
- {kind: ServiceAccount, name: moeguard-node, namespace: kube-system}
EOF
token=""
for _ in $(seq 1 50); do
  token=$("${KUBECTL[@]}" -n kube-system get secret moeguard-node-token -o jsonpath='{.data.token}' | base64 -d)
  [ -n "$token" ] && break
  sleep 0.2
done
[ -n "$token" ] || die "the token controller did not fill kube-system/moeguard-node-token"
(umask 077; cat >"$N/kubelet/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: moeguard
  cluster: {server: "https://127.0.0.1:$APISERVER_PORT", certificate-authority: "$RUN/pki/apiserver/apiserver.crt"}
contexts:
- name: node
  context: {cluster: moeguard, user: node}
current-context: node
users:
- name: node
  user: {token: "$token"}
EOF
)
cat >"$N/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false          # cgroup v1 here: the kubelet only warns (dropped on a cgroup v2 host)
cgroupDriver: cgroupfs       # no systemd
cgroupRoot: $CGROUP_ROOT
cgroupsPerQOS: true
enforceNodeAllocatable: [pods]
failSwapOn: false
containerRuntimeEndpoint: unix://$SOCK
address: $NODE_IP
port: $KUBELET_PORT
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
readOnlyPort: 0
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
podCIDR: $POD_SUBNET
maxPods: 30
resolvConf: ""
registerNode: true
registerWithTaints:
- {key: moeguard.dev/node, value: real, effect: NoSchedule}
serializeImagePulls: false
imageMinimumGCAge: 87600h
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
containerLogMaxSize: 10Mi
shutdownGracePeriod: 0s
EOF
$cgroup_v1 || sed -i '/^failCgroupV1:/d' "$N/kubelet/config.yaml"
start kubelet "$NODE_BIN/kubelet" --config="$N/kubelet/config.yaml" --kubeconfig="$N/kubelet/kubeconfig" \
  --root-dir="$N/kubelet/root" --cert-dir="$N/kubelet/pki" --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" \
  --node-labels="moeguard.dev/node=real,nvidia.com/gpu.present=true" --v=1
wait_for kubelet 60 kubelet_ok
wait_for kubelet 60 node_ready
start gpu-device-plugin "$NODE_BIN/gpu-device-plugin" --resource=nvidia.com/gpu --count="$GPUS" \
  --socket-dir="$DP_DIR/" -- "$RUN/"  # (the run dir: an ignored argument that marks the process as ours)
wait_for gpu-device-plugin 30 gpus_ok
log "node $NODE_NAME ready in $(elapsed)s ($GPUS nvidia.com/gpu, taint moeguard.dev/node=real:NoSchedule); kubelet log: $RUN/logs/kubelet.log"
