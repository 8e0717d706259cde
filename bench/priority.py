"""Interactive first (issue 13 §3): interactive latency at twice the worker's capacity, half the requests batch.

``python -m bench.priority [--reps 3]`` (``make bench-priority``) writes ``bench/results/priority.json`` and
renders ``bench/results/priority.md`` from it (``--render`` renders again from the JSON alone).

Two worker processes (``python -m moeguard_runtime``, :data:`PRESET`, one torch thread each), the same budgets
(:data:`BUDGETS`), started once and served over real HTTP on loopback by the load generator
(:mod:`harness.loadgen`, streaming, so TTFT is the first token's arrival at the client):

* ``priority``: ``MOEGUARD_SCHEDULING_POLICY=priority`` (this issue's mechanism: class order, preemption of
  running batch requests with their KV cache kept, strict priority per step, batch shed at full caps) with
  ``MOEGUARD_MAX_BATCH_STEP_TOKENS`` = :data:`BATCH_STEP_TOKENS`;
* ``fcfs``: ``MOEGUARD_SCHEDULING_POLICY=fcfs``, the behaviour before (arrival order; only overload mode
  moves interactive requests ahead).

Each repetition, arms interleaved (their order alternates between repetitions) so that their figures are side by
side under the same machine state:

1. **capacity**, measured on the ``fcfs`` worker (the engine's plain throughput, arrival order, full batches):
   :data:`CAPACITY_REQUESTS` requests of the 50/50 mix, all sent at once with at most as many in flight as the
   worker has batch slots (a closed loop that keeps every slot busy); capacity = requests completed between the
   10th and the 90th percentile of their end times divided by that interval (steady state: the ramp and the tail
   are left out), in requests per second;
2. per arm, **unloaded**: :data:`UNLOADED_REQUESTS` interactive requests one after another (nothing else in the
   worker), the same prompts as the loaded phase's interactive requests;
3. per arm, **loaded**: Poisson arrivals at twice that capacity for ``--seconds``, each request interactive or
   batch with probability 1/2; the same seeded schedule for both arms within a repetition; then the backlog
   drains. Nothing is retried.

Figures per arm and class: p50/p95 TTFT and end-to-end latency (send to last byte) of the requests answered in
full, refusals by HTTP status and reason (``error.code``, including SSE error events after a 200), and the
interactive ratios loaded p95 / unloaded p95 of the same arm and repetition. The report gives medians over the
repetitions; the headline is the ``priority`` arm's median interactive TTFT ratio (target <= 1.5, with batch
absorbing the refusals), with the latency ratio beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from harness.loadgen import RequestSpec, run_requests
from harness.loadgen.text import prompt_of_length
from harness.metrics_text import samples_named
from harness.worker_process import WorkerProcess, start_worker_process

from bench.headline import machine
from bench.slo import percentile

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PRESET = "small"
BUDGETS = {"MOEGUARD_MAX_PREFILL_TOKENS": "512", "MOEGUARD_MAX_DECODE_TOKENS": "64",
           "MOEGUARD_MAX_BATCH_REQUESTS": "8", "MOEGUARD_MAX_CONCURRENT_BATCHES": "2",
           "MOEGUARD_MAX_QUEUE_REQUESTS": "16", "MOEGUARD_QUEUE_TIMEOUT_SECONDS": "30"}
"""The same for both arms; overload mode stays ``Auto`` (the default), as deployed."""
SLOTS = 8 * 2
"""Batch slots: ``max_batch_requests`` x ``max_concurrent_batches``."""
BATCH_STEP_TOKENS = 16
"""``MOEGUARD_MAX_BATCH_STEP_TOKENS`` of the ``priority`` arm: a batch step of 16 tokens costs about a third
of an interactive request's prefill step on this CPU (single-repetition pilots: with 32, the TTFT ratio was 1.67×;
with 16, 1.33×)."""
ARMS: dict[str, dict[str, str]] = {
    "priority": {"MOEGUARD_SCHEDULING_POLICY": "priority", "MOEGUARD_MAX_BATCH_STEP_TOKENS": str(BATCH_STEP_TOKENS)},
    "fcfs": {"MOEGUARD_SCHEDULING_POLICY": "fcfs"},
}


@dataclass(frozen=True)
class Kind:
    """One class of request: prompt and output lengths, tokens (ASCII text: a byte is a token)."""

    priority: str
    prompt_tokens: int
    max_tokens: int


INTERACTIVE = Kind("interactive", 64, 16)
"""A chat turn: a short prompt, a short answer."""
BATCH = Kind("batch", 384, 128)
"""Offline work: a longer document, a longer output."""
TARGET_RATIO = 1.5
CAPACITY_REQUESTS = 48
UNLOADED_REQUESTS = 20
PROMPTS = 64
"""Distinct interactive prompts (corpus offsets), shared by the unloaded and loaded phases."""
REQUEST_TIMEOUT_S = 90.0


def prompt(kind: Kind, i: int) -> str:
    """Real text of exactly ``kind.prompt_tokens`` bytes; interactive prompts cycle over :data:`PROMPTS`."""
    n = i % PROMPTS if kind is INTERACTIVE else i
    return prompt_of_length(kind.prompt_tokens, offset=(n * 7919 + (0 if kind is INTERACTIVE else 500_000)))


def spec(kind: Kind, i: int, at_s: float = 0.0) -> RequestSpec:
    return RequestSpec(prompt(kind, i), kind.max_tokens, at_s, kind.priority)


def poisson_mix(rate: float, seconds: float, seed: int) -> list[tuple[Kind, float]]:
    """Arrivals of a Poisson process at ``rate`` per second over ``seconds``, each interactive or batch with
    probability 1/2 (seeded: both arms of a repetition get the same schedule)."""
    rng = random.Random(seed)
    out: list[tuple[Kind, float]] = []
    t = rng.expovariate(rate)
    while t < seconds:
        out.append((INTERACTIVE if rng.random() < 0.5 else BATCH, t))
        t += rng.expovariate(rate)
    return out


# --- pure summaries (unit-tested) ----------------------------------------------------------------------------------

def answered(r: dict[str, Any]) -> bool:
    """A 2xx read to its end without an error event."""
    status = r.get("status")
    return status is not None and 200 <= int(status) < 300 and r.get("error") is None and r.get("end_s") is not None


def outcome(r: dict[str, Any]) -> str:
    """``ok``, or ``<status> <code>`` for a refusal (``200 <code>``: an SSE error event after the 200)."""
    if answered(r):
        return "ok"
    return f"{r.get('status')} {r.get('code') or (r.get('error') or 'error')[:40]}"


def class_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per class: sent, answered, p50/p95 TTFT and latency (seconds) of the answered, outcomes of the rest."""
    ok = [r for r in records if answered(r)]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    latency = [r["latency_s"] for r in ok if r.get("latency_s") is not None]
    return {"sent": len(records), "answered": len(ok),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "latency_p50_s": percentile(latency, 50), "latency_p95_s": percentile(latency, 95),
            "refused": dict(sorted(Counter(outcome(r) for r in records if not answered(r)).items())),
            "completion_tokens": sum(int(r.get("completion_tokens") or 0) for r in ok)}


