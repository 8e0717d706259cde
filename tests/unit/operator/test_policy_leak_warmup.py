"""A pod's RSS slope counts for the leak judgement and the diagnosis only once its leak window starts after the
worker's warm-up (observation.LEAK_WARMUP_SECONDS)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from moeguard_operator.loop.observation import LEAK_WARMUP_SECONDS, leak_window_start
from moeguard_operator.loop.podstate import pod_facts

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 1, 15, 0, tzinfo=UTC)


def running_pod(name: str, started: datetime) -> dict[str, object]:
    return {"metadata": {"name": name}, "status": {
        "phase": "Running", "startTime": started.isoformat().replace("+00:00", "Z"),
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [{"name": "worker", "ready": True, "restartCount": 0,
                               "state": {"running": {"startedAt": started.isoformat().replace("+00:00", "Z")}}}]}}


def test_the_leak_window_starts_after_the_warm_up() -> None:
    assert leak_window_start(NOW, 600) == NOW - timedelta(seconds=600 + LEAK_WARMUP_SECONDS)
    lw = 30
    old = running_pod("old", NOW - timedelta(seconds=lw + LEAK_WARMUP_SECONDS + 1))
    young = running_pod("young", NOW - timedelta(seconds=lw + LEAK_WARMUP_SECONDS - 1))
    window_only = running_pod("window-only", NOW - timedelta(seconds=lw + 1))  # counted before the warm-up existed
    facts = pod_facts([old, young, window_only])
    assert facts.running_since(leak_window_start(NOW, lw)) == ("old",)
    # a shorter warm-up (the operator's --leak-warmup-seconds, in tests): the same rule, sooner
    assert leak_window_start(NOW, lw, warmup_seconds=5) == NOW - timedelta(seconds=lw + 5)
    assert facts.running_since(leak_window_start(NOW, lw, warmup_seconds=0)) == ("old", "window-only", "young")
