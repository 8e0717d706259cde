"""The budget document the operator writes: which budgets, which generation, and when to write it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from moeguard_core.contract import BudgetDocument, Budgets
from moeguard_operator.loop import budget_document as bd
from moeguard_operator.loop.policy import Decision, PolicyState
from moeguard_operator.spec.models import MoEInferenceServiceSpec, MoEInferenceServiceStatus

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 1, tzinfo=UTC)
MINE = Budgets(max_prefill_tokens=2048, max_decode_tokens=64, max_batch_requests=16, max_concurrent_batches=2)
HAND = MINE.model_copy(update={"max_prefill_tokens": 700})
SPEC = MoEInferenceServiceSpec.model_validate({"batching": {"maxPrefillTokens": 2048, "maxDecodeTokens": 64,
                                                            "maxBatchRequests": 16, "maxConcurrentBatches": 2}})
INITIAL = Budgets(max_prefill_tokens=2048, max_decode_tokens=64, max_batch_requests=16, max_concurrent_batches=2)


def _status(**fields: Any) -> MoEInferenceServiceStatus:
    return MoEInferenceServiceStatus.model_validate(fields)


def test_same_document_is_not_written_again() -> None:
    doc = BudgetDocument(generation=3, budgets=MINE)
    assert bd.to_apply(doc.to_configmap_data(), doc) is None


def test_a_changed_document_is_written_as_is() -> None:
    old = BudgetDocument(generation=3, budgets=HAND).to_configmap_data()
    new = BudgetDocument(generation=4, budgets=MINE)
    assert bd.to_apply(old, new) == new


def test_a_hand_edit_at_the_same_generation_is_superseded() -> None:
    hand = BudgetDocument(generation=50, budgets=HAND).to_configmap_data()
    written = bd.to_apply(hand, BudgetDocument(generation=50, budgets=MINE))
    assert written is not None and (written.generation, written.budgets) == (51, MINE)


def test_missing_or_unreadable_configmap() -> None:
    assert bd.generation_in(None) == 0
    assert bd.generation_in({"budget.json": '{"generation": 7, "budgets": "junk"}'}) == 7
    assert bd.generation_in({"budget.json": "not json"}) == 0
    assert bd.generation_in({"budget.json": "[1, 2]"}) == 0
    doc = BudgetDocument(generation=1, budgets=MINE)
    assert bd.to_apply(None, doc) == doc
    # An unreadable document with a higher generation is replaced by a valid, newer one.
    written = bd.to_apply({"budget.json": '{"generation": 7, "budgets": "junk"}'}, doc)
    assert written is not None and written.generation == 8


def test_generation_in_effect_is_the_higher_of_status_and_configmap() -> None:
    data = BudgetDocument(generation=9, budgets=MINE).to_configmap_data()
    assert bd.generation_in_effect(_status(budgetGeneration=4), data) == 9
    assert bd.generation_in_effect(_status(budgetGeneration=12), data) == 12
    assert bd.generation_in_effect(_status(), None) == 0


def test_first_reconcile_writes_the_spec_budgets_at_generation_1() -> None:
    doc = bd.for_spec(SPEC, _status(), None, NOW, policy="threshold")
    assert (doc.generation, doc.budgets, doc.overload_mode, doc.reason) == (1, INITIAL, "Off", "initial budgets from spec")
    assert doc.overload_max_context_tokens == 512  # half of tiny's 1024-token context
    assert doc.updated_at == NOW


def test_reconcile_keeps_the_budgets_in_effect() -> None:
    status = _status(budgets=HAND.model_dump(by_alias=True), initialBudgets=INITIAL.model_dump(by_alias=True),
                     budgetGeneration=6, overloadMode="On")
    doc = bd.for_spec(SPEC, status, None, NOW, policy="threshold")
    assert (doc.generation, doc.budgets, doc.overload_mode, doc.reason) == (6, HAND, "On", "in effect")


def test_a_spec_batching_change_resets_the_budgets_with_the_next_generation() -> None:
    status = _status(budgets=HAND.model_dump(by_alias=True),
                     initialBudgets=INITIAL.model_copy(update={"max_decode_tokens": 32}).model_dump(by_alias=True),
                     budgetGeneration=6)
    data = BudgetDocument(generation=8, budgets=HAND).to_configmap_data()
    doc = bd.for_spec(SPEC, status, data, NOW, policy="threshold")
    assert (doc.generation, doc.budgets, doc.reason) == (9, INITIAL, "spec.batching changed")


def test_a_forced_overload_mode_takes_the_next_generation() -> None:
    forced = SPEC.model_copy(update={"overload": SPEC.overload.model_copy(update={"mode": "On"})})
    status = _status(budgets=HAND.model_dump(by_alias=True), initialBudgets=INITIAL.model_dump(by_alias=True),
                     budgetGeneration=6, overloadMode="Off")
    doc = bd.for_spec(forced, status, None, NOW, policy="threshold")
    assert (doc.generation, doc.budgets, doc.overload_mode, doc.reason) == (7, HAND, "On", "overload.mode On")


def test_a_new_overload_context_cap_takes_the_next_generation_and_reaches_the_configmap() -> None:
    """A review found that changing only spec.overload.maxContextTokens never reached the workers."""
    status = _status(budgets=HAND.model_dump(by_alias=True), initialBudgets=INITIAL.model_dump(by_alias=True),
                     budgetGeneration=2, overloadMode="On")
    forced = {"mode": "On", "maxContextTokens": 400}
    spec = SPEC.model_copy(update={"overload": SPEC.overload.model_validate(forced)})
    data = BudgetDocument(generation=2, budgets=HAND, overload_mode="On", overload_max_context_tokens=300,
                          ).to_configmap_data()
    doc = bd.for_spec(spec, status, data, NOW, policy="threshold")
    assert (doc.generation, doc.budgets, doc.overload_max_context_tokens) == (3, HAND, 400)
    assert doc.reason == "overload context cap 300 -> 400"
    assert bd.to_apply(data, doc) == doc
    # the same cap already there: nothing to write, no new generation
    same = BudgetDocument(generation=2, budgets=HAND, overload_mode="On", overload_max_context_tokens=400)
    again = bd.for_spec(spec, status, same.to_configmap_data(), NOW, policy="threshold")
    assert again.generation == 2 and bd.to_apply(same.to_configmap_data(), again) is None
    # a hand edit of the cap at the same generation is superseded
    edited = same.model_copy(update={"overload_max_context_tokens": 999}).to_configmap_data()
    assert bd.to_apply(edited, again) == again.model_copy(update={"generation": 3})


def test_overload_context_cap() -> None:
    assert bd.overload_context_cap(SPEC) == 512
    capped = MoEInferenceServiceSpec.model_validate({"overload": {"maxContextTokens": 300}})
    assert bd.overload_context_cap(capped) == 300
    longer = MoEInferenceServiceSpec.model_validate({"model": {"overrides": {"maxSeqLen": 4096}}})
    assert bd.overload_context_cap(longer) == 2048


def test_reason_is_cut_to_1024_characters() -> None:
    doc = bd.for_budgets(SPEC, MINE, "Off", 2, "x" * 5000, NOW, policy="threshold")
    assert len(doc.reason) == 1024


def test_a_decision_that_moves_nothing_writes_nothing() -> None:
    status = _status(budgets=MINE.model_dump(by_alias=True), budgetGeneration=6)
    hold = Decision(state=PolicyState(MINE), direction="hold", reasons=())
    assert bd.for_decision(SPEC, status, None, hold, NOW, policy="threshold") is None
    down = Decision(state=PolicyState(HAND), direction="down", reasons=("expert skew", "2048 -> 700"))
    data = BudgetDocument(generation=9, budgets=MINE).to_configmap_data()
    doc = bd.for_decision(SPEC, status, data, down, NOW, policy="threshold")
    assert doc is not None and (doc.generation, doc.budgets, doc.reason) == (10, HAND, "expert skew; 2048 -> 700")
    overload = Decision(state=PolicyState(MINE, overload="On"), direction="hold", reasons=("x",), overload_changed=True)
    doc = bd.for_decision(SPEC, status, None, overload, NOW, policy="threshold")
    assert doc is not None and (doc.generation, doc.overload_mode) == (7, "On")


def test_the_document_in_effect_rewrites_a_deleted_configmap_at_the_same_generation() -> None:
    status = _status(budgets=HAND.model_dump(by_alias=True), budgetGeneration=6, overloadMode="On")
    doc = bd.in_effect(SPEC, status, "recreated", NOW, policy="threshold")
    assert doc is not None and (doc.generation, doc.budgets, doc.overload_mode) == (6, HAND, "On")
    assert bd.in_effect(SPEC, _status(), "recreated", NOW, policy="threshold") is None


def test_the_predictive_policy_takes_the_queue_out_of_the_workers_overload_trigger() -> None:
    """Issue 30: the predictive policy decides overload from SLO attainment, so its documents tell the
    workers not to self-trigger on queue depth; a switch of ``--policy`` reaches a ConfigMap already there."""
    status = _status(budgets=HAND.model_dump(by_alias=True), initialBudgets=INITIAL.model_dump(by_alias=True),
                     budgetGeneration=4, overloadMode="Off")
    threshold = bd.for_spec(SPEC, status, None, NOW, policy="threshold")
    assert (threshold.generation, threshold.overload_queue_trigger) == (4, True)
    data = threshold.to_configmap_data()
    predictive = bd.for_spec(SPEC, status, data, NOW, policy="predictive")
    assert (predictive.generation, predictive.budgets, predictive.overload_queue_trigger) == (5, HAND, False)
    assert predictive.reason == "overload queue trigger for policy predictive"
    assert bd.to_apply(data, predictive) == predictive
    assert bd.to_apply(predictive.to_configmap_data(), bd.for_spec(
        SPEC, status, predictive.to_configmap_data(), NOW, policy="predictive")) is None
    decision = Decision(state=PolicyState(MINE), direction="down", reasons=("x",))
    down = bd.for_decision(SPEC, status, data, decision, NOW, policy="predictive")
    assert down is not None and not down.overload_queue_trigger
    recreated = bd.in_effect(SPEC, status, "recreated", NOW, policy="predictive")
    assert recreated is not None and not recreated.overload_queue_trigger
    assert BudgetDocument(generation=1, budgets=MINE).overload_queue_trigger  # an older document: the queue counts
