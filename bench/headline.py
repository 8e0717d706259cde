"""The headline experiment: three batching policies, same traffic, same memory limit, one run.

``python -m bench.headline [--reps 3] [--out bench/results/headline]`` then
``python -m bench.headline_report`` (``make bench-headline`` runs both).

Each policy is a worker process (``python -m moeguard_runtime``, the ``small`` preset) started
directly, no Kubernetes, configured only through its environment. Each worker runs in its own
cgroup-v1 memory cgroup whose ``memory.limit_in_bytes`` is the pod's memory limit (= hardLimit,
as the operator sets it): an over-limit worker is really OOM-killed by the kernel. The worker
is started in a private mount namespace where its cgroup directory is bind-mounted over
``/sys/fs/cgroup/memory``, as a container sees it, so the worker's own memory guard reads the
same figure the kernel compares (``memory.usage_in_bytes``). A killed worker is restarted after
``RESTART_DELAY_S`` (the kubelet's restart; its real back-off starts at 10 s). Where cgroups are
not writable, a watchdog kills the worker with SIGKILL when its RSS passes the hard limit.

Samples every 100 ms: the cgroup usage, process RSS, ``memory.failcnt`` (from the harness,
no worker involvement) and, every ``METRICS_EVERY`` samples, the worker's ``/metrics``:
budgets in effect, shrink factor, queue depth, running requests, overload, rejections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import run_requests
from bench.traffic import TrafficConfig, build, describe

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CGROUP_BASE = Path("/sys/fs/cgroup/memory")
MiB = 1024 * 1024
PRESET = "small"
HARD_LIMIT = 1152 * MiB
"""Chosen so that request-count batching hits it on this traffic: a first run at 1400 MiB saw its
cgroup peak at 1273 MiB (idle 797 MiB) with no kill."""
SOFT_LIMIT = 980 * MiB
"""0.85 x hard."""
SAMPLE_S = 0.1
METRICS_EVERY = 3
RESTART_DELAY_S = 1.0
REQUEST_TIMEOUT_S = 30.0
DRAIN_S = 25.0
BASE_PORT = 18600

HUGE = {"prefill": 1_048_576, "decode": 1_048_576, "requests": 65_536, "queue": 1_048_576}


QUEUE_TIMEOUT_S = float(os.environ.get("BENCH_QUEUE_TIMEOUT_S", "2"))
"""The moeguard policy's queue timeout: a request that has not started within 2 s is refused
(the trace's requests take ~1-4 s to serve here; waiting longer than that only adds latency)."""


MOEGUARD_BATCHES = int(os.environ.get("BENCH_MOEGUARD_BATCHES", "1"))
"""One batch in flight: the engine runs batches' steps in turn, so with two batches each request
decodes every other step; one batch with the plan's request count decodes every step."""
STEP_PREFILL_TOKENS = int(os.environ.get("BENCH_STEP_PREFILL_TOKENS", "256"))
"""Prefill tokens per step chosen for decode latency (chunked prefill, as vLLM's
``max_num_batched_tokens``): every step that carries a prefill chunk also carries the running
requests' decode tokens, so the chunk sets their time per output token. The plan's figure is the
memory ceiling; the policy uses the smaller of the two."""


def moeguard_env(b: dict[str, int]) -> dict[str, str]:
    """The full moeguard policy: plan budgets, concurrency cap, bounded queue, limits, overload."""
    running = MOEGUARD_BATCHES * b["max_batch_requests"]
    queue = b["max_batch_requests"]  # one batch's worth waiting: it can start within a step or two
    prefill = min(b["max_prefill_tokens"], STEP_PREFILL_TOKENS)
    return {
        "MOEGUARD_MAX_PREFILL_TOKENS": str(prefill),
        "MOEGUARD_MAX_DECODE_TOKENS": str(b["max_decode_tokens"]),
        "MOEGUARD_MAX_BATCH_REQUESTS": str(b["max_batch_requests"]),
        "MOEGUARD_MAX_CONCURRENT_BATCHES": str(MOEGUARD_BATCHES),
        "MOEGUARD_MAX_LONG_REQUESTS_PER_BATCH": "1",  # KV is planned at PLAN_CONTEXT per sequence
        "MOEGUARD_MAX_QUEUE_REQUESTS": str(queue),
        "MOEGUARD_MAX_QUEUE_TOKENS": str(8 * prefill),
        "MOEGUARD_MAX_CONCURRENT_REQUESTS": str(running + queue),
        "MOEGUARD_QUEUE_TIMEOUT_SECONDS": f"{QUEUE_TIMEOUT_S:g}",
        "MOEGUARD_SOFT_LIMIT_BYTES": str(SOFT_LIMIT),
        "MOEGUARD_HARD_LIMIT_BYTES": str(HARD_LIMIT),
        "MOEGUARD_OVERLOAD_MODE": "Auto",
    }


def policy_env(plan_budgets: dict[str, int]) -> dict[str, dict[str, str]]:
    """Environment of each policy. Everything not named here is the worker's default."""
    unbounded_queue = {
        "MOEGUARD_MAX_QUEUE_REQUESTS": str(HUGE["queue"]),
        "MOEGUARD_MAX_QUEUE_TOKENS": str(1 << 30),
        "MOEGUARD_MAX_CONCURRENT_REQUESTS": str(1 << 20),
        "MOEGUARD_QUEUE_TIMEOUT_SECONDS": "3600",
        "MOEGUARD_OVERLOAD_MODE": "Off",
        "MOEGUARD_MAX_LONG_REQUESTS_PER_BATCH": str(HUGE["requests"]),
    }
    return {
        # 1. the seed's "before": at most 16 requests per batch, no token budget, no queue bound.
        "request-count": {
            **unbounded_queue,
            "MOEGUARD_MAX_PREFILL_TOKENS": str(HUGE["prefill"]),
            "MOEGUARD_MAX_DECODE_TOKENS": str(HUGE["decode"]),
            "MOEGUARD_MAX_BATCH_REQUESTS": "16",
            "MOEGUARD_MAX_CONCURRENT_BATCHES": "2",
        },
        # 2. token budgets alone: moeguard's prefill/decode budgets (from `moeguard plan`), no
        #    request cap per batch, no concurrency cap, no queue bound, no memory limits.
        "token-budgets": {
            **unbounded_queue,
            "MOEGUARD_MAX_PREFILL_TOKENS": str(plan_budgets["max_prefill_tokens"]),
            "MOEGUARD_MAX_DECODE_TOKENS": "16",  # the request-count policy's decode width per batch
            "MOEGUARD_MAX_BATCH_REQUESTS": str(HUGE["requests"]),
            "MOEGUARD_MAX_CONCURRENT_BATCHES": "2",
        },
        # 3. full moeguard, as a platform engineer would deploy it: `moeguard plan` budgets for the
        #    soft limit and the expected context, a concurrency cap (what the batches can run plus
        #    a short queue), a bounded queue with a short timeout (a request that cannot start within
        #    QUEUE_TIMEOUT_S gets a fast 429/503 with Retry-After instead of a slow success), soft and
        #    hard memory limits, overload mode Auto.
        "moeguard": moeguard_env(plan_budgets),
    }


def cgroups_writable() -> bool:
    probe = CGROUP_BASE / f"moeguard-bench-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


@dataclass
class Worker:
    """One policy's worker process, restarted like a pod's container after an OOM kill."""

    name: str
    env: dict[str, str]
    port: int
    use_cgroup: bool
    log_path: Path
    cgroup: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    t0: float = 0.0

    def start(self) -> None:
        env = {**os.environ, **self.env, "MOEGUARD_PORT": str(self.port), "MOEGUARD_MODEL_PRESET": PRESET,
               "MOEGUARD_TORCH_THREADS": "1", "PYTHONPATH": f"{ROOT / 'runtime'}"}
        cmd = [PY, "-m", "moeguard_runtime"]
        if self.use_cgroup:
            if self.cgroup is None:
                self.cgroup = CGROUP_BASE / f"moeguard-bench-{self.name}-{os.getpid()}"
                self.cgroup.mkdir(exist_ok=True)
                (self.cgroup / "memory.limit_in_bytes").write_text(str(HARD_LIMIT))
                with contextlib.suppress(OSError):  # no swap accounting on some kernels
                    (self.cgroup / "memory.memsw.limit_in_bytes").write_text(str(HARD_LIMIT))
            script = ('echo $$ > "$1/cgroup.procs" && exec unshare --mount --propagation private '
                      'sh -c \'mount --bind "$0" /sys/fs/cgroup/memory && shift && exec "$@"\' "$@"')
            cmd = ["sh", "-c", script, "_", str(self.cgroup), str(self.cgroup), *cmd]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)
        self.events.append({"t": time.monotonic() - self.t0, "event": "start", "pid": self.proc.pid})

    def ready(self, timeout: float = 60.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc is not None and self.proc.poll() is not None:
                return False
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=1.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def oom_kills(self) -> int:
        if self.cgroup is None:
            return 0
        text = (self.cgroup / "memory.oom_control").read_text()
        m = re.search(r"oom_kill (\d+)", text)
        return int(m.group(1)) if m else 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def remove_cgroup(self) -> None:
        if self.cgroup is not None and self.cgroup.exists():
            for _ in range(50):
                try:
                    self.cgroup.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)


