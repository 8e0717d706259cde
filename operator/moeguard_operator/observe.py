"""Observation: Prometheus → :class:`~moeguard_operator.policy.Observation`.

The only I/O here is one PromQL instant query through prometheus-api-client.
A failed query or an empty result gives ``skew_ratio=None`` with the reason;
never 0 (KEDA #965, AIBrix #1032: missing values read as 0.0).
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from prometheus_api_client import PrometheusConnect

from moeguard_operator.policy import Observation
from moeguard_runtime.contract import LABEL_NAMESPACE, LABEL_SERVICE, METRIC_EXPERT_SKEW_RATIO

QUERY_TIMEOUT_SECONDS = 5


def skew_query(namespace: str, name: str, window_seconds: int) -> str:
    """PromQL: the highest expert skew ratio among ``name``'s pods over the window."""
    selector = f'{LABEL_NAMESPACE}="{namespace}",{LABEL_SERVICE}="{name}"'
    return f"max(max_over_time({METRIC_EXPERT_SKEW_RATIO}{{{selector}}}[{window_seconds}s]))"


def parse_scalar(result: Any) -> tuple[float | None, str | None]:
    """Read one number from an instant-query ``result`` list.

    Returns ``(value, None)``, or ``(None, reason)`` for an empty, malformed
    or non-finite answer.
    """
    if not isinstance(result, list) or not result:
        return None, "no series matched"
    try:
        value = float(result[0]["value"][1])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return None, f"malformed Prometheus answer: {exc!r}"
    if not math.isfinite(value):
        return None, f"non-finite value {value}"
    return value, None


def observe(prometheus_url: str, namespace: str, name: str, window_seconds: int, now: datetime) -> Observation:
    """Query Prometheus once for the service's skew ratio."""
    try:
        prom = PrometheusConnect(url=prometheus_url, disable_ssl=True, timeout=QUERY_TIMEOUT_SECONDS)
        result = prom.custom_query(query=skew_query(namespace, name, window_seconds))
    except Exception as exc:  # any transport or HTTP failure means: blind
        return Observation(time=now, skew_ratio=None, error=f"Prometheus at {prometheus_url} failed: {type(exc).__name__}: {exc}"[:500])
    value, error = parse_scalar(result)
    return Observation(time=now, skew_ratio=value, error=error)
