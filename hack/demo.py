"""``make demo``: moeguard's main job end to end, on real input.

1. bring up the local control plane and Prometheus (``hack/cluster-up.sh``);
2. apply the CRD;
3. start the operator (``python -m moeguard_operator``);
4. apply ``examples/moeinferenceservice.yaml`` and wait for Ready
   (``hack/pod_workers.py`` backs each kwok pod with a local worker process);
5. replay the first requests of the Azure LLM conversation trace, time-compressed,
   with prompts of real text (the Python docs) at the trace's lengths, scaled to the model;
6. send a burst of repetitive prompts, which route most tokens to a few experts;
7. print the timeline: the operator's predictive policy cutting the budgets that its memory prediction says will not
   fit the soft limit (the example's request-count ceilings, then the burst's longer prompts), skew rising without
   a cut where the prediction has room, the workers applying each budget document;
8. print a summary and tear everything down (unless ``--keep``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import stack
from harness.loadgen.client import burst, replay
from harness.loadgen.records import RunResult
from harness.loadgen.stats import summarize
from harness.loadgen.text import repetitive_prompt
from harness.loadgen.trace import load_schedule

from moeguard_core.contract import METRIC_BUDGET_GENERATION, METRIC_PROCESS_RSS_BYTES
from moeguard_operator.config import POLICIES, OperatorConfig
from moeguard_operator.loop.observe import skew_query

NAMESPACE = "moeguard-demo"
NAME = "mixtral-tiny"
EXAMPLE = stack.ROOT / "examples" / "moeinferenceservice.yaml"
SHOWN = {"maxBatchRequests": "max_batch_requests", "maxPrefillTokens": "max_prefill_tokens"}
"""The budgets the timeline shows per worker: the example's prediction binds on maxBatchRequests (the KV of
maxConcurrentBatches x maxBatchRequests sequences) first."""


@dataclass
class Timeline:
    """Samples the system once a second and records every change as one line."""

    t0: float = field(default_factory=time.monotonic)
    lines: list[str] = field(default_factory=list)
    peak_rss: float = 0.0
    peak_skew: float = 0.0
    budget_changes: list[str] = field(default_factory=list)
    _last: dict[str, object] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def note(self, text: str) -> None:
        line = f"  t={time.monotonic() - self.t0:6.1f}s  {text}"
        self.lines.append(line)
        print(line, flush=True)

    def _changed(self, key: str, value: object) -> bool:
        if self._last.get(key, object()) == value:
            return False
        self._last[key] = value
        return True

    def sample(self, urls: list[str]) -> None:
        skew = stack.prom_query(skew_query(NAMESPACE, NAME, 15))
        if skew is not None and not math.isnan(skew) and self._changed("skew", round(skew, 1)):  # NaN: no batches
            self.note(f"Prometheus: max expert skew ratio over 15 s = {skew:.1f}")
            self.peak_skew = max(self.peak_skew, skew)
        adj = stack.get_moeis(NAMESPACE, NAME).get("status", {}).get("lastAdjustment")
        if adj and self._changed("cr-adjustment", adj.get("time")):  # the operator rewrites it with every change
            moved = changed_budgets(adj["from"], adj["to"])
            self.note(f"operator: status.budgets {moved} ({adj['reason']})")
            self.budget_changes.append(f"{moved} at {adj['time']}")
        for url in urls:
            gen = stack.scrape_one(url, METRIC_BUDGET_GENERATION)
            if gen is not None and self._changed(f"worker-generation-{url}", gen):
                shown = {alias: stack.scrape_one(url, f"moeguard_budget_{field}") for alias, field in SHOWN.items()}
                self.note(f"worker {url}: applies budget generation {gen:.0f} ("
                          + ", ".join(f"{k} = {v:.0f}" for k, v in shown.items() if v is not None) + ")")
            rss = stack.scrape_one(url, METRIC_PROCESS_RSS_BYTES)
            if rss:
                self.peak_rss = max(self.peak_rss, rss)

    def run(self, urls: list[str]) -> None:
        while not self._stop.is_set():
            try:
                self.sample(urls)
            except Exception as exc:  # a sampler must never stop the demo
                self.note(f"(sampler: {type(exc).__name__}: {exc})")
            self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()


def changed_budgets(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The budgets that differ, as ``name a -> b`` joined by commas."""
    return ", ".join(f"{k} {before.get(k)} -> {v}" for k, v in after.items() if before.get(k) != v) or "unchanged"


