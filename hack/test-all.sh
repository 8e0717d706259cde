#!/usr/bin/env bash
# make test: the cluster suite (make test-cluster), then the real-node tests (make test-node), each timed.
#
# Sequential on purpose. Run beside the cluster suite (own run dir and port offset), the node part saved
# ~4 min of wall time but overloaded the 2-core machine: its kubelet, containerd and image builds slowed the
# three xdist workers' control planes until `kubectl apply` timed out fetching the OpenAPI schema, and the
# node tests took 8-12 min instead of ~4 (two CI runs of 2026-12-04: 1,670 s with 3 failures, 2,462 s with 4,
# every one a timeout under load). One after the other, the clean-clone runs of c805a8e took 1,679 s and
# 1,700 s warm, both green (docs/testing.md).
# Both sub-makes skip `deps` and `node-deps` (the caller ran them once).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS

make --no-print-directory run-test-cluster PYTEST_ARGS="${PYTEST_ARGS:-}"
cluster_rc=$?
cluster_s=$((SECONDS - start))
echo "test-cluster: exit $cluster_rc after $cluster_s s"

make --no-print-directory run-test-node PYTEST_ARGS="${PYTEST_ARGS:-}"
node_rc=$?
echo "test-node: exit $node_rc after $((SECONDS - start - cluster_s)) s"
echo "make test: test-cluster exit $cluster_rc ($cluster_s s), test-node exit $node_rc, $((SECONDS - start)) s in all"
[ "$cluster_rc" -eq 0 ] && [ "$node_rc" -eq 0 ]
