"""Realistic inputs of `moeguard diagnose`'s report: a service under a burst (status.diagnosis with a
BurstOverlap finding), its Events, and ten minutes of range answers with gaps."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from moeguard_cli.diagnose_report import RangeAnswer, grid

NOW = datetime(2026, 12, 1, 14, 0, 10, tzinfo=UTC)
START, END, COUNT = grid(NOW, 10)
GiB = 2**30
PATCH = '{"spec":{"batching":{"maxConcurrentBatches":1}}}'


def matrix(*series: tuple[dict[str, str], dict[float, str]]) -> RangeAnswer:
    return RangeAnswer(body={"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": labels, "values": [[t, v] for t, v in sorted(points.items())]} for labels, points in series]}})


def at(i: int) -> float:
    return START + 30 * i


def service(diagnosis: dict[str, Any] | None = None, hard_limit: str = "8Gi") -> dict[str, Any]:
    status: dict[str, Any] = {
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": "2/2 ready",
             "lastTransitionTime": "2026-12-01T13:40:00Z"},
            {"type": "BurstOverlap", "status": "True", "reason": "BurstOverlap", "message": "3 prefills overlap",
             "lastTransitionTime": "2026-12-01T13:55:00Z"}],
        "budgets": {"maxPrefillTokens": 2048, "maxDecodeTokens": 256, "maxBatchRequests": 32,
                    "maxConcurrentBatches": 2},
        "observed": {"memoryRatio": 0.91, "skewRatio": 2.5},
    }
    if diagnosis is not None:
        status["diagnosis"] = diagnosis
    return {"apiVersion": "moeguard.dev/v1alpha1", "kind": "MoEInferenceService",
            "metadata": {"name": "mixtral", "namespace": "serving"},
            "spec": {"resources": {"hardLimit": hard_limit, "softLimit": "6Gi"}}, "status": status}


BURST = {
    "time": "2026-12-01T14:00:00Z",
    "findings": [{
        "kind": "BurstOverlap", "since": "2026-12-01T13:55:00Z", "lastSeen": "2026-12-01T14:00:00Z",
        "message": "3 prefill batches overlapped while memory reached 91% of the hard limit; expert buffers are "
                   "62% of the peak",
        "evidence": [
            {"signal": "prefill batches in flight", "value": 3, "unit": "batches",
             "metric": "moeguard_step_prefill_batches", "pod": "mixtral-0"},
            {"signal": "memory in use / hard limit", "value": 0.91, "unit": "ratio",
             "metric": "moeguard_memory_usage_bytes", "pod": "mixtral-0"},
            {"signal": "expert buffers in the peak", "value": 3 * GiB, "unit": "bytes",
             "metric": "moeguard_memory_peak_breakdown_bytes", "pod": "mixtral-0", "detail": "stage expert_buffers"}],
        "remedy": "Let one prefill run at a time: lower maxConcurrentBatches to 1.",
        "patch": PATCH, "pods": ["mixtral-0"]}],
    "missingSignals": ["moeguard_memory_peak_breakdown_bytes on mixtral-1 (silent pod)"],
}

EVENTS = [
    {"type": "Warning", "reason": "BurstOverlap", "message": "3 prefill batches overlapped", "count": 1,
     "lastTimestamp": "2026-12-01T13:55:02Z", "firstTimestamp": "2026-12-01T13:55:02Z"},
    {"type": "Normal", "reason": "BudgetTightened", "message": "maxPrefillTokens 4096 -> 2048", "count": 2,
     "lastTimestamp": "2026-12-01T13:56:00Z"},
    {"type": "Normal", "reason": "Reconciled", "message": "old", "count": 1,
     "lastTimestamp": "2026-12-01T12:00:00Z"},  # before the window: left out
    {"type": "Normal", "reason": "RoutingSkewCleared", "message": "skew back to 2.0", "count": None,
     "eventTime": "2026-12-01T13:58:30.123456Z", "series": {"count": 3, "lastObservedTime": "2026-12-01T13:59:00Z"}},
]


def answers() -> dict[str, RangeAnswer]:
    """Ten minutes of a service under a burst: memory climbs to 94 % of the hard limit, a gap at steps 5-6 (Prometheus missed
    two scrapes), refusals by reason, no KV cache series at all."""
    mem = {at(i): str((5.0 + 0.125 * i) * GiB) for i in range(COUNT) if i not in (5, 6)}
    return {
        "max_prefill_tokens": matrix(({}, {at(i): "4096" if i < 10 else "2048" for i in range(COUNT)})),
        "max_decode_tokens": matrix(({}, {at(i): "256" for i in range(COUNT)})),
        "max_batch_requests": matrix(({}, {at(i): "32" for i in range(COUNT)})),
        "max_concurrent_batches": matrix(({}, {at(i): "2" for i in range(COUNT)})),
        "skew_ratio": matrix(({}, {at(i): "NaN" if i < 3 else "2.5" for i in range(COUNT)})),
        "memory_bytes": matrix(({}, mem)),
        "soft_limit_bytes": matrix(({}, {at(i): str(6 * GiB) for i in range(COUNT)})),
        "hard_limit_bytes": matrix(({}, {at(i): str(8 * GiB) for i in range(COUNT)})),
        "refusals_per_second": matrix(({"reason": "memory"}, {at(i): "0.5" for i in range(15, COUNT)}),
                                      ({"reason": "queue_full"}, {at(i): "0.25" for i in range(17, COUNT)})),
        "batches_in_flight": matrix(({}, {at(i): "2" for i in range(COUNT)})),
        "queue_requests": matrix(({}, {at(i): str(i) for i in range(COUNT)})),
        "long_requests_running": matrix(({}, {at(i): "0" for i in range(COUNT)})),
        "kv_cache_bytes": matrix(),
    }
