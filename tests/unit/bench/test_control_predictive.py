"""The predictive control-latency benchmark's pure parts (issue 30, "Measure" item 2): the step's spec and the
budgets the memory model says it needs, the skew-with-room spec's headroom, counts, status readings, verdicts and
the report."""

from __future__ import annotations

import pytest
from bench import control_predictive as pred
from bench.control_latency import SPEC, report_predictive, worker_reading

from moeguard_core.contract import BUDGET_NAMES
from moeguard_operator.loop.observation import PodLoad

pytestmark = pytest.mark.unit

MiB = 2**20
IDLE = 460 * MiB
"""About a tiny CPU worker's steady memory (bench/results/diagnosis.json: rssSoftFraction ~0.248 of 2 GiB was
48 MiB above it)."""
LONG = pred.LONG_PROMPT_TOKENS + pred.OUTPUT_TOKENS


def step_spec_for(idle: float, correction: float | None = None) -> dict[str, object]:
    return pred.step_spec(pred.quantity(pred.soft_limit_for(idle, correction)))


def test_context_bucket_is_the_operator_longest() -> None:
    assert pred.context_bucket(392) == 512
    assert pred.context_bucket(LONG) == 4096 == pred.STEP_SEQ_LEN
    assert pred.context_bucket(4096) == 4096
    assert pred.context_bucket(16) == 16


def test_step_needs_a_computed_prefill_cut_not_a_halving() -> None:
    spec = step_spec_for(IDLE)
    top = pred.ceiling_budgets(spec)
    long = pred.load_of("a", IDLE, LONG)
    assert not pred.predict(spec, top, long).fits  # the ceilings do not fit the long prompts
    assert pred.predict(spec, top, pred.load_of("a", IDLE, 392)).fits  # 384-token prompts would
    need = pred.needed_budgets(spec, [long])
    changed = {n for n in BUDGET_NAMES if getattr(need, n) != getattr(top, n)}
    assert changed == {"max_prefill_tokens"}
    ratio = need.max_prefill_tokens / top.max_prefill_tokens
    assert abs(ratio - pred.STEP_FRACTION) < 0.03 and abs(ratio - 0.5) > 0.05
    assert pred.predict(spec, need, long).fits
    one_more = need.model_copy(update={"max_prefill_tokens": need.max_prefill_tokens + 1})
    assert not pred.predict(spec, one_more, long).fits  # the largest that fits


def test_soft_limit_is_idle_plus_the_predicted_step_whole_mib() -> None:
    soft = pred.soft_limit_for(IDLE)
    assert soft % MiB == 0
    assert IDLE + 60 * MiB < soft < IDLE + 120 * MiB  # KV 8 MiB + the corrected step at 0.6 x 4,096 tokens
    assert pred.soft_limit_for(IDLE + 10 * MiB) == soft + 10 * MiB
    assert pred.quantity(soft) == f"{soft // MiB}Mi" and pred.quantity(soft + 1) == f"{soft // MiB + 1}Mi"


def test_needed_follows_the_inputs_the_operator_reads() -> None:
    spec = step_spec_for(IDLE)
    base = pred.needed_budgets(spec, [pred.load_of("a", IDLE, LONG)]).max_prefill_tokens
    # a larger idle footprint on one pod: the lowest over the pods
    both = pred.needed_budgets(spec, [pred.load_of("a", IDLE, LONG), pred.load_of("b", IDLE + 16 * MiB, LONG)])
    assert both.max_prefill_tokens < base
    # a correction above its floor (1.2) scales the step: a deeper cut
    assert pred.needed_budgets(spec, [pred.load_of("a", IDLE, LONG, correction=1.5)]).max_prefill_tokens < base
    # the attention phase dominates this step: the expert skew does not move it
    assert {pred.needed_budgets(spec, [pred.load_of("a", IDLE, LONG, skew_ratio=r)]).max_prefill_tokens
            for r in (1.0, 4.0, 384.0)} == {base}


def test_skew_with_room_fits_with_room_to_spare() -> None:
    top = pred.ceiling_budgets(SPEC)
    skewed = pred.load_of("a", IDLE, 392, skew_ratio=384.0)
    p = pred.predict(SPEC, top, skewed)
    assert p.fits and p.headroom_bytes > 900 * MiB
    assert pred.needed_budgets(SPEC, [skewed, pred.load_of("b", IDLE, 392, skew_ratio=384.0)]) == top


def test_predict_refuses_without_a_model_or_idle_footprint() -> None:
    gpu = {**SPEC, "resources": {**SPEC["resources"], "gpus": 1}}  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="no memory model"):
        pred.predict(gpu, pred.ceiling_budgets(SPEC), pred.load_of("a", IDLE, 392))
    no_idle = PodLoad(pod="a", context_mean_tokens=392.0, context_max_tokens=512.0)
    with pytest.raises(ValueError, match="no idle footprint"):
        pred.predict(SPEC, pred.ceiling_budgets(SPEC), no_idle)


def test_changes_windows_and_collapses() -> None:
    s = [(0.0, 4096.0), (1.0, 4096.0), (2.0, 2048.0), (3.0, 2048.0), (4.0, 4096.0)]
    assert pred.changes(s) == 2 and pred.changes([]) == 0 and pred.changes(s[:2]) == 0
    assert pred.budget_changes({"max_prefill_tokens": s, "max_decode_tokens": [(0.0, 256.0)]}) == 2
    assert pred.window(s, 1.5, 3.5) == [(1.0, 4096.0), (2.0, 2048.0), (3.0, 2048.0)]  # the value in effect at 1.5 first
    assert pred.changes(pred.window(s, 2.5, 3.5)) == 0
    assert pred.latest(s, 2.5) == 2048.0 and pred.latest(s, -1.0) is None
    assert pred.value_changes([{"a": 1}, {"a": 1}, {"a": 2}, None]) == 2
    assert pred.collapsed(["Off", "Off", "On", "Off", "Off"]) == ["Off", "On", "Off"]


