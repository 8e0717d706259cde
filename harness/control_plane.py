"""The local control plane, as the closed-loop benchmarks use it (``bench.control_latency``,
``bench.headline_loop``): only the project's stable interfaces.

* the cluster: ``hack/cluster-up.sh`` and the CRD (:mod:`harness.stack`);
* the operator: its command line as in the Makefile's ``operator`` target (no extra flags);
* the workers: ``hack/pod_workers.py start|stop`` and its state file (``workers.json``: pod -> url);
* a MoEInferenceService: ``kubectl apply``; pods and their status: ``kubectl get -o json``;
* each worker's ``/metrics`` (the budgets it runs with).

The scrape interval of the run dir's Prometheus is set through its own config file and
``/-/reload`` (``cluster-up.sh`` starts it with ``--web.enable-lifecycle``), so the benchmarks
run at the 5 s scrape a cluster would use without editing ``hack/``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from harness import stack
from harness.metrics_text import samples

BUDGET_PREFIX = "moeguard_budget_"
BUDGET_NAMES = ("max_prefill_tokens", "max_decode_tokens", "max_batch_requests", "max_long_requests_per_batch",
                "max_concurrent_batches", "max_queue_requests", "queue_timeout_seconds")
"""The budget gauges a worker exports (``moeguard_budget_<name>``), contract.BUDGET_FIELDS' names."""


def cluster_up() -> None:
    """Start (or keep) the local control plane and Prometheus, apply the CRD.

    Raises:
        subprocess.CalledProcessError: ``cluster-up.sh`` failed.
    """
    stack.script("cluster-up.sh")
    stack.apply_crds()


def set_scrape_interval(seconds: int, run_dir: Path = stack.RUN_DIR) -> None:
    """Set the global ``scrape_interval`` (and evaluation interval) of the run dir's Prometheus and
    reload it.

    Raises:
        FileNotFoundError: no Prometheus config in ``run_dir`` (the cluster is not up).
        httpx.HTTPError: Prometheus refused the reload.
    """
    path = run_dir / "prometheus" / "prometheus.yml"
    text = path.read_text()
    text = re.sub(r"(?m)^(\s*(?:scrape|evaluation)_interval:\s*)\S+", rf"\g<1>{seconds}s", text)
    path.write_text(text)
    httpx.post(f"{stack.PROMETHEUS_URL}/-/reload", timeout=10).raise_for_status()


def start_operator(log_path: Path, args: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """``python -m moeguard_operator -A --standalone --prometheus-url <the stack's> [args]``: the Makefile's
    ``operator`` target (with ``args``, e.g. ``--policy threshold``), logging to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "moeguard_operator", "-A", "--standalone", "--prometheus-url",
             stack.PROMETHEUS_URL, *args], cwd=stack.ROOT, env=stack.tools_env(), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)


def apply(manifest: dict[str, Any]) -> None:
    """``kubectl apply -f -`` of one object (namespaced objects carry their namespace)."""
    stack.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))


def moeis(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A MoEInferenceService object."""
    return {"apiVersion": "moeguard.dev/v1alpha1", "kind": "MoEInferenceService",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def create_namespace(namespace: str) -> None:
    apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})


def delete_namespace(namespace: str, wait: bool = True) -> None:
    """Delete ``namespace`` (its workers stop as their pods go); waits up to 120 s when ``wait``."""
    stack.kubectl("delete", "namespace", namespace, f"--wait={'true' if wait else 'false'}", "--timeout=120s",
                  check=False, timeout=150)


def workers(namespace: str, name: str, run_dir: Path = stack.RUN_DIR) -> dict[str, str]:
    """pod name -> worker base URL of ``name``'s pods, from the harness's state file."""
    path = run_dir / "workers.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {key.split("/", 1)[1]: str(w["url"]) for key, w in state.items()
            if key.startswith(f"{namespace}/") and w.get("moeis") == name and "url" in w}


def wait_workers(namespace: str, name: str, replicas: int, timeout_s: float = 240) -> dict[str, str]:
    """Wait until ``replicas`` workers of ``name`` answer ``/readyz`` 200; pod -> URL.

    Raises:
        TimeoutError: not within ``timeout_s``.
    """
    def probe() -> dict[str, str] | None:
        w = workers(namespace, name)
        ready = {pod: url for pod, url in w.items() if stack.healthy(url)}
        return ready if len(ready) >= replicas else None

    return stack.wait_for(probe, timeout_s, f"{replicas} ready workers of {namespace}/{name}", interval=0.5)


