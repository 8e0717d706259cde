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
from dataclasses import dataclass
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
"""Absolute path of a safetensors checkpoint (unset: seeded random weights). With ``spec.model.source``:
``MODEL_MOUNT_PATH``, or ``MODEL_MOUNT_PATH/<subPath>``."""
ENV_KERNEL_CACHE_DIR = "MOEGUARD_KERNEL_CACHE_DIR"
"""Where the worker caches its measured expert-matmul kernel choice (``kernel_select``). The operator sets
:data:`POD_KERNEL_CACHE_DIR`, on the pod's ``/tmp`` volume (an emptyDir: it outlives a container restart)."""
POD_KERNEL_CACHE_DIR = "/tmp/moeguard-kernels"
ENV_SERVED_MODEL_NAME = "MOEGUARD_SERVED_MODEL_NAME"
"""The model name the worker's OpenAI API reports (``/v1/models``) and accepts (``spec.model.servedModelName``;
unset: the worker's own default)."""
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
ENV_ROLE = "MOEGUARD_ROLE"
"""The worker's part in disaggregated prefill/decode (issue 33): ``single`` (default: prefill and decode),
``prefill`` (runs prompts and offers their KV at ``PREFILL_PATH``), ``decode`` (the clients' endpoint: has each
prompt prefilled by ``ENV_PREFILL_URL``'s workers and reads its KV over UCX)."""
ROLES = ("single", "prefill", "decode")
ENV_PREFILL_URL = "MOEGUARD_PREFILL_URL"
"""A decode worker's prefill workers: the base URL of their Service (``http://<name>-prefill:8000``)."""
ENV_KV_TRANSFER_TIMEOUT_SECONDS = "MOEGUARD_KV_TRANSFER_TIMEOUT_SECONDS"
"""Seconds a decode worker waits for a prompt's KV read (default 5); past it the request ends with 503
``kv_transfer_failed``. Its call to the prefill worker (the prompt's queueing and prefill there) is bounded by
``ENV_KV_LEASE_SECONDS``."""
ENV_KV_LEASE_SECONDS = "MOEGUARD_KV_LEASE_SECONDS"
"""Seconds a prefill worker holds an offered KV that no decode worker has read, and the bound of one prefill
call, queueing included, on both sides (default 30)."""
PREFILL_PATH = "/internal/v1/prefill"
"""A prefill worker's endpoint: ``POST {"request_id", "prompt_token_ids", "temperature", "seed", "priority"}``
-> ``{"offer": {...}}`` (:class:`moeguard_runtime.disagg.nixl_kv.KVOffer` as JSON)."""
ENV_DEVICE = "MOEGUARD_DEVICE"
"""Torch device of the model, KV caches and inputs: ``auto`` (default: ``cuda`` when
``torch.cuda.is_available()``, else ``cpu``), ``cpu``, ``cuda`` or ``cuda:N``."""
ENV_DTYPE = "MOEGUARD_DTYPE"
"""Weights and KV cache dtype: ``auto`` (default: bfloat16 on CUDA, float32 on CPU),
``float32``, ``bfloat16`` or ``float16``. The router softmax is float32 whatever this is."""
ENV_PORT = "MOEGUARD_PORT"
"""TCP port of the worker's HTTP server (OpenAI API, /metrics, health)."""
WORKER_PORT = 8000


