"""Fixtures for integration tests against the local control plane (hack/cluster-up.sh).

* ``cluster`` (session): reuses a healthy cluster in the run dir
  (``$MOEGUARD_RUN_DIR``, default /tmp/moeguard-run) or starts one, and stops it
  at the end only if it started it (``MOEGUARD_KEEP_CLUSTER=1`` keeps it). After a
  session with failures its logs are copied to ``<run dir>-logs`` first.
* ``pod_workers`` (session): hack/pod_workers.py in the background, the kubelet of
  the worker pods: each runs as a local worker process in a memory cgroup with the
  pod's limit, its kills, restarts and readiness written to the pod status
  (docs/local-cluster.md; ``MOEGUARD_WORKER_CMD`` overrides the command, default
  ``{python} -m moeguard_runtime``). Without a writable memory cgroup it fails to
  start, and the tests that use it fail with its message.
* ``namespace`` (function): a fresh namespace, deleted afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import stack

# hack/cluster-up.sh adds MOEGUARD_PORT_OFFSET to every port (a second cluster beside the first)
from harness.stack import PROMETHEUS_URL, ROOT, RUN_DIR

HACK = ROOT / "hack"


def pinned_kubectl() -> Path:
    """The kubectl that hack/build-binaries.sh built for the pinned Kubernetes version."""
    return stack.bin_dir("kubernetes") / "kubectl"


@dataclass
class Cluster:
    run_dir: Path
    kubeconfig: Path
    prometheus_url: str
    kubectl_bin: Path
    started_here: bool = False

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl against this cluster (harness.stack.kubectl); raises
        harness.stack.ToolError with its stderr when ``check``."""
        return stack.kubectl(*args, check=check, stdin=input, timeout=timeout, run_dir=self.run_dir)

    def kubectl_json(self, *args: str) -> Any:
        return stack.kubectl_json(*args, run_dir=self.run_dir)

    def prometheus_query(self, query: str) -> list[dict[str, Any]]:
        """The result vector of an instant query (harness.stack.prom_results); raises when unreachable."""
        return stack.prom_results(query, self.prometheus_url)


def _healthy(c: Cluster) -> bool:
    if not c.kubeconfig.exists():
        return False
    try:
        ok = c.kubectl("get", "--raw", "/readyz", check=False, timeout=10).returncode == 0
        return ok and httpx.get(f"{c.prometheus_url}/-/ready", timeout=2).status_code == 200
    except (httpx.HTTPError, subprocess.TimeoutExpired):
        return False


def only_logs(folder: str, names: list[str]) -> list[str]:
    """``shutil.copytree``'s ignore: every entry of ``folder`` but folders and ``*.log`` files."""
    return [n for n in names if not n.endswith(".log") and not os.path.isdir(os.path.join(folder, n))]


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    kubectl = pinned_kubectl()
    if not kubectl.exists():
        pytest.skip(f"{kubectl} is missing: build the control plane with hack/build-binaries.sh")
    c = Cluster(RUN_DIR, RUN_DIR / "kubeconfig", PROMETHEUS_URL, kubectl)
    # Tear down at the end only a cluster this session brought up from nothing: one that was
    # there but had a dead part (say, a test stopped Prometheus) is repaired and left running.
    c.started_here = not c.kubeconfig.exists()
    # Always: on a running cluster it only checks every part (0.2 s) and restarts a dead one.
    env = {**os.environ, "MOEGUARD_RUN_DIR": str(RUN_DIR)}
    res = subprocess.run([str(HACK / "cluster-up.sh")], env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        pytest.fail(f"hack/cluster-up.sh failed ({res.returncode}):\n{res.stderr[-4000:]}")
    yield c
    if request.session.testsfailed and (c.run_dir / "logs").is_dir():
        # cluster-down removes the run dir: keep the evidence of a failed session (operator, workers, control plane)
        kept = c.run_dir.with_name(f"{c.run_dir.name}-logs")
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(c.run_dir / "logs", kept)
        if (c.run_dir / "workers").is_dir():  # the harness's workers' own logs (<namespace>_<pod>.log)
            shutil.copytree(c.run_dir / "workers", kept / "workers", ignore=only_logs)
        print(f"\n{request.session.testsfailed} tests failed: the cluster's logs are kept in {kept}")
    if c.started_here and os.environ.get("MOEGUARD_KEEP_CLUSTER") != "1":
        subprocess.run([str(HACK / "cluster-down.sh")], env={**os.environ, "MOEGUARD_RUN_DIR": str(RUN_DIR)},
                       check=False, timeout=120)


@dataclass
class PodWorkers:
    """A running hack/pod_workers.py; ``state()`` is its workers file (``namespace/pod`` -> info)."""

    run_dir: Path
    instance: str = "default"
    extra_args: list[str] = field(default_factory=list)

    def _cmd(self, action: str) -> list[str]:
        return [sys.executable, str(HACK / "pod_workers.py"), action, "--run-dir", str(self.run_dir),
                "--instance", self.instance, *self.extra_args]

    def start(self) -> None:
        res = subprocess.run(self._cmd("start"), capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, f"pod_workers.py start failed: {res.stderr}"

    def stop(self) -> None:
        subprocess.run(self._cmd("stop"), capture_output=True, text=True, timeout=120, check=False)

    def state(self) -> dict[str, dict[str, Any]]:
        suffix = "" if self.instance == "default" else f"-{self.instance}"
        try:
            return dict(json.loads((self.run_dir / f"workers{suffix}.json").read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait_for(self, key: str, timeout: float = 30) -> dict[str, Any]:
        """Wait until pod ``namespace/name`` has a worker; returns its port, pid, url, moeis."""
        return stack.wait_for(lambda: self.state().get(key), timeout,
                              f"a worker for {key} (see {self.run_dir}/logs/)", interval=0.2)


def _pod_workers_args() -> list[str]:
    return ["--worker-cmd", os.environ["MOEGUARD_WORKER_CMD"]] if "MOEGUARD_WORKER_CMD" in os.environ else []


@pytest.fixture(scope="session")
def pod_workers(cluster: Cluster) -> Iterator[PodWorkers]:
    pw = PodWorkers(cluster.run_dir, extra_args=_pod_workers_args())
    pw.start()
    yield pw
    pw.stop()


@pytest.fixture
def no_pod_workers(cluster: Cluster) -> Iterator[None]:
    """Pods without workers (kwok makes them Ready, nothing exports metrics), whatever ran before: the
    session's harness, if an earlier test started it, is stopped for this test and started again after."""
    pid_file = cluster.run_dir / "pids" / "pod-workers.pid"
    running = pid_file.exists() and Path(f"/proc/{pid_file.read_text().strip()}").exists()
    pw = PodWorkers(cluster.run_dir, extra_args=_pod_workers_args())
    if running:
        pw.stop()
    yield
    if running:
        pw.start()


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace whose default ServiceAccount exists; deleted afterwards."""
    name = f"mg-test-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    stack.wait_for(lambda: cluster.kubectl("-n", name, "get", "serviceaccount", "default", check=False).returncode == 0,
                   30, f"ServiceAccount {name}/default", interval=0.2)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/integration/ is an integration test."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.integration)
