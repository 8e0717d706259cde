"""Allocation failures in a step, over real HTTP: the test-only switch makes every step's
allocation fail (the real allocator's error: it asks for 2**62 bytes) while a file exists.
Each request in a failing step gets 503 ``out_of_memory`` with Retry-After; the budgets drop, and
overload mode's context cap applies, for the documented 30 s and no longer; the first failed step
makes /readyz 503 with the reason; once the fault is cleared a probe step runs and the worker is
ready and serving again. A loop that cannot recover fails /healthz too."""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from harness.stack import wait_for
from tests.integration.worker.conftest import WorkerProcess
from tests.integration.worker.test_worker_http import assert_openai_error, metrics, post

from moeguard_runtime.engine.memory_guard import ALLOCATION_FAILURE_HOLD_S

pytestmark = pytest.mark.integration

BODY = {"prompt": "hello", "max_tokens": 4, "temperature": 0}


def sample(w: WorkerProcess, name: str, **labels: str) -> float:
    return next(v for lab, v in metrics(w)[name] if labels.items() <= lab.items())


def get(w: WorkerProcess, path: str) -> httpx.Response:
    return httpx.get(f"{w.base_url}{path}", timeout=10)


def assert_out_of_memory(r: httpx.Response) -> None:
    err = assert_openai_error(r, 503, "the batch ran out of memory (host)")
    assert err["code"] == "out_of_memory" and err["type"] == "service_unavailable_error"
    assert r.headers["retry-after"] == "1"


