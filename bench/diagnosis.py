"""The diagnosis drill benchmark (issue 14): time from an incident's onset to the right finding, per kind,
and wrong findings; and the false positives of calm runs of the shared trace.

``python -m bench.diagnosis [--reps 3] [--calm-minutes 10]`` (``make bench-diagnosis``) writes
``bench/results/diagnosis.json`` and ``bench/diagnosis.md``.

Everything runs as a user would run it: the local control plane and Prometheus (``hack/cluster-up.sh``,
scrape interval 2 s), the operator as the Makefile's ``operator`` target starts it, the kwok pod harness.
The drills are :mod:`bench.diagnosis_drills`; each repetition runs every kind at once, one namespace each
(six workers on this machine's two cores: the times are those of a loaded machine). The calm run replays
the first ``--calm-minutes`` of the shared Azure conversation trace (real arrival times; lengths × 0.5,
at most 4,095 tokens of context and 32 new tokens) against one service of the drills' spec, sized as
a user would size it (the default ``rssSoftFraction`` 0.8 of its 2 GiB ``hardLimit``), and counts every
finding that appears (status polled every second, and the finding Events).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from harness import control_plane as cp
from harness import stack
from harness.loadgen import load_schedule
from harness.loadgen.client import replay
from harness.loadgen.stats import summarize as summarize_run

from bench import diagnosis_drills as drills
from bench.headline import machine

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"
REPORT = ROOT / "bench" / "diagnosis.md"
CALM_LENGTH_SCALE = 0.5
CALM_MAX_CONTEXT = 4095
CALM_MAX_NEW_TOKENS = 32


def calm_run(minutes: float, namespace: str, log: Any = print) -> dict[str, Any]:
    """``minutes`` of the shared trace against one service; every finding seen is a false positive."""
    name = "calm"
    schedule = load_schedule(time_compression=1.0, length_scale=CALM_LENGTH_SCALE, max_context=CALM_MAX_CONTEXT,
                             max_new_tokens_cap=CALM_MAX_NEW_TOKENS)
    requests = [r for r in schedule.requests if r.arrival_s < minutes * 60]
    cp.create_namespace(namespace)
    out: dict[str, Any] = {"minutes": minutes, "requests": len(requests), "length_scale": CALM_LENGTH_SCALE,
                           "max_context": CALM_MAX_CONTEXT, "max_new_tokens": CALM_MAX_NEW_TOKENS}
    watch = None
    try:
        urls = cp.start_service(namespace, name, drills.BASE_SPEC)
        watch = drills.Watch(namespace, name)
        watch.start()
        time.sleep(drills.warmup_seconds(drills.BASE_SPEC))
        log(f"calm: replaying {len(requests)} requests of the trace over {minutes} min")
        run = asyncio.run(replay(list(urls.values()), requests, progress=False, request_timeout_s=120.0))
        out["statuses"] = summarize_run(run).by_status
        time.sleep(2 * drills.BASE_SPEC["control"]["queryIntervalSeconds"])
    finally:
        if watch is not None:
            watch.stop()
            kinds = {k for _, ks in watch.changes for k in ks}
            events = drills.finding_events(namespace, name)
            out["findings"] = sorted(kinds | {r for r, _ in events})
            out["finding_events"] = events
            out["first_seen"] = {k: watch.first[k][1].get("message") for k in watch.first}
        cp.stop_service(namespace, name)
        cp.delete_namespace(namespace, wait=False)
    return out


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind: the median time to the right finding over the drills that found it, and the wrong ones."""
    rows = []
    for kind in drills.KINDS:
        mine = [r for r in results if r["kind"] == kind]
        times = [r["seconds_to_finding"] for r in mine if r["seconds_to_finding"] is not None]
        rows.append({"kind": kind, "drills": len(mine), "found": len(times),
                     "median_s": statistics.median(times) if times else None,
                     "max_s": max(times) if times else None,
                     "within_deadline": sum(1 for t in times if t <= drills.DEADLINE_S),
                     "wrong": sorted({w for r in mine for w in r["wrong"]}),
                     "errors": [r["error"] for r in mine if r["error"]]})
    return rows


