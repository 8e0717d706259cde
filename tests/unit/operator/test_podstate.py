from __future__ import annotations

from datetime import UTC, datetime

import pytest

from moeguard_operator.podstate import pod_facts

pytestmark = pytest.mark.unit


def pod(name: str, phase: str = "Running", restarts: int = 0, last_reason: str | None = None,
        finished: str = "2026-11-30T10:00:00Z", deleting: bool = False, started: str = "2026-11-30T09:00:00Z") -> dict:
    cs: dict = {"name": "worker", "restartCount": restarts, "state": {"running": {"startedAt": started}}}
    if last_reason:
        cs["lastState"] = {"terminated": {"reason": last_reason, "exitCode": 137, "finishedAt": finished}}
    meta: dict = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-30T10:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "containerStatuses": [cs]}}


def test_running_restarts_and_oom_kills() -> None:
    facts = pod_facts([
        pod("a", restarts=2, last_reason="OOMKilled", finished="2026-11-30T10:05:00Z"),
        pod("b", restarts=1, last_reason="Error"),
        pod("c", phase="Pending"),
        pod("d", deleting=True),
    ])
    assert facts.running == ("a", "b")
    assert facts.restarts == 3
    assert facts.oom_kills == (("a", "worker", datetime(2026, 11, 30, 10, 5, tzinfo=UTC)),)
    assert facts.oom_kills_after(datetime(2026, 11, 30, 10, 0, tzinfo=UTC)) == 1
    assert facts.oom_kills_after(datetime(2026, 11, 30, 10, 5, tzinfo=UTC)) == 0
    assert facts.latest_oom() == datetime(2026, 11, 30, 10, 5, tzinfo=UTC)


def test_no_pods() -> None:
    facts = pod_facts([])
    assert facts.running == () and facts.restarts == 0 and facts.latest_oom() is None


def test_pods_old_enough_for_a_slope() -> None:
    facts = pod_facts([pod("old", started="2026-11-30T09:00:00Z"), pod("young", started="2026-11-30T10:09:00Z"),
                       pod("gone", phase="Succeeded")])
    assert facts.running_since(datetime(2026, 11, 30, 10, 0, tzinfo=UTC)) == ("old",)
    assert facts.running_since(datetime(2026, 11, 30, 10, 10, tzinfo=UTC)) == ("old", "young")
