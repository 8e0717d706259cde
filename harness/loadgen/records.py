"""Plain records of what happened to each request and to a whole run.

No network imports here: :mod:`harness.loadgen.stats` summarizes these records
without needing httpx. Times are seconds on the monotonic clock, counted from
the start of the run (``0.0`` = when the runner began its schedule).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """What one request did.

    Attributes:
        index: position in the schedule or burst (0-based).
        url: the worker base URL it was sent to.
        scheduled_s: when it was due (s after run start); sends can lag behind
            it when the in-flight cap is reached.
        prompt_bytes: prompt length in bytes (= tokens for moeguard's tokenizer).
        max_tokens: the ``max_tokens`` it asked for.
        send_s: when the request was handed to the HTTP client (s), None if
            it was never sent (the run's deadline came first).
        first_byte_s: when the response headers arrived (s); with streaming,
            when the first non-empty token chunk arrived.
        end_s: when the response body was fully read or the request failed (s).
        status: HTTP status code; None for a transport error, timeout or a
            request the deadline stopped.
        retry_after: the ``Retry-After`` response header, verbatim, if any.
        error: error text: the OpenAI ``error.message`` of a refusal, the
            exception of a transport failure, or why it was not completed.
        code: the OpenAI ``error.code`` of a refusal or of an SSE error event (the
            reason: ``queue_full``, ``priority_shed``...), None otherwise.
        prompt_tokens: ``usage.prompt_tokens`` reported by the worker.
        completion_tokens: ``usage.completion_tokens`` reported by the worker
            (streaming without usage: UTF-8 bytes of the text, an estimate).
        text: ``choices[0].text`` of a successful response.
    """

    index: int
    url: str
    scheduled_s: float
    prompt_bytes: int
    max_tokens: int
    send_s: float | None = None
    first_byte_s: float | None = None
    end_s: float | None = None
    status: int | None = None
    retry_after: str | None = None
    error: str | None = None
    code: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    text: str | None = None

    @property
    def ok(self) -> bool:
        """True for a 2xx response that was read to the end and parsed without error."""
        return (self.status is not None and 200 <= self.status < 300
                and self.end_s is not None and self.error is None)

    @property
    def latency_s(self) -> float | None:
        """End-to-end latency, seconds from send to the last byte."""
        if self.send_s is None or self.end_s is None:
            return None
        return self.end_s - self.send_s

    @property
    def ttft_s(self) -> float | None:
        """Time to first byte/token, seconds from send."""
        if self.send_s is None or self.first_byte_s is None:
            return None
        return self.first_byte_s - self.send_s

    def to_dict(self, include_text: bool = False) -> dict[str, Any]:
        """JSON-ready dictionary (the completion text only when asked)."""
        d = asdict(self)
        if not include_text:
            d.pop("text")
        d["latency_s"] = self.latency_s
        d["ttft_s"] = self.ttft_s
        return d


@dataclass
class RunResult:
    """All requests of one run.

    Attributes:
        results: one :class:`RequestResult` per request, in schedule order.
        wall_s: seconds from run start until the last request ended or the
            deadline stopped the run.
        started_unix_s: wall-clock time (Unix seconds) of the run start.
        timed_out: True when the global deadline stopped unfinished requests.
        meta: how the run was configured (mode, URLs, limits, schedule factors).
    """

    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    started_unix_s: float = 0.0
    timed_out: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, include_text: bool = False) -> dict[str, Any]:
        """JSON-ready dictionary."""
        return {
            "wall_s": self.wall_s,
            "started_unix_s": self.started_unix_s,
            "timed_out": self.timed_out,
            "meta": self.meta,
            "results": [r.to_dict(include_text) for r in self.results],
        }
