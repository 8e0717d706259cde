"""Memory-aware admission (issue 13 §1): the fit, the correction factor, the scheduler's use of them,
and the worker's refusals and aborts, driven by hand with an injected memory reading."""

from __future__ import annotations

import itertools
import math

import pytest
from tests.unit.runtime.test_service import Lines

from moeguard_core import memory_model as mm
from moeguard_core import presets
from moeguard_core.contract import DEFAULT_BUDGETS, Budgets
from moeguard_core.memory_admission import (
    CORRECTION_FLOOR,
    CORRECTION_WINDOW_STEPS,
    MAX_CORRECTION,
    MIN_PREFILL_CHUNK_TOKENS,
    Correction,
    MemoryAdmission,
)
from moeguard_runtime.api import tokenizer
from moeguard_runtime.config import load_settings
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.engine.scheduler import QueueLimits, Rejected, Scheduler
from moeguard_runtime.engine.service import Event, GenerationRequest, Worker
from moeguard_runtime.memory.memory import MemoryReading
from moeguard_runtime.model.model import build_model
from moeguard_runtime.model.moe import routing_stats
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

pytestmark = pytest.mark.unit

MiB = mm.MiB
SMALL = presets.get_preset("small")
TINY = presets.get_preset("tiny")
LABELS = {"moeis": "s", "namespace": "n", "pod": "p"}


def admission(hard: int, shape: presets.ModelArgs = SMALL, floor: float = 1.0) -> MemoryAdmission:
    """An admission with correction 1 (the worker's starts at ``CORRECTION_FLOOR``)."""
    return MemoryAdmission(shape, "float32", hard, 2048, 0.0, floor)


def raw(adm: MemoryAdmission, prefill: tuple[tuple[int, int], ...] = (), decode: tuple[int, ...] = (),
        kv: int = 0) -> int:
    return mm.step_peak(SMALL, mm.Step(prefill, decode, kv), mm.Routing(adm.top_share), "float32").total_bytes


# --- the correction factor --------------------------------------------------------------------
def test_the_correction_only_scales_up_and_keeps_the_largest_recent_ratio() -> None:
    c = Correction()
    assert c.factor == 1.0
    assert c.observe(100 * MiB, 50 * MiB) == 0.5  # an over-prediction: kept, the factor stays 1
    assert c.factor == 1.0
    assert c.observe(1 * MiB, 10 * MiB) is None  # under 4 MiB predicted: noise, not recorded
    assert c.factor == 1.0
    assert c.observe(100 * MiB, 124 * MiB) == pytest.approx(1.24)  # the held-back test's 24 % under
    assert c.factor == pytest.approx(1.24)
    assert c.observe(100 * MiB, 110 * MiB) == pytest.approx(1.10)
    assert c.factor == pytest.approx(1.24)  # the largest of the window
    for _ in range(CORRECTION_WINDOW_STEPS):
        c.observe(100 * MiB, 105 * MiB)
    assert c.factor == pytest.approx(1.05)  # 1.24 left the window
    c.observe(10 * MiB, 100 * MiB)
    assert c.factor == MAX_CORRECTION


def test_a_correction_floor_from_the_validation_set_is_the_starting_value() -> None:
    c = Correction(1.2)
    assert c.factor == 1.2
    c.observe(100 * MiB, 100 * MiB)
    assert c.factor == 1.2
    with pytest.raises(ValueError, match="must be in"):
        Correction(0.9)


# --- the fit --------------------------------------------------------------------------------------
def test_a_prefill_chunk_is_cut_to_the_largest_size_that_fits() -> None:
    usage = 900 * MiB
    adm = admission(usage + 100 * MiB)
    fit = adm.fit(usage)
    kv = 4009
    m = fit.cap(0, 4001, kv)
    assert MIN_PREFILL_CHUNK_TOKENS < m < 4001
    assert usage + raw(adm, ((0, m),), kv=kv) <= adm.hard_limit_bytes
    assert usage + raw(adm, ((0, m + 1),), kv=kv) > adm.hard_limit_bytes
    assert (fit.shrunk, fit.blocked) == (1, 0)
    fit.add(0, m, kv)
    assert fit.predicted_raw() == raw(adm, ((0, m),), kv=kv)


