"""Prometheus metrics (dedicated registry) and rate-limited logfmt events.

Every series carries ``moeis``, ``namespace`` and ``pod``
(``contract.WORKER_LABELS``), read from ``MOEGUARD_SERVICE_NAME``,
``MOEGUARD_NAMESPACE`` and ``MOEGUARD_POD_NAME`` (defaults ``standalone``,
``default`` and the host name), so the operator's queries never need a
relabelling rule. Names follow OpenMetrics: counters end in ``_total``, units
are suffixes (``_seconds``, ``_bytes``), ratios end in ``_ratio``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from moeguard_core import contract
from moeguard_core.contract import Budgets
from moeguard_core.memory_model_info import MEMORY_MODEL_LABELS, ModelMemory, info_labels
from moeguard_runtime.engine.scheduler import PRIORITIES
from moeguard_runtime.memory.leak import Growth
from moeguard_runtime.memory.procmem import DeviceMemory, read_process_memory
from moeguard_runtime.model.moe import RoutingStats, tensor_bytes

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


STAGES = ("queue", "prefill", "routing", "expert", "decode", "postprocess")
"""Stages timed by ``moeguard_stage_duration_seconds``: ``queue`` per request
(arrival to admission); ``prefill``/``decode`` the forward pass of a step that
carries prefill (any) or only decode tokens, minus routing and expert time;
``routing`` the router (gate, softmax, top-k) and ``expert`` the expert matmuls
of all MoE layers; ``postprocess`` sampling and delivery to the clients."""
BUDGET_NAMES = contract.BUDGET_NAMES
UCX_LABELS = ("loaded", "libraries", "mmap_hook_mode", "rcache_max_unreleased")
"""Labels of ``moeguard_ucx_info`` (``contract.METRIC_UCX_INFO``), after the worker's."""


