"""Replica autoscaling (``spec.autoscaling``), as a pure function:
``decide(observation, state, spec, budgets, ready, now, blind_floor)``.

No I/O and no clock: :func:`tick.look_step` calls it after the budget policy, from the same look, and the
control loop writes what comes back: ``status.autoscaling`` first (the durable decision), then the worker
workload's replica count (:func:`children.builders.worker_replicas` is the one place that count is computed).
The spec is never written: a GitOps tool that owns the resource sees no drift.

**Signals** (:class:`ScaleSignals`), over ``control.windowSeconds``:

* the ``interactive`` class's SLO attainment (:mod:`slo`: the lower of its TTFT and TPOT shares), judged only
  from ``spec.slo.minRequests`` answered requests on;
* the requests waiting per replica: each pod's window maximum of the queue (``moeguard_queue_requests`` and
  the per-step histogram ``moeguard_step_queue_requests``: :attr:`signals.PodSignals.queue_requests`), summed
  over the pods, divided by the replicas they make up.

**Rules**, one look at a time:

* **Up** is recommended when the attainment is judged and below its target, or the queue per replica is above
  ``queueRequestsPerReplica``. **Down** when the attainment is met (or too few requests were answered to judge
  it: a calm service) and the queue would stay at or below the target spread over one replica fewer (the HPA's
  proportional rule, ``ceil(replicas x queue / target) <= replicas - 1``), which keeps a removal from
  recommending the next addition (no oscillation by construction).
* **Stabilization** as the Kubernetes HPA's ``behavior`` (kubernetes.io, "Horizontal Pod Autoscaling",
  "Stabilization window"): a step is taken once every look for ``scaleUpStabilizationSeconds`` (or
  ``scaleDownStabilizationSeconds``) recommended it. The window is counted from the latest of its start, the
  last scale and the loop's *blind floor* (the process start, an API-server outage: :mod:`tick`), so an
  operator restart waits a full window as the budget policy's stabilization does (issue 18, fault 1). At most
  one replica per step; a step restarts both windows.
* **Blind time** holds the count and restarts both windows: Prometheus unavailable, a silent pod, a
  crash-looping pod, a pod whose series do not span the window, or the queue not seen (the fields the policies'
  :func:`policy.visibility_reasons` reads; expert skew and the leak window are not the autoscaler's inputs and
  do not blind it). No data is never read as calm.
* **Bounds**: never below ``minReplicas`` nor above ``maxReplicas``; a count outside them (the bounds changed)
  is brought inside at once.
* **No scale-up that would not fit** (:func:`new_replica_fit`): a new replica runs the budgets in effect (the
  budget ConfigMap every replica reads), so it fits when the memory model (:mod:`memory_fit`, the worker
  admission's model) predicts a peak at or below ``resources.softLimit`` for it at the observed load of the
  worst current pod (idle footprint, context mix, skew, correction). Where the model does not apply (GPU
  workers, a ``model.source`` checkpoint, expert parallelism) the step is allowed and the reason says the fit
  was not predicted; where it applies but no pod reported its idle footprint, the step is refused (unknown is
  not "fits"). A scale-up also waits while a replica is not ready (one that cannot be scheduled, for lack of
  node memory or GPUs, stays Pending: adding more would not help). A refusal is reported
  (``status.autoscaling.scaleUpRefused``, a ``ScaleUpRefused`` Warning Event when it starts).
* **A leak replacement holds the count** (:mod:`leak_replacement`, ``status.leakReplacement``): on every look
  where one is in progress, or starts or ends, no step is taken (not even the bounds') and both windows restart
  (the look's pods include the surge pod and the leaking one: its signals are not the base count's). The
  autoscaler then writes *no* replica count at all, not even to set a drifted workload back
  (:func:`tick.scaled`): the leak replacement owns the workload's ``spec.replicas`` until it ends (base + 1
  while ``Surging``, the base once the surge pod is Ready), so the autoscaler can never undo a surge. The base
  is this autoscaler's count (:func:`base_replicas`), which therefore does not move under a surge. The status
  reason says so (``leak replacement of pod ... in progress``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from moeguard_core.contract import Budgets
from moeguard_operator.children.builders import worker_replicas
from moeguard_operator.loop.memory_fit import model_memory, predict
from moeguard_operator.loop.observation import Observation
from moeguard_operator.loop.policy import _since
from moeguard_operator.loop.report import Event, _round
from moeguard_operator.loop.slo import attainments
from moeguard_operator.spec.models import (
    AutoscalingSpec,
    AutoscalingStatus,
    LeakReplacementStatus,
    MoEInferenceServiceSpec,
    MoEInferenceServiceStatus,
)

Direction = Literal["up", "down", "hold"]
Recommendation = Literal["Up", "Down", "Hold"]


@dataclass(frozen=True)
class AutoscaleState:
    """The autoscaler's memory between looks (persisted in ``status.autoscaling``).

    Attributes:
        desired: the replica count decided.
        last_scale: the last change of it.
        up_since, down_since: start of the current stretch of fully visible looks that all recommended a
            scale-up (a scale-down); None: none.
    """

    desired: int
    last_scale: datetime | None = None
    up_since: datetime | None = None
    down_since: datetime | None = None


@dataclass(frozen=True)
class ScaleSignals:
    """What one look says to the autoscaler. None is *no data*, never 0.

    Attributes:
        attainment: the interactive class's lower attainment of TTFT and TPOT, ratio (None: no request).
        requests: interactive requests with a first token in the window.
        met: the interactive class met its target (:attr:`slo.Attainment.met`; None: not judged).
        queue_per_replica: requests waiting per replica (None: not seen).
    """

    attainment: float | None = None
    requests: float | None = None
    met: bool | None = None
    queue_per_replica: float | None = None


@dataclass(frozen=True)
class Fit:
    """Whether a new replica fits the memory model: ``fits`` None where the model does not apply (allowed);
    ``message`` says why, with the figures."""

    fits: bool | None
    message: str


@dataclass(frozen=True)
class ScaleDecision:
    """What the autoscaler decided after one look.

    Attributes:
        state: the next state (``desired`` is the replica count to set).
        direction: ``up``, ``down`` or ``hold``.
        recommendation: what the look's signals recommended (``Hold`` while blind).
        reason: one sentence: the signal, its value and target, and what was done.
        signals: the look's signals.
        refused: why a recommended scale-up was not taken (the memory model, a replica not ready), or None.
    """

    state: AutoscaleState
    direction: Direction
    recommendation: Recommendation
    reason: str
    signals: ScaleSignals
    refused: str | None = None

    @property
    def changed(self) -> bool:
        return self.direction != "hold"


def state_of(status: MoEInferenceServiceStatus, spec: MoEInferenceServiceSpec) -> AutoscaleState:
    """The autoscaler's state as ``status`` persists it; before its first decision, the count
    :func:`worker_replicas` gives (``spec.replicas`` within the bounds)."""
    saved = status.autoscaling
    if saved is None:
        return AutoscaleState(worker_replicas(spec))
    return AutoscaleState(saved.desired_replicas, saved.last_scale_time, saved.scale_up_since,
                          saved.scale_down_since)


def base_replicas(spec: MoEInferenceServiceSpec, status: MoEInferenceServiceStatus) -> int:
    """The workload's base replica count: :func:`worker_replicas` of ``spec`` at the autoscaler's count in
    ``status`` (``spec.replicas`` without ``spec.autoscaling``). A leak replacement's surge is one replica on top
    of it (:func:`leak_replacement.surge_replicas`). The same for ``spec`` and for its :func:`serving_spec`."""
    return worker_replicas(spec, status.autoscaling.desired_replicas if status.autoscaling is not None else None)


def serving_spec(spec: MoEInferenceServiceSpec, status: MoEInferenceServiceStatus) -> MoEInferenceServiceSpec:
    """``spec`` with ``replicas`` as the workload runs them: the autoscaler's count in ``status`` (within the
    bounds: :func:`base_replicas`) when ``spec.autoscaling`` is set, else ``spec`` itself. The readiness
    report, the builders and the loop read this, so "3/3 ready" counts the replicas the autoscaler asked for;
    the stored spec is never written."""
    if spec.autoscaling is None:
        return spec
    return spec.model_copy(update={"replicas": base_replicas(spec, status)})


def scale_signals(obs: Observation, spec: MoEInferenceServiceSpec) -> ScaleSignals:
    """The look's :class:`ScaleSignals`: the interactive attainment (:func:`slo.attainments`) and the queue per
    replica (every reporting pod's queue summed, over the replicas they make up: pods / ``podsPerReplica``)."""
    interactive = next((a for a in attainments(obs.latency, spec.slo) if a.priority == "interactive"), None)
    attainment = None
    if interactive is not None:
        known = [v for v in (interactive.ttft, interactive.tpot) if v is not None]
        attainment = min(known) if known else None
    queue = None
    pods = obs.signals.pods if obs.signals is not None else ()
    if pods and all(p.queue_requests is not None for p in pods):
        replicas = max(1.0, len(pods) / spec.parallelism.pods_per_replica)
        queue = sum(p.queue_requests or 0.0 for p in pods) / replicas
    return ScaleSignals(attainment, None if interactive is None else interactive.requests,
                        None if interactive is None else interactive.met, queue)


def blind_reason(obs: Observation, signals: ScaleSignals) -> str | None:
    """Why ``obs`` cannot move the replica count (the first blind spot, in words), or None when it can: the
    visibility the policies read (:func:`policy.visibility_reasons`) of the autoscaler's own inputs."""
    if not obs.available:
        return f"metrics unavailable ({obs.error or 'no data'})"
    if obs.silent_pods:
        return f"silent pods {', '.join(obs.silent_pods)}"
    if obs.crash_looping_pods:
        return f"crash-looping pods {', '.join(obs.crash_looping_pods)}"
    if obs.short_history_pods:
        return obs.short_history or f"short history: {', '.join(obs.short_history_pods)}"
    if signals.queue_per_replica is None:
        missing = obs.signals_missing or "no queue series for the reporting pods"
        return f"queue depth not seen ({missing})"
    return None


def new_replica_fit(obs: Observation, spec: MoEInferenceServiceSpec, budgets: Budgets) -> Fit:
    """Whether one more replica fits the memory model at ``budgets`` (see the module docstring): the worst
    current pod's load (:func:`memory_fit.predict` at ``resources.softLimit``) stands for the new replica's."""
    model, why = model_memory(spec, obs.memory_models, obs.memory_models_error)
    if model is None:
        return Fit(None, f"memory fit not predicted ({why})")
    limit = spec.resources.soft_limit_bytes
    predictions = [p for p in (predict(model, budgets, load, limit) for load in obs.pod_loads) if p is not None]
    if not predictions:
        return Fit(False, "memory fit unknown: no pod has reported its idle footprint "
                          "(moeguard_memory_idle_footprint_bytes)")
    worst = min(predictions, key=lambda p: p.headroom_bytes)
    if not worst.fits:
        return Fit(False, f"a new replica would not fit the memory model at the budgets in effect: {worst.describe()}")
    return Fit(True, f"fits the memory model ({worst.describe()})")


def _latest(*times: datetime | None) -> datetime | None:
    known = [t for t in times if t is not None]
    return max(known) if known else None


def _pct(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0%}"


def _up_reasons(signals: ScaleSignals, spec: MoEInferenceServiceSpec, auto: AutoscalingSpec) -> list[str]:
    out = []
    if signals.met is False:
        out.append(f"interactive SLO attainment {_pct(signals.attainment)} < target "
                   f"{spec.slo.interactive.attainment:.0%} ({signals.requests or 0:.0f} first tokens)")
    if signals.queue_per_replica is not None and signals.queue_per_replica > auto.queue_requests_per_replica:
        out.append(f"queue {signals.queue_per_replica:.1f} requests/replica > {auto.queue_requests_per_replica:g}")
    return out


def _calm(signals: ScaleSignals, replicas: int, spec: MoEInferenceServiceSpec, auto: AutoscalingSpec) -> str | None:
    """The sentence saying one replica fewer would do, or None."""
    if signals.queue_per_replica is None or signals.met is False:
        return None
    waiting = signals.queue_per_replica * replicas
    if waiting > auto.queue_requests_per_replica * (replicas - 1):
        return None
    slo = (f"interactive SLO attainment {_pct(signals.attainment)} >= target {spec.slo.interactive.attainment:.0%}"
           if signals.met else f"fewer than {spec.slo.min_requests} interactive "
                               "requests answered (calm)")
    return (f"{slo}; queue {signals.queue_per_replica:.1f} requests/replica fits {replicas - 1} replicas "
            f"(target {auto.queue_requests_per_replica:g})")


def decide(observation: Observation, state: AutoscaleState, spec: MoEInferenceServiceSpec, budgets: Budgets,
           ready: int, now: datetime, blind_floor: datetime | None = None,
           replacement: LeakReplacementStatus | None = None) -> ScaleDecision:
    """The replica count after one look (see the module docstring): ``state`` as persisted
    (:func:`state_of`), ``budgets`` the budgets in effect after this look's policy decision (the new replica
    runs them), ``ready`` the replicas ready now, ``blind_floor`` the latest moment this process could not see
    the service (None: none), ``replacement`` a leak replacement in progress, starting or ending in this look
    (None: none; else the count holds and the windows restart).

    Raises:
        ValueError: ``spec.autoscaling`` is not set.
    """
    auto = spec.autoscaling
    if auto is None:
        raise ValueError("decide needs spec.autoscaling")
    obs, n = observation, state.desired
    signals = scale_signals(obs, spec)
    if replacement is not None:
        return ScaleDecision(AutoscaleState(n, state.last_scale), "hold", "Hold",
                             f"leak replacement of pod {replacement.pod} in progress ({replacement.action}, "
                             f"{replacement.phase}): holding {n} replicas, no replica count written until it ends "
                             "(the windows restart)", signals)
    bounded = max(auto.min_replicas, min(auto.max_replicas, n))
    if bounded != n:
        bound = "minReplicas" if bounded > n else "maxReplicas"
        return ScaleDecision(AutoscaleState(bounded, now), "up" if bounded > n else "down", "Hold",
                             f"{bound} {bounded}: {n} -> {bounded} replicas", signals)
    blind = blind_reason(obs, signals)
    if blind is not None:
        return ScaleDecision(AutoscaleState(n, state.last_scale), "hold", "Hold",
                             f"{blind}: holding {n} replicas (blind time restarts the windows)", signals)

    ups = _up_reasons(signals, spec, auto)
    if ups:
        why = "; ".join(ups)
        since = state.up_since or now
        held = AutoscaleState(n, state.last_scale, up_since=since)
        start = _latest(since, state.last_scale, blind_floor) or since
        if n >= auto.max_replicas:
            return ScaleDecision(held, "hold", "Up", f"{why}; at maxReplicas {auto.max_replicas}", signals)
        if _since(now, start) < auto.scale_up_stabilization_seconds:
            return ScaleDecision(held, "hold", "Up", f"{why}; scale-up window of "
                                 f"{auto.scale_up_stabilization_seconds}s from {start.isoformat()}", signals)
        if ready < n:
            refused = f"{ready}/{n} replicas ready: no replica is added until they are"
            return ScaleDecision(held, "hold", "Up", f"{why}; scale-up refused: {refused}", signals, refused)
        fit = new_replica_fit(obs, spec, budgets)
        if fit.fits is False:
            return ScaleDecision(held, "hold", "Up", f"{why}; scale-up refused: {fit.message}", signals, fit.message)
        return ScaleDecision(AutoscaleState(n + 1, now), "up", "Up", f"{why}: {n} -> {n + 1} replicas; {fit.message}",
                             signals)

    calm = _calm(signals, n, spec, auto) if n > auto.min_replicas else None
    if calm is None:
        at_min = f"; at minReplicas {auto.min_replicas}" if n <= auto.min_replicas else ""
        return ScaleDecision(AutoscaleState(n, state.last_scale), "hold", "Hold",
                             f"signals within targets{at_min}: holding {n} replicas", signals)
    since = state.down_since or now
    start = _latest(since, state.last_scale, blind_floor) or since
    if _since(now, start) < auto.scale_down_stabilization_seconds:
        return ScaleDecision(AutoscaleState(n, state.last_scale, down_since=since), "hold", "Down",
                             f"{calm}; scale-down window of {auto.scale_down_stabilization_seconds}s from "
                             f"{start.isoformat()}", signals)
    return ScaleDecision(AutoscaleState(n - 1, now), "down", "Down", f"{calm}: {n} -> {n - 1} replicas", signals)


def autoscaled(status: MoEInferenceServiceStatus, decision: ScaleDecision) -> tuple[MoEInferenceServiceStatus,
                                                                                     list[Event]]:
    """``status`` with ``status.autoscaling`` (and ``status.replicas``) from ``decision``, and its Events: Normal
    ``ScaledUp``/``ScaledDown`` with the reason on a change, a Warning ``ScaleUpRefused`` when a refusal starts
    (not at every look it lasts)."""
    prior, nxt, sig = status.autoscaling, decision.state, decision.signals
    events = []
    if decision.changed:
        events.append(Event("Normal", "ScaledUp" if decision.direction == "up" else "ScaledDown", decision.reason))
    if decision.refused is not None and (prior is None or prior.scale_up_refused is None):
        events.append(Event("Warning", "ScaleUpRefused", decision.reason))
    block = AutoscalingStatus(
        desired_replicas=nxt.desired, attainment=_round(sig.attainment, 3), requests=_round(sig.requests, 1),
        queue_requests_per_replica=_round(sig.queue_per_replica, 2), recommendation=decision.recommendation,
        reason=decision.reason, scale_up_refused=decision.refused, last_scale_time=nxt.last_scale,
        scale_up_since=nxt.up_since, scale_down_since=nxt.down_since)
    return status.model_copy(update={"autoscaling": block, "replicas": nxt.desired}), events
