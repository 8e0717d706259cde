"""Observation from Prometheus: PromQL through prometheus-api-client.

Every query is an instant query over the service's series (labels ``namespace``
and ``moeis``, set by the worker itself). A failed query makes the whole look
*blind* (``error`` set, values None); an empty answer gives None for that value.
Never 0 (KEDA #965, AIBrix #1032: missing values read as 0.0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from prometheus_api_client import PrometheusConnect
from urllib3.util.retry import Retry

from moeguard_operator.models import MoEInferenceServiceSpec
from moeguard_operator.podstate import PodFacts
from moeguard_operator.policy import Observation
from moeguard_runtime.contract import (
    LABEL_NAMESPACE,
    LABEL_POD,
    LABEL_SERVICE,
    METRIC_E2E_LATENCY_SECONDS,
    METRIC_EXPERT_SKEW_RATIO,
    METRIC_MEMORY_GROWTH_BYTES_PER_SECOND,
    METRIC_MEMORY_LEAK_SUSPECTED,
    METRIC_MEMORY_USAGE_BYTES,
    METRIC_PROCESS_RSS_BYTES,
    METRIC_REJECTIONS_TOTAL,
)

QUERY_TIMEOUT_SECONDS = 5


@dataclass(frozen=True)
class Queries:
    """The PromQL the loop runs for one MoEInferenceService."""

    skew: str
    memory: str
    rss_slope: str
    leak_kinds: str
    growth: str
    rejection_rate: str
    p99_latency: str
    reporting_pods: str


def queries(namespace: str, name: str, window_seconds: int, leak_window_seconds: int) -> Queries:
    """PromQL for ``name`` in ``namespace`` over the given windows (seconds)."""
    sel = f'{LABEL_NAMESPACE}="{namespace}",{LABEL_SERVICE}="{name}"'
    w, lw = f"{window_seconds}s", f"{leak_window_seconds}s"
    return Queries(
        skew=f"max(max_over_time({METRIC_EXPERT_SKEW_RATIO}{{{sel}}}[{w}]))",
        memory=f"max(max_over_time({METRIC_MEMORY_USAGE_BYTES}{{{sel}}}[{w}]))",
        rss_slope=f"max by ({LABEL_POD}) (deriv({METRIC_PROCESS_RSS_BYTES}{{{sel}}}[{lw}]))",
        leak_kinds=f"max by ({LABEL_POD}, kind) ({METRIC_MEMORY_LEAK_SUSPECTED}{{{sel}}})",
        growth=f"max by ({LABEL_POD}, part) ({METRIC_MEMORY_GROWTH_BYTES_PER_SECOND}{{{sel}}})",
        rejection_rate=f"sum(rate({METRIC_REJECTIONS_TOTAL}{{{sel}}}[{w}]))",
        p99_latency=f"histogram_quantile(0.99, sum by (le) (rate({METRIC_E2E_LATENCY_SECONDS}_bucket{{{sel}}}[{w}])))",
        reporting_pods=f"count by ({LABEL_POD}) ({METRIC_PROCESS_RSS_BYTES}{{{sel}}})",
    )


def skew_query(namespace: str, name: str, window_seconds: int) -> str:
    """PromQL: the highest expert skew ratio among ``name``'s pods over the window."""
    return queries(namespace, name, window_seconds, window_seconds).skew


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


