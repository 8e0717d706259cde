from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from moeguard_operator.loop.conditions import find_condition, get_condition, set_condition
from moeguard_operator.spec.models import Condition

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_transition_time_moves_only_on_status_change() -> None:
    conds = set_condition([], "Ready", "False", "Waiting", "0/1", T0, 1)
    conds = set_condition(conds, "Ready", "False", "Waiting", "0/2", T0 + timedelta(seconds=5), 2)
    ready = find_condition(conds, "Ready")
    assert ready is not None
    assert ready.last_transition_time == T0 and ready.message == "0/2" and ready.observed_generation == 2
    conds = set_condition(conds, "Ready", "True", "AllReplicasReady", "", T0 + timedelta(seconds=9), 2)
    assert find_condition(conds, "Ready").last_transition_time == T0 + timedelta(seconds=9)  # type: ignore[union-attr]
    assert len(conds) == 1


def test_order_is_kept_and_new_types_are_appended() -> None:
    conds = set_condition([], "Stalled", "False", "Reconciled", "", T0, 1)
    conds = set_condition(conds, "Ready", "False", "Waiting", "", T0, 1)
    conds = set_condition(conds, "Stalled", "True", "InvalidSpec", "bad", T0, 2)
    assert [(c.type, c.status) for c in conds] == [("Stalled", "True"), ("Ready", "False")]
    assert find_condition(conds, "Overloaded") is None


def test_get_condition_reads_objects_as_the_api_returns_them() -> None:
    obj = {"conditions": [{"type": "Ready", "status": "True"}]}
    assert get_condition(obj["conditions"], "Ready") == {"type": "Ready", "status": "True"}
    assert get_condition(None, "Ready") is None


def _cond(status: str, reason: str) -> Condition:
    return Condition.model_validate({"type": "MetricsAvailable", "status": status, "reason": reason,
                                     "lastTransitionTime": T0.isoformat()})


def _obs(**kw):  # type: ignore[no-untyped-def]
    from moeguard_operator.loop.observation import Observation
    base = {"time": T0, "skew_ratio": 2.0, "memory_ratio": 0.5, "expected_pods": ("a", "b"), "reporting_pods": ("a", "b")}
    return Observation(**(base | kw))


def test_metrics_verdicts() -> None:
    from moeguard_operator.loop.conditions import metrics_verdict

    blind = _obs(skew_ratio=None, memory_ratio=None, error="memory: no series matched")
    first = metrics_verdict(blind, None, [], T0, grace_seconds=60)
    assert (first.status, first.reason, first.event) == ("False", "WaitingForMetrics", None)
    waiting = _cond("False", "WaitingForMetrics")
    assert metrics_verdict(blind, waiting, [], T0 + timedelta(seconds=59), 60).reason == "WaitingForMetrics"
    late = metrics_verdict(blind, waiting, [], T0 + timedelta(seconds=61), 60)
    assert (late.reason, late.event) == ("MetricsUnavailable", ("Warning", "MetricsUnavailable"))
    assert late.message == "memory: no series matched; budgets held, nothing loosens"
    seeing = _cond("True", "AllPodsReporting")
    lost = metrics_verdict(blind, seeing, [], T0, 60)
    assert (lost.reason, lost.event) == ("MetricsUnavailable", ("Warning", "MetricsUnavailable"))
    still = metrics_verdict(blind, _cond("False", "MetricsUnavailable"), [], T0, 60)
    assert still.event is None  # warned once, not every look
    silent = metrics_verdict(_obs(reporting_pods=("a",)), seeing, [], T0, 60)
    assert (silent.reason, silent.event) == ("SilentPods", ("Warning", "SilentPods")) and "b" in silent.message
    assert metrics_verdict(_obs(reporting_pods=("a",)), _cond("False", "AllPodsReporting"), ["b"], T0, 60).event is None
    back = metrics_verdict(_obs(), _cond("False", "SilentPods"), ["b"], T0, 60)
    assert (back.status, back.event) == ("True", ("Normal", "MetricsAvailable"))
