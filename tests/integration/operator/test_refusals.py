"""Issue 12 §4 (Secrets) and §1 (children the API server refuses), with the operator in this process
(``kopf.testing.KopfRunner``) against the local API server, watching only the test's namespace."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import kopf
import kubernetes.config.kube_config
import pytest
from harness import stack
from kopf.testing import KopfRunner
from kubernetes.client.exceptions import ApiException
from tests.integration.conftest import Cluster
from tests.integration.e2e.helpers import moeis, wait_cr

from moeguard_operator import handlers
from moeguard_operator.children import apply_errors, kube
from moeguard_operator.config import OperatorConfig

DEADLINE_SECONDS = 120
"""Generous: the machine may be loaded; each wait ends as soon as the state is there."""
QUIET_SECONDS = 25
"""How long a stalled resource is watched for further apply attempts (2.5 of the old 10 s retry period)."""
SECRET_TEMPLATE = {
    "volumes": [{"name": "models", "emptyDir": {}}, {"name": "cache", "emptyDir": {}},
                {"name": "hf-token", "secret": {"secretName": "hf"}}],
    "volumeMounts": [{"name": "hf-token", "mountPath": "/var/run/hf"}],
}

Operator = Callable[[OperatorConfig], Any]


@pytest.fixture
def run_operator(cluster: Cluster, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Operator]:
    """``run_operator(config)``: a context manager running the operator in this process with ``config``."""
    stack.apply_crds(run_dir=cluster.run_dir)
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(cluster.kubeconfig))

    @contextmanager
    def run(config: OperatorConfig) -> Iterator[KopfRunner]:
        registry = kopf.OperatorRegistry()
        handlers.register(config, registry)
        with KopfRunner(["run", "--standalone", "--namespace", namespace], registry=registry, timeout=60) as runner:
            yield runner
        assert runner.exception is None, runner.output

    yield run


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return stack.condition(obj, type_) or {}


def _warnings(cluster: Cluster, ns: str, name: str) -> list[tuple[str, str]]:
    items = cluster.kubectl_json("-n", ns, "get", "events", "--field-selector", f"involvedObject.name={name}")["items"]
    return [(e["reason"], e["message"]) for e in items if e["type"] == "Warning"]


def _stalled(o: dict[str, Any]) -> bool:
    return _condition(o, "Stalled").get("status") == "True"


def test_secrets_are_stalled_unless_the_operator_allows_them(
        cluster: Cluster, namespace: str, run_operator: Operator) -> None:
    ns = namespace
    with run_operator(OperatorConfig(timer_interval_seconds=1.0)):
        cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis("secretive", replicas=0, template=SECRET_TEMPLATE))
        obj = wait_cr(cluster, ns, "secretive", _stalled, DEADLINE_SECONDS, "Stalled=True")
        ready = _condition(obj, "Ready")
        assert ready["status"] == "False" and ready["reason"] == "SecretsNotAllowed"
        expected = ("spec.template.volumes[2] (hf-token): Secret volumes are not allowed by this operator "
                    "(chart value operator.allowSecrets)")
        assert ready["message"] == expected
        assert ("SecretsNotAllowed", expected) in stack.wait_for(
            lambda: _warnings(cluster, ns, "secretive"), DEADLINE_SECONDS, "the Warning Event", interval=0.5)
        assert cluster.kubectl("-n", ns, "get", "deployment", "secretive-worker", check=False).returncode != 0

    with run_operator(OperatorConfig(timer_interval_seconds=1.0, allow_secrets=True)):
        cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis("allowed", replicas=0, template=SECRET_TEMPLATE))
        wait_cr(cluster, ns, "allowed", lambda o: _condition(o, "Ready").get("status") == "True",
                DEADLINE_SECONDS, "Ready=True")
        dep = cluster.kubectl_json("-n", ns, "get", "deployment", "allowed-worker")
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        assert volumes["hf-token"]["secret"]["secretName"] == "hf"


def test_a_deployment_the_api_server_refuses_is_stalled_naming_the_field_and_not_retried(
        cluster: Cluster, namespace: str, run_operator: Operator, monkeypatch: pytest.MonkeyPatch) -> None:
    ns, name = namespace, "badprio"
    attempts: list[float] = []
    lock = threading.Lock()
    apply = kube.apply

    def counting(manifest: dict[str, Any]) -> dict[str, Any]:
        if manifest["kind"] == "Deployment" and manifest["metadata"]["name"] == f"{name}-worker":
            with lock:
                attempts.append(time.monotonic())
        return apply(manifest)

    monkeypatch.setattr(kube, "apply", counting)
    with run_operator(OperatorConfig(timer_interval_seconds=1.0)):
        # The CRD leaves priorityClassName free; the Deployment's own validation refuses it (422).
        cluster.kubectl("-n", ns, "apply", "-f", "-",
                        input=moeis(name, replicas=0, template={"priorityClassName": "Bad_Name"}))
        obj = wait_cr(cluster, ns, name, _stalled, DEADLINE_SECONDS, "Stalled=True")
        stalled = _condition(obj, "Stalled")
        assert stalled["reason"] == "ApplyRefused", stalled
        assert "Deployment badprio-worker" in stalled["message"]
        assert "spec field spec.template.priorityClassName" in stalled["message"]
        events = stack.wait_for(lambda: [m for r, m in _warnings(cluster, ns, name) if r == "ApplyRefused"],
                                DEADLINE_SECONDS, "the Warning Event", interval=0.5)
        assert "spec.template.priorityClassName" in events[0]
        seen = len(attempts)
        time.sleep(QUIET_SECONDS)
        print(f"\nDeployment apply attempts: {seen} until Stalled, {len(attempts)} after {QUIET_SECONDS} s more")
        assert seen == 1 and len(attempts) == seen


def test_a_transient_refusal_is_retried_a_bounded_number_of_times_then_stalled(
        cluster: Cluster, namespace: str, run_operator: Operator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API server answers 503 to every apply of the Deployment (injected: a real API server does not
    fail on demand); the operator tries MAX_RETRIES + 1 times, then stalls with ApplyFailed."""
    ns, name = namespace, "flaky"
    attempts: list[float] = []
    apply = kube.apply

    def unavailable(manifest: dict[str, Any]) -> dict[str, Any]:
        if manifest["kind"] == "Deployment" and manifest["metadata"]["name"] == f"{name}-worker":
            attempts.append(time.monotonic())
            raise ApiException(status=503, reason="Service Unavailable")
        return apply(manifest)

    monkeypatch.setattr(kube, "apply", unavailable)
    monkeypatch.setattr(apply_errors, "RETRY_DELAY_SECONDS", 0.5)
    with run_operator(OperatorConfig(timer_interval_seconds=1.0)):
        cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis(name, replicas=0))
        obj = wait_cr(cluster, ns, name, _stalled, DEADLINE_SECONDS, "Stalled=True")
        stalled = _condition(obj, "Stalled")
        assert stalled["reason"] == "ApplyFailed" and "gave up after 6 tries" in stalled["message"], stalled
        time.sleep(5)
        assert len(attempts) == apply_errors.MAX_RETRIES + 1
