"""Names used across the operator: label keys, the field manager, annotation prefixes."""

from __future__ import annotations

from moeguard_core.contract import API_GROUP

FIELD_MANAGER = "moeguard"
"""The one field manager of every server-side apply the operator makes."""

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
"""Labels LeaderWorkerSet's pod webhook puts on every pod of a group (worker index 0: the leader)."""

TEMPLATE_HASH_LABEL = f"{API_GROUP}/template-hash"
ROLE_LABEL = f"{API_GROUP}/role"
"""On the children of a service's prefill role (disaggregated prefill/decode): ``prefill``."""
"""Label of the worker pod template (and so of its pods): a hash of the template the operator applied, which tells
the pods of the current template from those of an earlier one during a rollout, for a Deployment and a
LeaderWorkerSet alike (:func:`children.builders.template_hash`; issue 29, item 1)."""

WORKER_NAME = "moeguard-worker"
WORKER_COMPONENT = "worker"
MANAGED_BY = "moeguard"

FINALIZER = f"{API_GROUP}/finalizer"
"""kopf's finalizer, under moeguard's own API group."""
ANNOTATION_PREFIX = API_GROUP
"""Prefix of kopf's progress and diff-base annotations."""

CONDITION_READY = "Ready"
CONDITION_RECONCILING = "Reconciling"
CONDITION_STALLED = "Stalled"
CONDITION_METRICS_AVAILABLE = "MetricsAvailable"
CONDITION_BUDGET_TIGHTENED = "BudgetTightened"
CONDITION_BUDGETS_APPLIED = "BudgetsApplied"
"""True when every reporting worker runs the budget document in the ConfigMap (:mod:`loop.applied`)."""

PROMETHEUS_URL_ENV = "MOEGUARD_PROMETHEUS_URL"
"""Default Prometheus URL of the operator, when a resource's spec names none."""
CONDITION_OVERLOADED = "Overloaded"
CONDITION_MEMORY_LEAK_SUSPECTED = "MemoryLeakSuspected"