# --- expert parallelism (issue 15): one replica = a LeaderWorkerSet group of pods ---------------
ENV_LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
"""Set by LeaderWorkerSet on every pod of a group: the leader pod's address (the rendezvous host)."""
ENV_LWS_GROUP_SIZE = "LWS_GROUP_SIZE"
"""Set by LeaderWorkerSet: pods in the group."""
ENV_LWS_WORKER_INDEX = "LWS_WORKER_INDEX"
"""Set by LeaderWorkerSet: this pod's index in its group, 0 for the leader."""
ENV_EXPERT_PARALLEL_SIZE = "MOEGUARD_EXPERT_PARALLEL_SIZE"
"""Ranks per replica (``spec.parallelism.expertParallelSize``); unset or 1: the single-process worker."""
ENV_EP_PORT = "MOEGUARD_EP_PORT"
"""TCP port of the group's rendezvous (``torch.distributed`` TCPStore) on the leader."""
DEFAULT_EP_PORT = 29500
ENV_EP_TIMEOUT_SECONDS = "MOEGUARD_EP_TIMEOUT_SECONDS"
"""Timeout of every collective of the group, seconds: a rank dead or hung longer fails the group."""
DEFAULT_EP_TIMEOUT_SECONDS = 30.0
ENV_EP_JOIN_TIMEOUT_SECONDS = "MOEGUARD_EP_JOIN_TIMEOUT_SECONDS"
"""How long a rank waits for the whole group to join at start-up (model loads differ), seconds."""
DEFAULT_EP_JOIN_TIMEOUT_SECONDS = 600.0
EP_GROUP_UNAVAILABLE = "expert_parallel_group_unavailable"
"""Reason of the leader's 503s (and its readiness) once a rank of its group died or hung."""
EP_NOT_LEADER = "not_the_leader"
"""Reason of a follower rank's 503 to a completion request: only the group's leader serves them."""
EXIT_EP_GROUP_LOST = 4
"""Exit status of any rank whose group broke (a peer died or hung): the kubelet restarts the container and
LeaderWorkerSet's ``RecreateGroupOnPodRestart`` recreates the group."""
MODEL_MOUNT_PATH = "/moeguard/model"
"""Where the worker container sees ``spec.model.source``, read-only."""
MODEL_VOLUME = "moeguard-model"
"""Name of the pod volume of ``spec.model.source``."""
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
"""File where the worker writes why it failed to start (a bad checkpoint, a bad configuration) before it
exits non-zero; the kubelet copies it into ``containerStatuses[].lastState.terminated.message`` (at most
4096 bytes), where the operator reads it for the Ready condition."""

UCX_MEM_MMAP_HOOK_MODE = "UCX_MEM_MMAP_HOOK_MODE"
"""UCX's memory hooks; ``none`` stops UCX from intercepting mmap/munmap (and queueing freed regions)."""
UCX_RCACHE_MAX_UNRELEASED = "UCX_RCACHE_MAX_UNRELEASED"
"""Bound of UCX's rcache invalidation queue (unbounded by default: host RSS grows outside the heap)."""
UCX_SAFE_MMAP_HOOK_MODE = "none"
"""The safe value of ``UCX_MEM_MMAP_HOOK_MODE`` (vLLM, NIXL: freed memory is returned at once)."""
UCX_SAFE_RCACHE_MAX_UNRELEASED = 1024
"""The bounded ``UCX_RCACHE_MAX_UNRELEASED`` of vLLM PR #32570 / NIXL PR #1210."""
UCX_MANAGED_VARS = (UCX_MEM_MMAP_HOOK_MODE, UCX_RCACHE_MAX_UNRELEASED)
"""UCX variables that only the operator sets (from ``spec.ucx``); never from ``ucx.extraEnv``."""

# --- budget ConfigMap ----------------------------------------------------------
BUDGET_KEY = "budget.json"


def budget_configmap_name(service: str) -> str:
    """Name of the budget ConfigMap of MoEInferenceService ``service``."""
    return f"{service}-budget"


