"""The diagnosis signals of one look (issue 14), as plain frozen data: what :mod:`observe` reads per pod for
:mod:`diagnosis`. ``None`` is *no data* (the worker does not export it, or it has no value in the window),
never 0. Nothing here is read by the budget policy (:func:`policy.decide`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UcxInfo:
    """A worker's ``moeguard_ucx_info`` labels (``contract.METRIC_UCX_INFO``).

    Attributes:
        loaded: a UCX library is mapped in the worker process.
        libraries: the mapped UCX libraries' file names, comma-separated.
        mmap_hook_mode: the effective ``UCX_MEM_MMAP_HOOK_MODE`` (``default:<value>`` when unset).
        rcache_max_unreleased: the effective ``UCX_RCACHE_MAX_UNRELEASED`` (``default:<value>`` when unset).
    """

    loaded: bool
    libraries: str = ""
    mmap_hook_mode: str = ""
    rcache_max_unreleased: str = ""


@dataclass(frozen=True)
class TopLayer:
    """A MoE layer with one of the highest top-expert shares in the window.

    Attributes:
        layer: the layer's label value.
        share: its highest top-expert share in the window (``moeguard_expert_top_share_ratio``), ratio.
        expert: its hottest expert in the window (most token-slots), or None when not known.
        tokens: token-slots routed to that expert in the window (``increase`` of
            ``moeguard_expert_tokens_total``), or None.
    """

    layer: str
    share: float
    expert: str | None = None
    tokens: float | None = None


@dataclass(frozen=True)
class PodSignals:
    """One pod's diagnosis signals over the look's windows (``windowSeconds``: w, ``leakWindowSeconds``: lw).

    Attributes:
        pod: the pod's name.
        memory_bytes: window max of ``moeguard_memory_usage_bytes``, bytes.
        prefill_batches: window max of prefill batches in flight at a prefill step (0: no prefill step).
        queue_requests: window max of requests waiting: the larger of the queue gauge's scrapes and the per-step
            histogram's top bucket bound (it sees a burst drained between two scrapes), requests.
        batches_in_flight: window max of batches in flight, batches.
        long_running: window max of long requests running, requests.
        long_admitted: long requests admitted in the window (``increase``), requests.
        kv_cache_bytes: window max of the KV cache held, bytes.
        memory_failures: OOM errors survived + memory refusals (``memory_predicted``, ``memory_hard_limit``) +
            prefill chunk shrinks in the window (``increase``; 0 for a reporting pod without any).
        limit_state: window max of ``moeguard_memory_limit_state`` (0 below soft, 1 above soft, 2 above hard).
        gpu_reserved_bytes, gpu_allocated_bytes: window max of the caching allocator's figures, bytes (None on
            a worker without a GPU).
        steady_growth_bytes_per_second: the smallest short-window RSS slope over the leak window, bytes/s
            (a leak grows in every sub-window; a burst's one-off jump does not).
        mappings_growth_per_second: the worker's slope of its memory mappings count, mappings/s.
        breakdown: ``(stage, bytes)``: window max of each stage of the largest predicted step peak.
        top_layers: the layers with the highest top-expert share (at most 3), highest first.
        ucx: the worker's UCX info, or None.
        leak_kinds: the leak kinds the worker flags itself (``native``, ``python_heap``), sorted.
        growth: ``(part, bytes/s)``: the worker's own growth slopes (``moeguard_memory_growth_bytes_per_second``).
        age_seconds: seconds since the worker process started its telemetry (a restarted container is young
            again), or None when unknown.
        anonymous_growth_bytes_per_second: anonymous RSS slope over the leak window (PromQL ``deriv``), bytes/s.
        python_blocks_growth_per_second: Python heap block count slope over the leak window, blocks/s.
    """

    pod: str
    memory_bytes: float | None = None
    prefill_batches: float | None = None
    queue_requests: float | None = None
    batches_in_flight: float | None = None
    long_running: float | None = None
    long_admitted: float | None = None
    kv_cache_bytes: float | None = None
    memory_failures: float | None = None
    limit_state: float | None = None
    gpu_reserved_bytes: float | None = None
    gpu_allocated_bytes: float | None = None
    steady_growth_bytes_per_second: float | None = None
    mappings_growth_per_second: float | None = None
    breakdown: tuple[tuple[str, float], ...] = ()
    top_layers: tuple[TopLayer, ...] = ()
    ucx: UcxInfo | None = None
    leak_kinds: tuple[str, ...] = ()
    growth: tuple[tuple[str, float], ...] = ()
    age_seconds: float | None = None
    anonymous_growth_bytes_per_second: float | None = None
    python_blocks_growth_per_second: float | None = None

    def stage(self, name: str) -> float | None:
        """Bytes of one stage of the peak breakdown, or None when the worker does not export it."""
        return dict(self.breakdown).get(name)


@dataclass(frozen=True)
class DiagnosisSignals:
    """The diagnosis signals of one service in one look.

    Attributes:
        pods: each reporting Running pod's signals, by pod name.
        missing: the signals a reporting pod lacks, as sentences (``kv cache bytes: pod-a``).
    """

    pods: tuple[PodSignals, ...] = ()
    missing: tuple[str, ...] = ()
