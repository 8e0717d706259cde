"""Start real worker processes (``python -m moeguard_runtime``) for HTTP tests.

``start_worker(**env)`` starts one on a free loopback port, waits for
``/healthz``, and stops it at the end of the test. Reusable by other suites:
``from tests.integration.worker.conftest import WorkerProcess, start_worker_process``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[str]
    base_url: str
    log_path: Path

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_worker_process(log_dir: Path, env: dict[str, str] | None = None,
                         timeout_s: float = 90.0) -> WorkerProcess:
    """Start a worker with ``env`` added to a minimal environment; wait until its
    model is loaded (/readyz is 200, or 503 for a reason other than loading: a
    test may start one above its hard limit)."""
    port = free_port()
    full_env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": os.environ.get("HOME", "/tmp"),
        "PYTHONPATH": str(REPO / "runtime"),
        "PYTHONUNBUFFERED": "1",
        "MOEGUARD_HOST": "127.0.0.1",
        "MOEGUARD_PORT": str(port),
        "MOEGUARD_MODEL_PRESET": "tiny",
        "MOEGUARD_TORCH_THREADS": "1",
        **(env or {}),
    }
    log_path = log_dir / f"worker-{port}.log"
    log = log_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "moeguard_runtime"], cwd=REPO, env=full_env,
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    worker = WorkerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}:\n{worker.logs()}")
        try:
            r = httpx.get(f"{worker.base_url}/readyz", timeout=1)
            if r.status_code == 200 or r.text != "model is loading":
                return worker
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    worker.stop()
    raise RuntimeError(f"worker not ready after {timeout_s} s:\n{worker.logs()}")


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
