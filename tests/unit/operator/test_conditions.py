from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from moeguard_operator.conditions import get_condition, set_condition

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_transition_time_moves_only_on_status_change() -> None:
    conds = set_condition(None, "Ready", "False", "Waiting", "0/1", T0, 1)
    conds = set_condition(conds, "Ready", "False", "Waiting", "0/2", T0 + timedelta(seconds=5), 2)
    ready = get_condition(conds, "Ready")
    assert ready is not None
    assert ready["lastTransitionTime"] == T0.isoformat() and ready["message"] == "0/2" and ready["observedGeneration"] == 2
    conds = set_condition(conds, "Ready", "True", "AllReplicasReady", "", T0 + timedelta(seconds=9), 2)
    assert get_condition(conds, "Ready")["lastTransitionTime"] == (T0 + timedelta(seconds=9)).isoformat()  # type: ignore[index]
    assert len(conds) == 1


def _obs(**kw):  # type: ignore[no-untyped-def]
    from moeguard_operator.policy import Observation
    base = {"time": T0, "skew_ratio": 2.0, "memory_ratio": 0.5, "expected_pods": ("a", "b"), "reporting_pods": ("a", "b")}
    return Observation(**(base | kw))


def test_metrics_verdicts() -> None:
    from moeguard_operator.conditions import metrics_verdict

    blind = _obs(skew_ratio=None, memory_ratio=None, error="memory: no series matched")
    first = metrics_verdict(blind, None, [], T0, grace_seconds=60)
    assert (first.status, first.reason, first.event) == ("False", "WaitingForMetrics", None)
    waiting = {"status": "False", "reason": "WaitingForMetrics", "lastTransitionTime": T0.isoformat()}
    assert metrics_verdict(blind, waiting, [], T0 + timedelta(seconds=59), 60).reason == "WaitingForMetrics"
    late = metrics_verdict(blind, waiting, [], T0 + timedelta(seconds=61), 60)
    assert (late.reason, late.event) == ("MetricsUnavailable", ("Warning", "MetricsUnavailable"))
    assert late.message == "memory: no series matched; budgets held, nothing loosens"
    seeing = {"status": "True", "reason": "AllPodsReporting", "lastTransitionTime": T0.isoformat()}
    lost = metrics_verdict(blind, seeing, [], T0, 60)
    assert (lost.reason, lost.event) == ("MetricsUnavailable", ("Warning", "MetricsUnavailable"))
    still = metrics_verdict(blind, {"status": "False", "reason": "MetricsUnavailable", "lastTransitionTime": T0.isoformat()}, [], T0, 60)
    assert still.event is None  # warned once, not every look
    silent = metrics_verdict(_obs(reporting_pods=("a",)), seeing, [], T0, 60)
    assert (silent.reason, silent.event) == ("SilentPods", ("Warning", "SilentPods")) and "b" in silent.message
    assert metrics_verdict(_obs(reporting_pods=("a",)), {**seeing, "status": "False"}, ["b"], T0, 60).event is None
    back = metrics_verdict(_obs(), {"status": "False", "reason": "SilentPods", "lastTransitionTime": T0.isoformat()}, ["b"], T0, 60)
    assert (back.status, back.event) == ("True", ("Normal", "MetricsAvailable"))
