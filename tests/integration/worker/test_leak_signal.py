"""The exported leak signal tells an anonymous-mmap (native) leak from a Python-heap
leak, with the test-only fault switches making each worker leak 4 MB/s."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from tests.integration.worker.conftest import WorkerProcess
from tests.integration.worker.test_worker_http import metrics

pytestmark = pytest.mark.integration
RATE = 4_000_000


def signal(w: WorkerProcess) -> dict[str, float]:
    m = metrics(w)
    out = {f"leak_{lab['kind']}": v for lab, v in m["moeguard_memory_leak_suspected"]}
    out.update({f"growth_{lab['part']}": v for lab, v in m["moeguard_memory_growth_bytes_per_second"]})
    out["blocks_growth"] = m["moeguard_python_allocated_blocks_growth_per_second"][0][1]
    return out


def test_native_and_python_heap_leaks_are_told_apart(
        start_worker: Callable[..., WorkerProcess]) -> None:
    native = start_worker(MOEGUARD_TEST_FAULTS="1", MOEGUARD_FAULT_LEAK_ANON_BYTES_PER_SECOND=str(RATE))
    heap = start_worker(MOEGUARD_TEST_FAULTS="1", MOEGUARD_FAULT_LEAK_PYTHON_BYTES_PER_SECOND=str(RATE))
    clean = start_worker()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        n, h = signal(native), signal(heap)
        if n["leak_native"] == 1 and h["leak_python_heap"] == 1:
            break
        time.sleep(0.5)
    n, h, c = signal(native), signal(heap), signal(clean)
    assert (n["leak_native"], n["leak_python_heap"]) == (1, 0), n
    assert (h["leak_native"], h["leak_python_heap"]) == (0, 1), h
    assert (c["leak_native"], c["leak_python_heap"]) == (0, 0), c
    # both grow anonymous RSS at about the fault's rate ...
    assert 0.5 * RATE < n["growth_rss_anonymous"] < 2 * RATE
    assert h["growth_rss_anonymous"] > 0.5 * RATE
    # ... but only the Python-heap leak grows the Python heap's blocks
    assert n["blocks_growth"] < 1000 < h["blocks_growth"]
    assert "event=memory_growth kind=native" in native.logs()
    assert "event=memory_growth kind=python_heap" in heap.logs()
    assert "event=fault_enabled" in native.logs()