def test_a_chunk_that_fits_whole_is_not_cut_and_decode_tokens_count() -> None:
    usage = 900 * MiB
    adm = admission(usage + 400 * MiB)
    fit = adm.fit(usage)
    fit.add_decode(1000)
    assert fit.cap(0, 512, 600) == 512
    assert fit.shrunk == 0
    fit.add(0, 512, 600)
    assert fit.predicted_raw() == raw(adm, ((0, 512),), (1000,), 600)


def test_when_even_the_smallest_chunk_does_not_fit_the_chunk_waits() -> None:
    usage = 900 * MiB
    kv_bytes = 4009 * mm.kv_bytes_per_token(SMALL, 4)  # 47 MiB of KV cache alone
    adm = admission(usage + kv_bytes)
    fit = adm.fit(usage)
    assert fit.cap(0, 4001, 4009) == 0
    assert fit.blocked == 1
    assert fit.cap(0, 100, 0) == 100  # without the KV cache a short chunk fits


def test_refusal_predicts_the_smallest_step_its_last_chunk_with_its_kv_cache() -> None:
    usage = 900 * MiB
    adm = admission(usage + 40 * MiB)
    need = adm.refusal(usage, 4000, 9)
    assert need == math.ceil(raw(adm, ((4000 - MIN_PREFILL_CHUNK_TOKENS, MIN_PREFILL_CHUNK_TOKENS),), kv=4009))
    assert need > 40 * MiB
    assert adm.refusal(usage, 100, 8) is None
    assert adm.refusal(usage, 4000, 9, kv_allocated=True) is None  # the chunk alone fits


def test_the_top_expert_share_follows_the_observed_routing() -> None:
    adm = admission(1 << 40)
    prior = adm.top_share
    assert prior == pytest.approx(4 / (4 + 8 - 1))  # skew 4 until steps are seen
    adm.observe_routing([routing_stats([2, 1, 0, 0, 0, 0, 0, 1])])  # 4 slots < 4 x E: says nothing
    assert adm.top_share == prior
    adm.observe_routing([routing_stats([8] * 8), routing_stats([16, 8, 8, 8, 8, 8, 4, 4])])
    assert adm.top_share == pytest.approx(16 / 64)
    assert adm.raw(mm.Step(((0, 512),))) == mm.step_peak(
        SMALL, mm.Step(((0, 512),)), mm.Routing(16 / 64), "float32").total_bytes


def prefill_budget(tokens: int) -> Budgets:
    return DEFAULT_BUDGETS.model_copy(update={"max_prefill_tokens": tokens})


# --- the scheduler with a fit -------------------------------------------------------------------
def test_the_scheduler_chunks_a_long_prompt_to_what_memory_allows() -> None:
    usage = 900 * MiB
    adm = admission(usage + 100 * MiB)
    s = Scheduler(prefill_budget(4096), QueueLimits(), lambda: 0.0)
    s.submit("long", 4001, 8)
    chunks = []
    for _ in range(40):
        fit = adm.fit(usage)
        plan = s.schedule(fit).plan
        if plan is None or not plan.prefill:
            break
        (_, start, n), = plan.prefill
        assert usage + fit.predicted_raw() <= adm.hard_limit_bytes
        chunks.append((start, n))
    assert chunks[0][0] == 0 and sum(n for _, n in chunks) == 4001
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(chunks))  # contiguous
    assert len(chunks) > 1  # cut: the whole prompt at once would not fit
    assert usage + raw(adm, ((0, 4001),), kv=4009) > adm.hard_limit_bytes


def test_a_head_whose_kv_cache_does_not_fit_waits_and_is_named_when_nothing_runs() -> None:
    usage = 900 * MiB
    adm = admission(usage + 30 * MiB)
    s = Scheduler(prefill_budget(4096), QueueLimits(), lambda: 0.0)
    s.submit("short", 10, 4)
    s.submit("long", 3000, 8)  # 35 MiB of KV cache alone
    plan = s.schedule(adm.fit(usage)).plan
    assert plan is not None and plan.admitted == ("short",)  # the long one waits at the front
    fit = adm.fit(usage)
    plan = s.schedule(fit).plan
    assert plan is not None and plan.decode == ("short",) and fit.blocked >= 1
    s.finish("short")
    fit = adm.fit(usage)
    assert s.schedule(fit).plan is None
    assert s.memory_blocked(lambda p, n, kv: adm.refusal(usage, p, n, kv) is None) == ["long"]
    assert s.queue_requests == 1  # named, not removed: the step loop ends it


