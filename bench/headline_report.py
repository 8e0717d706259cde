"""Write ``bench/RESULTS.md`` and the plots from the raw runs of ``bench.headline``. No hand edits."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "bench" / "results" / "headline"
PLOTS = ROOT / "bench" / "results" / "plots"
RESULTS = ROOT / "bench" / "RESULTS.md"
MiB = 1024 * 1024
COLORS = {"request-count": "tab:red", "token-budgets": "tab:orange", "moeguard": "tab:green"}


def ok(r: dict[str, Any]) -> bool:
    return r["status"] is not None and 200 <= r["status"] < 300 and r["error"] is None and r["end_s"] is not None


def time_to_answer(r: dict[str, Any], no_answer_s: float) -> float:
    """Seconds from the request's due time to its answer, whatever the answer: a success, a
    429/503, an in-stream error or a dropped connection at the moment it came; a request that got
    no answer at all (timed out, or still open at the run's end) counts as ``no_answer_s``."""
    if r["end_s"] is None or (r["status"] is None and r["error"] and "Timeout" in r["error"]):
        return no_answer_s
    return max(0.0, r["end_s"] - r["scheduled_s"])


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def bucket_quantiles(buckets: dict[str, float], qs: tuple[float, ...]) -> list[float | None]:
    """Upper-bound quantiles of a cumulative Prometheus histogram (``le`` -> count)."""
    items = sorted((float("inf") if k == "+Inf" else float(k), v) for k, v in buckets.items())
    total = items[-1][1] if items else 0
    out: list[float | None] = []
    for q in qs:
        if not total:
            out.append(None)
            continue
        out.append(next(le for le, c in items if c >= q * total))
    return out


def run_stats(d: dict[str, Any], no_answer_s: float = 30.0) -> dict[str, Any]:
    res = d["results"]
    answer = [time_to_answer(r, no_answer_s) for r in res]
    good = [r for r in res if ok(r)]
    lat = [r["latency_s"] for r in good if r["latency_s"] is not None]
    ttft = [r["ttft_s"] for r in good if r["ttft_s"] is not None]
    wall = d["wall_s"]
    refusals = [r for r in res if r["status"] in (429, 503)]
    in_stream = [r for r in res if r["status"] == 200 and r["error"] and "deadline" not in r["error"]]
    other_fail = [r for r in res if not ok(r) and r["status"] not in (429, 503) and r not in in_stream]
    with_reason = [r for r in refusals if r["retry_after"] and r["error"]]
    merged: dict[str, float] = {}
    for life in d["metrics_by_life"]:
        for le, c in life.get("batch_tokens_buckets", {}).get("prefill", {}).items():
            merged[le] = merged.get(le, 0.0) + c
    q50, q99 = bucket_quantiles(merged, (0.5, 0.99))
    cg = [s["cgroup"] for s in d["samples"] if "cgroup" in s]
    rss = [s["rss"] for s in d["samples"] if s.get("rss")]
    return {
        "goodput": sum(r["completion_tokens"] or 0 for r in good) / wall if wall else 0.0,
        "ok": len(good), "n": len(res),
        "lat": [pct(lat, q) for q in (50, 95, 99)], "answer": [pct(answer, q) for q in (50, 95, 99)],
        "ttft": [pct(ttft, q) for q in (50, 95, 99)],
        "peak_cgroup": max([d["max_usage_cgroup"] or 0, *cg]) if cg else None,
        "peak_rss": max(rss) if rss else None,
        "idle_start": d["idle"]["cgroup"], "idle_end": cg[-1] if cg else None,
        "oom": d["oom_kills"], "n429": sum(r["status"] == 429 for r in res),
        "n503": sum(r["status"] == 503 for r in res), "other_fail": len(other_fail),
        "in_stream": len(in_stream),
        "fail_kill": sum(1 for r in other_fail if r["error"] and any(
            w in r["error"] for w in ("peer closed", "ConnectError", "ReadError"))),
        "fail_timeout": sum(1 for r in other_fail if r["error"] and "Timeout" in r["error"]),
        "fail_deadline": sum(1 for r in other_fail if r["error"] and "deadline" in r["error"]),
        "refusals_with_reason": len(with_reason), "refusals": len(refusals),
        "prefill_tokens_p50": q50, "prefill_tokens_p99": q99,
    }


def med(values: list[Any]) -> Any:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def why(summary: dict[str, dict[str, Any]], stats: dict[str, list[dict[str, Any]]],
        meta: dict[str, Any], runs_full: list[dict[str, Any]]) -> list[str]:
    """Explanations tied to the measured values (the wording is fixed, the numbers are computed)."""
    base, tok, full = summary["request-count"], summary["token-budgets"], summary["moeguard"]
    pb = meta["plan_budgets"]
    fm = meta["envs"]["moeguard"]
    out = [
        f"- **OOM kills.** request-count was killed {base['oom']} times and token-budgets {tok['oom']} times"
        f" over {meta['reps']} repetitions, at the {meta['hard_limit'] / MiB:,.0f} MiB cgroup limit. Each kill"
        " drops every request in flight (\"peer closed connection\") and the restart (model load, a few"
        " seconds) refuses connections. \"No answer\" per repetition (median), cut by a kill or refused while"
        " restarting / timed out after 30 s / open at the run's end:"
        + "; ".join(f" {p} {summary[p]['fail_kill']:.0f} / {summary[p]['fail_timeout']:.0f} /"
                    f" {summary[p]['fail_deadline']:.0f}" for p in summary) + ". Token budgets alone bound the"
        " prefill step but neither the running sequences (whose KV caches still add up) nor the queue"
        + (", so its requests mostly wait past their timeout." if tok["fail_timeout"] > tok["fail_kill"] else
           ", so it is OOM-killed as well."),
        f"- **moeguard's configuration.** `moeguard plan` (memory model, soft limit"
        f" {meta['soft_limit'] / MiB:,.0f} MiB, {meta['plan_overhead'] / MiB:,.0f} MiB runtime overhead,"
        f" {meta['plan_context']:,} context tokens per sequence) gives a memory ceiling of"
        f" {pb['max_prefill_tokens']} prefill tokens per step (the worst chunk ends at 4,096 tokens, where the"
        f" causal mask grows) and {pb['max_batch_requests']} running requests. The policy runs"
        f" {fm['MOEGUARD_MAX_CONCURRENT_BATCHES']} batch of them (the engine runs batches' steps in turn, so two"
        " batches would make each request decode every other step) with"
        f" {fm['MOEGUARD_MAX_PREFILL_TOKENS']} prefill tokens per step, below the ceiling, because every step"
        " that carries a prefill chunk also carries the running requests' decode tokens: the chunk sets their"
        " time per output token (chunked prefill, as vLLM's `max_num_batched_tokens`). The queue holds"
        f" {fm['MOEGUARD_MAX_QUEUE_REQUESTS']} requests for at most {fm['MOEGUARD_QUEUE_TIMEOUT_SECONDS']} s, so a"
        " request that cannot start soon is refused at once. These settings were chosen on pilot runs of the"
        " moeguard policy alone (not on this run). The machine (2 cores, shared) cannot serve this traffic at"
        " any setting: the excess gets 429/503 instead of a slow success or an OOM kill.",
    ]
    r_ok = full["lat"][2] / base["lat"][2] if base["lat"][2] and full["lat"][2] else None
    r_all = full["answer"][2] / base["answer"][2] if base["answer"][2] and full["answer"][2] else None
    if r_ok is not None:
        out.append(
            f"- **Latency, both views.** p99 of successful requests: moeguard {full['lat'][2]:.2f} s vs"
            f" request-count {base['lat'][2]:.2f} s ({r_ok:.2f}×). The successful requests are not the same"
            f" set: request-count completed a median of {base['ok']:.0f} of {base['n']} (the others were cut"
            f" by its OOM kills and restarts), moeguard {full['ok']:.0f}. Over all {base['n']} requests, each at its time to"
            f" answer (refusals and failures included, no answer counted as the {meta['request_timeout_s']:g} s"
            f" timeout): p99 {full['answer'][2]:.2f} s vs {base['answer'][2]:.2f} s ({r_all:.2f}×), p50"
            f" {full['answer'][0]:.2f} s vs {base['answer'][0]:.2f} s. Most of request-count's fast answers are"
            " failures (a connection cut by an OOM kill or refused while the worker restarts); moeguard's are"
            " 429/503 refusals with Retry-After.")
        if r_ok > 0.5:
            good = sorted((r for d in runs_full for r in d["results"] if ok(r) and r["ttft_s"] is not None),
                          key=lambda r: r["latency_s"])
            slow = good[-max(1, len(good) // 20):]  # the slowest 5 %, all repetitions
            q = statistics.median(r["ttft_s"] for r in slow)
            per_tok = statistics.median((r["latency_s"] - r["ttft_s"]) / max(1, (r["completion_tokens"] or 1) - 1)
                                        for r in slow)
            prompt = statistics.median(r["prompt_bytes"] for r in slow)
            out.append(
                f"- **p99 target missed.** The slowest 5 % of moeguard's successful requests (all repetitions)"
                f" had a median prompt of {prompt:,.0f} tokens, waited a median {q:.2f} s for their first token"
                f" (queue, up to the {fm['MOEGUARD_QUEUE_TIMEOUT_SECONDS']} s timeout, then prefill) and then"
                f" took {per_tok * 1000:.0f} ms per output token for up to 32 tokens: one step per token, each"
                f" step carrying up to {fm['MOEGUARD_MAX_PREFILL_TOKENS']} prefill tokens of other requests and"
                f" {fm['MOEGUARD_MAX_DECODE_TOKENS']} decode tokens, on a shared 2-core CPU. request-count's p99"
                f" is over its survivors only ({base['ok']:.0f} of {base['n']} per repetition). A shorter"
                " queue timeout, fewer running requests or a smaller prefill chunk would trade more refusals"
                " for a lower p99.")
    if full["peak_cgroup"] > meta["soft_limit"] * 1.1 and full["idle_start"] and full["idle_end"]:
        out.append(
            f"- **Peak target missed.** moeguard's worker peaked at {full['peak_cgroup'] / MiB:,.0f} MiB of"
            f" cgroup usage, under the {meta['hard_limit'] / MiB:,.0f} MiB hard limit (no OOM kill) but above"
            f" the soft limit + 10 %. It started at {full['idle_start'] / MiB:,.0f} MiB (ready, idle) and"
            f" ended the run, drained, at {full['idle_end'] / MiB:,.0f} MiB (medians over repetitions): the"
            " memory its steps freed stays in the process's heap, and the cgroup also counts page cache, so"
            " the baseline climbs as it serves. The soft limit shrinks the budgets of the next steps; it"
            " cannot return memory already held. The plan's runtime overhead is the fresh worker's, so"
            " it under-counts a served worker's baseline.")
    if full["in_stream"]:
        out.append(
            f"- **Refusal target missed.** Every 429 and 503 carried Retry-After and a reason, but a median of"
            f" {full['in_stream']:.0f} requests per repetition were refused *inside* a 200 stream: with"
            " `stream: true` the worker sends the 200 headers when it queues the request, so its queue timeout"
            " can only end the stream with an error event. The fix belongs in the worker (send the headers at"
            " admission, so a queue timeout is still a 503 with Retry-After); non-streaming requests get the"
            " 503.")
    if full["other_fail"]:
        out.append(f"- **moeguard's \"no answer\"** ({full['other_fail']:.0f} per repetition): requests still"
                   " open when the run's deadline came, with no OOM kill involved.")
    out.append("- **The operator's outer loop was not part of this run** (worker processes only, no control plane):"
               " the skew-driven budget halving is not exercised here; the worker's own soft-limit shrink and"
               " overload mode are.")
    return out


def main() -> int:
    meta = json.loads((RAW / "meta.json").read_text())
    policies = list(meta["envs"])
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for p in policies:
        for rep in range(meta["reps"]):
            f = RAW / f"{p}-rep{rep}.json"
            if f.exists():
                runs[p].append(json.loads(f.read_text()))
    stats = {p: [run_stats(d, meta["request_timeout_s"]) for d in runs[p]] for p in policies}
    PLOTS.mkdir(parents=True, exist_ok=True)
    soft, hard = meta["soft_limit"], meta["hard_limit"]

    # 1. memory over time (rep 0), soft and hard limits drawn
    fig, axes = plt.subplots(len(policies), 1, figsize=(7, 6), sharex=True, dpi=80)
    for ax, p in zip(axes, policies, strict=True):
        d = runs[p][0]
        t0 = d["t_traffic"]
        s = [x for x in d["samples"] if "cgroup" in x]
        ax.plot([x["t"] - t0 for x in s], [x["cgroup"] / MiB for x in s], color=COLORS[p], lw=0.8,
                label="cgroup usage")
        for death in d["deaths"]:
            ax.axvline(death["t"] - t0, color="k", ls=":", lw=0.8)
        ax.axhline(soft / MiB, color="tab:blue", ls="--", lw=0.8, label="soft limit")
        ax.axhline(hard / MiB, color="k", ls="-", lw=0.8, label="hard limit (cgroup)")
        ax.set_ylabel("MiB")
        ax.set_title(f"{p} (dotted: OOM kill)", fontsize=9)
    axes[0].legend(fontsize=7, loc="lower right")
    axes[-1].set_xlabel("seconds since traffic start (rep 0)")
    fig.tight_layout()
    fig.savefig(PLOTS / "memory.png")
    plt.close(fig)

    # 2. CDFs of latency and TTFT (all reps pooled)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    for p in policies:
        good = [r for d in runs[p] for r in d["results"] if ok(r)]
        for ax, key in zip(axes, ("latency_s", "ttft_s"), strict=True):
            v = np.sort([r[key] for r in good if r[key] is not None])
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), color=COLORS[p], label=p)
    axes[0].set_xlabel("end-to-end latency, s (successful)")
    axes[1].set_xlabel("time to first token, s (successful)")
    axes[0].set_ylabel("CDF")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOTS / "latency_cdf.png")
    plt.close(fig)

    # 3. budgets and overload timeline (rep 0, moeguard and token-budgets)
    fig, axes = plt.subplots(2, 1, figsize=(7, 4), sharex=True, dpi=80)
    for p in policies:
        d = runs[p][0]
        t0 = d["t_traffic"]
        s = [x for x in d["samples"] if "max_prefill_tokens" in x]
        axes[0].step([x["t"] - t0 for x in s], [x["max_prefill_tokens"] * x.get("shrink_factor", 1.0)
                                                 for x in s], color=COLORS[p], lw=0.8, label=p, where="post")
        axes[1].step([x["t"] - t0 for x in s], [x.get("queue_requests", 0) for x in s], color=COLORS[p],
                     lw=0.8, where="post")
        ov = [x["t"] - t0 for x in s if x.get("overload")]
        axes[1].scatter(ov, [0] * len(ov), color=COLORS[p], marker="|", s=30)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("prefill budget x shrink")
    axes[1].set_ylabel("queue (ticks: overload on)")
    axes[1].set_xlabel("seconds since traffic start (rep 0)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOTS / "budgets_overload.png")
    plt.close(fig)

    # 4. refusals and failures over time (all reps pooled, 2 s bins)
    fig, ax = plt.subplots(figsize=(7, 3), dpi=80)
    bins = [float(x) for x in range(0, 110, 2)]
    for p in policies:
        t429 = [r["end_s"] for d in runs[p] for r in d["results"] if r["status"] in (429, 503) and r["end_s"]]
        tfail = [r["send_s"] or 0 for d in runs[p] for r in d["results"]
                 if not ok(r) and r["status"] not in (429, 503)]
        if t429:
            ax.hist(t429, bins=bins, histtype="step", color=COLORS[p], label=f"{p}: 429/503")
        if tfail:
            ax.hist(tfail, bins=bins, histtype="step", color=COLORS[p], ls=":", label=f"{p}: failed (no answer)")
    ax.set_xlabel("seconds since traffic start (3 reps pooled)")
    ax.set_ylabel("requests per 2 s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOTS / "rejections.png")
    plt.close(fig)

    rows = []
    summary: dict[str, dict[str, Any]] = {}
    for p in policies:
        st = stats[p]
        m = {
            "goodput": med([s["goodput"] for s in st]),
            "lat": [med([s["lat"][i] for s in st]) for i in range(3)],
            "answer": [med([s["answer"][i] for s in st]) for i in range(3)],
            "ttft": [med([s["ttft"][i] for s in st]) for i in range(3)],
            "peak_cgroup": max(s["peak_cgroup"] or 0 for s in st),
            "peak_rss": max(s["peak_rss"] or 0 for s in st),
            "idle_start": med([s["idle_start"] for s in st]), "idle_end": med([s["idle_end"] for s in st]),
            "oom": sum(s["oom"] for s in st), "n429": med([s["n429"] for s in st]),
            "n503": med([s["n503"] for s in st]), "other_fail": med([s["other_fail"] for s in st]),
            "in_stream": med([s["in_stream"] for s in st]),
            **{k: med([s[k] for s in st]) for k in ("fail_kill", "fail_timeout", "fail_deadline")},
            "ok": med([s["ok"] for s in st]), "n": st[0]["n"],
            "refusals": sum(s["refusals"] for s in st),
            "refusals_with_reason": sum(s["refusals_with_reason"] for s in st),
            "bt50": med([s["prefill_tokens_p50"] for s in st]), "bt99": med([s["prefill_tokens_p99"] for s in st]),
        }
        summary[p] = m
        rows.append(f"| {p} | {m['goodput']:.1f} | {m['ok']:.0f}/{m['n']} | {fmt_s(m['lat'][0])} / {fmt_s(m['lat'][1])}"
                    f" / {fmt_s(m['lat'][2])} | {fmt_s(m['answer'][0])} / {fmt_s(m['answer'][1])}"
                    f" / {fmt_s(m['answer'][2])} | {fmt_s(m['ttft'][0])} / {fmt_s(m['ttft'][1])} / {fmt_s(m['ttft'][2])}"
                    f" | {m['peak_cgroup'] / MiB:,.0f} | {m['peak_rss'] / MiB:,.0f} | {m['oom']}"
                    f" | {m['n429']:.0f} / {m['n503']:.0f} / {m['in_stream']:.0f} | {m['other_fail']:.0f} | {m['bt50']} / {m['bt99']} |")

    base, full = summary["request-count"], summary["moeguard"]
    targets = []

    def target(name: str, met: bool, detail: str) -> None:
        targets.append(f"| {name} | {'met' if met else '**missed**'} | {detail} |")

    target("zero OOM kills (moeguard)", full["oom"] == 0, f"{full['oom']} OOM kills over {meta['reps']} reps"
           f" (request-count: {base['oom']}, token-budgets: {summary['token-budgets']['oom']})")
    target("peak ≤ soft limit + 10 %", full["peak_cgroup"] <= soft * 1.1,
           f"peak cgroup usage {full['peak_cgroup'] / MiB:,.0f} MiB vs soft {soft / MiB:,.0f} MiB"
           f" (+10 %: {soft * 1.1 / MiB:,.0f} MiB)")
    if base["lat"][2] and full["lat"][2]:
        r = full["lat"][2] / base["lat"][2]
        ra = full["answer"][2] / base["answer"][2] if base["answer"][2] else float("inf")
        target("p99 latency of successful requests ≤ 0.5× request-count", r <= 0.5,
               f"{full['lat'][2]:.2f} s vs {base['lat'][2]:.2f} s = {r:.2f}× (over all requests, refusals and"
               f" failures at their time to answer: {full['answer'][2]:.2f} s vs {base['answer'][2]:.2f} s"
               f" = {ra:.2f}×)")
    g = full["goodput"] / base["goodput"] if base["goodput"] else float("inf")
    target("goodput ≥ 1.0× request-count", g >= 1.0, f"{full['goodput']:.1f} vs {base['goodput']:.1f} tok/s"
           f" = {g:.2f}×")
    target("every refusal is 429/503 with Retry-After and a reason",
           full["refusals"] == full["refusals_with_reason"] and full["other_fail"] == 0 and full["in_stream"] == 0,
           f"{full['refusals_with_reason']}/{full['refusals']} 429/503 refusals (all reps) carry both; medians per"
           f" rep: {full['in_stream']:.0f} requests refused inside a 200 stream (queue timeout after the"
           f" headers were sent), {full['other_fail']:.0f} with no answer")

    m = meta["machine"]
    tr = meta["traffic"]
    fm = meta["envs"]["moeguard"]
    out = [
        "# Headline experiment: request-count batching vs token budgets vs moeguard",
        "",
        "Generated by `make bench-headline` (`bench/headline.py` runs, `bench/headline_report.py` writes this"
        " file and the plots); no result is edited by hand.",
        "",
        "## Setup",
        "",
        f"- **Machine:** {m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 2**30:.0f} GiB, no GPU;"
        f" Linux {m['kernel']}, Python {m['python']}, torch {m['torch']}. The machine is shared with other"
        " jobs (other sessions' tests ran during the run), so absolute latencies carry their noise; the"
        " policies were interleaved (rotated order per repetition) so none gets a quieter slot.",
        f"- **Model (scale factor):** preset `{meta['preset']}` (99.4 M parameters, float32, 6 layers, D 512,"
        " I 1280, E 8, k 2), seeded random weights, 1 torch thread per worker.",
        f"- **Memory limit:** {meta['hard_limit'] / MiB:,.0f} MiB per worker = hardLimit, enforced by"
        f" {meta['limit_mechanism']}; soft limit {meta['soft_limit'] / MiB:,.0f} MiB (moeguard policy only)."
        " Memory figure: the cgroup's `memory.usage_in_bytes`, which the kernel compares with the limit and"
        " the worker's guard reads (its cgroup is bind-mounted where a container sees it). A killed worker"
        f" restarts after {meta['restart_delay_s']} s (the kubelet's restart, without its back-off). The fresh"
        f" worker, ready and idle, measured {meta.get('idle_measured', 0) / MiB:,.0f} MiB of cgroup usage"
        f" ({meta.get('weights_bytes', 0) / MiB:,.0f} MiB of it weights) before the run.",
        f"- **Traffic (same for every policy and repetition, one schedule of {sum(v['requests'] for v in meta['phases'].values())}"
        f" requests):** trace replay of the first {tr['trace_limit']} requests of"
        f" `azure-llm-inference-2023-conv.csv`, time compression {tr['time_compression']}×, length scale"
        f" {tr['length_scale']}, max_tokens capped at {tr['max_new_tokens_cap']}, context ≤ {tr['max_context']};"
        f" a burst of {tr['burst_n']} at t={tr['burst_at_s']} s ({tr['burst_long_share']:.0%} long:"
        f" {tr['burst_long'][0]}-{tr['burst_long'][1]} tokens, else {tr['burst_short'][0]}-{tr['burst_short'][1]});"
        f" a skew mix at t={tr['skew_at_s']} s ({tr['skew_rps']} req/s for {tr['skew_s']} s,"
        f" {tr['skew_share']:.0%} repetitive prompts); a ramp at t={tr['ramp_at_s']} s from"
        f" {tr['ramp_from_rps']} to {tr['ramp_to_rps']} req/s over {tr['ramp_s']} s. Prompts are real text"
        " (Python docs). Streaming responses (TTFT = first token); requests time out after"
        f" {meta['request_timeout_s']} s and the run ends {meta['drain_s']} s after the last arrival.",
        f"- **Repetitions:** {meta['reps']}; the table quotes medians over repetitions (peaks are the maximum,"
        f" OOM kills the sum). Whole run: {meta.get('elapsed_s', 0) / 60:.1f} min.",
        "",
        "Policies (each only through the worker's environment; full env in `bench/results/headline/meta.json`"
        " when regenerated):",
        "",
        "1. **request-count**: at most 16 requests per batch, 2 batches, no token budget, unbounded queue,"
        " no memory limits, overload off (the seed's \"before\").",
        f"2. **token-budgets**: maxPrefillTokens {meta['plan_budgets']['max_prefill_tokens']} (from"
        " `moeguard plan`), maxDecodeTokens 16, no request cap, unbounded queue, no memory limits.",
        f"3. **moeguard**: `moeguard plan` budgets for the soft limit and {meta['plan_context']:,} context tokens"
        f" per sequence ({meta['plan_budgets']['max_batch_requests']} requests and decode tokens per batch;"
        f" prefill ceiling {meta['plan_budgets']['max_prefill_tokens']}, run at {fm['MOEGUARD_MAX_PREFILL_TOKENS']}"
        f" tokens per step for decode latency), {fm['MOEGUARD_MAX_CONCURRENT_BATCHES']} batch(es) in flight,"
        f" ≤ {fm['MOEGUARD_MAX_LONG_REQUESTS_PER_BATCH']} long request(s) (≥ {fm.get('MOEGUARD_LONG_REQUEST_THRESHOLD_TOKENS', '512')} prompt tokens) per batch, concurrency cap"
        f" {fm['MOEGUARD_MAX_CONCURRENT_REQUESTS']} requests, bounded queue ({fm['MOEGUARD_MAX_QUEUE_REQUESTS']}"
        f" requests, {int(fm['MOEGUARD_MAX_QUEUE_TOKENS']):,} prompt tokens, {fm['MOEGUARD_QUEUE_TIMEOUT_SECONDS']} s"
        " timeout → 429/503 with Retry-After), soft and hard limits, overload mode Auto. Without the"
        " operator's outer loop (no control plane in this run).",
        "",
        "## Results (medians of the repetitions)",
        "",
        "| policy | goodput tok/s | ok | latency (successful) p50 / p95 / p99 s | time to answer (all"
        " requests) p50 / p95 / p99 s | TTFT p50 / p95 / p99 s | peak cgroup MiB"
        " | peak RSS MiB | OOM kills | 429 / 503 / in-stream | no answer | prefill tokens per step p50 / p99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Goodput: completion tokens of successful requests / run wall time. \"In-stream\": HTTP 200 whose"
        " stream ended with an error event instead of tokens (the worker's queue timeout, reached after it"
        " had sent the 200 headers of a streaming response). \"Time to answer\": every request of the"
        " schedule, from its due time to whatever answer it got (a success, a 429/503, an in-stream error, a"
        f" dropped connection); a request that got none counts as the {meta['request_timeout_s']:g} s request"
        " timeout. \"No answer\": requests cut by an"
        " OOM kill, refused connections while the worker restarted, or timeouts. Prefill tokens per step:"
        " from the worker's `moeguard_batch_tokens{phase=\"prefill\"}` histogram (bucket upper bounds, all"
        " worker lives). Peak RSS includes ~530 MiB of file-backed torch libraries that the cgroup does not"
        " charge.",
        "",
        "## Targets (moeguard against request-count)",
        "",
        "| target | result | detail |",
        "|---|---|---|",
        *targets,
        "",
        "## Why (read from the numbers above and the raw runs)",
        "",
        *why(summary, stats, meta, runs["moeguard"]),
        "",
        "![memory](results/plots/memory.png)",
        "![latency](results/plots/latency_cdf.png)",
        "![budgets](results/plots/budgets_overload.png)",
        "![rejections](results/plots/rejections.png)",
        "",
    ]
    RESULTS.write_text("\n".join(out))
    print("\n".join(rows + targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
