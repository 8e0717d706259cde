"""Pure parts of the control-latency benchmark under ``--policy predictive`` (:mod:`bench.control_latency`):
the step's spec, the budgets the memory model says are needed, counts and verdicts. No I/O here.

The targets are issue 30's ("Measure", item 2):

* skew with room to spare: no budget change (:func:`no_change_verdict`);
* a step that would not fit: the needed budget in effect at every worker, median <= 25 s;
* an OOM kill: tighter budgets at every survivor, median <= 10 s.

The expected budgets are computed with the operator's own code (:mod:`moeguard_operator.loop.memory_fit`, the
memory model of :mod:`moeguard_core.memory_model`), from what the bench reads of each worker (idle footprint,
correction factor) and the context mix it sends, exactly as :func:`moeguard_operator.loop.predictive.decide`
does for the pods whose prediction does not fit. Sizes are bytes, contexts tokens, times Unix seconds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.control_stats import Series, steps
from moeguard_core.contract import CONTEXT_TOKEN_BUCKETS, Budgets
from moeguard_operator.loop import memory_fit
from moeguard_operator.loop.observation import PodLoad
from moeguard_operator.loop.policy import ceilings, floors
from moeguard_operator.loop.predictive import lowest
from moeguard_operator.spec.spec_checks import parse_spec

MiB = 2**20
SKEW_ROOM_TARGET_CHANGES = 0
"""Skew with room to spare: budget changes allowed over the hold (issue 30: "no budget change")."""
STEP_TARGET_S = 25.0
"""A step that would not fit: median seconds from the step's first request until the needed budget is in
effect at every worker (issue 30)."""
OOM_TARGET_S = 10.0
"""An OOM kill: median seconds from the kill until every survivor runs tighter budgets (issue 30)."""

LONG_PROMPT_TOKENS = 4000
"""The step's prompts, tokens (real text): with :data:`OUTPUT_TOKENS` a KV capacity of 4,008 tokens, in the
4,096 bucket of ``moeguard_request_context_tokens``: the prediction's longest context is the model's 4,096."""
OUTPUT_TOKENS = 8
"""``max_tokens`` of every request (the traffic's, :class:`bench.steady_traffic.SteadyTraffic`)."""
STEP_SEQ_LEN = 4096
"""``model.overrides.maxSeqLen`` of the step's spec: the tiny preset's 1,024 makes the whole step (its causal
mask grows with the square of the context) a few MiB; at 4,096 the worst step of maxPrefillTokens 4,096 is a
~100 MiB mask, and the prediction depends on maxPrefillTokens almost linearly below the context."""
STEP_FRACTION = 0.6
"""The step's softLimit is sized (:func:`soft_limit_for`) so that the largest maxPrefillTokens that fits the long
prompts is about this fraction of the ceiling: a cut the policy must compute (a halving would be 0.5)."""
CALIBRATION_SOFT_LIMIT = "1536Mi"
"""The softLimit of the calibration service (the step's spec with room), whose idle footprint sizes the step's."""


def step_spec(soft_limit: str) -> dict[str, Any]:
    """The MoEInferenceService spec of the step measurement: 2 replicas of the tiny preset at a 4,096-token
    context (:data:`STEP_SEQ_LEN`), the default ceilings but 4 requests a batch and one batch in flight (the KV
    caches then weigh 8 MiB at the long prompts' mix, so the step's causal mask is what does not fit, and
    maxPrefillTokens is the one budget whose cut can make it fit), ``softLimit`` as given (:func:`soft_limit_for`);
    every other field as :data:`bench.control_latency.SPEC`."""
    return {
        "model": {"preset": "tiny", "overrides": {"maxSeqLen": STEP_SEQ_LEN}}, "replicas": 2,
        "resources": {"gpus": 0, "cpu": "1", "softLimit": soft_limit, "hardLimit": "2Gi"},
        "batching": {"maxBatchRequests": 4, "maxConcurrentBatches": 1},
        "control": {"skewThreshold": 32},
    }


def context_bucket(tokens: float) -> float:
    """The upper bound of the ``moeguard_request_context_tokens`` bucket holding ``tokens``: what the operator's
    ``histogram_quantile(1, ...)`` reads as the window's longest context."""
    return next(b for b in CONTEXT_TOKEN_BUCKETS if tokens <= b)


def load_of(pod: str, idle_bytes: float, context_tokens: int, correction: float | None = None,
            skew_ratio: float | None = None) -> PodLoad:
    """A pod's inputs to the prediction when every request in the window has a KV capacity of
    ``context_tokens`` (prompt + max_tokens): mean that, longest its bucket bound."""
    return PodLoad(pod=pod, idle_footprint_bytes=idle_bytes, skew_ratio=skew_ratio,
                   context_mean_tokens=float(context_tokens), context_max_tokens=context_bucket(context_tokens),
                   correction=correction)


def predict(spec: Mapping[str, Any], budgets: Budgets, load: PodLoad) -> memory_fit.Prediction:
    """The operator's prediction of ``load``'s pod at ``budgets`` against ``spec``'s softLimit.

    Raises:
        ValueError: the spec has no memory model (GPU workers, a checkpoint) or the load no idle footprint.
    """
    parsed = parse_spec(spec)
    model, why = memory_fit.model_memory(parsed)
    if model is None:
        raise ValueError(f"no memory model: {why}")
    p = memory_fit.predict(model, budgets, load, parsed.resources.soft_limit_bytes)
    if p is None:
        raise ValueError(f"{load.pod}: no idle footprint")
    return p


def ceiling_budgets(spec: Mapping[str, Any]) -> Budgets:
    """The spec's ceilings (the budgets a fresh service runs with)."""
    return ceilings(parse_spec(spec).batching)


def needed_budgets(spec: Mapping[str, Any], loads: Sequence[PodLoad], budgets: Budgets | None = None) -> Budgets:
    """The budgets the predictive policy sets when ``budgets`` (default: the ceilings) run ``loads``: for each
    pod whose prediction does not fit, the largest that fit (:func:`memory_fit.solve`), the lowest over the
    pods; ``budgets`` itself when every pod fits (``predictive.decide``'s predicted-memory path, without
    cooldown or OOM kills)."""
    parsed = parse_spec(spec)
    model, why = memory_fit.model_memory(parsed)
    if model is None:
        raise ValueError(f"no memory model: {why}")
    start = budgets if budgets is not None else ceilings(parsed.batching)
    limit, lower = parsed.resources.soft_limit_bytes, floors(parsed.batching)
    target = start
    for load in loads:
        p = memory_fit.predict(model, start, load, limit)
        if p is not None and not p.fits:
            target = lowest(target, memory_fit.solve(model, start, lower, load, limit))
    return target


def soft_limit_for(idle_bytes: float, correction: float | None = None, fraction: float = STEP_FRACTION,
                   context_tokens: int = LONG_PROMPT_TOKENS + OUTPUT_TOKENS) -> int:
    """The step's softLimit, bytes, whole MiB: the predicted peak at the ceilings but maxPrefillTokens
    ``fraction`` of its ceiling, for a pod of ``idle_bytes`` (the calibration's largest) under requests of
    ``context_tokens``; rounded up, so the largest maxPrefillTokens that fits is that one or a few tokens more."""
    spec = step_spec(CALIBRATION_SOFT_LIMIT)
    top = ceiling_budgets(spec)
    at = top.model_copy(update={"max_prefill_tokens": max(1, round(fraction * top.max_prefill_tokens))})
    p = predict(spec, at, load_of("calibration", idle_bytes, context_tokens, correction))
    return math.ceil(p.peak_bytes / MiB) * MiB


def quantity(n_bytes: int) -> str:
    """``n_bytes`` as a Kubernetes quantity in whole MiB (rounded up)."""
    return f"{math.ceil(n_bytes / MiB)}Mi"


def changes(series: Series) -> int:
    """How many times the value changes along ``series`` (repeated readings are no change)."""
    return max(0, len(steps(series)) - 1)


def budget_changes(series_by_budget: Mapping[str, Series]) -> int:
    """Changes summed over one worker's budget gauges."""
    return sum(changes(s) for s in series_by_budget.values())


def no_change_verdict(n_changes: int | None) -> str:
    """Issue 30's skew-with-room target: no budget change at any worker."""
    if n_changes is None:
        return "**not measured**"
    return "met" if n_changes <= SKEW_ROOM_TARGET_CHANGES else "**missed**"


def median_verdict(median: float | None, target: float) -> str:
    """``met`` when the median (seconds) is at most ``target``."""
    if median is None:
        return "**not measured**"
    return "met" if median <= target else "**missed**"


@dataclass(frozen=True)
class Generation:
    """One budget document the operator wrote: its generation, when the bench first saw it in status, and its
    budgets (camelCase, as in ``status.budgets``)."""

    generation: int
    seen_unix: float
    budgets: dict[str, float]


def generations(statuses: Sequence[tuple[float, Mapping[str, Any]]]) -> list[Generation]:
    """The distinct ``status.budgetGeneration`` values in polled statuses ``(unix, status)``, in order."""
    out: list[Generation] = []
    for t, st in statuses:
        g, b = st.get("budgetGeneration"), st.get("budgets")
        if g is None or b is None or (out and out[-1].generation == int(g)):
            continue
        out.append(Generation(int(g), t, dict(b)))
    return out


def first_below(gens: Sequence[Generation], ceiling: Mapping[str, float], budget: str) -> Generation | None:
    """The first generation whose ``budget`` (camelCase) is below ``ceiling``'s."""
    return next((g for g in gens if budget in g.budgets and g.budgets[budget] < ceiling[budget]), None)


def max_skew(statuses: Sequence[tuple[float, Mapping[str, Any]]]) -> float | None:
    """The highest ``status.observed.skewRatio`` the operator reported."""
    seen = [float(v) for _, st in statuses if (v := (st.get("observed") or {}).get("skewRatio")) is not None]
    return max(seen) if seen else None


def min_headroom(statuses: Sequence[tuple[float, Mapping[str, Any]]]) -> int | None:
    """The least ``headroomBytes`` of any pod in ``status.observed.predictedMemory``, bytes."""
    room = [int(p["headroomBytes"]) for _, st in statuses
            for p in (st.get("observed") or {}).get("predictedMemory") or [] if "headroomBytes" in p]
    return min(room) if room else None


def finding_kinds(statuses: Sequence[tuple[float, Mapping[str, Any]]]) -> list[str]:
    """The diagnosis finding kinds seen in any polled status, sorted."""
    return sorted({f["kind"] for _, st in statuses for f in (st.get("diagnosis") or {}).get("findings") or []
                   if "kind" in f})


def window(series: Series, start: float, end: float) -> list[tuple[float, float]]:
    """The readings of ``series`` in ``[start, end]``, after the last reading before ``start`` (the value in
    effect when the window opened, so a change right at its start counts)."""
    before = [(t, v) for t, v in series if t < start]
    return before[-1:] + [(t, v) for t, v in series if start <= t <= end]


def latest(series: Series, at: float) -> float | None:
    """The last reading of ``series`` at or before ``at``."""
    return next((v for t, v in reversed(series) if t <= at), None)


def predicted_pods(status: Mapping[str, Any]) -> set[str]:
    """The pods in ``status.observed.predictedMemory`` (the operator has each one's idle footprint)."""
    return {str(p["pod"]) for p in (status.get("observed") or {}).get("predictedMemory") or [] if "pod" in p}


def value_changes(values: Sequence[Any]) -> int:
    """How many times consecutive values differ (any comparable values: budgets as dicts, modes as strings)."""
    return sum(1 for a, b in itertools.pairwise(values) if a != b)


def collapsed(values: Sequence[Any]) -> list[Any]:
    """``values`` with repeats in a row collapsed (``[Off, Off, On, Off]`` -> ``[Off, On, Off]``)."""
    return [v for j, v in enumerate(values) if j == 0 or v != values[j - 1]]
