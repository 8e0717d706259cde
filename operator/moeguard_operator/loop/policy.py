"""The outer loop's decision, as a pure function: ``decide(observation, state, spec, now)``.

No I/O and no clock: the handler passes ``now`` in and acts on the returned
:class:`Decision`. The rules are AIMD with hysteresis (Chiu & Jain 1989, the
rule TCP congestion control uses):

* **Pressure** — a new OOM kill, expert skew above ``control.skewThreshold``, or
  memory in use above ``control.rssSoftFraction`` of the hard limit — drops
  budgets multiplicatively (× ``decreaseFactor``), never below their floors.
  Skew drops the prefill budgets (prefill tokens, long requests per batch): the
  per-expert buffers grow with the top expert's share of the prefill tokens.
  Memory and OOM kills drop every budget.
* Moves are at least ``cooldownSeconds`` apart; an OOM kill does not wait.
* **Recovery** — after ``stabilizationWindowSeconds`` without pressure *and with
  every signal visible all along* (no missing series, no silent pod, every pod's
  series spanning the window, the leak window judged: blind time restarts the
  window), budgets climb additively (+ ``increaseStep`` × ceiling), never above
  their ceilings. An idle service (no batch in the window: ``skew_steps == 0``)
  has no skew pressure and counts as seen, so it climbs back after a burst.
* **No data is never read as healthy**: while blind the loop can tighten on what
  it sees, but never loosens (KEDA #965, AIBrix #1032).
* **Overload** (mode Auto) turns on when memory passes ``rssHardFraction``, the
  refusal rate or p99 latency passes its threshold, or on an OOM kill; it turns
  off only after a stabilization window without triggers, with full visibility.
* **Leak** (:func:`judge_leak`): judged by its projected time to the hard limit. A leak is
  suspected when the highest RSS slope (over ``leakWindowSeconds``) is above the noise floor
  (:data:`LEAK_NOISE_BYTES_PER_SECOND`) and would take the highest memory use to
  ``hardLimit`` within ``leakHorizonSeconds`` (or, deprecated, when it is above
  ``leakSlopeBytesPerSecond`` where that is set). Its kind is what the workers flag
  (``moeguard_memory_leak_suspected{kind}``: ``native`` or ``python_heap``), else
  ``unclassified``. With ``leakAction: Restart`` it also asks for a rolling restart, at most
  once per leak window (the predictive policy on Deployment workers replaces each leaking pod before the
  hard limit instead: :mod:`leak_replacement`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Literal

from moeguard_core.contract import Budgets, coherent
from moeguard_operator.loop.observation import (
    LEAK_NOISE_BYTES_PER_SECOND,
    Observation,
)
from moeguard_operator.spec.models import (
    BUDGET_FIELDS,
    BatchingSpec,
    MoEInferenceServiceSpec,
    PodMemoryPrediction,
)

OverloadMode = Literal["On", "Off"]
SKEW_FIELDS = ("max_prefill_tokens", "max_long_requests_per_batch")
"""Budgets that expert skew drops."""


@dataclass(frozen=True)
class PolicyState:
    """The loop's memory between looks (persisted in ``status.control`` and ``status.budgets``)."""

    budgets: Budgets
    overload: OverloadMode = "Off"
    last_change: datetime | None = None
    last_pressure: datetime | None = None
    last_overload_trigger: datetime | None = None
    last_restart: datetime | None = None
    last_blind: datetime | None = None


@dataclass(frozen=True)
class Decision:
    """What to do after one look.

    Attributes:
        state: the next loop state (budgets and overload mode in effect).
        direction: ``down`` (tightened), ``up`` (relaxed) or ``hold``.
        reasons: one sentence per signal that mattered, with its value.
        pressure: the pressure signals seen (``OOMKilled``, ``ExpertSkew``, ``MemoryPressure``).
        overload_changed: overload mode switched.
        leak_suspected: the RSS slope passed the leak threshold (None: slope unknown).
        restart: roll the workers now (leak action Restart).
        leak: the leak verdict behind ``leak_suspected`` (None: slope unknown).
        memory: per pod, the predicted memory peak at the budgets decided (the predictive policy's; empty for
            the threshold policy).
    """

    state: PolicyState
    direction: Literal["down", "up", "hold"]
    reasons: tuple[str, ...]
    pressure: tuple[str, ...] = ()
    overload_changed: bool = False
    leak_suspected: bool | None = None
    restart: bool = False
    leak: LeakVerdict | None = None
    memory: tuple[PodMemoryPrediction, ...] = ()

    @property
    def changed(self) -> bool:
        return self.direction != "hold"

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


