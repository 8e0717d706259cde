"""The operator at scale (issue 11 §4): many MoEInferenceServices created at once on the local control plane.

``python -m bench.operator_scale`` (``make bench-scale``) runs, against the cluster of ``$MOEGUARD_RUN_DIR``
(started if needed), with the operator as ``make operator`` runs it (``-A --standalone``, the stack's
Prometheus):

1. **1 service**: Prometheus queries per minute (Prometheus's own
   ``prometheus_http_requests_total{handler="/api/v1/query"}``) over ``--query-minutes``;
2. **200 services** created at once (one ``kubectl create`` of a List; replicas 1, no GPU, small limits, so that
   every kwok pod fits; no workers): seconds until every service is ``Ready``; the operator's RSS (peak and at
   the end, ``/proc/<pid>/status``); then over ``--idle-minutes`` idle: every write the API server served
   (its own ``apiserver_request_total{verb=~"POST|PUT|PATCH|DELETE"}``, by resource), the services whose
   ``resourceVersion`` changed (status rewrites), and Prometheus queries per minute;
3. **1,000 services**: the same figures, and what breaks first.

Writes by the control plane's own parts (kwok's node heartbeats and leases, the controller-manager) are in
the same counter: the report lists every resource, and sums the ones the operator writes (its children, its
status, Events) apart from the others. Extra kwok nodes are added for the pods (and removed at the end).

Results: ``bench/results/operator_scale.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from harness import stack

RESULTS = stack.ROOT / "bench" / "results"
SNAPSHOT_SECONDS = 20.0
"""While idle, the services are listed this often to see which status fields change."""
OPERATOR_RESOURCES = frozenset({"moeinferenceservices", "configmaps", "deployments", "services", "serviceaccounts",
                                "roles", "rolebindings", "poddisruptionbudgets", "events", "podmonitors"})
"""Resources the operator writes (children by server-side apply, its status, Events)."""
WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")
BENCH_NODES = 10
METRICS_PORT = 18089 + int(os.environ.get("MOEGUARD_PORT_OFFSET", "0"))


def service(name: str) -> dict[str, Any]:
    """One small service: replicas 1, no GPU, limits that let hundreds of kwok pods fit."""
    return {"apiVersion": "moeguard.dev/v1alpha1", "kind": "MoEInferenceService", "metadata": {"name": name},
            "spec": {"model": {"preset": "tiny"}, "replicas": 1,
                     "resources": {"gpus": 0, "cpu": "10m", "softLimit": "96Mi", "hardLimit": "128Mi"}}}


def apiserver_writes() -> dict[str, float]:
    """``resource[/subresource] verb`` → requests so far, from the API server's own metrics (writes only)."""
    text = stack.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if labels.get("verb") not in WRITE_VERBS:
            continue
        key = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
        key += f" {labels['verb']}"
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def prometheus_queries() -> float:
    """Instant queries Prometheus has served so far (its own ``prometheus_http_requests_total``)."""
    text = httpx.get(f"{stack.PROMETHEUS_URL}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("prometheus_http_requests_total{") and 'handler="/api/v1/query"' in line)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """The operator's RSS every second: the peak since :meth:`reset` and the last value."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.last, self.stopping = pid, 0, 0, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stopping.wait(1.0):
            try:
                self.last = rss_bytes(self.pid)
            except OSError:
                return
            self.peak = max(self.peak, self.last)

    def reset(self) -> None:
        self.peak = self.last


def add_nodes(count: int) -> list[str]:
    """Extra kwok nodes (110 pods each), so that 1,000 pods fit; returns their names."""
    names = [f"moeguard-bench-{i}" for i in range(count)]
    res = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    for name in names:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
            "labels": {"type": "kwok", "kubernetes.io/hostname": name}}, "status": {"capacity": res, "allocatable": res}}
        stack.kubectl("apply", "-f", "-", stdin=json.dumps(node))
        stack.kubectl("patch", "node", name, "--subresource=status", "--type=merge",
                      "-p", json.dumps({"status": {"capacity": res, "allocatable": res}}))
    return names


