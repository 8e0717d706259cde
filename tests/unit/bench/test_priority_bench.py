"""The priority benchmark's pure parts: per-class summaries, capacity, the mix, the report."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from bench import priority as bp

pytestmark = pytest.mark.unit


def rec(status: int | None = 200, ttft: float = 0.1, latency: float = 0.5, code: str | None = None,
        error: str | None = None, tokens: int = 16) -> dict[str, Any]:
    return {"status": status, "error": error, "code": code, "end_s": 1.0, "ttft_s": ttft, "latency_s": latency,
            "completion_tokens": tokens}


def test_class_summary_counts_refusals_by_status_and_reason_and_times_only_the_answered() -> None:
    records = [rec(ttft=t / 10) for t in range(1, 21)] + [
        rec(503, code="priority_shed", error="shed"), rec(429, code="queue_full", error="full"),
        rec(200, code="priority_shed", error="shed in the stream"), rec(503, code="priority_shed", error="shed")]
    s = bp.class_summary(records)
    assert s["sent"] == 24 and s["answered"] == 20
    assert s["refused"] == {"200 priority_shed": 1, "429 queue_full": 1, "503 priority_shed": 2}
    assert s["ttft_p50_s"] == pytest.approx(1.05) and s["ttft_p95_s"] == pytest.approx(1.905)
    assert s["completion_tokens"] == 20 * 16


def test_steady_throughput_leaves_out_the_ramp_and_the_tail() -> None:
    ends = [0.0, 0.1] + [1.0 + i * 0.5 for i in range(17)] + [30.0]  # 2 requests per second in the middle
    assert bp.steady_throughput(ends) == pytest.approx(2.0, rel=0.15)
    assert bp.steady_throughput([1.0, 2.0]) is None


def test_poisson_mix_is_seeded_and_half_interactive() -> None:
    a, b = bp.poisson_mix(20.0, 100.0, seed=3), bp.poisson_mix(20.0, 100.0, seed=3)
    assert a == b and 1800 < len(a) < 2200
    share = sum(1 for kind, _ in a if kind is bp.INTERACTIVE) / len(a)
    assert 0.45 < share < 0.55
    assert all(t2 > t1 for (_, t1), (_, t2) in itertools.pairwise(a))


def _arm(ratio: float) -> dict[str, Any]:
    cls = bp.class_summary([rec()] * 4 + [rec(503, code="priority_shed", error="shed")])
    return {"unloaded": bp.class_summary([rec()] * 4), "loaded": {"interactive": cls, "batch": cls},
            "ttft_ratio": ratio, "latency_ratio": ratio, "goodput_rps": 1.0}


def test_aggregate_and_render_report_medians_and_the_verdict() -> None:
    reps = [{"rep": i, "capacity_rps": 5.0 + i, "offered_rps": 10.0 + 2 * i, "requests": 100, "order": list(bp.ARMS),
             "arms": {"priority": _arm(1.2 + i / 10), "fcfs": _arm(6.0)}} for i in range(3)]
    agg = bp.aggregate(reps)
    assert agg["capacity_rps"] == 6.0 and agg["priority"]["ttft_ratio"] == pytest.approx(1.3)
    assert agg["priority"]["batch"]["refused"] == {"503 priority_shed": 3}
    doc = {"date": "today", "machine": {"cpu": "cpu", "cores": 2, "torch": "2"}, "reps": reps, "aggregate": agg,
           "config": {"preset": bp.PRESET, "budgets": bp.BUDGETS, "arms": bp.ARMS, "slots": bp.SLOTS, "reps": 3,
                      "seconds": 20.0, "capacity_requests": 64, "unloaded_requests": 24,
                      "interactive": bp.INTERACTIVE.__dict__, "batch": bp.BATCH.__dict__}}
    md = bp.render(doc)
    assert "`priority` arm: 1.30×** (target ≤ 1.5×: **met**" in md
    assert "fcfs`), same load, same run: TTFT ratio 6.00×" in md
    agg["priority"]["ttft_ratio"] = 1.6
    assert "**missed**" in bp.render(doc)
