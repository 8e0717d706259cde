from __future__ import annotations

from pathlib import Path

import pytest

from moeguard_runtime.memory.memory import (
    MemoryPolicy,
    MemoryReading,
    MemoryState,
    decide,
    own_cgroups,
    read_memory,
    shrink_factor,
    start_headroom,
)

pytestmark = pytest.mark.unit

P = MemoryPolicy(soft_limit_bytes=800, hard_limit_bytes=1000, shrink_factor=0.5, hysteresis=0.1)


def test_soft_and_hard_with_hysteresis() -> None:
    s = decide(MemoryState.NORMAL, 700, P)
    assert s == MemoryState.NORMAL
    s = decide(s, 801, P)
    assert s == MemoryState.SOFT and shrink_factor(s, P) == 0.5
    s = decide(s, 750, P)  # below soft but above 720: stays shrunk
    assert s == MemoryState.SOFT
    s = decide(s, 1001, P)
    assert s == MemoryState.HARD
    s = decide(s, 900, P)
    assert s == MemoryState.SOFT
    s = decide(s, 719, P)
    assert s == MemoryState.NORMAL and shrink_factor(s, P) == 1.0


def test_unset_limits_never_trigger() -> None:
    assert decide(MemoryState.NORMAL, 10**15, MemoryPolicy(None, None)) == MemoryState.NORMAL


def test_reads_cgroup_v2_when_limited_else_rss(tmp_path: Path) -> None:
    (tmp_path / "memory.current").write_text("12345\n")
    (tmp_path / "memory.max").write_text("99999\n")
    r = read_memory(tmp_path)
    assert (r.usage_bytes, r.source, r.limit_bytes) == (12345, "cgroup_v2", 99999)
    (tmp_path / "memory.max").write_text("max\n")
    r = read_memory(tmp_path)
    assert r.source == "rss" and r.usage_bytes > 1_000_000


