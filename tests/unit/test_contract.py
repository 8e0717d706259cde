"""The operator-worker contract holds on both sides.

Fails when a budget is missing on either side, when a default differs between the
operator's spec and a worker started by hand, when the operator's Deployment env and its
first budget document do not reproduce the spec's values in the worker, when a budget
is in the Deployment env (budget changes must never roll the pods), or when the operator queries a
metric that the worker does not export.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moeguard_core import contract
from moeguard_core.presets import get_preset
from moeguard_operator.children.builders import Owner, build_budget_configmap, worker_env
from moeguard_operator.loop import budget_document
from moeguard_operator.loop.observe import queries
from moeguard_operator.loop.policy import floors, initial_budgets
from moeguard_operator.spec.models import (
    BatchingSpec,
    BudgetCeilings,
    BudgetFloors,
    MoEInferenceServiceSpec,
    MoEInferenceServiceStatus,
)
from moeguard_runtime.config import load_settings
from moeguard_runtime.engine.budget_watch import NO_GENERATION, decide_update
from moeguard_runtime.parallel.ep_telemetry import EpMetrics
from moeguard_runtime.telemetry.telemetry import Telemetry

pytestmark = pytest.mark.unit


def test_the_budget_table_and_the_budgets_model_list_the_same_fields_in_order() -> None:
    assert tuple(contract.Budgets.model_fields) == contract.BUDGET_NAMES
    assert len(contract.BUDGET_NAMES) == 7
    assert [f.alias for f in contract.BUDGET_FIELDS][:2] == ["maxPrefillTokens", "maxDecodeTokens"]
    assert len({f.env for f in contract.BUDGET_FIELDS}) == 7


@pytest.mark.parametrize("model", [BatchingSpec, BudgetFloors, BudgetCeilings])
def test_every_budget_is_in_the_spec_models(model: type) -> None:
    fields = model.model_fields  # type: ignore[attr-defined]
    for name in contract.BUDGET_NAMES:
        assert name in fields, f"{model.__name__} lacks {name}"
        assert fields[name].alias == contract.Budgets.model_fields[name].alias


def test_spec_defaults_are_the_contract_defaults() -> None:
    batching = MoEInferenceServiceSpec().batching
    assert initial_budgets(batching) == contract.DEFAULT_BUDGETS
    assert floors(batching) == contract.DEFAULT_FLOORS
    assert contract.DEFAULT_BUDGETS.max_prefill_tokens == 4096
    assert contract.DEFAULT_FLOORS.max_prefill_tokens == 256
    assert batching.long_request_threshold_tokens == contract.DEFAULT_LONG_REQUEST_THRESHOLD_TOKENS == 2048
    resources = MoEInferenceServiceSpec().resources
    assert (resources.gpu_soft_fraction, resources.gpu_hard_fraction) == (0.85, 0.95)


def test_a_worker_started_by_hand_gets_the_operators_defaults() -> None:
    spec = MoEInferenceServiceSpec()
    s = load_settings({})
    assert s.budgets == initial_budgets(spec.batching)
    assert s.limits.long_request_threshold_tokens == spec.batching.long_request_threshold_tokens
    assert s.limits.max_concurrent_requests == spec.batching.max_concurrent_requests
    assert (s.gpu_soft_fraction, s.gpu_hard_fraction) == (spec.resources.gpu_soft_fraction,
                                                          spec.resources.gpu_hard_fraction)
    assert s.overload_mode == spec.overload.mode


def test_the_deployment_env_and_the_first_budget_document_reproduce_the_spec_in_the_worker() -> None:
    spec = MoEInferenceServiceSpec.model_validate({
        "batching": {"maxPrefillTokens": 1000, "maxDecodeTokens": 77, "maxBatchRequests": 9,
                     "maxLongRequestsPerBatch": 3, "maxConcurrentBatches": 5, "maxQueueRequests": 11,
                     "queueTimeoutSeconds": 2.5, "longRequestThresholdTokens": 300, "maxConcurrentRequests": 40},
        "resources": {"gpuSoftFraction": 0.7, "gpuHardFraction": 0.8},
        "overload": {"mode": "On"},
    })
    owner = Owner("svc", "ns", "uid")
    env = {e["name"]: e["value"] for e in worker_env(owner, spec) if "value" in e}
    # Budgets never roll the pods: none is in the env; they come from the ConfigMap's document.
    assert not {f.env for f in contract.BUDGET_FIELDS} & env.keys()
    s = load_settings(env)
    assert s.budget_configmap == contract.budget_configmap_name("svc")
    assert (s.limits.long_request_threshold_tokens, s.limits.max_concurrent_requests) == (300, 40)
    assert (s.gpu_soft_fraction, s.gpu_hard_fraction, s.overload_mode) == (0.7, 0.8, "On")
    assert env[contract.ENV_KERNEL_CACHE_DIR] == "/tmp/moeguard-kernels"  # the pod's /tmp emptyDir
    assert env[contract.UCX_MEM_MMAP_HOOK_MODE] == contract.UCX_SAFE_MMAP_HOOK_MODE
    assert env[contract.UCX_RCACHE_MAX_UNRELEASED] == str(contract.UCX_SAFE_RCACHE_MAX_UNRELEASED)

    first = budget_document.for_spec(spec, MoEInferenceServiceStatus(), None, datetime(2026, 1, 1, tzinfo=UTC),
                                     policy="predictive")
    data = build_budget_configmap(owner, first)["data"]
    decision = decide_update(data, NO_GENERATION, get_preset(spec.model.preset).max_seq_len)
    assert decision.action == "apply" and decision.document is not None
    assert decision.document.budgets == initial_budgets(spec.batching)
    assert decision.document.budgets.queue_timeout_seconds == 2.5
    assert decision.document.overload_mode == "On"


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
            "summary": ("_sum", "_count", ""), "unknown": ("",)}


def _exported_series() -> set[str]:
    """Series names the worker's registry exposes, from each family's name and type
    (a labelled family has no samples before its first observation, but it is declared)."""
    telemetry = Telemetry({"moeis": "svc", "namespace": "ns", "pod": "p"}, num_experts=4)
    EpMetrics(telemetry.registry, telemetry.labels, rank=0, ranks=2, experts=(0, 2))  # an expert-parallel leader's
    text = generate_latest(telemetry.registry).decode()
    return {family.name + suffix for family in text_string_to_metric_families(text)
            for suffix in SUFFIXES[family.type]}


def test_every_metric_the_operator_queries_is_exported_by_the_worker() -> None:
    q = queries("ns", "svc", 30, 300)
    promql = " ".join(vars(q).values())
    named = set(re.findall(r"moeguard_[a-z0-9_]+", promql))
    # the contract lists exactly the names the queries use (the budget look's and the diagnosis', issue 14)
    assert {re.sub(r"_(bucket|count|sum)$", "", n) for n in named} == set(contract.OPERATOR_READS)
    exported = _exported_series()
    missing = sorted(n for n in named if n not in exported)
    assert not missing, f"the operator queries series the worker does not export: {missing}"
    undeclared = sorted(n for n in contract.OPERATOR_READS if n not in exported and f"{n}_bucket" not in exported)
    assert not undeclared, f"the contract lists series the worker does not export: {undeclared}"


def test_the_worker_exports_every_budget_as_a_gauge() -> None:
    exported = _exported_series()
    assert {f"moeguard_budget_{name}" for name in contract.BUDGET_NAMES} <= exported


def test_overload_context_cap_rule() -> None:
    assert contract.overload_context_cap(None, 4096) == 2048
    assert contract.overload_context_cap(1000, 4096) == 1000
    assert contract.overload_context_cap(None, 1) == 1
