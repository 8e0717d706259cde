"""The operator's own Prometheus metrics (served with ``--metrics-port``).

Every series is labelled by its service (``namespace``, ``moeis``); none is per pod. They live as long as the
service: :func:`forget_service` removes all of them when the watch reports the service deleted (issue 29, item 2,
the kind of kedacore/keda#6617: a deleted service's ``metrics_available 0`` and ``budget_at_floor 1`` series kept
the chart's alerts firing until the operator restarted).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge
from pydantic.alias_generators import to_camel

from moeguard_core.contract import Budgets
from moeguard_operator.diagnosis.diagnosis import Diagnosis
from moeguard_operator.loop.observation import Observation
from moeguard_operator.loop.policy import Decision
from moeguard_operator.spec.models import BUDGET_FIELDS

LABELS = ("namespace", "moeis")

RECONCILIATIONS = Counter(
    "moeguard_operator_reconciliations_total", "Reconciliations of a MoEInferenceService, by result.", [*LABELS, "result"])
BUDGET_CHANGES = Counter(
    "moeguard_operator_budget_changes_total", "Budget changes made by the control loop, by direction.", [*LABELS, "direction"])
PROMETHEUS_QUERIES = Counter(
    "moeguard_operator_prometheus_looks_total", "Looks at Prometheus, by result (ok, blind).", [*LABELS, "result"])
METRICS_AVAILABLE = Gauge(
    "moeguard_operator_metrics_available", "1 when every signal of the service is visible, else 0.", LABELS)
PREFILL_BUDGET = Gauge(
    "moeguard_operator_budget_max_prefill_tokens", "maxPrefillTokens in effect, tokens.", LABELS)
OVERLOAD = Gauge("moeguard_operator_overload", "1 while overload mode is on.", LABELS)
CHILD_APPLY_REFUSALS = Counter(
    "moeguard_operator_child_apply_refusals_total",
    "Children the API server refused at apply, by what the operator did (retry, stall).", [*LABELS, "action"])
OOM_KILLS = Counter("moeguard_operator_oom_kills_total", "OOMKilled worker containers seen.", LABELS)
DIAGNOSIS_FINDING = Gauge(
    "moeguard_operator_diagnosis_finding",
    "1 while the diagnosis holds a finding of this kind for the service, 0 once it cleared.", [*LABELS, "kind"])
BUDGET_AT_FLOOR = Gauge(
    "moeguard_operator_budget_at_floor", "1 while a budget sits at its floor (the loop can tighten no further).",
    [*LABELS, "budget"])


SERVICE_METRICS = (RECONCILIATIONS, BUDGET_CHANGES, PROMETHEUS_QUERIES, METRICS_AVAILABLE, PREFILL_BUDGET, OVERLOAD,
                   CHILD_APPLY_REFUSALS, OOM_KILLS, DIAGNOSIS_FINDING, BUDGET_AT_FLOOR)
"""Every metric above: each has the labels ``namespace`` and ``moeis`` (:func:`forget_service`)."""


def forget_service(namespace: str, name: str) -> None:
    """Remove every series of the service ``namespace``/``name`` from every metric (its counters, gauges and
    per-kind, per-budget series): a deleted service exports nothing, so no alert on it fires after it is gone."""
    for metric in SERVICE_METRICS:
        metric.remove_by_labels({"namespace": namespace, "moeis": name})


def record_scaled_to_zero(namespace: str, name: str) -> None:
    """``replicas: 0``: no ``metrics_available`` series (neither 1, every signal seen, nor 0, blind: there are no
    pods to see, and the chart's ``MoeguardMetricsUnavailable`` alert must stay calm); issue 29, item 3."""
    METRICS_AVAILABLE.remove_by_labels({"namespace": namespace, "moeis": name})


def record_look(namespace: str, name: str, obs: Observation, decision: Decision, floors: Budgets,
                scaled_to_zero: bool = False) -> None:
    """The operator's metrics after one look at Prometheus and its decision (``floors``: the spec's;
    ``scaled_to_zero``: the spec asks for no replicas, :func:`record_scaled_to_zero`)."""
    budgets = decision.state.budgets
    PROMETHEUS_QUERIES.labels(namespace, name, "ok" if obs.fully_visible else "blind").inc()
    if scaled_to_zero:
        record_scaled_to_zero(namespace, name)
    else:
        METRICS_AVAILABLE.labels(namespace, name).set(1 if obs.fully_visible else 0)
    if obs.new_oom_kills:
        OOM_KILLS.labels(namespace, name).inc(obs.new_oom_kills)
    if decision.changed:
        BUDGET_CHANGES.labels(namespace, name, decision.direction).inc()
    PREFILL_BUDGET.labels(namespace, name).set(budgets.max_prefill_tokens)
    for field in BUDGET_FIELDS:
        at_floor = getattr(budgets, field) <= getattr(floors, field)
        BUDGET_AT_FLOOR.labels(namespace, name, to_camel(field)).set(1 if at_floor else 0)
    OVERLOAD.labels(namespace, name).set(1 if decision.state.overload == "On" else 0)


def record_diagnosis(namespace: str, name: str, found: Diagnosis) -> None:
    """``moeguard_operator_diagnosis_finding``: 1 for each active finding's kind, 0 for each kind cleared now (a
    kind never found has no series)."""
    for finding in found.status.findings:
        DIAGNOSIS_FINDING.labels(namespace, name, finding.kind).set(1)
    for kind in found.cleared:
        DIAGNOSIS_FINDING.labels(namespace, name, kind).set(0)