def budgets(url: str, client: httpx.Client | None = None) -> dict[str, float] | None:
    """The budgets a worker runs with now (its ``moeguard_budget_*`` gauges), or None when it does
    not answer."""
    try:
        text = (client or httpx).get(f"{url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    out = {n[len(BUDGET_PREFIX):]: v for n, _, v in samples(text)
           if n.startswith(BUDGET_PREFIX) and n[len(BUDGET_PREFIX):] in BUDGET_NAMES}
    return out or None


def metric_values(url: str, names: tuple[str, ...], client: httpx.Client | None = None) -> dict[str, float]:
    """The first sample of each of ``names`` on a worker (missing ones left out; {} when it does not
    answer)."""
    try:
        text = (client or httpx).get(f"{url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for n, _, v in samples(text):
        if n in names and n not in out:
            out[n] = v
    return out


def pods(namespace: str, name: str) -> list[dict[str, Any]]:
    """``name``'s worker pods (the operator's labels), as JSON."""
    sel = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=worker"
    return list(stack.kubectl_json("get", "pods", "-n", namespace, "-l", sel)["items"])


def terminations(pod: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
    """(restartCount, lastState.terminated) of a pod's first container, as the kubelet writes them."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if not statuses:
        return 0, None
    st = statuses[0]
    return int(st.get("restartCount") or 0), (st.get("lastState") or {}).get("terminated")


def parse_time(ts: str) -> float:
    """An RFC 3339 timestamp of the API (``2026-01-01T00:00:00Z``, second precision) as Unix seconds."""
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def patch_worker_env(namespace: str, name: str, env: dict[str, str]) -> None:
    """Add ``env`` to the worker Deployment's container by hand (a strategic merge patch: another
    field manager, as an admin debugging would; ``spec.template.extraEnv`` may not set ``MOEGUARD_*``).
    The patch rolls the pods."""
    patch = {"spec": {"template": {"spec": {"containers": [
        {"name": "worker", "env": [{"name": k, "value": v} for k, v in env.items()]}]}}}}
    stack.kubectl("-n", namespace, "patch", "deployment", f"{name}-worker", "--type", "strategic", "-p",
                  json.dumps(patch))


def wait_deployment(namespace: str, name: str, timeout_s: float = 60) -> None:
    """Wait until the operator has created ``name``'s worker Deployment."""
    stack.wait_for(lambda: stack.kubectl("-n", namespace, "get", "deployment", f"{name}-worker",
                                         check=False).returncode == 0,
                   timeout_s, f"deployment {namespace}/{name}-worker")


def now() -> float:
    """Unix time, seconds (the clock pod timestamps are in)."""
    return time.time()


def _has_env(pod: dict[str, Any], key: str) -> bool:
    return any(e.get("name") == key for e in pod["spec"]["containers"][0].get("env", []))


def start_service(namespace: str, name: str, spec: dict[str, Any], env: dict[str, str] | None = None,
                  timeout_s: float = 300) -> dict[str, str]:
    """Apply a MoEInferenceService and wait for its ``spec["replicas"]`` workers to answer ``/readyz``
    200; pod -> URL. With ``env``, the service is created with 0 replicas, ``env`` is patched into its
    worker Deployment (:func:`patch_worker_env`), then it is scaled to ``spec["replicas"]``: every pod
    starts with ``env``, none is rolled.

    Raises:
        TimeoutError: the workers were not ready within ``timeout_s``.
    """
    replicas = int(spec["replicas"])
    if not env:
        apply(moeis(namespace, name, spec))
        return wait_workers(namespace, name, replicas, timeout_s)
    apply(moeis(namespace, name, {**spec, "replicas": 0}))
    wait_deployment(namespace, name)
    patch_worker_env(namespace, name, env)
    stack.kubectl("-n", namespace, "patch", "moeis", name, "--type", "merge", "-p",
                  json.dumps({"spec": {"replicas": replicas}}))
    key = next(iter(env))

    def probe() -> dict[str, str] | None:
        live = [p for p in pods(namespace, name) if not p["metadata"].get("deletionTimestamp")]
        names = {p["metadata"]["name"] for p in live if _has_env(p, key)}
        ready = {pod: url for pod, url in workers(namespace, name).items() if pod in names and stack.healthy(url)}
        return ready if len(ready) >= replicas else None

    return dict(stack.wait_for(probe, timeout_s, f"{replicas} ready workers of {namespace}/{name} with the patched env",
                               interval=0.5))


def stop_service(namespace: str, name: str) -> None:
    """Delete a MoEInferenceService (the operator must be running: it removes its finalizer) and wait
    until the harness has stopped its workers."""
    stack.kubectl("-n", namespace, "delete", "moeis", name, "--wait=true", "--timeout=120s", check=False, timeout=150)
    deadline = time.monotonic() + 60
    while workers(namespace, name) and time.monotonic() < deadline:
        time.sleep(0.5)