class Budgets(BaseModel):
    """The batching budgets in effect: the knobs the operator's outer loop moves.

    This class declares each budget once (name, type, bounds, meaning); :data:`BUDGET_FIELDS`
    adds its container variable, default and floor. The operator's spec models
    (``batching``, ``batching.floors``, ``batching.ceilings``) and the worker's settings
    are generated from the two, never re-typed.

    Names follow TGI/vLLM/Triton where the meaning matches (see each field).
    Strict: a number written as a string (``"100"``) is refused, as the HTTP API refuses it.
    Fields added after the first release carry defaults, so an older document
    still parses.
    """

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True, strict=True)

    max_prefill_tokens: int = Field(
        alias="maxPrefillTokens", ge=1, le=1_048_576,
        description="Prompt tokens in one prefill batch, tokens (TGI ``max_batch_prefill_tokens``; vLLM "
                    "``max_num_batched_tokens``). Longer prompts are prefilled in chunks.")
    max_decode_tokens: int = Field(
        alias="maxDecodeTokens", ge=1, le=1_048_576,
        description="Tokens in one decode step, i.e. sequences decoded together (vLLM ``max_num_seqs``).")
    max_batch_requests: int = Field(
        alias="maxBatchRequests", ge=1, le=65_536,
        description="Requests in one batch (Triton ``max_batch_size``).")
    max_long_requests_per_batch: int = Field(
        default=4, alias="maxLongRequestsPerBatch", ge=1, le=65_536,
        description="Requests of at least ``longRequestThresholdTokens`` prompt tokens in one batch.")
    max_concurrent_batches: int = Field(
        alias="maxConcurrentBatches", ge=1, le=64,
        description="Batches in flight at once in one worker.")
    max_queue_requests: int = Field(
        default=64, alias="maxQueueRequests", ge=1, le=1_048_576,
        description="Requests waiting in the queue (Triton ``max_queue_size``); beyond it, HTTP 429.")
    queue_timeout_seconds: float = Field(
        default=30.0, alias="queueTimeoutSeconds", gt=0, le=3600,
        description="Seconds a request may wait in the queue (Triton ``default_timeout_microseconds``); "
                    "then HTTP 503.")


@dataclass(frozen=True)
class BudgetField:
    """What the contract adds to one :class:`Budgets` field: how it reaches the worker and its defaults.

    ``default`` is the initial budget of a spec that sets none and of a worker started by hand
    (``moeguard worker serve``); ``floor`` is the default lowest value the outer loop may set
    (``spec.batching.floors``); the default ceiling is the initial value.
    """

    name: str
    """The :class:`Budgets` attribute (snake case); the spec's key is its camelCase alias."""
    env: str
    """Container variable carrying the initial value."""
    default: int | float
    floor: int | float
    unit: str
    """``tokens``, ``requests``, ``batches`` or ``seconds``."""

    @property
    def alias(self) -> str:
        """The camelCase key in the spec, the budget document and ``status.budgets``."""
        return str(Budgets.model_fields[self.name].alias)


BUDGET_FIELDS: tuple[BudgetField, ...] = (
    BudgetField("max_prefill_tokens", ENV_MAX_PREFILL_TOKENS, 4096, 256, "tokens"),
    BudgetField("max_decode_tokens", ENV_MAX_DECODE_TOKENS, 256, 16, "tokens"),
    BudgetField("max_batch_requests", ENV_MAX_BATCH_REQUESTS, 32, 1, "requests"),
    BudgetField("max_long_requests_per_batch", ENV_MAX_LONG_REQUESTS_PER_BATCH, 4, 1, "requests"),
    BudgetField("max_concurrent_batches", ENV_MAX_CONCURRENT_BATCHES, 2, 1, "batches"),
    BudgetField("max_queue_requests", ENV_MAX_QUEUE_REQUESTS, 64, 1, "requests"),
    BudgetField("queue_timeout_seconds", ENV_QUEUE_TIMEOUT_SECONDS, 30.0, 1.0, "seconds"),
)
"""Every budget, in :class:`Budgets`' order (a unit test checks that the two agree)."""
BUDGET_NAMES: tuple[str, ...] = tuple(f.name for f in BUDGET_FIELDS)
"""The budgets' attribute names, snake case, in order."""
DEFAULT_BUDGETS = Budgets.model_validate({f.name: f.default for f in BUDGET_FIELDS})
"""The initial budgets of a spec that sets none, and of a worker started without the variables."""
DEFAULT_FLOORS = Budgets.model_validate({f.name: f.floor for f in BUDGET_FIELDS})
"""The default ``spec.batching.floors``."""


def coherent(budgets: Budgets) -> Budgets:
    """``budgets`` with ``maxLongRequestsPerBatch`` at most ``maxBatchRequests``.

    The long-request cap is a cap inside the batch, so lowering it to the batch changes nothing a worker
    does; a worker refuses a budget document whose cap is above its batch
    (``moeguard_runtime.engine.budget_watch.check_consistency``) and keeps its old budgets. Every set of
    budgets the operator writes passes through here: a cut of ``maxBatchRequests`` alone (the memory model's
    largest fit) under a cap halved by an OOM kill made such a document, and the survivors of the kill kept
    their old budgets (``bench/results/control_latency_predictive.md``, stop 45's run)."""
    if budgets.max_long_requests_per_batch <= budgets.max_batch_requests:
        return budgets
    return budgets.model_copy(update={"max_long_requests_per_batch": budgets.max_batch_requests})

