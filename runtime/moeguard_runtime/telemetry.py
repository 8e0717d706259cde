"""Prometheus metrics (dedicated registry) and rate-limited logfmt events.

Every series carries ``moeis``, ``namespace`` and ``pod``
(``contract.WORKER_LABELS``), read from ``MOEGUARD_SERVICE_NAME``,
``MOEGUARD_NAMESPACE`` and ``MOEGUARD_POD_NAME`` (defaults ``standalone``,
``default`` and the host name), so the operator's queries never need a
relabelling rule. Names follow OpenMetrics: counters end in ``_total``, units
are suffixes (``_seconds``, ``_bytes``), ratios end in ``_ratio``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import psutil
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from moeguard_runtime import contract
from moeguard_runtime.contract import Budgets
from moeguard_runtime.moe import RoutingStats

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def worker_labels(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The three identity labels, from the environment."""
    env = os.environ if env is None else env
    return {
        contract.LABEL_SERVICE: env.get(contract.ENV_SERVICE_NAME) or "standalone",
        contract.LABEL_NAMESPACE: env.get(contract.ENV_NAMESPACE) or "default",
        contract.LABEL_POD: env.get(contract.ENV_POD_NAME) or socket.gethostname(),
    }


def read_rss_split() -> tuple[int, int | None, int | None]:
    """``(rss, anonymous, file)`` bytes of this process. RSS from psutil; the
    split from ``/proc/self/status`` (``RssAnon``, ``RssFile``), None off Linux."""
    rss = psutil.Process().memory_info().rss
    anon = file = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith("RssFile:"):
                    file = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, anon, file