def test_verdicts() -> None:
    assert pred.no_change_verdict(0) == "met"
    assert pred.no_change_verdict(1) == "**missed**"
    assert pred.no_change_verdict(None) == "**not measured**"
    assert pred.median_verdict(25.0, pred.STEP_TARGET_S) == "met"
    assert pred.median_verdict(25.1, pred.STEP_TARGET_S) == "**missed**"
    assert pred.median_verdict(None, pred.OOM_TARGET_S) == "**not measured**"
    assert (pred.STEP_TARGET_S, pred.OOM_TARGET_S, pred.SKEW_ROOM_TARGET_CHANGES) == (25.0, 10.0, 0)


CEIL = {"maxPrefillTokens": 4096.0, "maxDecodeTokens": 256.0}
STATUSES = [
    (10.0, {"budgetGeneration": 1, "budgets": CEIL, "observed": {"skewRatio": 8.0}}),
    (12.0, {"budgetGeneration": 1, "budgets": CEIL, "observed": {"skewRatio": 384.0, "predictedMemory": [
        {"pod": "a", "headroomBytes": 900 * MiB}, {"pod": "b", "headroomBytes": 1000 * MiB}]},
        "diagnosis": {"findings": [{"kind": "RoutingSkew"}]}}),
    (14.0, {"budgetGeneration": 2, "budgets": CEIL, "overloadMode": "On"}),  # overload only: same budgets
    (16.0, {"budgetGeneration": 3, "budgets": {**CEIL, "maxPrefillTokens": 2489.0}}),
    (18.0, {"budgetGeneration": 3, "budgets": {**CEIL, "maxPrefillTokens": 2489.0}}),
]


def test_status_readings() -> None:
    gens = pred.generations(STATUSES)
    assert [(g.generation, g.seen_unix) for g in gens] == [(1, 10.0), (2, 14.0), (3, 16.0)]
    cut = pred.first_below(gens, CEIL, "maxPrefillTokens")
    assert cut is not None and (cut.generation, cut.budgets["maxPrefillTokens"]) == (3, 2489.0)
    assert pred.first_below(gens[:2], CEIL, "maxPrefillTokens") is None
    assert pred.max_skew(STATUSES) == 384.0 and pred.max_skew([]) is None
    assert pred.min_headroom(STATUSES) == 900 * MiB and pred.min_headroom(STATUSES[:1]) is None
    assert pred.finding_kinds(STATUSES) == ["RoutingSkew"]
    assert pred.predicted_pods(STATUSES[1][1]) == {"a", "b"} and pred.predicted_pods({}) == set()


def test_worker_reading_keys_budgets_by_name() -> None:
    got = worker_reading({"moeguard_budget_max_prefill_tokens": 4096.0, "moeguard_budget_generation": 3.0,
                          "moeguard_memory_idle_footprint_bytes": 1.0})
    assert got == {"max_prefill_tokens": 4096.0, "moeguard_budget_generation": 3.0,
                   "moeguard_memory_idle_footprint_bytes": 1.0}
    assert worker_reading({}) is None


def test_report_has_a_target_row_per_measurement() -> None:
    res = {
        "pilot": False, "policy": "predictive", "spec": SPEC, "machine": "test", "note": "", "elapsed_s": 600.0,
        "skew_hold_s": 60.0, "step_spec": pred.step_spec("549Mi"), "step_soft_limit": "549Mi",
        "calibration": {"idle_bytes": IDLE, "correction": None, "soft_limit": "549Mi"},
        "skew_room": [{"rep": 0, "changes_total": 0, "budget_changes": {"a": 0, "b": 0}, "max_skew_ratio": 384.0,
                       "routing_skew_events": 1, "finding_kinds": ["RoutingSkew"], "min_headroom_bytes": 1000 * MiB,
                       "overload_modes": ["Off"], "shrink_factors": {"a": [1.0]}}],
        "step": [{"rep": 0, "step_latency_s": 14.0, "cut_seen_in_status_s": 12.0, "ceiling": CEIL,
                  "cut": {"budgets": {**CEIL, "maxPrefillTokens": 2489.0}}, "cut_ratio": 2489 / 4096,
                  "cut_budgets_changed": ["maxPrefillTokens"], "expected_before": {"needed": {"maxPrefillTokens": 2489}},
                  "generations": [{"seen_s": 12.0, "budgets": {"maxPrefillTokens": 2489.0}}]},
                 {"rep": 1, "error": "no maxPrefillTokens cut in status within 120 s", "ceiling": CEIL}],
        "oom": [{"rep": 0, "oom_latency_s": 1.2, "killed_pod": "p", "terminated": {"reason": "OOMKilled"}}],
    }
    md = report_predictive(res)
    assert "| skew with room: budget changes at any worker over the hold | 1/1 | 0 changes (0 per rep) | 0 changes | met |" in md
    assert "median 14.0 s, max 14.0 s | median ≤ 25 s | met |" in md
    assert "| 1/2 |" in md  # the failed step rep counts as not measured
    assert "median ≤ 10 s | met |" in md
    assert "4096 → 2489.0 (0.608)" in md