# --- static knobs (set once per pod, not moved by the outer loop) --------------------------------
DEFAULT_LONG_REQUEST_THRESHOLD_TOKENS = 2048
"""``ENV_LONG_REQUEST_THRESHOLD_TOKENS`` / ``spec.batching.longRequestThresholdTokens`` default, tokens."""
DEFAULT_MAX_CONCURRENT_REQUESTS = 128
"""``ENV_MAX_CONCURRENT_REQUESTS`` / ``spec.batching.maxConcurrentRequests`` default (TGI's default is 128)."""
DEFAULT_GPU_SOFT_FRACTION = 0.85
"""``ENV_GPU_SOFT_FRACTION`` / ``spec.resources.gpuSoftFraction`` default: share of device memory."""
DEFAULT_GPU_HARD_FRACTION = 0.95
"""``ENV_GPU_HARD_FRACTION`` / ``spec.resources.gpuHardFraction`` default: share of device memory."""
OVERLOAD_MODES = ("Auto", "On", "Off")
"""``ENV_OVERLOAD_MODE`` / ``spec.overload.mode`` values; ``Auto`` is the default."""
DEFAULT_OVERLOAD_MODE = "Auto"


def overload_context_cap(max_context_tokens: int | None, max_seq_len: int) -> int:
    """Tokens (prompt + ``max_tokens``) above which a request is refused while overload mode is on.

    Args:
        max_context_tokens: the cap set explicitly (``spec.overload.maxContextTokens``, the budget
            document's ``overloadMaxContextTokens``), or None.
        max_seq_len: the model's context length, tokens.

    Returns:
        The explicit cap, else half the model's context (at least 1): long contexts hold the most
        KV cache and the longest prefill, so they are shed first (the overload cure of the
        field's OOM reports; see docs/runbook.md).
    """
    return max_context_tokens if max_context_tokens else max(1, max_seq_len // 2)


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
    overload_queue_trigger: bool = Field(default=True, alias="overloadQueueTrigger")
    """Whether the worker's own overload trigger (mode ``Auto``) also fires on queue depth (at least 80 % of
    ``maxQueueRequests`` waiting). False where the operator decides overload from SLO attainment (its
    ``predictive`` policy, issue 30: never from the queue or the refusal rate alone); the worker's memory
    triggers (above the soft limit, an allocation failure) fire either way."""
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
"""Gauge per ``layer``: top expert tokens / median expert tokens, last batch (dashboards; the operator reads
:data:`METRIC_STEP_EXPERT_SKEW_RATIO`, which says when the batches were)."""
METRIC_STEP_EXPERT_SKEW_RATIO = "moeguard_step_expert_skew_ratio"
"""Histogram: one observation per engine step that routed enough token-slots, the highest skew ratio among
its layers (buckets :data:`SKEW_RATIO_BUCKETS`). Its ``_count`` is the number of such steps: no step in a
window is no skew data, never the last value forever."""
METRIC_WORKER_START_TIME_SECONDS = "moeguard_worker_start_time_seconds"
"""Gauge: when the worker process started its telemetry (Unix time, seconds), where its counters start from 0.
A worker younger than a window has all its counts inside it (a new pod, a restarted container)."""
SKEW_RATIO_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 14.0, 16.0,
                      20.0, 24.0, 28.0, 32.0, 40.0, 48.0, 56.0, 64.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0,
                      1024.0, 2048.0, 4096.0, 16384.0, 65536.0)