class _ProcessMemoryCollector(Collector):
    """Reads process memory at scrape time (:func:`procmem.read_process_memory`)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels

    def collect(self) -> Iterator[GaugeMetricFamily]:
        names, values = list(self._labels), list(self._labels.values())
        m = read_process_memory()
        series: list[tuple[str, str, int | None, str]] = [
            (contract.METRIC_PROCESS_RSS_BYTES, "Resident set size of the worker process.",
             m.rss, "bytes"),
            (contract.METRIC_PROCESS_RSS_ANONYMOUS_BYTES,
             "Resident anonymous memory (/proc/self/status RssAnon).", m.rss_anonymous, "bytes"),
            ("moeguard_process_resident_file_memory_bytes",
             "Resident file-backed memory (/proc/self/status RssFile).", m.rss_file, "bytes"),
            (contract.METRIC_PROCESS_MEMORY_MAPPINGS, "Memory mappings (/proc/self/maps lines).",
             m.mappings, ""),
            (contract.METRIC_PYTHON_ALLOCATED_BLOCKS,
             "Python heap: live blocks of the object allocator (sys.getallocatedblocks).",
             m.python_allocated_blocks, ""),
            ("moeguard_malloc_in_use_bytes", "glibc malloc bytes in use (mallinfo2).",
             m.malloc_in_use, "bytes"),
        ]
        for name, doc, value, unit in series:
            if value is not None:
                fam = GaugeMetricFamily(name, doc, labels=names, unit=unit)
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
        self.step_skew = Histogram(contract.METRIC_STEP_EXPERT_SKEW_RATIO,
                                   "Per engine step with >= 4*num_experts routed token-slots in some layer: the "
                                   "highest skew ratio among those layers. The operator's skew signal: a window "
                                   "without steps has no skew data.", base, registry=r,
                                   buckets=contract.SKEW_RATIO_BUCKETS, unit="ratio")
        self.balancedness = gauge("moeguard_expert_balancedness",
                                  "mean/max expert token-slots (vLLM EPLB balancedness), same steps.",
                                  ["layer"])
        self.expert_tokens = Counter("moeguard_expert_tokens", "Token-slots routed to each expert.",
                                     [*base, "layer", "expert"], registry=r)
        self.overflow = Counter("moeguard_expert_overflow_tokens",
                                "Token-slots over expert capacity (dropped; 0 when dropless).",
                                [*base, "layer"], registry=r)
        self.expert_split_steps = Counter(
            contract.METRIC_EXPERT_SPLIT_STEPS_TOTAL.removesuffix("_total"),
            "Engine steps in which some MoE layer ran its expert work in more than one chunk "
            "(expert_chunk_tokens; 256 token-slots on the CPU's oneDNN path).", base, registry=r)
        self.step_expert_chunks = Histogram(
            contract.METRIC_STEP_EXPERT_CHUNKS,
            "Per engine step that routed token-slots: the most chunks any MoE layer split its expert "
            "work into (1: not split).", base, registry=r, buckets=contract.EXPERT_CHUNK_BUCKETS)
        self.budget = {name: gauge(f"moeguard_budget_{name}", f"Budget in effect: {name}.")
                       for name in BUDGET_NAMES}
        self.budget_generation = gauge(contract.METRIC_BUDGET_GENERATION,
                                       "Generation of the budget document applied (-1: none yet).")
        self.budget_shrink = gauge("moeguard_budget_shrink_factor",
                                   "Factor applied to budgets under the memory soft limit (1: none).")
        self.budget_updates = Counter("moeguard_budget_updates", "Budget documents seen, by result.",
                                      [*base, "result"], registry=r)
        self.requests = Counter("moeguard_requests", "Finished requests, by status and HTTP code.",
                                [*base, "status", "code"], registry=r)
        self.rejections = Counter(contract.METRIC_REJECTIONS_TOTAL.removesuffix("_total"), "Requests refused, by reason.",
                                  [*base, "reason"], registry=r)
        self.queue_requests = gauge(contract.METRIC_QUEUE_REQUESTS, "Requests waiting in the queue.")
        self.queue_tokens = gauge("moeguard_queue_tokens", "Prompt tokens waiting in the queue.")
        self.running_requests = gauge("moeguard_running_requests", "Requests in running batches.")
        self.ttft = Histogram(contract.METRIC_TTFT_SECONDS, "Arrival to first token, by priority class.",
                              [*base, "priority"], registry=r, buckets=contract.TTFT_BUCKETS, unit="seconds")
        self.tpot = Histogram(contract.METRIC_TPOT_SECONDS,
                              "Per request answered: time per output token after the first, (last - first token) "
                              "/ (tokens - 1); 0 for a one-token answer. By priority class.",
                              [*base, "priority"], registry=r, buckets=contract.TPOT_BUCKETS, unit="seconds")
        self.kv_transfer_seconds = Histogram(
            contract.METRIC_KV_TRANSFER_SECONDS, "Per prompt KV read from a prefill worker (disaggregated "
            "prefill/decode): seconds from registering the cache to the read's end.", base, registry=r,
            buckets=contract.KV_TRANSFER_BUCKETS, unit="seconds")
        self.kv_transfer_bytes = Counter(
            contract.METRIC_KV_TRANSFER_BYTES_TOTAL.removesuffix("_total"), "Bytes of prompt KV read from prefill "
            "workers (disaggregated prefill/decode).", base, registry=r, unit="bytes")
        self.context_tokens = Histogram(contract.METRIC_REQUEST_CONTEXT_TOKENS,
                                        "Per request accepted into the queue: its KV capacity, prompt + max_tokens.",
                                        base, registry=r, buckets=contract.CONTEXT_TOKEN_BUCKETS)
        self.e2e = Histogram(contract.METRIC_E2E_LATENCY_SECONDS, "Arrival to last token, by priority class.",
                             [*base, "priority"], registry=r, buckets=LATENCY_BUCKETS, unit="seconds")
        self.preemptions = Counter(contract.METRIC_PREEMPTIONS_TOTAL.removesuffix("_total"),
                                   "Running requests moved back to the queue, KV cache kept, to make room "
                                   "for a higher priority class.", [*base, "priority"], registry=r)
        self.priority_rejections = Counter(
            contract.METRIC_PRIORITY_REJECTIONS_TOTAL.removesuffix("_total"),
            "Requests of a known priority class refused or ended without an answer, by reason "
            "(priority_shed: ended to make room for an interactive request).",
            [*base, "priority", "reason"], registry=r)
        self.priority_requests = gauge(contract.METRIC_PRIORITY_REQUESTS,
                                       "Requests in the worker by priority class and state (waiting, "
                                       "preempted: waiting again with their KV cache kept, running).",
                                       ["priority", "state"])
        self.step_seconds = Histogram("moeguard_step_duration_seconds", "Engine step wall time.",
                                      base, registry=r, buckets=LATENCY_BUCKETS, unit="seconds")
        self.stage_seconds = Histogram("moeguard_stage_duration_seconds",
                                       "Time per stage (queue per request; the others per step).",
                                       [*base, "stage"], registry=r, buckets=LATENCY_BUCKETS,
                                       unit="seconds")
        self.memory_usage = gauge(contract.METRIC_MEMORY_USAGE_BYTES,
                                  "The figure compared with the soft/hard limits, by source "
                                  "(cgroup working set: memory.current minus inactive file; or process rss).",
                                  ["source"], unit="bytes")
        self.memory_cgroup_limit = gauge("moeguard_memory_cgroup_limit_bytes",
                                         "The cgroup's own memory limit (memory.max), when limited.",
                                         ["source"], unit="bytes")
        self.memory_limit = gauge("moeguard_memory_limit_bytes",
                                  "The worker's soft and hard limits, compared with "
                                  "moeguard_memory_usage_bytes.", ["limit"], unit="bytes")
        self.memory_idle_footprint = gauge(
            contract.METRIC_MEMORY_IDLE_FOOTPRINT_BYTES,
            "Memory in use (moeguard_memory_usage_bytes' figure) at the latest memory check with no request in "
            "the worker: the loaded model, the runtime and the heap it keeps.", unit="bytes")
        self.admission_limit = gauge("moeguard_memory_admission_limit_bytes",
                                     "The limit memory-aware admission fits each step under: "
                                     "min(hard limit, memory cgroup limit); label limit names the one "
                                     "in effect (hard or cgroup).", ["limit"], unit="bytes")
        self.memory_state = gauge(contract.METRIC_MEMORY_LIMIT_STATE,
                                  "0 below the soft limit, 1 above soft, 2 above hard.")
        self.gpu = {name: gauge(f"moeguard_gpu_memory_{name}_bytes", doc, unit="bytes")
                    for name, doc in (
                        ("allocated", "torch.cuda.memory_allocated (caching allocator only)."),
                        ("reserved", "torch.cuda.memory_reserved (caching allocator only)."),
                        ("fragmentation", "Reserved minus allocated: the allocator's cache."),
                        ("used", "Device memory in use by everything (mem_get_info total - free)."),
                        ("total", "Device memory (mem_get_info)."))}
        self.pinned = gauge("moeguard_pinned_memory_bytes",
                            "Pinned host memory (torch.cuda.host_memory_stats allocated_bytes).",
                            unit="bytes")
        self.growth = gauge(contract.METRIC_MEMORY_GROWTH_BYTES_PER_SECOND,
                            "Least-squares slope over the worker's window, by part.", ["part"])
        self.blocks_growth = gauge("moeguard_python_allocated_blocks_growth_per_second",
                                   "Slope of the Python heap's live block count.")
        self.mappings_growth = gauge("moeguard_process_memory_mappings_growth_per_second",
                                     "Slope of the number of memory mappings.")
        self.leak = gauge(contract.METRIC_MEMORY_LEAK_SUSPECTED,
                          "1 when that part grows (native: anonymous RSS without the Python heap).",
                          ["kind"])
        self.overload = gauge(contract.METRIC_OVERLOAD_ACTIVE,
                              "1 while overload mode is on, by who asked for it.", ["source"])
        self.weight_bytes = gauge(contract.METRIC_MODEL_WEIGHT_BYTES,
                                  "Bytes of the loaded model's parameters (set once the model is loaded).",
                                  unit="bytes")
        self.matmul_kernel = gauge(
            "moeguard_matmul_kernel_info",
            "1 for the expert-matmul kernel in use (set once the model is loaded): kernel is onednn, torch "
            "(F.linear), torch_t (F.linear's product transposed, the weight as the GEMM's left operand), stream (moeguard's "
            "own few-row kernel, a C++ library built with the machine's compiler), onednn_packed (oneDNN on expert weights packed once into its blocked layout, which "
            "replace the dense ones), or a per-row-bucket plan measured at start-up such as torch<=4,onednn; "
            "cpu is the CPU model from /proc/cpuinfo.", ["kernel", "cpu"])
        self.memory_model = gauge(
            contract.METRIC_MEMORY_MODEL_INFO,
            "1 for the memory model the worker predicts its steps with (set once the model is loaded): the "
            "model's shape, dtype, expert_chunk_tokens and capacity_factor, as labels.", MEMORY_MODEL_LABELS)
        self.memory_step_peak = gauge(
            "moeguard_memory_step_peak_bytes",
            "The last engine step's peak above the resident set before it: figure=predicted (the memory "
            "model, before correction) or measured (VmHWM), memory-aware admission only.", ["figure"],
            unit="bytes")
        self.memory_prediction_error = Histogram(
            "moeguard_memory_prediction_error_ratio",
            "Per engine step predicted at >= 4 MiB: measured peak / predicted peak - 1 (positive: the model "
            "was under, the unsafe side).", base, registry=r, unit="ratio",
            buckets=(-0.75, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0, 2.0))
        self.memory_correction = gauge(
            contract.METRIC_MEMORY_PREDICTION_CORRECTION_RATIO,
            "The factor (>= 1) the memory model's predictions are multiplied by for admission: the largest "
            "measured/predicted ratio of the recent steps.", unit="ratio")
        self.memory_chunk_shrinks = Counter(
            "moeguard_memory_chunk_shrinks",
            "Prefill chunks cut below the prefill budget so that the step's predicted peak fits under the "
            "hard memory limit.", base, registry=r)
        self.oom = Counter(contract.METRIC_OOM_ERRORS_TOTAL.removesuffix("_total"),
                           "Batches failed by an out-of-memory error the worker survived.",
                           [*base, "kind"], registry=r)
        # --- diagnosis signals (issue 14) ---
        self.batches_in_flight = gauge(contract.METRIC_BATCHES_IN_FLIGHT,
                                       "Batches in flight now (at most max_concurrent_batches).")
        self.step_prefill_batches = Histogram(
            contract.METRIC_STEP_PREFILL_BATCHES,
            "Per engine step carrying prefill tokens: batches in flight holding a partly prefilled prompt "
            "at that step (burst overlap).", base, registry=r, buckets=contract.BATCH_COUNT_BUCKETS)
        self.step_queue_requests = Histogram(
            contract.METRIC_STEP_QUEUE_REQUESTS,
            "Per engine step: requests left waiting in the queue once the step's plan admitted its own "
            "(a burst drained between two scrapes of moeguard_queue_requests).", base, registry=r,
            buckets=contract.QUEUE_DEPTH_BUCKETS)
        self.long_running = gauge(contract.METRIC_LONG_REQUESTS_RUNNING,
                                  "Requests in a batch or preempted whose prompt is at least "
                                  "long_request_threshold_tokens.")
        self.long_admitted = Counter(contract.METRIC_LONG_REQUESTS_ADMITTED_TOTAL.removesuffix("_total"),
                                     "Long requests admitted from the queue into a batch.", base, registry=r)
        self.kv_cache_bytes = gauge(contract.METRIC_KV_CACHE_BYTES,
                                    "KV cache held by the requests in the worker (running and preempted): "
                                    "the caches' tensor bytes, allocated whole at admission.", unit="bytes")
        self.peak_breakdown = gauge(contract.METRIC_MEMORY_PEAK_BREAKDOWN_BYTES,
                                    "The largest predicted step peak of the last "
                                    f"{contract.PEAK_BREAKDOWN_WINDOW_SECONDS:g} s, by stage (memory model).",
                                    ["stage"], unit="bytes")
        self.top_share = gauge(contract.METRIC_EXPERT_TOP_SHARE_RATIO,
                               "Top expert's share of the layer's token-slots, last step with "
                               ">= 4*num_experts routed token-slots.", ["layer"], unit="ratio")
        self.ucx = gauge(contract.METRIC_UCX_INFO,
                         "1 for the UCX state of the process: loaded, the mapped UCX libraries, the effective "
                         "UCX_MEM_MMAP_HOOK_MODE and UCX_RCACHE_MAX_UNRELEASED (default:<UCX's default> when "
                         "unset).", UCX_LABELS)
        self._ucx_labels: dict[str, str] | None = None
        self.model_weight_bytes = 0
        """What :meth:`set_model_weights` set, bytes (0 before the model is loaded)."""
        self.start_time = gauge(contract.METRIC_WORKER_START_TIME_SECONDS,
                                "When this worker's counters started from 0 (Unix time).", unit="seconds")
        self.start_time.labels(**labels).set(time.time())
        r.register(_ProcessMemoryCollector(labels))
        self.budget_generation.labels(**labels).set(-1)
        self.budget_shrink.labels(**labels).set(1)
        for phase in ("prefill", "decode"):
            self.batch_tokens.labels(**labels, phase=phase)
        self.step_skew.labels(**labels)  # 0 steps from the start: an idle worker says so
        self.context_tokens.labels(**labels)
        self.step_prefill_batches.labels(**labels)
        self.step_queue_requests.labels(**labels)
        self.long_admitted.labels(**labels)
        for gauge_ in (self.batches_in_flight, self.long_running, self.kv_cache_bytes):
            gauge_.labels(**labels).set(0)
        for stage in contract.MEMORY_STAGES:
            self.peak_breakdown.labels(**labels, stage=stage).set(0)
        self.step_expert_chunks.labels(**labels)
        self.expert_split_steps.labels(**labels)
        for name in ("applied", "rejected", "ignored"):
            self.budget_updates.labels(**labels, result=name)
        for kind in ("native", "python_heap"):
            self.leak.labels(**labels, kind=kind).set(0)
        for source in ("operator", "worker", "env"):
            self.overload.labels(**labels, source=source).set(0)
        for priority in PRIORITIES:  # every class from the start: zero is a reading
            self.ttft.labels(**labels, priority=priority)
            self.tpot.labels(**labels, priority=priority)
            self.e2e.labels(**labels, priority=priority)
            self.preemptions.labels(**labels, priority=priority)
            for state in ("waiting", "preempted", "running"):
                self.priority_requests.labels(**labels, priority=priority, state=state).set(0)

    def set_admission_limit(self, limit: str, limit_bytes: int) -> None:
        """``moeguard_memory_admission_limit_bytes{limit}``: one series, of the limit in effect (``hard`` or
        ``cgroup``); the other one's is removed."""
        for other in ("hard", "cgroup"):
            if other != limit:
                with contextlib.suppress(KeyError):  # never set
                    self.admission_limit.remove(*(self.labels[k] for k in contract.WORKER_LABELS), other)
        self.admission_limit.labels(**self.l(limit=limit)).set(limit_bytes)

    def l(self, **extra: str) -> dict[str, str]:  # noqa: E743 - short on purpose
        return {**self.labels, **extra}

    def observe_step(self, prefill_tokens: int, decode_tokens: int, routing: Sequence[RoutingStats],
                     seconds: float) -> None:
        """Record one engine step. Skew/balancedness gauges are set only from steps
        that routed at least ``4 * num_experts`` token-slots: below that (e.g. a
        decode step of two sequences routes 4 slots over 8 experts) the ratio is
        dominated by the floor of the median and says nothing about the router.
        Expert chunking (:attr:`moe.RoutingStats.expert_chunks`): the step's most
        chunks in any layer, and a split step counted when that is above 1."""
        if prefill_tokens:
            self.batch_tokens.labels(**self.l(phase="prefill")).observe(prefill_tokens)
        if decode_tokens:
            self.batch_tokens.labels(**self.l(phase="decode")).observe(decode_tokens)
        self.step_seconds.labels(**self.labels).observe(seconds)
        step_skew: float | None = None
        for layer, stats in enumerate(routing):
            for expert, n in enumerate(stats.tokens_per_expert):
                if n:
                    self.expert_tokens.labels(**self.l(layer=str(layer), expert=str(expert))).inc(n)
            if stats.overflow_tokens:
                self.overflow.labels(**self.l(layer=str(layer))).inc(stats.overflow_tokens)
            if stats.routed_slots >= 4 * self.num_experts:
                self.skew.labels(**self.l(layer=str(layer))).set(stats.expert_skew_ratio)
                self.balancedness.labels(**self.l(layer=str(layer))).set(stats.balancedness)
                self.top_share.labels(**self.l(layer=str(layer))).set(top_share(stats))
                step_skew = max(stats.expert_skew_ratio, step_skew or 0.0)
        if step_skew is not None:
            self.step_skew.labels(**self.labels).observe(step_skew)
        chunks = max((stats.expert_chunks for stats in routing), default=0)
        if chunks:
            self.step_expert_chunks.labels(**self.labels).observe(chunks)
        if chunks > 1:
            self.expert_split_steps.labels(**self.labels).inc()

    def set_batches(self, batches: int, long_running: int) -> None:
        """``moeguard_batches_in_flight`` and ``moeguard_long_requests_running``."""
        self.batches_in_flight.labels(**self.labels).set(batches)
        self.long_running.labels(**self.labels).set(long_running)

    def observe_plan(self, prefill_batches: int, long_admitted: int, queue_requests: int) -> None:
        """A planned step: its prefill batches (observed when > 0: the step carries prefill), the long
        requests it admitted from the queue, and the requests still waiting after its admission (every step)."""
        self.step_queue_requests.labels(**self.labels).observe(queue_requests)
        if prefill_batches:
            self.step_prefill_batches.labels(**self.labels).observe(prefill_batches)
        if long_admitted:
            self.long_admitted.labels(**self.labels).inc(long_admitted)

    def set_peak_breakdown(self, stages: Mapping[str, int]) -> None:
        """``moeguard_memory_peak_breakdown_bytes{stage}`` (``contract.MEMORY_STAGES``), bytes."""
        for stage in contract.MEMORY_STAGES:
            self.peak_breakdown.labels(**self.l(stage=stage)).set(stages[stage])

    def set_ucx(self, labels: Mapping[str, str]) -> bool:
        """``moeguard_ucx_info{labels} = 1`` (``ucx.UcxInfo.labels``); the previous label set is removed.
        Returns whether it changed."""
        new = dict(labels)
        if new == self._ucx_labels:
            return False
        if self._ucx_labels is not None:
            old = self.l(**self._ucx_labels)
            self.ucx.remove(*(old[name] for name in (*contract.WORKER_LABELS, *UCX_LABELS)))
        self.ucx.labels(**self.l(**new)).set(1)
        self._ucx_labels = new
        return True

    def set_model_weights(self, parameters: Iterable[Any]) -> int:
        """Set ``moeguard_model_weight_bytes`` from the loaded model's ``parameters()`` (torch tensors:
        ``numel × element_size``, in the dtype they were loaded in; packed expert weights: oneDNN's size
        of their blocked layout, :func:`moe.tensor_bytes`); returns the bytes."""
        total = sum(tensor_bytes(p) for p in parameters)
        self.weight_bytes.labels(**self.labels).set(total)
        self.model_weight_bytes = total
        return total

    def set_memory_model(self, model: ModelMemory) -> None:
        """``moeguard_memory_model_info{<model's labels>} = 1`` (:func:`memory_model_info.info_labels`)."""
        self.memory_model.clear()
        self.memory_model.labels(**self.l(**info_labels(model))).set(1)

    def set_matmul_kernel(self, kernel: str, cpu: str) -> None:
        """``moeguard_matmul_kernel_info{kernel, cpu} = 1`` (an info metric: the labels carry the value)."""
        self.matmul_kernel.clear()
        self.matmul_kernel.labels(**self.l(kernel=kernel, cpu=cpu)).set(1)

    def stage(self, stage: str, seconds: float) -> None:
        self.stage_seconds.labels(**self.l(stage=stage)).observe(seconds)

    def set_budgets(self, budgets: Budgets, shrink_factor: float = 1.0) -> None:
        for name, g in self.budget.items():
            g.labels(**self.labels).set(getattr(budgets, name))
        self.budget_shrink.labels(**self.labels).set(shrink_factor)

    def set_queue(self, requests: int, tokens: int, running: int,
                  by_priority: Mapping[str, Mapping[str, int]] | None = None) -> None:
        """The queue gauges; ``by_priority``: class -> state -> requests
        (:meth:`scheduler.Scheduler.counts_by_priority`)."""
        self.queue_requests.labels(**self.labels).set(requests)
        self.queue_tokens.labels(**self.labels).set(tokens)
        self.running_requests.labels(**self.labels).set(running)
        for priority, states in (by_priority or {}).items():
            for state, n in states.items():
                self.priority_requests.labels(**self.l(priority=priority, state=state)).set(n)

    def refused(self, reason: str, priority: str | None, n: int = 1) -> None:
        """Count ``n`` requests refused (or ended unanswered) for ``reason``: by reason, and, when the
        request's class is known, by class and reason."""
        self.rejections.labels(**self.l(reason=reason)).inc(n)
        if priority is not None:
            self.priority_rejections.labels(**self.l(priority=priority, reason=reason)).inc(n)

    def set_device(self, device: DeviceMemory) -> None:
        for name, value in (("allocated", device.allocated), ("reserved", device.reserved),
                            ("fragmentation", device.fragmentation), ("used", device.used),
                            ("total", device.total)):
            self.gpu[name].labels(**self.labels).set(value)
        if device.pinned is not None:
            self.pinned.labels(**self.labels).set(device.pinned)

    def set_growth(self, growth: Growth, kind: str) -> None:
        for part, value in (("rss", growth.rss_bytes), ("rss_anonymous", growth.rss_anonymous_bytes),
                            ("rss_file", growth.rss_file_bytes),
                            ("malloc_in_use", growth.malloc_in_use_bytes)):
            self.growth.labels(**self.l(part=part)).set(value)
        self.blocks_growth.labels(**self.labels).set(growth.python_allocated_blocks)
        self.mappings_growth.labels(**self.labels).set(growth.mappings)
        for k in ("native", "python_heap"):
            self.leak.labels(**self.l(kind=k)).set(1 if kind == k else 0)


