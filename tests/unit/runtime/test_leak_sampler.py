"""The worker's leak flag waits out its warm-up (:data:`leak_sampler.GROWTH_WARMUP_S`): a fresh process's growth
is never a leak, and the judgement after the warm-up reads only the samples taken after it."""

from __future__ import annotations

import pytest

from moeguard_runtime.memory.procmem import ProcessMemory
from moeguard_runtime.telemetry.leak_sampler import GROWTH_WARMUP_S, LeakSampler
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

pytestmark = pytest.mark.unit
KIB = 1024


class _Quiet:
    def info(self, event: str, **kw: object) -> None:
        pass


def sampler(anon_at: dict[int, int], blocks_per_s: int) -> tuple[LeakSampler, Telemetry, list[int]]:
    """A sampler reading anonymous RSS ``anon_at[t]`` (bytes) at second ``t`` and ``blocks_per_s`` new Python blocks
    a second."""
    now = [0]
    tel = Telemetry({"moeis": "s", "namespace": "n", "pod": "p"}, 8)

    def read() -> ProcessMemory:
        t = now[0]
        return ProcessMemory(rss=anon_at[t], rss_anonymous=anon_at[t], rss_file=0, mappings=100,
                             python_allocated_blocks=1000 + blocks_per_s * t, malloc_in_use=None)

    return LeakSampler(tel, RateLimitedLog(0.0, logger=_Quiet()), read), tel, now


def flag(tel: Telemetry, kind: str) -> float:
    return float(tel.leak.labels(**tel.l(kind=kind))._value.get())


def test_a_birth_growth_is_not_a_leak_and_leaves_the_window_with_the_warm_up() -> None:
    warm = int(GROWTH_WARMUP_S)
    # 200 KiB/s of anonymous RSS with Python blocks for the warm-up (a fresh process), flat after it
    anon = {t: 500 * 2**20 + 200 * KIB * min(t, warm) for t in range(warm + 30)}
    leak, tel, now = sampler(anon, blocks_per_s=50)
    for t in range(warm + 30):
        now[0] = t
        leak.sample(float(t))
        assert leak.kind == "none" and flag(tel, "python_heap") == 0, t
    assert leak.growth.growth().rss_anonymous_bytes == 0  # the window holds only flat, grown-up samples


def test_a_leak_is_flagged_once_the_warm_up_is_over() -> None:
    warm = int(GROWTH_WARMUP_S)
    anon = {t: 500 * 2**20 + 4_000_000 * t for t in range(warm + 10)}  # a native leak of 4 MB/s from the start
    leak, tel, now = sampler(anon, blocks_per_s=0)
    kinds = []
    for t in range(warm + 10):
        now[0] = t
        leak.sample(float(t))
        kinds.append(leak.kind)
    assert set(kinds[:warm]) == {"none"}  # not judged while warming, whatever it grows
    first = kinds.index("native")
    assert first == warm + 4 and flag(tel, "native") == 1  # the 5th grown-up sample judges it