"""Upper bounds of :data:`METRIC_STEP_EXPERT_SKEW_RATIO`'s buckets: every integer to 8, then about four per
doubling. The operator's window maximum is the upper bound of the bucket holding the highest step, so a
``skewThreshold`` that is one of these bounds is judged exactly (and any other one at most one bucket early)."""
METRIC_PROCESS_RSS_BYTES = "moeguard_process_resident_memory_bytes"
METRIC_BUDGET_GENERATION = "moeguard_budget_generation"
METRIC_MEMORY_USAGE_BYTES = "moeguard_memory_usage_bytes"
"""Gauge, label ``source`` (cgroup_v2 | cgroup_v1 | rss): the figure the soft and hard limits compare."""
METRIC_REJECTIONS_TOTAL = "moeguard_rejections_total"
"""Counter, label ``reason``."""
METRIC_E2E_LATENCY_SECONDS = "moeguard_e2e_request_latency_seconds"
"""Histogram of end-to-end request latency, seconds, label ``priority`` (the operator sums over it)."""
METRIC_TTFT_SECONDS = "moeguard_time_to_first_token_seconds"
"""Histogram of arrival to first token, seconds, label ``priority`` (vLLM ``time_to_first_token_seconds``)."""
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 2.5, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Upper bounds of :data:`METRIC_TTFT_SECONDS`' buckets, seconds: the worker's latency buckets plus 2 and 3 s, so
that the default interactive TTFT objective (``spec.slo.interactive.ttftSeconds`` 3 s, the headline's) is a bucket
bound and its attainment is exact (another target is interpolated within its bucket)."""
METRIC_TPOT_SECONDS = "moeguard_request_time_per_output_token_seconds"
"""Histogram, label ``priority``: one observation per request that finished with an answer, its time per output
token after the first, ``(last token - first token) / (tokens - 1)``, seconds; 0 for a one-token answer (nothing
after the first). DistServe's TPOT (Zhong et al., OSDI 2024) and ``bench/slo.py``'s; vLLM v1's
``vllm:request_time_per_output_token_seconds``. Buckets :data:`TPOT_BUCKETS`."""
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds of :data:`METRIC_TPOT_SECONDS`' buckets, seconds (the default TPOT objectives, 0.25 s interactive
and 1 s batch, are bounds)."""
METRIC_KV_TRANSFER_SECONDS = "moeguard_kv_transfer_seconds"
"""Histogram: one observation per prompt KV a decode worker read from a prefill worker (disaggregated
prefill/decode, issue 33), seconds from registering its cache to the read's completion."""
METRIC_KV_TRANSFER_BYTES_TOTAL = "moeguard_kv_transfer_bytes_total"
"""Counter: bytes of prompt KV a decode worker read from prefill workers (the prompts' runs of its caches)."""
KV_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Upper bounds of :data:`METRIC_KV_TRANSFER_SECONDS`' buckets, seconds (the default read deadline is 5 s)."""
METRIC_REQUEST_CONTEXT_TOKENS = "moeguard_request_context_tokens"
"""Histogram: one observation per request accepted into the queue, its KV capacity ``prompt + max_tokens``,
tokens (the worker allocates a sequence's cache whole at admission). The operator reads the window's mean
(``_sum`` / ``_count``) and its largest bucket bound: the context mix its memory prediction uses. Buckets
:data:`CONTEXT_TOKEN_BUCKETS`."""
CONTEXT_TOKEN_BUCKETS = (16.0, 32.0, 64.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0, 1536.0, 2048.0, 3072.0,
                         4096.0, 6144.0, 8192.0, 12288.0, 16384.0, 24576.0, 32768.0, 49152.0, 65536.0, 98304.0,
                         131072.0, 196608.0, 262144.0, 524288.0, 1048576.0)
"""Upper bounds of :data:`METRIC_REQUEST_CONTEXT_TOKENS`' buckets, tokens: about two per doubling, so that the
window's largest bound is at most 1.5 times the longest request."""
METRIC_MEMORY_IDLE_FOOTPRINT_BYTES = "moeguard_memory_idle_footprint_bytes"
"""Gauge: the memory in use (the figure of :data:`METRIC_MEMORY_USAGE_BYTES`, the one the soft and hard limits
compare) at the worker's latest memory check with no request in it (nothing queued, running or holding a KV
cache), bytes: the loaded model, the runtime and the heap the process keeps. Absent until the first such check.
The operator measures each pod's headroom to the soft limit from it (``--policy predictive``)."""
METRIC_MEMORY_PREDICTION_CORRECTION_RATIO = "moeguard_memory_prediction_correction_ratio"
"""Gauge: the factor (>= 1) the worker multiplies the memory model's step predictions by
(:class:`moeguard_core.memory_admission.Correction`); memory-aware admission only."""
METRIC_PREEMPTIONS_TOTAL = "moeguard_preemptions_total"
"""Counter, label ``priority``: running requests moved back to the queue (KV kept) to make room for a
higher class (vLLM ``vllm:num_preemptions_total``)."""
METRIC_PRIORITY_REJECTIONS_TOTAL = "moeguard_priority_rejections_total"
"""Counter, labels ``priority`` and ``reason``: requests of a known class refused or ended without an answer
(the same reasons as :data:`METRIC_REJECTIONS_TOTAL`, plus ``priority_shed``: a batch request ended to make
room for an interactive one). A request refused before its body is read (the caps, while no batch request could
make room) counts under its ``X-Priority`` header's class, else the default, interactive."""
METRIC_PRIORITY_REQUESTS = "moeguard_priority_requests"
"""Gauge, labels ``priority`` and ``state`` (``waiting``, ``preempted``, ``running``; disjoint)."""
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
METRIC_EXPERT_SPLIT_STEPS_TOTAL = "moeguard_expert_split_steps_total"
"""Counter: engine steps in which some MoE layer ran its expert work in more than one chunk (an expert's
token-slots over ``MOEGUARD_EXPERT_CHUNK_TOKENS``, 256 on the CPU's oneDNN path; the vLLM fused-MoE fix)."""
METRIC_STEP_EXPERT_CHUNKS = "moeguard_step_expert_chunks"
"""Histogram: one observation per engine step that routed token-slots, the most chunks any MoE layer split
its expert work into (1: not split; buckets :data:`EXPERT_CHUNK_BUCKETS`)."""
EXPERT_CHUNK_BUCKETS = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0, 128.0, 256.0)
"""Upper bounds of :data:`METRIC_STEP_EXPERT_CHUNKS`' buckets."""
METRIC_MODEL_WEIGHT_BYTES = "moeguard_model_weight_bytes"
"""Bytes of the loaded model's parameters (set once at start-up): the checkpoint's real size, which the
operator cannot know at apply time when the weights come from ``spec.model.source``."""

