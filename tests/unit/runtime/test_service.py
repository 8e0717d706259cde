"""The worker loop driven by hand (no thread): budgets, memory guard, events."""

from __future__ import annotations

import json

import pytest

from moeguard_core import presets
from moeguard_core.contract import BudgetDocument, Budgets
from moeguard_runtime.api import tokenizer
from moeguard_runtime.config import load_settings
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.engine.scheduler import Rejected
from moeguard_runtime.engine.service import Event, GenerationRequest, Worker
from moeguard_runtime.memory.memory import MemoryReading
from moeguard_runtime.model.model import build_model
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

pytestmark = pytest.mark.unit

LABELS = {"moeis": "s", "namespace": "n", "pod": "p"}


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, object]]] = []

    def info(self, event: str, **kw: object) -> None:
        self.lines.append((event, kw))


@pytest.fixture
def setup() -> tuple[Worker, list[int], Lines]:
    usage = [100]
    settings = load_settings({"MOEGUARD_SOFT_LIMIT_BYTES": "1000",
                              "MOEGUARD_HARD_LIMIT_BYTES": "2000",
                              "MOEGUARD_MAX_PREFILL_TOKENS": "64"})
    lines = Lines()
    worker = Worker(settings, Engine(build_model(presets.get_preset("tiny"), seed=1)),
                    Telemetry(LABELS, 8), RateLimitedLog(0.0, logger=lines), clock=lambda: 0.0,
                    memory_reader=lambda: MemoryReading(usage[0], "rss"), idle_wait_s=0.0)
    worker.check_memory(force=True)
    return worker, usage, lines


def gauge(worker: Worker, name: str, **extra: str) -> float | None:
    return worker.telemetry.registry.get_sample_value(name, {**LABELS, **extra})


def doc(generation: int, prefill: int) -> dict[str, str]:
    b = Budgets(max_prefill_tokens=prefill, max_decode_tokens=4, max_batch_requests=4,
                max_concurrent_batches=1)
    return BudgetDocument(generation=generation, budgets=b).to_configmap_data()


def test_request_runs_to_finish_with_chunked_prefill(setup: tuple[Worker, list[int], Lines]) -> None:
    worker, _, lines = setup
    events: list[Event] = []
    prompt = tokenizer.encode("x" * 150)  # 151 tokens: 3 prefill steps of <= 64
    worker.submit(GenerationRequest("r", prompt, 4, 0.0), events.append)
    for _ in range(10):
        worker._iteration()
    assert events[-1].kind == "finish"
    tokens = [e for e in events if e.kind == "token"]
    assert len(tokens) == 4 or events[-1].finish_reason == "stop"
    assert gauge(worker, "moeguard_batch_tokens_count", phase="prefill") == 3
    assert gauge(worker, "moeguard_batch_tokens_sum", phase="prefill") == 151
    source = next(kw for ev, kw in lines.lines if ev == "memory_source")
    assert source == {"source": "rss", "usage_bytes": 100, "cgroup_limit_bytes": None,
                      "cgroup_path": None,
                      "soft_limit_bytes": 1000, "hard_limit_bytes": 2000, "gpu": False,
                      "gpu_soft_fraction": 0.85, "gpu_hard_fraction": 0.95}
    assert worker.engine.sequences == {}  # released after finishing
    worker._iteration()


def test_budget_document_applies_next_step_and_bad_one_is_refused(
        setup: tuple[Worker, list[int], Lines]) -> None:
    worker, _, lines = setup
    worker.on_budget_data(doc(3, 16))
    assert gauge(worker, "moeguard_budget_max_prefill_tokens") == 64  # not before the next step
    worker._iteration()
    assert gauge(worker, "moeguard_budget_max_prefill_tokens") == 16
    assert gauge(worker, "moeguard_budget_generation") == 3
    assert worker.scheduler.budgets.max_prefill_tokens == 16
    worker.on_budget_data({"budget.json": json.dumps({"generation": 4})})
    worker.on_budget_data(doc(2, 999))
    assert gauge(worker, "moeguard_budget_updates_total", result="rejected") == 1
    assert gauge(worker, "moeguard_budget_updates_total", result="ignored") == 1
    assert gauge(worker, "moeguard_budget_updates_total", result="applied") == 1
    worker._iteration()
    assert worker.scheduler.budgets.max_prefill_tokens == 16 and worker.budget_generation == 3
    rejected = [kw for ev, kw in lines.lines if ev == "budget_rejected"]
    assert rejected and "budgets" in str(rejected[0]["reason"])


