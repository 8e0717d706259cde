"""Shared helpers of the end-to-end tests: the operator fixture lives in conftest.py."""

from __future__ import annotations

import json
import os
from typing import Any

from hack import stack
from tests.integration.conftest import Cluster

PORT_OFFSET = int(os.environ.get("MOEGUARD_PORT_OFFSET", "0"))
"""hack/cluster-up.sh shifts every port by it (a second cluster beside the first); so do the operator's."""
OPERATOR_METRICS_PORT = 18081 + PORT_OFFSET
OPERATOR_LIVENESS_PORT = 18082 + PORT_OFFSET


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
    """Poll the CR until ``pred(obj)`` holds; returns the object."""
    def probe() -> dict[str, Any] | None:
        obj = get(cluster, ns, name)
        return obj if pred(obj) else None
    return dict(wait(probe, timeout, what))
