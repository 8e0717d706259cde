"""LeaderWorkerSet on the local control plane: the real LWS controller (hack/cluster-up.sh starts
``lws-manager`` and registers its webhooks on loopback) and the pod harness acting as the pods' kubelet.

A raw LeaderWorkerSet of size 2 whose pod template is the one moeguard renders for worker pods (its
labels, env, limits, probe), with a stand-in label so that only this test's harness instance takes the
pods and runs the stand-in worker (``standin_worker.py``: ``/env`` shows the process env). Checked: LWS's
labels and env on the pods (its pod webhook ran), a process per pod with ``LWS_LEADER_ADDRESS=127.0.0.1``
and one ``MOEGUARD_EP_PORT`` for the group, both Ready; a SIGKILLed member makes LWS
(``RecreateGroupOnPodRestart``) recreate the whole group, which gets processes again.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from hack import pod_workers
from harness.stack import wait_for
from tests.integration.conftest import PodWorkers

from moeguard_core import contract as k
from moeguard_operator import constants as c

if TYPE_CHECKING:
    from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

STANDIN = Path(__file__).with_name("standin_worker.py")
STANDIN_LABEL = "harness.moeguard.dev/stand-in"
SELECTOR = f"{c.LABEL_MANAGED_BY}={c.MANAGED_BY},{c.LABEL_COMPONENT}={c.WORKER_COMPONENT},{STANDIN_LABEL}=true"
LWS_NAME = "svc-worker"
LEADER, MEMBER = f"{LWS_NAME}-0", f"{LWS_NAME}-0-1"  # group 0: leader <lws>-0, worker <lws>-0-1
LWS_LABELS = ("leaderworkerset.sigs.k8s.io/name", "leaderworkerset.sigs.k8s.io/group-index",
              "leaderworkerset.sigs.k8s.io/group-key", "leaderworkerset.sigs.k8s.io/worker-index")


def worker_labels() -> dict[str, str]:
    """The labels moeguard puts on worker pods (operator builders.labels), plus the stand-in label."""
    return {c.LABEL_NAME: c.WORKER_NAME, c.LABEL_INSTANCE: "svc", c.LABEL_COMPONENT: c.WORKER_COMPONENT,
            c.LABEL_MANAGED_BY: c.MANAGED_BY, c.LABEL_PART_OF: "moeguard", STANDIN_LABEL: "true"}


def pod_template(grace: int = 5) -> dict[str, Any]:
    """A worker pod template as the operator renders it for a Deployment (builders.build_deployment):
    labels, ServiceAccount, one GPU, memory limit, the worker's env and readiness probe."""
    env: list[dict[str, Any]] = [
        {"name": k.ENV_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": k.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": k.ENV_SERVICE_NAME, "value": "svc"},
        {"name": k.ENV_MODEL_PRESET, "value": "tiny"},
        {"name": k.ENV_BUDGET_CONFIGMAP, "value": k.budget_configmap_name("svc")},
        {"name": k.ENV_PORT, "value": str(k.WORKER_PORT)},
    ]
    return {
        "metadata": {"labels": worker_labels()},
        "spec": {
            "serviceAccountName": "worker",
            "terminationGracePeriodSeconds": grace,
            "containers": [{
                "name": "worker", "image": "registry.invalid/moeguard-worker:0",
                "command": ["python", "-m", "moeguard_runtime"],
                "ports": [{"name": "http", "containerPort": k.WORKER_PORT, "protocol": "TCP"}],
                "env": env,
                "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "256Mi", "cpu": "1"},
                              "requests": {"memory": "256Mi", "cpu": "1"}},
                "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 1,
                                   "failureThreshold": 2},
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }],
        },
    }


def leader_worker_set() -> str:
    return json.dumps({
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
        "metadata": {"name": LWS_NAME, "labels": {c.LABEL_INSTANCE: "svc", c.LABEL_MANAGED_BY: c.MANAGED_BY}},
        "spec": {"replicas": 1, "leaderWorkerTemplate": {
            "size": 2, "restartPolicy": "RecreateGroupOnPodRestart", "workerTemplate": pod_template()}}})


