#!/usr/bin/env bash
# Start moeguard's local control plane: etcd, kube-apiserver, kube-controller-
# manager, kube-scheduler, kwok with two fake GPU nodes, the LeaderWorkerSet
# controller (lws-manager: its CRD, its webhooks on loopback), and Prometheus. All
# of it listens on 127.0.0.1 only and lives in one run dir:
#
#   ${MOEGUARD_RUN_DIR:-/tmp/moeguard-run}/
#     kubeconfig          admin (system:masters) token, insecure-skip-tls-verify
#     pki/                service-account RSA key, token file, apiserver cert-dir;
#                         pki/lws/: the CA and serving cert (SAN IP 127.0.0.1) of LWS's webhooks
#     lws/config.yaml     lws-manager's Configuration (config.lws.x-k8s.io/v1alpha1)
#     pids/<name>.pid     one per process started here (cluster-down.sh reads them)
#     logs/<name>.log     one per process
#     etcd/  prometheus/  data; prometheus/targets/*.json is the file_sd folder
#
#     cluster.env         the URLs below, for scripts and tests to source
#
# Ports: etcd 12379 (peer 12380), kube-apiserver 16443, controller-manager 16257,
# scheduler 16259, Prometheus 19090, lws-manager's webhooks 19443 (health 19444,
# no metrics); kwok serves nothing. MOEGUARD_PORT_OFFSET=N
# adds N to every port, so that a second cluster (another run dir) can run beside.
#
# Idempotent: a healthy cluster is left alone (exit 0 at once); a process that
# died is started again. Binaries come from hack/build-binaries.sh's cache.
# Usage: hack/cluster-up.sh
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$HERE/versions.env"
source "$HERE/lib.sh"

RUN=${MOEGUARD_RUN_DIR:-/tmp/moeguard-run}
off=${MOEGUARD_PORT_OFFSET:-0}
ETCD_PORT=$((12379 + off)) ETCD_PEER_PORT=$((12380 + off)) APISERVER_PORT=$((16443 + off))
KCM_PORT=$((16257 + off)) SCHED_PORT=$((16259 + off)) PROM_PORT=$((19090 + off))
LWS_WEBHOOK_PORT=$((19443 + off)) LWS_HEALTH_PORT=$((19444 + off))
K8S=$(bin_dir kubernetes) ETCD=$(bin_dir etcd)/etcd KWOK_DIR=$(bin_dir kwok) LWS_DIR=$(bin_dir lws)
PYTHON=${PYTHON:-$(cd "$HERE/.." && pwd)/.venv/bin/python}
LWS_CRD=leaderworkersets.leaderworkerset.x-k8s.io
PROMETHEUS=${PROMETHEUS:-/usr/bin/prometheus}
KUBECTL=("$K8S/kubectl" --kubeconfig="$RUN/kubeconfig" --request-timeout=5s)
NODES=(moeguard-gpu-0 moeguard-gpu-1)
T0=$(date +%s.%N)

elapsed() { awk -v t0="$T0" -v t1="$(date +%s.%N)" 'BEGIN { printf "%.1f", t1 - t0 }'; }
log() { printf '[cluster-up %6ss] %s\n' "$(elapsed)" "$*" >&2; }
die() { printf '[cluster-up %6ss] ERROR: %s\n' "$(elapsed)" "$*" >&2; exit 1; }

