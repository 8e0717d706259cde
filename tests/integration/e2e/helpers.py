"""Shared helpers of the end-to-end tests: the operator fixture lives in conftest.py."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
from harness import stack
from tests.integration.conftest import Cluster

PORT_OFFSET = int(os.environ.get("MOEGUARD_PORT_OFFSET", "0"))
"""hack/cluster-up.sh shifts every port by it (a second cluster beside the first); so do the operator's."""
OPERATOR_METRICS_PORT = 18081 + PORT_OFFSET
OPERATOR_LIVENESS_PORT = 18082 + PORT_OFFSET
TEST_LEAK_WARMUP_SECONDS = 20
"""The worker warm-up (operator flag ``--leak-warmup-seconds``) of the e2e modules that wait for a leak judgement
(a module's ``OPERATOR_EXTRA_ARGS``) while their workers are idle, so the 90 s of
``observation.LEAK_WARMUP_SECONDS`` (the rule itself is unit-tested) would only make them wait."""
THRESHOLD_POLICY = ("--policy", "threshold")
"""The operator flags of the modules whose story is the ``threshold`` policy's (issue 11: a skew burst past
``skewThreshold`` halves the budgets, refusals turn overload mode on), which the default ``predictive`` policy
(issue 30) rightly leaves alone when the step has room: they keep testing that policy and the safety rules it
shares with ``predictive`` (blind time, stale series, short history, OOM kills, durable decisions). The default
policy's own e2e tests: test_predictive_e2e, test_leak_replacement_e2e, test_autoscale_e2e, and every module
without this flag."""


def operator_looks(namespace: str, name: str, result: str | None = None, port: int = OPERATOR_METRICS_PORT) -> float:
    """Looks at Prometheus the operator made for a service (``moeguard_operator_prometheus_looks_total`` on its
    ``--metrics-port``), of one ``result`` (``ok``, ``blind``) or all; 0 when none. The time of each look lives
    in the operator's memory and metrics, not in status (status changes only when what it says changes).

    Raises:
        httpx.HTTPError: the operator's metrics endpoint does not answer.
    """
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if (line.startswith("moeguard_operator_prometheus_looks_total{") and f'moeis="{name}"' in line
                and f'namespace="{namespace}"' in line and (result is None or f'result="{result}"' in line)):
            total += float(line.rsplit(" ", 1)[1])
    return total


def moeis(name: str, **spec: Any) -> str:
    return json.dumps({"apiVersion": "moeguard.dev/v1alpha1", "kind": "MoEInferenceService",
                       "metadata": {"name": name}, "spec": spec})


def get(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return dict(cluster.kubectl_json("-n", ns, "get", "moeis", name))


def ready_status(obj: dict[str, Any]) -> str | None:
    cond = stack.condition(obj, "Ready")
    return None if cond is None else str(cond["status"])


def wait(probe: Any, timeout: float, what: str) -> Any:
    return stack.wait_for(probe, timeout, what, interval=0.5)


def wait_cr(cluster: Cluster, ns: str, name: str, pred: Any, timeout: float, what: str) -> dict[str, Any]:
    """Poll the CR until ``pred(obj)`` holds; returns the object. On timeout the error names the last object's
    conditions (type, status, reason, message) and its ``status.autoscaling.reason`` where it has one, so a
    failure says what the operator last wrote."""
    last: list[dict[str, Any]] = []

    def probe() -> dict[str, Any] | None:
        obj = get(cluster, ns, name)
        last[:] = [obj]
        return obj if pred(obj) else None
    try:
        return dict(wait(probe, timeout, what))
    except TimeoutError as exc:
        conditions = [(c.get("type"), c.get("status"), c.get("reason"), c.get("message"))
                      for c in (last[0].get("status") or {}).get("conditions") or []] if last else None
        scaling = ((last[0].get("status") or {}).get("autoscaling") or {}).get("reason") if last else None
        because = f"; last status.autoscaling.reason: {scaling}" if scaling else ""
        raise TimeoutError(f"{exc}; last conditions: {conditions}{because}") from None


Event = tuple[str, str, str]
"""One core/v1 Event as the tests read it: ``(type, reason, message)``."""
EVENT_DEADLINE = 30.0
"""Seconds an Event may follow the status it goes with: the operator posts a look's Events after its status patch
(the status is the durable record; an Event is best effort), so a test that has just seen the status may read the
Events a moment too early (CI of stop 36: ``OOMKilled`` and ``ScaleUpRefused`` not yet there when read once)."""


def reasons(cluster: Cluster, ns: str, name: str) -> list[Event]:
    """The Events about the object ``name`` in ``ns``, as ``(type, reason, message)``, in the API server's order."""
    items = cluster.kubectl_json("-n", ns, "get", "events", "--field-selector", f"involvedObject.name={name}")["items"]
    return [(e["type"], e["reason"], e["message"]) for e in items]


def wait_event(cluster: Cluster, ns: str, name: str, type_: str, reason: str, needle: str = "",
               timeout: float = EVENT_DEADLINE) -> list[Event]:
    """Wait until an Event of ``type_`` and ``reason`` whose message holds ``needle`` is about ``name``; returns
    all Events about it then (:func:`reasons`).

    Raises:
        TimeoutError: none within ``timeout`` seconds (the message lists the Events seen).
    """
    def probe() -> list[Event] | None:
        seen = reasons(cluster, ns, name)
        return seen if any((t, r) == (type_, reason) and needle in m for t, r, m in seen) else None
    try:
        return list(wait(probe, timeout, f"a {type_} {reason} Event about {name}"))
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; Events: {reasons(cluster, ns, name)}") from None
