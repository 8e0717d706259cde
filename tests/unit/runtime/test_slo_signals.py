"""The worker's signals for the outer loop's predictive policy (issue 30): TPOT per request, the accepted
requests' context, and the idle footprint."""

from __future__ import annotations

import pytest

from moeguard_core import contract, presets
from moeguard_runtime.api import tokenizer
from moeguard_runtime.config import load_settings
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.engine.service import Event, GenerationRequest, Worker
from moeguard_runtime.engine.step_loop import time_per_output_token
from moeguard_runtime.memory.memory import MemoryReading
from moeguard_runtime.model.model import build_model
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

pytestmark = pytest.mark.unit

LABELS = {"moeis": "s", "namespace": "n", "pod": "p"}


class Quiet:
    def info(self, event: str, **kw: object) -> None:
        pass


def worker(clock: list[float], usage: list[int]) -> Worker:
    settings = load_settings({"MOEGUARD_SOFT_LIMIT_BYTES": "1000", "MOEGUARD_HARD_LIMIT_BYTES": "2000",
                              "MOEGUARD_MAX_PREFILL_TOKENS": "64"})
    return Worker(settings, Engine(build_model(presets.get_preset("tiny"), seed=1)), Telemetry(LABELS, 8),
                  RateLimitedLog(0.0, logger=Quiet()), clock=lambda: clock[0],
                  memory_reader=lambda: MemoryReading(usage[0], "rss"), idle_wait_s=0.0)


def value(w: Worker, name: str, **extra: str) -> float | None:
    return w.telemetry.registry.get_sample_value(name, {**LABELS, **extra})


def test_time_per_output_token_is_distserves() -> None:
    assert time_per_output_token(10.0, 12.0, 5) == 0.5  # 2 s over the 4 tokens after the first
    assert time_per_output_token(10.0, 10.0, 1) == 0.0  # nothing after the first token
    assert time_per_output_token(10.0, 9.0, 3) == 0.0  # a clock that went back never gives a negative TPOT


def test_a_finished_request_observes_its_tpot_and_its_context_once() -> None:
    clock, usage = [100.0], [500]
    w = worker(clock, usage)
    events: list[Event] = []
    prompt = tokenizer.encode("x" * 40)
    w.submit(GenerationRequest("r", prompt, 4, 0.0), events.append)
    tpot = contract.METRIC_TPOT_SECONDS
    ctx = contract.METRIC_REQUEST_CONTEXT_TOKENS
    assert value(w, f"{ctx}_count") == 1 and value(w, f"{ctx}_sum") == len(prompt) + 4
    for _ in range(10):
        clock[0] += 0.1  # each step a tenth of a second later
        w._iteration()
    assert events[-1].kind == "finish"
    tokens = len([e for e in events if e.kind == "token"])
    assert value(w, f"{tpot}_count", priority="interactive") == 1
    assert value(w, f"{tpot}_count", priority="batch") == 0
    # one step per token after the first: 0.1 s each
    assert value(w, f"{tpot}_sum", priority="interactive") == pytest.approx(0.1 if tokens > 1 else 0.0)
    assert value(w, f"{tpot}_bucket", priority="interactive", le="0.1") == 1
    assert value(w, f"{contract.METRIC_TTFT_SECONDS}_bucket", priority="interactive", le="3.0") == 1


def test_the_idle_footprint_is_the_memory_in_use_at_an_idle_check_only() -> None:
    clock, usage = [0.0], [500]
    w = worker(clock, usage)
    name = contract.METRIC_MEMORY_IDLE_FOOTPRINT_BYTES
    w.check_memory(force=True)
    assert value(w, name) == 500
    w.submit(GenerationRequest("r", tokenizer.encode("x" * 40), 4, 0.0), lambda e: None)
    usage[0] = 900  # a request in the worker: its memory is load, not footprint
    w.check_memory(force=True)
    assert value(w, name) == 500
    for _ in range(10):
        w._iteration()
    usage[0] = 520  # idle again, with the heap the process kept
    w.check_memory(force=True)
    assert value(w, name) == 520
