"""What the operator saw in one look (:class:`Observation`): built by :mod:`observe`, read by
:mod:`policy` and the diagnosis; with the leak window's warm-up and noise floor, which both read.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from moeguard_core.memory_model_info import ModelMemory
from moeguard_operator.loop.signals import DiagnosisSignals


@dataclass(frozen=True)
class PodLoad:
    """One pod's inputs to the memory prediction (``--policy predictive``), over the window. None: no data.

    Attributes:
        pod: the pod.
        memory_bytes: its highest memory in use in the window (``moeguard_memory_usage_bytes``), bytes.
        idle_footprint_bytes: its memory in use when it last held no request
            (``moeguard_memory_idle_footprint_bytes``), bytes; None before its first idle check.
        skew_ratio: its highest step's expert skew ratio in the window (None: no step large enough).
        context_mean_tokens: the mean KV capacity (prompt + max_tokens) of the requests it accepted in the window
            (``moeguard_request_context_tokens``), tokens; None: no request in the window.
        context_max_tokens: the bucket bound of the longest of them, tokens; None: no request in the window.
        correction: its memory model correction factor (``moeguard_memory_prediction_correction_ratio``); None:
            memory-aware admission off.
    """

    pod: str
    memory_bytes: float | None = None
    idle_footprint_bytes: float | None = None
    skew_ratio: float | None = None
    context_mean_tokens: float | None = None
    context_max_tokens: float | None = None
    correction: float | None = None


@dataclass(frozen=True)
class ClassLatency:
    """One priority class's latency histograms over the window, summed over the Running pods: ``(le, count)``
    cumulative bucket counts (``increase`` over the window), ``le`` ascending and ``math.inf`` last.

    Attributes:
        priority: ``interactive`` or ``batch``.
        ttft: ``moeguard_time_to_first_token_seconds``' buckets.
        tpot: ``moeguard_request_time_per_output_token_seconds``' buckets.
    """

    priority: str
    ttft: tuple[tuple[float, float], ...] = ()
    tpot: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class Observation:
    """What the operator saw in one look. ``None`` means *no data*, never 0.

    Attributes:
        time: when the look was made.
        skew_ratio: highest expert skew ratio of the steps in the window among the pods (the upper bound of
            its histogram bucket); None when no step in the window carried skew data, or unknown.
        skew_steps: steps with skew data in the window, summed over the pods where it is known: 0 is an idle
            service (no batches: no skew pressure, and skew counts as seen); None: not measured.
        skew_unknown_pods: reporting pods whose skew is unknown (no full window of history, a counter
            reset): skew is not seen while there is one.
        memory_ratio: highest memory in use / hard limit among the pods.
        rss_slope_bytes_per_second: highest RSS growth among the pods with a full leak window, bytes/s.
        pod_rss_slopes: ``(pod, bytes/s)``: each pod's own RSS growth, for the pods with a full leak window (the
            ones ``rss_slope_bytes_per_second`` is the highest of; PromQL ``deriv`` over ``leakWindowSeconds``).
        slope_unknown: why the leak window cannot be judged yet (pods whose worker ran for the leak window but
            whose series in Prometheus do not span it: Prometheus restarted, lost samples), or None.
        leak_kinds: leak kinds the pods flag themselves (``native``, ``python_heap``), sorted.
        growth_bytes_per_second: ``(part, bytes/s)``: highest growth of each memory part among the pods
            (``rss``, ``rss_anonymous``, ``rss_file``, ``malloc_in_use``; the workers' own slopes).
        rejection_rate_per_second: refusals (429, 503) per second across the pods (None unless every
            reporting pod has a full window).
        p99_latency_seconds: highest per-pod end-to-end p99 latency, seconds (same condition).
        expected_pods: Running worker pods (from the Kubernetes API).
        reporting_pods: pods with series in Prometheus.
        short_history_pods: reporting pods whose series do not yet span the window (``windowSeconds``).
        short_history: the sentence naming them, or None.
        new_oom_kills: OOMKilled terminations since the last look (from the Kubernetes API).
        crash_looping_pods: pods in the kubelet's crash-loop back-off (from the Kubernetes API:
            :attr:`podstate.PodFacts.crash_looping`); never loosen while there is one.
        error: why Prometheus values are missing (unreachable, no series), or None.
        signals: the diagnosis signals (:mod:`diagnosis`; never read by :func:`decide`), or None when missing.
        signals_missing: why ``signals`` is None although the look was not blind (a diagnosis query failed).
        pod_loads: per reporting pod, the memory prediction's inputs (:class:`PodLoad`).
        latency: per priority class, the latency histograms of the window (:class:`ClassLatency`); empty unless
            every reporting pod has a full window.
        memory_models: per reporting pod that exports one, the memory model its worker predicts steps with
            (``moeguard_memory_model_info``, :class:`memory_model_info.ModelMemory`).
        memory_models_error: why ``memory_models`` could not be read (the query's fixed problem), or None: a
            failed query is not "no worker reported one yet".
        budget_generations: ``(pod, generation)``: the budget document each reporting pod's worker runs
            (``moeguard_budget_generation``, its latest sample; -1: none yet); a pod without the series is absent
            (:mod:`applied` judges them).
    """

    time: datetime
    skew_ratio: float | None = None
    memory_ratio: float | None = None
    rss_slope_bytes_per_second: float | None = None
    pod_rss_slopes: tuple[tuple[str, float], ...] = ()
    skew_steps: float | None = None
    skew_unknown_pods: tuple[str, ...] = ()
    slope_unknown: str | None = None
    leak_kinds: tuple[str, ...] = ()
    growth_bytes_per_second: tuple[tuple[str, float], ...] = ()
    rejection_rate_per_second: float | None = None
    p99_latency_seconds: float | None = None
    expected_pods: tuple[str, ...] = ()
    reporting_pods: tuple[str, ...] = ()
    short_history_pods: tuple[str, ...] = ()
    short_history: str | None = None
    new_oom_kills: int = 0
    crash_looping_pods: tuple[str, ...] = ()
    error: str | None = None
    signals: DiagnosisSignals | None = None
    signals_missing: str | None = None
    pod_loads: tuple[PodLoad, ...] = ()
    latency: tuple[ClassLatency, ...] = ()
    memory_models: tuple[tuple[str, ModelMemory], ...] = ()
    memory_models_error: str | None = None
    budget_generations: tuple[tuple[str, float], ...] = ()

    @property
    def silent_pods(self) -> tuple[str, ...]:
        """Running pods that export nothing: never read as healthy."""
        return tuple(sorted(set(self.expected_pods) - set(self.reporting_pods)))

    @property
    def available(self) -> bool:
        """Prometheus answered and the pods' memory is there (skew appears only after large batches)."""
        return self.error is None and self.memory_ratio is not None

    @property
    def skew_seen(self) -> bool:
        """Skew is known for the window: measured, or no batch at all (``skew_steps == 0``: an idle service)."""
        return (self.skew_ratio is not None or self.skew_steps == 0) and not self.skew_unknown_pods

    @property
    def fully_visible(self) -> bool:
        """Available, every Running pod reports with a full window of history, skew is seen (or the service
        is idle) and the leak window can be judged: the only state in which the loop may loosen."""
        return (self.available and not self.silent_pods and not self.short_history_pods and self.skew_seen
                and self.slope_unknown is None and not self.crash_looping_pods)


LEAK_NOISE_BYTES_PER_SECOND = 64 * 1024
"""RSS growth at or below this (3.75 MiB/min) is never a leak, however close the hard limit: a steady
worker's noise (allocator caches, KV blocks reused). The workers' own classification uses the same floor
(``moeguard_runtime.memory.leak.DEFAULT_THRESHOLD_BYTES_PER_S``)."""
LEAK_WARMUP_SECONDS = 90
"""A worker's first seconds are its warm-up, seconds: lazy initialisation, the allocator's first arenas, caches
filling with the first batches of each size. Its RSS grows there, steadily (+5 to +10 MiB/min under 1 request/s
on the diagnosis drills' model, and +240 MiB/min for a few seconds at the first requests, with the worker flagging
``python_heap`` for its first ~100 s), and that is not a leak: a pod's RSS slope counts only once its leak window
starts after the warm-up (the pod Running for at least this plus ``leakWindowSeconds``; :func:`leak_window_start`),
for the leak judgement and the diagnosis alike."""


def leak_window_start(now: datetime, leak_window_seconds: int,
                      warmup_seconds: float = LEAK_WARMUP_SECONDS) -> datetime:
    """The pods Running since before this time have a leak window past their warm-up (``warmup_seconds``,
    by default :data:`LEAK_WARMUP_SECONDS`; the operator's ``--leak-warmup-seconds``): their RSS slope counts."""
    return now - timedelta(seconds=leak_window_seconds + warmup_seconds)
