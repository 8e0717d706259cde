"""The outer loop's predictive policy (operator flag ``--policy predictive``), pure: ``decide(observation, state,
spec, now)``, as :func:`policy.decide` (the ``threshold`` policy) with the same state, decision and safety rules.

It decides from the **predicted memory** of each pod and the **SLO attainment**, not from thresholds on skew,
memory and refusals (issue 30: on skew the threshold policy halved budgets and turned overload on from the
refusal rate, and refused work the inner loop served within the SLOs):

* **Budgets from prediction** (:mod:`memory_fit`): each look predicts every pod's peak at the budgets in effect
  under its observed skew and context mix, from its own idle footprint, against ``resources.softLimit``. Where a
  pod's prediction does not fit, the budgets are cut only as far as needed: the largest value that fits, one
  budget at a time (:func:`memory_fit.solve`), never a fixed factor, never below the floors. Expert skew with
  room to spare changes nothing: the worker bounds the per-expert buffers itself.
* **Loosen** toward the ceilings (``+ increaseStep x ceiling`` per move, as the threshold policy climbs) only
  when the look is fully visible, calm for ``stabilizationWindowSeconds`` and out of cooldown, every pod has a
  prediction, memory in use is at most ``rssSoftFraction`` of the hard limit, the interactive class's TPOT
  attainment is not below its target, and only as far as every pod's prediction still fits (a window without
  requests predicts at the model's full context: the safe side). A leaking pod that is being replaced does not
  hold the loosening back: its own worker shrinks its batches at its soft limit until it is gone.
* **Undo a loosening that costs the SLO:** where the interactive TPOT attainment (judged, :mod:`slo`) falls
  below its target while budgets stand above the spec's, one loosening step is undone (:func:`policy.step_back`,
  never below the spec's budgets, after the cooldown; pressure ``SloAttainment``, which restarts the
  stabilization window). More decode tokens and requests per step raise throughput but lengthen every step, so
  the loop settles where TPOT still meets its objective: the SLO goodput's operating point, which a static
  budget has to guess (the headline's pilot: decode 16 served 20 % more requests than 8 but met TPOT less often).
* **OOM kills** tighten at once (no cooldown): every budget x ``decreaseFactor``, and further where the
  prediction says so; a kill is evidence the prediction missed something.
* **Overload mode** (Auto) turns On when the interactive class's SLO attainment (TTFT or TPOT, :mod:`slo`)
  is below its target over the window with at least ``slo.minRequests`` answered requests, when memory in use
  passes ``rssHardFraction`` of the hard limit, or on an OOM kill; Off after a stabilization window without
  those, with full visibility. Never from the refusal rate alone: refusals are the inner loop doing its job
  (``overload.rejectionRatePerSecond`` and ``overload.p99LatencySeconds`` are the threshold policy's).
* Everything the threshold policy made safe stays (shared code in :mod:`policy`): blind time never loosens and
  restarts the stabilization window, missing series are never read as healthy, the leak verdict is the same,
  and the durable state is the same :class:`policy.PolicyState`.
* **Leaks** with ``leakAction: Restart``: on Deployment workers no rolling restart; each leaking pod is replaced
  before it reaches the hard limit, with the Deployment's surge where possible (:mod:`leak_replacement`, run by
  :func:`tick.look_step`). LeaderWorkerSet workers keep the rolling restart. A leaking pod's predicted peak
  (its idle footprint grows with the leak) cuts no budget there (:func:`leaking_pods`): a cut would narrow
  every pod's budgets without stopping the leak.

The goodput framing (requests meeting both latency SLOs per second) is DistServe's (Zhong et al., OSDI 2024);
planners that scale from SLO attainment rather than utilisation thresholds (NVIDIA Dynamo's SLA planner) take the
same view.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from moeguard_core.contract import Budgets, coherent
from moeguard_core.memory_model_info import ModelMemory
from moeguard_operator.loop import leak_replacement, memory_fit, slo
from moeguard_operator.loop.observation import LEAK_NOISE_BYTES_PER_SECOND, Observation
from moeguard_operator.loop.policy import (
    Decision,
    Move,
    PolicyState,
    _describe,
    _since,
    calm_for,
    ceilings,
    conclude,
    decrease,
    floors,
    hard_memory_trigger,
    increase,
    initial_budgets,
    step_back,
    tighten,
    visibility_reasons,
)
from moeguard_operator.spec.models import (
    BUDGET_FIELDS,
    MoEInferenceServiceSpec,
    PodMemoryPrediction,
)


def lowest(a: Budgets, b: Budgets) -> Budgets:
    """Each budget the lower of ``a``'s and ``b``'s."""
    return a.model_copy(update={n: min(getattr(a, n), getattr(b, n)) for n in BUDGET_FIELDS})


def _mib(n: int) -> int:
    """``n`` bytes rounded to a whole MiB: status shows the prediction at that grain, so that an idle pod's
    footprint moving by a few pages does not rewrite status at every look (``tick.stable``)."""
    return round(n / 2**20) * 2**20


def _status(p: memory_fit.Prediction) -> PodMemoryPrediction:
    peak = _mib(p.peak_bytes)
    return PodMemoryPrediction(pod=p.pod, idle_footprint_bytes=_mib(p.idle_footprint_bytes),
                               predicted_peak_bytes=peak, headroom_bytes=_mib(p.limit_bytes) - peak)


def decide(observation: Observation, state: PolicyState, spec: MoEInferenceServiceSpec, now: datetime) -> Decision:
    """Decide the next loop state from one observation (see the module docstring)."""
    control, batching, obs = spec.control, spec.batching, observation
    lower, upper, limit = floors(batching), ceilings(batching), spec.resources.soft_limit_bytes
    model, no_model = memory_fit.model_memory(spec, obs.memory_models, obs.memory_models_error)
    loads = obs.pod_loads if model is not None else ()
    predictions = {load.pod: memory_fit.predict(model, state.budgets, load, limit)
                   for load in loads} if model is not None else {}
    reasons: list[str] = []
    pressure: list[str] = []
    attained = slo.attainments(obs.latency, spec.slo)
    tpot_short = next((a for a in attained if a.priority == "interactive" and a.tpot_met is False), None)
    start = initial_budgets(batching)

    target = state.budgets
    if obs.new_oom_kills > 0:
        pressure.append("OOMKilled")
        reasons.append(f"{obs.new_oom_kills} OOM kill(s)")
        target = decrease(state.budgets, control.decrease_factor, lower, BUDGET_FIELDS)
    over = [load for load in loads if (p := predictions.get(load.pod)) is not None and p.observed_mix and not p.fits]
    replaced = leaking_pods(obs, spec)
    unfit = [load for load in over if load.pod not in replaced]
    for load in over:
        if load.pod in replaced:
            p = predictions[load.pod]
            assert p is not None
            reasons.append(f"{p.describe()}, but {load.pod} leaks (RSS +{replaced[load.pod] * 60 / 2**20:,.0f} "
                           f"MiB/min): left to the leak replacement, no budget cut for it")
    if unfit and model is not None:
        pressure.append("PredictedMemory")
        for load in unfit:
            p = predictions[load.pod]
            assert p is not None
            reasons.append(f"{p.describe()}: {-p.headroom_bytes / 2**20:,.0f} MiB over")
            target = lowest(target, memory_fit.solve(model, state.budgets, lower, load, limit))
    elif obs.skew_ratio is not None and obs.skew_ratio > control.skew_threshold and predictions and all(
            p is not None and p.fits for p in predictions.values()):
        room = min(p.headroom_bytes for p in predictions.values() if p is not None)
        reasons.append(f"expert skew ratio {obs.skew_ratio:.2f} > skewThreshold {control.skew_threshold:g}, but every "
                       f"pod's predicted peak fits ({room / 2**20:,.0f} MiB to spare): holding")
    if not pressure and tpot_short is not None and (back := step_back(
            state.budgets, control.increase_step, upper, start)) != state.budgets:
        pressure.append("SloAttainment")
        reasons.append(f"{tpot_short.message()}: TPOT below target with budgets above the spec's, one loosening "
                       "undone (more decode tokens and requests per step lengthen every step)")
        target = back
    reasons += visibility_reasons(obs)
    last_blind = state.last_blind if obs.fully_visible else now

    budgets = state.budgets
    direction: Literal["down", "up", "hold"] = "hold"
    last_change, last_pressure = state.last_change, state.last_pressure
    rested = _since(now, state.last_change) >= control.cooldown_seconds
    if pressure:
        last_pressure = now
        budgets, direction, last_change, why = tighten(state, target, "OOMKilled" in pressure, rested, now,
                                                       " (the largest that fit)" if unfit else "")
        reasons.append(why)
    elif obs.fully_visible:
        candidate = increase(state.budgets, control.increase_step, upper)
        blocked = _no_loosening(obs, spec, model, no_model, predictions) or (
            None if tpot_short is None else f"{tpot_short.message()}: TPOT below target, not loosening")
        if blocked is None and model is not None:
            for load in loads:
                if load.pod in replaced:  # its own worker's soft limit bounds it until it is replaced
                    continue
                candidate = memory_fit.solve(model, candidate, lowest(state.budgets, candidate), load, limit)
            candidate = coherent(candidate)
        if candidate == state.budgets:
            if blocked is None and increase(state.budgets, control.increase_step, upper) != state.budgets:
                reasons.append("the predicted peak leaves no room to loosen")
        elif blocked is not None:
            reasons.append(blocked)
        elif calm_for(state, now, control.stabilization_window_seconds) and rested:
            reasons.append(f"predicted peak fits, no pressure for {control.stabilization_window_seconds}s: "
                           f"{_describe(state.budgets, candidate)}")
            budgets, direction, last_change = candidate, "up", now
        else:
            reasons.append("room to loosen; waiting for the stabilization window"
                           if not calm_for(state, now, control.stabilization_window_seconds) else
                           "room to loosen; in cooldown")

    triggers = hard_memory_trigger(obs, spec)
    triggers += [a.message() for a in attained if a.priority == "interactive" and a.met is False]
    shown = tuple(_status(p) for p in (memory_fit.predict(model, budgets, load, limit) for load in loads)
                  if p is not None) if model is not None else ()
    # Deployment workers: each leaking pod is replaced before the hard limit (leak_replacement), no rolling restart.
    return conclude(obs, state, spec, now, Move(budgets, direction, last_change, last_pressure, last_blind),
                    triggers, reasons, pressure, shown, rolling_restart=spec.parallelism.multi_node)


def leaking_pods(obs: Observation, spec: MoEInferenceServiceSpec) -> dict[str, float]:
    """The pods whose RSS grows past the noise floor (``obs.pod_rss_slopes`` above
    :data:`observation.LEAK_NOISE_BYTES_PER_SECOND`), with their slope in bytes/s, where leaks are handled by
    replacement (:func:`leak_replacement.applies`); empty elsewhere.

    A leaking pod's idle footprint grows with its leak, so its predicted peak stops fitting whatever the budgets:
    cutting the service's budgets (every pod's) would not stop the leak, and the pod is replaced before it reaches
    the hard limit (:mod:`leak_replacement`), while its own worker refuses the work that would not fit its soft
    limit. Nor does it hold back a loosening: the worker shrinks its batches at its soft limit (the inner loop)
    until the replacement is Ready."""
    if not leak_replacement.applies(spec, "predictive"):
        return {}
    return {pod: slope for pod, slope in obs.pod_rss_slopes if slope > LEAK_NOISE_BYTES_PER_SECOND}


def _no_loosening(obs: Observation, spec: MoEInferenceServiceSpec, model: ModelMemory | None,
                  no_model: str | None, predictions: dict[str, memory_fit.Prediction | None]) -> str | None:
    """Why the budgets may not loosen although the look is fully visible and calm, or None."""
    if model is None:
        return f"no memory prediction ({no_model}): not loosening"
    missing = sorted(pod for pod, p in predictions.items() if p is None)
    if missing or not predictions:
        return (f"no idle footprint (moeguard_memory_idle_footprint_bytes) yet for {', '.join(missing)}: not loosening"
                if missing else "no pod to predict: not loosening")
    if obs.memory_ratio is not None and obs.memory_ratio > spec.control.rss_soft_fraction:
        return (f"memory {obs.memory_ratio:.0%} of hardLimit > rssSoftFraction {spec.control.rss_soft_fraction:.0%} "
                f"(more than the prediction accounts for): not loosening")
    return None
