"""SLO goodput (DistServe's definition, Zhong et al., OSDI 2024): requests per second that meet
both a time-to-first-token SLO and a time-per-output-token SLO. Pure: request records in, figures out.

A record is the loadgen's ``RequestResult.to_dict()``: ``status``, ``error``, ``send_s``,
``first_byte_s`` (the first token of a stream), ``end_s``, ``completion_tokens``; seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Record = Mapping[str, Any]


@dataclass(frozen=True)
class Slo:
    """The two latency objectives, seconds."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLOs must be > 0 s, got TTFT {self.ttft_s} and TPOT {self.tpot_s}")


def succeeded(r: Record) -> bool:
    """A 2xx answer read to its end without an error (a refusal inside a 200 stream is not)."""
    status = r.get("status")
    return status is not None and 200 <= int(status) < 300 and r.get("error") is None and r.get("end_s") is not None


def ttft(r: Record) -> float | None:
    """Seconds from send to the first token, None when there was none."""
    if r.get("send_s") is None or r.get("first_byte_s") is None:
        return None
    return float(r["first_byte_s"]) - float(r["send_s"])


def tpot(r: Record) -> float | None:
    """Seconds per output token after the first: ``(end - first token) / (tokens - 1)``; 0.0 for a
    one-token answer (nothing after the first), None without a first token or a token count."""
    first, end, n = r.get("first_byte_s"), r.get("end_s"), r.get("completion_tokens")
    if first is None or end is None or n is None or int(n) < 1:
        return None
    return 0.0 if int(n) == 1 else (float(end) - float(first)) / (int(n) - 1)


def meets(r: Record, slo: Slo) -> bool:
    """Succeeded, with TTFT ≤ ``slo.ttft_s`` and TPOT ≤ ``slo.tpot_s``."""
    t1, t2 = ttft(r), tpot(r)
    return succeeded(r) and t1 is not None and t2 is not None and t1 <= slo.ttft_s and t2 <= slo.tpot_s


def slo_goodput(records: Iterable[Record], slo: Slo, duration_s: float) -> float:
    """Requests meeting both SLOs per second of ``duration_s`` (the schedule's length, the same for
    every arm).

    Raises:
        ValueError: ``duration_s`` is not > 0.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    return sum(1 for r in records if meets(r, slo)) / duration_s


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, linear interpolation between closest ranks), None when empty."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