def test_reads_cgroup_v1(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text("500\n")
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("4096\n")
    assert read_memory(tmp_path).source == "cgroup_v1"
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    assert read_memory(tmp_path).source == "rss"


def test_the_figure_is_the_working_set_usage_minus_inactive_file_pages(tmp_path: Path) -> None:
    (tmp_path / "memory.current").write_text("900000\n")
    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.stat").write_text("anon 500000\nfile 400000\nactive_file 100000\ninactive_file 300000\n")
    r = read_memory(tmp_path)
    assert (r.usage_bytes, r.limit_bytes) == (600000, 1000000)  # the kubelet's working set
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.usage_in_bytes").write_text("800000\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("1000000\n")
    (v1 / "memory" / "memory.stat").write_text("inactive_file 1\ntotal_inactive_file 250000\n")
    assert read_memory(v1).usage_bytes == 550000  # v1: the hierarchical total


V2_ONLY = "0::/kubepods.slice/pod1.slice/cri-abc.scope\n"
HYBRID = ("12:memory:/kubepods/burstable/pod1/abc\n11:cpu,cpuacct:/kubepods/burstable/pod1/abc\n"
          "1:name=systemd:/kubepods/burstable/pod1/abc\n0::/\n")


def fake_cgroup(tmp_path: Path, text: str) -> Path:
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(text)
    return proc


def write(d: Path, **files: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (d / name.replace("__", ".")).write_text(value + "\n")


def test_own_cgroups_parses_v2_and_the_v1_memory_line(tmp_path: Path) -> None:
    assert own_cgroups(fake_cgroup(tmp_path, V2_ONLY)) == (
        "/kubepods.slice/pod1.slice/cri-abc.scope", None)
    assert own_cgroups(fake_cgroup(tmp_path, HYBRID)) == ("/", "/kubepods/burstable/pod1/abc")
    assert own_cgroups(fake_cgroup(tmp_path, "5:cpuset,memory:/x\n")) == (None, "/x")
    assert own_cgroups(tmp_path / "missing") == (None, None)


def test_v2_reads_the_own_cgroup_not_the_mount_root(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    write(root, memory__current="900000", memory__max="max")  # the host's root: unlimited
    own = root / "kubepods.slice" / "pod1.slice" / "cri-abc.scope"
    write(own, memory__current="123456", memory__max="1048576")
    r = read_memory(root, fake_cgroup(tmp_path, V2_ONLY))
    assert (r.usage_bytes, r.source, r.limit_bytes, r.cgroup_path) == (
        123456, "cgroup_v2", 1048576, str(own))


def test_v2_limit_on_an_ancestor_binds_the_container(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    pod = root / "kubepods.slice" / "pod1.slice"
    write(pod, memory__current="700000", memory__max="2000000")
    write(pod / "cri-abc.scope", memory__current="600000", memory__max="max")
    r = read_memory(root, fake_cgroup(tmp_path, V2_ONLY))
    assert (r.usage_bytes, r.limit_bytes, r.cgroup_path) == (700000, 2000000, str(pod))
    write(pod / "cri-abc.scope", memory__max="1500000")  # the tighter limit wins
    r = read_memory(root, fake_cgroup(tmp_path, V2_ONLY))
    assert (r.usage_bytes, r.limit_bytes) == (600000, 1500000)


def test_v2_path_not_mounted_falls_back_to_the_mount_root(tmp_path: Path) -> None:
    """A container without a cgroup namespace: /proc/self/cgroup names the host's
    path, but /sys/fs/cgroup is the container's own cgroup."""
    root = tmp_path / "cgroup"
    write(root, memory__current="4242", memory__max="8192")
    r = read_memory(root, fake_cgroup(tmp_path, V2_ONLY))
    assert (r.usage_bytes, r.source, r.limit_bytes, r.cgroup_path) == (
        4242, "cgroup_v2", 8192, str(root))


def test_v1_reads_the_memory_controller_path(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    unlimited = str(2**63 - 4096)
    write(root / "memory", memory__usage_in_bytes="99999999", memory__limit_in_bytes=unlimited)
    own = root / "memory" / "kubepods" / "burstable" / "pod1" / "abc"
    write(own, memory__usage_in_bytes="5000", memory__limit_in_bytes="65536")
    write(root / "unified", cgroup__procs="")  # hybrid: the unified mount has no memory files
    r = read_memory(root, fake_cgroup(tmp_path, HYBRID))
    assert (r.usage_bytes, r.source, r.limit_bytes, r.cgroup_path) == (
        5000, "cgroup_v1", 65536, str(own))
    write(own, memory__limit_in_bytes=unlimited)  # own unlimited, pod limited
    write(own.parent, memory__usage_in_bytes="7000", memory__limit_in_bytes="131072")
    r = read_memory(root, fake_cgroup(tmp_path, HYBRID))
    assert (r.usage_bytes, r.limit_bytes, r.cgroup_path) == (7000, 131072, str(own.parent))


def test_v1_path_not_mounted_falls_back_to_root_then_rss(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    write(root / "memory", memory__usage_in_bytes="300", memory__limit_in_bytes="4096")
    r = read_memory(root, fake_cgroup(tmp_path, HYBRID))
    assert (r.usage_bytes, r.source, r.cgroup_path) == (300, "cgroup_v1", str(root / "memory"))
    write(root / "memory", memory__limit_in_bytes=str(2**63 - 4096))
    r = read_memory(root, fake_cgroup(tmp_path, HYBRID))
    assert r.source == "rss" and r.cgroup_path is None and r.usage_bytes > 1_000_000
    r = read_memory(tmp_path / "no-cgroupfs", tmp_path / "no-proc-file")
    assert r.source == "rss"


def test_start_headroom_is_left_under_the_tightest_limit() -> None:
    cgroup = MemoryReading(usage_bytes=600, source="cgroup_v2", limit_bytes=1000)
    assert start_headroom(cgroup, None) == 400
    assert start_headroom(cgroup, 900) == 300  # the hard limit is tighter
    assert start_headroom(cgroup, 2000) == 400  # the cgroup's is tighter
    assert start_headroom(MemoryReading(usage_bytes=1100, source="cgroup_v2", limit_bytes=1000), None) == -100
    assert start_headroom(MemoryReading(usage_bytes=600, source="rss"), 1000) == 400
    assert start_headroom(MemoryReading(usage_bytes=600, source="rss"), None) is None  # no limit known
