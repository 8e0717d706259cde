"""Control latency of the closed loop (issue 11 §3; issue 30 for ``--policy predictive``), on the local control plane.

``python -m bench.control_latency [--skew-reps 10] [--recovery-reps 2] [--oom-reps 3]`` (``make
bench-control``) writes ``bench/results/control_latency.json`` and ``.md``: the operator's default policy
(``threshold``), the measurements below. ``python -m bench.control_latency --policy predictive [--skew-reps 3]
[--step-reps 5] [--oom-reps 3]`` (``make bench-control-predictive``) runs the operator with ``--policy predictive``
and writes ``bench/results/control_latency_predictive.json`` and ``.md``: the three measurements of
:func:`skew_room_rep`, :func:`step_rep` and the OOM kill, with issue 30's targets (:mod:`bench.control_predictive`).

Everything runs as a user would run it: the cluster and Prometheus (``hack/cluster-up.sh``, its
scrape interval set to 5 s), the operator started as the Makefile's ``operator`` target does, the
kwok pod harness (``hack/pod_workers.py start``), one MoEInferenceService per repetition applied
with kubectl (2 replicas of the ``tiny`` preset, the default ``control`` spec but a skew threshold of
32 (see :data:`SPEC`): query interval 10 s, window 30 s, cooldown 30 s, stabilization 120 s). Budgets are read where they
act: each worker's ``/metrics`` (``moeguard_budget_*``), every 0.25 s.

* **Skew step**: steady traffic of real-text prompts (2 requests/s); once the budgets sit at their
  ceilings, the prompts switch to repetitive ones (expert skew rises). Latency: from the first
  skewed request's send to the moment every worker runs a lower ``maxPrefillTokens``.
* **Recovery** (the last ``--recovery-reps`` skew steps): the skew stops 10 s after the budgets
  tightened and real text continues; time from the last skewed request until every worker's
  budgets are back at their ceilings, and the direction changes of ``maxPrefillTokens`` (a
  step down then a climb is 1; any more is oscillation).
* **OOM kill**: the leak fault (``MOEGUARD_TEST_FAULTS=1``, anonymous memory at
  ``--oom-leak-mib-s``) in one replica only (``MOEGUARD_FAULT_LEAK_LOCK_FILE``: the file is created,
  one worker claims it, the file is removed so that no other worker claims it after the kill); the
  kernel kills that worker at the pod's memory limit (needs the harness's memory cgroup). Kill
  time: the pod's ``lastState.terminated.finishedAt`` (second precision, so the latency is an
  overestimate by < 1 s); latency to the moment every surviving worker runs a lower budget.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from harness import control_plane as cp
from harness import stack

from bench import control_predictive as pred
from bench.control_stats import all_reached, direction_changes, steps, summary
from bench.headline import machine
from bench.steady_traffic import SteadyTraffic

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"
NAMESPACE = "bench-control"
SCRAPE_S = 5
RPS = 2.0
WARMUP_S = 20.0
SKEW_TIMEOUT_S = 120.0
RECOVERY_TIMEOUT_S = 600.0
SKEW_HOLD_S = 10.0
POLL_S = 0.25
SPEC: dict[str, Any] = {
    "model": {"preset": "tiny"}, "replicas": 2,
    "resources": {"gpus": 0, "cpu": "1", "softLimit": "1536Mi", "hardLimit": "2Gi"},
    "control": {"skewThreshold": 32},
}
"""The default spec but for the model, replicas, limits (no GPU: the workers run on this CPU) and
``control.skewThreshold`` 32: real text on this random-weight model reaches 30-s maxima of 6-10 now
and then (a pilot at 8 saw 10.25 during a recovery and tightened again), above the default 4, which
would keep the budgets from ever recovering; repetitive prompts measure 384. The other ``control``
and all ``batching`` fields are the defaults."""


GENERATION = "moeguard_budget_generation"
SHRINK = "moeguard_budget_shrink_factor"
IDLE = "moeguard_memory_idle_footprint_bytes"
CORRECTION = "moeguard_memory_prediction_correction_ratio"
PREDICTIVE_EXTRAS = (GENERATION, SHRINK, IDLE, CORRECTION)
"""Worker gauges the predictive measurements read beside the budgets: the budget document in effect (its
generation), the worker's own soft-limit shrink factor (it scales the budget gauges: the operator's documents are
told by their generation), and the memory model's inputs (idle footprint, bytes; correction factor)."""
SKEW_HOLD_S = 60.0
"""Skew with room: seconds the skewed prompts are held (more than 2 query intervals + the window: 50 s)."""
STEP_TIMEOUT_S = 120.0
STEP_SETTLE_S = 10.0
"""A step: seconds the long prompts continue after the needed budget is in effect at every worker."""
STATUS_POLL_S = 2.0


def worker_reading(values: dict[str, float]) -> dict[str, float] | None:
    """One scrape's metrics keyed as :class:`BudgetPoller` stores them: a budget gauge by its budget's name
    (``moeguard_budget_max_prefill_tokens`` -> ``max_prefill_tokens``), anything else by its metric name;
    None for an empty scrape (the worker did not answer)."""
    if not values:
        return None
    out: dict[str, float] = {}
    for n, v in values.items():
        short = n.removeprefix(cp.BUDGET_PREFIX)
        out[short if n.startswith(cp.BUDGET_PREFIX) and short in cp.BUDGET_NAMES else n] = v
    return out


