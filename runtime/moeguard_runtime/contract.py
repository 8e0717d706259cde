"""The contract between the operator and the worker, defined once.

Both sides import this module; it imports no torch and no kopf.

* **Environment** the operator puts on each worker container (``ENV_*``).
* **The budget ConfigMap** ``<service>-budget``: one key, ``budget.json``,
  holding a :class:`BudgetDocument`. The operator writes it; the worker watches
  it through the Kubernetes API (a watch on that one object, allowed by a Role
  whose ``resourceNames`` lists only it) and applies a new, valid document to
  the next batch. A kubelet-mounted ConfigMap volume was not chosen: the kubelet
  refreshes it only after its sync period plus cache TTL (often 60-90 s), far
  over the 5 s target, and kwok test clusters run no kubelet at all.
* **Metric names and labels** that the operator's Prometheus queries read.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

API_GROUP = "moeguard.dev"
API_VERSION = "v1alpha1"
KIND = "MoEInferenceService"
PLURAL = "moeinferenceservices"

# --- environment of the worker container ------------------------------------
ENV_SERVICE_NAME = "MOEGUARD_SERVICE_NAME"
"""Name of the owning MoEInferenceService."""
ENV_NAMESPACE = "MOEGUARD_NAMESPACE"
"""Namespace of the pod (downward API ``metadata.namespace``)."""
ENV_POD_NAME = "MOEGUARD_POD_NAME"
"""Name of the pod (downward API ``metadata.name``)."""
ENV_MODEL_PRESET = "MOEGUARD_MODEL_PRESET"
ENV_CHECKPOINT_PATH = "MOEGUARD_CHECKPOINT_PATH"
"""Absolute path of a safetensors checkpoint (unset: seeded random weights)."""
ENV_MODEL_OVERRIDES = "MOEGUARD_MODEL_OVERRIDES"
"""JSON object of ``presets.ModelArgs`` fields (snake case) that replace the preset's."""
ENV_SOFT_LIMIT_BYTES = "MOEGUARD_SOFT_LIMIT_BYTES"
"""Soft memory limit, bytes: above it the worker shrinks its budgets."""
ENV_HARD_LIMIT_BYTES = "MOEGUARD_HARD_LIMIT_BYTES"
"""Hard memory limit, bytes (= the container's memory limit): above it, 503."""
ENV_BUDGET_CONFIGMAP = "MOEGUARD_BUDGET_CONFIGMAP"
"""Name of the budget ConfigMap to watch, in the pod's namespace."""
ENV_MAX_PREFILL_TOKENS = "MOEGUARD_MAX_PREFILL_TOKENS"
ENV_MAX_DECODE_TOKENS = "MOEGUARD_MAX_DECODE_TOKENS"
ENV_MAX_BATCH_REQUESTS = "MOEGUARD_MAX_BATCH_REQUESTS"
ENV_MAX_CONCURRENT_BATCHES = "MOEGUARD_MAX_CONCURRENT_BATCHES"
ENV_MAX_LONG_REQUESTS_PER_BATCH = "MOEGUARD_MAX_LONG_REQUESTS_PER_BATCH"
ENV_MAX_QUEUE_REQUESTS = "MOEGUARD_MAX_QUEUE_REQUESTS"
ENV_QUEUE_TIMEOUT_SECONDS = "MOEGUARD_QUEUE_TIMEOUT_SECONDS"
ENV_LONG_REQUEST_THRESHOLD_TOKENS = "MOEGUARD_LONG_REQUEST_THRESHOLD_TOKENS"
"""Static: a request whose prompt is at least this many tokens counts as long."""
ENV_MAX_CONCURRENT_REQUESTS = "MOEGUARD_MAX_CONCURRENT_REQUESTS"
"""Static: requests admitted at once, running plus waiting (TGI max_concurrent_requests); beyond it, HTTP 429."""
ENV_GPU_SOFT_FRACTION = "MOEGUARD_GPU_SOFT_FRACTION"
"""Static: fraction of device memory above which the worker shrinks its budgets (GPU only)."""
ENV_GPU_HARD_FRACTION = "MOEGUARD_GPU_HARD_FRACTION"
"""Static: fraction of device memory above which the worker admits no new requests (GPU only)."""
ENV_OVERLOAD_MODE = "MOEGUARD_OVERLOAD_MODE"
"""Static: Auto (the worker may switch overload on itself), On or Off (the operator decides)."""
ENV_DEVICE = "MOEGUARD_DEVICE"
"""Torch device of the model, KV caches and inputs: ``auto`` (default: ``cuda`` when
``torch.cuda.is_available()``, else ``cpu``), ``cpu``, ``cuda`` or ``cuda:N``."""
ENV_DTYPE = "MOEGUARD_DTYPE"
"""Weights and KV cache dtype: ``auto`` (default: bfloat16 on CUDA, float32 on CPU),
``float32``, ``bfloat16`` or ``float16``. The router softmax is float32 whatever this is."""
ENV_PORT = "MOEGUARD_PORT"
"""TCP port of the worker's HTTP server (OpenAI API, /metrics, health)."""
WORKER_PORT = 8000

