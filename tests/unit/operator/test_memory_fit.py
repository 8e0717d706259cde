"""The per-pod memory prediction and the largest budgets that fit (issue 30), on the headline's shape: preset
``small`` (float32), softLimit 980 MiB, an idle footprint near the headline's measured 799 MiB."""

from __future__ import annotations

import dataclasses

import pytest

from moeguard_core.memory_model import (
    Routing,
    kv_bytes_per_token,
    step_peak,
    top_share_from_skew_ratio,
)
from moeguard_operator.loop import memory_fit
from moeguard_operator.loop.memory_fit import largest, model_memory, predict, solve, worst_step
from moeguard_operator.loop.observation import PodLoad
from moeguard_operator.loop.policy import floors, initial_budgets
from moeguard_operator.spec.models import MoEInferenceServiceSpec

pytestmark = pytest.mark.unit

MIB = 2**20
SPEC = MoEInferenceServiceSpec.model_validate({
    "model": {"preset": "small"}, "resources": {"gpus": 0, "softLimit": "980Mi", "hardLimit": "1152Mi"},
    "batching": {"maxPrefillTokens": 256, "maxDecodeTokens": 8, "maxBatchRequests": 8, "maxConcurrentBatches": 1,
                 "maxLongRequestsPerBatch": 1, "maxQueueRequests": 8, "queueTimeoutSeconds": 2.0,
                 "floors": {"maxPrefillTokens": 64, "maxDecodeTokens": 1, "maxBatchRequests": 1,
                            "maxLongRequestsPerBatch": 1, "maxConcurrentBatches": 1, "maxQueueRequests": 1,
                            "queueTimeoutSeconds": 1.0}}})
MODEL = model_memory(SPEC)[0]
assert MODEL is not None
START = initial_budgets(SPEC.batching)
LOW = floors(SPEC.batching)
SOFT = SPEC.resources.soft_limit_bytes


def load(idle_mib: float | None = 799, mean: float | None = 300, longest: float | None = 2048,
         skew: float | None = 2.0, correction: float | None = None) -> PodLoad:
    return PodLoad("w-0", idle_footprint_bytes=None if idle_mib is None else idle_mib * MIB, skew_ratio=skew,
                   context_mean_tokens=mean, context_max_tokens=longest, correction=correction)