class BudgetPoller(threading.Thread):
    """Reads every worker's budget gauges each :data:`POLL_S` s: ``series[pod][budget]`` is a list of
    (Unix time, value); with ``extras``, those metrics too (``series[pod][metric name]``), from the same scrape."""

    def __init__(self, urls: Callable[[], dict[str, str]], extras: tuple[str, ...] = ()) -> None:
        super().__init__(daemon=True)
        self.urls = urls
        self.extras = extras
        self.series: dict[str, dict[str, list[tuple[float, float]]]] = {}
        self.down: dict[str, float] = {}
        self._halt = threading.Event()

    def _read(self, url: str, client: httpx.Client) -> dict[str, float] | None:
        if not self.extras:
            return cp.budgets(url, client)
        return worker_reading(cp.metric_values(url, tuple(cp.BUDGET_PREFIX + n for n in cp.BUDGET_NAMES) + self.extras,
                                               client))

    def run(self) -> None:
        with httpx.Client(trust_env=False) as client:
            while not self._halt.is_set():
                for pod, url in self.urls().items():
                    b = self._read(url, client)
                    t = time.time()
                    if b is None:
                        self.down.setdefault(pod, t)
                        continue
                    for name, v in b.items():
                        self.series.setdefault(pod, {}).setdefault(name, []).append((t, v))
                self._halt.wait(POLL_S)

    def of(self, budget: str, pods: list[str] | None = None) -> dict[str, list[tuple[float, float]]]:
        return {p: list(s.get(budget, [])) for p, s in list(self.series.items()) if pods is None or p in pods}

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


