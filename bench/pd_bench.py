"""Disaggregated prefill/decode on this machine (issue 33): one single-role worker vs one prefill + decode pair,
the headline's trace, side by side.

``python -m bench.pd_bench [--reps 3]`` (``make bench-pd``) writes ``bench/results/pd.json`` and renders
``bench/results/pd.md`` from it (``--render`` renders again from the JSON alone). About 8 minutes on 2 cores.

Arms, all three worker processes (``python -m moeguard_runtime``, the headline's ``small`` preset, the same
weights seed) started once and kept for the whole run, served over loopback HTTP by the load generator
(:mod:`harness.loadgen`, streaming, greedy):

* ``single``: one worker (``MOEGUARD_ROLE=single``) with :data:`SINGLE_THREADS` torch threads: the machine's
  2 cores, as the pair has them;
* ``pd``: a prefill worker (``MOEGUARD_ROLE=prefill``) and a decode worker (``MOEGUARD_ROLE=decode``,
  ``MOEGUARD_PREFILL_URL`` the prefill worker's), one torch thread each so that the pair does not oversubscribe
  the 2 cores; the clients call the decode worker, which has each prompt prefilled there and reads its KV over
  NIXL's UCX.

Every worker runs the headline's inner-loop settings (:func:`bench.headline_loop.arm_envs`: the plan's budgets,
concurrency cap, bounded queue with its 2-s timeout, overload Auto) without the memory limits: there is no memory
cgroup here, and a worker without one compares its RSS, torch's file-backed libraries included, with the hard
limit (:mod:`bench.headline_loop`).

Traffic: the headline's schedule builder (:func:`bench.headline_traffic.build_loop`: the Azure conversation trace,
time compression 8x, lengths x 0.25, ``max_tokens`` <= 32, context <= 2048, real-text prompts) over a shorter,
thinner window (:data:`TRAFFIC`: one service on 2 cores serves far less than the headline's two replicas at its
9.6 requests/s) and without the skew tenant (a regime change for the control loop, not what is measured here).
SLOs are the headline's (TTFT 3 s, TPOT 0.25 s), SLO goodput DistServe's (:mod:`bench.slo`). Repetitions
alternate the arms' order; figures are medians over repetitions, pd/single ratios are taken per repetition and
then their median.

Per run, from the workers' ``/metrics`` before and after: the decode worker's ``moeguard_kv_transfer_seconds``
(reads, mean from ``_sum``/``_count``, p50/p99 interpolated within its buckets as Prometheus'
``histogram_quantile`` does) and ``moeguard_kv_transfer_bytes_total`` (bytes per read); each worker's own
time-to-first-token histogram (its mean splits the pair's TTFT: the prefill worker's queue and prefill, the
decode worker's wait from the prefill's answer to the first token, KV read included, and the rest: the HTTP hops,
the prefill call's round trip outside the prefill worker's scheduler, tokenization); each process's CPU seconds
(``/proc/<pid>/stat``). Before the repetitions, an unloaded probe (:data:`PROBE_LENGTHS`, one request at a time)
checks that greedy outputs are identical between the arms and gives the same split without queueing.

While one arm runs, the other arm's processes are stopped (SIGSTOP, SIGCONT after), so that neither arm is measured
beside the other's idle processes. The run measures each worker's idle CPU, and a bare NIXL agent's with and
without NIXL's own progress thread (:func:`agent_idle_cpu`): that thread polls UCX with ``sched_yield`` and kept a
core busy in an idle worker, so the runtime turns it off and makes UCX progress from a thread of its own every
2 ms (``moeguard_runtime.disagg.nixl_kv.NixlKV``).

Caveats: the two pd workers share the same 2 cores as the single worker (and the load generator): disaggregation
cannot win on speed here. What the run shows is the handoff's cost (ms and bytes per request), that outputs stay
the same, and how the TTFT divides between the roles. Absolute latencies carry the noise of a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from harness.loadgen import RequestSpec, prompt_of_length, run_requests
from harness.metrics_text import samples_named
from harness.worker_process import WorkerProcess, free_port, start_worker_process

from bench.control_latency import machine_line
from bench.headline import machine
from bench.headline_loop import DRAIN_S, REQUEST_TIMEOUT_S, arm_envs
from bench.headline_loop_report import SLO, arm_figures, med, outcome
from bench.headline_policies import PRESET, plan_budgets
from bench.headline_traffic import LoopTrafficConfig, build_loop
from bench.priority import idle
from bench.priority import outcome as reason
from bench.slo import ttft
from moeguard_core import contract, presets

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ARMS = ("single", "pd")
SINGLE_THREADS = 2
"""The single worker's torch threads: both cores, the pair's total (1 + 1)."""
PAIR_THREADS = 1
TRAFFIC = LoopTrafficConfig(window_s=480.0, thin=48, skew_at=1.0)
"""The headline's trace and scaling over its first 480 s (60 s compressed) and every 48th request instead of every
4th: 0.78 requests/s offered to one service (a pilot: the single worker served all 47 within the SLOs, the pair 44);
``skew_at`` 1: no skew tenant."""
PROBE_LENGTHS = (32, 128, 256, 512)
PROBE_MAX_TOKENS = 16
PROBE_OFFSET = 900_000
"""Corpus offset of the probe's prompts (away from the trace's)."""
WARMUP_REQUESTS = 3
IDLE_S = 5.0
"""Seconds each arm's idle CPU is sampled."""
LIMIT_KEYS = (contract.ENV_SOFT_LIMIT_BYTES, contract.ENV_HARD_LIMIT_BYTES)
RATIO_KEYS = ("slo_goodput", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")
FIGURE_KEYS = ("slo_goodput", "meets", "ok", "n", "tok_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
               "lat_p50", "lat_p99")
TTFT_METRIC = contract.METRIC_TTFT_SECONDS
STEP_METRIC = "moeguard_step_duration_seconds"


# --- pure: metrics text -----------------------------------------------------------------------------------------

Hist = dict[str, Any]
"""A histogram summed over its label sets: ``count``, ``sum`` (floats), ``buckets`` ({upper bound: cumulative
count}, ``inf`` for ``+Inf``)."""


def histogram(text: str, name: str) -> Hist:
    """``name``'s histogram in a Prometheus text exposition, summed over its label sets (e.g. ``priority``)."""
    buckets: dict[float, float] = {}
    for labels, value in samples_named(text, f"{name}_bucket"):
        le = float(labels["le"])
        buckets[le] = buckets.get(le, 0.0) + value
    return {"count": sum(v for _, v in samples_named(text, f"{name}_count")),
            "sum": sum(v for _, v in samples_named(text, f"{name}_sum")),
            "buckets": dict(sorted(buckets.items()))}


def worker_metrics(text: str) -> dict[str, Any]:
    """What a run reads from one worker's ``/metrics``: its TTFT and step histograms, its KV reads and bytes."""
    return {"ttft": histogram(text, TTFT_METRIC), "steps": histogram(text, STEP_METRIC),
            "transfer": histogram(text, contract.METRIC_KV_TRANSFER_SECONDS),
            "transfer_bytes": sum(v for _, v in samples_named(text, contract.METRIC_KV_TRANSFER_BYTES_TOTAL))}


def hist_delta(before: Hist, after: Hist) -> Hist:
    """What was observed between two readings of the same histogram."""
    return {"count": after["count"] - before["count"], "sum": after["sum"] - before["sum"],
            "buckets": {le: v - before["buckets"].get(le, 0.0) for le, v in after["buckets"].items()}}


def metrics_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`worker_metrics` of a run: ``after`` less ``before``."""
    return {**{k: hist_delta(before[k], after[k]) for k in ("ttft", "steps", "transfer")},
            "transfer_bytes": after["transfer_bytes"] - before["transfer_bytes"]}


def mean(h: Hist) -> float | None:
    """The histogram's mean observation (``sum / count``), None without one."""
    return h["sum"] / h["count"] if h["count"] > 0 else None


def bucket_quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of a histogram from its cumulative buckets, interpolated linearly within
    the bucket it falls in (Prometheus' ``histogram_quantile``; the first bucket from 0); the highest finite
    bound when it falls in ``+Inf``; None without observations."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = total * q / 100
    lo_bound, lo_count = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if le == float("inf"):
                return lo_bound
            if count == lo_count:
                return le
            return lo_bound + (le - lo_bound) * (rank - lo_count) / (count - lo_count)
        lo_bound, lo_count = le, count
    return lo_bound


def transfer_figures(delta: Mapping[str, Any]) -> dict[str, float | None]:
    """A decode worker's KV reads in a run: how many, seconds each (mean; p50 and p99 from the buckets), bytes
    each (``transfer_bytes`` / reads)."""
    h = delta["transfer"]
    reads = h["count"]
    return {"reads": reads, "mean_s": mean(h), "p50_s": bucket_quantile(h["buckets"], 50),
            "p99_s": bucket_quantile(h["buckets"], 99), "bytes": delta["transfer_bytes"],
            "bytes_per_read": delta["transfer_bytes"] / reads if reads else None}


def cpu_seconds(stat: str, ticks_per_s: float) -> float:
    """User + system CPU seconds of a process from its ``/proc/<pid>/stat`` line (fields 14 and 15, counted
    after the command's closing parenthesis: the command may hold spaces)."""
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / ticks_per_s


# --- pure: figures ----------------------------------------------------------------------------------------------

def ttft_split(client_ttft_mean: float | None, stages: Mapping[str, float | None]) -> dict[str, float | None]:
    """The client's mean TTFT divided into ``stages`` (each worker's own mean, seconds) and the ``rest``: what
    the client waited outside every worker's scheduler (HTTP hops, tokenization, the prefill call's round trip
    outside the prefill worker). None where a part is missing."""
    known = list(stages.values())
    rest = (client_ttft_mean - sum(v for v in known if v is not None)
            if client_ttft_mean is not None and all(v is not None for v in known) else None)
    return {"client": client_ttft_mean, **stages, "rest": rest}


def client_ttft_mean(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Mean TTFT (seconds) of the requests that got a first token."""
    values = [v for r in records if (v := ttft(r)) is not None]
    return statistics.fmean(values) if values else None


def run_figures(arm: str, rep: int, records: Sequence[Mapping[str, Any]], duration_s: float,
                deltas: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One run's figures: the headline's per-arm figures (SLO goodput, TTFT/TPOT/latency p50 and p99, outcomes),
    each worker's steps and mean TTFT, the TTFT split and, for ``pd``, the KV reads."""
    figs = arm_figures({"results": list(records), "rep": rep, "oom_kills": 0, "restarts": 0}, duration_s)
    workers = {role: {"steps": d["steps"]["count"], "step_s": d["steps"]["sum"], "ttft_mean_s": mean(d["ttft"])}
               for role, d in deltas.items()}
    stages = {role: w["ttft_mean_s"] for role, w in workers.items()}
    reasons = Counter(reason(dict(r)) for r in records)
    reasons.pop("ok", None)
    out = {**figs, "arm": arm, "workers": workers, "split": ttft_split(client_ttft_mean(records), stages),
           "reasons": dict(sorted(reasons.items()))}
    if "decode" in deltas:
        out["transfer"] = transfer_figures(deltas["decode"])
    return out


def same_outputs(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Requests answered in full by both record lists (same schedule, same index): how many, and which of them
    have a different text or token count."""
    both = [(x, y) for x, y in zip(a, b, strict=True)
            if x.get("status") == 200 and y.get("status") == 200 and not x.get("error") and not y.get("error")
            and x.get("text") is not None and y.get("text") is not None]
    differ = [x["index"] for x, y in both
              if (x["text"], x.get("completion_tokens")) != (y["text"], y.get("completion_tokens"))]
    return {"compared": len(both), "identical": len(both) - len(differ), "differ": differ}


def probe_row(prompt_tokens: int, a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """One probe prompt's outcome in both arms: TTFTs, outcomes, texts, and whether both answered it in full
    with the same text and token count."""
    same = same_outputs([a], [b])
    return {"prompt_tokens": prompt_tokens, "single_ttft_s": ttft(a), "pd_ttft_s": ttft(b),
            "single_outcome": outcome(dict(a)), "pd_outcome": outcome(dict(b)),
            "identical": same["compared"] == 1 and not same["differ"],
            "single_text": a.get("text"), "pd_text": b.get("text")}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def diff(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def aggregate(reps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over the repetitions per arm (outcomes summed), the per-repetition pd/single ratios and their
    median, and the pd arm's handoff figures."""
    out: dict[str, Any] = {}
    for arm in ARMS:
        runs = [r["arms"][arm] for r in reps]
        kinds: Counter[str] = Counter()
        reasons: Counter[str] = Counter()
        for x in runs:
            kinds.update(x["kinds"])
            reasons.update(x["reasons"])
        a: dict[str, Any] = {k: med([x[k] for x in runs]) for k in FIGURE_KEYS}
        a["kinds"] = dict(sorted(kinds.items()))
        a["reasons"] = dict(sorted(reasons.items()))
        a["split"] = {k: med([x["split"][k] for x in runs]) for k in runs[0]["split"]}
        a["cpu_s"] = {role: med([x["cpu_s"][role] for x in runs]) for role in runs[0]["cpu_s"]}
        a["wall_s"] = med([x["wall_s"] for x in runs])
        a["step_s"] = {role: med([x["workers"][role]["step_s"] for x in runs]) for role in runs[0]["workers"]}
        if arm == "pd":
            a["transfer"] = {k: med([x["transfer"][k] for x in runs]) for k in runs[0]["transfer"]}
        out[arm] = a
    out["ratios"] = {k: [ratio(r["arms"]["pd"][k], r["arms"]["single"][k]) for r in reps] for k in RATIO_KEYS}
    out["ratio"] = {k: med(v) for k, v in out["ratios"].items()}
    out["trace_outputs"] = {"compared": sum(r["outputs"]["compared"] for r in reps),
                            "identical": sum(r["outputs"]["identical"] for r in reps)}
    return out


# --- pure: the report -------------------------------------------------------------------------------------------

def _ms(v: float | None, nd: int = 0) -> str:
    return "—" if v is None else f"{v * 1000:,.{nd}f} ms"


def _dms(v: float | None) -> str:
    """A signed difference in ms (a difference of means may be below zero: noise)."""
    return "—" if v is None else f"{v * 1000:+,.0f} ms"


def _s(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f} s"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _n(v: float | None, nd: int = 2) -> str:
    return "—" if v is None else f"{v:,.{nd}f}"


def _mib(v: float | None) -> str:
    return "—" if v is None else f"{v / 2**20:.2f} MiB"


def _outcomes(kinds: Mapping[str, int], reasons: Mapping[str, int]) -> str:
    """``ok 128, refused 13 (503 queue_timeout 13)``: outcomes, then the failures by status and reason."""
    detail = ", ".join(f"{k} {n}" for k, n in reasons.items())
    return ", ".join(f"{k} {n}" for k, n in kinds.items()) + (f" ({detail})" if detail else "")


LEVEL = 0.02
"""A pd/single ratio within this of 1 reads "level with" (the repetitions' noise is larger)."""


def _more_or_less(v: float | None, more: str, less: str, level: str = "level with the single worker") -> str:
    if v is None:
        return "—"
    return level if abs(v - 1) <= LEVEL else more if v > 1 else less


def findings(doc: Mapping[str, Any]) -> list[str]:
    """The report's conclusions, each from the figures it quotes."""
    agg, probe, cfg = doc["aggregate"], doc["probe"], doc["config"]
    s, p, r, t = agg["single"], agg["pd"], agg["ratio"], agg["pd"]["transfer"]
    ps, pp = probe["split"]["single"], probe["split"]["pd"]
    ident = sum(1 for row in probe["prompts"] if row["identical"])
    return [
        f"- **Speed: the pair is {_more_or_less(r['slo_goodput'], 'ahead', 'behind')}** at "
        f"{_n(p['slo_goodput'])} vs {_n(s['slo_goodput'])} req/s of SLO goodput ({_x(r['slo_goodput'])}); TTFT p50 "
        f"{_x(r['ttft_p50'])}, TPOT p50 {_x(r['tpot_p50'])} of the single worker's. Its prefill runs on one core (one "
        "torch thread) where the single worker's runs on two, and every prompt makes one more HTTP hop and one KV copy.",
        f"- **The handoff's cost per request:** one KV read of {_mib(t['bytes_per_read'])} (median of the runs' "
        f"means; {_n(cfg['kv_bytes_per_token'], 0)} bytes per prompt token: k and v of {cfg['kv_shape']}, float32) in "
        f"{_ms(t['mean_s'], 1)} on average (p99 {_ms(t['p99_s'], 1)}, UCX over loopback on one host). Unloaded, "
        f"the decode worker's part from the prefill's answer to the first token was {_ms(pp['decode'])} (the read "
        f"{_ms(probe['transfer']['mean_s'], 1)}), and the time outside the schedulers (HTTP hops) {_ms(pp['rest'])} "
        f"for pd vs {_ms(ps['rest'])} for single: the prefill call's HTTP round trip adds "
        f"{_dms(diff(pp['rest'], ps['rest']))} unloaded, {_dms(diff(p['split']['rest'], s['split']['rest']))} under "
        "the trace's load (medians of the runs' means).",
        f"- **TTFT, split (means under load):** pd {_ms(p['split']['client'])} = prefill worker "
        f"{_ms(p['split']['prefill'])} (queue + prefill on one thread) + decode worker {_ms(p['split']['decode'])} "
        f"+ outside {_ms(p['split']['rest'])}; single {_ms(s['split']['client'])} = worker {_ms(s['split']['single'])} "
        f"+ outside {_ms(s['split']['rest'])}. Of the pair's {_ms(diff(p['split']['client'], s['split']['client']))} "
        f"more, {_ms(diff(p['split']['prefill'], s['split']['single']))} is the prefill worker's scheduler against the "
        "single worker's (queue, prefill and first token).",
        f"- **Outputs stay the same:** greedy outputs of the {len(probe['prompts'])} probe prompts identical in "
        f"{ident} of {len(probe['prompts'])}; trace requests answered by both arms: "
        f"{agg['trace_outputs']['identical']} of {agg['trace_outputs']['compared']} identical.",
        f"- **Idle CPU:** {_n(doc['idle_cpu_per_s'].get('prefill'))} and "
        f"{_n(doc['idle_cpu_per_s'].get('decode'))} CPU s per s for the idle prefill and decode workers (single: "
        f"{_n(doc['idle_cpu_per_s'].get('single'))}); NIXL's own progress thread, off in the runtime, keeps a bare "
        f"agent at {_n(doc['agent_idle_cpu_per_s']['prog_thread'])} (see CPU below).",
    ]


def cpu_rows(doc: Mapping[str, Any]) -> list[str]:
    """One row per arm and process: wall, CPU and engine-step seconds per run (medians), idle CPU per second."""
    agg, idle_cpu_s = doc["aggregate"], doc["idle_cpu_per_s"]
    return [f"| {arm} | {role} | {_n(agg[arm]['wall_s'], 1)} | {_n(agg[arm]['cpu_s'][role], 1)} | "
            f"{_n(agg[arm]['step_s'][role], 1)} | {_n(idle_cpu_s.get(role))} |"
            for arm in ARMS for role in agg[arm]["cpu_s"]]


def probe_lines(probe: Mapping[str, Any]) -> list[str]:
    """The unloaded probe: outputs compared, per-prompt TTFT per arm, the split of the means."""
    s, p, bytes_per_token = probe["split"]["single"], probe["split"]["pd"], probe["bytes_per_prompt_token"]
    lines = [
        "| prompt tokens | single TTFT | pd TTFT | pd − single | identical output |",
        "|---|---|---|---|---|",
        *[f"| {row['prompt_tokens']} | {_ms(row['single_ttft_s'])} | {_ms(row['pd_ttft_s'])} | "
          f"{_ms(diff(row['pd_ttft_s'], row['single_ttft_s']))} | {'yes' if row['identical'] else '**no**'} |"
          for row in probe["prompts"]],
        "",
        f"Means over the probe's prompts: single {_ms(s['client'])} at the client, of which {_ms(s['single'])} in the "
        f"worker's scheduler (queue, prefill, first token) and {_ms(s['rest'])} outside it; pd {_ms(p['client'])} at the "
        f"client, of which {_ms(p['prefill'])} in the prefill worker's scheduler, {_ms(p['decode'])} in the decode "
        f"worker's (from the prefill's answer to the first token, the KV read included: {_ms(probe['transfer']['mean_s'], 1)} "
        f"per read) and {_ms(p['rest'])} outside both (HTTP hops: client → decode → prefill and back, the offer's JSON). "
        f"KV read per prompt token: {_n(bytes_per_token, 0)} bytes ({_mib(probe['transfer']['bytes'])} for "
        f"{probe['prompt_tokens']} prompt tokens as the workers count them).",
    ]
    return lines


def render(doc: Mapping[str, Any]) -> str:
    """The Markdown report, from the JSON alone."""
    cfg, agg, probe = doc["config"], doc["aggregate"], doc["probe"]
    s, p, r, t = agg["single"], agg["pd"], agg["ratio"], agg["pd"]["transfer"]
    ident = sum(1 for row in probe["prompts"] if row["identical"])
    lines = [
        "# Disaggregated prefill/decode on 2 cores: one worker vs a prefill + decode pair (issue 33)",
        "",
        f"Generated by `{doc['command']}` (`bench/pd_bench.py`) on {doc['date']}; no figure is edited by hand. "
        f"Machine: {doc['machine']}. Whole run: {doc['elapsed_s'] / 60:.1f} min.",
        "",
        "**On this machine disaggregation cannot win on speed.** The pair's two workers share the same 2 cores as "
        "the single worker (one torch thread each; the single worker has both), and the load generator runs on them "
        "too: splitting prefill and decode into two processes adds a hop and a copy and no compute. What the run "
        "shows is what the handoff costs per request, that the outputs stay the same, where a disaggregated "
        "request's time to first token goes, and how decode steps fare once no prefill chunk shares them (TPOT).",
        "",
        "## What it shows",
        "",
        *findings(doc),
        "",
        "## Results (medians of the repetitions; pd/single ratios per repetition, then their median)",
        "",
        "| arm | SLO goodput req/s | met SLO / ok / all | TTFT p50 / p99 | TPOT p50 / p99 | latency p50 / p99 | "
        "outcomes (summed) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, a in (("single", s), ("pd", p)):
        lines.append(f"| {arm} | {_n(a['slo_goodput'])} | {_n(a['meets'], 0)} / {_n(a['ok'], 0)} / {_n(a['n'], 0)} | "
                     f"{_s(a['ttft_p50'])} / {_s(a['ttft_p99'])} | {_ms(a['tpot_p50'])} / {_ms(a['tpot_p99'])} | "
                     f"{_s(a['lat_p50'])} / {_s(a['lat_p99'])} | {_outcomes(a['kinds'], a['reasons'])} |")
    lines.append(f"| **pd / single** | **{_x(r['slo_goodput'])}** | | {_x(r['ttft_p50'])} / {_x(r['ttft_p99'])} | "
                 f"{_x(r['tpot_p50'])} / {_x(r['tpot_p99'])} | | |")
    lines += [
        "",
        "## The handoff, per request (pd arm)",
        "",
        "| KV reads per run | transfer mean | transfer p50 / p99 (buckets) | bytes per read | decode worker: prefill's "
        "answer → first token | outside the workers' schedulers |",
        "|---|---|---|---|---|---|",
        f"| {_n(t['reads'], 0)} | {_ms(t['mean_s'], 1)} | {_ms(t['p50_s'], 1)} / {_ms(t['p99_s'], 1)} | "
        f"{_mib(t['bytes_per_read'])} | {_ms(p['split']['decode'])} | {_ms(p['split']['rest'])} (single: {_ms(s['split']['rest'])}) |",
        "",
        "Transfer time: the decode worker's `moeguard_kv_transfer_seconds` over the run (mean = `_sum` / `_count`; "
        "p50 and p99 interpolated within its buckets, as Prometheus' `histogram_quantile`), from registering the "
        "cache to the read's end. Bytes per read: `moeguard_kv_transfer_bytes_total` / `_count` (the prompts' "
        "positions of k and v; float32).",
        "",
        "### Where the time to first token goes (means per request, medians of the repetitions)",
        "",
        "| arm | client TTFT | prefill (its worker's scheduler) | decode worker: answer → first token | outside the "
        "schedulers |",
        "|---|---|---|---|---|",
        f"| single | {_ms(s['split']['client'])} | {_ms(s['split']['single'])} (queue, prefill, first token) | — | "
        f"{_ms(s['split']['rest'])} |",
        f"| pd | {_ms(p['split']['client'])} | {_ms(p['split']['prefill'])} | {_ms(p['split']['decode'])} | "
        f"{_ms(p['split']['rest'])} |",
        "",
        "Each worker's share is its own `moeguard_time_to_first_token_seconds` mean over the run (the prefill "
        "worker's is its one-token request: queue and prefill; the decode worker's counts from the prefill's answer). "
        "\"Outside the schedulers\" is the client's mean TTFT less those: HTTP hops (for pd also the decode → prefill "
        "call and the offer's JSON), tokenization, streaming the first token.",
        "",
        "### CPU (per run, medians of the repetitions)",
        "",
        "| arm | process | wall s | CPU s | engine steps s | CPU s per s, idle |",
        "|---|---|---|---|---|---|",
        *cpu_rows(doc),
        "",
        f"A bare NIXL agent (UCX backend) doing nothing measured {_n(doc['agent_idle_cpu_per_s']['prog_thread'])} CPU "
        f"s per s with NIXL's own progress thread (`nixl_agent_config`'s `enable_prog_thread`, default on: it polls "
        f"UCX with `sched_yield`) and {_n(doc['agent_idle_cpu_per_s']['no_prog_thread'], 4)} without. The runtime "
        "turns it off and makes UCX progress from a thread of its own, which reads NIXL's notifications every 2 ms "
        "(`NixlKV`); the idle column above is the workers' with that thread. While one arm runs, the other arm's "
        "processes are stopped (SIGSTOP, then SIGCONT).",
        "",
        "## Outputs",
        "",
        f"Greedy outputs (temperature 0) of {len(probe['prompts'])} fixed prompts, unloaded, one at a time: "
        f"**{ident} of {len(probe['prompts'])} identical** between the arms (text and token count). Trace requests "
        f"answered in full by both arms in the same repetition: {agg['trace_outputs']['identical']} of "
        f"{agg['trace_outputs']['compared']} identical (batched float32 steps may round differently with another batch "
        "composition, so this is information, not a test).",
        "",
        "### Unloaded probe",
        "",
        *probe_lines(probe),
        "",
        "## Per repetition",
        "",
        "| rep | order | single: goodput, TTFT p50, TPOT p50 | pd: goodput, TTFT p50, TPOT p50 | pd/single goodput | "
        "KV reads, transfer mean |",
        "|---|---|---|---|---|---|",
    ]
    for i, rep in enumerate(doc["reps"]):
        a, b = rep["arms"]["single"], rep["arms"]["pd"]
        lines.append(f"| {rep['rep']} | {', '.join(rep['order'])} | {_n(a['slo_goodput'])}, {_s(a['ttft_p50'])}, "
                     f"{_ms(a['tpot_p50'])} | {_n(b['slo_goodput'])}, {_s(b['ttft_p50'])}, {_ms(b['tpot_p50'])} | "
                     f"{_x(agg['ratios']['slo_goodput'][i])} | {_n(b['transfer']['reads'], 0)}, "
                     f"{_ms(b['transfer']['mean_s'], 1)} |")
    tr = cfg["traffic"]
    lines += [
        "",
        "## How it was measured",
        "",
        f"- Workers: `python -m moeguard_runtime`, preset `{cfg['preset']}` (float32, seeded random weights), CPU; "
        f"`single` with {cfg['single_threads']} torch threads, the pair's workers with {cfg['pair_threads']} each "
        "(`MOEGUARD_TORCH_THREADS`); all three started once, warmed up with "
        f"{cfg['warmup_requests']} requests each, kept for the whole run. Settings (every worker): "
        + ", ".join(f"`{k}={v}`" for k, v in cfg["env"].items())
        + "; the headline's inner-loop arm without its memory limits (no memory cgroup here). Transfer timeout and "
        "KV lease at their defaults (5 s, 30 s).",
        f"- Traffic: the headline's schedule builder on `azure-llm-inference-2023-conv.csv`, its first "
        f"{tr['window_s']:g} s, every {tr['thin']}th request ({cfg['requests']} requests in {cfg['duration_s']:g} s, "
        f"{cfg['requests'] / cfg['duration_s']:.2f} req/s), time compression {tr['time_compression']:g}×, lengths × "
        f"{tr['length_scale']:g}, max_tokens ≤ {tr['max_new_tokens_cap']}, context ≤ {tr['max_context'] + 1}; no skew "
        "tenant, no leak. The headline offers its two replicas every 4th request of 600 s (9.6 req/s); one service "
        "on 2 cores serves a small part of that, so this window is thinner and shorter to keep the run under 10 "
        f"minutes. Streaming, greedy, seed = repetition; requests time out after {cfg['request_timeout_s']:g} s, a "
        f"run ends {cfg['drain_s']:g} s after the last arrival.",
        f"- SLOs: TTFT ≤ {cfg['slo']['ttft_s']:g} s and TPOT ≤ {cfg['slo']['tpot_s']:g} s (the headline's); SLO goodput "
        "= requests that succeeded and met both per second of the schedule (DistServe). Percentiles over the "
        "requests answered in full.",
        f"- {cfg['reps']} repetitions, the arms' order alternating; each run starts with every worker idle.",
        f"- Probe: prompts of {', '.join(str(n) for n in cfg['probe_lengths'])} tokens of real text, max_tokens "
        f"{cfg['probe_max_tokens']}, one at a time to each arm, before the repetitions.",
        "",
    ]
    return "\n".join(lines)


# --- the run ----------------------------------------------------------------------------------------------------

def kv_bytes_per_token() -> dict[str, Any]:
    """The preset's KV bytes per token (k and v, every layer, float32) and its shape, for the report."""
    a = presets.get_preset(PRESET)
    head_dim = a.dim // a.n_head
    return {"kv_bytes_per_token": 2 * a.n_layer * a.n_kv_head * head_dim * 4,
            "kv_shape": f"{a.n_layer} layers x {a.n_kv_head} KV heads x {head_dim}"}


def worker_env() -> dict[str, str]:
    """Every worker's settings: the headline's inner-loop arm less its memory limits."""
    budgets, _ = plan_budgets()
    env = arm_envs(budgets)["inner-loop"]
    return {"MOEGUARD_MODEL_PRESET": PRESET, **{k: v for k, v in env.items() if k not in LIMIT_KEYS}}


def start_arms(log_dir: Path, env: Mapping[str, str]) -> dict[str, dict[str, WorkerProcess]]:
    """The single worker and the pair, started and loaded: {arm: {role: worker}}."""
    arms: dict[str, dict[str, WorkerProcess]] = {}
    try:
        arms["single"] = {"single": start_worker_process(
            log_dir, {**env, "MOEGUARD_TORCH_THREADS": str(SINGLE_THREADS)}, timeout_s=300)}
        port = free_port()
        pair = {**env, "MOEGUARD_TORCH_THREADS": str(PAIR_THREADS)}
        prefill = start_worker_process(log_dir, {**pair, contract.ENV_ROLE: "prefill", "MOEGUARD_PORT": str(port)},
                                       timeout_s=300)
        arms["pd"] = {"prefill": prefill}
        arms["pd"]["decode"] = start_worker_process(
            log_dir, {**pair, contract.ENV_ROLE: "decode", contract.ENV_PREFILL_URL: f"http://127.0.0.1:{port}"},
            timeout_s=300)
    except BaseException:
        stop_all(arms)
        raise
    return arms


def stop_all(arms: Mapping[str, Mapping[str, WorkerProcess]]) -> None:
    for roles in arms.values():
        for w in roles.values():
            w.stop()


@contextmanager
def running_arms(log_dir: Path, env: Mapping[str, str]) -> Iterator[dict[str, dict[str, WorkerProcess]]]:
    arms = start_arms(log_dir, env)
    try:
        yield arms
    finally:
        stop_all(arms)


def client_url(roles: Mapping[str, WorkerProcess]) -> str:
    """Where the arm's clients send: the single worker, or the pair's decode worker."""
    return (roles.get("single") or roles["decode"]).base_url


def scrape(roles: Mapping[str, WorkerProcess]) -> dict[str, dict[str, Any]]:
    return {role: worker_metrics(httpx.get(f"{w.base_url}/metrics", timeout=10).text) for role, w in roles.items()}


def cpu_now(arms: Mapping[str, Mapping[str, WorkerProcess]]) -> dict[str, float]:
    ticks = float(os.sysconf("SC_CLK_TCK"))
    return {role: cpu_seconds(Path(f"/proc/{w.proc.pid}/stat").read_text(), ticks)
            for roles in arms.values() for role, w in roles.items()}


def settle(arms: Mapping[str, Mapping[str, WorkerProcess]]) -> None:
    """Wait until no worker has anything queued or running."""
    for roles in arms.values():
        for w in roles.values():
            idle(w)


@contextmanager
def only(arms: Mapping[str, Mapping[str, WorkerProcess]], arm: str) -> Iterator[None]:
    """Every other arm's processes stopped (SIGSTOP) until the block ends (SIGCONT): the arm measured has the
    cores to itself and the load generator."""
    others = [w.proc.pid for name, roles in arms.items() if name != arm for w in roles.values()]
    for pid in others:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in others:
            os.kill(pid, signal.SIGCONT)


def send(url: str, specs: Sequence[RequestSpec], seed: int, max_in_flight: int = 512,
         timeout_s: float | None = None) -> tuple[list[dict[str, Any]], float]:
    run = asyncio.run(run_requests([url], specs, model=PRESET, temperature=0.0, seed=seed, stream=True,
                                   max_in_flight=max_in_flight, request_timeout_s=REQUEST_TIMEOUT_S,
                                   timeout_s=timeout_s, progress=False))
    return [r.to_dict(include_text=True) for r in run.results], run.wall_s


def measured(arms: Mapping[str, Mapping[str, WorkerProcess]], arm: str, specs: Sequence[RequestSpec], seed: int,
             max_in_flight: int = 512, timeout_s: float | None = None) -> dict[str, Any]:
    """Send ``specs`` to ``arm``, the other arm stopped (:func:`only`); its records, wall time, each of its
    workers' metrics delta and its processes' CPU seconds over the run."""
    roles = arms[arm]
    settle(arms)
    with only(arms, arm):
        before, cpu0 = scrape(roles), cpu_now({arm: roles})
        records, wall = send(client_url(roles), specs, seed, max_in_flight, timeout_s)
        settle({arm: roles})
        cpu1, after = cpu_now({arm: roles}), scrape(roles)
    return {"records": records, "wall_s": wall, "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu1},
            "deltas": {role: metrics_delta(before[role], after[role]) for role in roles}}


def idle_cpu(arms: Mapping[str, Mapping[str, WorkerProcess]], seconds: float = IDLE_S) -> dict[str, float]:
    """Each worker's CPU seconds per second while its arm is idle (the other arm stopped)."""
    settle(arms)
    out: dict[str, float] = {}
    for arm, roles in arms.items():
        with only(arms, arm):
            cpu0 = cpu_now({arm: roles})
            time.sleep(seconds)
            out.update({role: (v - cpu0[role]) / seconds for role, v in cpu_now({arm: roles}).items()})
    return out


def agent_idle_cpu(prog_thread: bool, seconds: float = 2.0) -> float:
    """CPU seconds per second of a bare NIXL agent (UCX backend) doing nothing, with or without its progress
    thread (``nixl_agent_config(enable_prog_thread=...)``; the runtime builds its agent without it),
    in a process of its own (:func:`main`'s ``--agent-idle``)."""
    out = subprocess.run([sys.executable, "-m", "bench.pd_bench", "--agent-idle", str(int(prog_thread)),
                          "--agent-idle-s", str(seconds)], capture_output=True, text=True, check=True, cwd=ROOT,
                         timeout=120)
    return float(out.stdout.strip().splitlines()[-1])


def print_agent_idle(prog_thread: bool, seconds: float) -> None:
    from moeguard_runtime.disagg.nixl_kv import infiniband_devices, load_api, ucx_module_defaults

    for k, v in ucx_module_defaults(os.environ, infiniband_devices()).items():
        os.environ.setdefault(k, v)
    api = load_api()
    agent = api.nixl_agent(f"idle-{os.getpid()}", api.nixl_agent_config(enable_prog_thread=prog_thread,
                                                                         backends=["UCX"]))
    t0 = time.process_time()
    time.sleep(seconds)
    print((time.process_time() - t0) / seconds, flush=True)
    del agent


def probe_specs() -> list[RequestSpec]:
    return [RequestSpec(prompt_of_length(n, offset=PROBE_OFFSET + i * 7919), PROBE_MAX_TOKENS)
            for i, n in enumerate(PROBE_LENGTHS)]


def run_probe(arms: Mapping[str, Mapping[str, WorkerProcess]]) -> dict[str, Any]:
    """The unloaded probe: each prompt alone, to each arm; outputs compared, TTFTs, the split, bytes per token."""
    specs = probe_specs()
    got = {arm: measured(arms, arm, specs, seed=0, max_in_flight=1) for arm in ARMS}
    single, pd = got["single"]["records"], got["pd"]["records"]
    same = same_outputs(single, pd)
    transfer = transfer_figures(got["pd"]["deltas"]["decode"])
    tokens = sum(int(r.get("prompt_tokens") or n) for r, n in zip(pd, PROBE_LENGTHS, strict=True))
    return {
        "prompts": [probe_row(n, a, b) for n, a, b in zip(PROBE_LENGTHS, single, pd, strict=True)],
        "outputs": same, "transfer": transfer, "prompt_tokens": tokens,
        "bytes_per_prompt_token": transfer["bytes"] / tokens if transfer["bytes"] else None,
        "split": {arm: ttft_split(client_ttft_mean(got[arm]["records"]),
                                  {role: mean(d["ttft"]) for role, d in got[arm]["deltas"].items()})
                  for arm in ARMS},
    }


def warm_up(arms: Mapping[str, Mapping[str, WorkerProcess]]) -> None:
    """A few requests to each arm: the first steps of a process are slower (allocator, oneDNN)."""
    specs = [RequestSpec(prompt_of_length(256, offset=PROBE_OFFSET * 2 + i * 7919), 8) for i in range(WARMUP_REQUESTS)]
    for roles in arms.values():
        send(client_url(roles), specs, seed=0)


def run_rep(arms: Mapping[str, Mapping[str, WorkerProcess]], rep: int, specs: Sequence[RequestSpec],
            duration_s: float) -> dict[str, Any]:
    order = list(ARMS) if rep % 2 == 0 else list(reversed(ARMS))
    out: dict[str, Any] = {"rep": rep, "order": order, "arms": {}, "records": {}}
    deadline = max(s.at_s for s in specs) + DRAIN_S
    for arm in order:
        m = measured(arms, arm, specs, seed=rep, timeout_s=deadline)
        figs = run_figures(arm, rep, m["records"], duration_s, m["deltas"])
        out["arms"][arm] = {**figs, "wall_s": m["wall_s"], "cpu_s": m["cpu_s"], "deltas": m["deltas"]}
        out["records"][arm] = m["records"]
        print(f"rep {rep} {arm:<6} goodput {figs['slo_goodput']:.2f} req/s ok {figs['ok']}/{figs['n']} "
              f"TTFT p50 {figs['ttft_p50']} TPOT p50 {figs['tpot_p50']} {figs['kinds']}", file=sys.stderr, flush=True)
    out["outputs"] = same_outputs(out["records"]["single"], out["records"]["pd"])
    for records in out["records"].values():  # compared: the texts (random weights' bytes) are not kept
        for r in records:
            r.pop("text", None)
    return out


def run(reps: int, log_dir: Path, traffic: LoopTrafficConfig = TRAFFIC) -> dict[str, Any]:
    items, duration = build_loop(traffic)
    specs = [it.spec for it in items]
    env = worker_env()
    t0 = time.monotonic()
    agent = {"prog_thread": agent_idle_cpu(True), "no_prog_thread": agent_idle_cpu(False)}
    with running_arms(log_dir, env) as arms:
        warm_up(arms)
        idle_cpu_s = idle_cpu(arms)
        probe = run_probe(arms)
        results = [run_rep(arms, rep, specs, duration) for rep in range(reps)]
    return {
        "command": "make bench-pd", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_line(), "machine_detail": machine(), "elapsed_s": time.monotonic() - t0,
        "config": {"preset": PRESET, **kv_bytes_per_token(), "single_threads": SINGLE_THREADS, "pair_threads": PAIR_THREADS, "env": env,
                   "traffic": traffic.to_dict(), "duration_s": duration, "requests": len(specs), "reps": reps,
                   "slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s}, "request_timeout_s": REQUEST_TIMEOUT_S,
                   "drain_s": DRAIN_S, "probe_lengths": list(PROBE_LENGTHS), "probe_max_tokens": PROBE_MAX_TOKENS,
                   "warmup_requests": WARMUP_REQUESTS},
        "idle_cpu_per_s": idle_cpu_s, "agent_idle_cpu_per_s": agent, "probe": probe, "reps": results,
        "aggregate": aggregate(results),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "pd", help="path stem of .md/.json")
    ap.add_argument("--render", action="store_true", help="render the .md again from the .json alone")
    ap.add_argument("--window-s", type=float, default=TRAFFIC.window_s, help="trace window before compression (pilots)")
    ap.add_argument("--thin", type=int, default=TRAFFIC.thin, help="keep every N-th trace request (pilots)")
    ap.add_argument("--agent-idle", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    ap.add_argument("--agent-idle-s", type=float, default=2.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.agent_idle is not None:  # agent_idle_cpu's child process
        print_agent_idle(bool(args.agent_idle), args.agent_idle_s)
        return 0
    if args.render:
        doc = json.loads(args.out.with_suffix(".json").read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="moeguard-pd-") as logs:
            doc = run(args.reps, Path(logs), dataclasses.replace(TRAFFIC, window_s=args.window_s, thin=args.thin))
        args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