def steady_throughput(end_times: Sequence[float]) -> float | None:
    """Requests per second between the 10th and 90th percentile of ``end_times`` (the ramp and the tail left
    out); None with fewer than 5 or a zero interval."""
    if len(end_times) < 5:
        return None
    lo, hi = percentile(end_times, 10), percentile(end_times, 90)
    assert lo is not None and hi is not None
    inside = sum(1 for t in end_times if lo <= t <= hi)
    return (inside - 1) / (hi - lo) if hi > lo else None


def ratio(loaded: float | None, unloaded: float | None) -> float | None:
    return loaded / unloaded if loaded is not None and unloaded else None


def median(values: Sequence[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def aggregate(reps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repetitions, per arm: each class's loaded figures, the unloaded interactive figures, the
    ratios, and the refusals summed."""
    out: dict[str, Any] = {"capacity_rps": median([r["capacity_rps"] for r in reps])}
    for arm in ARMS:
        runs = [r["arms"][arm] for r in reps]
        a: dict[str, Any] = {"unloaded": {k: median([x["unloaded"][k] for x in runs])
                                          for k in ("ttft_p50_s", "ttft_p95_s", "latency_p50_s", "latency_p95_s")}}
        for cls in ("interactive", "batch"):
            a[cls] = {k: median([x["loaded"][cls][k] for x in runs])
                      for k in ("ttft_p50_s", "ttft_p95_s", "latency_p50_s", "latency_p95_s")}
            refused: Counter[str] = Counter()
            for x in runs:
                refused.update(x["loaded"][cls]["refused"])
            a[cls]["sent"] = sum(x["loaded"][cls]["sent"] for x in runs)
            a[cls]["answered"] = sum(x["loaded"][cls]["answered"] for x in runs)
            a[cls]["refused"] = dict(sorted(refused.items()))
        a["ttft_ratio"] = median([x["ttft_ratio"] for x in runs])
        a["latency_ratio"] = median([x["latency_ratio"] for x in runs])
        a["ttft_ratios"] = [x["ttft_ratio"] for x in runs]
        a["latency_ratios"] = [x["latency_ratio"] for x in runs]
        a["goodput_rps"] = median([x["goodput_rps"] for x in runs])
        a["mean_step_s"] = median([x.get("mean_step_s") for x in runs])
        worker: Counter[str] = Counter()
        for x in runs:
            worker.update({k: v for k, v in x.get("worker", {}).items() if "step_duration" not in k})
        a["worker"] = dict(sorted(worker.items()))
        out[arm] = a
    return out


# --- the run ------------------------------------------------------------------------------------------------------

def idle(w: WorkerProcess, timeout_s: float = 120.0) -> None:
    """Wait until the worker has nothing queued or running (the previous phase's backlog drained)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{w.base_url}/metrics", timeout=10).text
        busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("moeguard_queue_requests{", "moeguard_running_requests{")))
        if busy == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"worker {w.base_url} still busy after {timeout_s:g} s")


WORKER_COUNTS = (("moeguard_preemptions_total", "priority"), ("moeguard_priority_rejections_total", "reason"),
                 ("moeguard_step_duration_seconds_count", ""), ("moeguard_step_duration_seconds_sum", ""))
"""The worker's own counts kept per loaded phase (their increase): preemptions, refusals by class and reason,
engine steps and their total seconds."""


def worker_counts(w: WorkerProcess) -> dict[str, float]:
    """``name{label=value,...}`` -> value for :data:`WORKER_COUNTS` (identity labels left out)."""
    out: dict[str, float] = {}
    text = httpx.get(f"{w.base_url}/metrics", timeout=10).text
    for name, _ in WORKER_COUNTS:
        for labels, v in samples_named(text, name):
            key = ",".join(f"{k}={labels[k]}" for k in ("priority", "reason") if k in labels)
            out[f"{name}{{{key}}}" if key else name] = v
    return out


def increase(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def send(w: WorkerProcess, specs: Sequence[RequestSpec], max_in_flight: int, seed: int) -> list[dict[str, Any]]:
    run = asyncio.run(run_requests([w.base_url], specs, model=PRESET, temperature=0.0, seed=seed, stream=True,
                                   max_in_flight=max_in_flight, request_timeout_s=REQUEST_TIMEOUT_S,
                                   progress=False))
    idle(w)
    return [r.to_dict() for r in run.results]


def measure_capacity(w: WorkerProcess, seed: int) -> float:
    specs = [spec(INTERACTIVE if i % 2 == 0 else BATCH, 1000 + i) for i in range(CAPACITY_REQUESTS)]
    records = send(w, specs, SLOTS, seed)
    rps = steady_throughput([r["end_s"] for r in records if answered(r)])
    if rps is None:
        raise RuntimeError(f"capacity not measurable: {Counter(outcome(r) for r in records)}")
    return rps


def run_arm(w: WorkerProcess, schedule: list[tuple[Kind, float]], seed: int) -> dict[str, Any]:
    unloaded = send(w, [spec(INTERACTIVE, i) for i in range(UNLOADED_REQUESTS)], 1, seed)
    counters = {INTERACTIVE.priority: 0, BATCH.priority: 0}
    specs = []
    for kind, at in schedule:
        specs.append(spec(kind, counters[kind.priority], at))
        counters[kind.priority] += 1
    t0, before = time.monotonic(), worker_counts(w)
    records = send(w, specs, 512, seed)
    wall, counts = time.monotonic() - t0, increase(before, worker_counts(w))
    by_class = {cls: class_summary([r for (kind, _), r in zip(schedule, records, strict=True)
                                    if kind.priority == cls]) for cls in ("interactive", "batch")}
    u = class_summary(unloaded)
    steps = counts.get("moeguard_step_duration_seconds_count", 0.0)
    return {"unloaded": u, "loaded": by_class, "loaded_wall_s": wall, "worker": counts,
            "mean_step_s": counts.get("moeguard_step_duration_seconds_sum", 0.0) / steps if steps else None,
            "ttft_ratio": ratio(by_class["interactive"]["ttft_p95_s"], u["ttft_p95_s"]),
            "latency_ratio": ratio(by_class["interactive"]["latency_p95_s"], u["latency_p95_s"]),
            "goodput_rps": sum(c["answered"] for c in by_class.values()) / max(schedule[-1][1], 1e-9)}


def run(reps: int, seconds: float, log_dir: Path) -> dict[str, Any]:
    workers = {arm: start_worker_process(log_dir, {"MOEGUARD_MODEL_PRESET": PRESET, **BUDGETS, **env},
                                         timeout_s=300) for arm, env in ARMS.items()}
    try:
        for w in workers.values():  # warm-up: the first steps of a process are slower (allocator, oneDNN)
            send(w, [spec(BATCH, 9000 + i) for i in range(SLOTS)], SLOTS, 0)
        out = []
        for rep in range(reps):
            capacity = measure_capacity(workers["fcfs"], rep)
            rate = 2 * capacity
            schedule = poisson_mix(rate, seconds, seed=rep)
            order = list(ARMS) if rep % 2 == 0 else list(reversed(ARMS))
            arms = {}
            for arm in order:
                arms[arm] = run_arm(workers[arm], schedule, rep)
                print(f"rep {rep} {arm}: ttft ratio {arms[arm]['ttft_ratio']}, latency ratio "
                      f"{arms[arm]['latency_ratio']}, {arms[arm]['loaded']}", file=sys.stderr, flush=True)
            out.append({"rep": rep, "capacity_rps": capacity, "offered_rps": rate, "requests": len(schedule),
                        "order": order, "arms": arms})
        return {"reps": out}
    finally:
        for w in workers.values():
            w.stop()


# --- the report --------------------------------------------------------------------------------------------------

def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.0f} ms"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _refusals(refused: dict[str, int]) -> str:
    return ", ".join(f"{n} × {k}" for k, n in refused.items()) or "none"


def verdict(value: float | None) -> str:
    if value is None:
        return "**not measured**"
    return "**met**" if value <= TARGET_RATIO else "**missed**"


def render(doc: dict[str, Any]) -> str:
    """The Markdown report, from the JSON alone."""
    cfg, agg = doc["config"], doc["aggregate"]
    p, f = agg["priority"], agg["fcfs"]
    lines = [
        "# Interactive first: interactive latency at 2× capacity, 50/50 with batch (issue 13 §3)",
        "",
        f"Generated by {doc.get('generated_by', '`make bench-priority` (`python -m bench.priority`)')} on {doc['date']}; "
        f"{doc['machine']['cpu']}, {doc['machine']['cores']} cores, torch {doc['machine']['torch']}. "
        f"{cfg['reps']} repetitions, arms interleaved; figures are medians over the repetitions.",
        "",
        "## Headline",
        "",
        f"- **Interactive p95 TTFT at 2× capacity / unloaded p95 TTFT, `priority` arm: {_x(p['ttft_ratio'])}** "
        f"(target ≤ {TARGET_RATIO}×: {verdict(p['ttft_ratio'])}; per repetition "
        f"{', '.join(_x(v) for v in p['ttft_ratios'])}). TTFT is the headline: an interactive user waits for the "
        "first token." + (" **Provisional: fewer than three repetitions (see Notes).**" if cfg["reps"] < 3 else ""),
        f"- End-to-end latency, same ratio: {_x(p['latency_ratio'])} ({verdict(p['latency_ratio'])}; per repetition "
        f"{', '.join(_x(v) for v in p['latency_ratios'])}).",
        f"- Interactive refusals: {_refusals(p['interactive']['refused'])} of {p['interactive']['sent']} sent; "
        f"batch refusals: {_refusals(p['batch']['refused'])} of {p['batch']['sent']} sent.",
        f"- The behaviour before (`fcfs`), same load, same run: TTFT ratio {_x(f['ttft_ratio'])}, latency ratio "
        f"{_x(f['latency_ratio'])}; interactive refusals {_refusals(f['interactive']['refused'])} of "
        f"{f['interactive']['sent']}.",
        "",
        "## Figures (medians over repetitions; latency = send to last byte; refusals summed)",
        "",
        "| arm | class | TTFT p50 | TTFT p95 | latency p50 | latency p95 | answered / sent | refused (status reason) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, a in (("priority", p), ("fcfs", f)):
        u = a["unloaded"]
        lines.append(f"| {arm} | interactive, unloaded | {_ms(u['ttft_p50_s'])} | {_ms(u['ttft_p95_s'])} | "
                     f"{_ms(u['latency_p50_s'])} | {_ms(u['latency_p95_s'])} | — | — |")
        for cls in ("interactive", "batch"):
            c = a[cls]
            lines.append(f"| {arm} | {cls}, 2× capacity | {_ms(c['ttft_p50_s'])} | {_ms(c['ttft_p95_s'])} | "
                         f"{_ms(c['latency_p50_s'])} | {_ms(c['latency_p95_s'])} | {c['answered']} / {c['sent']} | "
                         f"{_refusals(c['refused'])} |")
    for arm, a in (("priority", p), ("fcfs", f)):
        counts = ", ".join(f"`{k}` {v:g}" for k, v in a.get("worker", {}).items()) or "none"
        lines.append(f"\nWorker counts in the loaded phases, `{arm}` (summed over repetitions): {counts}; "
                     f"mean engine step {_ms(a.get('mean_step_s'))}.")
    lines += [
        "",
        "| repetition | capacity (req/s) | offered (req/s) | requests | arm order | priority: TTFT / latency ratio | "
        "fcfs: TTFT / latency ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["reps"]:
        lines.append(f"| {r['rep']} | {r['capacity_rps']:.2f} | {r['offered_rps']:.2f} | {r['requests']} | "
                     f"{', '.join(r['order'])} | {_x(r['arms']['priority']['ttft_ratio'])} / "
                     f"{_x(r['arms']['priority']['latency_ratio'])} | {_x(r['arms']['fcfs']['ttft_ratio'])} / "
                     f"{_x(r['arms']['fcfs']['latency_ratio'])} |")
    lines += [
        "",
        "## How it was measured",
        "",
        f"- Worker: `python -m moeguard_runtime`, preset `{cfg['preset']}`, 1 torch thread, CPU; budgets "
        f"{', '.join(f'`{k}={v}`' for k, v in cfg['budgets'].items())}; overload mode `Auto` (the default). "
        f"Arms: {'; '.join(f'`{a}`: ' + ', '.join(f'`{k}={v}`' for k, v in env.items()) for a, env in cfg['arms'].items())}.",
        f"- Requests: interactive {cfg['interactive']['prompt_tokens']}-token prompts, "
        f"`max_tokens` {cfg['interactive']['max_tokens']}; batch {cfg['batch']['prompt_tokens']}-token prompts, "
        f"`max_tokens` {cfg['batch']['max_tokens']}; greedy, streamed (`stream: true`), real text; the class in the "
        "body's `priority`. The load generator runs on the same machine (loopback HTTP).",
        f"- Capacity, each repetition, on the `fcfs` worker: {cfg['capacity_requests']} requests of the 50/50 mix "
        f"sent at once with at most {cfg['slots']} in flight (its batch slots, a closed loop); capacity = requests "
        "completed between the 10th and 90th percentile of their end times / that interval.",
        f"- Unloaded: {cfg['unloaded_requests']} interactive requests one after another, the same prompts as the "
        f"loaded phase's. Loaded: Poisson arrivals at 2× capacity for {cfg['seconds']:g} s, each interactive or "
        "batch with probability 1/2, the same seeded schedule for both arms; then the backlog drains. Nothing is "
        "retried.",
        "- Ratios are per repetition (loaded p95 over the same arm's unloaded p95 of that repetition), then the "
        "median. TTFT and latency percentiles are over the requests answered in full; refusals are listed beside.",
        "",
    ]
    notes = doc.get("notes")
    if notes:
        lines += ["## Notes", "", *notes, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the loaded phase's arrivals")
    ap.add_argument("--out", type=Path, default=RESULTS / "priority.json")
    ap.add_argument("--render", action="store_true", help="render the Markdown from the JSON only")
    ap.add_argument("--note", action="append", default=[],
                    help="with --render: a reading of the figures to keep in the JSON's notes and the report")
    args = ap.parse_args(argv)
    md = args.out.with_suffix(".md")
    if args.render:
        doc = json.loads(args.out.read_text())
        if args.note:
            doc["notes"] = [*doc.get("notes", []), *(f"- {n}" for n in args.note)]
            args.out.write_text(json.dumps(doc, indent=1) + "\n")
        md.write_text(render(doc))
        return 0
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="moeguard-bench-priority-") as tmp:
        result = run(args.reps, args.seconds, Path(tmp))
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "wall_s": time.time() - started,
        "machine": machine(),
        "config": {"preset": PRESET, "budgets": BUDGETS, "arms": ARMS, "slots": SLOTS, "reps": args.reps,
                   "seconds": args.seconds, "capacity_requests": CAPACITY_REQUESTS,
                   "unloaded_requests": UNLOADED_REQUESTS, "interactive": INTERACTIVE.__dict__,
                   "batch": BATCH.__dict__, "target_ratio": TARGET_RATIO},
        **result,
    }
    doc["aggregate"] = aggregate(doc["reps"])
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    md.write_text(render(doc))
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
