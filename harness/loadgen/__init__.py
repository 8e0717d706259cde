"""Load generator for moeguard workers.

Typical use from another module::

    import asyncio
    from harness.loadgen import load_schedule, replay, summarize, format_summary

    schedule = load_schedule(time_compression=20, length_scale=0.25, max_context=1023,
                             max_new_tokens_cap=64, limit=200)
    run = asyncio.run(replay(["http://127.0.0.1:8000"], schedule, progress=False))
    print("\\n".join(format_summary(summarize(run))))
"""

from __future__ import annotations

from harness.loadgen.client import (
    RequestSpec,
    burst,
    check_loopback_url,
    check_urls,
    default_prompt,
    replay,
    run_requests,
)
from harness.loadgen.records import RequestResult, RunResult
from harness.loadgen.stats import Summary, format_summary, percentiles, status_key, summarize
from harness.loadgen.text import corpus, corpus_fingerprint, prompt_of_length, repetitive_prompt
from harness.loadgen.trace import (
    Schedule,
    ScheduledRequest,
    ScheduleMeta,
    TraceRecord,
    default_trace_path,
    load_schedule,
    read_trace,
    scale,
)

__all__ = [
    "RequestResult",
    "RequestSpec",
    "RunResult",
    "Schedule",
    "ScheduleMeta",
    "ScheduledRequest",
    "Summary",
    "TraceRecord",
    "burst",
    "check_loopback_url",
    "check_urls",
    "corpus",
    "corpus_fingerprint",
    "default_prompt",
    "default_trace_path",
    "format_summary",
    "load_schedule",
    "percentiles",
    "prompt_of_length",
    "read_trace",
    "repetitive_prompt",
    "replay",
    "run_requests",
    "scale",
    "status_key",
    "summarize",
]
