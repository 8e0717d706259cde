"""The handlers' wiring, with the operator in this process (``kopf.testing.KopfRunner``) against the
local API server: registration with an :class:`OperatorConfig`, the config reaching the timer through
kopf's memo, the children, the typed status, the conditions and the Events.

The operator watches only the test's namespace, so it never meets another test's resources.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kopf
import kubernetes.config.kube_config
import pytest
from harness import stack
from kopf.testing import KopfRunner
from tests.integration.conftest import Cluster
from tests.integration.e2e.helpers import moeis, wait_cr

from moeguard_operator import handlers
from moeguard_operator.config import OperatorConfig

DEADLINE_SECONDS = 120
"""Generous: the machine may be loaded; each wait ends as soon as the state is there."""


@pytest.fixture
def operator_in_process(cluster: Cluster, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[KopfRunner]:
    stack.apply_crds(run_dir=cluster.run_dir)
    # kopf's login and kube.load_config load the default kubeconfig, whose path the kubernetes
    # client read from $KUBECONFIG when it was imported: point it at this cluster's.
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(cluster.kubeconfig))
    registry = kopf.OperatorRegistry()
    handlers.register(OperatorConfig(prometheus_url=cluster.prometheus_url, timer_interval_seconds=1.0), registry)
    with KopfRunner(["run", "--standalone", "--namespace", namespace], registry=registry, timeout=60) as runner:
        yield runner
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return stack.condition(obj, type_) or {}


def _events(cluster: Cluster, ns: str, name: str) -> list[tuple[str, str, str]]:
    items = cluster.kubectl_json("-n", ns, "get", "events", "--field-selector", f"involvedObject.name={name}")["items"]
    return [(e["type"], e["reason"], e["message"]) for e in items]


def test_a_service_gets_its_children_status_and_conditions(
        cluster: Cluster, no_pod_workers: None, namespace: str, operator_in_process: KopfRunner) -> None:
    ns = namespace
    # one CPU pod (kwok makes it Ready; no worker: ``no_pod_workers`` stops the session's harness, which would
    # otherwise serve it with a real worker): a service scaled to zero would never be looked at
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis("wired", replicas=1, resources={"gpus": 0},
                                                             batching={"maxPrefillTokens": 2048}))
    obj = wait_cr(cluster, ns, "wired", lambda o: _condition(o, "Ready").get("status") == "True"
                  and _condition(o, "MetricsAvailable"), DEADLINE_SECONDS, "Ready=True and a first look")

    status = obj["status"]
    assert status["observedGeneration"] == obj["metadata"]["generation"]
    assert status["budgets"]["maxPrefillTokens"] == 2048 and status["initialBudgets"] == status["budgets"]
    assert status["budgetGeneration"] == 1 and status["overloadMode"] == "Off"
    assert status["replicas"] == 1 and status["readyReplicas"] == 1
    assert status["selector"] == "app.kubernetes.io/name=moeguard-worker,app.kubernetes.io/instance=wired"
    assert (_condition(obj, "Stalled")["status"], _condition(obj, "Reconciling")["status"]) == ("False", "False")
    assert _condition(obj, "Ready")["reason"] == "AllReplicasReady"
    # The timer read the Prometheus URL from the OperatorConfig in kopf's memo: it looked there.
    looked = _condition(obj, "MetricsAvailable")
    assert looked["status"] == "False" and "no Prometheus URL configured" not in looked["message"], looked
    assert status["control"]["oomCheckedTime"] and status["observed"]["oomKills"] == 0

    for kind, child in (("deployment", "wired-worker"), ("service", "wired"), ("configmap", "wired-budget"),
                        ("poddisruptionbudget", "wired-worker"), ("serviceaccount", "wired-worker"),
                        ("role", "wired-worker"), ("rolebinding", "wired-worker")):
        got = cluster.kubectl_json("-n", ns, "get", kind, child)
        assert got["metadata"]["ownerReferences"][0]["name"] == "wired", (kind, got["metadata"])
    assert ("Normal", "Reconciled") in [(t, r) for t, r, _ in _events(cluster, ns, "wired")]


def test_a_spec_the_operator_cannot_serve_stalls_with_an_event(
        cluster: Cluster, namespace: str, operator_in_process: KopfRunner) -> None:
    ns = namespace
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis("unserved", replicas=0, model={"preset": "gpt-17"}))
    obj = wait_cr(cluster, ns, "unserved", lambda o: _condition(o, "Stalled").get("status") == "True",
                  DEADLINE_SECONDS, "Stalled=True")
    ready = _condition(obj, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "UnknownModelPreset")
    assert "unknown model preset 'gpt-17'" in ready["message"]
    assert _condition(obj, "Reconciling")["status"] == "False"
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    assert "budgets" not in obj["status"]
    events = _events(cluster, ns, "unserved")
    assert any(t == "Warning" and r == "UnknownModelPreset" for t, r, _ in events), events
    assert cluster.kubectl("-n", ns, "get", "deployment", "unserved-worker", check=False).returncode != 0
