"""Whether the workers run the budget document in the ConfigMap: the ``BudgetsApplied`` condition. Pure.

A worker applies a new document well under a second after the write (its watch,
``moeguard_runtime.engine.budget_watch``) unless it refuses it (an invalid document: ``event=budget_rejected``
in its log, ``moeguard_budget_updates_total{result="rejected"}``) or cannot read the ConfigMap (RBAC, the API
server). It exports the generation it runs as ``moeguard_budget_generation`` (-1: none yet, the environment's
budgets). A document that the workers do not run is a decision lost: status says "tightened" while every worker
serves the old budgets. That happened at stop 45: an OOM kill's cut carried a long-request cap above the batch,
every worker refused it, and the survivors of the kill kept their old budgets
(``bench/results/control_latency_predictive.md``, OOM row).

Per look (:func:`verdict`), on the reporting pods' generations (:attr:`Observation.budget_generations`):

* ``True``, ``Applied``: every pod that reports one runs the ConfigMap's generation or a newer one;
* ``Unknown``, ``Propagating``: some run an older one, and the document is younger than the grace
  (:func:`grace_seconds`: a scrape and a look have not shown it yet);
* ``False``, ``WorkersBehind``: some still run an older one past the grace; a Warning Event
  ``BudgetNotApplied`` names them (:func:`applied`, once per transition);
* ``Unknown``, ``NoDocument`` / ``NoReports``: no valid document in the ConfigMap, or no pod reports its
  generation (workers older than the metric, or Prometheus has none yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from moeguard_core.contract import METRIC_BUDGET_GENERATION, BudgetDocument
from moeguard_operator import constants as c
from moeguard_operator.loop.conditions import Verdict, find_condition, set_condition
from moeguard_operator.loop.report import Event
from moeguard_operator.spec.models import Condition, MoEInferenceServiceStatus

NOT_APPLIED_EVENT = ("Warning", "BudgetNotApplied")
"""The Event posted when the condition turns False (``Verdict.event``)."""


def grace_seconds(window_seconds: float, query_interval_seconds: float) -> float:
    """How long after a write a worker may still show an older generation, seconds: ``windowSeconds +
    queryIntervalSeconds`` (40 s at the defaults). Its watch applies a document in under a second; Prometheus
    shows that at its next scrape (a window holds several scrapes: the look needs them); the operator reads it at
    its next look."""
    return float(window_seconds + query_interval_seconds)


def verdict(document: BudgetDocument | None, generations: Sequence[tuple[str, float]], prior: Condition | None,
            now: datetime, grace: float) -> Verdict:
    """The ``BudgetsApplied`` condition for the ConfigMap's ``document`` (None: none, or not a valid one) and the
    reporting pods' ``generations`` at ``now``, ``grace`` seconds after a write (see the module docstring), with
    :data:`NOT_APPLIED_EVENT` when it turns False (``prior``: the condition as it was; not at every look it stays
    False)."""
    if document is None:
        return Verdict("Unknown", "NoDocument", "the budget ConfigMap holds no valid budget document")
    if not generations:
        return Verdict("Unknown", "NoReports", f"no worker reports {METRIC_BUDGET_GENERATION}")
    gen = document.generation
    behind = [(pod, int(g)) for pod, g in generations if g < gen]
    if not behind:
        return Verdict("True", "Applied", f"every reporting worker ({len(generations)}) runs budget generation {gen}")
    pods = ", ".join(f"{pod} (generation {g})" for pod, g in behind)
    written = document.updated_at.isoformat(timespec="seconds")
    if (now - document.updated_at).total_seconds() < grace:
        return Verdict("Unknown", "Propagating", f"budget generation {gen} written at {written}; not yet run by {pods}")
    return Verdict("False", "WorkersBehind",
                   f"{pods} still run(s) older budgets than generation {gen}, written at {written} (more than "
                   f"{grace:g}s ago): the worker refused the document (its log: event=budget_rejected) or "
                   f"cannot read the budget ConfigMap",
                   NOT_APPLIED_EVENT if prior is None or prior.status != "False" else None)


def applied(status: MoEInferenceServiceStatus, document: BudgetDocument | None, generations: Sequence[tuple[str, float]],
            now: datetime, generation: int | None, grace: float) -> tuple[MoEInferenceServiceStatus, list[Event]]:
    """``status`` with the ``BudgetsApplied`` condition of :func:`verdict`, and its Event."""
    v = verdict(document, generations, find_condition(status.conditions, c.CONDITION_BUDGETS_APPLIED), now, grace)
    conditions = set_condition(status.conditions, c.CONDITION_BUDGETS_APPLIED, v.status, v.reason, v.message, now,
                               generation)
    events = [] if v.event is None else [Event("Warning" if v.event[0] == "Warning" else "Normal", v.event[1], v.message)]
    return status.model_copy(update={"conditions": conditions}), events