def test_soft_limit_shrinks_hard_limit_refuses(setup: tuple[Worker, list[int], Lines]) -> None:
    worker, usage, _ = setup
    usage[0] = 1500
    worker.check_memory(force=True)
    worker._iteration()
    assert worker.scheduler.budgets.max_prefill_tokens == 32
    assert gauge(worker, "moeguard_budget_shrink_factor") == 0.5
    usage[0] = 2500
    worker.check_memory(force=True)
    assert not worker.ready or not worker.alive
    with pytest.raises(Rejected) as exc:
        worker.submit(GenerationRequest("r", [1, 2], 1), lambda e: None)
    assert exc.value.reason == "memory_hard_limit" and "2500 bytes (rss)" in exc.value.message
    usage[0] = 950  # below soft but within the 10 % hysteresis band (900-1000): still shrunk
    worker.check_memory(force=True)
    worker._iteration()
    assert worker.scheduler.budgets.max_prefill_tokens == 32
    usage[0] = 800
    worker.check_memory(force=True)
    worker._iteration()
    assert worker.scheduler.budgets.max_prefill_tokens == 64
    assert gauge(worker, "moeguard_memory_limit_state") == 0


def test_operator_overload_document_switches_mode_and_context_cap(
        setup: tuple[Worker, list[int], Lines]) -> None:
    worker, _, lines = setup
    b = Budgets(max_prefill_tokens=64, max_decode_tokens=8, max_batch_requests=4,
                max_concurrent_batches=2)
    data = BudgetDocument(generation=1, budgets=b, overload_mode="On",
                          overload_max_context_tokens=100).to_configmap_data()
    worker.on_budget_data(data)
    worker._iteration()
    assert worker.scheduler.budgets.max_concurrent_batches == 1
    assert worker.scheduler.budgets.max_decode_tokens == 4
    assert gauge(worker, "moeguard_overload_active", source="operator") == 1
    with pytest.raises(Rejected) as exc:
        worker.submit(GenerationRequest("r", [1] * 90, 20), lambda e: None)
    assert exc.value.status == 503 and "must be <= 100 tokens (given 90 + 20 = 110)" in exc.value.message
    assert any(ev == "overload_mode" and kw["active"] for ev, kw in lines.lines)
    off = BudgetDocument(generation=2, budgets=b).to_configmap_data()
    worker.on_budget_data(off)
    worker._iteration()
    assert worker.scheduler.budgets.max_concurrent_batches == 2
    assert gauge(worker, "moeguard_overload_active", source="operator") == 0


def test_budget_update_with_floor_above_ceiling_is_refused_and_counted(
        setup: tuple[Worker, list[int], Lines]) -> None:
    worker, _, lines = setup
    bad = {"budget.json": json.dumps({"generation": 5, "budgets": {
        "maxPrefillTokens": 64, "maxDecodeTokens": 4, "maxBatchRequests": 4,
        "maxLongRequestsPerBatch": 8, "maxConcurrentBatches": 1}})}
    worker.on_budget_data(bad)
    worker._iteration()
    assert worker.budget_generation == -1 and worker.scheduler.budgets.max_prefill_tokens == 64
    assert gauge(worker, "moeguard_budget_updates_total", result="rejected") == 1
    reason = next(kw["reason"] for ev, kw in lines.lines if ev == "budget_rejected")
    assert reason == ("invalid budget.json: budgets.maxLongRequestsPerBatch 8 is above "
                      "budgets.maxBatchRequests 4")


def test_worker_self_trigger_overload_with_hold(setup: tuple[Worker, list[int], Lines]) -> None:
    worker, usage, _ = setup
    now = [0.0]
    worker._clock = lambda: now[0]
    usage[0] = 1500  # above soft
    worker.check_memory(force=True)
    assert worker.overload_sources["worker"] and worker.scheduler.overload
    usage[0] = 100
    now[0] = 1.0
    worker.check_memory(force=True)
    assert worker.scheduler.overload  # held for OVERLOAD_HOLD_S after the last trigger
    now[0] = 6.5
    worker.check_memory(force=True)
    assert not worker.scheduler.overload
    assert gauge(worker, "moeguard_overload_active", source="worker") == 0