LEAK_KIND_REASONS = {"native": "NativeLeak", "python_heap": "PythonHeapLeak", "unclassified": "RSSGrowing"}
"""The MemoryLeakSuspected condition's reason for each leak kind."""


@dataclass(frozen=True)
class LeakVerdict:
    """The leak judgement of one look.

    Attributes:
        suspected: a leak is suspected.
        kind: ``native``, ``python_heap`` (what the workers flag; both: ``native+python_heap``),
            ``unclassified`` (the workers flag none) when suspected; ``none`` otherwise.
        seconds_to_limit: projected seconds until ``hardLimit`` at the current slope (inf: not growing).
        message: one sentence naming the kind, the slope, the projection and the horizon.
    """

    suspected: bool
    kind: str
    seconds_to_limit: float
    message: str

    @property
    def reason(self) -> str:
        """The condition's reason: ``NativeLeak``, ``PythonHeapLeak``, ``RSSGrowing`` (unclassified or both),
        ``RSSFlat`` (not suspected)."""
        return LEAK_KIND_REASONS.get(self.kind, "RSSGrowing") if self.suspected else "RSSFlat"


def seconds_to_hard_limit(slope_bytes_per_second: float, memory_ratio: float | None, hard_limit_bytes: int) -> float:
    """Seconds until memory reaches ``hard_limit_bytes`` at ``slope_bytes_per_second`` from ``memory_ratio``
    of it in use (None: unknown, projected from 0: the longest time); ``math.inf`` when not growing."""
    if slope_bytes_per_second <= 0:
        return math.inf
    headroom = hard_limit_bytes * min(1.0, max(0.0, 1.0 - (memory_ratio or 0.0)))
    return headroom / slope_bytes_per_second


def _duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def judge_leak(obs: Observation, spec: MoEInferenceServiceSpec) -> LeakVerdict | None:
    """The leak verdict of ``obs`` under ``spec.control`` (see the module docstring); None (Unknown) without a
    slope, or when some pods' leak window cannot be judged yet (``slope_unknown``) and the others show no
    leak: "not suspected" needs every pod."""
    slope, control = obs.rss_slope_bytes_per_second, spec.control
    if slope is None:
        return None
    eta = seconds_to_hard_limit(slope, obs.memory_ratio, spec.resources.hard_limit_bytes)
    legacy = control.leak_slope_bytes_per_second
    suspected = slope > LEAK_NOISE_BYTES_PER_SECOND and (
        eta <= control.leak_horizon_seconds or (legacy is not None and slope > legacy))
    if not suspected and obs.slope_unknown is not None:
        return None
    kind = ("+".join(obs.leak_kinds) or "unclassified") if suspected else "none"
    parts = dict(obs.growth_bytes_per_second)
    detail = ", ".join(f"{part} {parts[part] / 2**20 * 60:+.0f} MiB/min" for part in ("rss_anonymous", "malloc_in_use")
                       if part in parts)
    used = "" if obs.memory_ratio is None else f" at {obs.memory_ratio:.0%} of hardLimit"
    head = f"{kind} leak suspected: " if suspected else ""
    message = (f"{head}RSS {slope / 2**20 * 60:+.1f} MiB/min over {control.leak_window_seconds}s{used}"
               + (f" ({detail})" if detail else "")
               + f"; hardLimit reached in {_duration(eta)} at this slope (leakHorizonSeconds "
               + f"{_duration(control.leak_horizon_seconds)})")
    return LeakVerdict(suspected, kind, eta, message)


def initial_budgets(batching: BatchingSpec) -> Budgets:
    """The budgets a spec starts with: its ``batching`` values (:func:`~moeguard_core.contract.coherent`: a
    ``maxLongRequestsPerBatch`` above ``maxBatchRequests``, e.g. the default 4 under ``maxBatchRequests: 2``, is
    the batch)."""
    return coherent(Budgets.model_validate({name: getattr(batching, name) for name in BUDGET_FIELDS}))