def _worker_pid(w: Worker) -> int | None:
    """The python process (the launcher execs into it, so the Popen pid is the worker)."""
    return w.proc.pid if w.proc is not None and w.proc.poll() is None else None


def _status_kb(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, _, rest = line.partition("{")
        labels, _, value = rest.rpartition("} ")
        if not rest:
            name, _, value = line.partition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        if name in _METRIC_KEYS:
            out[_METRIC_KEYS[name]] = v
        elif name == "moeguard_overload_active":
            out["overload"] = max(out["overload"], int(v))
        elif name == "moeguard_rejections_total":
            m = re.search(r'reason="([^"]*)"', labels)
            if m:
                out["rejections"][m.group(1)] = v
        elif name == "moeguard_batch_tokens_bucket":
            ph = re.search(r'phase="([^"]*)"', labels)
            le = re.search(r'le="([^"]*)"', labels)
            if ph and le:
                out["batch_tokens_buckets"].setdefault(ph.group(1), {})[le.group(1)] = v
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
            pid = _worker_pid(self.w)
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
                s["rss"] = _status_kb(pid, "VmRSS")
                if self.w.cgroup is not None:
                    with contextlib.suppress(OSError):
                        s["cgroup"] = int((self.w.cgroup / "memory.usage_in_bytes").read_text())
                elif s["rss"] is not None and s["rss"] > HARD_LIMIT:  # watchdog fallback
                    os.killpg(pid, signal.SIGKILL)
                    self.w.events.append({"t": t, "event": "watchdog_kill", "rss": s["rss"]})
            if i % METRICS_EVERY == 0 and pid is not None:
                try:
                    m = parse_metrics(client.get(f"http://127.0.0.1:{self.w.port}/metrics").text)
                    self.last_metrics = m
                    s.update({k: v for k, v in m.items() if k != "batch_tokens_buckets"})
                except httpx.HTTPError:
                    pass
            self.samples.append(s)
            i += 1
            self.stop_flag.wait(max(0.0, SAMPLE_S - (time.monotonic() - self.w.t0 - t)))
        self.metrics_by_life.append(self.last_metrics)
        client.close()


def run_policy(name: str, env: dict[str, str], items: list[Any], port: int, use_cgroup: bool,
               out_dir: Path, rep: int) -> dict[str, Any]:
    w = Worker(name, env, port, use_cgroup, out_dir / f"{name}-rep{rep}.log")
    w.t0 = time.monotonic()
    w.start()
    if not w.ready():
        w.stop()
        w.remove_cgroup()
        raise RuntimeError(f"worker {name} did not become ready; see {w.log_path}")
    idle = {"cgroup": int((w.cgroup / "memory.usage_in_bytes").read_text()) if w.cgroup else None,
            "rss": _status_kb(w.proc.pid, "VmRSS") if w.proc else None}
    sampler = Sampler(w, use_cgroup)
    sampler.start()
    specs = [it.spec for it in items]
    last = max(s.at_s for s in specs)
    t_traffic = time.monotonic() - w.t0
    run = asyncio.run(run_requests([f"http://127.0.0.1:{port}"], specs, model=PRESET, seed=rep,
                                   timeout_s=last + DRAIN_S, request_timeout_s=REQUEST_TIMEOUT_S,
                                   max_in_flight=512, stream=True, progress=False))
    time.sleep(0.5)
    sampler.stop_flag.set()
    sampler.join()
    failcnt = int((w.cgroup / "memory.failcnt").read_text()) if w.cgroup else None
    max_usage = int((w.cgroup / "memory.max_usage_in_bytes").read_text()) if w.cgroup else None
    oom_kills = w.oom_kills() if w.cgroup else sum(1 for e in w.events if e["event"] == "watchdog_kill")
    w.stop()
    w.remove_cgroup()
    return {
        "policy": name, "rep": rep, "env": env, "idle": idle, "t_traffic": t_traffic,
        "results": [{**r.to_dict(), "phase": it.phase, "skewed": it.skewed}
                    for r, it in zip(run.results, items, strict=True)],
        "wall_s": run.wall_s, "samples": sampler.samples, "deaths": sampler.deaths,
        "events": w.events, "oom_kills": oom_kills, "failcnt": failcnt, "max_usage_cgroup": max_usage,
        "metrics_by_life": sampler.metrics_by_life,
    }


def machine() -> dict[str, Any]:
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "gpu": "none"}