def test_a_document_without_the_queue_trigger_leaves_overload_to_memory_and_the_operator() -> None:
    """Issue 30: under the predictive policy the operator decides overload from SLO attainment, so a full
    queue no longer halves decode; memory above the soft limit still turns it on."""
    settings = load_settings({"MOEGUARD_SOFT_LIMIT_BYTES": "1000", "MOEGUARD_HARD_LIMIT_BYTES": "2000",
                              "MOEGUARD_MAX_QUEUE_REQUESTS": "5"})
    usage, now = [100], [0.0]
    worker = Worker(settings, Engine(build_model(presets.get_preset("tiny"), seed=1)),
                    Telemetry(LABELS, 8), RateLimitedLog(0.0, logger=Lines()), clock=lambda: now[0],
                    memory_reader=lambda: MemoryReading(usage[0], "rss"), idle_wait_s=0.0)
    for i in range(4):  # 4 of 5 waiting: OVERLOAD_QUEUE_ON (80 %)
        worker.submit(GenerationRequest(f"r{i}", [1, 2, 3], 4), lambda e: None)
    assert worker.scheduler.queue_requests == 4
    worker.check_memory(force=True)
    assert worker.scheduler.overload and worker.overload_sources["worker"]  # the queue trigger, by default

    b = settings.budgets.model_copy(update={"max_decode_tokens": 8})
    worker.on_budget_data(BudgetDocument(generation=1, budgets=b, overload_queue_trigger=False).to_configmap_data())
    now[0] = 6.0  # past OVERLOAD_HOLD_S: the queue is still full, but no longer pressure
    worker.check_memory(force=True)
    assert worker.scheduler.queue_requests == 4
    assert not worker.scheduler.overload and gauge(worker, "moeguard_overload_active", source="worker") == 0
    assert worker.scheduler.next_budgets.max_decode_tokens == 8  # not halved

    usage[0] = 1500  # above the soft limit: the memory trigger fires whatever the document says
    now[0] = 7.0
    worker.check_memory(force=True)
    assert worker.scheduler.overload and worker.overload_sources["worker"]


def test_env_overload_off_disables_the_self_trigger() -> None:
    settings = load_settings({"MOEGUARD_SOFT_LIMIT_BYTES": "1000", "MOEGUARD_OVERLOAD_MODE": "Off"})
    worker = Worker(settings, Engine(build_model(presets.get_preset("tiny"), seed=1)),
                    Telemetry(LABELS, 8), RateLimitedLog(0.0, logger=Lines()), clock=lambda: 0.0,
                    memory_reader=lambda: MemoryReading(5000, "rss"), idle_wait_s=0.0)
    worker.check_memory(force=True)
    assert not worker.scheduler.overload
    on = load_settings({"MOEGUARD_OVERLOAD_MODE": "On"})
    w2 = Worker(on, worker.engine, Telemetry(LABELS, 8), RateLimitedLog(0.0, logger=Lines()), idle_wait_s=0.0)
    assert w2.scheduler.overload and w2.overload_sources["env"]


@pytest.mark.parametrize("error", [MemoryError("cannot allocate"), None])
def test_out_of_memory_in_a_batch_fails_it_and_the_worker_goes_on(
        setup: tuple[Worker, list[int], Lines], error: Exception | None) -> None:
    import torch

    worker, _, lines = setup
    exc = error or torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    real_step = worker.engine.step

    def boom(*a: object, **k: object) -> object:
        raise exc

    worker.engine.step = boom  # type: ignore[method-assign]
    events: list[Event] = []
    worker.submit(GenerationRequest("r1", tokenizer.encode("hello"), 3), events.append)
    worker._iteration()
    kind = "host" if error else "cuda"
    assert events[-1].kind == "error" and events[-1].status == 503
    assert events[-1].reason == "out_of_memory" and f"out of memory ({kind})" in events[-1].message
    assert gauge(worker, "moeguard_oom_errors_total", kind=kind) == 1
    assert any(ev == "inference_oom" and kw["kind"] == kind for ev, kw in lines.lines)
    worker.engine.step = real_step  # type: ignore[method-assign]
    ok: list[Event] = []
    worker.submit(GenerationRequest("r2", tokenizer.encode("hello"), 2), ok.append)
    for _ in range(5):
        worker._iteration()
    assert ok[-1].kind == "finish" and worker.engine.sequences == {}
    assert worker.scheduler.queue_requests == 0 and worker.scheduler.running_requests == 0