# --- diagnosis signals (issue 14) ------------------------------------------------
METRIC_BATCHES_IN_FLIGHT = "moeguard_batches_in_flight"
"""Gauge: batches in flight now (at most ``max_concurrent_batches``)."""
METRIC_STEP_PREFILL_BATCHES = "moeguard_step_prefill_batches"
"""Histogram: one observation per engine step that carries prefill tokens, the number of batches in flight
whose prefill work overlaps it: this one, those holding a partly prefilled prompt, and those whose last step
carried prefill (buckets :data:`BATCH_COUNT_BUCKETS`). Its window maximum (``histogram_quantile(1, ...)``) is
the burst-overlap signal: several expensive prefills overlapping in one worker (each batch's activations and
new KV caches are live across the round robin)."""
BATCH_COUNT_BUCKETS = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
"""Upper bounds of :data:`METRIC_STEP_PREFILL_BATCHES`' buckets (batches)."""
METRIC_STEP_QUEUE_REQUESTS = "moeguard_step_queue_requests"
"""Histogram: one observation per engine step, the requests left waiting in the queue once the step's plan has
admitted its own (buckets :data:`QUEUE_DEPTH_BUCKETS`). Its window maximum (``histogram_quantile(1, ...)``) sees
a queue that every scrape of :data:`METRIC_QUEUE_REQUESTS` missed: a burst that a fast worker drains between two
scrapes (a CI run: 24 prompts queued and served within 0.7 s, the 2-s scrapes all read 0)."""
QUEUE_DEPTH_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
"""Upper bounds of :data:`METRIC_STEP_QUEUE_REQUESTS`' buckets (requests); 0 first, so that a window of empty
queues reads 0 (``histogram_quantile`` returns a first bucket's bound when it is not positive)."""
METRIC_LONG_REQUESTS_RUNNING = "moeguard_long_requests_running"
"""Gauge: running (or preempted) requests whose prompt is at least ``long_request_threshold_tokens``."""
METRIC_LONG_REQUESTS_ADMITTED_TOTAL = "moeguard_long_requests_admitted_total"
"""Counter: long requests admitted from the queue into a batch."""
METRIC_KV_CACHE_BYTES = "moeguard_kv_cache_bytes"
"""Gauge: bytes of KV cache held by the requests in the worker (running and preempted), bytes."""
METRIC_MEMORY_PEAK_BREAKDOWN_BYTES = "moeguard_memory_peak_breakdown_bytes"
"""Gauge, label ``stage`` (:data:`MEMORY_STAGES`): the memory of the largest predicted step peak of the last
:data:`PEAK_BREAKDOWN_WINDOW_SECONDS`, stage by stage (``kv_cache``: KV held by every request in the worker plus
the step's new caches; ``attention``, ``expert_buffers``, ``dense_mlp``: the step's transient buffers from the
memory model, :mod:`moeguard_core.memory_model`; ``weights``: the model's parameters), bytes."""
MEMORY_STAGES = ("kv_cache", "attention", "expert_buffers", "dense_mlp", "weights")
PEAK_BREAKDOWN_WINDOW_SECONDS = 30.0
"""The window over which :data:`METRIC_MEMORY_PEAK_BREAKDOWN_BYTES` keeps its largest step, seconds."""
METRIC_EXPERT_TOP_SHARE_RATIO = "moeguard_expert_top_share_ratio"
"""Gauge per ``layer``: the top expert's share of the layer's token-slots (``1/E`` balanced, at most ``1/k``),
last step with ``>= 4 * num_experts`` routed token-slots (the same steps as :data:`METRIC_EXPERT_SKEW_RATIO`)."""
METRIC_EXPERT_TOKENS_TOTAL = "moeguard_expert_tokens_total"
"""Counter, labels ``layer`` and ``expert``: token-slots routed to each expert (which experts are hot)."""
METRIC_UCX_INFO = "moeguard_ucx_info"
"""Info gauge (value 1), labels ``loaded`` (``true``/``false``: a UCX library is mapped in the process),
``libraries`` (the mapped UCX libraries' file names, comma-separated, sorted), ``mmap_hook_mode`` and
``rcache_max_unreleased`` (the effective settings: the environment's value, else UCX's default written as
``default:<value>``)."""
METRIC_MEMORY_MODEL_INFO = "moeguard_memory_model_info"
"""Info gauge (value 1): the memory model the worker predicts its steps with, labels
``memory_model_info.MEMORY_MODEL_LABELS`` (the model's shape, ``dtype``, ``expert_chunk_tokens``,
``capacity_factor``); absent where the worker has none (a shape the memory model does not know). The operator's
predictive policy predicts each pod's peak with it (a ``model.source`` checkpoint's shape is known to the worker
only)."""
UCX_ENV_MMAP_HOOK_MODE = "UCX_MEM_MMAP_HOOK_MODE"
UCX_ENV_RCACHE_MAX_UNRELEASED = "UCX_RCACHE_MAX_UNRELEASED"
METRIC_EP_RANK_TOKENS_TOTAL = "moeguard_ep_rank_tokens_total"
"""Counter, labels ``layer`` and ``rank``: token-slots routed to each rank's experts (expert parallelism; on the
leader, for every rank; on a follower, its own)."""
METRIC_EP_BALANCEDNESS_RATIO = "moeguard_ep_balancedness_ratio"
"""Gauge per ``layer``: mean / max token-slots per rank, last step (vLLM EPLB's and SGLang's
``eplb_balancedness``; 1.0 balanced, ``1/ranks`` everything on one rank). Leader only."""
METRIC_EP_COLLECTIVE_SECONDS = "moeguard_ep_collective_seconds"
"""Histogram, label ``rank``: wall time a step spent in the group's collectives (sending, waiting, receiving;
on the leader the whole step's, on a follower its share of each MoE layer's), seconds."""
METRIC_EP_RANK_RSS_BYTES = "moeguard_ep_rank_resident_memory_bytes"
"""Gauge, label ``rank``: resident set size of each rank's process (the leader gathers the followers' about
once a second; every rank exports its own), bytes. The operator's memory signal takes the worst rank."""
METRIC_EP_RANK_INFO = "moeguard_ep_rank_info"
"""Info gauge (value 1), labels ``rank``, ``ranks``, ``experts`` (``lo-hi``, the half-open block this rank owns)
and ``role`` (``leader``/``follower``)."""
METRIC_EP_GROUP_UP = "moeguard_ep_group_up"
"""Gauge: 1 while this rank is in a working group, 0 before it joined and after the group broke."""
METRIC_GPU_MEMORY_ALLOCATED_BYTES = "moeguard_gpu_memory_allocated_bytes"
METRIC_GPU_MEMORY_RESERVED_BYTES = "moeguard_gpu_memory_reserved_bytes"
METRIC_MEMORY_CHUNK_SHRINKS_TOTAL = "moeguard_memory_chunk_shrinks_total"
"""Counter: prefill chunks cut below the prefill budget so that a step's predicted peak fits (a memory failure
for the diagnosis)."""
METRIC_PROCESS_MEMORY_MAPPINGS_GROWTH = "moeguard_process_memory_mappings_growth_per_second"
"""Gauge: the worker's own slope of its memory mappings count (native leak evidence), mappings/s."""

