"""Per pod: the memory peak predicted at a set of budgets, and the largest budgets that fit. Pure.

The memory model is the one the worker's admission and ``moeguard plan`` use
(:mod:`moeguard_core.memory_model`), at the pod's **observed** routing and context mix
(:class:`observation.PodLoad`)::

    predicted peak = idle footprint + KV + correction x step
    KV             = maxConcurrentBatches x maxBatchRequests sequences x mean context x KV bytes per token
    step           = step_peak(one prefill chunk of maxPrefillTokens ending at the longest context, the rest of
                     the chunk as other prompts' first segments, plus min(maxDecodeTokens, sequences) decode
                     tokens at the longest context), at the top-expert share of the observed skew ratio
    it fits       <=> predicted peak <= resources.softLimit

* **Idle footprint**: ``moeguard_memory_idle_footprint_bytes``, the pod's own memory with no request in it
  (weights, runtime, the heap it keeps): the headroom is measured from each pod's baseline, not from a
  fraction of the hard limit.
* **Context mix**: the mean KV capacity (prompt + max_tokens) of the window's requests sizes the KV caches
  the requests in flight hold (sequences x mean, the expected sum), its longest (the bucket bound of
  ``moeguard_request_context_tokens``, at most 1.5x the longest) the step's causal mask. A window without
  requests says nothing of the mix: the model's full context stands in for both (the safe side, used only to
  decide whether budgets may loosen).
* **Skew**: the pod's highest step skew ratio (top / median expert) converted to the top expert's share
  (:func:`memory_model.top_share_from_skew_ratio`); no step large enough: the worker's prior
  (:data:`memory_admission.PRIOR_SKEW_RATIO`). The per-expert buffers are bounded by the worker's expert
  chunk (:data:`memory_admission.DEFAULT_EXPERT_CHUNK_TOKENS`), so skew moves the peak only where the MoE
  phase outgrows the attention phase: on the CPU path's fit it mostly does not.
* **Correction**: the worker's own correction factor (``moeguard_memory_prediction_correction_ratio``, at
  least :data:`memory_admission.CORRECTION_FLOOR`) multiplies the step, as it does for admission.

The model is the workers' own where they report it (``moeguard_memory_model_info``: shape, dtype, expert chunk,
capacity factor; the only source for a ``model.source`` checkpoint, whose ``config.json`` the worker alone
reads), else the spec's preset. The prediction is of the CPU path (``memory_model``'s own scope): a GPU worker's
step is on the device, and an expert-parallel leader holds only its ranks' experts; for those
:func:`model_memory` says why there is no prediction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moeguard_core.contract import METRIC_MEMORY_MODEL_INFO, Budgets
from moeguard_core.family_shape import from_model_args
from moeguard_core.memory_admission import (
    CORRECTION_FLOOR,
    PRIOR_SKEW_RATIO,
)
from moeguard_core.memory_model import (
    DTYPE_BYTES,
    Routing,
    Step,
    kv_bytes_per_token,
    step_peak,
    top_share_from_skew_ratio,
)
from moeguard_core.memory_model_info import ModelMemory
from moeguard_core.presets import get_preset
from moeguard_operator.loop.observation import PodLoad
from moeguard_operator.spec.models import MoEInferenceServiceSpec

MEMORY_KNOBS = ("max_prefill_tokens", "max_decode_tokens", "max_batch_requests", "max_concurrent_batches")
"""The budgets the prediction depends on, in the order a tie is broken (the step's biggest term first)."""


def model_memory(spec: MoEInferenceServiceSpec, reported: Sequence[tuple[str, ModelMemory]] = (),
                 query_error: str | None = None) -> tuple[ModelMemory | None, str | None]:
    """The served model's :class:`ModelMemory`: the one the workers report (``reported``: per pod, their
    ``moeguard_memory_model_info``, :mod:`moeguard_core.memory_model_info`) where every reporting pod reports the
    same, else from ``spec`` (preset and overrides; float32, the CPU worker's ``auto`` dtype; the worker's
    default expert chunk, no capacity factor: the operator sets neither); or ``(None, why)`` where the operator
    cannot predict: a GPU worker, expert parallelism, an unknown preset, a ``model.source`` checkpoint whose
    workers have not reported their model (or report different ones: a rollout between checkpoints); where the
    query for the reports failed (``query_error``, :attr:`Observation.memory_models_error`), the reason says so
    instead of "not reported yet"."""
    if spec.resources.gpus:
        return None, "GPU workers: the memory model is of the CPU path"
    if spec.parallelism.expert_parallel_size > 1:
        return None, "expert parallelism: a leader holds only its ranks' experts"
    models = {model for _, model in reported}
    if len(models) == 1:
        return next(iter(models)), None
    if spec.model.source is not None:
        return None, ("model.source: the pods report different memory models (a rollout?): "
                      f"{', '.join(sorted(pod for pod, _ in reported))}" if models else
                      f"model.source: the {METRIC_MEMORY_MODEL_INFO} query failed ({query_error})" if query_error else
                      f"model.source: no {METRIC_MEMORY_MODEL_INFO} from the workers yet (the checkpoint's shape "
                      f"is known to them only)")
    try:
        args = dataclasses.replace(get_preset(spec.model.preset), **spec.model.overrides.model_dump(exclude_none=True))
    except KeyError:
        return None, f"unknown preset {spec.model.preset!r}"
    return ModelMemory(from_model_args(args)), None


@dataclass(frozen=True)
class Prediction:
    """One pod's predicted peak at a set of budgets, bytes.

    Attributes:
        pod: the pod.
        idle_footprint_bytes: its baseline.
        kv_bytes: the KV caches of the requests in flight.
        step_bytes: the worst step's transient buffers, corrected.
        limit_bytes: the soft limit it must stay under.
        observed_mix: the window had requests (else the full context stood in for the mix).
    """

    pod: str
    idle_footprint_bytes: int
    kv_bytes: int
    step_bytes: int
    limit_bytes: int
    observed_mix: bool

    @property
    def peak_bytes(self) -> int:
        return self.idle_footprint_bytes + self.kv_bytes + self.step_bytes

    @property
    def headroom_bytes(self) -> int:
        """The soft limit minus the peak (negative: it does not fit)."""
        return self.limit_bytes - self.peak_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    def describe(self) -> str:
        mib = 2**20
        return (f"{self.pod} predicted {self.peak_bytes / mib:,.0f} MiB (idle {self.idle_footprint_bytes / mib:,.0f}"
                f" + KV {self.kv_bytes / mib:,.0f} + step {self.step_bytes / mib:,.0f}) of softLimit "
                f"{self.limit_bytes / mib:,.0f} MiB")


def contexts(model: ModelMemory, load: PodLoad) -> tuple[int, int, bool]:
    """``(mean, longest, observed)`` KV capacity of the pod's requests, tokens, at most the model's context;
    the full context for both when the window had no request (``observed`` False)."""
    top = model.shape.max_seq_len
    if load.context_max_tokens is None or load.context_mean_tokens is None:
        return top, top, False
    longest = max(1, min(top, math.ceil(load.context_max_tokens)))
    return max(1, min(longest, math.ceil(load.context_mean_tokens))), longest, True


def worst_step(budgets: Budgets, longest: int, sequences: int) -> Step:
    """The budgets' worst step at a context of ``longest`` tokens: ``maxPrefillTokens`` of prefill, its first
    chunk ending at ``longest`` (the largest mask) and the rest as other prompts' first segments, plus
    ``min(maxDecodeTokens, sequences)`` decode tokens over ``longest - 1`` cached positions."""
    p = budgets.max_prefill_tokens
    first = min(p, longest)
    prefill = [(longest - first, first)]
    rest = p - first
    while rest > 0:
        n = min(rest, longest)
        prefill.append((0, n))
        rest -= n
    return Step(prefill=tuple(prefill), decode_contexts=(max(0, longest - 1),) * min(budgets.max_decode_tokens,
                                                                                         sequences))


def predict(model: ModelMemory, budgets: Budgets, load: PodLoad, limit_bytes: int) -> Prediction | None:
    """The pod's :class:`Prediction` at ``budgets`` under its observed mix and skew; None without its idle
    footprint (an older worker, or one never idle yet)."""
    if load.idle_footprint_bytes is None:
        return None
    mean, longest, observed = contexts(model, load)
    shape = model.shape
    sequences = budgets.max_concurrent_batches * budgets.max_batch_requests
    kv = sequences * mean * kv_bytes_per_token(shape, DTYPE_BYTES[model.dtype])
    share = top_share_from_skew_ratio(load.skew_ratio if load.skew_ratio is not None else PRIOR_SKEW_RATIO,
                                      shape.num_experts, shape.top_k)
    step = step_peak(shape, worst_step(budgets, longest, sequences),
                     Routing(share, model.expert_chunk_tokens, model.capacity_factor), model.dtype).total_bytes
    correction = max(CORRECTION_FLOOR, load.correction or 0.0)
    return Prediction(load.pod, int(load.idle_footprint_bytes), kv, math.ceil(step * correction), limit_bytes,
                      observed)


def _with(budgets: Budgets, name: str, value: int) -> Budgets:
    return budgets.model_copy(update={name: value})


def largest(fits: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest ``v`` in ``[lo, hi]`` with ``fits(v)`` (``fits`` monotone: true up to some value), or None
    when not even ``lo`` fits (binary search)."""
    if hi < lo or not fits(lo):
        return None
    if fits(hi):
        return hi
    while hi - lo > 1:  # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _fits_with(fits: Callable[[Budgets], bool], budgets: Budgets, name: str) -> Callable[[int], bool]:
    return lambda value: fits(_with(budgets, name, value))


def solve(model: ModelMemory, budgets: Budgets, lower: Budgets, load: PodLoad, limit_bytes: int) -> Budgets:
    """The budgets closest to ``budgets`` whose prediction fits under ``limit_bytes``: ``budgets`` itself when
    it fits (or without an idle footprint); else one budget of :data:`MEMORY_KNOBS` cut to the largest value
    that fits (never below ``lower``), the one that needs the smallest relative cut; where no single one can,
    the first is set to its floor and the others are tried again. The result is at ``lower`` where nothing fits
    (the inner loop's admission still bounds each step)."""
    def fits(b: Budgets) -> bool:
        p = predict(model, b, load, limit_bytes)
        return p is None or p.fits

    current = budgets
    for _ in MEMORY_KNOBS:
        if fits(current):
            return current
        best: tuple[float, int, str, int] | None = None
        for order, name in enumerate(MEMORY_KNOBS):
            now, floor = getattr(current, name), getattr(lower, name)
            value = largest(_fits_with(fits, current, name), floor, now)
            if value is not None:
                cut = 1.0 - value / now
                if best is None or (cut, order) < (best[0], best[1]):
                    best = (cut, order, name, value)
        if best is not None:
            return _with(current, best[2], best[3])
        first = next((n for n in MEMORY_KNOBS if getattr(current, n) > getattr(lower, n)), None)
        if first is None:
            return current
        current = _with(current, first, getattr(lower, first))
    return current
