"""Read the Azure LLM inference trace and scale it into a request schedule.

The trace (``TIMESTAMP,ContextTokens,GeneratedTokens``) holds arrival times and
sizes, not text. :func:`read_trace` turns it into :class:`TraceRecord` items;
:func:`scale` compresses time, scales lengths and clamps them to a model's
context, giving a :class:`Schedule` whose metadata records every factor.
"""

from __future__ import annotations

import csv
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

TRACE_FILENAME = "azure-llm-inference-2023-conv.csv"
TRACE_PATH_ENV = "MOEGUARD_TRACE_PATH"
"""Environment variable that overrides :func:`default_trace_path`."""

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The repository root (the folder holding ``bench/``)."""


def default_trace_path() -> Path:
    """Path of the trace: ``$MOEGUARD_TRACE_PATH`` if set, else the repository's copy,
    ``<repo>/bench/traces/<file>`` (CC-BY-4.0, source in ``bench/traces/README.md``)."""
    env = os.environ.get(TRACE_PATH_ENV)
    if env:
        return Path(env)
    return REPO_ROOT / "bench" / "traces" / TRACE_FILENAME


@dataclass(frozen=True)
class TraceRecord:
    """One request of the trace.

    Attributes:
        arrival_s: arrival time in seconds after the trace's first request.
        context_tokens: prompt length in tokens (the trace's tokenizer).
        generated_tokens: output length in tokens.
    """

    arrival_s: float
    context_tokens: int
    generated_tokens: int


def _parse_timestamp(text: str) -> tuple[datetime, float]:
    """Split ``2023-11-16 18:15:46.6805900`` into whole seconds and a fraction (s).

    The trace has 7 fractional digits, more than ``datetime`` keeps, so the
    fraction is kept apart as a float.
    """
    text = text.strip()
    whole, _, frac = text.partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    return base, float(f"0.{frac}") if frac else 0.0


def read_trace(path: str | os.PathLike[str] | None = None) -> list[TraceRecord]:
    """Read the trace CSV into records sorted by arrival.

    Args:
        path: the CSV file; ``None`` means :func:`default_trace_path`.

    Returns:
        One :class:`TraceRecord` per row; ``arrival_s`` counts seconds from the
        earliest row (the first row in the shipped file, which is sorted).

    Raises:
        FileNotFoundError: the file does not exist (the message names the path).
        ValueError: a row is malformed (the message names the line).
    """
    csv_path = Path(path) if path is not None else default_trace_path()
    if not csv_path.is_file():
        raise FileNotFoundError(
            f"trace not found at {csv_path} (set {TRACE_PATH_ENV} or pass a path)")
    rows: list[tuple[datetime, float, int, int]] = []
    with csv_path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        for line_no, row in enumerate(reader, start=2):
            try:
                base, frac = _parse_timestamp(row["TIMESTAMP"])
                rows.append((base, frac, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{csv_path}:{line_no}: malformed row {row!r}: {exc}") from None
    if not rows:
        return []
    rows.sort(key=lambda r: (r[0], r[1]))
    base0, frac0 = rows[0][0], rows[0][1]
    return [
        TraceRecord(arrival_s=(base - base0).total_seconds() + (frac - frac0),
                    context_tokens=ctx, generated_tokens=gen)
        for base, frac, ctx, gen in rows
    ]


@dataclass(frozen=True)
class ScheduledRequest:
    """One request to send.

    Attributes:
        index: position in the schedule (0-based).
        arrival_s: when to send it, seconds after the run starts.
        prompt_tokens: prompt length in tokens (= ASCII bytes).
        max_tokens: the request's ``max_tokens``.
        source_context_tokens: the trace's ContextTokens for this request.
        source_generated_tokens: the trace's GeneratedTokens.
        clamped: True when lengths were cut to fit ``max_context``.
    """

    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    source_context_tokens: int
    source_generated_tokens: int
    clamped: bool = False


@dataclass(frozen=True)
class ScheduleMeta:
    """How a schedule was derived from the trace; store it with every result.

    Attributes:
        time_compression: arrival times were divided by this.
        length_scale: token lengths were multiplied by this (then rounded, min 1).
        max_context: prompt + max_tokens never exceeds this (tokens).
        max_new_tokens_cap: max_tokens never exceeds this (None: no cap).
        limit: only the first ``limit`` trace requests were kept (None: all).
        n_requests: requests in the schedule.
        n_clamped: requests whose lengths were cut to fit ``max_context``.
        n_capped: requests whose max_tokens was cut by ``max_new_tokens_cap``.
        duration_s: arrival time of the last request (s, after compression).
        source: where the records came from (a path or a description).
    """

    time_compression: float
    length_scale: float
    max_context: int
    max_new_tokens_cap: int | None
    limit: int | None
    n_requests: int
    n_clamped: int
    n_capped: int
    duration_s: float
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary."""
        return asdict(self)


@dataclass(frozen=True)
class Schedule:
    """Requests in arrival order plus :class:`ScheduleMeta`."""

    requests: list[ScheduledRequest] = field(default_factory=list)
    meta: ScheduleMeta | None = None

    def __len__(self) -> int:
        return len(self.requests)


def scale(
    records: list[TraceRecord],
    time_compression: float = 1.0,
    length_scale: float = 1.0,
    max_context: int = 1024,
    max_new_tokens_cap: int | None = None,
    limit: int | None = None,
    source: str = "",
) -> Schedule:
    """Turn trace records into a schedule that fits a (small) model.

    Steps, per request among the first ``limit``:

    1. ``arrival_s / time_compression`` (``time_compression=10`` plays the
       trace ten times faster).
    2. ``round(tokens * length_scale)`` for both lengths, at least 1 each.
    3. ``max_tokens`` cut to ``max_new_tokens_cap`` (counted in ``n_capped``).
    4. If ``prompt + max_tokens > max_context``: ``max_tokens`` is cut to at
       most ``max_context - 1``, then the prompt to ``max_context - max_tokens``
       (counted in ``n_clamped``). Leave room for a BOS token by passing a
       ``max_context`` one below the model's.

    Raises:
        ValueError: a factor is not positive, ``max_context < 2``, the cap is
            below 1 or ``limit`` is negative.
    """
    if time_compression <= 0 or length_scale <= 0:
        raise ValueError("time_compression and length_scale must be > 0")
    if max_context < 2:
        raise ValueError(f"max_context must be >= 2 tokens, got {max_context}")
    if max_new_tokens_cap is not None and max_new_tokens_cap < 1:
        raise ValueError(f"max_new_tokens_cap must be >= 1, got {max_new_tokens_cap}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")

    selected = records if limit is None else records[:limit]
    out: list[ScheduledRequest] = []
    n_clamped = n_capped = 0
    for i, rec in enumerate(selected):
        prompt = max(1, round(rec.context_tokens * length_scale))
        new = max(1, round(rec.generated_tokens * length_scale))
        if max_new_tokens_cap is not None and new > max_new_tokens_cap:
            new = max_new_tokens_cap
            n_capped += 1
        clamped = prompt + new > max_context
        if clamped:
            new = min(new, max_context - 1)
            prompt = max_context - new
            n_clamped += 1
        out.append(ScheduledRequest(
            index=i, arrival_s=rec.arrival_s / time_compression, prompt_tokens=prompt,
            max_tokens=new, source_context_tokens=rec.context_tokens,
            source_generated_tokens=rec.generated_tokens, clamped=clamped))
    meta = ScheduleMeta(
        time_compression=time_compression, length_scale=length_scale, max_context=max_context,
        max_new_tokens_cap=max_new_tokens_cap, limit=limit, n_requests=len(out),
        n_clamped=n_clamped, n_capped=n_capped,
        duration_s=out[-1].arrival_s if out else 0.0, source=source)
    return Schedule(requests=out, meta=meta)


def load_schedule(
    path: str | os.PathLike[str] | None = None,
    *,
    time_compression: float = 1.0,
    length_scale: float = 1.0,
    max_context: int = 1024,
    max_new_tokens_cap: int | None = None,
    limit: int | None = None,
) -> Schedule:
    """:func:`read_trace` then :func:`scale`, recording the file in ``meta.source``."""
    csv_path = Path(path) if path is not None else default_trace_path()
    return scale(read_trace(csv_path), time_compression=time_compression,
                 length_scale=length_scale, max_context=max_context,
                 max_new_tokens_cap=max_new_tokens_cap, limit=limit, source=str(csv_path))