def ready_count(namespace: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """(services Ready=True, name → the service as stored) in ``namespace``."""
    items = stack.kubectl_json("-n", namespace, "get", "moeis")["items"]
    ready = sum(1 for o in items if (stack.condition(o, "Ready") or {}).get("status") == "True")
    return ready, {o["metadata"]["name"]: o for o in items}


def status_paths(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The status fields that differ between two versions of one service, pure: ``conditions[TYPE].FIELD``
    for a condition, ``KEY.SUBKEY`` one level into an object, ``KEY`` otherwise; sorted."""
    paths: set[str] = set()
    for key in set(before) | set(after):
        old, new = before.get(key), after.get(key)
        if old == new:
            continue
        if key == "conditions":
            olds = {c.get("type"): c for c in old or []}
            news = {c.get("type"): c for c in new or []}
            for t in set(olds) | set(news):
                a, b = olds.get(t) or {}, news.get(t) or {}
                paths |= {f"conditions[{t}].{f}" for f in set(a) | set(b) if a.get(f) != b.get(f)}
        elif isinstance(old, dict) and isinstance(new, dict):
            paths |= {f"{key}.{sub}" for sub in set(old) | set(new) if old.get(sub) != new.get(sub)}
        else:
            paths.add(key)
    return sorted(paths)


def status_changes(snapshots: list[dict[str, dict[str, Any]]], examples: int = 4) -> dict[str, Any]:
    """What changed in the services' status across consecutive snapshots (each: name → service), pure.

    Returns ``services`` (how many changed at least once), ``paths`` (per :func:`status_paths` path, how many
    times a service's status changed it between two snapshots, most first; ``(no status field)`` for a new
    resourceVersion with the same status, ``(created)`` for a service new in a snapshot) and, for each of the ``examples`` commonest paths, its first change
    (values before and after, strings cut to 300 characters)."""
    changed: set[str] = set()
    counts: dict[str, int] = {}
    pairs: list[tuple[str, dict[str, Any], dict[str, Any], list[str]]] = []
    for before, after in itertools.pairwise(snapshots):
        for name, obj in sorted(after.items()):
            if name not in before:
                changed.add(name)
                counts["(created)"] = counts.get("(created)", 0) + 1
                continue
            if before[name]["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]:
                continue
            changed.add(name)
            paths = status_paths(before[name].get("status") or {}, obj.get("status") or {}) or ["(no status field)"]
            pairs.append((name, before[name], obj, paths))
            for path in paths:
                counts[path] = counts.get(path, 0) + 1
    ranked = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    shown = []
    for top in [p for p in ranked if p != "(created)"][:examples]:
        name, old, new, _ = next(p for p in pairs if top in p[3])
        shown.append({"service": name, "path": top, "before": _at(old, top)[:300], "after": _at(new, top)[:300]})
    return {"services": len(changed), "paths": ranked, "examples": shown}


def _at(obj: dict[str, Any], path: str) -> str:
    status = obj.get("status") or {}
    m = re.fullmatch(r"conditions\[(.*)\]\.(.*)", path)
    if m:
        cond = next((c for c in status.get("conditions") or [] if c.get("type") == m[1]), {})
        return str(cond.get(m[2]))
    key, _, sub = path.partition(".")
    value = status.get(key)
    return str(value.get(sub) if sub and isinstance(value, dict) else value)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v - before.get(k, 0.0) > 0}


def run_scale(count: int, idle_minutes: float, settle_seconds: float, rss: RssSampler, log: Any) -> dict[str, Any]:
    """Create ``count`` services at once in a fresh namespace; measure; delete them."""
    ns = f"mg-scale-{count}-{int(time.time())}"
    stack.kubectl("create", "namespace", ns)
    stack.wait_for(lambda: stack.kubectl("-n", ns, "get", "sa", "default", check=False).returncode == 0, 60, "the SA")
    out: dict[str, Any] = {"services": count}
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": [service(f"s{i:04d}") for i in range(count)]})
    rss.reset()
    start = time.monotonic()
    # One POST per object (`kubectl create`); a client-side `apply` adds a GET and the last-applied annotation,
    # a copy of each object, per service: 84.6 s for 200 in the pilot.
    stack.kubectl("-n", ns, "create", "-f", "-", stdin=body, timeout=600)
    out["create_seconds"] = round(time.monotonic() - start, 1)
    ready, deadline = 0, time.monotonic() + 600
    while time.monotonic() < deadline:
        ready, _ = ready_count(ns)
        if ready == count:
            break
        time.sleep(1)
    out["ready"] = ready
    out["all_ready_seconds"] = round(time.monotonic() - start, 1) if ready == count else None
    out["operator_rss_peak_bytes"] = rss.peak
    print(f"[scale {count}] created in {out['create_seconds']} s, {ready}/{count} Ready after "
          f"{round(time.monotonic() - start, 1)} s, RSS peak {rss.peak / 2**20:.0f} MiB", file=log, flush=True)
    # Settle: a service whose pods export nothing (no workers here) turns from WaitingForMetrics to
    # MetricsUnavailable (one status write and one Warning Event) after max(60 s, 3 x windowSeconds) of blind
    # looks. Those transitions are counted apart; "idle" starts after them.
    settle0 = apiserver_writes()
    time.sleep(settle_seconds)
    writes0, queries0, t0 = apiserver_writes(), prometheus_queries(), time.monotonic()
    out["settle_seconds"] = settle_seconds
    out["settle_writes_by_resource"] = delta(writes0, settle0)
    _, rvs0 = ready_count(ns)
    snapshots = [rvs0]  # every SNAPSHOT_SECONDS: a status that flips and flips back is seen too
    while time.monotonic() - t0 < idle_minutes * 60:
        time.sleep(min(SNAPSHOT_SECONDS, max(0.0, idle_minutes * 60 - (time.monotonic() - t0))))
        snapshots.append(ready_count(ns)[1])
    writes1, queries1, minutes = apiserver_writes(), prometheus_queries(), (time.monotonic() - t0) / 60
    ready_end, rvs1 = ready_count(ns)
    snapshots.append(rvs1)
    writes = delta(writes1, writes0)
    changes = status_changes(snapshots)
    out |= {
        "idle_status_changes": changes,
        "idle_minutes": round(minutes, 2),
        "idle_writes_by_resource": writes,
        "idle_operator_writes": sum(v for k, v in writes.items() if k.split("/")[0].split(" ")[0] in OPERATOR_RESOURCES),
        "idle_other_writes": sum(v for k, v in writes.items() if k.split("/")[0].split(" ")[0] not in OPERATOR_RESOURCES),
        "idle_status_rewrites": changes["services"],
        "ready_at_end": ready_end,
        "prometheus_queries_per_minute": round((queries1 - queries0) / minutes, 1),
        "operator_rss_bytes": rss.last,
        "operator_rss_peak_bytes": rss.peak,
    }
    print(f"[scale {count}] idle {minutes:.1f} min: operator writes {out['idle_operator_writes']:g}, others "
          f"{out['idle_other_writes']:g}, status rewrites {out['idle_status_rewrites']}, queries/min "
          f"{out['prometheus_queries_per_minute']}, RSS {rss.last / 2**20:.0f} MiB", file=log, flush=True)
    start = time.monotonic()
    stack.kubectl("delete", "namespace", ns, "--wait=true", timeout=900)
    out["delete_seconds"] = round(time.monotonic() - start, 1)
    return out


def queries_with_one(query_minutes: float) -> float:
    ns = f"mg-scale-1-{int(time.time())}"
    stack.kubectl("create", "namespace", ns)
    stack.kubectl("-n", ns, "apply", "-f", "-", stdin=json.dumps(service("one")))
    stack.wait_for(lambda: ready_count(ns)[0] == 1, 120, "one service Ready")
    time.sleep(15)
    q0, t0 = prometheus_queries(), time.monotonic()
    time.sleep(query_minutes * 60)
    rate = (prometheus_queries() - q0) / ((time.monotonic() - t0) / 60)
    stack.kubectl("delete", "namespace", ns, "--wait=true", timeout=300)
    return round(rate, 1)


def report(results: dict[str, Any]) -> str:
    one = results["queries_per_minute_1_service"]
    lines = ["# The operator at scale", "",
             f"Generated by `make bench-scale` (`bench/operator_scale.py`) on {results['date']}; "
             f"{results['machine']}. Local control plane (kube-apiserver, kwok pods, no workers), the operator as "
             "`make operator` runs it (`-A --standalone`, one Prometheus). Each service: replicas 1, no GPU.",
             "", "| figure | target | " + " | ".join(f"{r['services']} services" for r in results["runs"]) + " |",
             "|---|---|" + "---|" * len(results["runs"])]

    def row(label: str, target: str, fn: Any) -> None:
        lines.append(f"| {label} | {target} | " + " | ".join(str(fn(r)) for r in results["runs"]) + " |")

    row("create (one `kubectl create` of a List), s", "", lambda r: r["create_seconds"])
    row("all Ready after, s", "≤ 60 (200)", lambda r: r["all_ready_seconds"] if r["all_ready_seconds"] is not None
        else f"never ({r['ready']} Ready)")
    row("operator RSS peak / idle, MiB", "≤ 200", lambda r: f"{r['operator_rss_peak_bytes'] / 2**20:.0f} / "
                                                          f"{r['operator_rss_bytes'] / 2**20:.0f}")
    row("idle minutes measured", "5", lambda r: r["idle_minutes"])
    row("API writes by the operator's resources while idle", "0", lambda r: f"{r['idle_operator_writes']:g}")
    row("other API writes while idle (kwok heartbeats, leases, controllers)", "", lambda r: f"{r['idle_other_writes']:g}")
    row("services whose object changed while idle", "0", lambda r: r["idle_status_rewrites"])
    row("Prometheus queries / min", f"≤ 2 × {one} (1 service)", lambda r: r["prometheus_queries_per_minute"])
    row("queries / min ratio to 1 service", "≤ 2", lambda r: round(r["prometheus_queries_per_minute"] / one, 1)
        if one else "n/a")
    row("delete all (namespace), s", "", lambda r: r["delete_seconds"])
    lines += ["", f"Prometheus queries per minute with 1 service: {one}.", "",
              "Idle writes by resource (API server's `apiserver_request_total`, writes only):", ""]
    for r in results["runs"]:
        lines.append(f"- {r['services']} services: " + (", ".join(f"{k} {v:g}" for k, v in
                                                                   r["idle_writes_by_resource"].items()) or "none"))
    lines += ["", "Writes while settling (after all Ready, before idle; transitions such as WaitingForMetrics -> "
              "MetricsUnavailable):", ""]
    for r in results["runs"]:
        settle = r.get("settle_writes_by_resource")
        lines.append(f"- {r['services']} services: " + ("not measured (a run before the settle phase)" if settle is None
                                                        else ", ".join(f"{k} {v:g}" for k, v in settle.items()) or "none"))
    lines += ["", f"Status fields that changed while idle (changes per field between listings every "
              f"{SNAPSHOT_SECONDS:g} s; runs before session 12 counted the changed services only):", ""]
    for r in results["runs"]:
        ch = r.get("idle_status_changes")
        if ch is None:
            lines.append(f"- {r['services']} services: not recorded")
            continue
        lines.append(f"- {r['services']} services: " + (", ".join(f"`{k}` {v}" for k, v in ch["paths"].items())
                                                        or "none"))
        lines += [f"  - e.g. {e['service']} `{e.get('path', '')}`: `{e['before']}` -> `{e['after']}`"
                  for e in ch["examples"]]
    lines += ["", "## Notes", "", *(f"- {n}" for n in results.get("notes", [])), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.operator_scale", description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="200,1000", help="service counts, comma-separated (default %(default)s)")
    parser.add_argument("--idle-minutes", type=float, default=5.0)
    parser.add_argument("--query-minutes", type=float, default=2.0, help="minutes to count queries with 1 service")
    parser.add_argument("--settle-seconds", type=float, default=150.0,
                        help="seconds after all are Ready before idle counting starts (the blind services' one "
                             "WaitingForMetrics -> MetricsUnavailable transition falls in it; default %(default)s)")
    parser.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS / "operator_scale",
                        help="results path without suffix: .json and .md are written (default %(default)s)")
    args = parser.parse_args(argv)
    pids = stack.RUN_DIR / "pids" / "pod-workers.pid"
    if pids.exists() and Path(f"/proc/{pids.read_text().strip()}").exists():
        raise SystemExit("hack/pod_workers.py is running: it would start a worker per pod; stop it first")
    stack.script("cluster-up.sh")
    stack.apply_crds()
    nodes = add_nodes(BENCH_NODES)
    log_path = stack.RUN_DIR / "logs" / "operator-scale.log"
    log_path.unlink(missing_ok=True)
    proc = stack.start_operator(log_path, args=("-A", "--standalone", "--metrics-port", str(METRICS_PORT)))
    rss = RssSampler(proc.pid)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "machine": f"{os.cpu_count()} CPUs", "notes": args.note, "runs": []}
    try:
        time.sleep(5)
        results["queries_per_minute_1_service"] = queries_with_one(args.query_minutes)
        print(f"[scale 1] {results['queries_per_minute_1_service']} queries/min", file=sys.stderr, flush=True)
        for count in (int(c) for c in args.counts.split(",")):
            results["runs"].append(run_scale(count, args.idle_minutes, args.settle_seconds, rss, sys.stderr))
            assert proc.poll() is None, f"the operator exited: see {log_path}"
    finally:
        stack.stop_process(proc)
        for name in nodes:
            stack.kubectl("delete", "node", name, "--wait=false", check=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
