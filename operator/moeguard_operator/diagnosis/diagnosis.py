"""The incident diagnosis (issue 14), as a pure function over the last looks: ``diagnose(memory, look, prior,
spec, now)``. No I/O and no clock; it never changes budgets (the budget policy, :func:`policy.decide`, stays
the only writer of budgets, and never reads a finding).

Each look is judged by one rule per kind (:data:`models.FINDING_KINDS`), three-valued: *held* (with its
evidence), *not held*, or *unknown* (a signal it needs is missing). Rules hold per pod; the service's verdict is
held when a pod with all its signals holds it, else unknown when some pod's signals are missing.

* **Memory symptom** (the gate of BurstOverlap and LongContextPileUp): a pod's window max memory in use at or
  above ``control.rssSoftFraction`` of ``hardLimit``, memory failures in the window (OOM errors survived,
  ``memory_predicted``/``memory_hard_limit`` refusals, prefill chunk shrinks), its memory limit state at or above
  soft (1), or a new OOM kill of a worker container.
* **BurstOverlap**: the symptom, at least :data:`BURST_MIN_PREFILL_BATCHES` prefill batches in flight at one
  step, the queue at :data:`BURST_MIN_QUEUE` or more, and *no* long-request pile-up (fewer than
  :data:`LONG_MIN_REQUESTS` long requests running and admitted): concurrent prefills of many ordinary prompts,
  whose transient buffers add up. Not when the symptom has a cause with its own finding: the pod's memory grows
  steadily (:func:`grows_steadily`, a leak's trend), or the skew ratio is at or above ``control.skewThreshold``
  (skewed routing swells the hot experts' buffers). The peak breakdown (the memory model, ``moeguard_core.memory_model``) is
  evidence, not a condition: on small models attention's transients outweigh the experts' for ordinary prompts
  too (the drills' model: 6.3 MiB of attention against 3.4 MiB of expert buffers for eight 250-token prompts).
* **LongContextPileUp**: the symptom, at least :data:`LONG_MIN_REQUESTS` long requests running (or admitted in
  the window), and a peak that is KV cache and attention (``kv_cache + attention > expert_buffers +
  dense_mlp``). The long-request test excludes the two: a pile-up is never a burst.
* **RoutingSkew**: the skew ratio at or above ``control.skewThreshold`` in :data:`CONSECUTIVE_LOOKS` looks in a
  row (no memory gate: skew is the cause, whatever memory does yet).
* **NativeMemoryLeak** / **PythonHeapLeak**: a pod whose worker is past its warm-up (at least
  the look's warm-up (the operator's ``--leak-warmup-seconds``, :data:`LEAK_WARMUP_SECONDS` by default) +
  ``leakWindowSeconds`` old) whose *steady growth* (the smallest RSS slope of the
  sub-windows of the leak window) adds at least :data:`LEAK_MIN_WINDOW_GROWTH_BYTES` over the window, and whose
  kind over that window (:func:`leak_kind`: anonymous RSS against Python heap blocks) is the finding's; the
  steady growth must also be above the noise floor
  :data:`observation.LEAK_NOISE_BYTES_PER_SECOND`, in :data:`CONSECUTIVE_LOOKS` looks in a row. A leak grows in every
  sub-window; a burst's one-off jump leaves flat sub-windows, so its minimum slope stays at the floor.
* **UCXRiskyConfig**: a pod has UCX loaded with mmap hooks on (``UCX_MEM_MMAP_HOOK_MODE`` not ``none``) and an
  unbounded rcache invalidation queue (``UCX_RCACHE_MAX_UNRELEASED`` unset or ``inf``): the vLLM/NIXL RSS growth
  outside the Python heap. One look.
* **AllocatorFragmentation** (GPU): reserved at least :data:`FRAGMENTATION_RATIO` × allocated and at least
  :data:`FRAGMENTATION_MIN_BYTES` more, while memory failures happen in the window (PyTorch's caching
  allocator holding freed blocks it cannot reuse: ``expandable_segments`` is PyTorch's remedy; its patch edits only
  that option of ``PYTORCH_CUDA_ALLOC_CONF`` and is left out where it would change nothing or overturn a deliberate
  ``False``: :mod:`alloc_conf`).

A finding starts in the first look its rule holds (``since``: the first of the consecutive looks), stays while
it holds, and clears once its rule has not held for :func:`clear_after_seconds` of looks in which it could be
judged. While a signal it needs is missing (Prometheus blind, a silent pod, a failed query, a worker that does
not export it) no finding starts and none clears; ``missingSignals`` says what is missing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from moeguard_core import contract
from moeguard_core.ucx import risky_labels
from moeguard_operator.diagnosis.alloc_conf import expandable_segments_advice
from moeguard_operator.loop.observation import (
    LEAK_NOISE_BYTES_PER_SECOND,
    LEAK_WARMUP_SECONDS,
    Observation,
)
from moeguard_operator.loop.report import Event
from moeguard_operator.loop.signals import DiagnosisSignals, PodSignals, UcxInfo
from moeguard_operator.spec.models import (
    FINDING_KINDS,
    DiagnosisStatus,
    Evidence,
    Finding,
    MoEInferenceServiceSpec,
)

BURST_MIN_PREFILL_BATCHES = 2.0
"""Prefill batches in flight at one step from which prefills overlap (one batch's prefill alone is the normal
case that the budgets are sized for), batches."""
BURST_MIN_QUEUE = 4.0
"""Window max of requests waiting from which the arrivals came as a burst (the queue spiked), requests. Not 2: a
worker sharing two loaded cores with its neighbours queues two ordinary requests at 1 request/s, and a leak that
crossed the soft fraction then read as BurstOverlap until its window of steady growth filled (CI of stop 38: the
PythonHeapLeak drill, BurstOverlap 50 s after the onset). The drills' real bursts queue 8-13
(``bench/results/diagnosis_run1.md``)."""
LONG_MIN_REQUESTS = 2.0
"""Long requests running at once (or admitted in the window) from which they pile up (one is what
``maxLongRequestsPerBatch`` exists for), requests."""
CONSECUTIVE_LOOKS = 2
"""Looks in a row a skew or leak rule must hold before its finding starts (one look's skew can be one batch;
the worker's leak flag and the steady growth both need to persist). The loop keeps only the kinds that held in
the previous look (:class:`DiagnosisMemory`), so this is fixed at 2."""
FRAGMENTATION_RATIO = 1.5
"""Reserved / allocated GPU memory from which the caching allocator's cache is fragmentation, not reuse."""
FRAGMENTATION_MIN_BYTES = 2**30
"""Reserved minus allocated GPU memory from which fragmentation matters (1 GiB), bytes."""
LEAK_MIN_WINDOW_GROWTH_BYTES = 64 * 2**20
"""The least growth a leak adds over its window, bytes: the steady slope times ``leakWindowSeconds``. A worker
under varied traffic grows its allocator's arenas and caches by up to ~120 MiB in steps over its first minutes and
then stays flat (the calm trace run of ``bench/diagnosis.md``: 898 to 1,022 MiB in 5 minutes, 30-s rises up to
+66 MiB); steps leave flat sub-windows, and a leak that adds less than this over a short window is not told from
them. With the default 600-s window it asks for 6.4 MiB/min; slower leaks are the budget loop's
``MemoryLeakSuspected`` (time to the hard limit)."""
MIN_CLEAR_SECONDS = 60
"""The shortest calm before a finding clears, seconds (:func:`clear_after_seconds`)."""
STAGES_BURST = ("expert_buffers", "dense_mlp")
STAGES_CONTEXT = ("kv_cache", "attention")
GIB = 2**30

Tri = bool | None
"""A three-valued truth: True, False, or None (unknown: a signal is missing)."""


def all3(values: Iterable[Tri]) -> Tri:
    """Three-valued AND: False when any is False, else None when any is unknown, else True."""
    out: Tri = True
    for v in values:
        if v is False:
            return False
        if v is None:
            out = None
    return out


def not3(value: Tri) -> Tri:
    """Three-valued NOT: unknown stays unknown."""
    return None if value is None else not value


def any3(values: Iterable[Tri]) -> Tri:
    """Three-valued OR (De Morgan over :func:`all3`): True when any is True, else None when any is unknown,
    else False."""
    return not3(all3(not3(v) for v in values))


def at_least(value: float | None, bound: float) -> Tri:
    """``value >= bound``; None when the value is missing."""
    return None if value is None else value >= bound


def clear_after_seconds(spec: MoEInferenceServiceSpec) -> int:
    """Seconds of judged looks without its rule before a finding clears: ``max(2 × windowSeconds, 60)``."""
    return max(2 * spec.control.window_seconds, MIN_CLEAR_SECONDS)


@dataclass(frozen=True)
class DiagnosisLook:
    """The diagnosis's share of one look (built from a :class:`observation.Observation`; not kept between looks).

    Attributes:
        time: when the look was made.
        visible: Prometheus answered, every Running pod reports, and the diagnosis queries answered.
        missing: the missing signals, as sentences (empty when nothing is missing).
        new_oom_kills: OOM-killed worker containers since the previous look.
        skew_ratio: the policy's skew ratio (:attr:`observation.Observation.skew_ratio`); skew_seen: it is known.
        signals: the diagnosis signals of the reporting pods.
        leak_warmup_seconds: a worker's warm-up, seconds (the operator's ``--leak-warmup-seconds``): a pod younger
            than it plus ``leakWindowSeconds`` is never judged leaking.
    """

    time: datetime
    visible: bool
    missing: tuple[str, ...] = ()
    new_oom_kills: int = 0
    skew_ratio: float | None = None
    skew_seen: bool = False
    signals: DiagnosisSignals = field(default_factory=DiagnosisSignals)
    leak_warmup_seconds: float = LEAK_WARMUP_SECONDS

    @classmethod
    def of(cls, obs: Observation, leak_warmup_seconds: float = LEAK_WARMUP_SECONDS) -> DiagnosisLook:
        """The diagnosis's share of an observation; ``leak_warmup_seconds``: see the attribute."""
        missing = [m for m in (obs.error, obs.signals_missing) if m]
        if obs.available and obs.memory_ratio is None:
            missing.append("memory in use")
        if obs.silent_pods:
            missing.append(f"silent pods: {', '.join(obs.silent_pods)}")
        if obs.available and obs.signals is None and not obs.signals_missing:
            missing.append("diagnosis signals")
        signals = obs.signals or DiagnosisSignals()
        visible = obs.available and not obs.silent_pods and obs.signals is not None
        return cls(obs.time, visible, (*missing, *signals.missing), obs.new_oom_kills, obs.skew_ratio,
                   obs.skew_seen, signals, leak_warmup_seconds)


@dataclass(frozen=True)
class Held:
    """A rule that held in a look: the finding's content."""

    message: str
    evidence: tuple[Evidence, ...]
    remedy: str
    patch: str | None
    pods: tuple[str, ...]


Verdict = Held | bool | None
"""A rule's verdict on one look: :class:`Held`, False (not held) or None (unknown)."""


@dataclass(frozen=True)
class DiagnosisMemory:
    """The loop's memory of a service's diagnosis between looks (never in status; bounded).

    Attributes:
        previous: the kinds whose rule held in the previous look (for :data:`CONSECUTIVE_KINDS`).
        previous_time: the time of the previous look.
        last_held: ``(kind, time)``: the last look in which each active finding's rule held.
        unknown_at: ``(kind, time)``: the last look in which each kind's rule could not be judged.
        blind_at: the latest moment every rule was unknown (the process's start: after an operator restart a
            restored finding clears only after a full calm period seen by this process).
    """

    previous: tuple[str, ...] = ()
    previous_time: datetime | None = None
    last_held: tuple[tuple[str, datetime], ...] = ()
    unknown_at: tuple[tuple[str, datetime], ...] = ()
    blind_at: datetime | None = None


@dataclass(frozen=True)
class Diagnosis:
    """The diagnosis after one look.

    Attributes:
        status: ``status.diagnosis``.
        events: the Events of the findings that started or cleared.
        memory: the next :class:`DiagnosisMemory`.
        started, cleared: the kinds that started, and that cleared, in this look.
    """

    status: DiagnosisStatus
    events: tuple[Event, ...]
    memory: DiagnosisMemory
    started: tuple[str, ...] = ()
    cleared: tuple[str, ...] = ()


# --- evidence helpers --------------------------------------------------------------------------------------

def _ev(signal: str, value: float, unit: str, metric: str, pod: str | None = None, detail: str = "") -> Evidence:
    return Evidence(signal=signal, value=round(value, 4) if math.isfinite(value) else 0.0, unit=unit,
                    metric=metric, pod=pod, detail=detail)


def _mib(value: float) -> str:
    return f"{value / 2**20:.0f} MiB"


def _patch(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


def lowered_budget_patch(spec: MoEInferenceServiceSpec, name: str) -> tuple[int, str] | None:
    """The JSON merge patch lowering ``spec.batching.<name>`` by one (never below 1; its floor follows when it
    would be above), and the new value; None when it is already 1."""
    value = int(getattr(spec.batching, name))
    if value <= 1:
        return None
    alias = contract.Budgets.model_fields[name].alias or name
    batching: dict[str, Any] = {alias: value - 1}
    if int(getattr(spec.batching.floors, name)) > value - 1:
        batching["floors"] = {alias: value - 1}
    return value - 1, _patch({"spec": {"batching": batching}})


def ucx_patch(spec: MoEInferenceServiceSpec) -> str:
    """The merge patch of the safe UCX settings: mmap hooks off (``ucx.mode: none``; ``rcache`` on AMD GPUs,
    where ``none`` breaks NIXL's ROCm path) and a bounded rcache queue (``contract.UCX_SAFE_RCACHE_MAX_UNRELEASED``)."""
    mode = "rcache" if spec.resources.amd_gpu else "none"
    return _patch({"spec": {"ucx": {"mode": mode, "rcacheMaxUnreleased": contract.UCX_SAFE_RCACHE_MAX_UNRELEASED}}})


def alloc_conf_patch(spec: MoEInferenceServiceSpec, wasted_bytes: float) -> tuple[str, str | None]:
    """The remedy for a fragmented caching allocator keeping ``wasted_bytes`` of unusable blocks, and its merge
    patch of ``template.extraEnv`` (a merge patch replaces the list: the other variables are kept in it), or None
    where there is none (:func:`alloc_conf.expandable_segments_advice`: only ``expandable_segments`` changes; no
    patch when it is on already or set to False deliberately)."""
    advice = expandable_segments_advice(spec.template.extra_env, wasted_bytes / GIB)
    patch = None if advice.env is None else _patch({"spec": {"template": {"extraEnv": advice.env}}})
    return advice.remedy, patch


# --- the rules, per pod -------------------------------------------------------------------------------------

def memory_symptom(pod: PodSignals, look: DiagnosisLook, spec: MoEInferenceServiceSpec) -> tuple[Tri, list[Evidence]]:
    """Whether ``pod`` shows a memory symptom (see the module docstring), and the evidence of it."""
    hard = spec.resources.hard_limit_bytes
    ratio = None if pod.memory_bytes is None else pod.memory_bytes / hard
    facts: list[Evidence] = []
    if ratio is not None and ratio >= spec.control.rss_soft_fraction:
        facts.append(_ev("memory in use / hardLimit", ratio, "ratio", contract.METRIC_MEMORY_USAGE_BYTES, pod.pod))
    if pod.memory_failures is not None and pod.memory_failures > 0:
        facts.append(_ev("memory failures in the window", pod.memory_failures, "failures",
                         "moeguard_oom_errors_total + memory refusals + chunk shrinks", pod.pod))
    if pod.limit_state is not None and pod.limit_state >= 1:
        facts.append(_ev("memory limit state", pod.limit_state, "", contract.METRIC_MEMORY_LIMIT_STATE, pod.pod))
    if look.new_oom_kills > 0:
        facts.append(_ev("new OOM kills", look.new_oom_kills, "containers", "kubelet OOMKilled"))
    if facts:
        return True, facts
    if ratio is None and pod.memory_failures is None and pod.limit_state is None:
        return None, []
    return False, []


def _sum_stages(pod: PodSignals, stages: tuple[str, ...]) -> float:
    return sum(pod.stage(s) or 0.0 for s in stages)


def _breakdown_ev(pod: PodSignals) -> list[Evidence]:
    return [_ev(f"peak breakdown {stage}", v, "bytes", contract.METRIC_MEMORY_PEAK_BREAKDOWN_BYTES, pod.pod)
            for stage, v in pod.breakdown if stage != "weights"]


def burst_overlap(pod: PodSignals, look: DiagnosisLook, spec: MoEInferenceServiceSpec) -> Verdict:
    """BurstOverlap on one pod (module docstring)."""
    symptom, facts = memory_symptom(pod, look, spec)
    burst = _sum_stages(pod, STAGES_BURST) if pod.breakdown else None
    context = _sum_stages(pod, STAGES_CONTEXT) if pod.breakdown else None
    longs = any3((at_least(pod.long_running, LONG_MIN_REQUESTS), at_least(pod.long_admitted, LONG_MIN_REQUESTS)))
    held = all3((symptom, at_least(pod.prefill_batches, BURST_MIN_PREFILL_BATCHES),
                 at_least(pod.queue_requests, BURST_MIN_QUEUE), not3(longs)))
    if held is not True:
        return held
    if grows_steadily(pod, spec):
        # The memory symptom is a trend, not a burst: a leaking worker with two prefills and a short queue (a slow
        # machine's ordinary traffic) is the leak's finding alone (CI of issue 29: the PythonHeapLeak drill also
        # read as BurstOverlap). A burst's jump leaves flat sub-windows, so its smallest slope stays low.
        return False
    if look.skew_ratio is not None and look.skew_ratio >= spec.control.skew_threshold:
        # Skewed routing swells the hot experts' buffers: the memory symptom is RoutingSkew's (rehearsal of issue
        # 29: the RoutingSkew drill at 26% of hardLimit against a 25% soft fraction also read as BurstOverlap).
        return False
    assert pod.prefill_batches is not None and pod.queue_requests is not None
    lowered = lowered_budget_patch(spec, "max_concurrent_batches")
    change = (f"lower batching.maxConcurrentBatches to {lowered[0]}" if lowered
              else "maxConcurrentBatches is already 1: lower batching.maxPrefillTokens")
    return Held(
        message=(f"burst overlap on {pod.pod}: {pod.prefill_batches:.0f} prefill batches in flight at once with "
                 f"{pod.queue_requests:.0f} requests queued and no long-request pile-up, peak {_mib(burst or 0.0)} of "
                 f"expert buffers and dense MLP and {_mib(context or 0.0)} of KV cache and attention"),
        evidence=(_ev("prefill batches in flight", pod.prefill_batches, "batches",
                      f"histogram_quantile(1, {contract.METRIC_STEP_PREFILL_BATCHES})", pod.pod),
                  _ev("queue requests (window max)", pod.queue_requests, "requests",
                      f"max({contract.METRIC_QUEUE_REQUESTS}, histogram_quantile(1, "
                      f"{contract.METRIC_STEP_QUEUE_REQUESTS}))", pod.pod), *facts, *_breakdown_ev(pod)),
        remedy=(f"{change} (or the prefill budget, batching.maxPrefillTokens) so that fewer prefills overlap, and "
                "bound the queue (batching.maxQueueRequests, batching.maxConcurrentRequests) so a burst waits or is "
                "refused with 429 instead of piling into memory"),
        patch=lowered[1] if lowered else None,
        pods=(pod.pod,))


def long_context_pile_up(pod: PodSignals, look: DiagnosisLook, spec: MoEInferenceServiceSpec) -> Verdict:
    """LongContextPileUp on one pod (module docstring)."""
    symptom, facts = memory_symptom(pod, look, spec)
    burst = _sum_stages(pod, STAGES_BURST) if pod.breakdown else None
    context = _sum_stages(pod, STAGES_CONTEXT) if pod.breakdown else None
    longs = any3((at_least(pod.long_running, LONG_MIN_REQUESTS), at_least(pod.long_admitted, LONG_MIN_REQUESTS)))
    held = all3((symptom, longs, None if burst is None or context is None else context > burst))
    if held is not True:
        return held
    assert context is not None
    lowered = lowered_budget_patch(spec, "max_long_requests_per_batch")
    change = (f"lower batching.maxLongRequestsPerBatch to {lowered[0]}" if lowered
              else "maxLongRequestsPerBatch is already 1")
    running = pod.long_running or 0.0
    admitted = pod.long_admitted or 0.0
    return Held(
        message=(f"long-context pile-up on {pod.pod}: {running:.0f} long requests running ({admitted:.0f} admitted "
                 f"in the window), peak {_mib(context)} of KV cache and attention against {_mib(burst or 0.0)} of "
                 "expert buffers and dense MLP"),
        evidence=(_ev("long requests running (window max)", running, "requests", contract.METRIC_LONG_REQUESTS_RUNNING,
                      pod.pod),
                  _ev("long requests admitted in the window", admitted, "requests",
                      contract.METRIC_LONG_REQUESTS_ADMITTED_TOTAL, pod.pod),
                  *([_ev("KV cache (window max)", pod.kv_cache_bytes, "bytes", contract.METRIC_KV_CACHE_BYTES, pod.pod)]
                    if pod.kv_cache_bytes is not None else []),
                  *facts, *_breakdown_ev(pod)),
        remedy=(f"{change}; cap long contexts under overload (overload.maxContextTokens) and, where long prompts are "
                "the norm, raise batching.longRequestThresholdTokens only with the memory to hold them"),
        patch=lowered[1] if lowered else None,
        pods=(pod.pod,))


def ucx_risky(ucx: UcxInfo) -> bool:
    """UCX loaded with mmap hooks on and an unbounded rcache invalidation queue: the worker's own judgement
    (:func:`moeguard_core.ucx.risky_labels`; an unset ``UCX_RCACHE_MAX_UNRELEASED``, ``default:...``, is
    judged unbounded after NIXL PR #1210)."""
    return risky_labels(ucx.loaded, ucx.mmap_hook_mode, ucx.rcache_max_unreleased)


def _ucx_detail(ucx: UcxInfo | None) -> str:
    if ucx is None:
        return "UCX info not exported"
    if not ucx.loaded:
        return "UCX not loaded"
    return (f"UCX loaded ({ucx.libraries or 'libraries unknown'}); UCX_MEM_MMAP_HOOK_MODE={ucx.mmap_hook_mode}, "
            f"UCX_RCACHE_MAX_UNRELEASED={ucx.rcache_max_unreleased}")


def ucx_risky_config(pod: PodSignals, look: DiagnosisLook, spec: MoEInferenceServiceSpec) -> Verdict:
    """UCXRiskyConfig on one pod (module docstring)."""
    if pod.ucx is None:
        return None
    if not ucx_risky(pod.ucx):
        return False
    return Held(
        message=f"risky UCX settings on {pod.pod}: {_ucx_detail(pod.ucx)}",
        evidence=(_ev("UCX loaded", 1.0, "", contract.METRIC_UCX_INFO, pod.pod, _ucx_detail(pod.ucx)),),
        remedy=(f"set {contract.UCX_ENV_MMAP_HOOK_MODE}=none (spec.ucx.mode: none; rcache on AMD GPUs) and a finite "
                f"{contract.UCX_ENV_RCACHE_MAX_UNRELEASED} ({contract.UCX_SAFE_RCACHE_MAX_UNRELEASED}, "
                "spec.ucx.rcacheMaxUnreleased): the unbounded invalidation queue grows RSS outside the Python heap"),
        patch=ucx_patch(spec), pods=(pod.pod,))


def leak_kind(pod: PodSignals) -> str | None:
    """``native`` when the Python heap's blocks grow by fewer than one per
    ``contract.LEAK_BYTES_PER_BLOCK_NATIVE`` bytes of anonymous RSS growth over the leak window, else
    ``python_heap``; None when either slope is missing. The worker's rule (``moeguard_runtime.memory.leak.classify``),
    over the leak window itself rather than the worker's last 60 s, which at a leak's onset still describe what
    came before."""
    anon, blocks = pod.anonymous_growth_bytes_per_second, pod.python_blocks_growth_per_second
    if anon is None or blocks is None:
        return None
    return "native" if blocks * contract.LEAK_BYTES_PER_BLOCK_NATIVE < anon else "python_heap"


def grows_steadily(pod: PodSignals, spec: MoEInferenceServiceSpec) -> bool | None:
    """Whether ``pod``'s memory grows as a leak does: its smallest sub-window RSS slope above
    ``LEAK_NOISE_BYTES_PER_SECOND`` and adding at least :data:`LEAK_MIN_WINDOW_GROWTH_BYTES` over
    ``control.leakWindowSeconds``; None when the slope is unknown."""
    slope = pod.steady_growth_bytes_per_second
    if slope is None:
        return None
    return slope > LEAK_NOISE_BYTES_PER_SECOND and slope * spec.control.leak_window_seconds >= LEAK_MIN_WINDOW_GROWTH_BYTES


def _leak(kind: str) -> Callable[[PodSignals, DiagnosisLook, MoEInferenceServiceSpec], Verdict]:
    def rule(pod: PodSignals, look: DiagnosisLook, spec: MoEInferenceServiceSpec) -> Verdict:
        if pod.age_seconds is None:
            return None
        lw = spec.control.leak_window_seconds
        if pod.age_seconds < look.leak_warmup_seconds + lw:
            return False  # the leak window still holds the worker's warm-up
        growing = grows_steadily(pod, spec)
        if growing is None:
            return None
        if not growing:
            return False
        slope = pod.steady_growth_bytes_per_second
        assert slope is not None
        judged = leak_kind(pod)
        if judged is None:
            return None
        if judged != kind:
            return False
        growth = dict(pod.growth)
        evidence = [_ev("steady RSS growth (smallest sub-window slope)", slope, "bytes/s",
                        f"min_over_time(deriv({contract.METRIC_PROCESS_RSS_BYTES}))", pod.pod),
                    _ev("anonymous RSS growth over the leak window", pod.anonymous_growth_bytes_per_second or 0.0,
                        "bytes/s", f"deriv({contract.METRIC_PROCESS_RSS_ANONYMOUS_BYTES}[{lw}s])", pod.pod),
                    _ev("Python heap blocks growth over the leak window", pod.python_blocks_growth_per_second or 0.0,
                        "blocks/s", f"deriv({contract.METRIC_PYTHON_ALLOCATED_BLOCKS}[{lw}s])", pod.pod,
                        f"the worker's own flag over its last 60 s: {', '.join(pod.leak_kinds) or 'none'}")]
        for part, label in (("rss_anonymous", "anonymous RSS growth"), ("malloc_in_use", "malloc in use growth")):
            if part in growth:
                evidence.append(_ev(label, growth[part], "bytes/s", contract.METRIC_MEMORY_GROWTH_BYTES_PER_SECOND,
                                    pod.pod))
        if pod.mappings_growth_per_second is not None:
            evidence.append(_ev("memory mappings growth", pod.mappings_growth_per_second, "mappings/s",
                                contract.METRIC_PROCESS_MEMORY_MAPPINGS_GROWTH, pod.pod))
        rate = f"{slope / 2**20 * 60:+.1f} MiB/min"
        if kind == "native":
            ucx = pod.ucx
            evidence.append(_ev("UCX loaded", 1.0 if ucx and ucx.loaded else 0.0, "", contract.METRIC_UCX_INFO,
                                pod.pod, _ucx_detail(ucx)))
            loaded = ucx is not None and ucx.loaded
            remedy = ((f"UCX is loaded: set {contract.UCX_ENV_MMAP_HOOK_MODE}=none (spec.ucx.mode: none) or a finite "
                       f"{contract.UCX_ENV_RCACHE_MAX_UNRELEASED} ({contract.UCX_SAFE_RCACHE_MAX_UNRELEASED}, "
                       "spec.ucx.rcacheMaxUnreleased)") if loaded else
                      "profile the native heap on one replica (heaptrack, or pmap -x diffs a few minutes apart) to "
                      "find the growing mappings")
            return Held(message=(f"native memory leak on {pod.pod}: RSS grows {rate} in every sub-window of the leak "
                                 f"window, outside the Python heap ({_ucx_detail(ucx)})"),
                        evidence=tuple(evidence), remedy=remedy + "; a rolling restart is the stopgap",
                        patch=ucx_patch(spec) if loaded else None, pods=(pod.pod,))
        return Held(message=f"Python heap leak on {pod.pod}: RSS grows {rate} in every sub-window of the leak window "
                            "with the Python heap growing",
                    evidence=tuple(evidence),
                    remedy=("run tracemalloc on one replica (snapshots a few minutes apart, compared by traceback) to "
                            "find the code path that grows; a rolling restart is the stopgap"),
                    patch=None, pods=(pod.pod,))
    return rule


def allocator_fragmentation(pod: PodSignals, look: DiagnosisLook, spec: MoEInferenceServiceSpec) -> Verdict:
    """AllocatorFragmentation on one pod (module docstring); not held on a worker without a GPU."""
    reserved, allocated = pod.gpu_reserved_bytes, pod.gpu_allocated_bytes
    if reserved is None or allocated is None:
        return False
    if reserved < FRAGMENTATION_RATIO * allocated or reserved - allocated < FRAGMENTATION_MIN_BYTES:
        return False
    if pod.memory_failures is None:
        return None
    if pod.memory_failures <= 0:
        return False
    remedy, patch = alloc_conf_patch(spec, reserved - allocated)
    return Held(
        message=(f"GPU allocator fragmentation on {pod.pod}: {reserved / GIB:.1f} GiB reserved for "
                 f"{allocated / GIB:.1f} GiB allocated, with {pod.memory_failures:.0f} memory failures in the window"),
        evidence=(_ev("GPU memory reserved (window max)", reserved, "bytes", contract.METRIC_GPU_MEMORY_RESERVED_BYTES,
                      pod.pod),
                  _ev("GPU memory allocated (window max)", allocated, "bytes",
                      contract.METRIC_GPU_MEMORY_ALLOCATED_BYTES, pod.pod),
                  _ev("memory failures in the window", pod.memory_failures, "failures",
                      "moeguard_oom_errors_total + memory refusals + chunk shrinks", pod.pod)),
        remedy=remedy, patch=patch, pods=(pod.pod,))


PodRule = Callable[[PodSignals, DiagnosisLook, MoEInferenceServiceSpec], Verdict]
POD_RULES: dict[str, PodRule] = {
    "BurstOverlap": burst_overlap,
    "LongContextPileUp": long_context_pile_up,
    "NativeMemoryLeak": _leak("native"),
    "PythonHeapLeak": _leak("python_heap"),
    "UCXRiskyConfig": ucx_risky_config,
    "AllocatorFragmentation": allocator_fragmentation,
}
CONSECUTIVE_KINDS = ("RoutingSkew", "NativeMemoryLeak", "PythonHeapLeak")
"""The kinds whose rule must hold :data:`CONSECUTIVE_LOOKS` looks in a row before they start."""


def merge(helds: list[Held]) -> Held:
    """One service-level finding from the pods that hold a rule: the first pod's message (with how many more),
    every pod's evidence and the affected pods."""
    first = helds[0]
    more = f" (and {len(helds) - 1} more pods)" if len(helds) > 1 else ""
    return Held(first.message + more, tuple(e for h in helds for e in h.evidence), first.remedy, first.patch,
                tuple(sorted({p for h in helds for p in h.pods})))


def routing_skew(look: DiagnosisLook, spec: MoEInferenceServiceSpec) -> Verdict:
    """RoutingSkew on one look (module docstring; consecutive looks are checked by :func:`judge`)."""
    if not look.skew_seen:
        return None
    threshold = spec.control.skew_threshold
    if look.skew_ratio is None or look.skew_ratio < threshold:
        return False
    layers = sorted(((p.pod, t) for p in look.signals.pods for t in p.top_layers), key=lambda pt: -pt[1].share)[:3]
    evidence = [_ev("expert skew ratio", look.skew_ratio, "ratio", contract.METRIC_STEP_EXPERT_SKEW_RATIO)]
    for pod, t in layers:
        detail = f"layer {t.layer}, hottest expert {t.expert}" if t.expert is not None else f"layer {t.layer}"
        evidence.append(_ev("top expert share", t.share, "ratio", contract.METRIC_EXPERT_TOP_SHARE_RATIO, pod, detail))
    hottest = (f"; hottest: layer {layers[0][1].layer} (top-expert share {layers[0][1].share:.2f}"
               + (f", expert {layers[0][1].expert}" if layers[0][1].expert is not None else "") + ")") if layers else ""
    return Held(
        message=f"routing skew {look.skew_ratio:.1f} at or above skewThreshold {threshold:g}{hottest}",
        evidence=tuple(evidence),
        remedy=("the skew guardrail drops the prefill budgets above control.skewThreshold (tune it, and "
                "batching.floors.maxPrefillTokens); a smaller expert chunk (MOEGUARD_EXPERT_CHUNK_TOKENS, set by the "
                "worker image) bounds the hot expert's buffers; tell the model owner which layers route unevenly "
                "(router balance: auxiliary load-balancing loss, capacity factor)"),
        patch=None, pods=tuple(sorted({p for p, _ in layers} or {p.pod for p in look.signals.pods})))


def judge(look: DiagnosisLook, spec: MoEInferenceServiceSpec) -> dict[str, Verdict]:
    """Every kind's verdict on one look, single-look (no consecutive check); all unknown when not visible."""
    if not look.visible:
        return dict.fromkeys(FINDING_KINDS)
    out: dict[str, Verdict] = {"RoutingSkew": routing_skew(look, spec)}
    for kind, rule in POD_RULES.items():
        verdicts = [rule(p, look, spec) for p in look.signals.pods]
        helds = [v for v in verdicts if isinstance(v, Held)]
        out[kind] = merge(helds) if helds else (None if any(v is None for v in verdicts) else False)
    return {kind: out[kind] for kind in FINDING_KINDS}


def _event_start(finding: Finding) -> Event:
    return Event("Warning", finding.kind, f"{finding.message}. Remedy: {finding.remedy}")


def diagnose(memory: DiagnosisMemory, look: DiagnosisLook, prior: DiagnosisStatus | None,
             spec: MoEInferenceServiceSpec, now: datetime) -> Diagnosis:
    """The diagnosis after ``look`` (see the module docstring), pure.

    ``memory``: the loop's :class:`DiagnosisMemory` (the previous looks); ``prior``: ``status.diagnosis`` as
    stored (its findings are the active ones: after an operator restart they are restored from it, with no
    second start Event); ``now``: the time of this look.
    """
    prior = prior or DiagnosisStatus()
    active: dict[str, Finding] = {f.kind: f for f in prior.findings}
    last_held, unknown_at = dict(memory.last_held), dict(memory.unknown_at)
    now_v = judge(look, spec)
    hold = clear_after_seconds(spec)
    findings: list[Finding] = []
    events: list[Event] = []
    started: list[str] = []
    cleared: list[str] = []
    for kind in FINDING_KINDS:
        verdict, was = now_v[kind], active.get(kind)
        if verdict is None:
            unknown_at[kind] = now
        if isinstance(verdict, Held):
            if was is None:
                if kind in CONSECUTIVE_KINDS and (kind not in memory.previous or memory.previous_time is None):
                    continue
                since = memory.previous_time if kind in CONSECUTIVE_KINDS and memory.previous_time else now
                finding = Finding(kind=kind, since=since, last_seen=now, message=verdict.message,
                                  evidence=list(verdict.evidence), remedy=verdict.remedy, patch=verdict.patch,
                                  pods=list(verdict.pods))
                events.append(_event_start(finding))
                started.append(kind)
            else:
                finding = was.model_copy(update={"last_seen": now, "message": verdict.message,
                                                 "evidence": list(verdict.evidence), "remedy": verdict.remedy,
                                                 "patch": verdict.patch, "pods": list(verdict.pods)})
            last_held[kind] = now
            findings.append(finding)
            continue
        if was is None:
            last_held.pop(kind, None)
            continue
        calm_from = max(t for t in (was.last_seen, last_held.get(kind), unknown_at.get(kind), memory.blind_at)
                        if t is not None)
        if verdict is False and (now - calm_from).total_seconds() >= hold:
            cleared.append(kind)
            last_held.pop(kind, None)
            events.append(Event("Normal", f"{kind}Cleared",
                                         f"{kind} cleared: its rule has not held for {hold}s of judged looks "
                                         f"(active since {was.since.isoformat()}; last held {was.last_seen.isoformat()})"))
            continue
        findings.append(was)
    kept = {f.kind for f in findings}
    new_memory = DiagnosisMemory(
        previous=tuple(k for k, v in now_v.items() if isinstance(v, Held)), previous_time=now,
        last_held=tuple(sorted((k, t) for k, t in last_held.items() if k in kept)),
        unknown_at=tuple(sorted((k, t) for k, t in unknown_at.items() if k in kept)),
        blind_at=memory.blind_at)
    status = DiagnosisStatus(time=now, findings=findings, missing_signals=list(look.missing))
    return Diagnosis(status, tuple(events), new_memory, tuple(started), tuple(cleared))


def unchanged_but_time(prior: DiagnosisStatus | None, new: DiagnosisStatus) -> bool:
    """``new`` differs from ``prior`` only in the times a look moves on (``time``, each finding's ``lastSeen``)."""
    if prior is None:
        return False

    def bare(d: DiagnosisStatus) -> DiagnosisStatus:
        return d.model_copy(update={"time": None, "findings": [f.model_copy(update={"last_seen": f.since})
                                                               for f in d.findings]})
    return bare(prior) == bare(new)


def active_kinds(status: DiagnosisStatus | None) -> tuple[str, ...]:
    """The kinds of the active findings."""
    return tuple(f.kind for f in (status.findings if status else []))

