"""The refusal-cost benchmark's arithmetic: medians per arm, their ratio against the target, the
CPU cost of one refusal, and the report rendered from the record."""

from __future__ import annotations

import asyncio

import pytest
from bench.refusal_cost import read_status, render, summarize

pytestmark = pytest.mark.unit


def row(arm: str, tokens: float, cpu: float, abuse: dict[str, int] | None = None) -> dict[str, object]:
    return {"arm": arm, "tokens_per_s": tokens, "requests_per_s": tokens / 32, "abuse": abuse or {},
            "worker_cpu_s": cpu, "seconds": 20.0}


def test_medians_ratio_and_cost_per_refusal() -> None:
    rows = [row("alone", 100, 10), row("abuse", 92, 11, {"429": 1900, "503": 100}),
            row("abuse", 95, 12, {"429": 2000}), row("alone", 104, 10), row("alone", 50, 9),
            row("abuse", 80, 13, {"429": 2000})]
    s = summarize(rows)
    assert s["medians"]["alone"]["tokens_per_s"] == 100 and s["medians"]["abuse"]["tokens_per_s"] == 92
    assert s["ratio_tokens"] == pytest.approx(0.92) and s["met"]
    assert s["abuse_answers"] == {"429": 5900, "503": 100}
    assert s["refusals_per_s"] == pytest.approx(6000 / 60)
    assert s["worker_cpu_us_per_refusal"] == pytest.approx((12 - 10) / 2000 * 1e6)
    record = {"summary": s, "windows": rows, "order": ["alone", "abuse", "abuse", "alone", "alone", "abuse"],
              "started": "2026-12-01T07:40:00Z",
              "machine": {"cpu": "x", "cores": 2, "torch": "2.15"},
              "params": {"preset": "small", "lanes": 4, "prompt_tokens": 128, "max_tokens": 32,
                         "abuse_rate": 100.0, "abuse_connections": 4, "abuse_prompt_tokens": 1024,
                         "abuse_max_tokens": 2048, "window_s": 20.0, "settle_s": 4.0, "pairs": 3}}
    md = render(record)
    assert "Ratio of the medians (with abuse / alone): 0.920 in tokens/s" in md and ": met." in md
    assert "A B B A A B" in md
    s["met"] = False
    assert ": **missed**." in render(record)


async def test_read_status_reads_one_framed_response() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 5\r\nretry-after: 1\r\n\r\nhello"
                     b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
    assert await read_status(reader) == 429
    assert await read_status(reader) == 503