# --- the worker -------------------------------------------------------------------------------
def tiny_worker(usage: list[int], hard: int) -> Worker:
    settings = load_settings({"MOEGUARD_HARD_LIMIT_BYTES": str(hard), "MOEGUARD_MAX_PREFILL_TOKENS": "1024",
                              "MOEGUARD_OVERLOAD_MODE": "Off"})
    adm = MemoryAdmission(TINY, "float32", hard, 2048)
    return Worker(settings, Engine(build_model(TINY, seed=1)), Telemetry(LABELS, TINY.num_experts),
                  RateLimitedLog(0.0), clock=lambda: 0.0,
                  memory_reader=lambda: MemoryReading(usage[0], "rss"), idle_wait_s=0.0, admission=adm)


def value(worker: Worker, name: str, **extra: str) -> float | None:
    return worker.telemetry.registry.get_sample_value(name, {**LABELS, **extra})


def tiny_worker_reading(reading: list[MemoryReading], hard: int) -> tuple[Worker, list[tuple[str, dict[str, object]]]]:
    """A tiny worker whose memory reading (use and cgroup limit) is ``reading[0]``; its log lines."""
    settings = load_settings({"MOEGUARD_HARD_LIMIT_BYTES": str(hard), "MOEGUARD_MAX_PREFILL_TOKENS": "1024",
                              "MOEGUARD_OVERLOAD_MODE": "Off"})
    lines = Lines()
    worker = Worker(settings, Engine(build_model(TINY, seed=1)), Telemetry(LABELS, TINY.num_experts),
                    RateLimitedLog(0.0, logger=lines), clock=lambda: 0.0, memory_reader=lambda: reading[0],
                    idle_wait_s=0.0, admission=MemoryAdmission(TINY, "float32", hard, 2048))
    return worker, lines.lines


def refusal(worker: Worker, req_id: str, prompt: list[int], max_new: int) -> Rejected | None:
    try:
        worker.submit(GenerationRequest(req_id, prompt, max_new), lambda e: None)
    except Rejected as rej:
        return rej
    worker.cancel(req_id)
    return None


PROMPT_900 = tokenizer.encode("x" * 900)
_ADM = MemoryAdmission(TINY, "float32", 1, 2048)
NEED_900 = _ADM.predict(_ADM.smallest_step(len(PROMPT_900), 100))
"""The smallest step of a 900-byte prompt with 100 new tokens on ``tiny``, at the correction's floor (bytes)."""


def test_a_request_that_can_never_fit_is_refused_400_idle_or_busy() -> None:
    usage = [100 * MiB]
    long_prompt, need = PROMPT_900, NEED_900
    hard = usage[0] + need - 1  # one byte short for the long prompt's smallest step
    worker = tiny_worker(usage, hard)
    worker._iteration()  # the engine thread's idle reading: the idle footprint
    with pytest.raises(Rejected) as idle:
        worker.submit(GenerationRequest("long", long_prompt, 100), lambda e: None)
    assert (idle.value.status, idle.value.reason) == (400, "memory_predicted")
    assert f"hard memory limit of {hard} bytes" in idle.value.message and "never" in idle.value.message
    assert f"idle footprint: {usage[0]} bytes in use" in idle.value.message
    events: list[Event] = []
    worker.submit(GenerationRequest("short", tokenizer.encode("hi"), 50), events.append)
    with pytest.raises(Rejected) as busy:  # others hold memory, but it could not fit without them either
        worker.submit(GenerationRequest("long", long_prompt, 100), lambda e: None)
    assert (busy.value.status, busy.value.reason) == (400, "memory_predicted")
    for _ in range(60):
        worker._iteration()
    assert events[-1].kind == "finish"