@pytest.fixture
def lws_workers(cluster: Cluster, namespace: str) -> Iterator[PodWorkers]:
    pw = PodWorkers(cluster.run_dir, instance=f"lws-{namespace[-8:]}", extra_args=[
        "--namespace", namespace, "--selector", SELECTOR, "--worker-cmd", f"{{python}} {STANDIN}",
        "--backoff-initial-seconds", "1", "--backoff-max-seconds", "4"])
    pw.start()
    yield pw
    pw.stop()


def wait(what: str, check: Any, timeout: float = 30) -> Any:
    """:func:`harness.stack.wait_for` with this file's argument order and a 0.25-s interval."""
    return wait_for(check, timeout, what, interval=0.25)


def pods(cluster: Cluster, namespace: str) -> dict[str, dict[str, Any]]:
    items = cluster.kubectl_json("-n", namespace, "get", "pods")["items"]
    return {p["metadata"]["name"]: p for p in items}


def ready(pod: dict[str, Any]) -> bool:
    return any(cond["type"] == "Ready" and cond["status"] == "True" for cond in pod["status"].get("conditions") or [])


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0].get("env") or []}


def get_env(url: str) -> dict[str, str] | None:
    try:
        return dict(httpx.get(f"{url}/env", timeout=2).json())
    except httpx.HTTPError:
        return None


def group_running(cluster: Cluster, namespace: str, pw: PodWorkers,
                  not_uids: Collection[str] = ()) -> dict[str, Any] | None:
    """Leader and member pods exist (with uids not in ``not_uids``), each has a worker process for that
    very pod, and both are Ready; returns {name: (pod, worker info)}."""
    current, state = pods(cluster, namespace), pw.state()
    out = {}
    for name in (LEADER, MEMBER):
        pod, info = current.get(name), state.get(f"{namespace}/{name}")
        if pod is None or info is None or pod["metadata"]["uid"] in not_uids:
            return None
        if info["uid"] != pod["metadata"]["uid"] or not ready(pod) or pod["metadata"].get("deletionTimestamp"):
            return None
        out[name] = (pod, info)
    return out


def check_group(namespace: str, group: dict[str, Any]) -> int:
    """LWS's labels and env on both pods, the harness's env in both processes; returns the group's port."""
    leader, member = group[LEADER][0], group[MEMBER][0]
    for pod in (leader, member):
        labels = pod["metadata"]["labels"]
        assert all(key in labels for key in LWS_LABELS), labels
        assert labels[c.LABEL_INSTANCE] == "svc" and labels[c.LABEL_COMPONENT] == c.WORKER_COMPONENT
    assert leader["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert member["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "1"
    assert leader["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/group-key"] == \
        member["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/group-key"]
    dns_name = f"{LEADER}.{LWS_NAME}.{namespace}"  # <lws>-<group>.<subdomain>.<namespace>: no DNS here
    for pod, index in ((leader, "0"), (member, "1")):
        env = env_of(pod)  # what LWS's pod webhook injected
        assert (env["LWS_LEADER_ADDRESS"], env["LWS_GROUP_SIZE"], env["LWS_WORKER_INDEX"]) == (dns_name, "2", index)
    ports = set()
    for name, index in ((LEADER, "0"), (MEMBER, "1")):
        info = group[name][1]
        proc_env = wait(f"/env of {name}'s worker", lambda url=info["url"]: get_env(url))
        assert proc_env["LWS_LEADER_ADDRESS"] == "127.0.0.1", "the harness points the group at loopback"
        assert (proc_env["LWS_GROUP_SIZE"], proc_env["LWS_WORKER_INDEX"]) == ("2", index)
        assert proc_env["MOEGUARD_PORT"] == str(info["port"])
        assert proc_env["MOEGUARD_EP_PORT"] == str(info["lws"]["epPort"])
        assert info["lws"]["leaderAddress"] == dns_name and info["lws"]["workerIndex"] == index
        ports.add(int(proc_env["MOEGUARD_EP_PORT"]))
    assert len(ports) == 1, f"one MOEGUARD_EP_PORT per group, got {ports}"
    port = ports.pop()
    assert port not in (group[LEADER][1]["port"], group[MEMBER][1]["port"])
    return port


def test_lws_group_runs_and_a_killed_member_recreates_the_group(cluster: Cluster, namespace: str,
                                                                lws_workers: PodWorkers) -> None:
    cluster.kubectl("-n", namespace, "create", "serviceaccount", "worker")
    t0 = time.monotonic()
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=leader_worker_set())
    group = wait("leader and member running and Ready", lambda: group_running(cluster, namespace, lws_workers), 60)
    print(f"\nLWS group 0 Ready with 2 worker processes {time.monotonic() - t0:.1f} s after the apply")
    port = check_group(namespace, group)
    # The harness's default selector (moeguard's worker labels; it also leaves out stand-ins) takes LWS pods.
    taken = cluster.kubectl_json("-n", namespace, "get", "pods", "-l", pod_workers.SELECTOR)["items"]
    assert {p["metadata"]["name"] for p in taken} == {LEADER, MEMBER}
    lws = cluster.kubectl_json("-n", namespace, "get", "leaderworkerset", LWS_NAME)
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"

    # A member dies: the harness writes the restart as a kubelet would; LWS deletes the leader, the group goes.
    old_uids = {p["metadata"]["uid"] for p, _ in group.values()}
    old_pids = [info["pid"] for _, info in group.values()]
    t1 = time.monotonic()
    os.kill(group[MEMBER][1]["pid"], signal.SIGKILL)
    new = wait("a new group (new pods, new processes, Ready)",
               lambda: group_running(cluster, namespace, lws_workers, not_uids=old_uids), 90)
    took = time.monotonic() - t1
    print(f"SIGKILL of the member -> new group Ready with 2 new processes in {took:.1f} s "
          f"(EP port {port} -> {new[LEADER][1]['lws']['epPort']})")
    assert {p["metadata"]["uid"] for p, _ in new.values()}.isdisjoint(old_uids)
    check_group(namespace, new)
    assert all(not Path(f"/proc/{pid}").exists() for pid in old_pids), "the old group's processes are gone"
    events = cluster.kubectl_json("-n", namespace, "get", "events", "--field-selector",
                                  f"involvedObject.name={LWS_NAME}")["items"]
    recreated = [e for e in events if e["reason"] == "RecreateGroupOnPodRestart"]
    assert recreated and MEMBER in recreated[0]["message"], [e["reason"] for e in events]
    for name in (LEADER, MEMBER):  # the new pods start afresh: no restart carried over
        assert new[name][0]["status"]["containerStatuses"][0]["restartCount"] == 0


