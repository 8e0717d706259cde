from __future__ import annotations

from pathlib import Path

import pytest

from moeguard_runtime.memory import MemoryPolicy, MemoryState, decide, read_memory, shrink_factor

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
