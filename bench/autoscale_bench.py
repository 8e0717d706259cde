"""Replica autoscaling over 10 minutes under a load step (issue 30, item 5): replica counts, signals and Events.

Not run by the test suite (nor yet by anyone: written with the autoscaler, to be run where the machine is free).
On the local control plane (``hack/cluster-up.sh``), the real Prometheus, the kwok pod harness and one operator
(``--policy threshold``), one MoEInferenceService with ``spec.autoscaling`` (1..3 replicas, the default 30-s up and
a 120-s down window) is sent no load for ``--calm-before-s``, then ``--threads`` concurrent clients for
``--load-s`` spread round-robin over every ready worker (unlike the e2e test, the new replicas take load), then
no load again until ``--duration-s`` (600 s by default). Every ``--sample-s`` it records
``status.autoscaling`` (desired replicas, attainment, queue per replica, recommendation, reason), the Deployment's
replica count and the ready replicas; at the end, the ScaledUp / ScaledDown / ScaleUpRefused Events.

The summary counts the replica changes and their *reversals* (a change in the direction opposite to the previous
one within ``--reversal-window-s``: oscillation), the time from the load step to the first ScaledUp and from the
load's end to the first ScaledDown.

What a 2-core machine cannot show: that more replicas add capacity. Every worker process shares the same two cores,
so a second replica halves each one's CPU share and the SLO attainment under the same load does not recover by
scaling out (on a real cluster each replica brings its own node's CPUs or GPUs); the load step's end is what
brings calm here. The replica decisions, their timing against the windows and the absence of oscillation are
what this run measures.

Usage: ``.venv/bin/python -m bench.autoscale_bench [--out bench/results/autoscale]``
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from itertools import count, pairwise
from pathlib import Path
from typing import Any

import httpx
from harness import control_plane as cp
from harness import stack
from harness.loadgen.text import prompt_of_length

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "bench-autoscale"
NAME = "auto"
SPEC: dict[str, Any] = {
    "model": {"preset": "tiny"}, "replicas": 1,
    "resources": {"gpus": 0, "softLimit": "3Gi", "hardLimit": "4Gi"},
    "batching": {"maxPrefillTokens": 2048, "maxDecodeTokens": 64, "maxBatchRequests": 16, "maxConcurrentBatches": 2},
    "control": {"queryIntervalSeconds": 5, "windowSeconds": 30},
    "slo": {"interactive": {"ttftSeconds": 1.0, "tpotSeconds": 0.25, "attainment": 0.9}, "minRequests": 10},
    "autoscaling": {"minReplicas": 1, "maxReplicas": 3, "scaleUpStabilizationSeconds": 30,
                    "scaleDownStabilizationSeconds": 120, "queueRequestsPerReplica": 4},
}


class Load(threading.Thread):
    """``threads`` clients sending completions round-robin over the ready workers until stopped."""

    def __init__(self, threads: int) -> None:
        super().__init__(daemon=True)
        self.threads, self.halt, self.answered, self.sent = threads, threading.Event(), 0, 0
        self._lock = threading.Lock()
        self._next = count()

    def _urls(self) -> list[str]:
        return [u for u in cp.workers(NAMESPACE, NAME).values() if stack.healthy(u)]

    def _client(self) -> None:
        with httpx.Client(timeout=120, trust_env=False) as client:
            urls: list[str] = []
            while not self.halt.is_set():
                i = next(self._next)
                if i % 20 == 0 or not urls:
                    urls = self._urls() or urls
                if not urls:
                    time.sleep(0.5)
                    continue
                try:
                    r = client.post(f"{urls[i % len(urls)]}/v1/completions", json={
                        "model": "tiny", "prompt": prompt_of_length(300, offset=97 * i), "max_tokens": 8})
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                with self._lock:
                    self.sent += 1
                    self.answered += ok

    def run(self) -> None:
        clients = [threading.Thread(target=self._client, daemon=True) for _ in range(self.threads)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()


def sample(t0: float) -> dict[str, Any]:
    obj = stack.get_moeis(NAMESPACE, NAME)
    status = obj.get("status") or {}
    auto = status.get("autoscaling") or {}
    dep = stack.kubectl_json("-n", NAMESPACE, "get", "deployment", f"{NAME}-worker")
    return {"t": round(time.monotonic() - t0, 1), "desired": auto.get("desiredReplicas"),
            "deployment": dep["spec"].get("replicas"), "ready": status.get("readyReplicas"),
            "attainment": auto.get("attainment"), "queue": auto.get("queueRequestsPerReplica"),
            "recommendation": auto.get("recommendation"), "reason": auto.get("reason"),
            "refused": auto.get("scaleUpRefused")}


def summarize(samples: list[dict[str, Any]], events: list[dict[str, Any]], load_from: float, load_to: float,
              reversal_window_s: float) -> dict[str, Any]:
    """Replica changes, reversals within ``reversal_window_s`` and the reaction times (pure)."""
    changes = [(b["t"], b["desired"] - a["desired"]) for a, b in pairwise(samples)
               if a["desired"] is not None and b["desired"] is not None and b["desired"] != a["desired"]]
    reversals = sum(1 for (t1, d1), (t2, d2) in pairwise(changes)
                    if d1 * d2 < 0 and t2 - t1 < reversal_window_s)
    first_up = next((t for t, d in changes if d > 0 and t >= load_from), None)
    first_down = next((t for t, d in changes if d < 0 and t >= load_to), None)
    return {"changes": changes, "reversals": reversals,
            "up_after_load_s": None if first_up is None else round(first_up - load_from, 1),
            "down_after_calm_s": None if first_down is None else round(first_down - load_to, 1),
            "max_replicas_seen": max((s["desired"] or 0) for s in samples) if samples else None,
            "events": [(e.get("type"), e.get("reason"), e.get("message")) for e in events
                       if e.get("reason") in ("ScaledUp", "ScaledDown", "ScaleUpRefused")]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=600)
    ap.add_argument("--calm-before-s", type=float, default=60)
    ap.add_argument("--load-s", type=float, default=240)
    ap.add_argument("--threads", type=int, default=24)
    ap.add_argument("--sample-s", type=float, default=2)
    ap.add_argument("--reversal-window-s", type=float, default=120)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "autoscale")
    ap.add_argument("--keep-cluster", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cp.cluster_up()
    stack.pod_workers("start")
    operator = cp.start_operator(stack.RUN_DIR / "logs" / "bench-operator-autoscale.log", ("--policy", "threshold"))
    cp.delete_namespace(NAMESPACE)
    cp.create_namespace(NAMESPACE)
    samples: list[dict[str, Any]] = []
    load = Load(args.threads)
    try:
        cp.start_service(NAMESPACE, NAME, SPEC, timeout_s=300)
        t0 = time.monotonic()
        load_from, load_to = args.calm_before_s, args.calm_before_s + args.load_s
        while (now := time.monotonic() - t0) < args.duration_s:
            if now >= load_from and not load.is_alive() and not load.halt.is_set():
                load.start()
            if now >= load_to and not load.halt.is_set():
                load.halt.set()
            samples.append(sample(t0))
            time.sleep(args.sample_s)
        load.halt.set()
        events = stack.events(NAMESPACE, NAME)
        summary = summarize(samples, events, load_from, load_to, args.reversal_window_s)
        summary.update(sent=load.sent, answered=load.answered, spec=SPEC, args={k: str(v) for k, v in vars(args).items()})
        (args.out / "samples.json").write_text(json.dumps(samples, indent=1))
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps({k: summary[k] for k in ("changes", "reversals", "up_after_load_s", "down_after_calm_s",
                                                  "max_replicas_seen", "sent", "answered")}))
    finally:
        load.halt.set()
        cp.stop_service(NAMESPACE, NAME)
        cp.delete_namespace(NAMESPACE)
        stack.stop_process(operator)
        stack.pod_workers("stop")
        if not args.keep_cluster:
            stack.script("cluster-down.sh")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
