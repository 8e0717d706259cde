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
