"""Two operator replicas with kopf peering: one works, the other stands by and takes over."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from harness import stack
from tests.integration.conftest import Cluster
from tests.integration.e2e.helpers import moeis, wait

PEERING = "moeguard-peering-test"
DEADLINE_SECONDS = 120
"""Generous: each wait ends as soon as the state is there."""


def _peering(cluster: Cluster, namespace: str) -> None:
    """kopf's peering CRDs (as the chart renders them) and a KopfPeering in ``namespace``."""
    rendered = subprocess.run(
        ["helm", "template", "moeguard", str(stack.ROOT / "charts" / "moeguard"), "--kube-version", "1.34.4",
         "--set", "operator.peering.enabled=true", "--show-only", "templates/crds/kopf-peerings.yaml"],
        env=stack.tools_env(cluster.run_dir), check=True, capture_output=True, text=True).stdout
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=rendered)
    stack.wait_established("kopfpeerings.kopf.dev", run_dir=cluster.run_dir)
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING}}))


def _standing_by(cluster: Cluster, namespace: str, log: Path) -> bool:
    """Both replicas are in the peering object, and the low one has not resumed since: kopf starts
    every replica paused and resumes it only while no live peer has a higher priority."""
    status = cluster.kubectl_json("-n", namespace, "get", "kopfpeering", PEERING).get("status") or {}
    priorities = sorted(peer.get("priority") for peer in status.values())
    text = log.read_text() if log.exists() else ""
    return priorities == [10, 20] and text.rfind("Resuming operations") <= text.rfind("Pausing operations")


def _reconciled(log: Path, key: str) -> int:
    return log.read_text().count(f"reconciled {key} ") if log.exists() else 0


def test_active_standby_failover(cluster: Cluster, namespace: str) -> None:
    stack.apply_crds(run_dir=cluster.run_dir)
    _peering(cluster, namespace)
    logs = [cluster.run_dir / "logs" / f"operator-peer-{i}-{namespace}.log" for i in (0, 1)]
    peer = ("-n", namespace, "--peering", PEERING, "--peering-lifetime-seconds", "6", "--priority")
    low = stack.start_operator(logs[0], cluster.run_dir, args=(*peer, "10"))
    high = stack.start_operator(logs[1], cluster.run_dir, args=(*peer, "20"))
    try:
        # Wait for the state (both peers registered, the low one paused), not for a fixed time.
        wait(lambda: _standing_by(cluster, namespace, logs[0]), DEADLINE_SECONDS, "the priority-10 replica to stand by")
        cluster.kubectl("-n", namespace, "apply", "-f", "-", input=moeis("peer", replicas=0))
        key = f"{namespace}/peer"
        wait(lambda: _reconciled(logs[1], key) >= 1, DEADLINE_SECONDS, "the priority-20 replica to reconcile")
        assert _reconciled(logs[0], key) == 0, "the standby replica must not act"

        high.send_signal(signal.SIGKILL)  # no goodbye: the standby waits for the lease to lapse
        high.wait(10)
        cluster.kubectl("-n", namespace, "patch", "moeis", "peer", "--type=merge", "-p", '{"spec":{"replicas":1}}')
        wait(lambda: _reconciled(logs[0], key) >= 1, DEADLINE_SECONDS, "the standby to take over")
        dep = cluster.kubectl_json("-n", namespace, "get", "deployment", "peer-worker")
        assert dep["spec"]["replicas"] == 1
    finally:
        for proc in (low, high):
            stack.stop_process(proc)
