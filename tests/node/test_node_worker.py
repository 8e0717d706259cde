"""The worker image's pod, exactly as the operator renders it, on the real node (hack/node-up.sh).

The operator runs as a local process (``-n <namespace>``); the MoEInferenceService names the image
that hack/build-images.sh built and loaded into the node's containerd (``<run dir>/node/images.env``),
a toleration of the node's taint and its label as nodeSelector: the rest of the pod is the
operator's (restricted security context, read-only root, probes, the memory limit, the budget
ConfigMap read under the worker's own ServiceAccount token through the ``kubernetes`` Service).
The completion goes through ``kubectl port-forward`` to the Service (the node has no kube-proxy).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import stack
from harness.stack import ROOT, RUN_DIR

from moeguard_operator.children.builders import Owner, build_workload
from moeguard_operator.spec.models import MoEInferenceServiceSpec

pytestmark = pytest.mark.node

NODE_ENV = RUN_DIR / "node" / "node.env"
IMAGES_ENV = RUN_DIR / "node" / "images.env"
READY_TIMEOUT = 420  # a cold node unpacks nothing (images are loaded), but torch's import takes a while on 2 cores


def _env_file(path: Path) -> dict[str, str]:
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make test-node` (or hack/node-up.sh and "
                    f"hack/build-images.sh --load operator worker > {IMAGES_ENV})")
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


@pytest.fixture(scope="module")
def node() -> str:
    name = _env_file(NODE_ENV)["NODE_NAME"]
    ready = stack.kubectl("get", "node", name, "-o",
                          'jsonpath={.status.conditions[?(@.type=="Ready")].status}', check=False)
    assert ready.stdout.strip() == "True", f"node {name} is not Ready: {ready.stdout} {ready.stderr}"
    return name


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    return _env_file(IMAGES_ENV)


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    ns = f"mg-node-{uuid.uuid4().hex[:8]}"
    stack.kubectl("create", "namespace", ns)
    yield ns
    stack.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(namespace: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    stack.apply_crds()
    log = RUN_DIR / "logs" / f"operator-{namespace}.log"
    proc = stack.start_operator(log, args=("-n", namespace, "--standalone"))
    yield log
    stack.stop_process(proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def port_forward(namespace: str, target: str, remote: int) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [str(stack.bin_dir("kubernetes") / "kubectl"), "-n", namespace, "port-forward", target, f"{port}:{remote}"],
        env=stack.tools_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "Forwarding from 127.0.0.1:PORT -> 8000"
        assert "Forwarding from" in line, f"kubectl port-forward: {line}{proc.stdout.read() if proc.poll() is not None else ''}"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def moeis_manifest(name: str, namespace: str, image: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "moeguard.dev/v1alpha1",
        "kind": "MoEInferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "image": image,
            "model": {"preset": "tiny"},
            "replicas": 1,
            "resources": {"gpus": 1, "cpu": "500m", "softLimit": "3Gi", "hardLimit": "4Gi"},
            "template": {
                "nodeSelector": {"moeguard.dev/node": "real"},
                "tolerations": [{"key": "moeguard.dev/node", "operator": "Equal", "value": "real",
                                 "effect": "NoSchedule"}],
            },
            **spec,
        },
    }


def worker_pods(namespace: str, name: str) -> list[dict[str, Any]]:
    pods = stack.kubectl_json("-n", namespace, "get", "pods", "-l", f"app.kubernetes.io/instance={name}")
    return list(pods["items"])


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def describe(namespace: str, name: str) -> str:
    out = stack.kubectl("-n", namespace, "describe", "pods", "-l", f"app.kubernetes.io/instance={name}", check=False)
    logs = stack.kubectl("-n", namespace, "logs", "-l", f"app.kubernetes.io/instance={name}", "--tail=40",
                         "--all-containers", "--prefix", check=False)
    return f"{out.stdout[-6000:]}\n--- logs\n{logs.stdout[-4000:]}{logs.stderr[-1000:]}"


def test_worker_pod_runs_on_the_real_node_and_serves(node: str, images: dict[str, str], namespace: str,
                                                     operator: Path) -> None:
    name = "tiny"
    manifest = moeis_manifest(name, namespace, images["worker"])
    stack.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
    t0 = time.monotonic()
    try:
        pod = stack.wait_for(
            lambda: next((p for p in worker_pods(namespace, name) if ready(p)), None),
            READY_TIMEOUT, "a Ready worker pod")
    except TimeoutError:
        pytest.fail(f"no Ready worker pod after {READY_TIMEOUT}s\n{describe(namespace, name)}\n"
                    f"--- operator\n{operator.read_text()[-3000:]}")
    ready_s = time.monotonic() - t0
    print(f"worker pod Ready {ready_s:.1f}s after the apply")
    assert pod["spec"]["nodeName"] == node

    # The pod is the operator's rendering of the spec: compare with the builder's template.
    moeis = stack.kubectl_json("-n", namespace, "get", "moeis", name)
    spec = MoEInferenceServiceSpec.model_validate(moeis["spec"])
    rendered = build_workload(Owner(name, namespace, moeis["metadata"]["uid"]), spec)
    want = rendered["spec"]["template"]["spec"]
    got = pod["spec"]
    (wc,), gc = want["containers"], got["containers"][0]
    assert gc["image"] == images["worker"]
    for field in ("command", "securityContext", "terminationMessagePath", "terminationMessagePolicy"):
        assert gc[field] == wc[field], field
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert gc[probe]["httpGet"]["path"] == wc[probe]["httpGet"]["path"], probe
    assert gc["resources"]["limits"]["memory"] == wc["resources"]["limits"]["memory"] == "4Gi"
    assert gc["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert got["securityContext"]["runAsUser"] == want["securityContext"]["runAsUser"] == 65532
    assert got["serviceAccountName"] == want["serviceAccountName"]
    assert {e["name"] for e in gc["env"]} >= {e["name"] for e in wc["env"]}
    # The kubelet ran it as it said: the status it wrote is a real container's.
    (cs,) = pod["status"]["containerStatuses"]
    assert cs["ready"] and cs["containerID"].startswith("containerd://"), cs
    assert re.fullmatch(r"10\.85\.0\.\d+", pod["status"]["podIP"]), pod["status"].get("podIP")

    # The device plugin allocated one of its nvidia.com/gpu devices (its env, as NVIDIA's plugin sets it,
    # over the image's NVIDIA_VISIBLE_DEVICES=all); exec goes API server -> kubelet -> containerd.
    env = stack.kubectl("-n", namespace, "exec", pod["metadata"]["name"], "--", "python", "-c",
                        "import os; print(os.environ['NVIDIA_VISIBLE_DEVICES'])").stdout.strip()
    assert re.fullmatch(r"gpu-[0-7]", env), env

    with port_forward(namespace, f"svc/{name}", 8000) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "The experts of a mixture", "max_tokens": 8},
                       timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"], body
        assert body["usage"]["completion_tokens"] >= 1, body
        models = httpx.get(f"{url}/v1/models", timeout=30).json()
        assert models["data"], models


def test_kernel_oom_kill_drives_the_operator(node: str, images: dict[str, str], namespace: str,
                                             operator: Path) -> None:
    """A hardLimit below the worker's start-up RSS: the kernel kills it in the kubelet's memory cgroup,
    the kubelet writes ``OOMKilled`` (exit 137) and the restart, and the operator, reading only that
    Pod status (no harness on this node), counts the kill and cuts every budget."""
    name = "oom"
    manifest = moeis_manifest(name, namespace, images["worker"])
    manifest["spec"]["resources"].update({"softLimit": "256Mi", "hardLimit": "320Mi"})
    stack.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))

    def killed() -> dict[str, Any] | None:
        for p in worker_pods(namespace, name):
            for cs in p.get("status", {}).get("containerStatuses", []):
                term = cs.get("lastState", {}).get("terminated") or {}
                if term.get("reason") == "OOMKilled":
                    return {"pod": p, "status": cs, "terminated": term}
        return None

    try:
        seen = stack.wait_for(killed, 240, "an OOMKilled worker container")
    except TimeoutError:
        pytest.fail(f"no OOM kill\n{describe(namespace, name)}")
    assert seen["pod"]["spec"]["nodeName"] == node
    assert seen["terminated"]["exitCode"] == 137
    assert seen["status"]["restartCount"] >= 1

    def reacted() -> dict[str, Any] | None:
        status = stack.kubectl_json("-n", namespace, "get", "moeis", name).get("status", {})
        return status if status.get("observed", {}).get("oomKills", 0) >= 1 and \
            status.get("budgets", {}).get("maxPrefillTokens", 0) < status.get("initialBudgets", {}).get("maxPrefillTokens", 0) \
            else None

    status = stack.wait_for(reacted, 60, "the operator to count the OOM kill and cut the budgets")
    print(f"OOM kills {status['observed']['oomKills']}: budgets {status['initialBudgets']} -> {status['budgets']}")
    stack.kubectl("-n", namespace, "delete", "moeis", name, "--wait=false")


def test_chart_installs_the_operator_as_a_pod(node: str, images: dict[str, str]) -> None:
    """helm installs the operator from the built image as a pod on the real node (its Service account
    token, the API server through the `kubernetes` Service); it reconciles a MoEInferenceService whose
    worker pod runs there and serves."""
    ns, release_ns = f"mg-node-chart-{uuid.uuid4().hex[:6]}", f"mg-node-op-{uuid.uuid4().hex[:6]}"
    repo, tag = images["operator"].rsplit(":", 1)
    toleration = {"key": "moeguard.dev/node", "operator": "Equal", "value": "real", "effect": "NoSchedule"}
    values = {"image": {"repository": repo, "tag": tag, "pullPolicy": "IfNotPresent"},
              "crds": {"enabled": False}, "operator": {"watchNamespaces": [ns]},
              "nodeSelector": {"moeguard.dev/node": "real"}, "tolerations": [toleration]}
    stack.apply_crds()
    stack.kubectl("create", "namespace", ns)
    helm = str(stack.bin_dir("helm") / "helm")
    try:
        out = subprocess.run([helm, "install", "moeguard", str(ROOT / "charts" / "moeguard"), "-n", release_ns,
                              "--create-namespace", "-f", "-", "--wait", "--timeout", "180s"],
                             input=json.dumps(values), env=stack.tools_env(), capture_output=True, text=True,
                             timeout=240)
        assert out.returncode == 0, out.stderr
        (op,) = stack.kubectl_json("-n", release_ns, "get", "pods")["items"]
        assert op["spec"]["nodeName"] == node and ready(op)
        assert op["spec"]["containers"][0]["image"] == images["operator"]

        name = "served"
        stack.kubectl("apply", "-f", "-", stdin=json.dumps(moeis_manifest(name, ns, images["worker"])))
        try:
            pod = stack.wait_for(lambda: next((p for p in worker_pods(ns, name) if ready(p)), None),
                                 READY_TIMEOUT, "a Ready worker pod of the chart's operator")
        except TimeoutError:
            oplog = stack.kubectl("-n", release_ns, "logs", "deploy/moeguard", "--tail=60", check=False).stdout
            pytest.fail(f"no Ready worker pod\n{describe(ns, name)}\n--- operator pod\n{oplog}")
        assert pod["spec"]["nodeName"] == node
        with port_forward(ns, f"svc/{name}", 8000) as url:
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120)
            assert r.status_code == 200, r.text
        moeis = stack.kubectl_json("-n", ns, "get", "moeis", name)
        ready_cond = next(c for c in moeis["status"]["conditions"] if c["type"] == "Ready")
        assert ready_cond["status"] == "True", ready_cond
    finally:
        stack.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        subprocess.run([helm, "uninstall", "moeguard", "-n", release_ns, "--wait", "--timeout", "60s"],
                       env=stack.tools_env(), capture_output=True, timeout=90)
        stack.kubectl("delete", "namespace", release_ns, "--wait=false", check=False)


class EndpointClient:
    """A client of the Service that does kube-proxy's part itself (the node has none): it sends each
    request to a ready endpoint of the Service's EndpointSlices (re-read every 0.3 s, round robin, pod IPs
    are routed to the node's bridge) and honours Retry-After on 429/503. Anything else that is not a
    200 (a connection refused or reset, a 5xx without Retry-After, a timeout) counts as failed."""

    def __init__(self, namespace: str, service: str) -> None:
        self.namespace, self.service = namespace, service
        self.endpoints: list[str] = []
        self.ok = 0
        self.retried = 0
        self.failed: list[str] = []
        self.served_by: set[str] = set()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._refresh, daemon=True),
                         threading.Thread(target=self._send, daemon=True)]

    def _refresh(self) -> None:
        while not self._stop.is_set():
            res = stack.kubectl("-n", self.namespace, "get", "endpointslices", "-l",
                                f"kubernetes.io/service-name={self.service}", "-o", "json", check=False)
            if res.returncode == 0:
                eps = [f"{a}:{(s.get('ports') or [{}])[0].get('port', 8000)}"
                       for s in json.loads(res.stdout)["items"] for e in s.get("endpoints") or []
                       if (e.get("conditions") or {}).get("ready") for a in e["addresses"]]
                self.endpoints = sorted(eps)
            self._stop.wait(0.3)

    def _send(self) -> None:
        i = 0
        with httpx.Client(timeout=60) as http:
            while not self._stop.is_set():
                eps = self.endpoints
                if not eps:
                    time.sleep(0.1)
                    continue
                ep = eps[i % len(eps)]
                i += 1
                try:
                    r = http.post(f"http://{ep}/v1/completions", json={"prompt": "roll", "max_tokens": 4})
                except httpx.HTTPError as exc:
                    self.failed.append(f"{ep}: {exc!r}")
                    continue
                if r.status_code == 200:
                    self.ok += 1
                    self.served_by.add(ep)
                elif r.status_code in (429, 503) and "retry-after" in r.headers:
                    self.retried += 1
                    time.sleep(min(float(r.headers["retry-after"]), 5.0))
                else:
                    self.failed.append(f"{ep}: {r.status_code} {r.text[:200]}")

    def __enter__(self) -> EndpointClient:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(70)


def two_ready_pods(namespace: str, name: str, images: dict[str, str]) -> set[str]:
    stack.kubectl("apply", "-f", "-", stdin=json.dumps(moeis_manifest(name, namespace, images["worker"], replicas=2)))
    try:
        stack.wait_for(lambda: len([p for p in worker_pods(namespace, name) if ready(p)]) == 2 or None,
                       READY_TIMEOUT, "2 Ready worker pods")
    except TimeoutError:
        pytest.fail(f"not 2 Ready worker pods\n{describe(namespace, name)}")
    return {p["metadata"]["name"] for p in worker_pods(namespace, name)}


def test_rollout_without_failed_requests(node: str, images: dict[str, str], namespace: str,
                                         operator: Path) -> None:
    """A spec change rolls the pods (Deployment: maxSurge 1, maxUnavailable 0 for 2 replicas) while a
    client that honours Retry-After sends requests through the Service's ready endpoints. The real node's
    fault 1 failed it (the worker exited at once on SIGTERM: 2-5 of ~1,000 requests refused); the worker now
    answers 503 + Retry-After for MOEGUARD_SHUTDOWN_DELAY_SECONDS first."""
    name = "roll"
    before = two_ready_pods(namespace, name, images)
    try:
        with EndpointClient(namespace, name) as client:
            stack.wait_for(lambda: client.ok >= 5 or None, 60, "traffic before the rollout")
            stack.kubectl("-n", namespace, "patch", "moeis", name, "--type=merge", "-p",
                          json.dumps({"spec": {"template": {"annotations": {"moeguard.dev/rollout": "2"}}}}))
            stack.kubectl("-n", namespace, "rollout", "status", f"deploy/{name}-worker", "--timeout=400s",
                          timeout=420)
            stack.wait_for(lambda: (len([p for p in worker_pods(namespace, name)
                                        if ready(p) and p["metadata"]["name"] not in before]) == 2
                           and len(worker_pods(namespace, name)) == 2) or None, 300, "the old pods gone")
            time.sleep(3)
        print(f"rollout: {client.ok} served, {client.retried} Retry-After, {len(client.failed)} failed "
              f"{client.failed[:3]}, endpoints used {sorted(client.served_by)}")
        after = {p["metadata"]["name"] for p in worker_pods(namespace, name)}
        assert not before & after
        assert client.ok >= 10
        assert not client.failed, client.failed[:10]
    finally:
        stack.kubectl("-n", namespace, "delete", "moeis", name, "--wait=false", check=False)
        stack.wait_for(lambda: not worker_pods(namespace, name) or None, 120, "the roll pods gone")


def test_drain_evicts_within_the_disruption_budget(node: str, images: dict[str, str], namespace: str,
                                                   operator: Path) -> None:
    """The PodDisruptionBudget (maxUnavailable 1) lets one pod go; its replacement cannot schedule (the
    only node that tolerates it is cordoned), so the second eviction is refused until drain's timeout."""
    name = "drain"
    before = two_ready_pods(namespace, name, images)
    drain = stack.kubectl("drain", node, f"--pod-selector=app.kubernetes.io/instance={name}",
                          "--delete-emptydir-data", "--ignore-daemonsets", "--timeout=40s",
                          check=False, timeout=90)
    try:
        out = drain.stdout + drain.stderr
        assert drain.returncode != 0, out
        assert "disruption budget" in out, out
        pods = worker_pods(namespace, name)
        left = [p for p in pods if p["metadata"]["name"] in before]
        assert len(left) == 1 and ready(left[0]), [p["metadata"]["name"] for p in pods]
        pending = [p for p in pods if p["metadata"]["name"] not in before]
        assert pending and all(p["status"].get("phase") == "Pending" for p in pending)
        print(f"drain: evicted {sorted(before - {left[0]['metadata']['name']})}, "
              f"kept {left[0]['metadata']['name']} (PodDisruptionBudget)")
    finally:
        stack.kubectl("uncordon", node, check=False)
    stack.wait_for(lambda: len([p for p in worker_pods(namespace, name) if ready(p)]) == 2 or None,
                   READY_TIMEOUT, "2 Ready worker pods after the uncordon")
    stack.kubectl("-n", namespace, "delete", "moeis", name, "--wait=false")
