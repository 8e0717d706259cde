from __future__ import annotations

from datetime import UTC, datetime

import pytest

from moeguard_operator.loop.podstate import pod_facts

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


# Container statuses as the kubelet writes them for a worker that cannot load its checkpoint: it writes
# why to /dev/termination-log and exits 3; the kubelet restarts it, then backs off.
CRASH_LOOP = {
    "name": "worker", "ready": False, "restartCount": 4, "started": False,
    "state": {"waiting": {"reason": "CrashLoopBackOff",
                          "message": "back-off 1m20s restarting failed container=worker pod=q-worker-7d9c"}},
    "lastState": {"terminated": {
        "exitCode": 3, "reason": "Error", "startedAt": "2026-11-30T10:01:00Z", "finishedAt": "2026-11-30T10:01:04Z",
        "message": "model_load_error: /moeguard/model/model-00002-of-00002.safetensors: missing shard "
                   "(named by model.safetensors.index.json)"}},
}


def _pod_with(name: str, cs: dict, phase: str = "Running") -> dict:
    return {"metadata": {"name": name}, "status": {"phase": phase, "containerStatuses": [cs]}}


def test_a_crash_looping_worker_names_its_termination_message() -> None:
    facts = pod_facts([_pod_with("q-worker-7d9c", CRASH_LOOP)])
    assert facts.startup_failures == (("q-worker-7d9c",
        "container worker exited 3 (Error): model_load_error: /moeguard/model/model-00002-of-00002.safetensors: "
        "missing shard (named by model.safetensors.index.json) (CrashLoopBackOff)"),)
    assert facts.restarts == 4 and facts.oom_kills == ()


def test_waiting_errors_terminations_and_what_is_not_a_failure() -> None:
    pull = {"name": "worker", "ready": False, "restartCount": 0,
            "state": {"waiting": {"reason": "ImagePullBackOff",
                                  "message": "Back-off pulling image \"ghcr.io/moeguard/worker:nope\""}}}
    exited = {"name": "worker", "ready": False, "restartCount": 0,
              "state": {"terminated": {"exitCode": 2, "reason": "Error", "message": ""}}}
    creating = {"name": "worker", "ready": False, "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}
    loading = {"name": "worker", "ready": False, "restartCount": 0, "state": {"running": {"startedAt": "2026-11-30T10:00:00Z"}}}
    ready_again = {**CRASH_LOOP, "ready": True, "state": {"running": {"startedAt": "2026-11-30T10:02:00Z"}}}
    reloading = {**CRASH_LOOP, "state": {"running": {"startedAt": "2026-11-30T10:02:00Z"}}}
    deleting = _pod_with("e", CRASH_LOOP)
    deleting["metadata"]["deletionTimestamp"] = "2026-11-30T10:05:00Z"
    facts = pod_facts([_pod_with("a", pull, "Pending"), _pod_with("b", exited), _pod_with("c", creating, "Pending"),
                       _pod_with("d", loading), _pod_with("f", ready_again), deleting, _pod_with("g", reloading)])
    assert facts.startup_failures == (
        ("a", 'container worker ImagePullBackOff: Back-off pulling image "ghcr.io/moeguard/worker:nope"'),
        ("b", "container worker exited 2 (Error)"),
        ("g", "container worker exited 3 (Error): model_load_error: /moeguard/model/model-00002-of-00002.safetensors: "
              "missing shard (named by model.safetensors.index.json) (restarted, not ready)"),
    )


def test_a_log_tail_message_is_clipped_to_its_end() -> None:
    tail = "x" * 5000 + " model_load_error: truncated file"
    cs = {**CRASH_LOOP, "lastState": {"terminated": {"exitCode": 3, "reason": "Error", "message": tail}}}
    (_, failure), = pod_facts([_pod_with("p", cs)]).startup_failures
    assert failure.endswith("model_load_error: truncated file (CrashLoopBackOff)")
    assert len(failure) == len("container worker exited 3 (Error): ") + 2048 + len(" (CrashLoopBackOff)")


def test_crash_looping_pods_are_named_while_they_loop() -> None:
    """Named in the back-off, still named while the restarted container runs not ready, no longer once
    it is ready; one restart after an OOM kill (no back-off yet) is not a crash loop."""
    between = {**CRASH_LOOP, "state": {"running": {"startedAt": "2026-11-30T10:02:30Z"}}, "restartCount": 5}
    recovered = {**between, "ready": True}
    once = {"name": "worker", "ready": False, "restartCount": 1, "state": {"running": {"startedAt": "2026-11-30T10:00:01Z"}},
            "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled", "finishedAt": "2026-11-30T10:00:00Z"}}}
    deleting = _pod_with("e", CRASH_LOOP)
    deleting["metadata"]["deletionTimestamp"] = "2026-11-30T10:00:00Z"
    facts = pod_facts([_pod_with("a", CRASH_LOOP), _pod_with("b", between), _pod_with("c", recovered),
                       _pod_with("d", once), deleting])
    assert facts.crash_looping == ("a", "b")
    assert pod_facts([_pod_with("c", recovered)]).crash_looping == ()
