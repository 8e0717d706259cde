"""Steady open-loop traffic whose prompts can switch, mid-run, between real text and repetitive
prompts (a tenant that starts sending the same few letters: routing skew rises), or to long real-text
prompts (``long_prompt_tokens``: the context mix steps up).

Used by :mod:`bench.control_latency`: a thread sends one request every ``1 / rps`` seconds,
round-robin over the worker URLs it is given (non-streaming, a few output tokens), and records
the Unix send time of every skewed (and every long) request, so a measurement can start at the first one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
from harness.loadgen import prompt_of_length, repetitive_prompt

PROMPT_STRIDE = 7919


class SteadyTraffic(threading.Thread):
    """Sends ``rps`` requests per second to ``urls()`` until :meth:`stop`; :attr:`skewed` switches
    the prompts to repetitive ones, :attr:`long` (with ``long_prompt_tokens``) to real text of that many
    tokens. Counts answers by status (``None``: a transport error)."""

    def __init__(self, urls: Callable[[], list[str]], rps: float, prompt_tokens: int = 384,
                 max_tokens: int = 8, model: str = "tiny", skew_seed: int = 0, long_prompt_tokens: int = 0) -> None:
        super().__init__(daemon=True)
        if rps <= 0:
            raise ValueError(f"rps must be > 0, got {rps}")
        self.urls, self.rps, self.prompt_tokens, self.max_tokens, self.model = urls, rps, prompt_tokens, max_tokens, model
        self.skew_seed = skew_seed
        """:func:`harness.loadgen.repetitive_prompt`'s seed for the skewed prompts (which letters)."""
        self.skewed = False
        self.skewed_sends: list[float] = []
        self.long_prompt_tokens = long_prompt_tokens
        self.long = False
        """Send real-text prompts of ``long_prompt_tokens`` tokens (when > 0 and not :attr:`skewed`)."""
        self.long_sends: list[float] = []
        self.statuses: dict[str, int] = {}
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=16)
        self._client = httpx.Client(timeout=60, trust_env=False)

    def _send(self, url: str, prompt: str, skewed: bool, long: bool = False) -> None:
        if skewed or long:
            with self._lock:
                (self.skewed_sends if skewed else self.long_sends).append(time.time())
        try:
            status: int | None = self._client.post(f"{url}/v1/completions", json={
                "model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0}).status_code
        except httpx.HTTPError:
            status = None
        with self._lock:
            self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1

    def run(self) -> None:
        i = 0
        t_next = time.monotonic()
        while not self._halt.is_set():
            urls = self.urls()
            if urls:
                skewed = self.skewed
                long = not skewed and self.long and self.long_prompt_tokens > 0
                prompt = (repetitive_prompt(self.prompt_tokens, seed=self.skew_seed) if skewed
                          else prompt_of_length(self.long_prompt_tokens if long else self.prompt_tokens,
                                                offset=i * PROMPT_STRIDE))
                self._pool.submit(self._send, urls[i % len(urls)], prompt, skewed, long)
                i += 1
            t_next += 1.0 / self.rps
            self._halt.wait(max(0.0, t_next - time.monotonic()))

    def first_skewed_after(self, t: float) -> float | None:
        """Send time of the first skewed request at or after Unix time ``t``."""
        with self._lock:
            return next((s for s in self.skewed_sends if s >= t), None)

    def first_long_after(self, t: float) -> float | None:
        """Send time of the first long request at or after Unix time ``t``."""
        with self._lock:
            return next((s for s in self.long_sends if s >= t), None)

    def last_skewed(self) -> float | None:
        with self._lock:
            return self.skewed_sends[-1] if self.skewed_sends else None

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()
