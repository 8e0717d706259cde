"""hack/pod_workers.py acts as the kubelet of worker pods: a local process per pod, in a memory cgroup
with the pod's limit, a token and a scrape target; kills, crashes, the crash-loop back-off, readiness and
deletion written to the pod's status as a kubelet writes them.

Runs the harness with the stand-in worker in this folder (the real ``moeguard_runtime`` is not needed
here), as its own instance limited to the test's namespace and to pods labelled as stand-ins, with a
short back-off (1 s doubling to 4 s; the kubelet's 10 s to 5 min is the default).
"""

from __future__ import annotations

import itertools
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
    pw = PodWorkers(cluster.run_dir, instance=f"standin-{namespace[-8:]}", extra_args=[
        "--namespace", namespace, "--selector", SELECTOR, "--worker-cmd", f"{{python}} {STANDIN}",
        "--backoff-initial-seconds", "1", "--backoff-max-seconds", "4"])
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

    # It runs in its own memory cgroup, limited to the container's memory limit, as on a node.
    cgroup = Path(info["cgroup"])
    assert cgroup_limit(cgroup) == 2 * 1024**3
    assert info["pid"] in cgroup_pids(cgroup)

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


def cgroup_limit(cgroup: Path) -> int:
    f = cgroup / "memory.limit_in_bytes"
    return int((f if f.exists() else cgroup / "memory.max").read_text())


def cgroup_pids(cgroup: Path) -> list[int]:
    return [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]


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


def standin_pod(name: str, memory: str = "256Mi", env: dict[str, str] | None = None, probe_period: int = 1,
                grace: int = 30, standin: bool = True) -> str:
    """A stand-in worker pod (JSON) with an HTTP readinessProbe on /readyz."""
    # standin=False: no worker labels, so that no harness (not even the e2e tests' default one) takes it
    labels = {"app.kubernetes.io/managed-by": "moeguard", "app.kubernetes.io/component": "worker",
              "app.kubernetes.io/instance": "svc", "harness.moeguard.dev/stand-in": "true"} if standin else {"app": "plain"}
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": {
        "terminationGracePeriodSeconds": grace,
        "containers": [{
            "name": "worker", "image": "registry.invalid/moeguard-worker:0",
            "ports": [{"name": "http", "containerPort": 8000}],
            "resources": {"limits": {"memory": memory}},
            "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
            "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": probe_period,
                               "failureThreshold": 2},
            "terminationMessagePolicy": "FallbackToLogsOnError"}]}})


def container(cluster: Cluster, namespace: str, pod: str) -> dict[str, Any]:
    obj = cluster.kubectl_json("-n", namespace, "get", "pod", pod)
    return dict((obj["status"].get("containerStatuses") or [{}])[0])


def condition(cluster: Cluster, namespace: str, pod: str, kind: str) -> str | None:
    obj = cluster.kubectl_json("-n", namespace, "get", "pod", pod)
    return next((c["status"] for c in obj["status"].get("conditions") or [] if c["type"] == kind), None)


def test_an_oom_kill_is_written_as_the_kubelet_writes_it(cluster: Cluster, namespace: str,
                                                        standin_workers: PodWorkers) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=standin_pod("oom", memory="128Mi"))
    info = standin_workers.wait_for(f"{namespace}/oom")
    cgroup = Path(info["cgroup"])
    assert cgroup_limit(cgroup) == 128 * 1024**2
    wait("Ready", lambda: condition(cluster, namespace, "oom", "Ready") == "True")
    with pytest.raises(httpx.HTTPError):  # the kernel kills it mid-request: the connection drops
        httpx.get(f"{info['url']}/alloc/400", timeout=30)
    cs = wait("the OOM kill in the pod status",
              lambda: (c := container(cluster, namespace, "oom")).get("lastState", {}).get("terminated") and c)
    term = cs["lastState"]["terminated"]
    assert (term["reason"], term["exitCode"]) == ("OOMKilled", 137)
    assert term["startedAt"] <= term["finishedAt"]
    assert cs["restartCount"] == 1
    # The first restart is immediate (the kubelet's back-off starts with the second): running again.
    assert "running" in cs["state"], cs
    assert int((cgroup / "memory.oom_control").read_text().split("oom_kill ")[1].split()[0]) >= 1 \
        if (cgroup / "memory.oom_control").exists() else True
    restarted = standin_workers.wait_for(f"{namespace}/oom")
    wait("the restarted worker", lambda: standin_workers.state()[f"{namespace}/oom"]["pid"] != info["pid"])
    assert restarted["port"] == info["port"], "the container keeps its port across restarts"
    wait("Ready again", lambda: condition(cluster, namespace, "oom", "Ready") == "True")