def ceilings(batching: BatchingSpec) -> Budgets:
    """Each budget's ceiling: ``batching.ceilings`` where set, else the initial value (coherent)."""
    return coherent(Budgets.model_validate({
        name: getattr(batching.ceilings, name) if getattr(batching.ceilings, name) is not None else getattr(batching, name)
        for name in BUDGET_FIELDS
    }))


def floors(batching: BatchingSpec) -> Budgets:
    """Each budget's floor (coherent)."""
    return coherent(Budgets.model_validate({name: getattr(batching.floors, name) for name in BUDGET_FIELDS}))


def decrease(budgets: Budgets, factor: float, lower: Budgets, names: tuple[str, ...]) -> Budgets:
    """``budgets`` with each of ``names`` × ``factor``, never below ``lower`` (integers round down)."""
    update: dict[str, float | int] = {}
    for name in names:
        value, floor = getattr(budgets, name), getattr(lower, name)
        if isinstance(value, int):
            new: float | int = max(floor, min(value - 1, math.floor(value * factor))) if value > floor else value
        else:
            new = max(floor, value * factor)
        update[name] = new
    return budgets.model_copy(update=update)


def _climb(value: float, step: float, ceiling: float) -> float:
    """One climb's size for a budget at ``value``: ``step`` × its ceiling, at least 1 for an integer budget."""
    return max(1, round(step * ceiling)) if isinstance(value, int) else step * ceiling


def increase(budgets: Budgets, step: float, upper: Budgets) -> Budgets:
    """``budgets`` with each budget + ``step`` × its ceiling (at least 1), never above ``upper``."""
    update: dict[str, float | int] = {}
    for name in BUDGET_FIELDS:
        value, ceiling = getattr(budgets, name), getattr(upper, name)
        update[name] = min(ceiling, value + _climb(value, step, ceiling))
    return budgets.model_copy(update=update)


def step_back(budgets: Budgets, step: float, upper: Budgets, start: Budgets) -> Budgets:
    """``budgets`` with each budget above ``start`` lowered by the climb :func:`increase` makes (``step`` × its
    ceiling, at least 1), never below ``start``: one loosening undone. Budgets at or below ``start`` are kept."""
    update: dict[str, float | int] = {}
    for name in BUDGET_FIELDS:
        value, ceiling, base = getattr(budgets, name), getattr(upper, name), getattr(start, name)
        if value > base:
            update[name] = max(base, value - _climb(value, step, ceiling))
    return budgets.model_copy(update=update)


def _since(now: datetime, then: datetime | None) -> float:
    return math.inf if then is None else (now - then).total_seconds()


def _describe(before: Budgets, after: Budgets) -> str:
    moves = [f"{_camel(n)} {getattr(before, n):g} -> {getattr(after, n):g}"
             for n in BUDGET_FIELDS if getattr(before, n) != getattr(after, n)]
    return ", ".join(moves)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def tighten(state: PolicyState, target: Budgets, urgent: bool, rested: bool, now: datetime,
            note: str = "") -> tuple[Budgets, Literal["down", "hold"], datetime | None, str]:
    """One look under pressure, in either policy: ``target`` takes effect (``down``) when the move is
    ``urgent`` (an OOM kill: no cooldown) or the loop is ``rested`` (``cooldownSeconds`` since the last move),
    unless it changes nothing. Returns the budgets, the direction, the last change's time and the reason
    (``note`` appended to the moves)."""
    if not (urgent or rested):
        return state.budgets, "hold", state.last_change, "in cooldown"
    target = coherent(target)
    if target == state.budgets:
        return state.budgets, "hold", state.last_change, "budgets already at their floors"
    return target, "down", now, _describe(state.budgets, target) + note


def visibility_reasons(obs: Observation) -> list[str]:
    """Why ``obs`` may not loosen anything (the first blind spot, in words), or nothing when it is fully
    visible; shared by every policy."""
    if not obs.available:
        return [f"metrics unavailable ({obs.error or 'no data'}): not loosening"]
    if obs.silent_pods:
        return [f"silent pods {', '.join(obs.silent_pods)}: not loosening"]
    if obs.crash_looping_pods:
        return [f"crash-looping pods {', '.join(obs.crash_looping_pods)}: not loosening"]
    if obs.short_history_pods:
        return [f"{obs.short_history}: not loosening"]
    if obs.skew_unknown_pods:
        return [f"expert skew unknown for {', '.join(obs.skew_unknown_pods)} (counter reset): not loosening"]
    if not obs.skew_seen:
        return ["no expert-skew samples yet (no batch large enough): not loosening"]
    if obs.slope_unknown is not None:
        return [f"leak window not judged ({obs.slope_unknown}): not loosening"]
    return []


