"""The budget document the operator writes to the budget ConfigMap, pure: which document, which generation.

* :func:`for_spec` — the document a reconcile writes: the budgets in effect, unless the spec's
  initial budgets changed (then those), the overload mode the spec forces, and whether the workers' own
  overload trigger reads the queue (:func:`queue_trigger`: not where the policy decides from SLO attainment);
* :func:`for_decision` — the document a control-loop decision asks for (None when budgets and
  overload mode stay), at the next generation;
* :func:`in_effect` — the document of the budgets in effect, for a ConfigMap deleted by hand;
* :func:`to_apply` — the one rule for writing it: nothing when the ConfigMap already holds it,
  else the document with a generation newer than anything found there;
* :func:`caught_up` — the status with the budgets of a ConfigMap that is ahead of it.

A worker ignores a generation that is not newer than the one it applied, so every document the
operator writes carries a generation above both ``status.budgetGeneration`` and the ConfigMap's.

**The ConfigMap is where a decision becomes durable.** The operator writes it first, then
``status``: a process killed between the two leaves a ConfigMap ahead of ``status``. So the budgets
in effect are the ConfigMap's whenever its generation is at least ``status.budgetGeneration``
(:func:`caught_up`), and a reconcile (create, update, resume) never writes back the older budgets of
a lagging status (issue 18, fault 6).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

from moeguard_core import contract
from moeguard_core.contract import (
    BUDGET_KEY,
    BudgetDocument,
    BudgetDocumentError,
    Budgets,
    parse_budget_configmap_data,
)
from moeguard_core.presets import get_preset
from moeguard_operator.loop.policy import Decision, initial_budgets
from moeguard_operator.spec.models import MoEInferenceServiceSpec, MoEInferenceServiceStatus

OverloadMode = Literal["On", "Off"]
REASON_MAX_CHARS = 1024
"""Longest ``reason`` written into a document, characters."""


def overload_context_cap(spec: MoEInferenceServiceSpec) -> int:
    """Prompt + max_tokens refused while overload is on, tokens (:func:`contract.overload_context_cap`
    of ``spec.overload.maxContextTokens`` and the model's context).

    Raises:
        KeyError: the spec names an unknown preset (:func:`~moeguard_operator.spec.spec_checks.parse_spec` reports it first).
    """
    max_seq = spec.model.overrides.max_seq_len or get_preset(spec.model.preset).max_seq_len
    return contract.overload_context_cap(spec.overload.max_context_tokens, max_seq)


def generation_in(data: dict[str, str] | None) -> int:
    """The generation in a budget ConfigMap's ``data`` (0 when missing or unreadable).

    A hand-edited document that does not parse still counts with its ``generation``: the
    operator's next one must be newer, or the workers would ignore it.
    """
    if data is None:
        return 0
    try:
        return parse_budget_configmap_data(data).generation
    except BudgetDocumentError:
        try:
            raw = json.loads(data.get(BUDGET_KEY, "{}"))
            return int(raw.get("generation", 0)) if isinstance(raw, dict) else 0
        except (TypeError, ValueError):
            return 0


def generation_in_effect(status: MoEInferenceServiceStatus, data: dict[str, str] | None) -> int:
    """The highest generation written so far: ``status.budgetGeneration`` or the ConfigMap's."""
    return max(status.budget_generation or 0, generation_in(data))


def overload_in_effect(status: MoEInferenceServiceStatus) -> OverloadMode:
    """The overload mode in ``status`` (Off when none was recorded yet)."""
    return "On" if status.overload_mode == "On" else "Off"


def written_by(managed_fields: list[dict[str, Any]] | None, manager: str) -> bool:
    """Whether field manager ``manager`` owns the budget document (``data.budget.json``) of a ConfigMap, from its
    ``metadata.managedFields``: False after a hand edit (``kubectl edit``/``patch`` take the field over)."""
    for entry in managed_fields or []:
        fields = (entry.get("fieldsV1") or {}).get("f:data") or {}
        if f"f:{BUDGET_KEY}" in fields:
            return bool(entry.get("manager") == manager)
    return False


def caught_up(status: MoEInferenceServiceStatus, data: dict[str, str] | None, ours: bool = True
              ) -> MoEInferenceServiceStatus:
    """``status`` with the budgets, overload mode and generation of the budget ConfigMap's valid document in
    ``data`` when that document is the operator's own (``ours``: :func:`written_by`) and ahead of (or at)
    ``status.budgetGeneration``; ``status`` unchanged otherwise (no ConfigMap, an invalid document, one behind
    status, a document edited by hand, or no budgets recorded yet: the first reconcile).

    A hand-edited document never pins the budgets: its generation is respected (the next document is newer,
    :func:`to_apply`), its budgets are not adopted.
    """
    current = _parsed(data)
    if (not ours or status.budgets is None or current is None
            or current.generation < (status.budget_generation or 0)):
        return status
    update: dict[str, object] = {"budgets": current.budgets, "budget_generation": current.generation,
                                 "overload_mode": current.overload_mode}
    if all(getattr(status, k) == v for k, v in update.items()):
        return status
    return status.model_copy(update=update)


def queue_trigger(policy: str) -> bool:
    """The document's ``overloadQueueTrigger`` under the operator's ``--policy``: False for ``predictive``,
    which decides overload mode from SLO attainment (issue 30), so the workers' own trigger keeps only memory
    and allocation failures; True for ``threshold``, whose overload follows the refusal rate as the queue does."""
    return policy != "predictive"


def for_budgets(spec: MoEInferenceServiceSpec, budgets: Budgets, overload: OverloadMode, generation: int,
                reason: str, now: datetime, *, policy: str) -> BudgetDocument:
    """The document for ``budgets`` and ``overload`` at ``generation`` (``reason`` cut to 1024 characters),
    with the queue trigger of ``policy`` (:func:`queue_trigger`)."""
    return BudgetDocument(generation=generation, budgets=budgets, overload_mode=overload,
                          overload_max_context_tokens=overload_context_cap(spec),
                          overload_queue_trigger=queue_trigger(policy),
                          reason=reason[:REASON_MAX_CHARS], updated_at=now)


def for_spec(spec: MoEInferenceServiceSpec, status: MoEInferenceServiceStatus, data: dict[str, str] | None,
             now: datetime, ours: bool = True, *, policy: str) -> BudgetDocument:
    """The document a reconcile of ``spec`` writes, given the prior ``status`` and the ConfigMap's ``data``.

    The budgets in effect stay unless the spec's initial budgets changed (or none are in effect
    yet), the budgets in effect being the ConfigMap's when it is ahead of ``status`` and ``ours`` (the
    operator wrote it: :func:`caught_up`);
    a forced ``overload.mode`` applies at once; a new overload context cap
    (``overload.maxContextTokens``, or the model's context it defaults from) too. Each change takes
    the next generation (the workers ignore a generation they have applied).
    """
    status = caught_up(status, data, ours)
    initial = initial_budgets(spec.batching)
    generation = generation_in_effect(status, data)
    overload = overload_in_effect(status) if spec.overload.mode == "Auto" else spec.overload.mode
    budgets, reason = status.budgets, "in effect"
    current = _parsed(data)
    if budgets is None or status.initial_budgets != initial:
        reason = "initial budgets from spec" if budgets is None else "spec.batching changed"
        budgets, generation = initial, generation + 1
    elif overload != status.overload_mode:
        reason, generation = f"overload.mode {spec.overload.mode}", generation + 1
    elif current is not None and current.overload_max_context_tokens != overload_context_cap(spec):
        reason, generation = (f"overload context cap {current.overload_max_context_tokens} -> "
                              f"{overload_context_cap(spec)}"), generation + 1
    elif current is not None and current.overload_queue_trigger != queue_trigger(policy):
        reason, generation = f"overload queue trigger for policy {policy}", generation + 1
    return for_budgets(spec, budgets, overload, generation, reason, now, policy=policy)


def _key(document: BudgetDocument) -> tuple[object, ...]:
    """What a worker applies from a document: equal keys, nothing to write."""
    return (document.generation, document.budgets, document.overload_mode, document.overload_max_context_tokens,
            document.overload_queue_trigger)


def _parsed(data: dict[str, str] | None) -> BudgetDocument | None:
    """The valid document in ``data``, or None (no ConfigMap, or an invalid one)."""
    if data is None:
        return None
    try:
        return parse_budget_configmap_data(data)
    except BudgetDocumentError:
        return None


def for_decision(spec: MoEInferenceServiceSpec, status: MoEInferenceServiceStatus, data: dict[str, str] | None,
                 decision: Decision, now: datetime, *, policy: str) -> BudgetDocument | None:
    """The document for ``decision``'s budgets and overload mode at the next generation, or None
    when neither changed (nothing to write)."""
    if not (decision.changed or decision.overload_changed):
        return None
    return for_budgets(spec, decision.state.budgets, decision.state.overload,
                       generation_in_effect(status, data) + 1, decision.reason, now, policy=policy)


def in_effect(spec: MoEInferenceServiceSpec, status: MoEInferenceServiceStatus, reason: str,
              now: datetime, *, policy: str) -> BudgetDocument | None:
    """The document of the budgets, overload mode and generation in ``status`` (None before the
    first reconcile recorded any): what a ConfigMap deleted by hand is written back with."""
    if status.budgets is None:
        return None
    return for_budgets(spec, status.budgets, overload_in_effect(status), generation_in_effect(status, None),
                       reason, now, policy=policy)


def to_apply(data: dict[str, str] | None, document: BudgetDocument) -> BudgetDocument | None:
    """What to write to the ConfigMap whose current ``data`` is given (None: it does not exist).

    None when ``data`` already holds this generation, budgets, overload mode, context cap and queue trigger.
    Otherwise ``document``, with the generation after the one found when that is not older (a
    ConfigMap edited by hand at this generation or beyond: the workers ignore a generation they
    have seen).
    """
    current = _parsed(data)
    if current is not None and _key(current) == _key(document):
        return None
    found = generation_in(data)
    if data is not None and document.generation <= found:
        return document.model_copy(update={"generation": found + 1})
    return document
