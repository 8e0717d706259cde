"""hack/kubelet_status.py (the kubelet's back-off, termination reasons, readiness) and hack/memcg.py's
pure parts."""

from __future__ import annotations

import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hack import kubelet_status as ks
from hack.memcg import Hierarchy, find_hierarchies

pytestmark = pytest.mark.unit
T0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)


def test_back_off_is_the_kubelets_sequence() -> None:
    """First restart at once; then 10, 20, 40, 80, 160, 300, 300 s after each exit (exits right away)."""
    b, t, waits = ks.BackOff(), T0, []
    for _ in range(8):
        finished = t
        wait = b.wait_s(finished, finished)
        waits.append(wait)
        t = finished + timedelta(seconds=wait)
        b = b.restarted(finished, t)
    assert waits == [0, 10, 20, 40, 80, 160, 300, 300]
    # Waiting is counted from the exit: 4 s after it, 6 s of a 10 s back-off are left.
    b2 = ks.BackOff().restarted(T0, T0)
    assert b2.wait_s(T0, T0 + timedelta(seconds=4)) == 6 and b2.current_s(T0) == 10


def test_back_off_resets_after_ten_minutes_running() -> None:
    b = ks.BackOff(delay_s=300, last_update=T0)
    assert b.wait_s(T0 + timedelta(seconds=599), T0 + timedelta(seconds=599)) == 300
    later = T0 + timedelta(seconds=601)  # ran more than 2 x 300 s since the last restart
    assert b.wait_s(later, later) == 0 and b.restarted(later, later).delay_s == 10


def test_a_short_back_off_for_tests() -> None:
    b = ks.BackOff(1, 4)
    waits = []
    for _ in range(5):
        waits.append(b.wait_s(T0, T0))
        b = b.restarted(T0, T0)
    assert waits == [0, 1, 2, 4, 4]


@pytest.mark.parametrize(("returncode", "before", "after", "expected"), [
    (-signal.SIGKILL, 0, 1, ("OOMKilled", 137)),
    (-signal.SIGKILL, 1, 1, ("Error", 137)),  # killed, but not by the OOM killer
    (-signal.SIGTERM, 0, 1, ("Error", 143)),
    (3, 0, 0, ("Error", 3)),
    (0, 0, 0, ("Completed", 0)),
])
def test_termination(returncode: int, before: int, after: int, expected: tuple[str, int]) -> None:
    term = ks.termination(returncode, before, after)
    assert (term.reason, term.exit_code) == expected


def test_ready_conditions_keep_their_transition_time() -> None:
    prior = [{"type": "PodScheduled", "status": "True"},
             {"type": "Ready", "status": "False", "lastTransitionTime": "2026-11-30T09:00:00Z"}]
    not_ready = ks.ready_conditions(prior, False, ["worker"], T0)
    ready = {c["type"]: c for c in not_ready}["Ready"]
    assert ready["lastTransitionTime"] == "2026-11-30T09:00:00Z"  # no flip, no new time
    assert ready["message"] == "containers with unready status: [worker]"
    flipped = {c["type"]: c for c in ks.ready_conditions(not_ready, True, [], T0)}
    assert flipped["Ready"]["status"] == flipped["ContainersReady"]["status"] == "True"
    assert flipped["Ready"]["lastTransitionTime"] == "2026-11-30T10:00:00Z" and "reason" not in flipped["Ready"]
    assert flipped["PodScheduled"] == {"type": "PodScheduled", "status": "True"}


def test_probe_from_the_container_and_its_thresholds() -> None:
    probe = ks.Probe.from_container({"readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"},
                                                         "periodSeconds": 5, "failureThreshold": 2}})
    assert probe is not None and (probe.path, probe.period_s, probe.failure_threshold) == ("/readyz", 5, 2)
    assert ks.Probe.from_container({}) is None
    with pytest.raises(ValueError, match=r"\['exec'\] is not httpGet"):
        ks.Probe.from_container({"name": "w", "readinessProbe": {"exec": {"command": ["true"]}}})
    c = ks.ProbeCounter(probe)
    assert not c.ready and (c := c.observe(True)).ready
    assert (c := c.observe(False)).ready and not c.observe(False).ready  # 2 failures in a row


def test_find_hierarchies_v1_and_v2() -> None:
    mounts = ("cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n"
              "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
              "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
              "cgroup2 /sys/fs/cgroup2 cgroup2 rw 0 0\n")
    found = find_hierarchies(mounts, {Path("/sys/fs/cgroup/unified"): "cpu io",
                                      Path("/sys/fs/cgroup2"): "cpu memory pids"})
    assert found == [Hierarchy(1, Path("/sys/fs/cgroup/memory")), Hierarchy(2, Path("/sys/fs/cgroup2"))]
    assert [h.limit_file for h in found] == ["memory.limit_in_bytes", "memory.max"]
    assert find_hierarchies("", {}) == []


def test_no_writable_memory_cgroup_is_said_loudly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hack import memcg

    mounts = tmp_path / "mounts"
    mounts.write_text("cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n")
    monkeypatch.setattr(memcg, "PROC_MOUNTS", mounts)
    with pytest.raises(memcg.MemcgUnavailable, match="neither a cgroup v1 'memory' mount nor a cgroup2 mount"):
        memcg.memory_hierarchy()
    mounts.write_text(f"cgroup {tmp_path}/absent cgroup rw,memory 0 0\n")
    with pytest.raises(memcg.MemcgUnavailable, match=rf"cgroup v1 at {tmp_path}/absent: No such file or directory"):
        memcg.memory_hierarchy()
    with pytest.raises(ValueError, match="must be a relative path"):
        memcg.MemoryCgroup.create("../escape", 1 << 20, memcg.Hierarchy(1, tmp_path))
    with pytest.raises(ValueError, match="must be > 0 bytes"):
        memcg.MemoryCgroup.create("x", 0, memcg.Hierarchy(1, tmp_path))