def calm_for(state: PolicyState, now: datetime, window_seconds: float) -> bool:
    """No pressure and no blind time for ``window_seconds`` (the stabilization window)."""
    return min(_since(now, state.last_pressure), _since(now, state.last_blind)) >= window_seconds


@dataclass(frozen=True)
class OverloadStep:
    """Overload mode after one look: the mode, whether it switched, the last trigger's time, and the sentence
    that says why it switched (None: it did not)."""

    mode: OverloadMode
    changed: bool
    last_trigger: datetime | None
    reason: str | None


def overload_step(state: PolicyState, spec: MoEInferenceServiceSpec, obs: Observation, triggers: list[str],
                  now: datetime) -> OverloadStep:
    """Overload mode (``spec.overload.mode`` Auto): On at once on any of ``triggers`` (sentences), Off only after
    a stabilization window without triggers and without blind time, with ``obs`` fully visible; forced modes
    as set. Shared by every policy (each brings its own triggers)."""
    control, overload_spec = spec.control, spec.overload
    last_trigger = now if triggers else state.last_overload_trigger
    overload = state.overload
    if overload_spec.mode != "Auto":
        overload = overload_spec.mode
    elif triggers:
        overload = "On"
    elif (state.overload == "On" and obs.fully_visible
          and min(_since(now, state.last_overload_trigger), _since(now, state.last_blind))
          >= control.stabilization_window_seconds):
        overload = "Off"
    if overload == state.overload:
        return OverloadStep(overload, False, last_trigger, None)
    why = "; ".join(triggers) if overload == "On" and triggers else (
        f"overload.mode {overload_spec.mode}" if overload_spec.mode != "Auto" else
        f"no overload trigger for {control.stabilization_window_seconds}s")
    return OverloadStep(overload, True, last_trigger, f"overload mode {state.overload} -> {overload} ({why})")


def leak_step(obs: Observation, spec: MoEInferenceServiceSpec, state: PolicyState,
              now: datetime, rolling_restart: bool = True) -> tuple[LeakVerdict | None, bool | None, bool, list[str]]:
    """The leak verdict (:func:`judge_leak`), whether a leak is suspected (None: unknown), whether to roll the
    workers (``leakAction: Restart``, at most once per leak window; never where ``rolling_restart`` is False: the
    leaking pods are replaced one by one instead, :mod:`leak_replacement`), and the sentence for the reasons."""
    verdict = judge_leak(obs, spec)
    leak = None if verdict is None else verdict.suspected
    restart = (rolling_restart and bool(leak) and spec.control.leak_action == "Restart"
               and _since(now, state.last_restart) >= spec.control.leak_window_seconds)
    replaced = not rolling_restart and spec.control.leak_action == "Restart"
    note = "; rolling restart" if restart else "; leaking pods replaced before hardLimit" if replaced else ""
    reasons = [verdict.message + note] if verdict and verdict.suspected else []
    return verdict, leak, restart, reasons