def plain_pod(name: str, grace: int, env: dict[str, str]) -> str:
    template = pod_template(grace)
    container = template["spec"]["containers"][0]
    container["env"] += [{"name": key, "value": value} for key, value in env.items()]
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **template["metadata"]},
                       "spec": template["spec"]})


def test_a_pod_made_again_under_its_name_gets_a_process_once_the_old_one_is_gone(
        cluster: Cluster, namespace: str, lws_workers: PodWorkers) -> None:
    """What a StatefulSet does when the old pod's object went before its process (kwok's fallback removes
    an annotated pod when its grace period ends, as the harness SIGKILLs the process): the new pod of the
    same name waits for the old process, then runs at once (not at the harness's next relist, 60 s)."""
    cluster.kubectl("-n", namespace, "create", "serviceaccount", "worker")
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=plain_pod("same", 3, {"STANDIN_IGNORE_SIGTERM": "1"}))
    key = f"{namespace}/same"
    old = lws_workers.wait_for(key)
    wait("Ready", lambda: ready(pods(cluster, namespace)["same"]))
    cluster.kubectl("-n", namespace, "delete", "pod", "same", "--wait=false")  # SIGTERM, ignored: 3 s
    wait("SIGTERM sent", lambda: "standin: SIGTERM received" in
         (cluster.run_dir / "workers" / f"{namespace}_same.log").read_text(), 5)
    cluster.kubectl("-n", namespace, "delete", "pod", "same", "--grace-period=0", "--force")
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=plain_pod("same", 3, {}))
    assert Path(f"/proc/{old['pid']}").exists(), "the old process still runs (its grace period is not over)"
    t0 = time.monotonic()
    new = wait("a process for the new pod", lambda: (i := lws_workers.state().get(key)) and
               i["uid"] != old["uid"] and i, 15)
    print(f"\nnew pod's process {time.monotonic() - t0:.1f} s after it was made (the old one had up to 3 s left)")
    assert not Path(f"/proc/{old['pid']}").exists()
    assert new["uid"] == pods(cluster, namespace)["same"]["metadata"]["uid"]
    wait("the new pod Ready", lambda: ready(pods(cluster, namespace)["same"]))