def test_a_request_that_fits_the_idle_worker_is_a_503_when_it_does_not_fit_now() -> None:
    """Issue 29: after a burst of long prompts an idle worker's use stays above its idle footprint (the
    allocator's caches); judged on it, a prompt served a minute earlier was a 400 'can never be served'."""
    usage = [100 * MiB]
    prompt, need = PROMPT_900, NEED_900
    hard = usage[0] + need + 4 * MiB  # fits the idle worker with 4 MiB to spare
    worker = tiny_worker(usage, hard)
    worker._iteration()  # the idle footprint: 100 MiB
    assert refusal(worker, "served", prompt, 100) is None
    usage[0] += 9 * MiB // 2  # idle again, but 4.5 MiB more in use (the burst's caches)
    worker._iteration()
    rej = refusal(worker, "after-burst", prompt, 100)
    assert rej is not None and (rej.status, rej.reason, rej.retry_after_s) == (503, "memory_predicted", 5)
    assert f"it fits the idle worker ({100 * MiB} bytes in use)" in rej.message
    assert f"holds {9 * MiB // 2} bytes more than its idle footprint" in rej.message
    events: list[Event] = []
    worker.submit(GenerationRequest("short", tokenizer.encode("hi"), 50), events.append)
    rej = refusal(worker, "busy", prompt, 100)
    assert rej is not None and rej.status == 503 and "the requests in flight hold memory" in rej.message
    usage[0] = 100 * MiB  # the memory came back
    for _ in range(60):
        worker._iteration()
    assert events[-1].kind == "finish"
    assert refusal(worker, "later", prompt, 100) is None


