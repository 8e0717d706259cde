"""``bench/RESULTS.md`` from the four-arm headline's raw runs (``bench/results/headline_loop/``).

``python -m bench.headline_loop_report [--pilot]``. Everything in the file is computed here from
the JSON the runs wrote; nothing is edited by hand. ``--pilot`` writes
``bench/results/headline_loop_pilot.md`` instead, labelled as a pilot.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from bench.headline_loop import ARMS
from bench.slo import Slo, meets, percentile, slo_goodput, succeeded, tpot, ttft

ROOT = Path(__file__).resolve().parents[1]
SLO = Slo(ttft_s=3.0, tpot_s=0.25)
"""Chosen for a 2-core CPU (2 shared cores, the small preset in float32) where a served request decodes at
~50-150 ms per token and a short queue wait plus prefill takes 1-2 s; fixed across arms and hosts (a slower host's
steps put the TPOT objective out of reach of most requests: :func:`host_regime` says where it sits)."""
MiB = 2**20


def outcome(r: dict[str, Any]) -> str:
    """What happened to one request: ``ok``, ``refused`` (429/503), ``in-stream`` (an error event in a
    200 stream), ``cut`` (the connection broke after it was accepted: a kill), ``no-endpoint``
    (connection refused), ``timeout``, ``deadline`` (not finished by the run's end) or ``status-N``."""
    if succeeded(r):
        return "ok"
    status, err = r.get("status"), str(r.get("error") or "")
    if err.startswith(("not sent", "cancelled")):  # the loadgen's own: the run's end came first
        return "deadline"
    if status in (429, 503):
        return "refused"
    if status is not None and 200 <= status < 300:
        return "in-stream"
    if status is not None:
        return f"status-{status}"
    if err.startswith("ConnectError"):
        return "no-endpoint"
    if "Timeout" in err:
        return "timeout"
    return "cut"


def served(rs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[float], list[float]]:
    """The requests that succeeded, and their TTFTs and TPOTs (seconds; those that have one)."""
    ok = [r for r in rs if succeeded(r)]
    return ok, [v for r in ok if (v := ttft(r)) is not None], [v for r in ok if (v := tpot(r)) is not None]


def arm_figures(run: dict[str, Any], duration: float) -> dict[str, Any]:
    rs = run["results"]
    ok, t1, t2 = served(rs)
    kinds = Counter(outcome(r) for r in rs)
    lat = [float(r["end_s"]) - float(r["send_s"]) for r in ok if r.get("send_s") is not None]
    return {"slo_goodput": slo_goodput(rs, SLO, duration), "meets": sum(1 for r in rs if meets(r, SLO)),
            "tok_s": sum(int(r.get("completion_tokens") or 0) for r in ok) / duration,
            "lat_p50": percentile(lat, 50), "lat_p99": percentile(lat, 99),
            "ok": len(ok), "n": len(rs), "ttft_p50": percentile(t1, 50), "ttft_p99": percentile(t1, 99),
            "tpot_p50": percentile(t2, 50), "tpot_p99": percentile(t2, 99), "kinds": dict(kinds),
            "rep": run.get("rep"), "oom_kills": run["oom_kills"], "restarts": run["restarts"], "pods_replaced": run.get("pods_replaced", 0),
            "peak_mib": (run.get("peak_memory_bytes") or 0) / MiB}


def window_goodput(run: dict[str, Any], lo: float, hi: float) -> float:
    """SLO goodput of the requests due in [lo, hi) seconds of the schedule."""
    rs = [r for r in run["results"] if lo <= r["scheduled_s"] < hi]
    return sum(1 for r in rs if meets(r, SLO)) / (hi - lo) if hi > lo else 0.0


def med(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def f(v: float | None, nd: int = 2) -> str:
    return "n/a" if v is None else f"{v:,.{nd}f}"


def per_rep(figs: list[dict[str, Any]], reps: int) -> list[float | None]:
    """An arm's SLO goodput for repetitions 0 to ``reps - 1`` by number (``arm_figures``' ``rep``), None for one
    whose run failed: a gap, not a shift of the later repetitions into its column."""
    by_rep = {x["rep"]: x["slo_goodput"] for x in figs}
    return [by_rep.get(i) for i in range(reps)]


def ratio_row(full: list[dict[str, Any]], inner: list[dict[str, Any]], reps: int) -> str:
    """The per-repetition table's row of full-moeguard's SLO goodput over the inner loop's, paired by repetition
    (:func:`per_rep`): a repetition either arm lacks or where the inner loop met none is n/a."""
    return "| full-moeguard / inner-loop | " + " | ".join(
        f"{a / b:.2f}×" if a is not None and b else "n/a"
        for a, b in zip(per_rep(full, reps), per_rep(inner, reps), strict=True)) + " |"


def host_regime(runs: list[dict[str, Any]]) -> str:
    """One sentence on where the fixed SLOs sit on this host: the inner loop's served requests, their TPOT median
    against the objective and the shares that met each objective (pooled over its repetitions). The SLOs are absolute
    (:data:`SLO`), so a host with slower steps moves every arm's figures, and the ratios between arms rest on fewer
    requests."""
    ok, t1, t2 = served([r for run in runs for r in run["results"]])
    if not t1 or not t2:
        return "Where the SLOs sit on this host: not measured (no inner-loop request served)."
    p50 = percentile(t2, 50) or 0.0
    return (f"Where the SLOs sit on this host: the inner loop's served requests ({len(ok)} over its repetitions) decoded "
            f"at a TPOT median of {p50:.3f} s against the {SLO.tpot_s:g}-s objective; "
            f"{sum(v <= SLO.tpot_s for v in t2) / len(t2):.0%} of them met TPOT and "
            f"{sum(v <= SLO.ttft_s for v in t1) / len(t1):.0%} met TTFT. The SLOs are fixed across hosts: a host with "
            "slower steps moves every arm's figures, and the ratios then rest on fewer requests.")


def refusals(runs: list[dict[str, Any]]) -> list[str]:
    """Every 429/503 answer of an arm's runs: status, Retry-After present or not, reason; counted."""
    c: Counter[tuple[Any, bool, str]] = Counter()
    for run in runs:
        for r in run["results"]:
            if outcome(r) in ("refused", "in-stream"):
                c[(r.get("status"), r.get("retry_after") is not None, str(r.get("error") or "")[:90])] += 1
    return [f"{n} × {st}, Retry-After {'yes' if ra else '**no**'}: {why}" for (st, ra, why), n in c.most_common()]


def render(meta: dict[str, Any], runs: dict[str, list[dict[str, Any]]], pilot: bool, note: str = "") -> str:
    duration = meta["duration_s"]
    cfg = meta["traffic"]
    figs = {a: [arm_figures(r, duration) for r in runs[a]] for a in runs}

    def m(arm: str, key: str) -> float | None:
        return med([x[key] for x in figs.get(arm, [])])

    lines = [
        "# Headline: request-count vs static budgets vs the inner loop vs full moeguard (operator in the loop)"
        + (" — PILOT (shortened; not the committed result)" if pilot else ""),
        "",
        "Generated by `make bench-headline` (`bench/headline_loop.py` runs, `bench/headline_loop_report.py` writes this "
        "file); no result is edited by hand." + (f" {note}" if note else ""),
        "",
        "## Setup",
        "",
        f"- **Machine:** {meta['machine']['cpu']}, {meta['machine']['cores']} cores, no GPU; Linux {meta['machine']['kernel']}, "
        f"torch {meta['machine']['torch']}. Shared with other engineers' jobs: absolute latencies carry their noise; the arms "
        "run in rotated order per repetition so that none always gets the quietest slot.",
        f"- **Model:** preset `{meta['preset']}` (float32, seeded random weights), **{meta['replicas']} replicas** per arm, "
        "1 torch thread each.",
        f"- **Memory:** hardLimit {meta['hard_limit'] // MiB:,} MiB per replica = the pod's memory limit, enforced by a memory "
        f"cgroup (kernel OOM kill); softLimit {meta['soft_limit'] // MiB:,} MiB. A killed worker restarts after "
        f"{meta['restart_delay_s']:g} s (the kubelet's first back-off). Idle served worker measured {meta['idle_measured'] / MiB:,.0f} MiB.",
        "- **How each arm runs:** arms 1–3 are bare worker processes (`bench/headline_worker.py`: the same cgroup limit, the "
        "same restart rule); arm 4 runs on the local control plane: a MoEInferenceService applied with kubectl, the operator "
        "(`make operator`'s command line), Prometheus (scrape 5 s), the kwok pod harness (`hack/pod_workers.py`: cgroup, "
        "restarts, pod status). Every arm reaches its replicas through the same load balancer: each request goes to a replica "
        "whose `/readyz` answered 200 at the last look (every 0.5 s), round-robin, as a Service's endpoints.",
        f"- **Traffic (the same schedule for every arm and repetition):** the first {cfg['window_s']:g} s of "
        f"`azure-llm-inference-2023-conv.csv`, every {cfg['thin']}th request ({meta['n_requests']} requests), **time compression "
        f"{cfg['time_compression']:g}×** ({cfg['window_s']:g} s of trace in {duration:g} s), lengths × {cfg['length_scale']:g}, "
        f"max_tokens ≤ {cfg['max_new_tokens_cap']}, context ≤ {cfg['max_context'] + 1}; prompts of real text (Python docs); "
        f"streaming. Requests time out after {meta['request_timeout_s']:g} s; the run ends {meta['drain_s']:g} s after the last arrival.",
        f"- **Regime changes:** at {cfg['leak_at']:.0%} of the run ({cfg['leak_at'] * duration:.1f} s) a native leak of "
        f"{meta['leak_mib_s']:g} MiB/s starts in one replica (the worker's leak fault; the replica holding the fault's lock "
        f"file; when it dies the next worker to look takes it over); at {cfg['skew_at']:.0%} ({cfg['skew_at'] * duration:.1f} s) "
        f"a tenant switches to repetitive prompts: every {cfg['skew_every']}nd request from then on ({meta['n_skewed']} requests).",
        f"- **SLOs (fixed across arms):** TTFT ≤ {SLO.ttft_s:g} s and TPOT ≤ {SLO.tpot_s:g} s. **SLO goodput** = requests that "
        f"succeeded and met both, per second of the schedule ({duration:g} s): DistServe's definition. Goodput tok/s: "
        "completion tokens of successful requests per second of the schedule (the earlier headline's figure). \"Cut by a "
        "kill\": accepted, then the connection broke (a kill or a restart's SIGTERM); \"no endpoint\": connection refused; "
        "\"open at the end\": still streaming when the run ended.",
        f"- **Repetitions:** {meta['reps']}; tables quote medians over repetitions (OOM kills and restarts: the sum; peaks: the "
        f"maximum). Whole run: {meta.get('elapsed_s', 0) / 60:.1f} min.",
        "",
        "Arms (the worker's environment in `bench/results/headline_loop/meta.json`):",
        "",
        "1. **request-count**: at most 16 requests per batch, 2 batches, no token budget, unbounded queue, no memory limits "
        "known to the worker, overload off (the seed's \"before\").",
        f"2. **static-budgets**: `moeguard plan`'s maxPrefillTokens {meta['plan_budgets']['max_prefill_tokens']}, decode 16, "
        "no request cap, unbounded queue.",
        "3. **inner-loop**: the moeguard worker with everything the full arm's spec gives it (plan budgets, concurrency cap, "
        "bounded queue with a 2 s timeout, soft/hard limits, overload Auto), no operator.",
        "4. **threshold-loop** and 5. **full-moeguard**: the same worker settings as the spec of a MoEInferenceService "
        f"(`{json.dumps(meta['full_spec']['batching'])}`) and `control` `{json.dumps(meta['full_spec']['control'])}`, the "
        "other control fields default (window 30 s, leakHorizonSeconds 12 h). "
        + ("The ceilings are where the outer loop may loosen the spec's (the plan's) budgets; a worker alone keeps the "
           "spec's budgets, and the inner-loop arm's concurrency cap is the same as the loop arms' (room for the "
           "ceiling's batch plus the queue). stabilizationWindowSeconds 15, cooldownSeconds 10 and increaseStep 0.25: "
           "the defaults (120 s, 30 s, 0.1) scaled to the trace's 8x time compression (two moves from the spec's "
           "budgets to the ceilings instead of ten), else no loosening could happen inside the run. "
           + ("queryIntervalSeconds 5: one look per Prometheus scrape (the default 10 s scaled by 8 would look "
              "between scrapes). " if meta["full_spec"]["control"].get("queryIntervalSeconds") else "")
           if meta["full_spec"]["batching"].get("ceilings") else "")
        + "Why the other four differ from the defaults: leakAction Restart is the ask (a drained restart "
        "before the hard limit); leakWindowSeconds 30 (its minimum) because a pod's RSS slope counts only after it has run one "
        "leak window and the default 600 s is longer than this time-compressed run (the operator's clocks are not "
        "compressed); skewThreshold 32 because real text on this random-weight model reaches 30-s maxima of 6-10 "
        "(repetitive prompts: 100-384); rssSoftFraction 0.9 because the default 0.8 sits below softLimit/hardLimit "
        "(0.85) and made the operator cut every budget while the worker ran at its own soft limit (pilot). maxPrefillTokens' "
        "floor is 64 (the plan's 256 per step is the default floor). The two loop arms differ only in the operator's "
        "`--policy`: **threshold-loop** runs `threshold` (issue 11's policy: halve on a crossed threshold, overload from "
        "the refusal rate), **full-moeguard** runs `predictive` (issue 30: tighten only what the predicted step peak "
        "says will not fit, overload from SLO attainment; `spec.slo` at its defaults)."
        + " The loop arms' operators own overload mode: under `predictive` the budget document's "
        "`overloadQueueTrigger` is false, so a full queue no longer turns the workers' own overload mode on (it halved "
        "decode in every bare arm with overload Auto: the inner loop's workers ran it from the first seconds); memory "
        "still does, and the operator turns it on from SLO attainment. Under `threshold` the workers keep the queue "
        "trigger."
        + (f" Both operators run with `--leak-warmup-seconds {meta['leak_warmup_s']:g}` (default 90): the leaking "
           "replica dies about 86 s after its pod started, before a 90-s warm-up and the leak window could judge it."
           if meta.get("leak_warmup_s") is not None else "")
        + (f" Each loop arm's service runs {meta['loop_warmup_s']:g} s ready and idle before its traffic (one leak "
           "window, a scrape and a look: until every pod has that history the operator is blind by design); the bare "
           "arms read no history and start at once; the leak starts at the same point of the traffic in every arm."
           if meta.get("loop_warmup_s") else ""),
        "",
        "## Results (medians of the repetitions)",
        "",
        "| arm | SLO goodput req/s | met SLO / ok / all | goodput tok/s | latency (successful) p50 / p99 s "
        "| TTFT p50 / p99 s | TPOT p50 / p99 s | OOM kills | restarts | pods replaced "
        "| cut by a kill | no endpoint | 429/503 | in-stream | timeout | open at the end | peak memory MiB (soft / hard) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in ARMS:
        if a not in figs:
            continue
        fs = figs[a]

        def k(kind: str, fs: list[dict[str, Any]] = fs) -> str:
            return f(med([x["kinds"].get(kind, 0) for x in fs]), 0)

        lines.append(
            f"| {a} | {f(m(a, 'slo_goodput'))} | {f(m(a, 'meets'), 0)} / {f(m(a, 'ok'), 0)} / {fs[0]['n']} | "
            f"{f(m(a, 'tok_s'), 1)} | {f(m(a, 'lat_p50'))} / {f(m(a, 'lat_p99'))} | "
            f"{f(m(a, 'ttft_p50'))} / {f(m(a, 'ttft_p99'))} | {f(m(a, 'tpot_p50'), 3)} / {f(m(a, 'tpot_p99'), 3)} | "
            f"{sum(x['oom_kills'] for x in fs)} | {sum(x['restarts'] for x in fs)} | {sum(x['pods_replaced'] for x in fs)} | "
            f"{k('cut')} | {k('no-endpoint')} | {k('refused')} | {k('in-stream')} | {k('timeout')} | {k('deadline')} | "
            f"{max(x['peak_mib'] for x in fs):,.0f} ({meta['soft_limit'] // MiB:,} / {meta['hard_limit'] // MiB:,}) |")
    lines += ["", "SLO goodput per repetition (req/s), side by side:", "",
              "| arm | " + " | ".join(f"rep {i}" for i in range(meta["reps"])) + " |",
              "|---|" + "---|" * meta["reps"]]
    for a in ARMS:
        if a in figs:
            lines.append(f"| {a} | " + " | ".join(f(g) for g in per_rep(figs[a], meta["reps"])) + " |")
    if "full-moeguard" in figs and "inner-loop" in figs:
        lines.append(ratio_row(figs["full-moeguard"], figs["inner-loop"], meta["reps"]))
    lines += ["", host_regime(runs.get("inner-loop", []))]
    full, inner, rc = m("full-moeguard", "slo_goodput"), m("inner-loop", "slo_goodput"), m("request-count", "slo_goodput")
    threshold = m("threshold-loop", "slo_goodput")
    full_ooms = [x["oom_kills"] for x in figs.get("full-moeguard", [])]

    def ratio(a: float | None, b: float | None) -> str:
        return "n/a" if a is None or not b else f"{a / b:.2f}×"

    def verdict(ok: bool, measured: bool) -> str:
        return "not measured" if not measured else "met" if ok else "**missed**"

    lines += [
        "", "## Targets", "", "| target | result | detail |", "|---|---|---|",
        f"| full moeguard: 0 OOM kills in every repetition | {verdict(not any(full_ooms), bool(full_ooms))} | "
        f"per repetition: {full_ooms} |",
        f"| SLO goodput ≥ 3× request-count | {verdict(full is not None and rc is not None and full >= 3 * rc, full is not None and rc is not None)} | "
        f"{f(full)} vs {f(rc)} req/s = {ratio(full, rc)} |",
        f"| SLO goodput ≥ 1.2× inner-loop only | {verdict(full is not None and inner is not None and full >= 1.2 * inner, full is not None and inner is not None)} | "
        f"{f(full)} vs {f(inner)} req/s = {ratio(full, inner)} |",
        f"| (side by side) predictive vs threshold loop | {'measured' if full is not None and threshold is not None else 'not measured'} | "
        f"{f(full)} vs {f(threshold)} req/s = {ratio(full, threshold)} |",
        "",
        "## Where the outer loop wins or loses (SLO goodput by stretch of the schedule, medians)",
        "",
    ]
    cuts = [0.0, cfg["leak_at"] * duration, cfg["skew_at"] * duration, duration]
    names = ["before the leak", "leak, no skew", "leak and skew"]
    lines += ["| arm | " + " | ".join(f"{n} ({lo:.0f}–{hi:.0f} s)" for n, lo, hi in zip(names, cuts, cuts[1:], strict=False)) + " |",
              "|---|---|---|---|"]
    for a in ARMS:
        if a in runs:
            lines.append(f"| {a} | " + " | ".join(
                f(med([window_goodput(r, lo, hi) for r in runs[a]])) for lo, hi in itertools.pairwise(cuts)) + " |")
    lines += ["", "### The operator's actions in the loop arms (Events, per repetition)", ""]
    for r in [*runs.get("threshold-loop", []), *runs.get("full-moeguard", [])]:
        evs = [e for e in r.get("events", []) if e.get("reason") not in ("Reconciled",)]
        terms = r.get("terminations", [])
        lines.append(f"- {r['arm']} rep {r['rep']}: " + ("; ".join(f"{e['reason']}: {str(e['message'])[:160]}" for e in evs[:8]) or "no Events")
                     + (f". Terminations: {', '.join(str(t.get('reason')) + ' ' + str(t.get('pod', ''))[-5:] for t in terms)}" if terms else ""))
    lines += ["", "## Refusals (all repetitions): status, Retry-After, reason", ""]
    for a in ARMS:
        if a in runs:
            lines.append(f"- **{a}**: " + ("; ".join(refusals(runs[a])) or "none"))
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--raw", type=Path, default=ROOT / "bench" / "results" / "headline_loop")
    ap.add_argument("--pilot", action="store_true")
    ap.add_argument("--output", type=Path, default=None,
                    help="where to write (default: bench/RESULTS.md, or the pilot's file with --pilot)")
    ap.add_argument("--note", default="", help="a line under the title (e.g. which branches a pilot ran on)")
    args = ap.parse_args(argv)
    meta = json.loads((args.raw / "meta.json").read_text())
    runs: dict[str, list[dict[str, Any]]] = {}
    failed: list[str] = []
    for a in ARMS:
        for rep in range(meta["reps"]):
            p = args.raw / f"{a}-rep{rep}.json"
            if p.exists():
                run = json.loads(p.read_text())
                if "error" in run:
                    failed.append(f"{a} rep {rep}: {run['error']}")
                else:
                    runs.setdefault(a, []).append(run)
    text = render(meta, runs, args.pilot, args.note)
    if failed:
        text += "\n## Runs that failed (left out above)\n\n" + "\n".join(f"- {x}" for x in failed) + "\n"
    out = args.output or (ROOT / "bench" / "results" / "headline_loop_pilot.md" if args.pilot else ROOT / "bench" / "RESULTS.md")
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