def test_events_and_stage_metrics(setup: tuple[Worker, list[int], Lines]) -> None:
    worker, _, lines = setup
    worker.submit(GenerationRequest("r", tokenizer.encode("x" * 40), 3), lambda e: None)
    for _ in range(5):
        worker._iteration()
    start = next(kw for ev, kw in lines.lines if ev == "inference_batch_start")
    assert start == {"step": 0, "batch": 0, "requests": 1, "input_tokens": 41, "prefill_tokens": 41,
                     "decode_tokens": 0, "longest_request": 41, "active_decode_sequences": 0,
                     "concurrent_batches": 1, "batches_in_flight": 1, "prefill_batches": 1, "long_requests": 0}
    routing = next(kw for ev, kw in lines.lines if ev == "moe_routing_stats")
    assert routing["layers"] == 2 and len(str(routing["skew_ratio"]).split(",")) == 2
    ratios = [float(x) for x in str(routing["skew_ratio"]).split(",")]
    assert routing["top_skew_layer"] == ratios.index(max(ratios))
    assert abs(float(str(routing["top_skew_ratio"])) - max(ratios)) < 0.01
    assert 0 <= int(str(routing["top_expert"])) < 8 and 1 / 8 <= float(str(routing["top_share"])) <= 1 / 2
    assert routing["overflow_tokens"] == "0,0"
    snap = next(kw for ev, kw in lines.lines if ev == "memory_snapshot")
    assert snap["stage"] == "post_pack_pre_forward" and int(str(snap["rss_bytes"])) > 0
    assert {"rss_anonymous_bytes", "python_allocated_blocks", "gpu_allocated_bytes",
            "gpu_reserved_bytes", "pinned_bytes"} <= set(snap)
    for stage in ("queue", "prefill", "routing", "expert", "decode", "postprocess"):
        assert (gauge(worker, "moeguard_stage_duration_seconds_count", stage=stage) or 0) >= 1, stage


def test_admitted_comes_before_tokens_and_never_after_a_queue_timeout() -> None:
    """The server holds a stream's 200 until ``admitted``: it must precede the first
    token, and a request that times out in the queue must get only its error."""
    now = [0.0]
    settings = load_settings({"MOEGUARD_MAX_CONCURRENT_BATCHES": "1",
                              "MOEGUARD_MAX_BATCH_REQUESTS": "1",
                              "MOEGUARD_QUEUE_TIMEOUT_SECONDS": "2"})
    worker = Worker(settings, Engine(build_model(presets.get_preset("tiny"), seed=1)),
                    Telemetry(LABELS, 8), RateLimitedLog(0.0, logger=Lines()),
                    clock=lambda: now[0], memory_reader=lambda: MemoryReading(1, "rss"), idle_wait_s=0.0)
    first: list[Event] = []
    second: list[Event] = []
    worker.submit(GenerationRequest("a", tokenizer.encode("hello"), 50, 0.0), first.append)
    worker.submit(GenerationRequest("b", tokenizer.encode("queued"), 2, 0.0), second.append)
    worker._iteration()
    assert [e.kind for e in first][:2] == ["admitted", "token"]
    assert second == []
    now[0] = 2.5
    worker._iteration()
    assert [e.kind for e in second] == ["error"]
    assert second[0].status == 503 and second[0].reason == "queue_timeout"
    assert [e.kind for e in first].count("admitted") == 1


def test_the_self_trigger_holds_until_calm() -> None:
    from moeguard_runtime.engine.overload_trigger import worker_wants_overload

    assert worker_wants_overload(active=False, pressure=True, calm=False)
    assert worker_wants_overload(active=True, pressure=False, calm=False)  # held
    assert not worker_wants_overload(active=True, pressure=False, calm=True)
    assert not worker_wants_overload(active=False, pressure=False, calm=False)


def test_with_a_budget_configmap_the_worker_is_not_ready_before_its_first_document(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Worker, "alive", property(lambda self: True))  # no engine thread in unit tests
    settings = load_settings({"MOEGUARD_BUDGET_CONFIGMAP": "svc-budget"})
    worker = Worker(settings, Engine(build_model(presets.get_preset("tiny"), seed=1)),
                    Telemetry(LABELS, 8), RateLimitedLog(0.0, logger=Lines()), clock=lambda: 0.0,
                    memory_reader=lambda: MemoryReading(100, "rss"), idle_wait_s=0.0)
    assert not worker.ready
    assert worker.not_ready_reason is not None and "svc-budget" in worker.not_ready_reason
    worker.on_budget_data({"budget.json": json.dumps({"generation": 1})})  # invalid: still not ready
    assert not worker.ready
    worker.on_budget_data(doc(1, 32))
    assert worker.ready and worker.not_ready_reason is None