def top_share(stats: RoutingStats) -> float:
    """The top expert's share of a layer's token-slots (``top_expert_tokens / routed_slots``; 0 when none
    were routed): ``1/E`` balanced, at most ``1/k``."""
    return stats.top_expert_tokens / stats.routed_slots if stats.routed_slots else 0.0


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

    def allowed(self, event: str) -> bool:
        """Whether ``event`` would be logged now (so costly fields are computed only then)."""
        last = self._last.get(event)
        return last is None or self._clock() - last >= self.interval_s

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


def write_termination_message(message: str, path: str = contract.TERMINATION_MESSAGE_PATH) -> bool:
    """Write why the worker is about to exit to the container's termination-message file, which the
    kubelet creates (``contract.TERMINATION_MESSAGE_PATH``) and copies into the pod's
    ``containerStatuses[].lastState.terminated.message``. The kubelet keeps at most 4096 bytes: longer
    messages are cut here, on a character boundary. Outside Kubernetes the file does not exist and
    nothing is written (it is never created). Returns whether the message was written; never raises."""
    data = message.encode("utf-8", "replace")[:4096].decode("utf-8", "ignore")
    try:
        with open(path, "r+", encoding="utf-8") as out:
            out.truncate(0)
            out.write(data)
    except OSError:
        return False
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
