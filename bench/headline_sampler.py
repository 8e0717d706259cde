"""The headline experiment's sampler: memory every 100 ms, the worker's ``/metrics`` every few
samples, and the kubelet's restart after an OOM kill.

Samples the cgroup usage, process RSS (from the harness, no worker involvement) and, every
``METRICS_EVERY`` samples, the worker's ``/metrics``: budgets in effect, shrink factor, queue
depth, running requests, overload, rejections. A killed worker is restarted after
``RESTART_DELAY_S`` (the kubelet's restart; its real back-off starts at 10 s). Where cgroups are
not writable, a watchdog kills the worker with SIGKILL when its RSS passes the hard limit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

import httpx
from harness.metrics_text import samples

from bench.headline_policies import HARD_LIMIT
from bench.headline_worker import Worker, status_bytes

SAMPLE_S = 0.1
METRICS_EVERY = 3
RESTART_DELAY_S = 1.0

_METRIC_KEYS = {
    "moeguard_budget_max_prefill_tokens": "max_prefill_tokens",
    "moeguard_budget_max_decode_tokens": "max_decode_tokens",
    "moeguard_budget_max_batch_requests": "max_batch_requests",
    "moeguard_budget_max_concurrent_batches": "max_concurrent_batches",
    "moeguard_budget_shrink_factor": "shrink_factor",
    "moeguard_queue_requests": "queue_requests",
    "moeguard_running_requests": "running_requests",
    "moeguard_memory_limit_state": "memory_state",
}


def parse_metrics(text: str) -> dict[str, Any]:
    """The few series the experiment plots, from the worker's Prometheus text."""
    out: dict[str, Any] = {"overload": 0, "rejections": {}, "batch_tokens_buckets": {}}
    for name, labels, v in samples(text):
        if name in _METRIC_KEYS:
            out[_METRIC_KEYS[name]] = v
        elif name == "moeguard_overload_active":
            out["overload"] = max(out["overload"], int(v))
        elif name == "moeguard_rejections_total" and "reason" in labels:
            out["rejections"][labels["reason"]] = v
        elif name == "moeguard_batch_tokens_bucket" and "phase" in labels and "le" in labels:
            out["batch_tokens_buckets"].setdefault(labels["phase"], {})[labels["le"]] = v
    return out


class Sampler(threading.Thread):
    """Samples memory every 100 ms and the worker's /metrics every few samples; restarts the
    worker after it dies (OOM kill), like the kubelet."""

    def __init__(self, w: Worker, use_cgroup: bool) -> None:
        super().__init__(daemon=True)
        self.w = w
        self.use_cgroup = use_cgroup
        self.samples: list[dict[str, Any]] = []
        self.stop_flag = threading.Event()
        self.deaths: list[dict[str, Any]] = []
        self.last_metrics: dict[str, Any] = {}
        self.metrics_by_life: list[dict[str, Any]] = []

    def run(self) -> None:
        client = httpx.Client(timeout=0.5, trust_env=False)
        i = 0
        while not self.stop_flag.is_set():
            t = time.monotonic() - self.w.t0
            s: dict[str, Any] = {"t": t}
            pid = self.w.pid()
            if pid is None and self.w.proc is not None:
                rc = self.w.proc.wait()
                oom = self.w.oom_kills()
                self.deaths.append({"t": t, "returncode": rc, "oom_kills_cgroup": oom,
                                    "signal": -rc if rc < 0 else None})
                self.w.events.append({"t": t, "event": "died", "returncode": rc})
                self.metrics_by_life.append(self.last_metrics)
                self.last_metrics = {}
                time.sleep(RESTART_DELAY_S)
                self.w.start()
                continue
            if pid is not None:
                s["rss"] = status_bytes(pid, "VmRSS")
                if self.w.cgroup is not None:
                    with contextlib.suppress(OSError):
                        s["cgroup"] = self.w.cgroup_value("memory.usage_in_bytes")
                elif s["rss"] is not None and s["rss"] > HARD_LIMIT:  # watchdog fallback
                    os.killpg(pid, signal.SIGKILL)
                    self.w.events.append({"t": t, "event": "watchdog_kill", "rss": s["rss"]})
            if i % METRICS_EVERY == 0 and pid is not None:
                try:
                    m = parse_metrics(client.get(f"http://127.0.0.1:{self.w.port}/metrics").text)
                    self.last_metrics = m
                    s.update({k: v for k, v in m.items() if k != "batch_tokens_buckets"})
                except (httpx.HTTPError, ValueError):  # not up yet, or not Prometheus text
                    pass
            self.samples.append(s)
            i += 1
            self.stop_flag.wait(max(0.0, SAMPLE_S - (time.monotonic() - self.w.t0 - t)))
        self.metrics_by_life.append(self.last_metrics)
        client.close()