class StatusPoller(threading.Thread):
    """Reads the MoEInferenceService's status each :data:`STATUS_POLL_S` s (``kubectl get``): ``items`` is a
    list of (Unix time, status)."""

    def __init__(self, name: str) -> None:
        super().__init__(daemon=True)
        self.name = name
        self.items: list[tuple[float, dict[str, Any]]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            with contextlib.suppress(Exception):  # a slow apiserver: the next poll
                self.items.append((time.time(), dict(stack.get_moeis(NAMESPACE, self.name).get("status") or {})))
            self._halt.wait(STATUS_POLL_S)

    def between(self, start: float, end: float) -> list[tuple[float, dict[str, Any]]]:
        return [(t, st) for t, st in list(self.items) if start <= t <= end]

    def stop(self) -> None:
        self._halt.set()
        self.join(15)


def wait_until(pred: Callable[[], Any], timeout_s: float, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return None


def start_service(name: str, spec: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, str]:
    return cp.start_service(NAMESPACE, name, spec, env)


def stop_service(name: str) -> None:
    cp.stop_service(NAMESPACE, name)


def at_ceiling(poller: BudgetPoller, pods: list[str], ceiling: dict[str, float]) -> bool:
    for pod in pods:
        s = poller.series.get(pod, {})
        if any(not s.get(n) or s[n][-1][1] != v for n, v in ceiling.items()):
            return False
    return True


def skew_rep(i: int, recovery: bool) -> dict[str, Any]:
    """One skew step (and its recovery when ``recovery``)."""
    name = f"skew-{i}"
    urls = start_service(name, SPEC)
    pods = sorted(urls)
    poller = BudgetPoller(lambda: {p: u for p, u in cp.workers(NAMESPACE, name).items() if p in pods})
    traffic = SteadyTraffic(lambda: [urls[p] for p in pods], RPS)
    poller.start()
    traffic.start()
    out: dict[str, Any] = {"rep": i, "service": name, "pods": pods}
    try:
        time.sleep(WARMUP_S)
        ceiling = {n: s[-1][1] for n, s in poller.series.get(pods[0], {}).items()}
        out["ceiling"] = ceiling
        t_switch = time.time()
        traffic.skewed = True
        prefill0 = ceiling.get("max_prefill_tokens")
        tightened = wait_until(lambda: all_reached(poller.of("max_prefill_tokens", pods), t_switch,
                                                   lambda v: prefill0 is not None and v < prefill0), SKEW_TIMEOUT_S)
        t0 = traffic.first_skewed_after(t_switch)
        out["first_skewed_unix"] = t0
        out["tightened_unix"] = tightened
        out["skew_latency_s"] = None if tightened is None or t0 is None else tightened - t0
        if recovery and tightened is not None:
            time.sleep(SKEW_HOLD_S)
            traffic.skewed = False
            t_end = traffic.last_skewed()
            back = wait_until(lambda: at_ceiling(poller, pods, ceiling) and time.time(), RECOVERY_TIMEOUT_S, 1.0)
            out["last_skewed_unix"] = t_end
            out["recovered_unix"] = back
            if back is not None and t_end is not None:
                back_all = max(all_reached(poller.of(n, pods), t_end, lambda v, c=c: v == c) or back
                               for n, c in ceiling.items())
                out["recovery_s"] = back_all - t_end
            seq = {p: steps([(t, v) for t, v in s if t >= t_switch]) for p, s in poller.of("max_prefill_tokens", pods).items()}
            out["prefill_steps"] = seq
            out["direction_changes"] = {p: direction_changes(v) for p, v in seq.items()}
        else:
            traffic.skewed = False
        out["traffic_statuses"] = dict(traffic.statuses)
        out["status_budgets"] = stack.get_moeis(NAMESPACE, name).get("status", {}).get("budgets")
    finally:
        traffic.stop()
        poller.stop()
        stop_service(name)
    print(f"skew rep {i}: latency {out.get('skew_latency_s')} s"
          + (f", recovery {out.get('recovery_s')} s, direction changes {out.get('direction_changes')}" if recovery else ""),
          flush=True)
    return out


def memory_cgroup_limit(pid: int) -> int | None:
    """The memory limit of the cgroup process ``pid`` runs in (v1 ``memory.limit_in_bytes`` or v2
    ``memory.max``), None when it has none or cannot be read."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        for f in ([Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.limit_in_bytes"] if "memory" in ctrls.split(",")
                  else [Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max"] if ctrls == "" else []):
            with contextlib.suppress(OSError, ValueError):
                v = f.read_text().strip()
                if v != "max" and int(v) < 1 << 50:
                    return int(v)
    return None


def harness_confines(name: str) -> bool:
    """Whether the harness runs ``name``'s workers in a memory cgroup (its state file names one, or
    the pids it lists run in a cgroup with a memory limit)."""
    state = json.loads((stack.RUN_DIR / "workers.json").read_text())
    mine = [w for k, w in state.items() if k.startswith(f"{NAMESPACE}/") and w.get("moeis") == name]
    return any(w.get("cgroup") or ("pid" in w and memory_cgroup_limit(int(w["pid"])) is not None) for w in mine)


def oom_rep(i: int, leak_mib_s: float) -> dict[str, Any]:
    name = f"oom-{i}"
    lock = stack.RUN_DIR / f"bench-leak-{name}.lock"
    lock.unlink(missing_ok=True)
    env = {"MOEGUARD_TEST_FAULTS": "1", "MOEGUARD_FAULT_LEAK_ANON_BYTES_PER_SECOND": str(int(leak_mib_s * 2**20)),
           "MOEGUARD_FAULT_LEAK_LOCK_FILE": str(lock)}
    urls = start_service(name, SPEC, env)
    pods = sorted(urls)
    out: dict[str, Any] = {"rep": i, "service": name, "pods": pods}
    if not harness_confines(name):
        stop_service(name)
        out["skipped"] = "the harness does not run the workers in a memory cgroup (no kernel kill possible)"
        print(f"oom rep {i}: skipped: {out['skipped']}", flush=True)
        return out
    poller = BudgetPoller(lambda: {p: u for p, u in cp.workers(NAMESPACE, name).items() if p in pods})
    traffic = SteadyTraffic(lambda: list(cp.workers(NAMESPACE, name).values()), RPS)  # a restart moves the port
    poller.start()
    traffic.start()
    try:
        time.sleep(WARMUP_S)
        restarts0 = {p["metadata"]["name"]: cp.terminations(p)[0] for p in cp.pods(NAMESPACE, name)}
        before = {p: {n: s[-1][1] for n, s in poller.series.get(p, {}).items()} for p in pods}
        lock.touch()
        claimed = wait_until(lambda: lock.read_text().strip(), 10, 0.05)
        lock.unlink(missing_ok=True)  # no second claim after the kill
        out["leaker_pid"] = claimed

        def killed() -> tuple[str, dict[str, Any]] | None:
            for p in cp.pods(NAMESPACE, name):
                n, term = cp.terminations(p)
                if n > restarts0.get(p["metadata"]["name"], 0) and term:
                    return p["metadata"]["name"], term
            return None

        hit = wait_until(killed, 2**30 / (leak_mib_s * 2**20) + 60, 0.5)
        if hit is None:
            out["error"] = "no kill seen in pod status (restartCount, lastState.terminated)"
            return out
        dead, term = hit
        t_kill = cp.parse_time(term["finishedAt"])
        survivors = [p for p in pods if p != dead]
        out.update({"killed_pod": dead, "terminated": term, "kill_unix": t_kill, "survivors": survivors,
                    "worker_down_seen_unix": poller.down.get(dead)})

        def lower(pod: str) -> float | None:
            """When ``pod`` first ran any budget below what it ran before the leak (from 1 s before
            the kill: finishedAt is truncated to the second)."""
            times: list[float] = []
            for n, s in poller.series.get(pod, {}).items():
                b0 = before[pod].get(n)
                times += [t for t, v in s if t >= t_kill - 1 and b0 is not None and v < b0]
            return min(times) if times else None

        got = wait_until(lambda: all(lower(p) is not None for p in survivors), 60)
        if got:
            t_tight = max(lower(p) or 0.0 for p in survivors)
            out["tightened_unix"] = t_tight
            out["oom_latency_s"] = t_tight - t_kill
            if poller.down.get(dead):
                out["oom_latency_from_seen_down_s"] = t_tight - poller.down[dead]
        status = stack.get_moeis(NAMESPACE, name).get("status", {})
        out["last_adjustment"] = status.get("lastAdjustment")
        out["traffic_statuses"] = dict(traffic.statuses)
    finally:
        lock.unlink(missing_ok=True)
        traffic.stop()
        poller.stop()
        stop_service(name)
    print(f"oom rep {i}: kill {out.get('killed_pod')} ({(out.get('terminated') or {}).get('reason')}), "
          f"latency {out.get('oom_latency_s')} s", flush=True)
    return out


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)


def _events(name: str) -> list[dict[str, Any]]:
    try:
        return [{"reason": e.get("reason"), "type": e.get("type"), "message": e.get("message"),
                 "time": e.get("lastTimestamp") or e.get("eventTime"), "count": e.get("count")}
                for e in stack.events(NAMESPACE, name)]
    except Exception as exc:
        return [{"reason": "error", "message": str(exc)}]


def skew_room_rep(i: int, hold_s: float) -> dict[str, Any]:
    """Skew with room to spare (issue 30): :data:`SPEC` (softLimit 1,536 MiB; the tiny preset's predicted peak at
    the ceilings under the skew is ~490 MiB, :mod:`bench.control_predictive`), real text for :data:`WARMUP_S` s,
    then repetitive prompts for ``hold_s`` s. Every worker's budget gauges over the hold: the target is no change
    (0). Also recorded, so that no change is not blindness: the highest ``status.observed.skewRatio`` the operator
    reported, the diagnosis' RoutingSkew finding and Event, each pod's predicted headroom."""
    name = f"room-{i}"
    urls = start_service(name, SPEC)
    pods = sorted(urls)
    poller = BudgetPoller(lambda: {p: u for p, u in cp.workers(NAMESPACE, name).items() if p in pods}, PREDICTIVE_EXTRAS)
    status = StatusPoller(name)
    traffic = SteadyTraffic(lambda: [urls[p] for p in pods], RPS)
    for t in (poller, status, traffic):
        t.start()
    out: dict[str, Any] = {"rep": i, "service": name, "pods": pods, "hold_s": hold_s}
    try:
        time.sleep(WARMUP_S)
        t_switch = time.time()
        traffic.skewed = True
        time.sleep(hold_s)
        t_end = time.time()
        traffic.skewed = False
        t0 = traffic.first_skewed_after(t_switch)
        out.update({"first_skewed_unix": t0, "hold_end_unix": t_end})
        start = t0 if t0 is not None else t_switch
        per_pod = {p: {n: pred.window(s, start, t_end) for n, s in poller.series.get(p, {}).items() if n in cp.BUDGET_NAMES}
                   for p in pods}
        out["budget_changes"] = {p: pred.budget_changes(b) for p, b in per_pod.items()}
        out["budgets_seen"] = {p: {n: steps(s) for n, s in b.items()} for p, b in per_pod.items()}
        out["generation_changes"] = {p: pred.changes(pred.window(poller.series.get(p, {}).get(GENERATION, []), start, t_end))
                                     for p in pods}
        out["shrink_factors"] = {p: steps(pred.window(poller.series.get(p, {}).get(SHRINK, []), start, t_end))
                                 for p in pods}
        held = status.between(start, t_end)
        out["status_budget_changes"] = pred.value_changes([st.get("budgets") for _, st in held])
        out["overload_modes"] = pred.collapsed([st.get("overloadMode") for _, st in held])
        out["max_skew_ratio"] = pred.max_skew(held)
        out["min_headroom_bytes"] = pred.min_headroom(held)
        out["finding_kinds"] = pred.finding_kinds(held)
        events = _events(name)
        out["events"] = events
        out["routing_skew_events"] = sum(1 for e in events if e.get("reason") == "RoutingSkew")
        out["budget_events"] = [e for e in events if e.get("reason") in ("BudgetTightened", "BudgetRelaxed")]
        out["traffic_statuses"] = dict(traffic.statuses)
        out["status"] = held[-1][1] if held else None
    finally:
        traffic.stop()
        status.stop()
        poller.stop()
        stop_service(name)
    changes = sum(out.get("budget_changes", {}).values()) if "budget_changes" in out else None
    out["changes_total"] = changes
    print(f"skew-with-room rep {i}: budget changes {out.get('budget_changes')}, operator's skew ratio "
          f"{out.get('max_skew_ratio')}, RoutingSkew events {out.get('routing_skew_events')}, findings "
          f"{out.get('finding_kinds')}, least headroom {(out.get('min_headroom_bytes') or 0) / 2**20:.0f} MiB", flush=True)
    return out


def calibrate_step() -> dict[str, Any]:
    """The step's softLimit: a service of the step's spec with room (:data:`pred.CALIBRATION_SOFT_LIMIT`), no
    request sent; once both workers report their idle footprint (and correction factor), the softLimit is the
    predicted peak of the largest of them at maxPrefillTokens :data:`pred.STEP_FRACTION` of its ceiling under
    the long prompts (:func:`pred.soft_limit_for`)."""
    name = "calibrate"
    urls = start_service(name, pred.step_spec(pred.CALIBRATION_SOFT_LIMIT))
    out: dict[str, Any] = {"service": name, "pods": sorted(urls)}
    try:
        def read() -> dict[str, dict[str, float]] | None:
            got = {p: cp.metric_values(u, (IDLE, CORRECTION)) for p, u in urls.items()}
            return got if all(IDLE in g for g in got.values()) else None

        got = wait_until(read, 60, 1.0)
        if got is None:
            raise RuntimeError("calibration: no idle footprint (moeguard_memory_idle_footprint_bytes) within 60 s")
        idle = max(g[IDLE] for g in got.values())
        corr = max((g[CORRECTION] for g in got.values() if CORRECTION in g), default=None)
        soft = pred.soft_limit_for(idle, corr)
        out.update({"readings": got, "idle_bytes": idle, "correction": corr, "soft_limit_bytes": soft,
                    "soft_limit": pred.quantity(soft)})
    finally:
        stop_service(name)
    print(f"step calibration: idle footprint {out['idle_bytes'] / 2**20:.0f} MiB, correction {out['correction']}: "
          f"softLimit {out['soft_limit']}", flush=True)
    return out


def _expected(spec: dict[str, Any], poller: BudgetPoller, pods: list[str], at: float) -> dict[str, Any]:
    """The needed budgets by the memory model from each worker's idle footprint and correction read at or
    before ``at``, under the long prompts (:func:`pred.needed_budgets`)."""
    loads = []
    for p in pods:
        s = poller.series.get(p, {})
        idle, corr = pred.latest(s.get(IDLE, []), at), pred.latest(s.get(CORRECTION, []), at)
        if idle is None:
            return {"error": f"{p}: no idle footprint read"}
        loads.append(pred.load_of(p, idle, pred.LONG_PROMPT_TOKENS + pred.OUTPUT_TOKENS, corr))
    top = pred.ceiling_budgets(spec)
    need = pred.needed_budgets(spec, loads)
    return {"inputs": {ld.pod: {"idle_bytes": ld.idle_footprint_bytes, "correction": ld.correction} for ld in loads},
            "at_ceilings": [pred.predict(spec, top, ld).describe() for ld in loads],
            "needed": need.model_dump(by_alias=True),
            "at_needed": [pred.predict(spec, need, ld).describe() for ld in loads]}


def step_rep(i: int, soft_limit: str, settle_s: float) -> dict[str, Any]:
    """A step that would not fit (issue 30): :func:`pred.step_spec` at ``soft_limit``; once the operator predicts
    every pod (``status.observed.predictedMemory``: it has each idle footprint; no request yet, so its window is
    empty and holds only the step's requests from then on), real-text prompts of :data:`pred.LONG_PROMPT_TOKENS`
    tokens at :data:`RPS`/s. The step's predicted peak at the ceilings is over the softLimit (the 4,096-token
    causal mask), so the policy cuts maxPrefillTokens to the largest that fits. Latency: from the first long
    request's send to the moment every worker runs the budget document (``moeguard_budget_generation``) of the
    operator's first cut. Also recorded: the cut vs the ceiling (the ratio) and vs the memory model's needed
    value computed here from each worker's idle footprint and correction (before the step and at the cut), and
    further cuts within ``settle_s`` s."""
    name = f"step-{i}"
    spec = pred.step_spec(soft_limit)
    urls = start_service(name, spec)
    pods = sorted(urls)
    poller = BudgetPoller(lambda: {p: u for p, u in cp.workers(NAMESPACE, name).items() if p in pods}, PREDICTIVE_EXTRAS)
    status = StatusPoller(name)
    traffic = SteadyTraffic(lambda: [urls[p] for p in pods], RPS, long_prompt_tokens=pred.LONG_PROMPT_TOKENS,
                            max_tokens=pred.OUTPUT_TOKENS)
    traffic.long = True
    poller.start()
    status.start()
    top = pred.ceiling_budgets(spec)
    ceiling = {_camel(n): float(getattr(top, n)) for n in cp.BUDGET_NAMES}
    out: dict[str, Any] = {"rep": i, "service": name, "pods": pods, "soft_limit": soft_limit, "ceiling": ceiling}
    try:
        ready = wait_until(lambda: status.items and set(pods) <= pred.predicted_pods(status.items[-1][1]), 90, 0.5)
        out["predicted_before"] = ready and (status.items[-1][1].get("observed") or {}).get("predictedMemory")
        t_switch = time.time()
        out["expected_before"] = _expected(spec, poller, pods, t_switch)
        traffic.start()

        def cut() -> pred.Generation | None:
            return pred.first_below(pred.generations(status.between(t_switch, time.time())), ceiling, "maxPrefillTokens")

        first = wait_until(cut, STEP_TIMEOUT_S, 0.5)
        t0 = traffic.first_long_after(t_switch)
        out["first_long_unix"] = t0
        if first is None or t0 is None:
            out["error"] = f"no maxPrefillTokens cut in status within {STEP_TIMEOUT_S:g} s"
            return out
        out["cut"] = {"generation": first.generation, "seen_unix": first.seen_unix, "budgets": first.budgets}
        out["cut_ratio"] = first.budgets["maxPrefillTokens"] / ceiling["maxPrefillTokens"]
        out["cut_budgets_changed"] = sorted(n for n, v in first.budgets.items() if ceiling.get(n) is not None and v != ceiling[n])
        out["expected_at_cut"] = _expected(spec, poller, pods, first.seen_unix)
        in_effect = wait_until(lambda: all_reached(poller.of(GENERATION, pods), t_switch,
                                                   lambda v: v >= first.generation), 60, 0.25)
        if in_effect is None:
            out["error"] = f"generation {first.generation} not in effect at every worker within 60 s"
            return out
        out["in_effect_unix"] = in_effect
        out["step_latency_s"] = in_effect - t0
        out["cut_seen_in_status_s"] = first.seen_unix - t0
        time.sleep(settle_s)
        t_end = time.time()
        gens = pred.generations(status.between(t_switch, t_end))
        out["generations"] = [{"generation": g.generation, "seen_s": g.seen_unix - t0, "budgets": g.budgets} for g in gens]
        out["prefill_steps"] = {p: steps(pred.window(poller.series.get(p, {}).get("max_prefill_tokens", []), t_switch, t_end))
                                for p in pods}
        out["shrink_factors"] = {p: steps(pred.window(poller.series.get(p, {}).get(SHRINK, []), t_switch, t_end))
                                 for p in pods}
        last = status.items[-1][1] if status.items else {}
        out["last_adjustment"] = last.get("lastAdjustment")
        out["predicted_after"] = (last.get("observed") or {}).get("predictedMemory")
    finally:
        out["traffic_statuses"] = dict(traffic.statuses)
        traffic.stop()
        status.stop()
        poller.stop()
        stop_service(name)
        need = (out.get("expected_at_cut") or {}).get("needed", {}).get("maxPrefillTokens")
        print(f"step rep {i}: latency {out.get('step_latency_s')} s, maxPrefillTokens {ceiling['maxPrefillTokens']:g} -> "
              f"{(out.get('cut') or {}).get('budgets', {}).get('maxPrefillTokens')} (ratio {out.get('cut_ratio')}; "
              f"the model's needed at the cut {need})" + (f"; {out['error']}" if out.get("error") else ""), flush=True)
    return out


def report(res: dict[str, Any]) -> str:
    """The Markdown report of a run."""
    skew = [r["skew_latency_s"] for r in res["skew"] if r.get("skew_latency_s") is not None]
    rec = [r for r in res["skew"] if "recovery_s" in r or "recovered_unix" in r]
    oom = [r["oom_latency_s"] for r in res["oom"] if r.get("oom_latency_s") is not None]
    s, o = summary(skew), summary(oom)

    lines = [
        "# Control latency of the closed loop" + (" (PILOT: shortened run, not the committed result)" if res["pilot"] else ""),
        "",
        "Generated by `make bench-control` (`bench/control_latency.py`); nothing edited by hand.",
        "",
        "## Setup",
        "",
        f"- Machine: {res['machine']}; shared with other jobs (absolute times carry their noise)."
        + (f" {res['note']}" if res.get("note") else ""),
        f"- Local control plane (`hack/cluster-up.sh`), Prometheus scrape interval {SCRAPE_S} s, the operator as `make operator` "
        f"runs it, kwok pods backed by `hack/pod_workers.py` workers. Each repetition applies a fresh MoEInferenceService "
        f"(`{json.dumps(SPEC)}`, every other `control` and `batching` field at its default: query interval 10 s, window 30 s, "
        "decrease ×0.5, cooldown 30 s, stabilization 120 s, increase +10 % of the ceiling). skewThreshold is 32 "
        "instead of the default 4: real text on this random-weight model reaches 30-s maxima of 6-10 now and then (a "
        "pilot at 8 saw 10.25 mid-recovery and tightened again), which keeps the budgets from ever recovering; repetitive "
        "prompts measure 384. The threshold changes what counts as skew, not how fast the loop acts on it.",
        f"- Traffic: {RPS:g} requests/s round-robin over the 2 workers, 384-token prompts, 8 output tokens; real text "
        f"(Python docs) for {WARMUP_S:g} s, then repetitive prompts (one letter pattern: most tokens go to few experts).",
        f"- Budgets read from each worker's `/metrics` (`moeguard_budget_*`) every {POLL_S} s.",
        "",
        "## Results",
        "",
        "| measurement | n | median s | max s | target | verdict |",
        "|---|---|---|---|---|---|",
        f"| skew step: first skewed request → every worker runs the lower maxPrefillTokens | {s['n']}/{len(res['skew'])} | "
        f"{_seconds(s['median'])} | {_seconds(s['max'])} | median ≤ 25 s | {verdict(s['median'], 25)} |",
        f"| OOM kill: lastState.terminated.finishedAt → every surviving worker runs lower budgets | {o['n']}/{len(res['oom'])} | "
        f"{_seconds(o['median'])} | {_seconds(o['max'])} | median ≤ 10 s | {verdict(o['median'], 10)} |",
        "",
        "Skew steps, each: " + ", ".join(_seconds(r.get("skew_latency_s")) for r in res["skew"]) + " s.",
        "",
        "### Recovery (skew stopped 10 s after the budgets tightened; real text continues)",
        "",
        "| rep | last skewed request → all budgets back at their ceilings, s | maxPrefillTokens steps per worker | direction changes per worker |",
        "|---|---|---|---|",
    ]
    for r in rec:
        seqs = "; ".join(f"{' → '.join(f'{v:g}' for v in seq)}" for seq in r.get("prefill_steps", {}).values())
        dc = ", ".join(str(n) for n in r.get("direction_changes", {}).values())
        lines.append(f"| {r['rep']} | {_seconds(r.get('recovery_s'))} | {seqs} | {dc} |")
    lines += ["", "Direction changes: flips between moving down and moving up along a worker's maxPrefillTokens from the "
              "first skewed request until it is back at its ceiling. One descent (the skew may still be in the 30 s window "
              "after it stops, so there can be a second halving) followed by one monotone climb is 1; more is oscillation.",
              "", "### OOM kills", ""]
    lines += oom_lines(res["oom"])
    lines += ["", f"Whole run: {res['elapsed_s'] / 60:.1f} min.", ""]
    return "\n".join(lines)


def _seconds(v: Any) -> str:
    """Seconds to one decimal, ``n/a`` for None."""
    return "n/a" if v is None else f"{v:.1f}"


def oom_lines(reps: list[dict[str, Any]]) -> list[str]:
    """The report's "OOM kills" bullets, one per repetition (both policies' reports)."""
    lines = []
    for r in reps:
        if r.get("skipped") or r.get("error"):
            lines.append(f"- rep {r['rep']}: {r.get('skipped') or r.get('error')}")
            continue
        term = r.get("terminated") or {}
        adj = r.get("last_adjustment") or {}
        lines.append(f"- rep {r['rep']}: {r['killed_pod']} terminated `{term.get('reason')}` exit {term.get('exitCode')} at "
                     f"{term.get('finishedAt')}; survivors tightened after {_seconds(r.get('oom_latency_s'))} s "
                     f"(from the worker seen down: {_seconds(r.get('oom_latency_from_seen_down_s'))} s); "
                     f"the operator's lastAdjustment: {adj.get('reason', 'n/a')!s}")
    return lines


def report_predictive(res: dict[str, Any]) -> str:
    """The Markdown report of a ``--policy predictive`` run (issue 30's three targets)."""
    room = [r for r in res["skew_room"] if r.get("changes_total") is not None]
    step = [r["step_latency_s"] for r in res["step"] if r.get("step_latency_s") is not None]
    oom = [r["oom_latency_s"] for r in res["oom"] if r.get("oom_latency_s") is not None]
    s, o = summary(step), summary(oom)
    total = sum(r["changes_total"] for r in room) if room else None
    cal = res.get("calibration") or {}

    def mib(v: Any) -> str:
        return "n/a" if v is None else f"{v / 2**20:,.0f} MiB"

    lines = [
        "# Control latency of the closed loop, `--policy predictive`"
        + (" (PILOT: shortened run, not the committed result)" if res["pilot"] else ""),
        "",
        "Generated by `make bench-control-predictive` (`bench/control_latency.py --policy predictive`); nothing edited "
        "by hand. Targets: issue 30, 'Measure' item 2. The threshold policy's results are `control_latency.md`.",
        "",
        "## Setup",
        "",
        f"- Machine: {res['machine']}; shared with other jobs (absolute times carry their noise)."
        + (f" {res['note']}" if res.get("note") else ""),
        f"- Local control plane (`hack/cluster-up.sh`), Prometheus scrape interval {SCRAPE_S} s, the operator as `make operator` "
        "runs it with `--policy predictive`, kwok pods backed by `hack/pod_workers.py` workers, a fresh "
        "MoEInferenceService per repetition (query interval 10 s, window 30 s, cooldown 30 s: the defaults).",
        f"- Budgets read from each worker's `/metrics` every {POLL_S} s (`moeguard_budget_*`, the budget document's "
        f"generation, the worker's own soft-limit shrink factor, its idle footprint and correction factor); the "
        f"service's status every {STATUS_POLL_S:g} s.",
        f"- Skew with room: `{json.dumps(res['spec'])}`; {RPS:g} requests/s of 384-token real text for {WARMUP_S:g} s, then "
        f"repetitive prompts for {res.get('skew_hold_s', SKEW_HOLD_S):g} s (more than 2 query intervals + the window).",
        f"- Step: `{json.dumps(res.get('step_spec'))}`. softLimit from a calibration service (same spec, softLimit "
        f"{pred.CALIBRATION_SOFT_LIMIT}, no request): largest idle footprint {mib(cal.get('idle_bytes'))}, correction "
        f"{cal.get('correction')}; softLimit = the memory model's predicted peak at maxPrefillTokens "
        f"{pred.STEP_FRACTION:g} x its ceiling under the step's prompts = {cal.get('soft_limit', res.get('step_soft_limit'))}. "
        f"Once the operator predicts both pods (no request yet), {RPS:g} requests/s of {pred.LONG_PROMPT_TOKENS:,}-token "
        f"real text, {pred.OUTPUT_TOKENS} output tokens (context bucket {pred.context_bucket(pred.LONG_PROMPT_TOKENS + pred.OUTPUT_TOKENS):g}).",
        f"- OOM: `{json.dumps(res['spec'])}` with the leak fault in one replica at {res.get('oom_leak_mib_s', 128):g} MiB/s, "
        "as in `control_latency.md`.",
        "",
        "## Results",
        "",
        "| measurement | n | result | target (issue 30) | verdict |",
        "|---|---|---|---|---|",
        f"| skew with room: budget changes at any worker over the hold | {len(room)}/{len(res['skew_room'])} | "
        f"{'n/a' if total is None else total} changes ({', '.join(str(r['changes_total']) for r in room) or 'none'} per rep) | "
        f"0 changes | {pred.no_change_verdict(total)} |",
        f"| step that would not fit: first long request → the operator's cut in effect at every worker | "
        f"{s['n']}/{len(res['step'])} | median {_seconds(s['median'])} s, max {_seconds(s['max'])} s | median ≤ {pred.STEP_TARGET_S:g} s | "
        f"{pred.median_verdict(s['median'], pred.STEP_TARGET_S)} |",
        f"| OOM kill: lastState.terminated.finishedAt → every survivor runs lower budgets | {o['n']}/{len(res['oom'])} | "
        f"median {_seconds(o['median'])} s, max {_seconds(o['max'])} s | median ≤ {pred.OOM_TARGET_S:g} s | "
        f"{pred.median_verdict(o['median'], pred.OOM_TARGET_S)} |",
        "",
        "### Skew with room: the operator saw the skew",
        "",
        "| rep | budget changes per worker | budget document generations per worker | operator's highest skewRatio | "
        "RoutingSkew Events | findings | least predicted headroom | overload mode | worker shrink factors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["skew_room"]:
        lines.append(f"| {r['rep']} | {', '.join(str(v) for v in (r.get('budget_changes') or {}).values())} | "
                     f"{', '.join(str(v) for v in (r.get('generation_changes') or {}).values())} | {r.get('max_skew_ratio')} | "
                     f"{r.get('routing_skew_events')} | {', '.join(r.get('finding_kinds') or []) or 'none'} | "
                     f"{mib(r.get('min_headroom_bytes'))} | {' → '.join(str(m) for m in r.get('overload_modes') or [])} | "
                     f"{'; '.join(' → '.join(f'{v:g}' for v in s) for s in (r.get('shrink_factors') or {}).values())} |")
    lines += ["", f"skewThreshold is {SPEC['control']['skewThreshold']} (as in `control_latency.md`); a skewRatio above it "
              "with no budget change is the policy holding because every pod's predicted peak fits.", "",
              "### Step: the cut vs the ceiling and the memory model", "",
              "| rep | latency s | seen in status s | maxPrefillTokens ceiling → cut (ratio) | budgets cut | the model's needed "
              "(before the step / at the cut) | generations within the settle | worker shrink factors |",
              "|---|---|---|---|---|---|---|---|"]
    for r in res["step"]:
        if r.get("error") and r.get("step_latency_s") is None:
            lines.append(f"| {r['rep']} | {r['error']} | | | | | | |")
            continue
        cut = (r.get("cut") or {}).get("budgets", {})
        eb = (r.get("expected_before") or {}).get("needed", {}).get("maxPrefillTokens")
        ec = (r.get("expected_at_cut") or {}).get("needed", {}).get("maxPrefillTokens")
        gens = " → ".join(f"{g['budgets'].get('maxPrefillTokens'):g}@{g['seen_s']:.0f}s" for g in r.get("generations") or [])
        lines.append(f"| {r['rep']} | {_seconds(r.get('step_latency_s'))} | {_seconds(r.get('cut_seen_in_status_s'))} | "
                     f"{r['ceiling']['maxPrefillTokens']:g} → {cut.get('maxPrefillTokens')} ({r.get('cut_ratio', 0):.3f}) | "
                     f"{', '.join(r.get('cut_budgets_changed') or [])} | {eb} / {ec} | {gens} | "
                     f"{'; '.join(' → '.join(f'{v:g}' for v in s) for s in (r.get('shrink_factors') or {}).values())} |")
    lines += ["", "The latency ends when every worker runs the budget document of the operator's first cut (its "
              "`moeguard_budget_generation`): the budget gauges also carry the worker's own soft-limit shrink, which is "
              "not the operator's. The model's needed maxPrefillTokens is computed here with the operator's code "
              "(`memory_fit.solve`) from each worker's idle footprint and correction factor read before the step and at "
              "the cut; the operator reads the same gauges through Prometheus (up to a scrape later).", ""]
    for r in res["step"]:
        adj = r.get("last_adjustment") or {}
        if adj:
            lines.append(f"- rep {r['rep']}: the operator's lastAdjustment: {adj.get('reason')}")
    lines += ["", "### OOM kills", ""]
    lines += oom_lines(res["oom"])
    lines += ["", f"Whole run: {res['elapsed_s'] / 60:.1f} min.", ""]
    return "\n".join(lines)


def machine_line() -> str:
    m = machine()
    return f"{m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 2**30:.0f} GiB, Linux {m['kernel']}, torch {m['torch']}"


def verdict(median: float | None, target: float) -> str:
    if median is None:
        return "**not measured**"
    return "met" if median <= target else "**missed**"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", choices=("threshold", "predictive"), default="threshold",
                    help="threshold (the operator's default, no flag passed): skew step, recovery, OOM; predictive: "
                         "the operator with --policy predictive, skew with room, a step that would not fit, OOM")
    ap.add_argument("--skew-reps", type=int, default=None,
                    help="threshold: skew steps (default 10); predictive: skew-with-room holds (default 3)")
    ap.add_argument("--recovery-reps", type=int, default=2, help="threshold: the last N skew steps also measure recovery")
    ap.add_argument("--step-reps", type=int, default=5, help="predictive: steps that would not fit")
    ap.add_argument("--oom-reps", type=int, default=3)
    ap.add_argument("--oom-leak-mib-s", type=float, default=128.0)
    ap.add_argument("--skew-hold-s", type=float, default=SKEW_HOLD_S, help="predictive: seconds of skew with room")
    ap.add_argument("--step-settle-s", type=float, default=STEP_SETTLE_S,
                    help="predictive: seconds the long prompts continue after the cut is in effect")
    ap.add_argument("--step-soft-limit", default=None,
                    help="predictive: the step's softLimit (e.g. 560Mi) instead of calibrating it")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--pilot", action="store_true", help="label the results as a pilot run (<stem>_pilot.*)")
    ap.add_argument("--keep-cluster", action="store_true", help="leave the cluster up afterwards")
    ap.add_argument("--note", default="", help="a line for the report's setup (e.g. which branches a pilot ran on)")
    ap.add_argument("--render", type=Path, default=None, help="only rewrite the .md of this JSON result (with --note)")
    args = ap.parse_args(argv)
    predictive = args.policy == "predictive"
    render = report_predictive if predictive else report
    if args.render is not None:
        done = json.loads(args.render.read_text())
        done["note"] = args.note or done.get("note", "")
        args.render.write_text(json.dumps(done, indent=1))
        args.render.with_suffix(".md").write_text((report_predictive if done.get("policy") == "predictive" else report)(done))
        return 0
    skew_reps = args.skew_reps if args.skew_reps is not None else (3 if predictive else 10)
    t_start = time.monotonic()
    cp.cluster_up()
    cp.set_scrape_interval(SCRAPE_S)
    operator = cp.start_operator(stack.RUN_DIR / "logs" / "bench-operator.log",
                                 ("--policy", args.policy))
    stack.pod_workers("start")
    cp.delete_namespace(NAMESPACE)  # a previous run's leftovers (the operator removes its finalizers)
    cp.create_namespace(NAMESPACE)
    res: dict[str, Any] = {"pilot": args.pilot, "spec": SPEC, "scrape_s": SCRAPE_S, "rps": RPS,
                           "machine": machine_line(), "note": args.note,
                           "skew": [], "oom": [], "started_unix": time.time()}
    if predictive:
        res.update({"policy": "predictive", "skew_room": [], "step": [], "skew_hold_s": args.skew_hold_s,
                    "oom_leak_mib_s": args.oom_leak_mib_s, "step_settle_s": args.step_settle_s})
    try:
        if predictive:
            for i in range(skew_reps):
                res["skew_room"].append(skew_room_rep(i, args.skew_hold_s))
            if args.step_reps:
                if args.step_soft_limit is None:
                    res["calibration"] = calibrate_step()
                soft = args.step_soft_limit or res["calibration"]["soft_limit"]
                res["step_soft_limit"] = soft
                res["step_spec"] = pred.step_spec(soft)
                for i in range(args.step_reps):
                    res["step"].append(step_rep(i, soft, args.step_settle_s))
        else:
            for i in range(skew_reps):
                res["skew"].append(skew_rep(i, recovery=i >= skew_reps - args.recovery_reps))
        for i in range(args.oom_reps):
            res["oom"].append(oom_rep(i, args.oom_leak_mib_s))
    finally:
        cp.delete_namespace(NAMESPACE)  # while the operator runs: it removes its finalizers
        stack.stop_process(operator)
        stack.pod_workers("stop")
        with contextlib.suppress(Exception):
            cp.set_scrape_interval(2)
        if not args.keep_cluster:
            stack.script("cluster-down.sh")
    res["elapsed_s"] = time.monotonic() - t_start
    stem = "control_latency_predictive" if predictive else "control_latency"
    stem += "_pilot" if args.pilot else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (args.out / f"{stem}.md").write_text(render(res))
    print(render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