def test_without_a_budget_configmap_the_env_budgets_serve_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Worker, "alive", property(lambda self: True))
    worker = Worker(load_settings({}), Engine(build_model(presets.get_preset("tiny"), seed=1)),
                    Telemetry(LABELS, 8), RateLimitedLog(0.0, logger=Lines()), clock=lambda: 0.0,
                    memory_reader=lambda: MemoryReading(100, "rss"), idle_wait_s=0.0)
    assert worker.ready


def _one_slot_worker(**env: str) -> Worker:
    settings = load_settings({"MOEGUARD_MAX_BATCH_REQUESTS": "1", "MOEGUARD_MAX_CONCURRENT_BATCHES": "1",
                              "MOEGUARD_MAX_QUEUE_REQUESTS": "1", "MOEGUARD_OVERLOAD_MODE": "Off", **env})
    return Worker(settings, Engine(build_model(presets.get_preset("tiny"), seed=1)), Telemetry(LABELS, 8),
                  RateLimitedLog(0.0, logger=Lines()), clock=lambda: 0.0,
                  memory_reader=lambda: MemoryReading(100, "rss"), idle_wait_s=0.0)


def test_a_preempted_batch_request_resumes_with_the_same_tokens_as_alone() -> None:
    prompt = tokenizer.encode("hello there")
    alone: list[Event] = []
    worker = _one_slot_worker()
    worker.submit(GenerationRequest("b", prompt, 12, 0.0, priority="batch"), alone.append)
    for _ in range(20):
        worker._iteration()
    worker = _one_slot_worker()
    batch: list[Event] = []
    interactive: list[Event] = []
    worker.submit(GenerationRequest("b", prompt, 12, 0.0, priority="batch"), batch.append)
    for _ in range(4):  # prefill and 3 decode steps
        worker._iteration()
    worker.submit(GenerationRequest("i", prompt, 3, 0.0), interactive.append)
    for _ in range(3):  # the interactive request runs alone to its end: prefill, 2 decode steps
        worker._iteration()
    assert [e.kind for e in interactive] == ["admitted", "token", "token", "token", "finish"]
    assert len([e for e in batch if e.kind == "token"]) == 4  # paused, not failed
    assert gauge(worker, "moeguard_preemptions_total", priority="batch") == 1
    assert gauge(worker, "moeguard_priority_requests", priority="batch", state="preempted") == 1
    assert "b" in worker.engine.sequences  # its KV cache kept
    for _ in range(20):
        worker._iteration()
    tokens = [e.token for e in batch if e.kind == "token"]
    assert tokens == [e.token for e in alone if e.kind == "token"] and len(tokens) == 12
    assert [e.kind for e in batch].count("admitted") == 1 and batch[-1].kind == "finish"


def test_a_queued_batch_request_is_shed_for_an_interactive_one_with_a_503() -> None:
    worker = _one_slot_worker()
    prompt = tokenizer.encode("hello there")
    running: list[Event] = []
    queued: list[Event] = []
    worker.submit(GenerationRequest("b1", prompt, 8, 0.0, priority="batch"), running.append)
    worker._iteration()
    worker.submit(GenerationRequest("b2", prompt, 8, 0.0, priority="batch"), queued.append)
    with pytest.raises(Rejected) as exc:  # a batch request meets the full queue: refused
        worker.submit(GenerationRequest("b3", prompt, 8, 0.0, priority="batch"), queued.append)
    assert exc.value.reason == "queue_full"
    worker.submit(GenerationRequest("i", prompt, 2, 0.0), lambda e: None)
    assert [(e.kind, e.status, e.reason) for e in queued] == [("error", 503, "priority_shed")]
    assert gauge(worker, "moeguard_priority_rejections_total", priority="batch", reason="priority_shed") == 1
    assert gauge(worker, "moeguard_priority_rejections_total", priority="batch", reason="queue_full") == 1
    assert gauge(worker, "moeguard_rejections_total", reason="priority_shed") == 1
