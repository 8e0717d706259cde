"""The incident diagnosis (issue 14): :func:`diagnosis.diagnose` on each incident's signature, and on every
other incident's signature (no wrong finding), missing signals, onset, hold and clearing, restore after a
restart; it never changes budgets."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from moeguard_operator.diagnosis.diagnosis import (
    BURST_MIN_QUEUE,
    LEAK_MIN_WINDOW_GROWTH_BYTES,
    DiagnosisLook,
    DiagnosisMemory,
    clear_after_seconds,
    diagnose,
    leak_kind,
    lowered_budget_patch,
    ucx_patch,
    ucx_risky,
)
from moeguard_operator.loop import metrics
from moeguard_operator.loop.observation import LEAK_WARMUP_SECONDS, Observation
from moeguard_operator.loop.policy import PolicyState, decide, initial_budgets
from moeguard_operator.loop.signals import DiagnosisSignals, PodSignals, TopLayer, UcxInfo
from moeguard_operator.spec.models import FINDING_KINDS, DiagnosisStatus, MoEInferenceServiceSpec

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 1, 14, 0, tzinfo=UTC)
GIB, MIB = 2**30, 2**20
SPEC = MoEInferenceServiceSpec.model_validate({
    "batching": {"maxConcurrentBatches": 2, "maxLongRequestsPerBatch": 4},
    "resources": {"gpus": 1, "softLimit": "3Gi", "hardLimit": "4Gi"},
    "control": {"skewThreshold": 4, "windowSeconds": 30, "queryIntervalSeconds": 10},
    "template": {"extraEnv": [{"name": "HF_HOME", "value": "/cache"}]},
})
HARD = SPEC.resources.hard_limit_bytes
SAFE_UCX = UcxInfo(loaded=False, libraries="", mmap_hook_mode="default:bistro", rcache_max_unreleased="default:inf")
EXPERT_HEAVY = (("attention", 50 * MIB), ("dense_mlp", 100 * MIB), ("expert_buffers", 600 * MIB),
                ("kv_cache", 200 * MIB), ("weights", 2 * GIB))
KV_HEAVY = (("attention", 500 * MIB), ("dense_mlp", 50 * MIB), ("expert_buffers", 200 * MIB),
            ("kv_cache", 2 * GIB), ("weights", 2 * GIB))
CALM = PodSignals(pod="w-0", memory_bytes=0.5 * HARD, prefill_batches=1, queue_requests=0, batches_in_flight=1,
                  anonymous_growth_bytes_per_second=0.0, python_blocks_growth_per_second=0.0,
                  long_running=0, long_admitted=0, kv_cache_bytes=200 * MIB, memory_failures=0, limit_state=0,
                  steady_growth_bytes_per_second=0.0, mappings_growth_per_second=0.0, breakdown=EXPERT_HEAVY,
                  top_layers=(TopLayer("3", 0.2, "5", 900.0),), ucx=SAFE_UCX, age_seconds=3600.0)

DRILLS: dict[str, tuple[PodSignals, float]] = {
    # pod signals, and the service's skew ratio
    "calm": (CALM, 1.5),
    # A burst: prefills overlap, the queue spikes, memory fails, RSS jumps once (the worker's own detector
    # flags it while the jump is in its window) but the smallest sub-window slope is flat.
    "BurstOverlap": (replace(CALM, memory_bytes=0.9 * HARD, prefill_batches=3, queue_requests=12, batches_in_flight=3,
                             memory_failures=4, limit_state=1, leak_kinds=("native",),
                             steady_growth_bytes_per_second=1024.0), 2.5),
    # Long prompts pile up: KV cache and attention dominate; the queue is up too, prefills overlap.
    "LongContextPileUp": (replace(CALM, memory_bytes=0.92 * HARD, prefill_batches=2, queue_requests=4, long_running=3,
                                  long_admitted=5, kv_cache_bytes=2 * GIB, memory_failures=2, limit_state=1,
                                  breakdown=KV_HEAVY), 2.0),
    # Repetitive prompts: skewed routing, prefills overlap and the queue is up, but memory is fine.
    "RoutingSkew": (replace(CALM, prefill_batches=2, queue_requests=3,
                            top_layers=(TopLayer("7", 0.61, "3", 5e4), TopLayer("2", 0.4, "0", 3e4))), 12.0),
    "NativeMemoryLeak": (replace(CALM, memory_bytes=0.7 * HARD, leak_kinds=("native",),
                                 steady_growth_bytes_per_second=2 * MIB, mappings_growth_per_second=0.5,
                                 growth=(("rss_anonymous", 2 * MIB),), anonymous_growth_bytes_per_second=2 * MIB,
                                 python_blocks_growth_per_second=40.0), 1.5),
    # the worker's own flag still says python_heap (its 60 s began before the leak): the window's slopes decide
    "PythonHeapLeak": (replace(CALM, memory_bytes=0.7 * HARD, leak_kinds=("native",),
                               steady_growth_bytes_per_second=1 * MIB, growth=(("malloc_in_use", 1 * MIB),),
                               anonymous_growth_bytes_per_second=1 * MIB, python_blocks_growth_per_second=7500.0), 1.5),
    "UCXRiskyConfig": (replace(CALM, ucx=UcxInfo(True, "libucp.so.0,libucs.so.0", "default:bistro",
                                                 "default:inf")), 1.5),
    "AllocatorFragmentation": (replace(CALM, gpu_reserved_bytes=7 * GIB, gpu_allocated_bytes=3 * GIB,
                                       memory_failures=2), 1.5),
}


def look(pod: PodSignals | None = CALM, t: float = 0, skew: float | None = 1.5, **obs: object) -> DiagnosisLook:
    pods = () if pod is None else (pod,)
    o = Observation(time=T0 + timedelta(seconds=t), memory_ratio=0.5, skew_ratio=skew, skew_steps=10,
                    expected_pods=tuple(p.pod for p in pods), reporting_pods=tuple(p.pod for p in pods),
                    signals=DiagnosisSignals(pods=pods))
    return DiagnosisLook.of(replace(o, **obs))  # type: ignore[arg-type]


def run(looks: list[DiagnosisLook], prior: DiagnosisStatus | None = None,
        memory: DiagnosisMemory | None = None) -> tuple[DiagnosisStatus | None, list[tuple[str, str, str]]]:
    """Diagnose ``looks`` in order, the status fed back as ``prior``; returns the last status and the Events."""
    memory = memory or DiagnosisMemory(blind_at=T0 - timedelta(hours=1))
    events: list[tuple[str, str, str]] = []
    status = prior
    for lk in looks:
        out = diagnose(memory, lk, status, SPEC, lk.time)
        memory, status = out.memory, out.status
        events += [(e.type, e.reason, e.message) for e in out.events]
    return status, events


def kinds(status: DiagnosisStatus | None) -> set[str]:
    return {f.kind for f in (status.findings if status else [])}


@pytest.mark.parametrize("drill", list(DRILLS))
def test_each_drill_gives_its_own_finding_and_no_other(drill: str) -> None:
    pod, skew = DRILLS[drill]
    status, events = run([look(pod, t, skew) for t in (0, 10, 20)])
    expected = set() if drill == "calm" else {drill}
    assert kinds(status) == expected
    assert [(t, r) for t, r, _ in events] == [("Warning", k) for k in sorted(expected)]
    assert status is not None and status.missing_signals == []


def test_the_burst_finding_names_its_values_the_pod_and_the_lowered_concurrency() -> None:
    pod, skew = DRILLS["BurstOverlap"]
    status, events = run([look(pod, 0, skew)])
    assert status is not None
    (finding,) = status.findings
    assert finding.since == T0 and finding.pods == ["w-0"]
    assert finding.message == ("burst overlap on w-0: 3 prefill batches in flight at once with 12 requests queued and "
                               "no long-request pile-up, peak 700 MiB of expert buffers and dense MLP and 250 MiB of "
                               "KV cache and attention")
    values = {e.signal: e.value for e in finding.evidence}
    assert values["prefill batches in flight"] == 3 and values["queue requests (window max)"] == 12
    assert values["memory in use / hardLimit"] == 0.9 and values["memory failures in the window"] == 4
    assert "peak breakdown weights" not in values
    assert json.loads(finding.patch or "") == {"spec": {"batching": {"maxConcurrentBatches": 1}}}
    assert events[0][2].startswith(finding.message + ". Remedy: lower batching.maxConcurrentBatches to 1")


def test_long_context_lowers_long_requests_per_batch() -> None:
    pod, skew = DRILLS["LongContextPileUp"]
    status, _ = run([look(pod, 0, skew)])
    assert status is not None
    (finding,) = status.findings
    assert json.loads(finding.patch or "") == {"spec": {"batching": {"maxLongRequestsPerBatch": 3}}}
    assert {e.signal: e.value for e in finding.evidence}["long requests running (window max)"] == 3


def test_skew_and_leaks_need_two_looks_in_a_row_and_date_from_the_first() -> None:
    for drill in ("RoutingSkew", "NativeMemoryLeak", "PythonHeapLeak"):
        pod, skew = DRILLS[drill]
        status, events = run([look(pod, 0, skew)])
        assert kinds(status) == set() and events == []
        status, events = run([look(pod, 0, skew), look(CALM, 10), look(pod, 20, skew)])
        assert kinds(status) == set()
        status, events = run([look(pod, 0, skew), look(pod, 10, skew)])
        assert kinds(status) == {drill} and status is not None and status.findings[0].since == T0
        assert len(events) == 1


def test_skew_evidence_names_the_hottest_layers_and_experts() -> None:
    pod, skew = DRILLS["RoutingSkew"]
    status, _ = run([look(pod, 0, skew), look(pod, 10, skew)])
    assert status is not None
    finding = status.findings[0]
    assert finding.message == "routing skew 12.0 at or above skewThreshold 4; hottest: layer 7 (top-expert share 0.61, expert 3)"
    assert [(e.value, e.detail) for e in finding.evidence[1:]] == [(0.61, "layer 7, hottest expert 3"),
                                                                  (0.4, "layer 2, hottest expert 0")]
    assert finding.patch is None


def test_native_leak_with_ucx_loaded_patches_ucx_and_says_which_settings() -> None:
    pod, _ = DRILLS["NativeMemoryLeak"]
    loaded = replace(pod, ucx=UcxInfo(True, "libucp.so.0", "none", "1024"))
    status, _ = run([look(loaded, 0), look(loaded, 10)])
    assert status is not None and kinds(status) == {"NativeMemoryLeak"}
    finding = status.findings[0]
    assert json.loads(finding.patch or "") == {"spec": {"ucx": {"mode": "none", "rcacheMaxUnreleased": 1024}}}
    assert "UCX_MEM_MMAP_HOOK_MODE=none" in finding.message and "rolling restart" in finding.remedy
    values = {e.signal: e.value for e in finding.evidence}
    assert values["steady RSS growth (smallest sub-window slope)"] == 2 * MIB
    assert values["anonymous RSS growth"] == 2 * MIB and values["memory mappings growth"] == 0.5
    status, _ = run([look(pod, 0), look(pod, 10)])  # UCX not loaded: profile the native heap
    assert status is not None and status.findings[0].patch is None and "heaptrack" in status.findings[0].remedy


@pytest.mark.parametrize("kind", ["NativeMemoryLeak", "PythonHeapLeak"])
def test_a_worker_in_its_warm_up_has_no_leak_finding_and_one_of_unknown_age_none(kind: str) -> None:
    pod = DRILLS[kind][0]
    young = LEAK_WARMUP_SECONDS + SPEC.control.leak_window_seconds - 1
    assert kinds(run([look(replace(pod, age_seconds=young), t) for t in (0, 10, 20)])[0]) == set()
    assert kinds(run([look(replace(pod, age_seconds=None), t) for t in (0, 10, 20)])[0]) == set()
    assert kinds(run([look(replace(pod, age_seconds=young + 1), t) for t in (0, 10, 20)])[0]) == {kind}


@pytest.mark.parametrize("kind", ["NativeMemoryLeak", "PythonHeapLeak"])
def test_the_warm_up_is_the_looks_own(kind: str) -> None:
    """The operator's --leak-warmup-seconds reaches the rule through the look: a pod past a 5-s warm-up is judged."""
    pod = DRILLS[kind][0]
    age = 5 + SPEC.control.leak_window_seconds
    short = [replace(look(replace(pod, age_seconds=age), t), leak_warmup_seconds=5) for t in (0, 10, 20)]
    assert kinds(run(short)[0]) == {kind}
    assert kinds(run([replace(x, leak_warmup_seconds=6) for x in short])[0]) == set()