def decide(observation: Observation, state: PolicyState, spec: MoEInferenceServiceSpec, now: datetime) -> Decision:
    """Decide the next loop state from one observation (see the module docstring)."""
    control, batching, overload_spec = spec.control, spec.batching, spec.overload
    obs = observation
    reasons: list[str] = []
    pressure: list[str] = []
    names: set[str] = set()
    if obs.new_oom_kills > 0:
        pressure.append("OOMKilled")
        reasons.append(f"{obs.new_oom_kills} OOM kill(s)")
        names.update(BUDGET_FIELDS)
    if obs.skew_ratio is not None and obs.skew_ratio > control.skew_threshold:
        pressure.append("ExpertSkew")
        reasons.append(f"expert skew ratio {obs.skew_ratio:.2f} > threshold {control.skew_threshold:g}")
        names.update(SKEW_FIELDS)
    if obs.memory_ratio is not None and obs.memory_ratio > control.rss_soft_fraction:
        pressure.append("MemoryPressure")
        reasons.append(f"memory {obs.memory_ratio:.0%} of hardLimit > rssSoftFraction {control.rss_soft_fraction:.0%}")
        names.update(BUDGET_FIELDS)
    reasons += visibility_reasons(obs)
    # Blind time never counts as calm: the stabilization window restarts when sight returns.
    last_blind = state.last_blind if obs.fully_visible else now

    budgets = state.budgets
    direction: Literal["down", "up", "hold"] = "hold"
    last_change, last_pressure = state.last_change, state.last_pressure
    if pressure:
        last_pressure = now
        ordered = tuple(n for n in BUDGET_FIELDS if n in names)
        new = decrease(state.budgets, control.decrease_factor, floors(batching), ordered)
        budgets, direction, last_change, why = tighten(
            state, new, "OOMKilled" in pressure, _since(now, state.last_change) >= control.cooldown_seconds, now)
        reasons.append(why)
    elif obs.fully_visible:
        calm = calm_for(state, now, control.stabilization_window_seconds)
        rested = _since(now, state.last_change) >= control.cooldown_seconds
        new = increase(state.budgets, control.increase_step, ceilings(batching))
        if new != state.budgets and calm and rested:
            reasons.append(f"no pressure for {control.stabilization_window_seconds}s: {_describe(state.budgets, new)}")
            budgets, direction, last_change = new, "up", now
        elif new != state.budgets:
            reasons.append("no pressure; waiting for the stabilization window" if not calm else "no pressure; in cooldown")

    # Overload mode.
    triggers = hard_memory_trigger(obs, spec)
    if obs.rejection_rate_per_second is not None and obs.rejection_rate_per_second > overload_spec.rejection_rate_per_second:
        triggers.append(f"{obs.rejection_rate_per_second:.2f} refusals/s > {overload_spec.rejection_rate_per_second:g}")
    if obs.p99_latency_seconds is not None and obs.p99_latency_seconds > overload_spec.p99_latency_seconds:
        triggers.append(f"p99 latency {obs.p99_latency_seconds:.1f}s > {overload_spec.p99_latency_seconds:g}s")
    return conclude(obs, state, spec, now, Move(budgets, direction, last_change, last_pressure, last_blind),
                    triggers, reasons, pressure)


def hard_memory_trigger(obs: Observation, spec: MoEInferenceServiceSpec) -> list[str]:
    """The overload trigger both policies share: memory in use past ``control.rssHardFraction`` of the hard limit."""
    control = spec.control
    if obs.memory_ratio is not None and obs.memory_ratio > control.rss_hard_fraction:
        return [f"memory {obs.memory_ratio:.0%} of hardLimit > rssHardFraction {control.rss_hard_fraction:.0%}"]
    return []


@dataclass(frozen=True)
class Move:
    """A policy's budget move of one look: the budgets, the direction, and the times it updates."""

    budgets: Budgets
    direction: Literal["down", "up", "hold"]
    last_change: datetime | None
    last_pressure: datetime | None
    last_blind: datetime | None


def conclude(obs: Observation, state: PolicyState, spec: MoEInferenceServiceSpec, now: datetime, move: Move,
             triggers: list[str], reasons: list[str], pressure: list[str],
             memory: tuple[PodMemoryPrediction, ...] = (), rolling_restart: bool = True) -> Decision:
    """The :class:`Decision` of a look, shared by every policy: its budget ``move``, overload mode from its
    ``triggers`` (an OOM kill is one for every policy: :func:`overload_step`) and the leak verdict
    (:func:`leak_step`; ``rolling_restart``: whether ``leakAction: Restart`` rolls the workers), with the
    ``reasons`` (extended here) and ``pressure`` it saw."""
    if obs.new_oom_kills:
        triggers = [*triggers, "OOM kill"]
    over = overload_step(state, spec, obs, triggers, now)
    if over.reason:
        reasons.append(over.reason)
    verdict, leak, restart, leak_reasons = leak_step(obs, spec, state, now, rolling_restart)
    reasons += leak_reasons
    next_state = replace(
        state,
        budgets=coherent(move.budgets),
        overload=over.mode,
        last_change=move.last_change,
        last_pressure=move.last_pressure,
        last_overload_trigger=over.last_trigger,
        last_restart=now if restart else state.last_restart,
        last_blind=move.last_blind,
    )
    return Decision(state=next_state, direction=move.direction, reasons=tuple(reasons), pressure=tuple(pressure),
                    overload_changed=over.changed, leak_suspected=leak, restart=restart, leak=verdict, memory=memory)
