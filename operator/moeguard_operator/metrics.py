"""The operator's own Prometheus metrics (served with ``--metrics-port``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

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
OOM_KILLS = Counter("moeguard_operator_oom_kills_total", "OOMKilled worker containers seen.", LABELS)
BUDGET_AT_FLOOR = Gauge(
    "moeguard_operator_budget_at_floor", "1 while a budget sits at its floor (the loop can tighten no further).",
    [*LABELS, "budget"])