def test_a_leak_must_add_its_minimum_over_the_window_and_its_kind_comes_from_the_window() -> None:
    lw = SPEC.control.leak_window_seconds
    pod = DRILLS["NativeMemoryLeak"][0]
    just = LEAK_MIN_WINDOW_GROWTH_BYTES / lw
    assert kinds(run([look(replace(pod, steady_growth_bytes_per_second=just * 0.99), t) for t in (0, 10)])[0]) == set()
    assert kinds(run([look(replace(pod, steady_growth_bytes_per_second=just), t) for t in (0, 10)])[0]) == {
        "NativeMemoryLeak"}
    # the same growth with the Python heap growing a block per 2 KiB: a Python heap leak, whatever the worker flags
    heap = replace(pod, python_blocks_growth_per_second=2 * MIB / 2048)
    assert kinds(run([look(heap, t) for t in (0, 10)])[0]) == {"PythonHeapLeak"}
    assert leak_kind(heap) == "python_heap" and leak_kind(pod) == "native"
    assert leak_kind(replace(pod, python_blocks_growth_per_second=None)) is None
    assert kinds(run([look(replace(pod, anonymous_growth_bytes_per_second=None), t) for t in (0, 10)])[0]) == set()


def test_a_leak_flag_with_a_slope_at_the_noise_floor_is_no_leak() -> None:
    pod = replace(DRILLS["NativeMemoryLeak"][0], steady_growth_bytes_per_second=64 * 1024)
    assert kinds(run([look(pod, t) for t in (0, 10, 20)])[0]) == set()


