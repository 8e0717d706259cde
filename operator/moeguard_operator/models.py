"""The MoEInferenceService API (moeguard.dev/v1alpha1), as pydantic models.

These models are the single source of truth: ``crdgen`` turns them into the
committed CRD under ``crds/`` (structural schema, defaults, CEL rules), and the
operator parses every object it handles through them. Field docstrings become
the CRD's descriptions (``use_attribute_docstrings``).

Names follow the serving engines where the meaning matches (TGI
``max_batch_prefill_tokens``, vLLM ``max_num_seqs``, Triton ``max_batch_size``)
and the Kubernetes API conventions for status (``observedGeneration``,
``conditions``, kstatus).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from kubernetes.utils.quantity import parse_quantity
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from moeguard_runtime.contract import Budgets

QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
"""Memory quantities as Kubernetes writes them (a subset: no exponents or milli)."""

DEFAULT_IMAGE = "ghcr.io/moeguard/worker:0.1.0-cpu"


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=True,
        extra="forbid",
        frozen=True,
    )


def _cel(*rules: tuple[str, str, str]) -> dict[str, Any]:
    """``x-kubernetes-validations`` entries from (rule, message, fieldPath) triples."""
    out = []
    for rule, message, path in rules:
        entry = {"rule": rule, "message": message}
        if path:
            entry["fieldPath"] = path
        out.append(entry)
    return {"x-kubernetes-validations": out}


class ModelSpec(_Model):
    """Which model the workers serve."""

    preset: str = Field(default="tiny", min_length=1, max_length=63, pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$")
    """Name of a built-in model shape preset (see ``moeguard_runtime.presets``). An unknown name is
    reported by the operator as a Ready=False condition and a Warning Event."""


class ResourcesSpec(_Model):
    """Accelerators and memory of each worker pod."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("quantity(self.softLimit).isLessThan(quantity(self.hardLimit))",
         "resources.softLimit must be less than resources.hardLimit", ".softLimit"),
    ))

    gpus: int = Field(default=1, ge=0, le=16)
    """``nvidia.com/gpu`` limit of each worker container."""
    soft_limit: str = Field(default="6Gi", pattern=QUANTITY_PATTERN, max_length=32)
    """Soft memory limit (Kubernetes quantity, bytes). Above it the worker shrinks its token budgets.
    Compared with the container's cgroup ``memory.current`` (process RSS where no cgroup limit exists)."""
    hard_limit: str = Field(default="8Gi", pattern=QUANTITY_PATTERN, max_length=32)
    """Hard memory limit (Kubernetes quantity, bytes): the container's memory limit. Above it the worker
    admits no new requests (HTTP 503)."""

    @model_validator(mode="after")
    def _soft_below_hard(self) -> ResourcesSpec:
        if parse_quantity(self.soft_limit) >= parse_quantity(self.hard_limit):
            raise ValueError(
                f"resources.softLimit ({self.soft_limit}) must be less than resources.hardLimit ({self.hard_limit})"
            )
        return self

    @property
    def soft_limit_bytes(self) -> int:
        return int(parse_quantity(self.soft_limit))

    @property
    def hard_limit_bytes(self) -> int:
        return int(parse_quantity(self.hard_limit))


class BudgetFloors(_Model):
    """The lowest value the operator's control loop may set for each budget."""

    max_prefill_tokens: int = Field(default=256, ge=1, le=1_048_576)
    """Floor of ``maxPrefillTokens``, tokens."""


class BatchingSpec(_Model):
    """Initial batching budgets. The control loop moves the budgets in effect between the floors and
    these values; the budgets in effect are in ``status.budgets`` and the budget ConfigMap."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("self.floors.maxPrefillTokens <= self.maxPrefillTokens",
         "batching.floors.maxPrefillTokens must be <= batching.maxPrefillTokens", ".floors.maxPrefillTokens"),
    ))

    max_prefill_tokens: int = Field(default=4096, ge=1, le=1_048_576)
    """Prompt tokens in one prefill batch, tokens (TGI ``max_batch_prefill_tokens``; vLLM
    ``max_num_batched_tokens``). Longer prompts are prefilled in chunks."""
    max_decode_tokens: int = Field(default=256, ge=1, le=1_048_576)
    """Tokens in one decode step, i.e. sequences decoded together (vLLM ``max_num_seqs``)."""
    max_batch_requests: int = Field(default=32, ge=1, le=65_536)
    """Requests in one batch (Triton ``max_batch_size``)."""
    max_concurrent_batches: int = Field(default=2, ge=1, le=64)
    """Batches in flight at once in one worker."""
    floors: BudgetFloors = Field(default_factory=BudgetFloors)
    """Lower bounds for the control loop."""

    @model_validator(mode="after")
    def _floor_below_initial(self) -> BatchingSpec:
        if self.floors.max_prefill_tokens > self.max_prefill_tokens:
            raise ValueError("batching.floors.maxPrefillTokens must be <= batching.maxPrefillTokens")
        return self


class ControlSpec(_Model):
    """The operator's outer control loop."""

    prometheus_url: str | None = Field(default=None, max_length=2048, pattern=r"^https?://")
    """Prometheus base URL. Unset: the operator's ``--prometheus-url`` (env ``MOEGUARD_PROMETHEUS_URL``)."""
    query_interval_seconds: int = Field(default=10, ge=1, le=3600)
    """Seconds between two looks at Prometheus."""
    skew_window_seconds: int = Field(default=30, ge=5, le=3600)
    """Window of ``max_over_time`` over the expert skew ratio, seconds."""
    skew_threshold: float = Field(default=4.0, gt=1.0, le=1_000_000.0)
    """Expert skew ratio (top expert tokens / median expert tokens) above which the prefill budget is
    halved."""
    cooldown_seconds: int = Field(default=30, ge=0, le=86_400)
    """Minimum seconds between two budget changes."""


