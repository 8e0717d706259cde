"""The generation the operator writes to the budget ConfigMap (kube.apply captured at the I/O edge)."""

from __future__ import annotations

from typing import Any

import pytest

from moeguard_operator import handlers
from moeguard_operator.builders import Owner
from moeguard_runtime.contract import BudgetDocument, Budgets, parse_budget_configmap_data

pytestmark = pytest.mark.unit

OWNER = Owner(name="svc", namespace="ns", uid="u")
MINE = Budgets(max_prefill_tokens=2048, max_decode_tokens=64, max_batch_requests=16, max_concurrent_batches=2)
HAND = MINE.model_copy(update={"max_prefill_tokens": 700})


@pytest.fixture
def applied(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    monkeypatch.setattr(handlers.kube, "apply", lambda m: out.append(m) or m)
    return out


def test_same_document_is_not_applied_again(applied: list[dict[str, Any]]) -> None:
    doc = BudgetDocument(generation=3, budgets=MINE)
    assert handlers._ensure_budget_configmap(OWNER, doc.to_configmap_data(), doc) == 3
    assert applied == []


def test_a_hand_edit_at_the_same_generation_is_superseded(applied: list[dict[str, Any]]) -> None:
    hand = BudgetDocument(generation=50, budgets=HAND).to_configmap_data()
    mine = BudgetDocument(generation=50, budgets=MINE)
    assert handlers._ensure_budget_configmap(OWNER, hand, mine) == 51
    written = parse_budget_configmap_data(applied[0]["data"])
    assert (written.generation, written.budgets) == (51, MINE)


def test_missing_or_unreadable_configmap(applied: list[dict[str, Any]]) -> None:
    assert handlers._generation_in(None) == 0
    assert handlers._generation_in({"budget.json": '{"generation": 7, "budgets": "junk"}'}) == 7
    assert handlers._generation_in({"budget.json": "not json"}) == 0
    assert handlers._ensure_budget_configmap(OWNER, None, BudgetDocument(generation=1, budgets=MINE)) == 1
    assert len(applied) == 1
