"""hack/pod_workers.py gives each Running worker pod a local process, a token and a scrape target.

Runs the harness with the stand-in worker in this folder (the real
``moeguard_runtime`` is not needed here), as its own instance limited to the
test's namespace and to pods labelled as stand-ins.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from tests.integration.conftest import PodWorkers

if TYPE_CHECKING:
    from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

STANDIN = Path(__file__).with_name("standin_worker.py")
SELECTOR = ("app.kubernetes.io/managed-by=moeguard,app.kubernetes.io/component=worker,"
            "harness.moeguard.dev/stand-in=true")

MANIFESTS = """
apiVersion: v1
kind: ServiceAccount
metadata: {name: worker}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: svc-budget}
data: {budget.json: "{}"}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: worker-budget}
rules:
- {apiGroups: [""], resources: [configmaps], resourceNames: [svc-budget], verbs: [get, watch, list]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: worker-budget}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: worker-budget}
subjects: [{kind: ServiceAccount, name: worker}]
---
apiVersion: v1
kind: Pod
metadata:
  name: svc-worker-0
  labels:
    app.kubernetes.io/managed-by: moeguard
    app.kubernetes.io/component: worker
    app.kubernetes.io/instance: svc
    harness.moeguard.dev/stand-in: "true"
spec:
  serviceAccountName: worker
  containers:
  - name: worker
    image: registry.invalid/moeguard-worker:0
    resources:
      limits: {nvidia.com/gpu: "1", memory: 2Gi}
    env:
    - {name: MOEGUARD_SERVICE_NAME, value: svc}
    - {name: MOEGUARD_BUDGET_CONFIGMAP, value: svc-budget}
    - {name: MOEGUARD_PORT, value: "8000"}
    - name: MOEGUARD_POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: MOEGUARD_NAMESPACE
      valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
    - name: MOEGUARD_POD_IP
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
    - name: MOEGUARD_HARD_LIMIT_BYTES
      valueFrom: {resourceFieldRef: {containerName: worker, resource: limits.memory}}
"""


@pytest.fixture
def standin_workers(cluster: Cluster, namespace: str) -> Iterator[PodWorkers]:
    pw = PodWorkers(cluster.run_dir, instance="standin", extra_args=[
        "--namespace", namespace, "--selector", SELECTOR,
        "--worker-cmd", f"{{python}} {STANDIN}"])
    pw.start()
    yield pw
    pw.stop()


def wait(what: str, check: Any, timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_worker_process_env_token_and_scrape(cluster: Cluster, namespace: str,
                                             standin_workers: PodWorkers) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=MANIFESTS)
    key = f"{namespace}/svc-worker-0"
    info = standin_workers.wait_for(key)
    assert info["url"] == f"http://127.0.0.1:{info['port']}" and info["moeis"] == "svc"
    assert info["port"] != 8000, "MOEGUARD_PORT is overridden with a free port"

    env = wait("the worker's /env", lambda: _get_json(f"{info['url']}/env"))
    pod = cluster.kubectl_json("-n", namespace, "get", "pod", "svc-worker-0")
    assert env["MOEGUARD_PORT"] == str(info["port"])
    assert env["MOEGUARD_SERVICE_NAME"] == "svc"
    assert env["MOEGUARD_POD_NAME"] == "svc-worker-0"
    assert env["MOEGUARD_NAMESPACE"] == namespace
    assert env["MOEGUARD_POD_IP"] == pod["status"]["podIP"]
    assert env["MOEGUARD_HARD_LIMIT_BYTES"] == str(2 * 1024**3)

    # The worker's kubeconfig carries a token of the pod's ServiceAccount: RBAC applies.
    kubeconfig = Path(env["KUBECONFIG"])
    assert kubeconfig.parent == cluster.run_dir / "workers"
    as_pod = [str(cluster.kubectl_bin), f"--kubeconfig={kubeconfig}", "-n", namespace]
    who = json.loads(subprocess.run([*as_pod, "auth", "whoami", "-o", "json"], check=True,
                                    capture_output=True, text=True).stdout)
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:worker"
    assert subprocess.run([*as_pod, "get", "configmap", "svc-budget"], capture_output=True).returncode == 0
    denied = subprocess.run([*as_pod, "get", "pods"], capture_output=True, text=True)
    assert denied.returncode != 0 and "forbidden" in denied.stderr

    # Prometheus scrapes the file_sd target the harness wrote.
    target = cluster.run_dir / "prometheus" / "targets" / f"{namespace}_svc-worker-0.json"
    assert json.loads(target.read_text())[0]["targets"] == [f"127.0.0.1:{info['port']}"]
    query = f'up{{job="moeguard-workers",namespace="{namespace}",pod="svc-worker-0",moeis="svc"}}'
    series = wait("up == 1 in Prometheus", lambda: [
        s for s in cluster.prometheus_query(query) if s["value"][1] == "1"], timeout=15)
    assert series[0]["metric"]["instance"] == f"127.0.0.1:{info['port']}"

    # Deleting the pod stops the worker and removes its target.
    cluster.kubectl("-n", namespace, "delete", "pod", "svc-worker-0", "--wait=false")
    wait("the worker to stop", lambda: key not in standin_workers.state())
    assert not target.exists()
    assert not Path(f"/proc/{info['pid']}").exists(), "the harness stopped and reaped the worker"


def _get_json(url: str) -> dict[str, Any] | None:
    try:
        return dict(httpx.get(url, timeout=2).json())
    except httpx.HTTPError:
        return None


def test_harness_stops_its_workers_on_sigterm(cluster: Cluster, namespace: str,
                                              standin_workers: PodWorkers) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=MANIFESTS)
    info = standin_workers.wait_for(f"{namespace}/svc-worker-0")
    wait("the worker to serve", lambda: _get_json(f"{info['url']}/env"))
    standin_workers.stop()
    assert not Path(f"/proc/{info['pid']}").exists()
    assert not (cluster.run_dir / "prometheus" / "targets" / f"{namespace}_svc-worker-0.json").exists()
    assert standin_workers.state() == {}