def print_summary(title: str, run: RunResult) -> None:
    s = summarize(run)
    lat = s.latency_s
    print(f"  {title}: {s.n_ok}/{s.n_requests} served, by status {s.by_status}; "
          f"latency p50/p95/p99 = {_ms(lat.get('p50'))}/{_ms(lat.get('p95'))}/{_ms(lat.get('p99'))}; "
          f"goodput {s.goodput_tok_s:.0f} tokens/s")
    for error in sorted({r.error for r in run.results if r.status is None and r.error})[:3]:
        print(f"    not answered: {error}")


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f} ms"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", action="store_true", help="leave the cluster, operator and workers running")
    p.add_argument("--requests", type=int, default=300, help="trace requests to replay")
    p.add_argument("--time-compression", type=float, default=4.0, help="trace arrival times are divided by this")
    p.add_argument("--length-scale", type=float, default=0.25, help="trace token lengths are multiplied by this")
    p.add_argument("--burst", type=int, default=48, help="repetitive prompts in the skew burst")
    p.add_argument("--policy", choices=POLICIES, default=OperatorConfig.policy,
                   help="the operator's --policy (default: %(default)s; threshold: the policy before issue 30, which "
                        "halves maxPrefillTokens on the burst's skew)")
    args = p.parse_args()
    run_dir = stack.RUN_DIR
    operator = None
    t_start = time.monotonic()
    try:
        print("[1/8] control plane and Prometheus", flush=True)
        stack.script("cluster-up.sh")
        print("[2/8] CRD", flush=True)
        stack.apply_crds()
        print("[3/8] operator", flush=True)
        operator = stack.start_operator(run_dir / "logs" / "operator.log",
                                        args=("-A", "--standalone", "--policy", args.policy))
        stack.pod_workers("start")
        print(f"[4/8] {EXAMPLE.relative_to(stack.ROOT)} in namespace {NAMESPACE}", flush=True)
        stack.kubectl("create", "namespace", NAMESPACE, check=False)
        stack.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLE))
        stack.wait_for(lambda: (stack.condition(stack.get_moeis(NAMESPACE, NAME), "Ready") or {}).get("status") == "True",
                       240, f"{NAME} Ready")
        replicas = stack.get_moeis(NAMESPACE, NAME)["spec"]["replicas"]
        urls = stack.wait_for(lambda: (u := stack.worker_urls(NAMESPACE, NAME)) and len(u) >= replicas
                              and all(stack.healthy(x) for x in u) and u, 240, "workers healthy")
        print(stack.kubectl("get", "moeis", "-n", NAMESPACE).stdout, flush=True)
        timeline = Timeline()
        sampler = threading.Thread(target=timeline.run, args=(urls,), daemon=True)
        sampler.start()

        schedule = load_schedule(time_compression=args.time_compression, length_scale=args.length_scale,
                                 max_context=1023, max_new_tokens_cap=64, limit=args.requests)
        print(f"[5/8] replaying {len(schedule.requests)} trace requests over {schedule.meta.duration_s:.0f} s "
              f"(time x1/{args.time_compression:g}, lengths x{args.length_scale:g}) on {len(urls)} workers", flush=True)
        trace_run = asyncio.run(replay(urls, schedule, progress=False, max_in_flight=64, request_timeout_s=120))
        before = stack.get_moeis(NAMESPACE, NAME)["status"]["budgets"]
        print(f"[6/8] burst of {args.burst} repetitive prompts (budgets now {json.dumps(before)})", flush=True)
        # One repeated pattern for every prompt: a batch of them routes nearly all tokens to top-k experts.
        prompts = [repetitive_prompt(512, seed=0)] * args.burst
        burst_run = asyncio.run(burst(urls, prompts, max_tokens=8, progress=False, request_timeout_s=120))
        control = stack.get_moeis(NAMESPACE, NAME)["spec"]["control"]
        settle = control["windowSeconds"] + 2 * control["queryIntervalSeconds"]
        print(f"[7/8] the operator's looks at the burst's window ({settle} s, --policy {args.policy}): the skew is "
              "high, the prompts longer", flush=True)
        time.sleep(settle)

        def applied() -> bool:  # the generation: a worker's budget gauges also carry its own soft-limit shrink
            target = stack.get_moeis(NAMESPACE, NAME)["status"].get("budgetGeneration")
            return all(stack.scrape_one(u, METRIC_BUDGET_GENERATION) == target for u in urls)

        try:
            stack.wait_for(applied, 60, "every worker to apply the budget document in status", interval=1)
        except TimeoutError as exc:
            print(f"  !! {exc}", flush=True)
        after = stack.get_moeis(NAMESPACE, NAME)["status"]["budgets"]
        skewed = f"at a peak expert skew ratio of {timeline.peak_skew:.0f} (skewThreshold {control['skewThreshold']})"
        cut = after["maxPrefillTokens"] < before["maxPrefillTokens"]
        why = (("the skew passed skewThreshold" if cut else "the skew stayed under skewThreshold")
               if args.policy == "threshold" else
               ("the predicted step did not fit" if cut else "the predicted step fits, and skew alone cuts nothing"))
        print(f"  after the burst ({args.policy} policy): {changed_budgets(before, after)}; maxPrefillTokens "
              f"{'cut' if cut else 'unchanged'} {skewed}: {why}", flush=True)
        time.sleep(2)
        timeline.stop()
        sampler.join(5)

        print("[8/8] summary", flush=True)
        print_summary("trace replay", trace_run)
        print_summary("skew burst", burst_run)
        print(f"  peak worker RSS: {timeline.peak_rss / 2**20:.0f} MiB")
        print(f"  budget changes: {len(timeline.budget_changes)} ({'; '.join(timeline.budget_changes) or 'none'})")
        for ev in stack.events(NAMESPACE, NAME):
            if ev.get("reason") in ("BudgetTightened", "BudgetRelaxed", "MetricsUnavailable", "UnknownModelPreset"):
                print(f"  event {ev['type']} {ev['reason']}: {ev['message']}")
        print(f"  demo took {time.monotonic() - t_start:.0f} s")
        return 0 if timeline.budget_changes else 1
    finally:
        if not args.keep:
            print("tearing down (pass --keep to leave it running)", flush=True)
            stack.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
            if operator is not None:
                stack.stop_process(operator)
            try:
                stack.pod_workers("stop")
            finally:
                stack.script("cluster-down.sh")


if __name__ == "__main__":
    raise SystemExit(main())