class UcxSpec(_Model):
    """UCX settings of the worker. Defaults bound UCX's memory-invalidation queue, whose unbounded default
    grows host RSS outside the Python heap (vLLM/NIXL reports; see docs)."""

    mmap_hook_mode: Literal["none", "reloc", "bistro"] = "none"
    """``UCX_MEM_MMAP_HOOK_MODE``. ``none`` disables the mmap hooks that feed the invalidation queue."""
    rcache_max_unreleased: str = Field(default="1024", pattern=r"^([0-9]+|inf)$", max_length=20)
    """``UCX_RCACHE_MAX_UNRELEASED``: regions held in the rcache invalidation queue; ``inf`` is UCX's
    unbounded default."""


class MoEInferenceServiceSpec(_Model):
    """Desired state of a MoEInferenceService."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    """Model to serve."""
    replicas: int = Field(default=1, ge=0, le=1024)
    """Number of worker pods."""
    image: str = Field(default=DEFAULT_IMAGE, min_length=1, max_length=512)
    """Worker container image."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """GPU count and memory limits of each worker."""
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    """Initial batching budgets and their floors."""
    control: ControlSpec = Field(default_factory=ControlSpec)
    """The outer control loop."""
    ucx: UcxSpec = Field(default_factory=UcxSpec)
    """UCX environment of the worker."""

    @field_validator("image")
    @classmethod
    def _no_space(cls, v: str) -> str:
        if any(c.isspace() for c in v):
            raise ValueError("image must not contain whitespace")
        return v


# --- status ---------------------------------------------------------------------

class Condition(_Model):
    """A Kubernetes condition (metav1.Condition)."""

    type: str
    """Condition type: Ready, Reconciling, Stalled, MetricsAvailable, BudgetTightened."""
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    reason: str
    """CamelCase reason."""
    message: str = ""
    """Human-readable detail."""
    last_transition_time: datetime
    """When the status last changed."""
    observed_generation: int | None = None
    """The metadata.generation this condition was computed for."""


class Adjustment(_Model):
    """The last budget change made by the control loop."""

    time: datetime
    """When it was made."""
    reason: str
    """Why (names the signal and its value)."""
    from_: Budgets = Field(alias="from")
    """Budgets before."""
    to: Budgets
    """Budgets after."""


class Observed(_Model):
    """What the control loop last saw. A missing value is absent, never 0."""

    time: datetime | None = None
    """When Prometheus was last queried."""
    skew_ratio: float | None = None
    """Highest expert skew ratio among the service's pods over the skew window."""


class MoEInferenceServiceStatus(_Model):
    """Observed state, written by the operator only."""

    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = None
    """metadata.generation of the spec last reconciled."""
    conditions: list[Condition] = Field(default_factory=list)
    """kstatus conditions (Ready, Reconciling, Stalled) and moeguard's own."""
    replicas: int | None = None
    """Worker pods desired."""
    ready_replicas: int | None = None
    """Worker pods ready."""
    selector: str | None = None
    """Label selector of the worker pods (for the scale subresource and HPAs)."""
    budgets: Budgets | None = None
    """Budgets in effect (the same as the budget ConfigMap)."""
    budget_generation: int | None = None
    """Generation of the budget document; increases with every change."""
    initial_budgets: Budgets | None = None
    """The spec's budgets that ``budgets`` derive from; a spec change resets ``budgets`` to them."""
    last_adjustment: Adjustment | None = None
    """The last budget change."""
    observed: Observed | None = None
    """The control loop's last observation."""