etcd_ok() { curl -sf --max-time 2 "http://127.0.0.1:$ETCD_PORT/health" | grep -q '"health":"true"'; }
apiserver_ok() { "${KUBECTL[@]}" get --raw /readyz >/dev/null 2>&1; }
secure_ok() { curl -skf --max-time 2 "https://127.0.0.1:$1/healthz" >/dev/null; }
prom_ok() { curl -sf --max-time 2 "http://127.0.0.1:$PROM_PORT/-/ready" >/dev/null; }
# lws-manager: its readyz, and its webhook server answering TLS with the certificate our CA signed
# (any HTTP status: "/" is no webhook, a 404) -- what the API server needs to call it.
lws_ok() {
  curl -sf --max-time 2 "http://127.0.0.1:$LWS_HEALTH_PORT/readyz" >/dev/null || return 1
  local code
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 --cacert "$RUN/pki/lws/ca.crt" \
    "https://127.0.0.1:$LWS_WEBHOOK_PORT/") || true
  [ -n "$code" ] && [ "$code" != 000 ]
}
crd_established() {
  [ "$("${KUBECTL[@]}" get crd "$1" -o jsonpath='{.status.conditions[?(@.type=="Established")].status}' 2>/dev/null)" = True ]
}
nodes_ok() {
  local ready
  ready=$("${KUBECTL[@]}" get node "${NODES[@]}" \
    -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{" "}{end}' 2>/dev/null) || return 1
  [ "$ready" = "True True " ]
}
healthy() {
  local c
  for c in etcd kube-apiserver kube-controller-manager kube-scheduler kwok prometheus lws-manager; do
    alive "$c" || return 1
  done
  etcd_ok && apiserver_ok && secure_ok "$KCM_PORT" && secure_ok "$SCHED_PORT" && nodes_ok && prom_ok && lws_ok
}

if [ -f "$RUN/kubeconfig" ] && healthy; then
  log "cluster in $RUN is already healthy (kubeconfig: $RUN/kubeconfig)"
  exit 0
fi

for b in "$ETCD" "$K8S/kube-apiserver" "$K8S/kube-controller-manager" "$K8S/kube-scheduler" \
  "$K8S/kubectl" "$KWOK_DIR/kwok" "$LWS_DIR/lws-manager" "$PROMETHEUS"; do
  [ -x "$b" ] || die "missing $b: build it with hack/build-binaries.sh (Prometheus: apt-get install prometheus)"
done


mkdir -p "$RUN"/{pki/apiserver,pki/kcm,pki/scheduler,pki/lws,lws,pids,logs,etcd,prometheus/targets,prometheus/data,workers}

# --- credentials (made once; kept with --keep-data) ---------------------------
if [ ! -f "$RUN/pki/sa.key" ]; then
  openssl genrsa -out "$RUN/pki/sa.key.tmp" 2048 2>/dev/null
  openssl rsa -in "$RUN/pki/sa.key.tmp" -pubout -out "$RUN/pki/sa.pub" 2>/dev/null
  mv "$RUN/pki/sa.key.tmp" "$RUN/pki/sa.key"
fi
if [ ! -f "$RUN/pki/tokens.csv" ]; then
  (umask 077; echo "$(openssl rand -hex 32),moeguard-admin,moeguard-admin,\"system:masters\"" >"$RUN/pki/tokens.csv")
fi
# LWS's webhooks: the API server calls https://127.0.0.1:$LWS_WEBHOOK_PORT; it trusts this CA (caBundle).
if [ ! -f "$RUN/pki/lws/tls.crt" ]; then
  (
    cd "$RUN/pki/lws"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj "/CN=moeguard-lws-webhook-ca" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -keyout tls.key.tmp -out tls.csr -subj "/CN=127.0.0.1" 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' >tls.ext
    openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -extfile tls.ext -out tls.crt.tmp 2>/dev/null
    chmod 600 ca.key tls.key.tmp
    mv tls.key.tmp tls.key && mv tls.crt.tmp tls.crt
  ) || die "openssl could not make the LWS webhook certificates in $RUN/pki/lws"
fi
TOKEN=$(cut -d, -f1 "$RUN/pki/tokens.csv")
(umask 077; cat >"$RUN/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: moeguard
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    insecure-skip-tls-verify: true
contexts:
- name: moeguard
  context: {cluster: moeguard, user: moeguard-admin, namespace: default}
current-context: moeguard
users:
- name: moeguard-admin
  user:
    token: $TOKEN
EOF
)
sed "s#@RUN_DIR@#$RUN#g" "$HERE/cluster/prometheus.yml.tmpl" >"$RUN/prometheus/prometheus.yml"
# lws-manager (sigs.k8s.io/lws/cmd): no cert rotation (our CA signed its cert), one instance (no leader
# election), webhooks and health on loopback, metrics off (they would need TokenReview-authenticated HTTPS).
cat >"$RUN/lws/config.yaml" <<EOF
apiVersion: config.lws.x-k8s.io/v1alpha1
kind: Configuration
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
webhook:
  host: 127.0.0.1
  port: $LWS_WEBHOOK_PORT
  certDir: $RUN/pki/lws
health:
  healthProbeBindAddress: 127.0.0.1:$LWS_HEALTH_PORT
metrics:
  bindAddress: "0"
EOF
cat >"$RUN/cluster.env" <<EOF
KUBECONFIG=$RUN/kubeconfig
KUBECTL=$K8S/kubectl
APISERVER_URL=https://127.0.0.1:$APISERVER_PORT
PROMETHEUS_URL=http://127.0.0.1:$PROM_PORT
ETCD_URL=http://127.0.0.1:$ETCD_PORT
LWS_WEBHOOK_URL=https://127.0.0.1:$LWS_WEBHOOK_PORT
EOF

# --- etcd, Prometheus and kube-apiserver start together --------------------------
start etcd "$ETCD" --name=moeguard --data-dir="$RUN/etcd" \
  --listen-client-urls="http://127.0.0.1:$ETCD_PORT" --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster="moeguard=http://127.0.0.1:$ETCD_PEER_PORT" \
  --auto-compaction-retention=1 --quota-backend-bytes=$((2 * 1024 * 1024 * 1024))
start prometheus "$PROMETHEUS" --config.file="$RUN/prometheus/prometheus.yml" \
  --storage.tsdb.path="$RUN/prometheus/data" --storage.tsdb.retention.time=1d \
  --web.listen-address="127.0.0.1:$PROM_PORT" --web.enable-lifecycle
start kube-apiserver "$K8S/kube-apiserver" \
  --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$APISERVER_PORT" \
  --cert-dir="$RUN/pki/apiserver" --token-auth-file="$RUN/pki/tokens.csv" \
  --authorization-mode=RBAC --allow-privileged=true \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$RUN/pki/sa.pub" --service-account-signing-key-file="$RUN/pki/sa.key" \
  --service-cluster-ip-range=10.96.0.0/16 \
  --kubelet-preferred-address-types=InternalIP,Hostname \
  --endpoint-reconciler-type=none  # Endpoints may not hold 127.0.0.1: it would log an error every 10 s
wait_for etcd 30 etcd_ok
wait_for kube-apiserver 90 apiserver_ok

# --- controllers, scheduler, kwok ---------------------------------------------
common=(--kubeconfig="$RUN/kubeconfig" --authentication-kubeconfig="$RUN/kubeconfig"
  --authorization-kubeconfig="$RUN/kubeconfig" --leader-elect=false --bind-address=127.0.0.1
  --authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics
  --authentication-skip-lookup=true)  # no client CA here: no extension-apiserver-authentication ConfigMap
start kube-controller-manager "$K8S/kube-controller-manager" "${common[@]}" \
  --secure-port="$KCM_PORT" --cert-dir="$RUN/pki/kcm" \
  --service-account-private-key-file="$RUN/pki/sa.key" --use-service-account-credentials=true \
  --root-ca-file="$RUN/pki/apiserver/apiserver.crt"
start kube-scheduler "$K8S/kube-scheduler" "${common[@]}" --secure-port="$SCHED_PORT" --cert-dir="$RUN/pki/scheduler"
# kwok's own node stages and pod-complete; kwok's pod-ready and pod-delete are replaced by
# hack/cluster/stages/: pods annotated harness.moeguard.dev/instance (taken by hack/pod_workers.py)
# get their containers' states and readiness from that harness, all others are made Ready by kwok.
stages=(node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml
  pod/fast/pod-complete.yaml)
kwok_cfg=(--config="$HERE/cluster/kwok.yaml")
for s in "${stages[@]}"; do
  [ -f "$KWOK_DIR/stage/$s" ] || die "kwok stage file $KWOK_DIR/stage/$s is missing (rebuild kwok)"
  kwok_cfg+=(--config="$KWOK_DIR/stage/$s")
done
for s in "$HERE"/cluster/stages/*.yaml; do kwok_cfg+=(--config="$s"); done
start_kwok() {
  start kwok "$KWOK_DIR/kwok" --kubeconfig="$RUN/kubeconfig" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
    --node-ip=127.0.0.1 --cidr=10.244.0.0/16 "${kwok_cfg[@]}"
}
start_kwok

# --- fake GPU nodes ---------------------------------------------------------------
# apply fetches the API server's OpenAPI schema to validate: the 5-s request timeout is too short for that on a
# loaded machine (CI of stop 36, make test's two parts side by side: "applying LWS's webhook configurations failed",
# kubectl's "...turn validation off with --validate=false"). Every apply gets 60 s, as the CRD's always had.
"${KUBECTL[@]}" --request-timeout=60s apply -f "$HERE/cluster/nodes.yaml" >/dev/null || die "kubectl apply of $HERE/cluster/nodes.yaml failed"
for n in "${NODES[@]}"; do
  gpus=$("${KUBECTL[@]}" get node "$n" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')
  if [ "$gpus" != 8 ]; then  # create dropped the status: set it through the subresource
    res='{"cpu":"64","memory":"512Gi","pods":"110","nvidia.com/gpu":"8"}'
    "${KUBECTL[@]}" patch node "$n" --subresource=status --type=merge \
      -p "{\"status\":{\"capacity\":$res,\"allocatable\":$res}}" >/dev/null
    log "patched status of node $n"
  fi
done

wait_for kube-controller-manager 60 secure_ok "$KCM_PORT"
wait_for kube-scheduler 60 secure_ok "$SCHED_PORT"

# --- LeaderWorkerSet: CRD, controller, webhooks -------------------------------------
# The CRD first (the manager's informers need the kind), server-side: it is too large for the
# last-applied annotation. One version (v1): no conversion webhook.
"${KUBECTL[@]}" --request-timeout=60s apply --server-side --force-conflicts --field-manager=moeguard-hack \
  -f "$LWS_DIR/crd/leaderworkerset.x-k8s.io_leaderworkersets.yaml" >/dev/null || die "applying the LWS CRD failed"
deadline=$(($(date +%s) + 60))
until crd_established "$LWS_CRD"; do
  [ "$(date +%s)" -lt "$deadline" ] || die "CRD $LWS_CRD not Established after 60 s"
  sleep 0.2
done
start lws-manager "$LWS_DIR/lws-manager" --config="$RUN/lws/config.yaml" --kubeconfig="$RUN/kubeconfig"
wait_for lws-manager 60 lws_ok
# Its webhooks (failurePolicy Fail; the pod ones only for pods labelled leaderworkerset.sigs.k8s.io/name)
# after it serves them: the pod webhook injects LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX.
"$PYTHON" "$HERE/lws_webhooks.py" "$LWS_DIR/webhook" "$LWS_WEBHOOK_PORT" "$RUN/pki/lws/ca.crt" |
  "${KUBECTL[@]}" --request-timeout=60s apply --server-side --force-conflicts --field-manager=moeguard-hack -f - \
  >/dev/null || die "applying LWS's webhook configurations failed"
# A kwok that outlived an API server outage can sit on stale watches for minutes while the node controller
# has marked its nodes NotReady (their Leases lapsed during the outage; kwok's heartbeat stage only acts on
# Ready nodes): seen once in seven runs of the outage e2e test, nodes Ready only 75 s after the return.
# Restart it once before giving up.
nodes_ready_within() {
  local deadline=$(($(date +%s) + $1))
  until nodes_ok; do [ "$(date +%s)" -lt "$deadline" ] || return 1; sleep 0.2; done
}
if ! nodes_ready_within 30; then
  log "nodes not Ready after 30 s: restarting kwok (stale watches after an API server outage?)"
  if alive kwok; then
    kill -KILL "$(cat "$RUN/pids/kwok.pid")" 2>/dev/null || true
    for _ in $(seq 1 100); do alive kwok || break; sleep 0.1; done
  fi
  start_kwok
fi
wait_for kwok 60 nodes_ok
wait_for prometheus 60 prom_ok
log "cluster ready in $(elapsed)s: export KUBECONFIG=$RUN/kubeconfig; kubectl: $K8S/kubectl; Prometheus: http://127.0.0.1:$PROM_PORT; LWS webhooks: https://127.0.0.1:$LWS_WEBHOOK_PORT"
