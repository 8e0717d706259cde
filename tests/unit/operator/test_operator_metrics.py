"""The operator's own series live as long as their service (issue 29, item 2; the kind of kedacore/keda#6617),
and ``replicas: 0`` exports no ``metrics_available`` (item 3): read from the real registry's exposition text."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from prometheus_client import REGISTRY, Counter, Gauge, generate_latest

from moeguard_operator.loop import metrics
from moeguard_operator.loop.observation import Observation
from moeguard_operator.loop.policy import Decision, PolicyState, floors, initial_budgets
from moeguard_operator.spec.models import MoEInferenceServiceSpec

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
SPEC = MoEInferenceServiceSpec()


def series(namespace: str, name: str) -> list[str]:
    """The exposition lines of the service's series (without the counters' ``_created`` times)."""
    text = generate_latest(REGISTRY).decode()
    return [line for line in text.splitlines() if not line.startswith("#") and "_created{" not in line
            and f'namespace="{namespace}"' in line and f'moeis="{name}"' in line]


def blind_look(namespace: str, name: str) -> None:
    """A blind look with every budget at its floor and an OOM kill: every kind of series the loop writes."""
    state = PolicyState(budgets=floors(SPEC.batching), overload="On")
    obs = Observation(time=NOW, error="Prometheus at http://p:9090: PrometheusTimeout", new_oom_kills=1)
    metrics.record_look(namespace, name, obs, Decision(state=state, direction="down", reasons=("x",)),
                        floors(SPEC.batching))
    metrics.RECONCILIATIONS.labels(namespace, name, "applied").inc()
    metrics.CHILD_APPLY_REFUSALS.labels(namespace, name, "retry").inc()
    metrics.DIAGNOSIS_FINDING.labels(namespace, name, "BurstOverlap").set(1)


def test_forget_service_removes_every_series_of_the_service_and_only_its() -> None:
    blind_look("ns-del", "gone")
    blind_look("ns-del", "kept")
    before = series("ns-del", "gone")
    assert 'moeguard_operator_metrics_available{moeis="gone",namespace="ns-del"} 0.0' in before
    assert sum("moeguard_operator_budget_at_floor{" in line and line.endswith(" 1.0") for line in before) == 7
    metrics.forget_service("ns-del", "gone")
    assert series("ns-del", "gone") == []
    assert series("ns-del", "kept") == [line.replace('moeis="gone"', 'moeis="kept"') for line in before]


def test_every_metric_of_the_operator_is_forgotten_with_its_service() -> None:
    """A new metric must join SERVICE_METRICS: every collector of the module is in it."""
    collectors = {v for v in vars(metrics).values() if isinstance(v, (Counter, Gauge))}
    assert collectors == set(metrics.SERVICE_METRICS)


def test_scaled_to_zero_exports_no_metrics_available() -> None:
    blind_look("ns-zero", "idle")
    assert REGISTRY.get_sample_value("moeguard_operator_metrics_available",
                                     {"namespace": "ns-zero", "moeis": "idle"}) == 0
    metrics.record_scaled_to_zero("ns-zero", "idle")
    assert REGISTRY.get_sample_value("moeguard_operator_metrics_available",
                                     {"namespace": "ns-zero", "moeis": "idle"}) is None
    state = PolicyState(budgets=initial_budgets(SPEC.batching), overload="Off")
    metrics.record_look("ns-zero", "idle", Observation(time=NOW, error="blind"),
                        Decision(state=state, direction="hold", reasons=()), floors(SPEC.batching),
                        scaled_to_zero=True)
    assert REGISTRY.get_sample_value("moeguard_operator_metrics_available",
                                     {"namespace": "ns-zero", "moeis": "idle"}) is None
