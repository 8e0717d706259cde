"""spec.model.source with the operator running against the real local control plane.

* A worker that cannot load its checkpoint: the worker really runs (hack/pod_workers.py) and exits 3,
  its checkpoint folder (the claim's mount path) being absent here; the harness restarts it and backs
  off as the kubelet does, and writes the pod status as the kubelet does: a crash loop whose last
  termination carries the log's tail (``terminationMessagePolicy: FallbackToLogsOnError``: outside a
  container there is no /dev/termination-log). That status becomes the service's Ready=False condition
  (reason WorkerStartupFailed) with the worker's own message, Stalled=True with reason CrashLoopBackOff (kstatus:
  the rollout cannot progress), one Warning Event, and the pod named in ``status.observed.crashLoopingPods``.
* A hostPath source on an operator run without ``--allow-host-path-models``: Stalled, HostPathNotAllowed.
* An image source on this API server (1.34, ImageVolume feature gate off): Stalled, VolumeDropped.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from harness import stack
from tests.integration.conftest import Cluster, PodWorkers
from tests.integration.e2e.helpers import moeis, wait, wait_cr

RESOURCES = {"gpus": 1, "softLimit": "3Gi", "hardLimit": "4Gi"}
MISSING = "/moeguard/model/tiny"
"""The checkpoint folder the worker is given (the claim's mount path + subPath): absent on this machine."""


@pytest.fixture
def bound_claim(cluster: Cluster, namespace: str) -> Iterator[str]:
    """A PersistentVolumeClaim bound to a static PersistentVolume (no provisioner here), so that the
    scheduler places the worker pod."""
    pv = f"m10-{uuid.uuid4().hex[:8]}"
    volume = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv}, "spec": {
        "capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
        "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": "/tmp/moeguard-models"},
        "claimRef": {"namespace": namespace, "name": "weights"}}}
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "weights"}, "spec": {
        "accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv,
        "resources": {"requests": {"storage": "1Gi"}}}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(volume))
    try:
        cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(claim))
        wait(lambda: cluster.kubectl_json("-n", namespace, "get", "pvc", "weights")["status"].get("phase") == "Bound",
             60, "the claim bound")
        yield "weights"
    finally:
        cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)


def test_a_worker_start_up_failure_is_the_ready_condition(cluster: Cluster, operator: None, namespace: str,
                                                          bound_claim: str, pod_workers: PodWorkers) -> None:
    source = {"persistentVolumeClaim": {"claimName": bound_claim}, "subPath": "tiny"}
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=moeis(
        "broken", model={"source": source, "servedModelName": "tiny-moe"}, replicas=1, resources=RESOURCES))
    deployment = wait(lambda: (r := cluster.kubectl("-n", namespace, "get", "deployment", "broken-worker", "-o",
                                                    "json", check=False)).returncode == 0 and json.loads(r.stdout),
                      60, "the worker Deployment")
    pod_spec = deployment["spec"]["template"]["spec"]
    assert {"name": "moeguard-model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} \
        in pod_spec["volumes"]
    env = {e["name"]: e.get("value") for e in pod_spec["containers"][0]["env"]}
    assert env["MOEGUARD_CHECKPOINT_PATH"] == "/moeguard/model/tiny"
    assert env["MOEGUARD_SERVED_MODEL_NAME"] == "tiny-moe"

    pod = cluster.kubectl_json("-n", namespace, "get", "pods", "-l", "app.kubernetes.io/instance=broken")["items"][0]
    name = pod["metadata"]["name"]

    def crash_looping() -> dict[str, Any] | None:
        cs = (cluster.kubectl_json("-n", namespace, "get", "pod", name)["status"].get("containerStatuses") or [{}])[0]
        return cs if (cs.get("state", {}).get("waiting") or {}).get("reason") == "CrashLoopBackOff" else None

    cs = wait(crash_looping, 90, "the kubelet's back-off (the second exit)")
    term = cs["lastState"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (3, "Error") and cs["restartCount"] >= 1 and not cs["ready"]
    assert "event=model_load_error" in term["message"] and MISSING in term["message"]
    assert cs["state"]["waiting"]["message"].startswith("back-off 10s restarting failed container=worker")

    obj = wait_cr(cluster, namespace, "broken",
                  lambda o: (stack.condition(o, "Ready") or {}).get("reason") == "WorkerStartupFailed", 60,
                  "Ready=False WorkerStartupFailed")
    ready = stack.condition(obj, "Ready")
    assert ready is not None and ready["status"] == "False"
    assert ready["message"].startswith(f"0/1 worker pods ready; pod {name}: container worker exited 3 (Error): ")
    assert MISSING in ready["message"]
    # kstatus: the current template cannot start, so the rollout is Stalled (the pod's reason), not in progress
    obj = wait_cr(cluster, namespace, "broken",
                  lambda o: (stack.condition(o, "Stalled") or {}).get("reason") == "CrashLoopBackOff", 60,
                  "Stalled=True CrashLoopBackOff")
    assert stack.condition(obj, "Stalled")["status"] == "True"  # type: ignore[index]
    assert stack.condition(obj, "Reconciling")["status"] == "False"  # type: ignore[index]
    looping = wait_cr(cluster, namespace, "broken",
                      lambda o: (o["status"].get("observed") or {}).get("crashLoopingPods") == [name], 120,
                      f"{name} named crash-looping")
    assert looping["status"]["observed"]["restarts"] >= 1

    def warned() -> bool:
        events = cluster.kubectl_json("-n", namespace, "get", "events",
                                      "--field-selector", "involvedObject.name=broken")["items"]
        messages = [e["message"] for e in events if e["reason"] == "WorkerStartupFailed"]
        return len(messages) == 1 and MISSING in messages[0]
    wait(warned, 30, "one WorkerStartupFailed Event")


@pytest.mark.parametrize(("name", "source", "reason", "needle"), [
    ("host", {"hostPath": {"path": "/srv/models/tiny"}}, "HostPathNotAllowed",
     "spec.model.source.hostPath (/srv/models/tiny): this operator serves no node directories"),
    ("image", {"image": {"reference": "registry.example.com/models/tiny:1"}}, "VolumeDropped",
     "the API server stored the worker Deployment without its volumes moeguard-model"),
])
def test_a_source_this_cluster_cannot_serve_stalls(cluster: Cluster, operator: None, namespace: str, name: str,
                                                   source: dict[str, Any], reason: str, needle: str) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", "-",
                    input=moeis(name, model={"source": source}, replicas=0, resources=RESOURCES))
    obj = wait_cr(cluster, namespace, name, lambda o: (stack.condition(o, "Ready") or {}).get("reason") == reason,
                  60, f"Ready=False {reason}")
    assert needle in stack.condition(obj, "Ready")["message"]  # type: ignore[index]
    assert stack.condition(obj, "Stalled")["status"] == "True"  # type: ignore[index]