def _weights_bytes() -> int:
    sys.path.insert(0, str(ROOT / "runtime"))
    from moeguard_runtime.presets import get_preset, parameter_count

    return parameter_count(get_preset(PRESET)) * 4  # float32


def measure_idle(use_cgroup: bool, out_dir: Path) -> int:
    """The idle worker's memory as soon as it is ready (no traffic yet): start it in its memory
    cgroup, sample ``memory.usage_in_bytes`` (RSS without cgroups) for 3 s, keep the maximum.
    A worker that has served requests sits higher (the heap keeps what its steps freed, and the
    cgroup counts page cache): see ``main``."""
    w = Worker("idle", {"MOEGUARD_MAX_PREFILL_TOKENS": str(STEP_PREFILL_TOKENS)}, BASE_PORT - 1, use_cgroup,
               out_dir / "idle.log")
    w.t0 = time.monotonic()
    w.start()
    try:
        if not w.ready():
            raise RuntimeError(f"idle worker did not become ready; see {w.log_path}")
        peak = 0
        for _ in range(30):
            if w.cgroup is not None:
                peak = max(peak, int((w.cgroup / "memory.usage_in_bytes").read_text()))
            elif w.proc is not None:
                peak = max(peak, _status_kb(w.proc.pid, "VmRSS") or 0)
            time.sleep(0.1)
        return peak
    finally:
        w.stop()
        w.remove_cgroup()