def test_the_prediction_is_footprint_plus_kv_plus_the_corrected_worst_step() -> None:
    p = predict(MODEL, START, load(), SOFT)
    assert p is not None and p.observed_mix
    assert p.kv_bytes == 8 * 300 * kv_bytes_per_token(MODEL.shape, 4) == 29_491_200  # 8 sequences x 300 tokens
    raw = step_peak(MODEL.shape, worst_step(START, 2048, 8), Routing(top_share_from_skew_ratio(2.0, 8, 2))).total_bytes
    assert p.step_bytes == -(-raw * 12 // 10)  # the worker's correction floor, 1.2
    assert p.peak_bytes == 799 * MIB + p.kv_bytes + p.step_bytes and p.fits
    assert round(p.headroom_bytes / MIB) == 132
    corrected = predict(MODEL, START, load(correction=2.0), SOFT)
    assert corrected is not None and corrected.step_bytes == -(-raw * 2 // 1)  # the pod's own factor, when higher


def test_skew_alone_does_not_move_this_prediction_the_expert_chunk_bounds_the_buffers() -> None:
    calm, skewed = predict(MODEL, START, load(skew=2.0), SOFT), predict(MODEL, START, load(skew=384.0), SOFT)
    assert calm is not None and skewed is not None and calm.peak_bytes == skewed.peak_bytes


def test_the_worst_step_ends_its_first_chunk_at_the_longest_context() -> None:
    step = worst_step(START.model_copy(update={"max_prefill_tokens": 5000}), 2048, 8)
    assert step.prefill == ((0, 2048), (0, 2048), (0, 904)) and step.decode_contexts == (2047,) * 8
    assert worst_step(START, 2048, 3).prefill == ((1792, 256),) and len(worst_step(START, 2048, 3).decode_contexts) == 3


def test_solve_cuts_one_budget_only_as_far_as_needed_not_by_half() -> None:
    tight = load(idle_mib=880, mean=800, longest=3072)
    before = predict(MODEL, START, tight, SOFT)
    assert before is not None and not before.fits and round(-before.headroom_bytes / MIB) == 2
    solved = solve(MODEL, START, LOW, tight, SOFT)
    assert solved == START.model_copy(update={"max_batch_requests": 7})  # 8 -> 7: KV is the term over
    after, over = predict(MODEL, solved, tight, SOFT), predict(MODEL, START, tight, SOFT)
    assert after is not None and after.fits and over is not None and not over.fits


def test_solve_finds_the_largest_prefill_that_fits() -> None:
    one = START.model_copy(update={"max_prefill_tokens": 4096, "max_batch_requests": 1, "max_decode_tokens": 1})
    full = load(idle_mib=800, mean=4096, longest=4096)
    solved = solve(MODEL, one, LOW, full, SOFT)
    assert solved == one.model_copy(update={"max_prefill_tokens": 2004})
    fits = predict(MODEL, solved, full, SOFT)
    over = predict(MODEL, solved.model_copy(update={"max_prefill_tokens": 2005}), full, SOFT)
    assert fits is not None and fits.fits and over is not None and not over.fits


def test_solve_stops_at_the_floors_where_nothing_fits() -> None:
    one = START.model_copy(update={"max_prefill_tokens": 4096, "max_batch_requests": 1, "max_decode_tokens": 1})
    assert solve(MODEL, one, LOW, load(idle_mib=999, mean=4096, longest=4096), SOFT) == one.model_copy(
        update={"max_prefill_tokens": 64})


def test_a_window_without_requests_predicts_at_the_full_context() -> None:
    p = predict(MODEL, START, load(mean=None, longest=None), SOFT)
    assert p is not None and not p.observed_mix
    assert p.kv_bytes == 8 * 4096 * kv_bytes_per_token(MODEL.shape, 4)


def test_no_idle_footprint_no_prediction() -> None:
    assert predict(MODEL, START, load(idle_mib=None), SOFT) is None
    assert solve(MODEL, START, LOW, load(idle_mib=None), SOFT) == START


@pytest.mark.parametrize(("change", "why"), [
    ({"resources": {"gpus": 1}}, "GPU workers"),
    ({"resources": {"gpus": 0}, "model": {"source": {"persistentVolumeClaim": {"claimName": "w"}}}}, "model.source"),
    ({"resources": {"gpus": 0}, "parallelism": {"expertParallelSize": 2}}, "expert parallelism"),
    ({"resources": {"gpus": 0}, "model": {"preset": "nope"}}, "unknown preset"),
])
def test_where_the_operator_cannot_predict_it_says_why(change: dict[str, object], why: str) -> None:
    model, reason = memory_fit.model_memory(MoEInferenceServiceSpec.model_validate(change))
    assert model is None and reason is not None and reason.startswith(why)


def test_the_workers_reported_model_is_used_where_every_pod_reports_the_same() -> None:
    """Issue 30: the worker exports the model it predicts with (``moeguard_memory_model_info``): a ``model.source``
    checkpoint is predicted with it, and a preset's workers' own dtype wins over the operator's float32 guess."""
    source = MoEInferenceServiceSpec.model_validate(
        {"resources": {"gpus": 0}, "model": {"source": {"persistentVolumeClaim": {"claimName": "w"}}}})
    assert MODEL is not None
    bf16 = dataclasses.replace(MODEL, dtype="bfloat16", expert_chunk_tokens=512)
    assert memory_fit.model_memory(source, (("w-0", bf16), ("w-1", bf16))) == (bf16, None)
    assert memory_fit.model_memory(SPEC, (("w-0", bf16),)) == (bf16, None)
    other = dataclasses.replace(bf16, dtype="float32")
    model, why = memory_fit.model_memory(source, (("w-0", bf16), ("w-1", other)))
    assert model is None and why == "model.source: the pods report different memory models (a rollout?): w-0, w-1"
    assert memory_fit.model_memory(SPEC, (("w-0", bf16), ("w-1", other))) == (MODEL, None)  # the preset's
    assert memory_fit.model_memory(source)[1] == ("model.source: no moeguard_memory_model_info from the workers yet "
                                                  "(the checkpoint's shape is known to them only)")
    assert memory_fit.model_memory(source, (), "PrometheusHTTPError 503")[1] == (
        "model.source: the moeguard_memory_model_info query failed (PrometheusHTTPError 503)")
    assert memory_fit.model_memory(SPEC, (), "PrometheusHTTPError 503") == (MODEL, None)  # the preset stands in
    gpu = MoEInferenceServiceSpec.model_validate({"resources": {"gpus": 1}})
    assert memory_fit.model_memory(gpu, (("w-0", bf16),))[0] is None  # the model is of the CPU path


def test_largest_is_a_binary_search_of_a_monotone_fit() -> None:
    assert largest(lambda v: v <= 37, 1, 100) == 37
    assert largest(lambda v: v <= 100, 1, 100) == 100
    assert largest(lambda v: False, 1, 100) is None
    assert largest(lambda v: True, 5, 4) is None
