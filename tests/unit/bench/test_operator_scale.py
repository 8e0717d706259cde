"""bench.operator_scale's status diff: which status fields an idle operator rewrote."""
from __future__ import annotations

import copy
from typing import Any

import pytest
from bench.operator_scale import report, status_changes, status_paths

pytestmark = pytest.mark.unit


def svc(rv: int, message: str = "Prometheus at http://p: PrometheusTimeout", observed_time: str = "t0",
        extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"resourceVersion": str(rv)}, "status": {
        "conditions": [{"type": "Ready", "status": "True", "reason": "PodsReady", "message": "1/1"},
                       {"type": "MetricsAvailable", "status": "False", "reason": "MetricsUnavailable",
                        "message": message}],
        "observed": {"time": observed_time, "memoryRatio": 0.5}, "budgetGeneration": 1, **(extra or {})}}


def test_paths_name_the_condition_field_and_one_level_into_objects() -> None:
    a, b = svc(1), svc(2, message="Prometheus at http://p: PrometheusTimeout (skew)", observed_time="t1",
                       extra={"budgetGeneration": 2})
    assert status_paths(a["status"], b["status"]) == [
        "budgetGeneration", "conditions[MetricsAvailable].message", "observed.time"]
    assert status_paths(a["status"], copy.deepcopy(a["status"])) == []
    gone = copy.deepcopy(a["status"])
    gone["conditions"] = gone["conditions"][:1]
    assert status_paths(a["status"], gone) == [
        "conditions[MetricsAvailable].message", "conditions[MetricsAvailable].reason",
        "conditions[MetricsAvailable].status", "conditions[MetricsAvailable].type"]


def test_changes_count_flips_between_listings_and_show_the_commonest_path() -> None:
    flip = "Prometheus at http://p: PrometheusTimeout (diag)"
    s0 = {"a": svc(1), "b": svc(1), "c": svc(1)}
    s1 = {"a": svc(2, message=flip), "b": svc(1), "c": svc(3, observed_time="t1")}
    s2 = {"a": svc(4), "b": svc(1), "c": svc(3, observed_time="t1")}  # a flips back: no net change
    s3 = {"a": svc(4), "b": svc(5), "c": svc(3, observed_time="t1")}  # b: a new resourceVersion, same status
    out = status_changes([s0, s1, s2, s3])
    assert out["services"] == 3
    assert out["paths"] == {"conditions[MetricsAvailable].message": 2, "(no status field)": 1, "observed.time": 1}
    assert out["examples"] == [
        {"service": "a", "path": "conditions[MetricsAvailable].message",
         "before": "Prometheus at http://p: PrometheusTimeout", "after": flip},
        {"service": "b", "path": "(no status field)", "before": "None", "after": "None"},
        {"service": "c", "path": "observed.time", "before": "t0", "after": "t1"}]
    assert status_changes([s0, s0]) == {"services": 0, "paths": {}, "examples": []}
    grown = status_changes([s0, s0 | {"d": svc(9)}])
    assert (grown["services"], grown["paths"], grown["examples"]) == (1, {"(created)": 1}, [])


def test_the_report_lists_the_changed_fields() -> None:
    run = {"services": 3, "create_seconds": 1.0, "all_ready_seconds": 2.0, "ready": 3,
           "operator_rss_peak_bytes": 2**20, "operator_rss_bytes": 2**20, "idle_minutes": 5.0,
           "idle_operator_writes": 2, "idle_other_writes": 0, "idle_status_rewrites": 1,
           "prometheus_queries_per_minute": 100.0, "delete_seconds": 1.0, "idle_writes_by_resource": {},
           "idle_status_changes": {"services": 1, "paths": {"observed.time": 2},
                                   "examples": [{"service": "s0001", "path": "observed.time", "before": "t0",
                                                 "after": "t1"}]}}
    text = report({"date": "d", "machine": "m", "runs": [run], "queries_per_minute_1_service": 100.0})
    assert "- 3 services: `observed.time` 2" in text
    assert "  - e.g. s0001 `observed.time`: `t0` -> `t1`" in text