LEAK_BYTES_PER_BLOCK_NATIVE = 4096
"""Growth with fewer than one new Python heap block (``moeguard_python_allocated_blocks``) per this many bytes of
anonymous RSS is not the Python heap's (a block is 16 to 512 bytes; a Python leak of small objects adds one block
per few hundred bytes): the worker's leak classification (``moeguard_runtime.memory.leak``) and the operator's diagnosis
use the same bound."""

OPERATOR_READS = (
    METRIC_STEP_EXPERT_SKEW_RATIO,
    METRIC_WORKER_START_TIME_SECONDS,
    METRIC_MEMORY_USAGE_BYTES,
    METRIC_PROCESS_RSS_BYTES,
    METRIC_REJECTIONS_TOTAL,
    METRIC_E2E_LATENCY_SECONDS,
    METRIC_MEMORY_LEAK_SUSPECTED,
    METRIC_MEMORY_GROWTH_BYTES_PER_SECOND,
    # diagnosis signals (issue 14)
    METRIC_BATCHES_IN_FLIGHT,
    METRIC_STEP_PREFILL_BATCHES,
    METRIC_LONG_REQUESTS_RUNNING,
    METRIC_LONG_REQUESTS_ADMITTED_TOTAL,
    METRIC_KV_CACHE_BYTES,
    METRIC_MEMORY_PEAK_BREAKDOWN_BYTES,
    METRIC_EXPERT_TOP_SHARE_RATIO,
    METRIC_EXPERT_TOKENS_TOTAL,
    METRIC_UCX_INFO,
    METRIC_QUEUE_REQUESTS,
    METRIC_STEP_QUEUE_REQUESTS,
    METRIC_OOM_ERRORS_TOTAL,
    METRIC_MEMORY_LIMIT_STATE,
    METRIC_GPU_MEMORY_ALLOCATED_BYTES,
    METRIC_GPU_MEMORY_RESERVED_BYTES,
    METRIC_MEMORY_CHUNK_SHRINKS_TOTAL,
    METRIC_PROCESS_MEMORY_MAPPINGS_GROWTH,
    METRIC_PROCESS_RSS_ANONYMOUS_BYTES,
    METRIC_PYTHON_ALLOCATED_BLOCKS,
    # an expert-parallel group's rank imbalance, part of the skew signal (issue 15)
    METRIC_EP_RANK_TOKENS_TOTAL,
    # SLO attainment and the memory prediction (issue 30)
    METRIC_TTFT_SECONDS,
    METRIC_TPOT_SECONDS,
    METRIC_REQUEST_CONTEXT_TOKENS,
    METRIC_MEMORY_IDLE_FOOTPRINT_BYTES,
    METRIC_MEMORY_PREDICTION_CORRECTION_RATIO,
    METRIC_MEMORY_MODEL_INFO,
    # the budget document each worker runs: the BudgetsApplied condition (stop 46)
    METRIC_BUDGET_GENERATION,
)
"""Every worker series the operator's Prometheus queries name (the budget look and issue 14's diagnosis): a
test checks that the worker's registry declares each, and that the queries name none outside it. The GPU gauges are declared
on every worker but carry a value only on CUDA."""