UCX_MEM_MMAP_HOOK_MODE = "UCX_MEM_MMAP_HOOK_MODE"
UCX_RCACHE_MAX_UNRELEASED = "UCX_RCACHE_MAX_UNRELEASED"

# --- budget ConfigMap ----------------------------------------------------------
BUDGET_KEY = "budget.json"


def budget_configmap_name(service: str) -> str:
    """Name of the budget ConfigMap of MoEInferenceService ``service``."""
    return f"{service}-budget"


class Budgets(BaseModel):
    """The batching budgets in effect: the knobs the operator's outer loop moves.

    Names follow TGI/vLLM/Triton where the meaning matches (see each field).
    Strict: a number written as a string (``"100"``) is refused, as the HTTP API refuses it.
    Fields added after the first release carry defaults, so an older document
    still parses.
    """

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True, strict=True)

    max_prefill_tokens: int = Field(alias="maxPrefillTokens", gt=0, le=1_048_576,
                                    description="Prompt tokens per prefill batch (TGI max_batch_prefill_tokens, vLLM max_num_batched_tokens).")
    max_decode_tokens: int = Field(alias="maxDecodeTokens", gt=0, le=1_048_576,
                                   description="Sequences decoded per decode step, one token each (vLLM max_num_seqs in tokens).")
    max_batch_requests: int = Field(alias="maxBatchRequests", gt=0, le=65_536,
                                    description="Requests per batch (Triton max_batch_size).")
    max_long_requests_per_batch: int = Field(default=4, alias="maxLongRequestsPerBatch", gt=0, le=65_536,
                                             description="Requests longer than the long-request threshold in one batch.")
    max_concurrent_batches: int = Field(alias="maxConcurrentBatches", gt=0, le=64,
                                        description="Batches in flight at once in one worker.")
    max_queue_requests: int = Field(default=64, alias="maxQueueRequests", gt=0, le=1_048_576,
                                    description="Requests waiting in the queue (Triton max_queue_size); beyond it, HTTP 429.")
    queue_timeout_seconds: float = Field(default=30.0, alias="queueTimeoutSeconds", gt=0, le=3600,
                                         description="Seconds a request may wait in the queue (Triton default_timeout_microseconds); then HTTP 503.")


class BudgetDocument(BaseModel):
    """The content of ``budget.json`` in the budget ConfigMap.

    ``generation`` increases with every change the operator makes; the worker
    ignores a document whose generation is not newer than the one it applied.
    """

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)

    generation: int = Field(ge=0)
    budgets: Budgets
    overload_mode: Literal["On", "Off"] = Field(default="Off", alias="overloadMode")
    overload_max_context_tokens: int | None = Field(default=None, alias="overloadMaxContextTokens", gt=0)
    """While overload mode is On, prompts plus max_tokens above this are refused (HTTP 503, with the reason)."""
    reason: str = Field(default="initial", max_length=1024)
    updated_at: datetime = Field(default_factory=lambda: datetime.now(UTC), alias="updatedAt")

    @model_validator(mode="after")
    def _aware(self) -> BudgetDocument:
        if self.updated_at.tzinfo is None:
            raise ValueError("updatedAt must carry a time zone")
        return self

    def to_configmap_data(self) -> dict[str, str]:
        """Serialize into ConfigMap ``data`` (camelCase JSON under ``budget.json``)."""
        return {BUDGET_KEY: self.model_dump_json(by_alias=True)}