def plan_budgets(overhead: int = 0) -> tuple[dict[str, int], list[tuple[str, str, str]]]:
    """The moeguard policy's budgets: `moeguard plan` for this shape, the soft limit, the measured
    runtime overhead and the expected context."""
    sys.path.insert(0, str(ROOT / "operator"))
    sys.path.insert(0, str(ROOT / "runtime"))
    from moeguard_cli.plan import PlanInput, estimate
    from moeguard_runtime.presets import get_preset

    p = estimate(PlanInput(args=get_preset(PRESET), memory_bytes=SOFT_LIMIT, dtype="float32", skew=4.0,
                           headroom=0.0, overhead_bytes=overhead or PLAN_OVERHEAD,
                           concurrent_batches=MOEGUARD_BATCHES, context_tokens=PLAN_CONTEXT))
    if not p.fits:
        raise RuntimeError("plan says the model does not fit the soft limit")
    return ({"max_prefill_tokens": p.max_prefill_tokens, "max_decode_tokens": p.max_decode_tokens,
             "max_batch_requests": p.max_batch_requests}, p.lines)


PLAN_OVERHEAD = 450 * MiB
"""Least runtime overhead (the idle worker's memory besides its weights) the plan uses: the fresh
worker measured 800 MiB of cgroup usage here (421 MiB besides its 379 MiB of weights); ``main``
measures it again each run (:func:`measure_idle`) and takes the larger figure."""
PLAN_CONTEXT = 1024
"""Expected context (prompt + max_tokens) per running sequence used to size the KV share;
above the p90 of the scaled trace's prompts plus max_tokens (676 + 32); longer requests are
what the soft limit, the long-request cap and the bounded queue are for."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a few requests per phase (a smoke test)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "headline")
    ap.add_argument("--policies", default="", help="comma-separated subset (pilot runs; the report needs all)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    use_cgroup = cgroups_writable()
    traffic = TrafficConfig()
    if args.quick:
        global DRAIN_S
        DRAIN_S = 5.0
        traffic = TrafficConfig(trace_limit=8, burst_at_s=2.0, burst_n=6, skew_at_s=3.0, skew_s=2.0,
                                ramp_at_s=5.0, ramp_s=2.0)
    items = build(traffic)
    idle = measure_idle(use_cgroup, args.out)
    weights = _weights_bytes()
    # The runtime overhead for the plan: the measured idle worker less its weights, rounded up to
    # 8 MiB, and never below PLAN_OVERHEAD (a served worker sits higher than a fresh one).
    overhead = max(PLAN_OVERHEAD, -(-(idle - weights) // (8 * MiB)) * 8 * MiB)
    budgets, plan_lines = plan_budgets(overhead)
    envs = policy_env(budgets)
    meta = {"machine": machine(), "preset": PRESET, "hard_limit": HARD_LIMIT, "soft_limit": SOFT_LIMIT,
            "limit_mechanism": "cgroup v1 memory.limit_in_bytes (kernel OOM kill)" if use_cgroup
            else "watchdog: SIGKILL when RSS > hard limit",
            "traffic": traffic.to_dict(), "phases": describe(items), "plan_budgets": budgets,
            "plan_lines": plan_lines, "plan_overhead": overhead, "idle_measured": idle, "weights_bytes": weights, "plan_context": PLAN_CONTEXT,
            "envs": envs, "reps": args.reps, "started_unix": time.time(),
            "sample_s": SAMPLE_S, "metrics_every": METRICS_EVERY, "restart_delay_s": RESTART_DELAY_S,
            "request_timeout_s": REQUEST_TIMEOUT_S, "drain_s": DRAIN_S}
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1))
    names = [n for n in envs if not args.policies or n in args.policies.split(",")]
    t_start = time.monotonic()
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotate: no policy always first
        for j, name in enumerate(order):
            t = time.monotonic()
            res = run_policy(name, envs[name], items, BASE_PORT + rep * 10 + j, use_cgroup, args.out, rep)
            (args.out / f"{name}-rep{rep}.json").write_text(json.dumps(res))
            ok = sum(1 for r in res["results"] if r["status"] == 200 and r["error"] is None)
            print(f"rep {rep} {name:<14} {time.monotonic() - t:6.1f}s ok={ok}/{len(items)} "
                  f"oom_kills={res['oom_kills']}", flush=True)
    meta["elapsed_s"] = time.monotonic() - t_start
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
