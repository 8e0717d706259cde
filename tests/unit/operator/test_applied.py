"""The BudgetsApplied condition (:mod:`moeguard_operator.loop.applied`): whether the workers run the budget
document in the ConfigMap, from their ``moeguard_budget_generation``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from moeguard_core.contract import DEFAULT_BUDGETS, BudgetDocument
from moeguard_operator.loop.applied import applied, grace_seconds, verdict
from moeguard_operator.loop.conditions import find_condition
from moeguard_operator.spec.models import MoEInferenceServiceStatus

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
GRACE = grace_seconds(30, 10)


def doc(generation: int = 5, age_s: float = 600) -> BudgetDocument:
    return BudgetDocument(generation=generation, budgets=DEFAULT_BUDGETS, updated_at=NOW - timedelta(seconds=age_s))


def test_every_worker_at_or_past_the_document_is_applied() -> None:
    v = verdict(doc(5), (("w-0", 5.0), ("w-1", 6.0)), None, NOW, GRACE)
    assert (v.status, v.reason, v.event) == ("True", "Applied", None)
    assert v.message == "every reporting worker (2) runs budget generation 5"


def test_a_worker_behind_past_the_grace_is_named_false() -> None:
    v = verdict(doc(5, age_s=GRACE + 1), (("w-0", 5.0), ("w-1", 4.0), ("w-2", -1.0)), None, NOW, GRACE)
    assert (v.status, v.reason, v.event) == ("False", "WorkersBehind", ("Warning", "BudgetNotApplied"))
    assert v.message.startswith("w-1 (generation 4), w-2 (generation -1) still run(s) older budgets than "
                                "generation 5, written at 2026-12-07T11:59:19+00:00 (more than 40s ago)")
    assert "event=budget_rejected" in v.message


def test_within_the_grace_a_worker_behind_is_propagating_not_false() -> None:
    v = verdict(doc(5, age_s=GRACE - 1), (("w-0", 4.0),), None, NOW, GRACE)
    assert (v.status, v.reason, v.event) == ("Unknown", "Propagating", None)
    assert v.message == "budget generation 5 written at 2026-12-07T11:59:21+00:00; not yet run by w-0 (generation 4)"


def test_the_grace_is_the_window_plus_a_look() -> None:
    assert grace_seconds(30, 10) == 40.0 and grace_seconds(10, 2) == 12.0


def test_no_document_or_no_reports_is_unknown() -> None:
    assert verdict(None, (("w-0", 1.0),), None, NOW, GRACE).reason == "NoDocument"
    v = verdict(doc(), (), None, NOW, GRACE)
    assert (v.status, v.reason) == ("Unknown", "NoReports") and "moeguard_budget_generation" in v.message


def test_the_warning_event_comes_once_when_the_condition_turns_false() -> None:
    behind = (("w-0", 4.0),)
    status, events = applied(MoEInferenceServiceStatus(), doc(5), (("w-0", 5.0),), NOW, 3, GRACE)
    cond = find_condition(status.conditions, "BudgetsApplied")
    assert cond is not None and (cond.status, cond.reason, cond.observed_generation) == ("True", "Applied", 3)
    assert events == []
    status, events = applied(status, doc(6), behind, NOW, 3, GRACE)
    assert [(e.type, e.reason) for e in events] == [("Warning", "BudgetNotApplied")]
    assert "w-0 (generation 4)" in events[0].message
    status, events = applied(status, doc(6), behind, NOW + timedelta(seconds=10), 3, GRACE)
    assert events == [] and find_condition(status.conditions, "BudgetsApplied").status == "False"  # type: ignore[union-attr]
    status, events = applied(status, doc(6), (("w-0", 6.0),), NOW + timedelta(seconds=20), 3, GRACE)
    assert events == [] and find_condition(status.conditions, "BudgetsApplied").reason == "Applied"  # type: ignore[union-attr]
