"""Trace parsing (the real Azure CSV) and scaling into a schedule."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from harness.loadgen.trace import (
    TRACE_PATH_ENV,
    TraceRecord,
    default_trace_path,
    load_schedule,
    read_trace,
    scale,
)

pytestmark = pytest.mark.unit

TRACE = default_trace_path()


def test_default_path_is_the_repositorys_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRACE_PATH_ENV, raising=False)
    repo = Path(__file__).resolve().parents[3]
    assert default_trace_path() == repo / "bench" / "traces" / "azure-llm-inference-2023-conv.csv"
    assert default_trace_path().is_file()
    monkeypatch.setenv(TRACE_PATH_ENV, "/tmp/other.csv")
    assert default_trace_path() == Path("/tmp/other.csv")


def test_read_real_trace() -> None:
    records = read_trace(TRACE)
    assert len(records) == 19_366
    assert records[0] == TraceRecord(arrival_s=0.0, context_tokens=374, generated_tokens=44)
    # 18:15:50.9951690 - 18:15:46.6805900
    assert records[1].arrival_s == pytest.approx(4.314579, abs=1e-9)
    assert (records[1].context_tokens, records[1].generated_tokens) == (396, 109)
    assert records[-1].arrival_s == pytest.approx(3501.721937, abs=1e-6)
    assert max(r.context_tokens for r in records) == 14_050
    assert all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(records))


def test_scale_real_trace_compression_10() -> None:
    records = read_trace(TRACE)
    sched = scale(records, time_compression=10, max_context=1024, limit=50)
    assert len(sched) == 50
    for rec, req in zip(records, sched.requests, strict=False):
        assert req.arrival_s == pytest.approx(rec.arrival_s / 10)
        assert req.prompt_tokens + req.max_tokens <= 1024
    assert sched.requests[1].arrival_s == pytest.approx(0.4314579)
    assert sched.requests[0].prompt_tokens == 374 and sched.requests[0].max_tokens == 44
    clamped = [r for r in sched.requests if r.clamped]
    assert sched.meta is not None
    assert sched.meta.n_clamped == len(clamped) > 0
    assert all(r.source_context_tokens + r.source_generated_tokens > 1024 for r in clamped)
    assert sched.meta.time_compression == 10 and sched.meta.limit == 50
    assert sched.meta.duration_s == pytest.approx(records[49].arrival_s / 10)


def test_load_schedule_records_source(tmp_path: Path) -> None:
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 23:59:59.5000000,10,5\n"
                   "2023-11-17 00:00:01.2500000,20,7\n")
    sched = load_schedule(csv, time_compression=2)
    assert sched.meta is not None and sched.meta.source == str(csv)
    assert [r.arrival_s for r in sched.requests] == pytest.approx([0.0, 0.875])


def test_malformed_row_names_the_line(tmp_path: Path) -> None:
    csv = tmp_path / "bad.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,x,5\n")
    with pytest.raises(ValueError, match=r"bad.csv:2"):
        read_trace(csv)
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path / "missing.csv")


RECORDS = [
    TraceRecord(0.0, 100, 10),
    TraceRecord(5.0, 1000, 100),   # 1100 > 1024: prompt cut to 924
    TraceRecord(12.5, 3000, 2000),  # both too long: max_tokens 1023, prompt 1
    TraceRecord(20.0, 300, 500),
]


def test_scale_divides_times_and_clamps_lengths() -> None:
    sched = scale(RECORDS, time_compression=10, length_scale=1.0, max_context=1024)
    got = [(r.arrival_s, r.prompt_tokens, r.max_tokens, r.clamped) for r in sched.requests]
    assert got == [(0.0, 100, 10, False), (0.5, 924, 100, True), (1.25, 1, 1023, True),
                   (2.0, 300, 500, False)]
    assert sched.meta is not None
    assert (sched.meta.n_clamped, sched.meta.n_capped, sched.meta.n_requests) == (2, 0, 4)
    assert sched.meta.duration_s == 2.0


def test_scale_length_factor_cap_and_limit() -> None:
    sched = scale(RECORDS, time_compression=1, length_scale=0.25, max_context=512,
                  max_new_tokens_cap=64, limit=3)
    got = [(r.prompt_tokens, r.max_tokens) for r in sched.requests]
    # 100*0.25=25, 10*.25=2.5->2 (banker's rounding); 250, 25; 750, 500->cap 64 -> clamp 448
    assert got == [(25, 2), (250, 25), (448, 64)]
    assert sched.meta is not None
    assert sched.meta.to_dict() == {
        "time_compression": 1, "length_scale": 0.25, "max_context": 512,
        "max_new_tokens_cap": 64, "limit": 3, "n_requests": 3, "n_clamped": 1, "n_capped": 1,
        "duration_s": 12.5, "source": ""}


def test_scale_rejects_bad_factors() -> None:
    with pytest.raises(ValueError):
        scale(RECORDS, time_compression=0)
    with pytest.raises(ValueError):
        scale(RECORDS, max_context=1)
    with pytest.raises(ValueError):
        scale(RECORDS, max_new_tokens_cap=0)
