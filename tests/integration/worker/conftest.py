"""Start real worker processes (``python -m moeguard_runtime``) for HTTP tests.

``start_worker(**env)`` starts one on a free loopback port, waits for
``/readyz``, and stops it at the end of the test. The launcher is the benchmarks' own
(:mod:`harness.worker_process`): one implementation for tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness.worker_process import WorkerProcess, free_port, start_worker_process

__all__ = ["WorkerProcess", "free_port", "start_worker_process"]


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Factory: ``start_worker(MOEGUARD_MAX_CONCURRENT_REQUESTS="1", ...)``."""
    started: list[WorkerProcess] = []

    def start(**env: str) -> WorkerProcess:
        w = start_worker_process(tmp_path, env)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """One shared worker with identity labels set, for read-mostly tests."""
    w = start_worker_process(tmp_path_factory.mktemp("worker"), {
        "MOEGUARD_SERVICE_NAME": "demo", "MOEGUARD_NAMESPACE": "ns-test",
        "MOEGUARD_POD_NAME": "demo-0", "MOEGUARD_SEED": "3",
    })
    yield w
    w.stop()
