#!/usr/bin/env bash
# make test: the real-node tests (make test-node) beside the cluster suite (make test-cluster), not after it.
#
# The node part is ~5-6 min warm (a cluster and a kubelet to start, the images built and loaded, 14 tests)
# and mostly waits on the kubelet and containerd; run after the cluster suite it put `make test` 3-4 min over
# issue 27's 30 minutes (docs/testing.md). It runs in the background with a run dir and port offset of its own
# (MOEGUARD_RUN_DIR-node, offset NODE_PORT_OFFSET: above the xdist workers' 0, 100, 200), its output in
# <that run dir>.log, printed once the cluster suite has ended; the exit status is the worse of the two.
# Both sub-makes skip `deps` and `node-deps` (the caller ran them once: two concurrent apt runs would fight
# over its lock).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
base=${MOEGUARD_RUN_DIR:-/tmp/moeguard-run}
node_dir=$base-node
node_offset=${NODE_PORT_OFFSET:-400}
log=$node_dir.log
mkdir -p "$(dirname "$log")"
start=$SECONDS

MOEGUARD_RUN_DIR=$node_dir MOEGUARD_PORT_OFFSET=$node_offset \
  make --no-print-directory run-test-node PYTEST_ARGS="${PYTEST_ARGS:-}" >"$log" 2>&1 &
node_pid=$!
echo "test-node: started beside test-cluster (run dir $node_dir, port offset $node_offset, log $log)"

make --no-print-directory run-test-cluster PYTEST_ARGS="${PYTEST_ARGS:-}"
cluster_rc=$?
echo "test-cluster: exit $cluster_rc after $((SECONDS - start)) s"

wait "$node_pid"
node_rc=$?
echo "=== test-node (ran beside test-cluster; exit $node_rc): $log"
cat "$log"
if [ "$node_rc" -eq 0 ]; then  # a failed node run stays up, with its logs, as `make test-node` leaves it
  MOEGUARD_RUN_DIR=$node_dir hack/node-down.sh >/dev/null 2>&1 || true
  MOEGUARD_RUN_DIR=$node_dir hack/cluster-down.sh >/dev/null 2>&1 || true
fi
echo "make test: test-cluster exit $cluster_rc, test-node exit $node_rc, $((SECONDS - start)) s in all"
[ "$cluster_rc" -eq 0 ] && [ "$node_rc" -eq 0 ]