def test_a_crash_loop_backs_off_as_the_kubelet_does(cluster: Cluster, namespace: str,
                                                    standin_workers: PodWorkers, tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=standin_pod("crash", env={
        "STANDIN_EXIT_AFTER_S": "0.3", "STANDIN_EXIT_CODE": "3", "STANDIN_STARTS_FILE": str(starts)}))
    seen: set[str] = set()

    def six_starts() -> bool:
        cs = container(cluster, namespace, "crash")
        if waiting := cs.get("state", {}).get("waiting"):
            seen.add(f"{waiting['reason']}: {waiting.get('message', '').split(' restarting')[0]}")
        return starts.exists() and len(starts.read_text().split()) >= 6
    wait("six starts", six_starts, timeout=40)
    times = [float(t) for t in starts.read_text().split()]
    gaps = [b - a - 0.3 for a, b in itertools.pairwise(times)][:5]
    # kubelet: the first restart at once, then 1, 2, 4, 4 (capped) seconds after each exit; the rest is
    # the stand-in's own start-up and the harness noticing the exit (every 0.2 s).
    print(f"\nmeasured waits between exit and restart (s): {[round(g, 2) for g in gaps]} (kubelet's shape: 0 1 2 4 4)")
    for gap, expected in zip(gaps, [0, 1, 2, 4, 4], strict=True):
        assert expected <= gap + 0.05 and gap < expected + 1.5, (gaps, times)
    assert {"CrashLoopBackOff: back-off 1s", "CrashLoopBackOff: back-off 4s"} <= seen, seen
    # between two starts (a 4-s back-off now): a running start is Ready for its 0.3 s, as with a kubelet
    # (rehearsal T read one, restartCount 5 and ready, under load)
    cs = wait("a back-off after the sixth start", lambda: (
        c if (c := container(cluster, namespace, "crash")).get("state", {}).get("waiting") else None), timeout=20)
    term = cs["lastState"]["terminated"]
    assert (term["reason"], term["exitCode"]) == ("Error", 3)
    assert "standin: exiting 3 on purpose" in term["message"]  # FallbackToLogsOnError: the log's tail
    assert cs["restartCount"] >= 5 and not cs["ready"]


def test_readiness_comes_from_the_probe_and_only_from_the_harness(cluster: Cluster, namespace: str,
                                                                  standin_workers: PodWorkers) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=standin_pod("probe"))
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=standin_pod("kwok-only", standin=False))
    info = standin_workers.wait_for(f"{namespace}/probe")
    wait("Ready", lambda: condition(cluster, namespace, "probe", "Ready") == "True")
    assert container(cluster, namespace, "probe")["ready"] is True
    httpx.get(f"{info['url']}/unready", timeout=5)
    wait("not Ready after 2 failed probes", lambda: condition(cluster, namespace, "probe", "Ready") == "False",
         timeout=10)
    obj = cluster.kubectl_json("-n", namespace, "get", "pod", "probe")
    assert obj["status"]["phase"] == "Running" and container(cluster, namespace, "probe")["ready"] is False
    assert condition(cluster, namespace, "probe", "ContainersReady") == "False"
    httpx.get(f"{info['url']}/ready", timeout=5)
    wait("Ready again", lambda: condition(cluster, namespace, "probe", "Ready") == "True", timeout=10)
    # A pod that no harness takes is made Ready by kwok, without an annotation and without a process.
    wait("kwok's Ready", lambda: condition(cluster, namespace, "kwok-only", "Ready") == "True")
    plain = cluster.kubectl_json("-n", namespace, "get", "pod", "kwok-only")
    assert "harness.moeguard.dev/instance" not in (plain["metadata"].get("annotations") or {})
    assert f"{namespace}/kwok-only" not in standin_workers.state()
    assert obj["metadata"]["annotations"]["harness.moeguard.dev/instance"] == standin_workers.instance
    # kwok's Ready waits 1 s: the harness annotated the pod first, kwok never marked it Ready.
    harness_log = (cluster.run_dir / "logs" / f"pod-workers-{standin_workers.instance}.log").read_text()
    assert "before the harness took it" not in harness_log


@pytest.mark.parametrize(("ignore", "low", "high"), [(True, 2.8, 4.5), (False, 0.0, 1.5)])
def test_delete_stops_the_worker_with_sigterm_then_sigkill_after_the_grace_period(
        cluster: Cluster, namespace: str, standin_workers: PodWorkers, ignore: bool, low: float,
        high: float) -> None:
    """Grace period 3 s: a worker that obeys SIGTERM is gone at once, one that ignores it is killed when
    the grace period ends; the pod object and the pod's cgroup go with it."""
    env = {"STANDIN_IGNORE_SIGTERM": "1"} if ignore else {}
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=standin_pod("term", env=env, grace=3))
    info = standin_workers.wait_for(f"{namespace}/term")
    wait("Ready", lambda: condition(cluster, namespace, "term", "Ready") == "True")
    proc = Path(f"/proc/{info['pid']}")
    t0 = time.monotonic()
    cluster.kubectl("-n", namespace, "delete", "pod", "term", "--wait=false")
    while proc.exists() and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    took = time.monotonic() - t0
    print(f"\nworker gone {took:.2f} s after the delete (SIGTERM {'ignored' if ignore else 'obeyed'}, grace 3 s)")
    assert low <= took < high, f"worker gone {took:.1f} s after the delete (grace 3 s, SIGTERM " \
                               f"{'ignored' if ignore else 'obeyed'})"
    wait("the pod gone", lambda: cluster.kubectl("-n", namespace, "get", "pod", "term", check=False).returncode != 0,
         timeout=10)
    wait("the pod's cgroup removed", lambda: not Path(info["cgroup"]).exists(), timeout=5)
    log = (cluster.run_dir / "workers" / f"{namespace}_term.log").read_text()
    assert "standin: SIGTERM received" in log
