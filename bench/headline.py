"""The headline experiment: three batching policies, same traffic, same memory limit, one run.

``python -m bench.headline [--reps 3] [--out bench/results/headline]`` then
``python -m bench.headline_report`` (``make bench-headline`` runs both).

Each policy is a worker process (``python -m moeguard_runtime``, the ``small`` preset) started
directly, no Kubernetes, configured only through its environment
(:mod:`bench.headline_policies`), confined to the pod's memory limit in a cgroup and restarted
after an OOM kill (:mod:`bench.headline_worker`), and sampled every 100 ms
(:mod:`bench.headline_sampler`). This module runs them in turn and writes the raw runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from harness.loadgen import run_requests

from bench.headline_policies import (
    HARD_LIMIT,
    PLAN_CONTEXT,
    PRESET,
    SOFT_LIMIT,
    STEP_PREFILL_TOKENS,
    plan_budgets,
    plan_overhead,
    policy_env,
    weights_bytes,
)
from bench.headline_sampler import METRICS_EVERY, RESTART_DELAY_S, SAMPLE_S, Sampler
from bench.headline_worker import Worker, cgroups_writable, status_bytes
from bench.traffic import TrafficConfig, build, describe

ROOT = Path(__file__).resolve().parents[1]
REQUEST_TIMEOUT_S = 30.0
DRAIN_S = 25.0
QUICK_DRAIN_S = 5.0
BASE_PORT = 18600


def run_policy(name: str, env: dict[str, str], items: list[Any], port: int, use_cgroup: bool,
               out_dir: Path, rep: int, drain_s: float = DRAIN_S) -> dict[str, Any]:
    w = Worker(name, env, port, use_cgroup, out_dir / f"{name}-rep{rep}.log")
    w.t0 = time.monotonic()
    w.start()
    if not w.ready():
        w.stop()
        w.remove_cgroup()
        raise RuntimeError(f"worker {name} did not become ready; see {w.log_path}")
    pid = w.pid()
    idle = {"cgroup": w.cgroup_value("memory.usage_in_bytes"),
            "rss": status_bytes(pid, "VmRSS") if pid is not None else None}
    sampler = Sampler(w, use_cgroup)
    sampler.start()
    specs = [it.spec for it in items]
    last = max(s.at_s for s in specs)
    t_traffic = time.monotonic() - w.t0
    run = asyncio.run(run_requests([f"http://127.0.0.1:{port}"], specs, model=PRESET, seed=rep,
                                   timeout_s=last + drain_s, request_timeout_s=REQUEST_TIMEOUT_S,
                                   max_in_flight=512, stream=True, progress=False))
    time.sleep(0.5)
    sampler.stop_flag.set()
    sampler.join()
    failcnt = w.cgroup_value("memory.failcnt")
    max_usage = w.cgroup_value("memory.max_usage_in_bytes")
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


def measure_idle(use_cgroup: bool, out_dir: Path) -> int:
    """The idle worker's anonymous resident memory (bytes) as soon as it is ready (no traffic yet):
    start it in its memory cgroup, sample the process's ``RssAnon`` for 3 s, keep the maximum. Not the
    cgroup's ``memory.usage_in_bytes`` nor ``VmRSS``: both also count file pages (torch's shared
    libraries), which the kernel can reclaim and which a cgroup is charged for only if it touched them
    first, so the figure moved from 822 to 1,181 MiB between runs on a shared machine and a plan built on
    it was sometimes refused. A worker that has served requests sits higher (the heap keeps what its
    steps freed): see ``main``."""
    w = Worker("idle", {"MOEGUARD_MAX_PREFILL_TOKENS": str(STEP_PREFILL_TOKENS)}, BASE_PORT - 1, use_cgroup,
               out_dir / "idle.log")
    w.t0 = time.monotonic()
    w.start()
    try:
        if not w.ready():
            raise RuntimeError(f"idle worker did not become ready; see {w.log_path}")
        peak = 0
        for _ in range(30):
            if w.proc is not None:
                peak = max(peak, status_bytes(w.proc.pid, "RssAnon") or 0)
            time.sleep(0.1)
        return peak
    finally:
        w.stop()
        w.remove_cgroup()


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
    drain_s = DRAIN_S
    if args.quick:
        drain_s = QUICK_DRAIN_S
        traffic = TrafficConfig(trace_limit=8, burst_at_s=2.0, burst_n=6, skew_at_s=3.0, skew_s=2.0,
                                ramp_at_s=5.0, ramp_s=2.0)
    items = build(traffic)
    idle = measure_idle(use_cgroup, args.out)
    weights = weights_bytes()
    overhead = plan_overhead(idle, weights)
    budgets, plan_lines = plan_budgets(overhead)
    envs = policy_env(budgets)
    meta = {"machine": machine(), "preset": PRESET, "hard_limit": HARD_LIMIT, "soft_limit": SOFT_LIMIT,
            "limit_mechanism": "cgroup v1 memory.limit_in_bytes (kernel OOM kill)" if use_cgroup
            else "watchdog: SIGKILL when RSS > hard limit",
            "traffic": traffic.to_dict(), "phases": describe(items), "plan_budgets": budgets,
            "plan_lines": plan_lines, "plan_overhead": overhead, "idle_measured": idle, "weights_bytes": weights, "plan_context": PLAN_CONTEXT,
            "envs": envs, "reps": args.reps, "started_unix": time.time(),
            "sample_s": SAMPLE_S, "metrics_every": METRICS_EVERY, "restart_delay_s": RESTART_DELAY_S,
            "request_timeout_s": REQUEST_TIMEOUT_S, "drain_s": drain_s}
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1))
    names = [n for n in envs if not args.policies or n in args.policies.split(",")]
    t_start = time.monotonic()
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotate: no policy always first
        for j, name in enumerate(order):
            t = time.monotonic()
            res = run_policy(name, envs[name], items, BASE_PORT + rep * 10 + j, use_cgroup, args.out, rep,
                             drain_s)
            (args.out / f"{name}-rep{rep}.json").write_text(json.dumps(res))
            ok = sum(1 for r in res["results"] if r["status"] == 200 and r["error"] is None)
            print(f"rep {rep} {name:<14} {time.monotonic() - t:6.1f}s ok={ok}/{len(items)} "
                  f"oom_kills={res['oom_kills']}", flush=True)
    meta["elapsed_s"] = time.monotonic() - t_start
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
