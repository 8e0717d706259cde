"""Allocation failures in a step: 503 ``out_of_memory``, budgets dropped as on a soft-limit
breach, readiness after repeated failures, probe steps, liveness when it cannot recover.
The worker loop is driven by hand with an injected clock and the test-only fault switch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.unit.runtime.test_service import LABELS, Lines

from moeguard_core import presets
from moeguard_runtime.api import tokenizer
from moeguard_runtime.config import ConfigError, load_settings
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.engine.memory_guard import ALLOCATION_FAILURE_HOLD_S
from moeguard_runtime.engine.scheduler import Rejected
from moeguard_runtime.engine.service import Event, GenerationRequest, Worker
from moeguard_runtime.memory.allocation import NOT_READY_AFTER_FAILURES, allocation_failure_kind
from moeguard_runtime.memory.memory import MemoryReading, MemoryState
from moeguard_runtime.model.model import build_model
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

pytestmark = pytest.mark.unit




def real_cpu_allocation_error() -> RuntimeError:
    try:
        torch.empty(1 << 62, dtype=torch.uint8)
    except RuntimeError as exc:
        return exc
    raise AssertionError("2**62 bytes were allocated")


@pytest.mark.parametrize(("exc", "kind"), [
    (real_cpu_allocation_error(), "host"),
    (MemoryError(), "host"),
    (RuntimeError("could not create a primitive"), "host"),
    (RuntimeError("std::bad_alloc"), "host"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "cuda"),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), "cuda"),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x64 and 32x64)"), None),
    (ValueError("bad prefill chunk"), None),
])
def test_which_errors_are_allocation_failures(exc: BaseException, kind: str | None) -> None:
    assert allocation_failure_kind(exc) == kind


class _Running:
    def is_alive(self) -> bool:
        return True


def make(env: dict[str, str], clock: list[float]) -> tuple[Worker, Lines]:
    settings = load_settings({"MOEGUARD_MAX_PREFILL_TOKENS": "64", "MOEGUARD_TEST_FAULTS": "1", **env})
    lines = Lines()
    worker = Worker(settings, Engine(build_model(presets.get_preset("tiny"), seed=1)),
                    Telemetry(LABELS, 8), RateLimitedLog(0.0, logger=lines), clock=lambda: clock[0],
                    memory_reader=lambda: MemoryReading(100, "rss"), idle_wait_s=0.0)
    worker.check_memory(force=True)
    worker._thread = _Running()  # type: ignore[assignment]  # the loop is driven by hand: "running"
    return worker, lines


def sample(worker: Worker, name: str, **extra: str) -> float | None:
    return worker.telemetry.registry.get_sample_value(name, {**LABELS, **extra})


def run(worker: Worker, req_id: str, clock: list[float], steps: int = 6) -> list[Event]:
    events: list[Event] = []
    worker.submit(GenerationRequest(req_id, tokenizer.encode("hello"), 2), events.append)
    for _ in range(steps):
        worker._iteration()
        if events and events[-1].kind in ("finish", "error"):
            break
    return events


def test_failed_steps_are_503_drop_budgets_and_then_readiness_until_a_probe_runs() -> None:
    clock = [100.0]
    worker, lines = make({"MOEGUARD_FAULT_ALLOC_FAIL_STEPS": "3"}, clock)
    assert worker.ready and NOT_READY_AFTER_FAILURES == 1
    prefill = worker.scheduler.next_budgets.max_prefill_tokens
    for i in range(3):
        events = run(worker, f"r{i}", clock)
        assert [e.kind for e in events] == ["error"]  # no "admitted": a stream answers a plain 503
        assert (events[0].status, events[0].reason) == (503, "out_of_memory")
        assert "ran out of memory (host)" in events[0].message
        # not ready from the first failed step on (issue 29: a burst that fits in one or two steps
        # left it ready while every step failed), with the reason; still alive
        reason = worker.not_ready_reason
        assert reason is not None and reason.startswith("out of memory: the last "), reason
        assert worker.alive
        clock[0] += 0.1
    assert worker.not_ready_reason is not None
    assert worker.not_ready_reason.startswith("out of memory: the last 3 engine steps failed")
    assert "a probe step every 1 s clears it" in worker.not_ready_reason
    assert sample(worker, "moeguard_oom_errors_total", kind="host") == 3
    assert worker.engine.sequences == {}  # the failed requests' KV caches are released
    # the budgets dropped as on a soft-limit breach (factor 0.5), from the next step planned
    assert worker.memory.state == MemoryState.SOFT and worker.memory.shrink_factor == 0.5
    assert worker.scheduler.next_budgets.max_prefill_tokens == prefill // 2
    oom = [kw for ev, kw in lines.lines if ev == "inference_oom"]
    assert [kw["consecutive_failures"] for kw in oom] == [1, 2, 3]
    assert "DefaultCPUAllocator: can't allocate memory" in str(oom[0]["error"])
    state = next(kw for ev, kw in lines.lines if ev == "memory_state")
    assert state["reason"] == "allocation_failure" and state["shrink_factor"] == 0.5
    # an idle loop probes once a second: the fault is spent, so the probe runs and heals
    worker._iteration()  # too early for a probe
    assert not worker.ready
    clock[0] += 1.0
    worker._iteration()
    assert worker.ready
    assert ("allocation_probe", {"result": "ok"}) in lines.lines
    assert worker.engine.sequences == {}
    events = run(worker, "ok", clock)
    assert events[-1].kind == "finish" and events[0].kind == "admitted"
    # the budgets come back once the hold is over
    clock[0] += ALLOCATION_FAILURE_HOLD_S
    worker.check_memory(force=True)
    assert worker.memory.state == MemoryState.NORMAL
    worker._iteration()
    assert worker.scheduler.budgets.max_prefill_tokens == prefill


def test_a_single_failed_step_makes_the_worker_unready_until_a_probe_step_runs() -> None:
    clock = [10.0]
    worker, lines = make({"MOEGUARD_FAULT_ALLOC_FAIL_STEPS": "2"}, clock)
    events: list[Event] = []
    for i in range(4):  # four requests in one step: one failure
        worker.submit(GenerationRequest(f"r{i}", tokenizer.encode("hi"), 2), events.append)
    worker._iteration()
    assert [(e.kind, e.reason) for e in events] == [("error", "out_of_memory")] * 4
    assert worker.loop.health.consecutive == 1
    assert worker.not_ready_reason is not None
    assert worker.not_ready_reason.startswith("out of memory: the last engine step failed to allocate memory")
    clock[0] += 1.0
    worker._iteration()  # the probe: the fault's second failing step
    assert not worker.ready and worker.loop.health.consecutive == 2
    clock[0] += 1.0
    worker._iteration()  # the next probe runs
    assert worker.ready
    assert [kw["result"] for ev, kw in lines.lines if ev == "allocation_probe"] == ["failed", "ok"]


@pytest.mark.parametrize("soft", [None, 1000])
def test_the_overload_cap_after_an_allocation_failure_ends_with_its_hold(soft: int | None) -> None:
    """Issue 29: the budgets drop for ALLOCATION_FAILURE_HOLD_S (docs/api.md), but the Auto trigger's own
    OVERLOAD_HOLD_S kept overload mode (its context cap) on 5 s longer, and with a soft limit the hold fed
    its hysteresis (usage 95 % of soft: shrunk for as long as it stayed there)."""
    clock = [50.0]
    env = {"MOEGUARD_FAULT_ALLOC_FAIL_STEPS": "1"}
    if soft is not None:
        env["MOEGUARD_SOFT_LIMIT_BYTES"] = str(soft)
    worker, _ = make(env, clock)
    worker.memory._read_memory = lambda: MemoryReading(950 if soft else 100, "rss")
    worker.check_memory(force=True)
    assert worker.memory.state == MemoryState.NORMAL and not worker.overload
    cap = worker.overload_trigger.policy.max_context_tokens
    assert run(worker, "r0", clock)[-1].reason == "out_of_memory"
    failed_at = clock[0]
    long_prompt = tokenizer.encode("y" * cap)  # over the overload context cap with its max_tokens

    def submit_long() -> str:
        try:
            worker.submit(GenerationRequest(f"long-{clock[0]}", long_prompt, 4), lambda e: None)
        except Rejected as rej:
            return rej.reason
        worker.cancel(f"long-{clock[0]}")
        return "admitted"

    while clock[0] < failed_at + ALLOCATION_FAILURE_HOLD_S - 0.25:
        clock[0] += 0.25
        worker.check_memory(force=True)
        assert worker.overload and worker.memory.state == MemoryState.SOFT
    assert submit_long() == "overload_context_limit"
    clock[0] = failed_at + ALLOCATION_FAILURE_HOLD_S
    worker.check_memory(force=True)
    assert not worker.overload and worker.memory.state == MemoryState.NORMAL
    assert worker.memory.shrink_factor == 1.0
    assert submit_long() == "admitted"


def test_a_loop_that_cannot_allocate_stops_claiming_to_be_alive(tmp_path: Path) -> None:
    switch = tmp_path / "alloc-fail"
    switch.touch()
    clock = [0.0]
    worker, lines = make({"MOEGUARD_FAULT_ALLOC_FAIL_FILE": str(switch),
                          "MOEGUARD_UNRECOVERED_OOM_SECONDS": "5"}, clock)
    for i in range(NOT_READY_AFTER_FAILURES):
        assert run(worker, f"r{i}", clock)[-1].reason == "out_of_memory"
    assert not worker.ready and worker.alive
    for _ in range(4):  # probes fail too, one a second
        clock[0] += 1.0
        worker._iteration()
    assert worker.loop.health.consecutive == NOT_READY_AFTER_FAILURES + 4 and worker.alive
    clock[0] += 1.0
    assert worker.not_alive_reason is not None
    assert worker.not_alive_reason.startswith("engine cannot allocate memory: no step has run for 5.0 s")
    assert worker.not_ready_reason == worker.not_alive_reason
    failed_probe = next(kw for ev, kw in lines.lines if ev == "allocation_probe")
    assert failed_probe["result"] == "failed" and str(failed_probe["error"]).startswith("host: ")
    switch.unlink()  # the fault is cleared: the next probe runs
    worker._iteration()
    assert worker.alive and worker.ready


def test_unrecovered_seconds_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="MOEGUARD_UNRECOVERED_OOM_SECONDS=0 must be in"):
        load_settings({"MOEGUARD_UNRECOVERED_OOM_SECONDS": "0"})
    with pytest.raises(ConfigError, match="MOEGUARD_FAULT_ALLOC_FAIL_STEPS set without MOEGUARD_TEST_FAULTS=1"):
        load_settings({"MOEGUARD_FAULT_ALLOC_FAIL_STEPS": "2"})


def test_a_primitive_that_could_not_be_created_makes_the_matmuls_leave_onednn() -> None:
    clock = [0.0]
    worker, lines = make({"MOEGUARD_FAULT_ALLOC_FAIL_STEPS": "1"}, clock)
    model = worker.engine.model
    assert isinstance(model, torch.nn.Module)
    backends = {getattr(m, "matmul_backend", None) for m in model.modules()} - {None}
    assert backends == {"onednn"}
    assert run(worker, "r0", clock)[-1].reason == "out_of_memory"  # the allocator's error: oneDNN stays
    assert {getattr(m, "matmul_backend", None) for m in model.modules()} - {None} == {"onednn"}
    worker.engine.step = _raise(RuntimeError("could not create a primitive"))  # type: ignore[method-assign]
    assert run(worker, "r1", clock)[-1].reason == "out_of_memory"
    assert {getattr(m, "matmul_backend", None) for m in model.modules()} - {None} == {"torch"}
    fallback = next(kw for ev, kw in lines.lines if ev == "matmul_backend_fallback")
    assert fallback["matmul_backend"] == "torch" and int(str(fallback["modules"])) == 2  # one per MoE layer
    del worker.engine.step  # the class's own again
    assert run(worker, "r2", clock)[-1].kind == "finish"


def _raise(exc: Exception) -> object:
    def step(*a: object, **k: object) -> object:
        raise exc
    return step
