"""A worker process (``python -m moeguard_runtime``) started from the checkout for a benchmark.

``start_worker_process`` starts one on a free loopback port in a minimal environment and waits
until its model is loaded; ``wait_ready`` and ``stop_process`` are shared with the headline
experiment's cgroup-confined workers (:mod:`bench.headline_worker`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_ready(r: httpx.Response) -> bool:
    """``/readyz`` is 200: the model is loaded and the worker is below its hard limit."""
    return r.status_code == 200


def is_loaded(r: httpx.Response) -> bool:
    """The model is loaded (``/readyz`` is 200, or 503 for another reason than loading: a test
    may start a worker above its hard limit)."""
    return r.status_code == 200 or r.text != "model is loading"


def wait_ready(base_url: str, proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout_s: float,
               done: Callable[[httpx.Response], bool] = is_ready) -> str | None:
    """Poll ``/readyz`` until ``done``; None then, else why not (the process exited, or time ran out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"worker exited with {proc.returncode}"
        try:
            if done(httpx.get(f"{base_url}/readyz", timeout=1.0)):
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return f"worker not ready after {timeout_s:g} s"


def stop_process(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout_s: float = 10,
                 group: bool = False) -> None:
    """SIGTERM (to its process group when ``group``: it was started with ``start_new_session``),
    then SIGKILL after ``timeout_s``."""
    if proc.poll() is not None:
        return

    def send(sig: int) -> None:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)

    send(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(10)


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[str]
    base_url: str
    log_path: Path

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.proc)


def start_worker_process(log_dir: Path, env: dict[str, str] | None = None,
                         timeout_s: float = 90.0,
                         wrap: Callable[[list[str]], list[str]] | None = None) -> WorkerProcess:
    """Start a ``tiny`` worker with ``env`` added to a minimal environment; wait until its model
    is loaded. ``wrap``: the command line made into the one to run (``hack.memcg.MemoryCgroup.wrap``:
    started inside a memory cgroup, as a pod's container).

    Raises:
        RuntimeError: the worker exited or did not load in time (with its log).
    """
    port = int((env or {}).get("MOEGUARD_PORT") or free_port())  # a given port: a worker started again on it
    full_env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": os.environ.get("HOME", "/tmp"),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "core")]),
        "PYTHONUNBUFFERED": "1",
        "MOEGUARD_HOST": "127.0.0.1",
        "MOEGUARD_PORT": str(port),
        "MOEGUARD_MODEL_PRESET": "tiny",
        "MOEGUARD_TORCH_THREADS": "1",
        **(env or {}),
    }
    log_path = log_dir / f"worker-{port}.log"
    with log_path.open("w") as log:
        cmd = [sys.executable, "-m", "moeguard_runtime"]
        proc = subprocess.Popen(wrap(cmd) if wrap else cmd, cwd=ROOT, env=full_env,
                                stdout=log, stderr=subprocess.STDOUT, text=True)
    worker = WorkerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    why = wait_ready(worker.base_url, proc, timeout_s, is_loaded)
    if why is not None:
        worker.stop()
        raise RuntimeError(f"{why}:\n{worker.logs()}")
    return worker
