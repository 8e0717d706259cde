"""Pure summaries of a run: counts by status, goodput, latency percentiles.

Percentiles use :func:`numpy.percentile` with its default (linear
interpolation between closest ranks), over successful requests only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from harness.loadgen.records import RequestResult, RunResult

PERCENTILES: tuple[int, ...] = (50, 95, 99)


def status_key(result: RequestResult) -> str:
    """Bucket name of a result.

    ``"not_sent"`` (the deadline came before it was sent), ``"incomplete"``
    (sent, cancelled by the deadline before it ended), ``"error"`` (transport
    failure or request timeout, no status), else the HTTP status code as text.
    """
    if result.send_s is None:
        return "not_sent"
    if result.end_s is None:
        return "incomplete"
    if result.status is None:
        return "error"
    return str(result.status)


def percentiles(values: Sequence[float], qs: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """``{"p50": ..., "p95": ..., "p99": ...}`` of ``values`` (None each when empty)."""
    if not values:
        return {f"p{q}": None for q in qs}
    arr = np.asarray(values, dtype=float)
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


@dataclass(frozen=True)
class Summary:
    """Summary of a run.

    Attributes:
        n_requests: all requests, sent or not.
        by_status: count per :func:`status_key` bucket.
        n_ok: successful (2xx, fully read) requests.
        wall_s: the run's wall time, seconds (the goodput denominator).
        completion_tokens_ok: completion tokens of successful requests.
        prompt_tokens_ok: prompt tokens of successful requests (usage, else bytes sent).
        goodput_tok_s: ``completion_tokens_ok / wall_s``, tokens per second.
        ok_rate_req_s: successful requests per second of wall time.
        latency_s: p50/p95/p99 end-to-end latency of successful requests, seconds.
        ttft_s: p50/p95/p99 time to first byte/token of successful requests, seconds.
        top_errors: up to 3 most frequent error messages with their counts.
    """

    n_requests: int
    by_status: dict[str, int]
    n_ok: int
    wall_s: float
    completion_tokens_ok: int
    prompt_tokens_ok: int
    goodput_tok_s: float
    ok_rate_req_s: float
    latency_s: dict[str, float | None] = field(default_factory=dict)
    ttft_s: dict[str, float | None] = field(default_factory=dict)
    top_errors: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary."""
        return asdict(self)


def _span(results: Sequence[RequestResult]) -> float:
    """Seconds from the earliest send to the latest end (0.0 when none)."""
    sends = [r.send_s for r in results if r.send_s is not None]
    ends = [r.end_s for r in results if r.end_s is not None]
    if not sends or not ends:
        return 0.0
    return max(0.0, max(ends) - min(sends))


def summarize(run: RunResult | Sequence[RequestResult], wall_s: float | None = None) -> Summary:
    """Summarize a run (or a bare list of results).

    Args:
        run: a :class:`RunResult` or its list of :class:`RequestResult`.
        wall_s: the run's wall time in seconds; default ``run.wall_s`` for a
            RunResult, else latest ``end_s`` minus earliest ``send_s``.
    """
    if isinstance(run, RunResult):
        results: Sequence[RequestResult] = run.results
        if wall_s is None:
            wall_s = run.wall_s
    else:
        results = run
    if wall_s is None:
        wall_s = _span(results)
    ok = [r for r in results if r.ok]
    completion = sum(r.completion_tokens or 0 for r in ok)
    prompt = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_bytes for r in ok)
    lat = [v for r in ok if (v := r.latency_s) is not None]
    ttft = [v for r in ok if (v := r.ttft_s) is not None]
    counts = Counter(status_key(r) for r in results)
    errors = Counter(r.error for r in results if r.error)
    return Summary(
        n_requests=len(results),
        by_status=dict(sorted(counts.items())),
        n_ok=len(ok),
        wall_s=wall_s,
        completion_tokens_ok=completion,
        prompt_tokens_ok=prompt,
        goodput_tok_s=completion / wall_s if wall_s > 0 else 0.0,
        ok_rate_req_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        latency_s=percentiles(lat),
        ttft_s=percentiles(ttft),
        top_errors=dict(errors.most_common(3)),
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_summary(summary: Summary) -> list[str]:
    """A short text table of ``summary``, one string per line (no trailing newlines)."""
    statuses = ", ".join(f"{k}: {v}" for k, v in summary.by_status.items()) or "none"
    lines = [
        f"requests      {summary.n_requests}  ({statuses})",
        f"ok            {summary.n_ok} in {summary.wall_s:.2f} s  "
        f"({summary.ok_rate_req_s:.2f} req/s)",
        f"goodput       {summary.goodput_tok_s:.1f} completion tok/s  "
        f"({summary.completion_tokens_ok} completion, {summary.prompt_tokens_ok} prompt tokens)",
        f"{'':14}{'p50':>10}{'p95':>10}{'p99':>10}",
    ]
    for name, pct in (("latency ms", summary.latency_s), ("ttft ms", summary.ttft_s)):
        lines.append(f"{name:14}" + "".join(f"{_ms(pct.get(f'p{q}')):>10}" for q in PERCENTILES))
    for message, count in summary.top_errors.items():
        lines.append(f"error x{count:<6}{message[:100]}")
    return lines