def test_a_correction_raised_by_a_burst_does_not_make_a_request_final() -> None:
    """The factor falls back to its floor once the window's large ratios pass: 'never' is judged at the floor."""
    usage = [100 * MiB]
    prompt, need = PROMPT_900, NEED_900
    worker = tiny_worker(usage, usage[0] + need + MiB // 4)
    worker._iteration()
    assert worker.loop.admission is not None
    worker.loop.admission.correction.window.append(2.0)  # a step of the burst measured at twice its prediction
    rej = refusal(worker, "r", prompt, 100)
    assert rej is not None and (rej.status, rej.retry_after_s) == (503, 5)
    assert "the memory model's correction is 2.00 after recent steps (it falls back to 1.20)" in rej.message


def test_admission_fits_under_a_memory_cgroup_smaller_than_the_hard_limit_and_says_so() -> None:
    """Issue 29: the cgroup at 901 MiB, the hard limit at 1,080 MiB: steps were fitted under the hard limit
    and the kernel killed the worker at the cgroup's. The limit in effect is min(hard, cgroup)."""
    hard, cgroup = 1080 * MiB, 901 * MiB
    reading = [MemoryReading(cgroup - 6 * MiB, "cgroup_v2", cgroup, "/sys/fs/cgroup/pod")]
    worker, lines = tiny_worker_reading(reading, hard)
    worker._iteration()
    adm = worker.loop.admission
    assert adm is not None and (adm.limit_bytes, adm.limit_source) == (cgroup, "cgroup")
    assert value(worker, "moeguard_memory_admission_limit_bytes", limit="cgroup") == cgroup
    assert value(worker, "moeguard_memory_admission_limit_bytes", limit="hard") is None
    (logged,) = [kw for ev, kw in lines if ev == "memory_admission_limit"]
    assert logged == {"limit": "cgroup", "limit_bytes": cgroup, "hard_limit_bytes": hard,
                      "cgroup_limit_bytes": cgroup, "cgroup_path": "/sys/fs/cgroup/pod"}
    # a 1,000-token prefill (~12 MB) fits the hard limit's 185 MiB of room, not the cgroup's 6 MiB: it is cut
    assert 0 < adm.fit(cgroup - 6 * MiB).cap(0, 1000, 1000 + 8) < 1000
    prompt, need = PROMPT_900, NEED_900
    reading[0] = MemoryReading(cgroup - need + MiB, "cgroup_v2", cgroup, "/sys/fs/cgroup/pod")
    rej = refusal(worker, "r", prompt, 100)  # under the hard limit, over the cgroup's
    assert rej is not None and rej.status in (400, 503)
    assert f"the memory cgroup's limit of {cgroup} bytes (below the hard memory limit of {hard} bytes)" in rej.message
    reading[0] = MemoryReading(cgroup - 6 * MiB, "cgroup_v2", 2 * hard, "/sys/fs/cgroup/pod")  # resized
    worker._iteration()
    assert (adm.limit_bytes, adm.limit_source) == (hard, "hard")
    assert value(worker, "moeguard_memory_admission_limit_bytes", limit="hard") == hard
    assert value(worker, "moeguard_memory_admission_limit_bytes", limit="cgroup") is None
    assert len([1 for ev, _ in lines if ev == "memory_admission_limit"]) == 2


def test_a_started_stream_that_can_no_longer_fit_is_ended_with_an_error_event_and_its_slot_freed() -> None:
    usage = [100 * MiB]
    worker = tiny_worker(usage, 200 * MiB)
    worker.scheduler.set_budgets(prefill_budget(64))
    events: list[Event] = []
    worker.submit(GenerationRequest("r", tokenizer.encode("y" * 600), 8), events.append)
    worker._iteration()  # the first chunk runs: the stream answers 200
    assert [e.kind for e in events] == ["admitted"]
    usage[0] = 200 * MiB  # something else took the memory: no chunk fits any more
    worker._iteration()  # no step: malloc_trim and one more look
    assert [e.kind for e in events] == ["admitted"]
    worker._iteration()
    assert [(e.kind, e.status, e.reason) for e in events] == [("admitted", 200, ""),
                                                              ("error", 503, "memory_predicted")]
    assert "hard memory limit" in (events[-1].message or "")
    assert worker.scheduler.running_requests == 0 and worker.scheduler.queue_requests == 0
    worker._iteration()
    assert worker.engine.sequences == {}  # its KV cache released
    assert value(worker, "moeguard_rejections_total", reason="memory_predicted") == 1


def test_steps_export_the_prediction_and_the_measured_peak() -> None:
    usage = [100 * MiB]
    worker = tiny_worker(usage, 1 << 40)
    events: list[Event] = []
    worker.submit(GenerationRequest("r", tokenizer.encode("z" * 300), 4), events.append)
    for _ in range(10):
        worker._iteration()
    assert events[-1].kind == "finish"
    assert value(worker, "moeguard_memory_step_peak_bytes", figure="predicted") is not None
    assert value(worker, "moeguard_memory_step_peak_bytes", figure="measured") is not None
    assert value(worker, "moeguard_memory_prediction_correction_ratio") == CORRECTION_FLOOR == 1.2


def test_the_torch_free_chunk_default_is_the_workers() -> None:
    from moeguard_core import memory_admission
    from moeguard_runtime.model import moe

    assert memory_admission.DEFAULT_EXPERT_CHUNK_TOKENS == moe.DEFAULT_EXPERT_CHUNK_TOKENS


def test_the_operator_warns_when_a_cpu_worker_cannot_hold_a_full_context_request() -> None:
    from moeguard_operator.spec.spec_checks import full_context_warnings

    weights = presets.parameter_count(SMALL) * 4
    adm = MemoryAdmission(SMALL, "float32", 1)
    need = adm.predict(adm.smallest_step(SMALL.max_seq_len - 1, 1))
    assert need > 48 * MiB  # 4,096 tokens of KV cache (12 KiB a token) and the last chunk
    assert full_context_warnings(SMALL, weights + need, "x") == []
    (warning,) = full_context_warnings(SMALL, weights + need - 1, "1Gi")
    assert "spec.resources.hardLimit (1Gi)" in warning and "400 memory_predicted" in warning
    assert f"{need / 2**20:.1f} MiB" in warning


def test_the_spec_check_applies_to_cpu_workers_of_a_preset_only() -> None:
    from moeguard_operator.spec.spec_checks import memory_warnings, parse_spec

    tight = {"model": {"preset": "small"}, "resources": {"softLimit": "300Mi", "hardLimit": "400Mi"}}
    (warning,) = memory_warnings(parse_spec({**tight, "resources": {**tight["resources"], "gpus": 0}}))
    assert "spec.resources.hardLimit (400Mi)" in warning
    assert memory_warnings(parse_spec(tight)) == []  # one GPU (the default): the step is on the device
    roomy = {"model": {"preset": "small"}, "resources": {"gpus": 0, "softLimit": "1Gi", "hardLimit": "2Gi"}}
    assert memory_warnings(parse_spec(roomy)) == []


def test_a_bad_memory_admission_setting_is_refused_at_start_naming_the_variable() -> None:
    from moeguard_runtime.config import ConfigError

    with pytest.raises(ConfigError, match=r"MOEGUARD_MEMORY_ADMISSION='sometimes' must be one of predicted, off"):
        load_settings({"MOEGUARD_MEMORY_ADMISSION": "sometimes"})
    assert load_settings({}).memory_admission == "predicted"
    assert not load_settings({"MOEGUARD_HARD_LIMIT_BYTES": "1000000000",
                              "MOEGUARD_MEMORY_ADMISSION": "off"}).admits_by_prediction
    assert load_settings({"MOEGUARD_HARD_LIMIT_BYTES": "1000000000"}).admits_by_prediction
    assert not load_settings({}).admits_by_prediction  # no hard limit: nothing to fit under
