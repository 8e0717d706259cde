"""The worker loop driven by hand (no thread): budgets, memory guard, events."""

from __future__ import annotations

import json

import pytest

from moeguard_runtime import presets, tokenizer
from moeguard_runtime.config import load_settings
from moeguard_runtime.contract import BudgetDocument, Budgets
from moeguard_runtime.engine import Engine
from moeguard_runtime.memory import MemoryReading
from moeguard_runtime.model import build_model
from moeguard_runtime.scheduler import Rejected
from moeguard_runtime.service import Event, GenerationRequest, Worker
from moeguard_runtime.telemetry import RateLimitedLog, Telemetry

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
                    memory_reader=lambda: MemoryReading(usage[0], "rss"))
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
                      "soft_limit_bytes": 1000, "hard_limit_bytes": 2000, "gpu": False,
                      "gpu_soft_fraction": 0.9, "gpu_hard_fraction": 0.97}
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