class _ProcessMemoryCollector(Collector):
    """Reads process memory at scrape time."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels

    def collect(self) -> Iterator[GaugeMetricFamily]:
        names, values = list(self._labels), list(self._labels.values())
        rss, anon, file = read_rss_split()
        fam = GaugeMetricFamily(contract.METRIC_PROCESS_RSS_BYTES,
                                "Resident set size of the worker process.", labels=names, unit="bytes")
        fam.add_metric(values, rss)
        yield fam
        for kind, value in (("anonymous", anon), ("file", file)):
            if value is not None:
                fam = GaugeMetricFamily(f"moeguard_process_resident_{kind}_memory_bytes",
                                        f"Resident {kind} memory of the worker process (/proc/self/status).",
                                        labels=names, unit="bytes")
                fam.add_metric(values, value)
                yield fam


class Telemetry:
    """All worker metrics, bound to the worker's identity labels."""

    def __init__(self, labels: dict[str, str], num_experts: int) -> None:
        self.labels = labels
        self.num_experts = num_experts
        self.registry = CollectorRegistry(auto_describe=True)
        base = list(contract.WORKER_LABELS)
        r = self.registry

        def gauge(name: str, doc: str, extra: Sequence[str] = (), unit: str = "") -> Gauge:
            return Gauge(name, doc, [*base, *extra], registry=r, unit=unit)

        self.batch_tokens = Histogram("moeguard_batch_tokens", "Tokens per engine step, by phase.",
                                      [*base, "phase"], registry=r, buckets=TOKEN_BUCKETS)
        self.skew = gauge(contract.METRIC_EXPERT_SKEW_RATIO,
                          "Top expert token-slots / median (floored at 1), last step with "
                          ">= 4*num_experts routed token-slots.", ["layer"])
        self.balancedness = gauge("moeguard_expert_balancedness",
                                  "mean/max expert token-slots (vLLM EPLB balancedness), same steps.",
                                  ["layer"])
        self.expert_tokens = Counter("moeguard_expert_tokens", "Token-slots routed to each expert.",
                                     [*base, "layer", "expert"], registry=r)
        self.budget = {
            name: gauge(f"moeguard_budget_{name}", f"Budget in effect: {name}.")
            for name in ("max_prefill_tokens", "max_decode_tokens", "max_batch_requests",
                         "max_concurrent_batches")
        }
        self.budget_generation = gauge(contract.METRIC_BUDGET_GENERATION,
                                       "Generation of the budget document applied (-1: none yet).")
        self.budget_shrink = gauge("moeguard_budget_shrink_factor",
                                   "Factor applied to budgets under the memory soft limit (1: none).")
        self.budget_updates = Counter("moeguard_budget_updates", "Budget documents seen, by result.",
                                      [*base, "result"], registry=r)
        self.requests = Counter("moeguard_requests", "Finished requests, by status and HTTP code.",
                                [*base, "status", "code"], registry=r)
        self.rejections = Counter("moeguard_rejections", "Requests refused, by reason.",
                                  [*base, "reason"], registry=r)
        self.queue_requests = gauge("moeguard_queue_requests", "Requests waiting in the queue.")
        self.queue_tokens = gauge("moeguard_queue_tokens", "Prompt tokens waiting in the queue.")
        self.running_requests = gauge("moeguard_running_requests", "Requests in running batches.")
        self.ttft = Histogram("moeguard_time_to_first_token_seconds", "Arrival to first token.",
                              base, registry=r, buckets=LATENCY_BUCKETS, unit="seconds")
        self.e2e = Histogram("moeguard_e2e_request_latency_seconds", "Arrival to last token.",
                             base, registry=r, buckets=LATENCY_BUCKETS, unit="seconds")
        self.step_seconds = Histogram("moeguard_step_duration_seconds", "Engine step wall time.",
                                      base, registry=r, buckets=LATENCY_BUCKETS, unit="seconds")
        self.memory_usage = gauge("moeguard_memory_usage_bytes",
                                  "The figure compared with the soft/hard limits, by source "
                                  "(cgroup memory.current or process rss).", ["source"], unit="bytes")
        self.memory_state = gauge("moeguard_memory_limit_state",
                                  "0 below the soft limit, 1 above soft, 2 above hard.")
        r.register(_ProcessMemoryCollector(labels))
        self.budget_generation.labels(**labels).set(-1)
        self.budget_shrink.labels(**labels).set(1)
        for phase in ("prefill", "decode"):
            self.batch_tokens.labels(**labels, phase=phase)
        for name in ("applied", "rejected", "ignored"):
            self.budget_updates.labels(**labels, result=name)

    def l(self, **extra: str) -> dict[str, str]:  # noqa: E743 - short on purpose
        return {**self.labels, **extra}

    def observe_step(self, prefill_tokens: int, decode_tokens: int, routing: Sequence[RoutingStats],
                     seconds: float) -> None:
        """Record one engine step. Skew/balancedness gauges are set only from steps
        that routed at least ``4 * num_experts`` token-slots: below that (e.g. a
        decode step of two sequences routes 4 slots over 8 experts) the ratio is
        dominated by the floor of the median and says nothing about the router."""
        if prefill_tokens:
            self.batch_tokens.labels(**self.l(phase="prefill")).observe(prefill_tokens)
        if decode_tokens:
            self.batch_tokens.labels(**self.l(phase="decode")).observe(decode_tokens)
        self.step_seconds.labels(**self.labels).observe(seconds)
        for layer, stats in enumerate(routing):
            for expert, n in enumerate(stats.tokens_per_expert.tolist()):
                if n:
                    self.expert_tokens.labels(**self.l(layer=str(layer), expert=str(expert))).inc(n)
            if stats.routed_slots >= 4 * self.num_experts:
                self.skew.labels(**self.l(layer=str(layer))).set(stats.expert_skew_ratio)
                self.balancedness.labels(**self.l(layer=str(layer))).set(stats.balancedness)

    def set_budgets(self, budgets: Budgets, shrink_factor: float = 1.0) -> None:
        for name, g in self.budget.items():
            g.labels(**self.labels).set(getattr(budgets, name))
        self.budget_shrink.labels(**self.labels).set(shrink_factor)

    def set_queue(self, requests: int, tokens: int, running: int) -> None:
        self.queue_requests.labels(**self.labels).set(requests)
        self.queue_tokens.labels(**self.labels).set(tokens)
        self.running_requests.labels(**self.labels).set(running)


class RateLimitedLog:
    """logfmt events through structlog, at most one per ``interval_s`` per event
    name; the next line emitted carries ``suppressed=N`` for the ones dropped.
    ``force=True`` bypasses the limit (for rare, important events)."""

    def __init__(self, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 logger: Any = None) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()
        self._log = logger if logger is not None else structlog.get_logger("moeguard.worker")

    def event(self, event: str, *, force: bool = False, **fields: Any) -> bool:
        """Log ``event`` with ``fields`` unless rate-limited; returns whether it was logged."""
        now = self._clock()
        with self._lock:
            last = self._last.get(event)
            if not force and last is not None and now - last < self.interval_s:
                self._suppressed[event] = self._suppressed.get(event, 0) + 1
                return False
            self._last[event] = now
            suppressed = self._suppressed.pop(event, 0)
        if suppressed:
            fields["suppressed"] = suppressed
        self._log.info(event, **fields)
        return True


def configure_logging() -> None:
    """structlog → stdout as logfmt: ``ts=... level=info event=budget_applied ...``."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.LogfmtRenderer(key_order=["ts", "level", "event"]),
        ],
        logger_factory=structlog.PrintLoggerFactory(),
        cache_logger_on_first_use=True,
    )