def parse_by_label(result: Any, label: str) -> dict[str, float]:
    """``{label value: number}`` from an instant-query ``result``; malformed or non-finite entries are left out."""
    out: dict[str, float] = {}
    if not isinstance(result, list):
        return out
    for r in result:
        try:
            key, value = str(r["metric"][label]), float(r["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if math.isfinite(value):
            out[key] = value
    return out


def parse_by_labels(result: Any, labels: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    """``{(value of each of labels): number}`` from an instant-query ``result``; malformed or non-finite
    entries (a missing label, a null metric) are left out."""
    out: dict[tuple[str, ...], float] = {}
    if not isinstance(result, list):
        return out
    for r in result:
        try:
            key, value = tuple(str(r["metric"][label]) for label in labels), float(r["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if math.isfinite(value):
            out[key] = value
    return out


def leak_signals(kinds_result: Any, growth_result: Any,
                 counted: Callable[[str], bool]) -> tuple[tuple[str, ...], tuple[tuple[str, float], ...]]:
    """The leak kinds the counted pods flag (``moeguard_memory_leak_suspected{kind} == 1``), sorted, and the
    highest growth per memory part among them (``moeguard_memory_growth_bytes_per_second{part}``, bytes/s)."""
    kinds = sorted({kind for (pod, kind), v in parse_by_labels(kinds_result, (LABEL_POD, "kind")).items()
                    if counted(pod) and v >= 1})
    parts: dict[str, float] = {}
    for (pod, part), v in parse_by_labels(growth_result, (LABEL_POD, "part")).items():
        if counted(pod):
            parts[part] = max(v, parts.get(part, -math.inf))
    return tuple(kinds), tuple(sorted(parts.items()))


def parse_label_values(result: Any, label: str) -> tuple[str, ...]:
    """The values of ``label`` across the series of an instant-query ``result``, sorted."""
    if not isinstance(result, list):
        return ()
    return tuple(sorted({str(r["metric"][label]) for r in result if isinstance(r, dict) and label in r.get("metric", {})}))


def observe(
    prometheus_url: str,
    namespace: str,
    name: str,
    *,
    hard_limit_bytes: int,
    window_seconds: int,
    leak_window_seconds: int,
    expected_pods: tuple[str, ...],
    new_oom_kills: int,
    now: datetime,
    slope_pods: tuple[str, ...] | None = None,
) -> Observation:
    """One look at Prometheus for ``name``; Kubernetes facts (pods, OOM kills) are passed in.

    ``slope_pods``: the pods whose RSS slope counts — those whose worker has run for at
    least the leak window, so that start-up growth (model load, first batches) is never
    read as a leak. None: every pod.
    """
    q = queries(namespace, name, window_seconds, leak_window_seconds)
    base = Observation(time=now, expected_pods=expected_pods, new_oom_kills=new_oom_kills)
    try:
        # Fail fast (no retries with back-off): the next tick looks again, and a slow tick delays
        # kopf's handling of the resource (deletion waits for a running timer to finish).
        prom = PrometheusConnect(url=prometheus_url, disable_ssl=True, timeout=QUERY_TIMEOUT_SECONDS,
                                 retry=Retry(total=0))
        answers = {field: prom.custom_query(query=getattr(q, field)) for field in q.__dataclass_fields__}
    except Exception as exc:  # any transport or HTTP failure means: blind
        return Observation(time=now, expected_pods=expected_pods, new_oom_kills=new_oom_kills,
                           error=f"Prometheus at {prometheus_url} failed: {type(exc).__name__}: {exc}"[:500])
    skew, _ = parse_scalar(answers["skew"])
    memory, memory_err = parse_scalar(answers["memory"])
    def counts(pod: str) -> bool:
        return slope_pods is None or pod in slope_pods

    slopes = parse_by_label(answers["rss_slope"], LABEL_POD)
    counted = [v for pod, v in slopes.items() if counts(pod)]
    slope = max(counted) if counted else None
    leak_kinds, growth = leak_signals(answers["leak_kinds"], answers["growth"], counts)
    rejections, _ = parse_scalar(answers["rejection_rate"])
    p99, _ = parse_scalar(answers["p99_latency"])
    missing = [f"memory: {memory_err}"] if memory_err else []  # skew appears only after large batches
    return Observation(
        time=base.time,
        skew_ratio=skew,
        memory_ratio=None if memory is None else memory / hard_limit_bytes,
        rss_slope_bytes_per_second=slope,
        leak_kinds=leak_kinds,
        growth_bytes_per_second=growth,
        rejection_rate_per_second=rejections,
        p99_latency_seconds=p99,
        expected_pods=expected_pods,
        reporting_pods=parse_label_values(answers["reporting_pods"], LABEL_POD),
        new_oom_kills=new_oom_kills,
        error="; ".join(missing) or None,
    )


def observe_service(default_url: str | None, namespace: str, name: str, spec: MoEInferenceServiceSpec,
                    facts: PodFacts, new_oom_kills: int, now: datetime) -> Observation:
    """One look for a service: at ``spec.control.prometheusUrl``, else ``default_url`` (the operator's);
    with neither, a blind observation that says so. Kubernetes facts (pods, OOM kills) are passed in."""
    url = spec.control.prometheus_url or default_url
    if not url:
        return Observation(time=now, expected_pods=facts.running, new_oom_kills=new_oom_kills,
                           error="no Prometheus URL configured (spec.control.prometheusUrl or --prometheus-url)")
    control = spec.control
    return observe(url, namespace, name, hard_limit_bytes=spec.resources.hard_limit_bytes,
                   window_seconds=control.window_seconds, leak_window_seconds=control.leak_window_seconds,
                   expected_pods=facts.running, new_oom_kills=new_oom_kills, now=now,
                   slope_pods=facts.running_since(now - timedelta(seconds=control.leak_window_seconds)))