class BudgetDocumentError(ValueError):
    """A budget ConfigMap whose content is missing or invalid; the message says why."""


def parse_budget_configmap_data(data: dict[str, str] | None) -> BudgetDocument:
    """Parse and validate a budget ConfigMap's ``data``.

    Raises:
        BudgetDocumentError: the key is missing, the JSON is malformed, or a
            field is invalid; the message names the field.
    """
    if not data or BUDGET_KEY not in data:
        raise BudgetDocumentError(f"budget ConfigMap has no {BUDGET_KEY!r} key")
    try:
        raw = json.loads(data[BUDGET_KEY])
    except json.JSONDecodeError as exc:
        raise BudgetDocumentError(f"{BUDGET_KEY} is not valid JSON: {exc}") from None
    try:
        return BudgetDocument.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise BudgetDocumentError(f"invalid {BUDGET_KEY}: {problems}") from None


# --- metrics the operator reads -------------------------------------------------
LABEL_SERVICE = "moeis"
"""Label naming the MoEInferenceService on every worker series."""
LABEL_NAMESPACE = "namespace"
LABEL_POD = "pod"
WORKER_LABELS = (LABEL_SERVICE, LABEL_NAMESPACE, LABEL_POD)

METRIC_EXPERT_SKEW_RATIO = "moeguard_expert_skew_ratio"
"""Gauge per ``layer``: top expert tokens / median expert tokens, last batch."""
METRIC_PROCESS_RSS_BYTES = "moeguard_process_resident_memory_bytes"
METRIC_BUDGET_GENERATION = "moeguard_budget_generation"
METRIC_MEMORY_USAGE_BYTES = "moeguard_memory_usage_bytes"
"""Gauge, label ``source`` (cgroup_v2 | cgroup_v1 | rss): the figure the soft and hard limits compare."""
METRIC_REJECTIONS_TOTAL = "moeguard_rejections_total"
"""Counter, label ``reason``."""
METRIC_E2E_LATENCY_SECONDS = "moeguard_e2e_request_latency_seconds"
"""Histogram of end-to-end request latency."""
METRIC_PROCESS_RSS_ANONYMOUS_BYTES = "moeguard_process_resident_anonymous_memory_bytes"
"""Gauge: anonymous resident memory (``RssAnon``); a native leak grows it."""
METRIC_PROCESS_MEMORY_MAPPINGS = "moeguard_process_memory_mappings"
"""Gauge: lines of ``/proc/self/maps``."""
METRIC_PYTHON_ALLOCATED_BLOCKS = "moeguard_python_allocated_blocks"
"""Gauge: ``sys.getallocatedblocks()``, the Python heap's live blocks (a count, not bytes)."""
METRIC_MEMORY_GROWTH_BYTES_PER_SECOND = "moeguard_memory_growth_bytes_per_second"
"""Gauge, label ``part`` (rss | rss_anonymous | rss_file | malloc_in_use): least-squares slope over the worker's window."""
METRIC_MEMORY_LEAK_SUSPECTED = "moeguard_memory_leak_suspected"
"""Gauge 0/1, label ``kind`` (native | python_heap): which part the worker sees growing."""
METRIC_MEMORY_LIMIT_STATE = "moeguard_memory_limit_state"
"""Gauge: 0 below the soft limit, 1 above soft (budgets shrunk), 2 above hard (503)."""
METRIC_OVERLOAD_ACTIVE = "moeguard_overload_active"
"""Gauge 0/1, label ``source`` (operator | worker | env): overload mode in effect, and who asked."""
METRIC_QUEUE_REQUESTS = "moeguard_queue_requests"
"""Gauge: requests waiting in the queue."""
METRIC_OOM_ERRORS_TOTAL = "moeguard_oom_errors_total"
"""Counter, label ``kind`` (cuda | host): batches failed by an out-of-memory error the worker survived."""
