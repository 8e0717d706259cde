"""The diagnosis drills' pure parts (bench/diagnosis_drills.py): what a failed drill reports of the status."""

from __future__ import annotations

from bench.diagnosis_drills import BASE_SPEC, active_kinds, status_summary, warmup_seconds

from moeguard_operator.loop.observation import LEAK_WARMUP_SECONDS


def test_the_status_summary_says_why_a_finding_is_missing() -> None:
    obj = {"status": {
        "conditions": [{"type": "Ready", "status": "True"},
                       {"type": "MetricsAvailable", "status": "False", "reason": "SignalsMissing",
                        "message": "memory: no series matched", "lastTransitionTime": "2026-12-03T07:00:00Z"}],
        "diagnosis": {"missingSignals": ["memory in use"], "findings": [{"kind": "RoutingSkew"}]},
        "observed": {"skewRatio": 3.5}, "budgets": {"maxPrefillTokens": 1024}}}
    assert status_summary(obj) == {
        "missingSignals": ["memory in use"],
        "MetricsAvailable": {"status": "False", "reason": "SignalsMissing", "message": "memory: no series matched"},
        "observed": {"skewRatio": 3.5}, "budgets": {"maxPrefillTokens": 1024}}
    assert active_kinds(obj) == ["RoutingSkew"]
    assert status_summary({}) == {"missingSignals": None, "MetricsAvailable": {"status": None, "reason": None,
                                                                              "message": None},
                                  "observed": None, "budgets": None}


def test_the_drills_warm_up_covers_the_operators_leak_warm_up() -> None:
    c = BASE_SPEC["control"]
    assert warmup_seconds(BASE_SPEC) == LEAK_WARMUP_SECONDS + c["leakWindowSeconds"] + 2 * c["queryIntervalSeconds"]