def report(res: dict[str, Any]) -> str:
    lines = ["# Diagnosis drills (issue 14)", "",
             f"`python -m bench.diagnosis --reps {res['reps']} --calm-minutes {res['calm_minutes']}` "
             f"(`make bench-diagnosis`), {time.strftime('%Y-%m-%d', time.gmtime(res['started_unix']))}; "
             f"{res['machine']['cpu']}, {res['machine']['cores']} cores, no GPU; elapsed "
             f"{res['elapsed_s'] / 60:.1f} min.", "",
             "Each repetition runs the six drills at once, one namespace and one worker each "
             "(`bench/diagnosis_drills.py`: onset = the injection; the right finding must appear in "
             f"`status.diagnosis` within {drills.DEADLINE_S:.0f} s; any other finding kind seen from the service's "
             "start to the end of the drill, in status or as an Event, is a wrong finding). "
             f"Spec: `{json.dumps(drills.BASE_SPEC)}`; `rssSoftFraction` set {drills.SOFT_MARGIN_BYTES >> 20} MiB "
             "above each worker's steady memory after the warm-up.", "",
             "| kind | drills | right finding | median s to finding | max s | wrong findings | errors |",
             "|---|---|---|---|---|---|---|"]
    for row in res["summary"]:
        median = "–" if row["median_s"] is None else f"{row['median_s']:.1f}"
        worst = "–" if row["max_s"] is None else f"{row['max_s']:.1f}"
        lines.append(f"| {row['kind']} | {row['drills']} | {row['within_deadline']}/{row['drills']} within "
                     f"{drills.DEADLINE_S:.0f} s | {median} | {worst} | {', '.join(row['wrong']) or 'none'} | "
                     f"{len(row['errors'])} |")
    lines += ["", "`AllocatorFragmentation`: no drill (it needs a GPU's caching allocator; no GPU here); its rule is "
              "unit-tested only.", "", "## Every drill", "",
              "| rep | kind | s to finding | wrong | rssSoftFraction | finding message |", "|---|---|---|---|---|---|"]
    for r in res["drills"]:
        msg = ((r.get("finding") or {}).get("message") or r.get("error") or "").replace("|", "/")
        lines.append(f"| {r['rep']} | {r['kind']} | {r['seconds_to_finding']} | {', '.join(r['wrong']) or 'none'} | "
                     f"{r['rss_soft_fraction']} | {msg[:220]} |")
    calm = res.get("calm")
    if calm:
        lines += ["", "## Calm run", "",
                  f"{calm['minutes']} min of the shared trace ({calm['requests']} requests, lengths × "
                  f"{calm['length_scale']}, at most {calm['max_context']} tokens of context and {calm['max_new_tokens']} "
                  f"new tokens; answers {calm.get('statuses')}): **{len(calm.get('findings', []))} false positive "
                  f"finding kind(s)**{': ' + ', '.join(calm['findings']) if calm.get('findings') else ''}."]
        for kind, message in (calm.get("first_seen") or {}).items():
            lines.append(f"- {kind}: {message}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calm-minutes", type=float, default=10.0)
    ap.add_argument("--kinds", default=",".join(drills.KINDS), help="comma-separated drill kinds")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--keep-cluster", action="store_true")
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    t0 = time.monotonic()
    cp.cluster_up()
    operator = cp.start_operator(stack.RUN_DIR / "logs" / "bench-operator.log")
    stack.pod_workers("start")
    res: dict[str, Any] = {"reps": args.reps, "calm_minutes": args.calm_minutes, "machine": machine(),
                           "started_unix": time.time(), "drills": []}
    tag = uuid.uuid4().hex[:4]
    try:
        for rep in range(args.reps):
            for r in drills.run_round(kinds, f"bench-diag-{tag}-{rep}"):
                res["drills"].append({**r.as_dict(), "rep": rep})
        if args.calm_minutes > 0:
            res["calm"] = calm_run(args.calm_minutes, f"bench-diag-{tag}-calm")
    finally:
        stack.stop_process(operator)
        stack.pod_workers("stop")
        if not args.keep_cluster:
            stack.script("cluster-down.sh")
    res["elapsed_s"] = time.monotonic() - t0
    res["summary"] = summarize(res["drills"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diagnosis.json").write_text(json.dumps(res, indent=1))
    REPORT.write_text(report(res))
    print(report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