@pytest.mark.parametrize(("mode", "rcache", "risky"), [
    ("default:bistro", "default:inf", True), ("bistro", "inf", True), ("reloc", "", True),
    ("none", "default:inf", False), ("default:none", "inf", False), ("default:bistro", "1024", False),
    ("default:bistro", "default:512M", True),  # UCX 1.13's table says 512M; unset is judged unbounded (NIXL #1210)
])
def test_ucx_risky_reads_default_values(mode: str, rcache: str, risky: bool) -> None:
    assert ucx_risky(UcxInfo(True, "libucp.so.0", mode, rcache)) is risky
    assert not ucx_risky(UcxInfo(False, "", mode, rcache))


def test_patches_respect_floors_and_the_other_env() -> None:
    at_one = SPEC.model_copy(update={"batching": SPEC.batching.model_copy(update={"max_concurrent_batches": 1})})
    assert lowered_budget_patch(at_one, "max_concurrent_batches") is None
    floored = MoEInferenceServiceSpec.model_validate({"batching": {"maxConcurrentBatches": 3,
                                                                   "floors": {"maxConcurrentBatches": 3}}})
    lowered = lowered_budget_patch(floored, "max_concurrent_batches")
    assert lowered is not None and json.loads(lowered[1]) == {"spec": {"batching": {
        "maxConcurrentBatches": 2, "floors": {"maxConcurrentBatches": 2}}}}
    amd = MoEInferenceServiceSpec.model_validate({"resources": {"gpus": 1, "gpuResourceName": "amd.com/gpu",
                                                                "softLimit": "3Gi", "hardLimit": "4Gi"}})
    assert json.loads(ucx_patch(amd))["spec"]["ucx"]["mode"] == "rcache"