def test_failing_allocations_are_503_then_not_ready_and_the_worker_heals(
        start_worker: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    switch = tmp_path / "alloc-fail"
    w = start_worker(MOEGUARD_TEST_FAULTS="1", MOEGUARD_FAULT_ALLOC_FAIL_FILE=str(switch))
    assert post(w, BODY).status_code == 200
    prefill = sample(w, "moeguard_budget_max_prefill_tokens")
    switch.touch()
    assert_out_of_memory(post(w, BODY))
    # a stream whose first step fails gets the same JSON 503, not a 200 with an error event
    assert_out_of_memory(post(w, {**BODY, "stream": True}))
    assert_out_of_memory(post(w, BODY))
    r = get(w, "/readyz")
    assert r.status_code == 503, r.text
    # three failed steps, and the probe steps that failed between them (one a second)
    assert r.text.startswith("out of memory: the last ") and " engine steps failed to allocate memory" in r.text
    assert "DefaultCPUAllocator: can't allocate memory" in r.text
    assert get(w, "/healthz").status_code == 200  # alive: it may heal
    assert sample(w, "moeguard_oom_errors_total", kind="host") == 3
    assert sample(w, "moeguard_memory_limit_state") == 1  # as above the soft limit ...
    wait_for(lambda: sample(w, "moeguard_budget_shrink_factor") == 0.5, 5,
             "the halved budgets applied (from the next step planned)")
    switch.unlink()  # the fault is cleared: the next probe step runs
    wait_for(lambda: get(w, "/readyz").status_code == 200, 15, "ready again after the fault")
    r = post(w, BODY)
    assert r.status_code == 200, r.text
    # ... and the step that served it ran under the halved prefill budget
    assert sample(w, "moeguard_budget_max_prefill_tokens") == prefill // 2
    logs = w.logs()
    assert "event=inference_oom" in logs and "consecutive_failures=1" in logs
    assert "event=memory_state" in logs and "reason=allocation_failure" in logs
    assert "event=allocation_probe result=ok" in logs


def test_one_failed_step_makes_the_worker_unready_until_a_probe_step_runs(
        start_worker: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    """Issue 29: a burst whose requests fit in one or two steps failed them all while /readyz said
    200 (readiness waited for three failed steps)."""
    switch = tmp_path / "alloc-fail"
    w = start_worker(MOEGUARD_TEST_FAULTS="1", MOEGUARD_FAULT_ALLOC_FAIL_FILE=str(switch))
    assert post(w, BODY).status_code == 200
    switch.touch()
    assert_out_of_memory(post(w, BODY))
    r = get(w, "/readyz")
    assert r.status_code == 503, r.text
    # one failed step (a probe step a second after it may have failed too: "the last 2 engine steps")
    assert r.text.startswith("out of memory: the last ") and "failed to allocate memory" in r.text, r.text
    assert sample(w, "moeguard_oom_errors_total", kind="host") == 1
    assert get(w, "/healthz").status_code == 200
    switch.unlink()
    t0 = time.monotonic()
    wait_for(lambda: get(w, "/readyz").status_code == 200, 10, "ready again: a probe step ran")
    assert time.monotonic() - t0 < 3.0  # a probe a second
    assert "event=allocation_probe result=ok" in w.logs()
    assert post(w, BODY).status_code == 200


def test_the_overload_cap_after_an_allocation_failure_ends_when_the_documented_30_s_are_up(
        start_worker: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    """Issue 29: after the fault was lifted, prompts of 500-1,000 bytes still got 503
    ``overload_context_limit`` past the 30 s docs/api.md gives (overload mode's own 5-s hold came on top)."""
    switch = tmp_path / "alloc-fail"
    w = start_worker(MOEGUARD_TEST_FAULTS="1", MOEGUARD_FAULT_ALLOC_FAIL_FILE=str(switch))
    long = {"prompt": "x" * 700, "max_tokens": 16, "temperature": 0}  # 717 tokens: over the 512 cap
    assert post(w, long).status_code == 200
    switch.touch()
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(post(w, BODY))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    failed_by = time.monotonic()  # the last failed step ran before its answers came back
    assert len(answers) == 8
    for r in answers:
        assert_out_of_memory(r)
    switch.unlink()
    wait_for(lambda: get(w, "/readyz").status_code == 200, 10, "ready again after the fault")
    r = post(w, long)  # within the hold: refused by the overload context cap, retryable
    assert time.monotonic() - failed_by < ALLOCATION_FAILURE_HOLD_S
    err = assert_openai_error(r, 503, "overload mode is on")
    assert err["code"] == "overload_context_limit" and r.headers["retry-after"]
    time.sleep(max(0.0, failed_by + ALLOCATION_FAILURE_HOLD_S + 1.5 - time.monotonic()))
    r = post(w, long)
    assert r.status_code == 200, r.text
    assert sample(w, "moeguard_overload_active", source="worker") == 0
    assert sample(w, "moeguard_memory_limit_state") == 0


def test_a_loop_that_cannot_allocate_stops_claiming_to_be_alive(
        start_worker: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    switch = tmp_path / "alloc-fail"
    w = start_worker(MOEGUARD_TEST_FAULTS="1", MOEGUARD_FAULT_ALLOC_FAIL_FILE=str(switch),
                     MOEGUARD_UNRECOVERED_OOM_SECONDS="3")
    switch.touch()
    for _ in range(3):
        assert_out_of_memory(post(w, BODY))
    r = wait_for(lambda: (h := get(w, "/healthz")).status_code == 503 and h, 20, "/healthz 503")
    assert r.text.startswith("engine cannot allocate memory: no step has run for"), r.text
    assert "limit 3 s, MOEGUARD_UNRECOVERED_OOM_SECONDS" in r.text
    assert get(w, "/readyz").status_code == 503
    switch.unlink()
    wait_for(lambda: get(w, "/healthz").status_code == 200, 15, "/healthz 200 after the fault")
    assert get(w, "/readyz").status_code == 200
    assert post(w, BODY).status_code == 200


def vm_size(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize:"))


def test_an_address_space_limit_mid_run_is_503s_and_lifting_it_heals(
        start_worker: Callable[..., WorkerProcess]) -> None:
    """The issue's input: ``prlimit --as`` at the worker's current size mid-run, requests, then the
    limit lifted. Before: 500 ``engine_error`` under the limit, and after it the prefills whose oneDNN
    primitives had failed kept failing ("could not create a primitive") while /readyz said 200."""
    w = start_worker(MOEGUARD_MODEL_PRESET="small")
    pid = w.proc.pid
    lengths = (50, 300, 900, 2000)
    for n in lengths[:2]:  # warm: some shapes' primitives exist before the limit
        assert post(w, {"prompt": "x" * n, "max_tokens": 2}).status_code == 200
    resource.prlimit(pid, resource.RLIMIT_AS, (vm_size(pid), resource.RLIM_INFINITY))
    try:
        limited = [post(w, {"prompt": "y" * n, "max_tokens": 2}) for n in (*lengths, 60, 310)]
    finally:
        resource.prlimit(pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert {r.status_code for r in limited} <= {200, 503}, [r.text[:200] for r in limited]
    refused = [r for r in limited if r.status_code == 503]
    assert refused, "no allocation failed under the limit"
    for r in refused:
        assert_out_of_memory(r)
    for n in (*lengths, 60, 310):  # every shape runs again, those that failed included
        r = post(w, {"prompt": "z" * n, "max_tokens": 2})
        assert r.status_code == 200, (n, r.text[:300])
    wait_for(lambda: get(w, "/readyz").status_code == 200, 10, "ready")
    assert get(w, "/healthz").status_code == 200
