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
from typing import TYPE_CHECKING, Annotated, Any, Literal

from kubernetes.utils.quantity import parse_quantity
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic.alias_generators import to_camel

from moeguard_runtime import contract
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


class ModelOverrides(_Model):
    """Shape fields that replace the preset's (``moeguard_runtime.presets.ModelArgs``). Unset: the preset's."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("!has(self.topK) || !has(self.numExperts) || self.topK <= self.numExperts",
         "model.overrides.topK must be <= model.overrides.numExperts", ".topK"),
    ))

    n_layer: int | None = Field(default=None, ge=1, le=256)
    """Decoder blocks."""
    dim: int | None = Field(default=None, ge=8, le=65_536)
    """Hidden size D."""
    n_head: int | None = Field(default=None, ge=1, le=1024)
    """Attention heads."""
    n_kv_head: int | None = Field(default=None, ge=1, le=1024)
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int | None = Field(default=None, ge=8, le=262_144)
    """Expert SwiGLU width I."""
    num_experts: int | None = Field(default=None, ge=1, le=1024)
    """Experts per MoE layer E."""
    top_k: int | None = Field(default=None, ge=1, le=64)
    """Experts per token k."""
    max_seq_len: int | None = Field(default=None, ge=16, le=1_048_576)
    """Maximum context length, tokens."""


class ModelSpec(_Model):
    """Which model the workers serve."""

    preset: str = Field(default="tiny", min_length=1, max_length=63, pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$")
    """Name of a built-in model shape preset (see ``moeguard_runtime.presets``). An unknown name is
    reported by the operator as a Ready=False condition and a Warning Event."""
    checkpoint_path: str | None = Field(default=None, max_length=4096, pattern=r"^/")
    """Absolute path, inside the worker container, of a safetensors checkpoint (HF Mixtral tensor names
    accepted). Unset: seeded random weights."""
    overrides: ModelOverrides = Field(default_factory=ModelOverrides)
    """Shape overrides on top of the preset."""


class ResourcesSpec(_Model):
    """Accelerators, CPU and memory of each worker pod."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("quantity(self.softLimit).isLessThan(quantity(self.hardLimit))",
         "resources.softLimit must be less than resources.hardLimit", ".softLimit"),
        ("quantity(self.softLimit).isGreaterThan(quantity('0'))", "resources.softLimit must be above 0", ".softLimit"),
        ("quantity(self.hardLimit).isLessThan(quantity('64Ti'))", "resources.hardLimit must be below 64Ti", ".hardLimit"),
        ("quantity(self.cpu).isGreaterThan(quantity('0'))", "resources.cpu must be above 0", ".cpu"),
        ("self.gpuSoftFraction < self.gpuHardFraction",
         "resources.gpuSoftFraction must be less than resources.gpuHardFraction", ".gpuSoftFraction"),
    ))

    gpus: int = Field(default=1, ge=0, le=16)
    """GPUs per worker container (the limit of ``gpuResourceName``)."""
    gpu_resource_name: str = Field(default="nvidia.com/gpu", max_length=253,
                                   pattern=r"^([a-z0-9.-]+/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Extended resource that counts GPUs, e.g. ``nvidia.com/gpu`` or a MIG profile ``nvidia.com/mig-1g.10gb``."""
    gpu_product: str | None = Field(default=None, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """GPU type: becomes the node selector ``nvidia.com/gpu.product`` (NVIDIA GPU feature discovery)."""
    cpu: str = Field(default="2", pattern=r"^[0-9]+(\.[0-9]+)?m?$", max_length=16)
    """CPU request and limit of each worker (Kubernetes quantity)."""
    soft_limit: str = Field(default="6Gi", pattern=QUANTITY_PATTERN, max_length=32)
    """Soft memory limit (Kubernetes quantity, bytes). Above it the worker shrinks its token budgets.
    Compared with the container's cgroup ``memory.current`` (process RSS where no cgroup limit exists)."""
    hard_limit: str = Field(default="8Gi", pattern=QUANTITY_PATTERN, max_length=32)
    """Hard memory limit (Kubernetes quantity, bytes): the container's memory limit. Above it the worker
    admits no new requests (HTTP 503)."""
    gpu_soft_fraction: float = Field(default=contract.DEFAULT_GPU_SOFT_FRACTION, gt=0.0, le=1.0)
    """Fraction of device memory in use (``torch.cuda.mem_get_info``) above which the worker shrinks its
    budgets."""
    gpu_hard_fraction: float = Field(default=contract.DEFAULT_GPU_HARD_FRACTION, gt=0.0, le=1.0)
    """Fraction of device memory in use above which the worker admits no new requests."""

    @model_validator(mode="after")
    def _soft_below_hard(self) -> ResourcesSpec:
        if parse_quantity(self.soft_limit) <= 0:
            raise ValueError("resources.softLimit must be above 0")
        if parse_quantity(self.hard_limit) >= parse_quantity("64Ti"):
            raise ValueError("resources.hardLimit must be below 64Ti")
        if parse_quantity(self.cpu) <= 0:
            raise ValueError("resources.cpu must be above 0")
        if parse_quantity(self.soft_limit) >= parse_quantity(self.hard_limit):
            raise ValueError(
                f"resources.softLimit ({self.soft_limit}) must be less than resources.hardLimit ({self.hard_limit})"
            )
        if self.gpu_soft_fraction >= self.gpu_hard_fraction:
            raise ValueError("resources.gpuSoftFraction must be less than resources.gpuHardFraction")
        return self

    @property
    def soft_limit_bytes(self) -> int:
        return int(parse_quantity(self.soft_limit))

    @property
    def hard_limit_bytes(self) -> int:
        return int(parse_quantity(self.hard_limit))


BUDGET_FIELDS: tuple[str, ...] = contract.BUDGET_NAMES
"""The budgets the control loop moves (``contract.Budgets``), in snake case."""


def _bound_rules(kind: str, op: str) -> tuple[tuple[str, str, str], ...]:
    """CEL rules tying ``floors``/``ceilings`` to the initial budgets, one per budget."""
    rules = []
    for name in BUDGET_FIELDS:
        camel = to_camel(name)
        if kind == "floors":
            rules.append((f"self.floors.{camel} <= self.{camel}",
                          f"batching.floors.{camel} must be <= batching.{camel}", f".floors.{camel}"))
        else:
            rules.append((f"!has(self.ceilings.{camel}) || self.{camel} {op} self.ceilings.{camel}",
                          f"batching.{camel} must be <= batching.ceilings.{camel}", f".ceilings.{camel}"))
    return tuple(rules)


def _budget_fields(role: Literal["initial", "floor", "ceiling"]) -> dict[str, Any]:
    """Pydantic field definitions for every budget, generated from the contract (never re-typed).

    Type, bounds and meaning come from ``contract.Budgets``; the default from ``contract.BUDGET_FIELDS``:
    the initial value, the floor, or None (a ceiling left unset is the initial value).
    """
    fields: dict[str, Any] = {}
    for budget in contract.BUDGET_FIELDS:
        info = Budgets.model_fields[budget.name]
        typed: Any = Annotated[info.annotation, *info.metadata]
        unit = "" if budget.unit in ("requests", "batches") else f", {budget.unit}"
        if role == "initial":
            fields[budget.name] = (typed, Field(default=budget.default, description=info.description))
        elif role == "floor":
            fields[budget.name] = (typed, Field(default=budget.floor,
                                                description=f"Floor of ``{budget.alias}``{unit}."))
        else:
            fields[budget.name] = (typed | None, Field(default=None,
                                                       description=f"Ceiling of ``{budget.alias}``{unit}."))
    return fields


if TYPE_CHECKING:  # generated classes: their budget attributes are read with getattr(…, name)
    BudgetFloors = _Model
    BudgetCeilings = _Model
    _BatchingBudgets = _Model
else:
    BudgetFloors = create_model("BudgetFloors", __base__=_Model, __module__=__name__,
                                __doc__="The lowest value the control loop may set for each budget.",
                                **_budget_fields("floor"))
    BudgetCeilings = create_model("BudgetCeilings", __base__=_Model, __module__=__name__,
                                  __doc__="The highest value the control loop may set for each budget. "
                                          "Unset: the initial value.",
                                  **_budget_fields("ceiling"))
    _BatchingBudgets = create_model("_BatchingBudgets", __base__=_Model, __module__=__name__,
                                    **_budget_fields("initial"))


class BatchingSpec(_BatchingBudgets):
    """Initial batching budgets, with the floors and ceilings the control loop keeps them within. The
    budgets in effect are in ``status.budgets`` and in the budget ConfigMap."""

    model_config = ConfigDict(json_schema_extra=_cel(*_bound_rules("floors", ""), *_bound_rules("ceilings", "<=")))

    long_request_threshold_tokens: int = Field(default=contract.DEFAULT_LONG_REQUEST_THRESHOLD_TOKENS, ge=1,
                                               le=1_048_576)
    """Prompt length from which a request counts as long, tokens (not moved by the control loop)."""
    max_concurrent_requests: int = Field(default=contract.DEFAULT_MAX_CONCURRENT_REQUESTS, ge=1, le=1_048_576)
    """Requests admitted at once, running plus waiting (TGI ``max_concurrent_requests``); beyond it,
    HTTP 429 with ``Retry-After``. Not moved by the control loop."""
    floors: BudgetFloors = Field(default_factory=BudgetFloors)
    """Lower bounds for the control loop."""
    ceilings: BudgetCeilings = Field(default_factory=BudgetCeilings)
    """Upper bounds for the control loop (unset: the initial value)."""

    @model_validator(mode="after")
    def _bounds(self) -> BatchingSpec:
        for name in BUDGET_FIELDS:
            value, floor, ceiling = getattr(self, name), getattr(self.floors, name), getattr(self.ceilings, name)
            if floor > value:
                raise ValueError(f"batching.floors.{to_camel(name)} must be <= batching.{to_camel(name)}")
            if ceiling is not None and value > ceiling:
                raise ValueError(f"batching.{to_camel(name)} must be <= batching.ceilings.{to_camel(name)}")
        return self


class ControlSpec(_Model):
    """The operator's outer control loop: AIMD on the budgets, with hysteresis."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("self.rssSoftFraction < self.rssHardFraction",
         "control.rssSoftFraction must be less than control.rssHardFraction", ".rssSoftFraction"),
        ("self.windowSeconds >= self.queryIntervalSeconds",
         "control.windowSeconds must be >= control.queryIntervalSeconds (a shorter window misses samples)",
         ".windowSeconds"),
    ))

    prometheus_url: str | None = Field(default=None, max_length=2048, pattern=r"^https?://")
    """Prometheus base URL. Unset: the operator's ``--prometheus-url`` (env ``MOEGUARD_PROMETHEUS_URL``)."""
    query_interval_seconds: int = Field(default=10, ge=1, le=3600)
    """Seconds between two looks at Prometheus. OOM kills are acted on at the next tick, without waiting."""
    window_seconds: int = Field(default=30, ge=5, le=3600)
    """Range of the PromQL windows (``max_over_time``, ``rate``), seconds."""
    skew_threshold: float = Field(default=4.0, gt=1.0, le=1_000_000.0)
    """Expert skew ratio (top expert tokens / median expert tokens) above which the prefill budgets drop."""
    rss_soft_fraction: float = Field(default=0.8, gt=0.0, le=1.0)
    """Memory in use / hardLimit above which every budget drops (pressure)."""
    rss_hard_fraction: float = Field(default=0.95, gt=0.0, le=1.0)
    """Memory in use / hardLimit above which overload mode turns on (mode Auto)."""
    decrease_factor: float = Field(default=0.5, gt=0.0, lt=1.0)
    """Multiplicative decrease under pressure: budget × factor, never below its floor."""
    increase_step: float = Field(default=0.1, gt=0.0, le=1.0)
    """Additive increase after a calm stabilization window: + step × ceiling, never above the ceiling."""
    stabilization_window_seconds: int = Field(default=120, ge=0, le=86_400)
    """Seconds without pressure (and with full visibility) before budgets climb or overload turns off."""
    cooldown_seconds: int = Field(default=30, ge=0, le=86_400)
    """Minimum seconds between two budget changes (an OOM kill does not wait)."""
    leak_action: Literal["Warn", "Restart"] = "Warn"
    """On a suspected native leak: ``Warn`` (condition and Event) or ``Restart`` (roll the workers too)."""
    leak_slope_bytes_per_second: int = Field(default=1_048_576, ge=1)
    """RSS growth (PromQL ``deriv`` over ``leakWindowSeconds``) above which a leak is suspected, bytes/s."""
    leak_window_seconds: int = Field(default=600, ge=30, le=86_400)
    """Window of the RSS slope, seconds."""

    @model_validator(mode="after")
    def _orders(self) -> ControlSpec:
        if self.rss_soft_fraction >= self.rss_hard_fraction:
            raise ValueError("control.rssSoftFraction must be less than control.rssHardFraction")
        if self.window_seconds < self.query_interval_seconds:
            raise ValueError("control.windowSeconds must be >= control.queryIntervalSeconds (a shorter window misses samples)")
        return self


class OverloadSpec(_Model):
    """Overload mode: aggressive batching off, fewer decode sequences, long contexts refused,
    interactive requests first."""

    mode: Literal["Auto", "On", "Off"] = "Auto"
    """``Auto``: the operator switches it from the thresholds below; ``On``/``Off``: forced."""
    p99_latency_seconds: float = Field(default=60.0, gt=0, le=86_400)
    """End-to-end p99 latency above which overload turns on (Auto), seconds."""
    rejection_rate_per_second: float = Field(default=1.0, gt=0, le=1_000_000)
    """Refusals (429 and 503) per second across the workers above which overload turns on (Auto)."""
    max_context_tokens: int | None = Field(default=None, ge=1, le=1_048_576)
    """While overload is on, prompts plus max_tokens above this are refused. Unset: half the model's context."""


class UcxSpec(_Model):
    """UCX settings of the worker. UCX's memory-invalidation queue is unbounded by default and grows host
    RSS outside the Python heap (vLLM/NIXL reports); both fixes are on by default."""

    mode: Literal["none", "rcache", "passthrough"] = "none"
    """``none``: ``UCX_MEM_MMAP_HOOK_MODE=none`` and ``UCX_RCACHE_MAX_UNRELEASED``; ``rcache``: only the
    bounded ``UCX_RCACHE_MAX_UNRELEASED`` (vLLM's later choice); ``passthrough``: UCX's own defaults (for UCX
    versions with the root cause fixed)."""
    rcache_max_unreleased: int = Field(default=contract.UCX_SAFE_RCACHE_MAX_UNRELEASED, ge=1, le=1_000_000_000)
    """``UCX_RCACHE_MAX_UNRELEASED``: regions held in the rcache invalidation queue."""
    extra_env: dict[str, str] = Field(default_factory=dict, max_length=64, json_schema_extra=_cel(
        ("self.all(k, k.startsWith('UCX_'))", "ucx.extraEnv keys must start with UCX_", ""),
        ("self.all(k, " + " && ".join(f"k != '{v}'" for v in reversed(contract.UCX_MANAGED_VARS)) + ")",
         f"ucx.extraEnv must not set {' or '.join(reversed(contract.UCX_MANAGED_VARS))} (use ucx.mode and "
         "ucx.rcacheMaxUnreleased)", "")))
    """More UCX variables (keys start with ``UCX_``), e.g. ``UCX_CUDA_IPC_CACHE: n``."""

    @field_validator("extra_env")
    @classmethod
    def _ucx_keys(cls, env: dict[str, str]) -> dict[str, str]:
        bad = sorted(k for k in env if not k.startswith("UCX_"))
        if bad:
            raise ValueError(f"ucx.extraEnv keys must start with UCX_ (got {', '.join(bad)})")
        managed = sorted(k for k in env if k in contract.UCX_MANAGED_VARS)
        if managed:
            raise ValueError(f"ucx.extraEnv must not set {', '.join(managed)} (use ucx.mode and ucx.rcacheMaxUnreleased)")
        return env


class Toleration(_Model):
    """A pod toleration (core/v1 Toleration)."""

    key: str | None = Field(default=None, max_length=316)
    """Taint key; empty with operator Exists matches every key."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """Exists or Equal."""
    value: str | None = Field(default=None, max_length=63)
    """Taint value, for operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect; unset matches all."""
    toleration_seconds: int | None = Field(default=None, ge=0)
    """For NoExecute: seconds the pod stays bound after the taint appears."""


class EnvVar(_Model):
    """A plain environment variable."""

    name: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Variable name; ``MOEGUARD_*`` and ``UCX_*`` are reserved."""
    value: str = Field(default="", max_length=32_768)
    """Value."""


class VolumeMount(_Model):
    """Where a volume from ``template.volumes`` is mounted in the worker container."""

    name: str = Field(min_length=1, max_length=63)
    """Volume name."""
    mount_path: str = Field(min_length=1, max_length=4096, pattern=r"^/")
    """Absolute path in the container."""
    read_only: bool = True
    """Mount read-only."""
    sub_path: str | None = Field(default=None, max_length=4096)
    """Sub-path of the volume."""


class PodTemplateSpec(_Model):
    """Extras for the worker pods."""

    node_selector: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Node labels the workers must run on."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    """Tolerations of the worker pods."""
    affinity: dict[str, Any] | None = None
    """core/v1 Affinity of the worker pods, as Kubernetes writes it."""
    priority_class_name: str | None = Field(default=None, max_length=253)
    """PriorityClass of the worker pods."""
    extra_env: list[EnvVar] = Field(default_factory=list, max_length=128, json_schema_extra={
        **_cel(("self.all(e, !e.name.startsWith('MOEGUARD_') && !e.name.startsWith('UCX_'))",
                "template.extraEnv must not set MOEGUARD_* or UCX_* (use spec fields and ucx.extraEnv)", "")),
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    """More environment variables for the worker container."""
    volumes: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
    """core/v1 Volumes added to the worker pods, as Kubernetes writes them."""
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=64, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["mountPath"]})
    """Mounts of those volumes in the worker container."""
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Annotations of the worker pods."""

    @field_validator("extra_env")
    @classmethod
    def _not_reserved(cls, env: list[EnvVar]) -> list[EnvVar]:
        bad = sorted(e.name for e in env if e.name.startswith(("MOEGUARD_", "UCX_")))
        if bad:
            raise ValueError(f"template.extraEnv must not set MOEGUARD_* or UCX_* (got {', '.join(bad)})")
        names = [e.name for e in env]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"template.extraEnv names must be unique (repeated: {', '.join(dups)})")
        return env

    @model_validator(mode="after")
    def _mounts_have_volumes(self) -> PodTemplateSpec:
        volumes = {str(v.get("name")) for v in self.volumes} | {"tmp"}
        missing = sorted(m.name for m in self.volume_mounts if m.name not in volumes)
        if missing:
            raise ValueError(f"template.volumeMounts name no volume in template.volumes: {', '.join(missing)}")
        return self


class MoEInferenceServiceSpec(_Model):
    """Desired state of a MoEInferenceService."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    """Model to serve."""
    replicas: int = Field(default=1, ge=0, le=1024)
    """Number of worker pods (the scale subresource: ``kubectl scale`` and HPAs work)."""
    image: str = Field(default=DEFAULT_IMAGE, min_length=1, max_length=512)
    """Worker container image."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Image pull policy of the worker container."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """GPU count and type, CPU and memory limits of each worker."""
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    """Initial batching budgets, their floors and ceilings."""
    control: ControlSpec = Field(default_factory=ControlSpec)
    """The outer control loop."""
    overload: OverloadSpec = Field(default_factory=OverloadSpec)
    """Overload mode."""
    ucx: UcxSpec = Field(default_factory=UcxSpec)
    """UCX environment of the worker."""
    template: PodTemplateSpec = Field(default_factory=PodTemplateSpec)
    """Pod template extras: node selector, tolerations, affinity, priority class, env, volumes."""

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
    """What the control loop last saw. A missing value is absent (null), never 0."""

    time: datetime | None = None
    """When the loop last looked."""
    skew_ratio: float | None = None
    """Highest expert skew ratio among the service's pods over the window."""
    memory_ratio: float | None = None
    """Highest memory in use / hardLimit among the pods (cgroup usage, or RSS where there is no cgroup)."""
    memory_percent: int | None = None
    """``memoryRatio`` in percent, for ``kubectl get``."""
    rss_slope_bytes_per_second: float | None = None
    """Highest RSS growth among the pods (PromQL ``deriv`` over the leak window), bytes/s."""
    rejection_rate_per_second: float | None = None
    """Refusals (429 and 503) per second across the pods."""
    p99_latency_seconds: float | None = None
    """End-to-end p99 latency across the pods, seconds."""
    oom_kills: int = 0
    """Container terminations with reason OOMKilled seen since the resource was created."""
    restarts: int = 0
    """Worker container restarts, summed over the current pods."""
    silent_pods: list[str] = Field(default_factory=list)
    """Running worker pods with no metrics in Prometheus."""


class LoopState(_Model):
    """Bookkeeping of the control loop, kept in status so an operator restart resumes it."""

    last_change_time: datetime | None = None
    """Last budget change."""
    last_pressure_time: datetime | None = None
    """Last time a pressure signal was seen (skew, memory, OOM kill)."""
    last_overload_trigger_time: datetime | None = None
    """Last time an overload trigger was seen."""
    last_restart_time: datetime | None = None
    """Last rolling restart for a suspected leak."""
    last_blind_time: datetime | None = None
    """Last look without full visibility (the stabilization window restarts after it)."""
    oom_checked_time: datetime | None = None
    """OOM kills that finished after this time are new."""


class MoEInferenceServiceStatus(_Model):
    """Observed state, written by the operator only."""

    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = None
    """metadata.generation of the spec last reconciled."""
    conditions: list[Condition] = Field(default_factory=list)
    """kstatus conditions (Ready, Reconciling, Stalled) and moeguard's own (MetricsAvailable,
    BudgetTightened, Overloaded, MemoryLeakSuspected)."""
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
    overload_mode: Literal["On", "Off"] | None = None
    """Overload mode in effect."""
    initial_budgets: Budgets | None = None
    """The spec's budgets that ``budgets`` derive from; a spec change resets ``budgets`` to them."""
    last_adjustment: Adjustment | None = None
    """The last budget change."""
    observed: Observed | None = None
    """The control loop's last observation."""
    control: LoopState | None = None
    """The control loop's bookkeeping."""