def fragmentation(alloc_conf: dict[str, object] | None) -> tuple[str, dict[str, object] | None]:
    """The AllocatorFragmentation finding's remedy and patch for a spec whose ``template.extraEnv`` holds HF_HOME,
    then ``alloc_conf`` (a PYTORCH_CUDA_ALLOC_CONF EnvVar; None: not set), then TZ."""
    env = [{"name": "HF_HOME", "value": "/cache"}, *([alloc_conf] if alloc_conf else []), {"name": "TZ", "value": "UTC"}]
    spec = SPEC.model_copy(update={"template": SPEC.template.model_copy(update={"extra_env": env})})
    out = diagnose(DiagnosisMemory(blind_at=T0 - timedelta(hours=1)), look(DRILLS["AllocatorFragmentation"][0], 0),
                   None, spec, T0)
    (finding,) = out.status.findings
    assert finding.kind == "AllocatorFragmentation"
    return finding.remedy, None if finding.patch is None else json.loads(finding.patch)


def _env_patch(value: str) -> dict[str, object]:
    return {"spec": {"template": {"extraEnv": [{"name": "HF_HOME", "value": "/cache"},
                                               {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": value},
                                               {"name": "TZ", "value": "UTC"}]}}}


def test_fragmentation_patch_adds_expandable_segments_keeping_the_other_allocator_options() -> None:
    """Issue 29 item 4 (pytorch/torchtitan#3865): the other options of PYTORCH_CUDA_ALLOC_CONF stay, in place."""
    conf = {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "max_split_size_mb:128,garbage_collection_threshold:0.6"}
    remedy, patch = fragmentation(conf)
    assert patch == _env_patch("max_split_size_mb:128,garbage_collection_threshold:0.6,expandable_segments:True")
    assert "max_split_size_mb:128,garbage_collection_threshold:0.6,expandable_segments:True" in remedy
    # a bracketed value holds commas and colons of its own (roundup_power2_divisions)
    conf = {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "roundup_power2_divisions:[256:1,512:2,>:8], max_split_size_mb:64"}
    assert fragmentation(conf)[1] == _env_patch(
        "roundup_power2_divisions:[256:1,512:2,>:8],max_split_size_mb:64,expandable_segments:True")
    # unset: appended after the other variables
    remedy, patch = fragmentation(None)
    assert patch == {"spec": {"template": {"extraEnv": [
        {"name": "HF_HOME", "value": "/cache"}, {"name": "TZ", "value": "UTC"},
        {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"}]}}}
    assert remedy.startswith("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in spec.template.extraEnv")


def test_fragmentation_with_expandable_segments_on_already_has_no_patch() -> None:
    conf = {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "max_split_size_mb:128,expandable_segments:True"}
    remedy, patch = fragmentation(conf)
    assert patch is None
    assert remedy.startswith("PYTORCH_CUDA_ALLOC_CONF already has expandable_segments:True: lower maxPrefillTokens")


def test_fragmentation_keeps_a_deliberate_false_and_names_the_trade_off() -> None:
    conf = {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:False,max_split_size_mb:128"}
    remedy, patch = fragmentation(conf)
    assert patch is None
    assert "expandable_segments:False, kept as a deliberate choice" in remedy
    assert "pytorch/pytorch#165419" in remedy and "uccl-project/uccl#839" in remedy


def test_fragmentation_with_the_variable_from_value_from_has_no_patch() -> None:
    conf = {"name": "PYTORCH_CUDA_ALLOC_CONF", "valueFrom": {"configMapKeyRef": {"name": "alloc", "key": "conf"}}}
    remedy, patch = fragmentation(conf)
    assert patch is None and remedy.startswith("PYTORCH_CUDA_ALLOC_CONF comes from valueFrom")


def test_missing_signals_start_nothing_and_are_named() -> None:
    pod, skew = DRILLS["BurstOverlap"]
    blind = look(pod, 0, skew, error="Prometheus at http://prom:9090: PrometheusTimeout", memory_ratio=None)
    status, events = run([blind, replace(blind, time=T0 + timedelta(seconds=10))])
    assert kinds(status) == set() and events == []
    assert status is not None and status.missing_signals == ["Prometheus at http://prom:9090: PrometheusTimeout"]
    # A silent pod: the other pod's burst does not start a finding while one is silent.
    silent = look(pod, 0, skew, expected_pods=("w-0", "w-1"))
    status, events = run([silent])
    assert kinds(status) == set() and status is not None and status.missing_signals == ["silent pods: w-1"]
    # A failed diagnosis query.
    failed = look(pod, 0, skew, signals=None, signals_missing="diagnosis queries failed (diag: PrometheusTimeout)")
    status, _ = run([failed])
    assert kinds(status) == set() and status is not None and status.missing_signals == [
        "diagnosis queries failed (diag: PrometheusTimeout)"]


def test_a_pod_without_the_breakdown_is_unknown_not_calm() -> None:
    pod = replace(DRILLS["LongContextPileUp"][0], breakdown=())
    status, _ = run([look(pod, 0)])
    assert kinds(status) == set()


def test_a_leaking_worker_with_overlapping_prefills_and_a_short_queue_is_a_leak_not_a_burst() -> None:
    """CI of issue 29: the PythonHeapLeak drill on a loaded machine (two prefills at once, a queue of two, memory
    over the soft fraction because of the leak) also read as BurstOverlap."""
    leak, _ = DRILLS["PythonHeapLeak"]
    pod = replace(leak, memory_bytes=0.9 * HARD, prefill_batches=2, queue_requests=2, limit_state=1)
    status, _ = run([look(pod, 0), look(pod, 30)])
    assert kinds(status) == {"PythonHeapLeak"}
    # the same pod without the steady growth (a burst's jump leaves flat sub-windows) and with a burst's queue is a
    # burst; with the short queue alone it is neither (CI of stop 38: a leak read as BurstOverlap before its window
    # of steady growth filled)
    flat = replace(pod, steady_growth_bytes_per_second=1024.0)
    status, _ = run([look(replace(flat, queue_requests=BURST_MIN_QUEUE), 0)])
    assert kinds(status) == {"BurstOverlap"}
    status, _ = run([look(replace(flat, queue_requests=BURST_MIN_QUEUE - 1), 0)])
    assert kinds(status) == set()


def test_skewed_routing_with_a_memory_symptom_and_a_short_queue_is_skew_not_a_burst() -> None:
    """Rehearsal of issue 29: the RoutingSkew drill (memory 26% of hardLimit over a 25% soft fraction, prefills
    overlapping on a loaded machine) also read as BurstOverlap."""
    skewed, skew = DRILLS["RoutingSkew"]
    pod = replace(skewed, memory_bytes=0.9 * HARD, limit_state=1, queue_requests=BURST_MIN_QUEUE)
    status, _ = run([look(pod, 0, skew=skew), look(pod, 10, skew=skew)])
    assert kinds(status) == {"RoutingSkew"}
    status, _ = run([look(pod, 0, skew=2.0)])  # the same pod without the skew: a burst
    assert kinds(status) == {"BurstOverlap"}


def test_a_burst_of_ordinary_prompts_is_a_burst_whatever_its_breakdown_and_long_prompts_are_not() -> None:
    """On small models attention outweighs the experts even for ordinary prompts: the burst is told from a
    pile-up by its long requests, not by the breakdown."""
    pod = replace(DRILLS["BurstOverlap"][0], breakdown=KV_HEAVY)
    status, _ = run([look(pod, 0)])
    assert kinds(status) == {"BurstOverlap"}
    status, _ = run([look(replace(pod, long_running=2), 0)])
    assert kinds(status) == {"LongContextPileUp"}
    status, _ = run([look(replace(pod, long_running=None, long_admitted=None), 0)])
    assert kinds(status) == set()  # the long-request signals missing: unknown, no finding


def test_a_finding_clears_after_the_hold_of_judged_looks_and_blind_looks_neither_start_nor_clear() -> None:
    pod, skew = DRILLS["BurstOverlap"]
    hold = clear_after_seconds(SPEC)
    assert hold == 60
    looks = [look(pod, 0, skew)]
    looks += [look(CALM, t, error="Prometheus at http://prom:9090: PrometheusTimeout", memory_ratio=None)
              for t in range(10, 200, 10)]  # blind for three minutes: still active
    status, events = run(looks)
    assert kinds(status) == {"BurstOverlap"} and len(events) == 1
    calm_from = 190
    looks += [look(CALM, t) for t in range(200, calm_from + hold, 10)]
    status, events = run(looks)
    assert kinds(status) == {"BurstOverlap"}
    status, events = run([*looks, look(CALM, calm_from + hold)])
    assert kinds(status) == set()
    assert [(t, r) for t, r, _ in events] == [("Warning", "BurstOverlap"), ("Normal", "BurstOverlapCleared")]


def test_held_again_before_the_hold_keeps_the_finding_and_its_onset() -> None:
    pod, skew = DRILLS["BurstOverlap"]
    status, events = run([look(pod, 0, skew), look(CALM, 10), look(CALM, 50), look(pod, 60, skew), look(CALM, 100)])
    assert status is not None and status.findings[0].since == T0 and len(events) == 1


def test_restore_after_a_restart_posts_no_second_start_and_clears_only_after_a_full_hold() -> None:
    pod, skew = DRILLS["BurstOverlap"]
    status, _ = run([look(pod, 0, skew)])
    restart = T0 + timedelta(seconds=300)  # the operator comes back long after the last look
    fresh = DiagnosisMemory(blind_at=restart)
    again, events = run([look(pod, 310, skew)], prior=status, memory=fresh)
    assert events == [] and again is not None and again.findings[0].since == T0
    calm, events = run([look(CALM, t) for t in (310, 320, 350)], prior=status, memory=fresh)
    assert kinds(calm) == {"BurstOverlap"} and events == []
    calm, events = run([look(CALM, 360)], prior=status, memory=fresh)
    assert kinds(calm) == set() and events[0][1] == "BurstOverlapCleared"


def test_the_diagnosis_changes_no_budget() -> None:
    pod, skew = DRILLS["BurstOverlap"]
    obs = Observation(time=T0, memory_ratio=0.9, skew_ratio=skew, skew_steps=10, expected_pods=("w-0",),
                      reporting_pods=("w-0",))
    with_signals = replace(obs, signals=DiagnosisSignals(pods=(pod,)))
    state = PolicyState(budgets=initial_budgets(SPEC.batching))
    assert decide(obs, state, SPEC, T0) == decide(with_signals, state, SPEC, T0)
    assert decide(obs, state, SPEC, T0).state.budgets != state.budgets  # the look itself does tighten


optional = st.none() | st.floats(min_value=0, max_value=1e12, allow_nan=False)


@given(kinds_=st.sets(st.sampled_from(["native", "python_heap"])), ooms=st.integers(0, 3),
       skew=st.none() | st.floats(min_value=1, max_value=100), gpu=optional)
def test_no_finding_from_missing_signals(kinds_: set[str], ooms: int, skew: float | None, gpu: float | None) -> None:
    """Every diagnosis signal missing (the pod exports none of them; skew not seen): never a finding."""
    bare = PodSignals(pod="w-0", leak_kinds=tuple(sorted(kinds_)), gpu_reserved_bytes=gpu)
    looks = [look(bare, t, skew, skew_steps=None, skew_unknown_pods=("w-0",), new_oom_kills=ooms) for t in (0, 10, 20)]
    status, events = run(looks)
    assert kinds(status) == set() and events == []


@given(drill=st.sampled_from(sorted(DRILLS)), blind=st.lists(st.booleans(), min_size=1, max_size=8))
def test_findings_start_only_in_visible_looks(drill: str, blind: list[bool]) -> None:
    pod, skew = DRILLS[drill]
    memory, status = DiagnosisMemory(blind_at=T0), None
    for i, b in enumerate(blind):
        lk = look(pod, 10 * i, skew, **({"error": "down", "memory_ratio": None} if b else {}))
        out = diagnose(memory, lk, status, SPEC, lk.time)
        if not lk.visible:
            assert out.started == () and out.cleared == ()
        memory, status = out.memory, out.status
    assert set(FINDING_KINDS) >= kinds(status)


def test_the_finding_gauge_is_1_while_active_and_0_once_cleared() -> None:
    pod, skew = DRILLS["BurstOverlap"]
    memory = DiagnosisMemory(blind_at=T0 - timedelta(hours=1))
    labels = {"namespace": "ns-gauge", "moeis": "svc", "kind": "BurstOverlap"}
    out = diagnose(memory, look(pod, 0, skew), None, SPEC, T0)
    metrics.record_diagnosis("ns-gauge", "svc", out)
    assert REGISTRY.get_sample_value("moeguard_operator_diagnosis_finding", labels) == 1
    cleared = diagnose(out.memory, look(CALM, 60), out.status, SPEC, T0 + timedelta(seconds=60))
    assert cleared.cleared == ("BurstOverlap",)
    metrics.record_diagnosis("ns-gauge", "svc", cleared)
    assert REGISTRY.get_sample_value("moeguard_operator_diagnosis_finding", labels) == 0
    assert REGISTRY.get_sample_value("moeguard_operator_diagnosis_finding", {**labels, "kind": "RoutingSkew"}) is None
