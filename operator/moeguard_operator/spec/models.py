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

import re
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from kubernetes.utils.quantity import parse_quantity
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic.alias_generators import to_camel

from moeguard_core import contract
from moeguard_core.contract import Budgets
from moeguard_operator.spec import core_schemas

QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
"""Memory quantities as Kubernetes writes them (a subset: no exponents or milli)."""

DEFAULT_IMAGE = "ghcr.io/moeguard/worker:0.1.0-cpu"

_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
IMAGE_REFERENCE = (rf"^(?:(?:{_DOMAIN_COMPONENT}(?:[.]{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?/)?"
                   rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
                   r"(?::[\w][\w.-]{0,127})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$")
"""An image reference as the container runtimes parse it (the grammar of ``distribution/reference``'s
``ReferenceRegexp``: ``[host[:port]/]path[:tag][@digest]``, path components lower case). The API server checks
only that a pod's image has no leading or trailing whitespace; a reference outside this grammar passes it and the
pod then waits in ``InvalidImageName`` (issue 29, item 5)."""
IMAGE_WORDS = "[registry[:port]/]path[:tag][@digest], path in lower case, no whitespace"
""":data:`IMAGE_REFERENCE` in words, for messages."""
ENV_VAR_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
"""An environment variable name as Kubernetes validated it up to 1.33 (``IsEnvVarName``: letters, digits, '-',
'.', '_', not starting with a digit). Later versions accept any printable ASCII but '='; this subset is what
every supported cluster's pods accept (issue 29, item 5: a ``=`` in a name was refused only by the pod)."""
ENV_NAME_WORDS = "letters, digits, -, . and _, not starting with a digit"
""":data:`ENV_VAR_NAME` in words, for messages."""


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=True,
        extra="forbid",
        frozen=True,
    )


CelRule = tuple[str, str, str] | tuple[str, str, str, str]
"""(rule, message, fieldPath) or (rule, message, fieldPath, messageExpression)."""


def _cel(*rules: CelRule) -> dict[str, Any]:
    """``x-kubernetes-validations`` entries from (rule, message, fieldPath) triples, or (rule, message, fieldPath,
    messageExpression) where the message names the offending item (the API server shows ``message`` when the
    expression fails)."""
    out = []
    for rule, message, path, *expression in rules:
        entry = {"rule": rule, "message": message}
        if path:
            entry["fieldPath"] = path
        if expression:
            entry["messageExpression"] = expression[0]
        out.append(entry)
    return {"x-kubernetes-validations": out}


class ModelOverrides(_Model):
    """Shape fields that replace the preset's (``moeguard_core.presets.ModelArgs``). Unset: the preset's."""

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


SUB_PATH_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*$"
"""A relative path inside a volume: segments that start with a letter, digit or ``_`` (so never ``..``)."""


class PvcModelSource(_Model):
    """A PersistentVolumeClaim that holds the checkpoint (mounted read-only; the claim may be ReadOnlyMany)."""

    claim_name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    """Name of the PersistentVolumeClaim, in the MoEInferenceService's namespace."""


class HostPathModelSource(_Model):
    """A directory of the node (single-node and development clusters: the files must be on every node the
    workers may run on). Served only where the operator runs with ``--allow-host-path-models``: a hostPath
    gives whoever may create a MoEInferenceService read access to that node directory."""

    path: str = Field(min_length=2, max_length=4096, pattern=r"^/[^:]*[^/:]$")
    """Absolute path of the directory on the node (not ``/``)."""


class ImageModelSource(_Model):
    """An OCI image or artifact whose files are the checkpoint (a Kubernetes image volume, read-only; needs
    Kubernetes 1.33+ with the ``ImageVolume`` feature and a container runtime that supports it)."""

    reference: str = Field(min_length=1, max_length=512, pattern=r"^[^\s]+$")
    """Image reference, e.g. ``registry.example.com/models/qwen3-30b-a3b:2507``."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """When the kubelet pulls the image."""


_SOURCE_KINDS = ("persistentVolumeClaim", "hostPath", "image")


class ModelSource(_Model):
    """Where the checkpoint's files come from: exactly one of ``persistentVolumeClaim``, ``hostPath`` or
    ``image``, mounted read-only in every worker at ``/moeguard/model`` (``contract.MODEL_MOUNT_PATH``). The operator
    reads nothing from it: the worker validates the checkpoint at start-up, and a failure reaches the
    Ready condition through the container's termination message."""

    model_config = ConfigDict(json_schema_extra=_cel(
        (" + ".join(f"(has(self.{k}) ? 1 : 0)" for k in _SOURCE_KINDS) + " == 1",
         "model.source must set exactly one of " + ", ".join(_SOURCE_KINDS), ""),
    ))

    persistent_volume_claim: PvcModelSource | None = None
    """A PersistentVolumeClaim."""
    host_path: HostPathModelSource | None = None
    """A node directory (only with the operator's ``--allow-host-path-models``)."""
    image: ImageModelSource | None = None
    """An OCI image volume."""
    sub_path: str | None = Field(default=None, max_length=1024, pattern=SUB_PATH_PATTERN)
    """Folder inside the source that holds ``config.json`` and the safetensors shards (relative, no
    ``..``). Unset: the source's root. The worker reads ``/moeguard/model/<subPath>``."""

    @model_validator(mode="after")
    def _one_kind(self) -> ModelSource:
        kinds = [self.persistent_volume_claim, self.host_path, self.image]
        if sum(k is not None for k in kinds) != 1:
            raise ValueError("model.source must set exactly one of " + ", ".join(_SOURCE_KINDS))
        return self

    @property
    def checkpoint_path(self) -> str:
        """Where the worker finds the checkpoint: ``contract.MODEL_MOUNT_PATH`` [``/subPath``]."""
        return contract.MODEL_MOUNT_PATH + (f"/{self.sub_path}" if self.sub_path else "")


class ModelSpec(_Model):
    """Which model the workers serve."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("!has(self.source) || !has(self.checkpointPath)",
         "model.source and model.checkpointPath are exclusive (with a source the worker reads /moeguard/model)",
         ".checkpointPath"),
    ))

    # This description is in the committed CRD: it keeps the path of before issue 28 (now moeguard_core.presets)
    # so that crds/ stays byte for byte the same.
    preset: str = Field(default="tiny", min_length=1, max_length=63, pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$")
    """Name of a built-in model shape preset (see ``moeguard_core.presets``). An unknown name is
    reported by the operator as a Ready=False condition and a Warning Event."""
    checkpoint_path: str | None = Field(default=None, max_length=4096, pattern=r"^/")
    """Absolute path, inside the worker container, of a safetensors checkpoint (HF Mixtral tensor names
    accepted). Unset: seeded random weights."""
    overrides: ModelOverrides = Field(default_factory=ModelOverrides)
    """Shape overrides on top of the preset."""
    source: ModelSource | None = None
    """A checkpoint folder in the Hugging Face layout (``config.json``, safetensors shards, tokenizer files)
    from a PersistentVolumeClaim, a node directory or an OCI image, mounted read-only at ``/moeguard/model``. Its
    ``config.json`` gives the model's shape: the preset and overrides are not used for it. Unset: the
    preset (``checkpointPath`` or seeded random weights)."""
    served_model_name: str | None = Field(default=None, min_length=1, max_length=256,
                                          pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")
    """The model name clients send and ``/v1/models`` reports (env ``MOEGUARD_SERVED_MODEL_NAME``), e.g.
    ``Qwen/Qwen3-30B-A3B``. Unset: the worker's default."""
    weight_bytes: str | None = Field(default=None, pattern=QUANTITY_PATTERN, max_length=32)
    """Size of the checkpoint's weights (Kubernetes quantity, bytes; e.g. ``57Gi``, what ``du -sh`` of the
    safetensors shards says). The operator reads nothing from a ``source``, so this hint is the only size it
    knows at apply time: when set, a ``hardLimit`` at or below it is refused. Unset with a source: not checked
    at apply time; the worker exports the loaded size as ``moeguard_model_weight_bytes``."""

    @model_validator(mode="after")
    def _one_checkpoint(self) -> ModelSpec:
        if self.source is not None and self.checkpoint_path is not None:
            raise ValueError("model.source and model.checkpointPath are exclusive "
                             "(with a source the worker reads /moeguard/model)")
        return self

    @property
    def weight_bytes_hint(self) -> int | None:
        """``weightBytes`` in bytes, or None when unset."""
        return None if self.weight_bytes is None else int(parse_quantity(self.weight_bytes))


CORE_RESOURCE_NAMES = ("cpu", "memory", "ephemeral-storage", "storage", "pods")
"""Core resource names: a GPU count under one of them would overwrite the container's own limit."""
CORE_RESOURCE_PREFIXES = ("hugepages-", "requests.", "limits.")
AMD_GPU_PREFIX = "amd.com/"
"""AMD's device plugin resources (``amd.com/gpu``): ROCm, where ``UCX_MEM_MMAP_HOOK_MODE=none`` breaks NIXL."""


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
        ("!(self.gpuResourceName in " + repr(list(CORE_RESOURCE_NAMES)) + ") && "
         + " && ".join(f"!self.gpuResourceName.startsWith('{p}')" for p in CORE_RESOURCE_PREFIXES),
         "resources.gpuResourceName must be an extended resource (e.g. nvidia.com/gpu), not a core one "
         "(cpu, memory, ephemeral-storage, hugepages-*)", ".gpuResourceName"),
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
    Compared with the container's working set: cgroup ``memory.current`` minus inactive file pages, the
    kubelet's figure (process RSS where no cgroup limit exists)."""
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
        name = self.gpu_resource_name
        if name in CORE_RESOURCE_NAMES or name.startswith(CORE_RESOURCE_PREFIXES):
            raise ValueError(f"resources.gpuResourceName must be an extended resource (e.g. nvidia.com/gpu), "
                             f"not the core resource {name!r}")
        return self

    @property
    def amd_gpu(self) -> bool:
        """Whether the GPUs are AMD's (ROCm): ``gpuResourceName`` under ``amd.com/``."""
        return self.gpu_resource_name.startswith(AMD_GPU_PREFIX)

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
    """Prometheus base URL. Unset: the operator's ``--prometheus-url`` (env ``MOEGUARD_PROMETHEUS_URL``). Set: it must be
    the operator's own or one it allows (``--allowed-prometheus-url``), else the resource is stalled with
    ``PrometheusURLNotAllowed``."""
    query_interval_seconds: int = Field(default=10, ge=1, le=3600)
    """Seconds between two looks at Prometheus. OOM kills are acted on at the next tick, without waiting."""
    window_seconds: int = Field(default=30, ge=5, le=3600)
    """Range of the PromQL windows (``max_over_time``, ``rate``), seconds."""
    skew_threshold: float = Field(default=4.0, gt=1.0, le=1_000_000.0)
    """Expert skew ratio (top expert tokens / median expert tokens) above which routing skew is reported (the
    RoutingSkew Event). The default ``predictive`` policy cuts no budget for skew alone: it predicts each pod's
    peak under the observed skew and cuts only where that does not fit. With the operator's ``--policy
    threshold`` the prefill budgets drop above it."""
    rss_soft_fraction: float = Field(default=0.8, gt=0.0, le=1.0)
    """Memory in use / hardLimit above which the budgets do not loosen (``predictive``, the default policy: more
    than its prediction accounts for) or every budget drops (``--policy threshold``: pressure)."""
    rss_hard_fraction: float = Field(default=0.95, gt=0.0, le=1.0)
    """Memory in use / hardLimit above which overload mode turns on (mode Auto)."""
    decrease_factor: float = Field(default=0.5, gt=0.0, lt=1.0)
    """Multiplicative decrease, never below the floors: on an OOM kill (both policies), and under any pressure
    with ``--policy threshold`` (the default ``predictive`` policy cuts to the largest value that fits instead)."""
    increase_step: float = Field(default=0.1, gt=0.0, le=1.0)
    """Additive increase after a calm stabilization window: + step × ceiling, never above the ceiling."""
    stabilization_window_seconds: int = Field(default=120, ge=0, le=86_400)
    """Seconds without pressure (and with full visibility) before budgets climb or overload turns off."""
    cooldown_seconds: int = Field(default=30, ge=0, le=86_400)
    """Minimum seconds between two budget changes (an OOM kill does not wait)."""
    leak_action: Literal["Warn", "Restart"] = "Warn"
    """On a suspected native leak: ``Warn`` (condition and Event) or ``Restart`` (roll the workers too; with the
    operator's default ``--policy predictive`` on Deployment workers, each leaking pod is replaced before it reaches
    hardLimit instead, surge first: ``status.leakReplacement``, docs/runbook.md)."""
    leak_horizon_seconds: int = Field(default=43_200, ge=60, le=604_800)
    """A leak is suspected when the RSS slope (over ``leakWindowSeconds``) would take memory from its current
    use to ``resources.hardLimit`` within this many seconds, and the slope is above the noise floor (64 KiB/s,
    3.75 MiB/min). Default 12 h: a leak that would kill the worker within an afternoon is flagged, as is
    400 MB/min with up to 268 GiB of headroom; a steady worker's noise is not. See docs/runbook.md."""
    leak_slope_bytes_per_second: int | None = Field(default=None, ge=1)
    """Deprecated: use ``leakHorizonSeconds``. Where set, an RSS growth above this many bytes/s is also
    flagged, whatever the time to the hard limit (the old fixed threshold)."""
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


class SloTarget(_Model):
    """Latency objectives of one priority class (DistServe's two: Zhong et al., OSDI 2024), and the share of
    requests that must meet each."""

    ttft_seconds: float = Field(default=3.0, gt=0, le=3600)
    """Time to first token objective (arrival to first token), seconds. Measured from the worker's
    ``moeguard_time_to_first_token_seconds`` histogram; exact when it is one of its bucket bounds
    (``contract.TTFT_BUCKETS``), else interpolated within its bucket."""
    tpot_seconds: float = Field(default=0.25, gt=0, le=60)
    """Time per output token objective (after the first), seconds. Measured from the worker's
    ``moeguard_request_time_per_output_token_seconds`` histogram (``contract.TPOT_BUCKETS``)."""
    attainment: float = Field(default=0.9, gt=0, le=1)
    """Share of the window's answered requests that must meet each objective (0.9: 90 %)."""


class BatchSloTarget(SloTarget):
    """Latency objectives of the ``batch`` priority class: looser defaults than interactive's."""

    ttft_seconds: float = Field(default=30.0, gt=0, le=3600)
    """Time to first token objective (arrival to first token), seconds (``contract.TTFT_BUCKETS``)."""
    tpot_seconds: float = Field(default=1.0, gt=0, le=60)
    """Time per output token objective (after the first), seconds (``contract.TPOT_BUCKETS``)."""


SLO_RULES = (
    ("self.batch.ttftSeconds >= self.interactive.ttftSeconds",
     "slo.batch.ttftSeconds must be >= slo.interactive.ttftSeconds (batch requests wait behind interactive ones)",
     ".batch.ttftSeconds"),
    ("self.batch.tpotSeconds >= self.interactive.tpotSeconds",
     "slo.batch.tpotSeconds must be >= slo.interactive.tpotSeconds (batch requests wait behind interactive ones)",
     ".batch.tpotSeconds"),
)


class SloSpec(_Model):
    """Service-level objectives per priority class (the worker's ``X-Priority`` classes: ``interactive``,
    ``batch``). ``status.observed.slo`` shows the attainment measured over ``control.windowSeconds``. With the
    operator's ``--policy predictive``, overload mode (Auto) turns on while the interactive attainment of either
    objective is below its ``attainment``; with ``--policy threshold`` they are reported only."""

    model_config = ConfigDict(json_schema_extra=_cel(*SLO_RULES))

    interactive: SloTarget = Field(default_factory=SloTarget)
    """Objectives of interactive requests (the default class)."""
    batch: BatchSloTarget = Field(default_factory=BatchSloTarget)
    """Objectives of batch requests."""
    min_requests: int = Field(default=10, ge=1, le=1_000_000)
    """Answered requests a class needs in the window before its attainment can turn overload mode on (fewer:
    reported, not acted on)."""

    @model_validator(mode="after")
    def _batch_not_tighter(self) -> SloSpec:
        for name in ("ttft_seconds", "tpot_seconds"):
            if getattr(self.batch, name) < getattr(self.interactive, name):
                camel = to_camel(name)
                raise ValueError(f"slo.batch.{camel} must be >= slo.interactive.{camel} (batch requests wait "
                                 "behind interactive ones)")
        return self

    def target(self, priority: str) -> SloTarget:
        """The objectives of ``priority`` (``interactive`` or ``batch``).

        Raises:
            KeyError: another class.
        """
        return {"interactive": self.interactive, "batch": self.batch}[priority]


class AutoscalingSpec(_Model):
    """Replica autoscaling by the operator (``autoscale.decide``): the count of the worker Deployment's (or
    LeaderWorkerSet's) replicas is set from the interactive class's SLO attainment (``spec.slo``) and the
    requests waiting per replica, within ``minReplicas`` and ``maxReplicas``, and never up when the memory model
    says a new replica would not fit. The decision lives in ``status.autoscaling`` and in the workload's replica
    count; the spec is never written (a GitOps tool that owns this resource sees no drift), and
    ``spec.replicas`` is then only the starting count (clamped to the bounds) before the first decision.

    The stabilization windows follow the Kubernetes HorizontalPodAutoscaler's ``behavior``
    (``scaleUp``/``scaleDown.stabilizationWindowSeconds``, kubernetes.io "Horizontal Pod Autoscaling",
    "Stabilization window"): a step is taken only once every fully visible look of the whole window recommended
    it; moeguard moves at most one replica per step, and a step, or a look that is not fully visible, restarts
    both windows. While a leak replacement is in progress (``status.leakReplacement``) the count holds and no
    replica count is written (its surge is one replica on top of this count)."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("self.minReplicas <= self.maxReplicas", "autoscaling.minReplicas must be <= autoscaling.maxReplicas",
         ".minReplicas"),
    ))

    min_replicas: int = Field(default=1, ge=1, le=1024)
    """Fewest replicas the autoscaler keeps (at least 1: scale to zero stays ``spec.replicas: 0`` without
    autoscaling)."""
    max_replicas: int = Field(ge=1, le=1024)
    """Most replicas the autoscaler sets (required, as the HPA's ``maxReplicas``)."""
    scale_up_stabilization_seconds: int = Field(default=30, ge=0, le=3600)
    """Seconds every look must recommend a scale-up before one replica is added (HPA ``scaleUp``'s window is 0
    by default; moeguard waits a little, as a new replica costs a model load)."""
    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=86_400)
    """Seconds every look must recommend a scale-down before one replica is removed (HPA ``scaleDown``'s
    default, 300)."""
    queue_requests_per_replica: float = Field(default=8.0, gt=0, le=1_000_000)
    """Requests waiting per replica above which a replica is added, requests: each pod's window maximum of
    ``moeguard_queue_requests`` (and of the per-step queue histogram), summed over the pods and divided by the
    replicas. A replica is removed only while the same sum spread over one replica fewer stays at or below it
    (the HPA's proportional rule: ``ceil(replicas x queue / target) <= replicas - 1``)."""

    @model_validator(mode="after")
    def _min_below_max(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.minReplicas must be <= autoscaling.maxReplicas")
        return self


class UcxSpec(_Model):
    """UCX settings of the worker. UCX's memory-invalidation queue is unbounded by default and grows host
    RSS outside the Python heap (vLLM/NIXL reports); both fixes are on by default."""

    mode: Literal["none", "rcache", "passthrough"] | None = None
    """``none``: ``UCX_MEM_MMAP_HOOK_MODE=none`` and ``UCX_RCACHE_MAX_UNRELEASED``; ``rcache``: only the
    bounded ``UCX_RCACHE_MAX_UNRELEASED`` (vLLM's later choice); ``passthrough``: UCX's own defaults (for UCX
    versions with the root cause fixed). Unset: ``rcache`` when ``resources.gpuResourceName`` is an AMD GPU
    (``amd.com/…``), where ``UCX_MEM_MMAP_HOOK_MODE=none`` breaks NIXL's ROCm path (vLLM PR #32570, NIXL PR
    #1210), else ``none``."""
    rcache_max_unreleased: int = Field(default=contract.UCX_SAFE_RCACHE_MAX_UNRELEASED, ge=1, le=1_000_000_000)
    """``UCX_RCACHE_MAX_UNRELEASED``: regions held in the rcache invalidation queue."""
    extra_env: dict[str, str] = Field(default_factory=dict, max_length=64, json_schema_extra=_cel(
        ("self.all(k, k.startsWith('UCX_'))", "ucx.extraEnv keys must start with UCX_", ""),
        # no messageExpression naming the key: a map key has no maxLength, and the API server estimates the cost
        # of joining unbounded keys far above its budget
        (f"self.all(k, k.matches('{ENV_VAR_NAME}'))", f"ucx.extraEnv keys must be {ENV_NAME_WORDS}", ""),
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
        bad = sorted(k for k in env if not re.fullmatch(ENV_VAR_NAME, k))
        if bad:
            raise ValueError(f"ucx.extraEnv: {', '.join(bad)} is not a variable name (keys must be {ENV_NAME_WORDS})")
        managed = sorted(k for k in env if k in contract.UCX_MANAGED_VARS)
        if managed:
            raise ValueError(f"ucx.extraEnv must not set {', '.join(managed)} (use ucx.mode and ucx.rcacheMaxUnreleased)")
        return env


class ParallelismSpec(_Model):
    """Expert parallelism (EP): one replica's experts spread over ranks, and its ranks over pods.

    ``podsPerReplica: 1`` keeps a Deployment of single-pod replicas. Above 1, each replica is a
    LeaderWorkerSet group (LWS, a Kubernetes SIG project, ``leaderworkerset.x-k8s.io/v1``) of that many pods:
    the leader pod (LWS worker index 0) serves HTTP, runs attention, the router, the scheduler and the
    budgets; every rank holds ``numExperts / expertParallelSize`` experts, and each MoE layer dispatches the
    routed tokens to the ranks that own their experts (``torch.distributed``: gloo on CPUs, NCCL on GPUs).
    """

    model_config = ConfigDict(json_schema_extra=_cel(
        ("self.expertParallelSize % self.podsPerReplica == 0",
         "parallelism.expertParallelSize must be divisible by parallelism.podsPerReplica "
         "(every pod holds the same number of ranks)", ".expertParallelSize"),
    ))

    expert_parallel_size: int = Field(default=1, ge=1, le=1024)
    """Ranks per replica (EP size). The model's expert count must be divisible by it; each rank holds
    ``numExperts / expertParallelSize`` experts."""
    pods_per_replica: int = Field(default=1, ge=1, le=256)
    """Pods one replica spans (the LeaderWorkerSet group size). Ranks per pod = ``expertParallelSize /
    podsPerReplica``; with GPUs it must equal ``resources.gpus`` (one rank per GPU). A pod's main process
    runs its first rank and starts the others as child processes."""

    @model_validator(mode="after")
    def _ranks_per_pod(self) -> ParallelismSpec:
        if self.expert_parallel_size % self.pods_per_replica:
            raise ValueError(f"parallelism.expertParallelSize ({self.expert_parallel_size}) must be divisible by "
                             f"parallelism.podsPerReplica ({self.pods_per_replica}) (every pod holds the same number "
                             "of ranks)")
        return self

    @property
    def ranks_per_pod(self) -> int:
        return self.expert_parallel_size // self.pods_per_replica

    @property
    def multi_node(self) -> bool:
        """Whether a replica spans several pods (a LeaderWorkerSet, not a Deployment)."""
        return self.pods_per_replica > 1


QUALIFIED_NAME = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
"""A label or annotation key (Kubernetes' qualified name: an optional DNS-subdomain prefix and a name)."""
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
"""A label value (at most 63 characters, checked separately)."""
ALLOWED_VOLUME_SOURCES = ("persistentVolumeClaim", "configMap", "emptyDir", "image", "csi", "secret")
"""Volume types a model server needs. ``secret`` passes the schema, but the operator serves it only where
its ``--allow-secrets`` setting (chart value ``operator.allowSecrets``) allows it (a spec cannot grant itself Secrets); hostPath, nfs,
iscsi, … are refused at apply time: they would give whoever may create a MoEInferenceService host
or storage access that they may not have on pods."""
MOUNTABLE_RESERVED_VOLUMES = ("tmp",)
"""The operator's volumes that ``template.volumeMounts`` may mount again (it is in every pod)."""
RESERVED_VOLUMES = (*MOUNTABLE_RESERVED_VOLUMES, contract.MODEL_VOLUME)
"""Volumes the operator adds to worker pods (``moeguard-model``: ``spec.model.source``)."""
RESERVED_MOUNT_PATHS = ("/tmp", contract.MODEL_MOUNT_PATH)
"""Paths where the operator mounts its own volumes (``/moeguard/model``: ``spec.model.source``, always reserved)."""


def _core(name: str, *rules: CelRule, message_expressions: dict[str, str] | None = None,
          max_lengths: dict[str, int] | None = None) -> dict[str, Any]:
    """JSON Schema asking crdgen for the API server's core/v1 ``name`` schema, plus CEL ``rules``
    (``messageExpression`` per rule index where given) and ``maxLength`` bounds on top-level string
    properties (the API server's own limits; they also keep the rules' estimated CEL cost in budget)."""
    extra: dict[str, Any] = {core_schemas.MARKER: name}
    if max_lengths:
        extra[core_schemas.MAX_LENGTHS] = max_lengths
    if rules:
        extra.update(_cel(*rules))
        for index, expression in (message_expressions or {}).items():
            extra["x-kubernetes-validations"][int(index)]["messageExpression"] = expression
    return extra


_TOLERATION_RULES = (
    ("!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
     "a toleration with operator Exists must not have a value", ".value"),
    ("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
     "tolerationSeconds is only for effect NoExecute", ".tolerationSeconds"),
    ("(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
     "a toleration without a key must have operator Exists", ".operator"),
    (f"!has(self.key) || self.key == '' || self.key.matches('{QUALIFIED_NAME}')",
     "a toleration key must be a qualified name (an optional DNS prefix/ and a name)", ".key"),
)
_VOLUME_RULES = (
    (" || ".join(f"has(self.{k})" for k in ALLOWED_VOLUME_SOURCES),
     f"template.volumes: only {', '.join(ALLOWED_VOLUME_SOURCES)} volumes are allowed", ""),
    (" && ".join(f"self.name != '{v}'" for v in RESERVED_VOLUMES),
     f"template.volumes: the names {', '.join(RESERVED_VOLUMES)} are the operator's", ".name"),
    ("self.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$') && size(self.name) <= 63",
     "template.volumes: a volume name must be a DNS label (lower case, digits, '-', at most 63)", ".name"),
)
_MOUNT_RULES = (
    (" && ".join(f"self.mountPath != '{p}' && !self.mountPath.startsWith('{p}/')" for p in RESERVED_MOUNT_PATHS),
     f"template.volumeMounts: {' and '.join(RESERVED_MOUNT_PATHS)} are where the operator mounts its own volumes",
     ".mountPath"),
    ("self.mountPath.startsWith('/') && !self.mountPath.contains(':')",
     "template.volumeMounts: mountPath must be an absolute path without ':'", ".mountPath"),
)
_ENV_RULES = (
    (f"self.name.matches('{ENV_VAR_NAME}')", f"template.extraEnv: a variable name is {ENV_NAME_WORDS}", ".name",
     f"'template.extraEnv: ' + self.name + ' is not a variable name ({ENV_NAME_WORDS})'"),
    ("!self.name.startsWith('MOEGUARD_') && !self.name.startsWith('UCX_')",
     "template.extraEnv must not set MOEGUARD_* or UCX_* (use spec fields and ucx.extraEnv)", ".name"),
    ("!has(self.value) || !has(self.valueFrom)", "template.extraEnv: set value or valueFrom, not both", ""),
)


_MOUNTED = ("m.name in " + repr(list(MOUNTABLE_RESERVED_VOLUMES)) +
            " || (has(self.volumes) && self.volumes.exists(v, v.name == m.name))")
"""CEL: mount ``m`` names a volume of ``template.volumes`` (or one of the operator's it may mount again)."""


class PodTemplateSpec(_Model):
    """Extras for the worker pods. Tolerations, affinity, volumes, volume mounts and env are validated at
    apply time by the API server's own core/v1 schemas (embedded in the CRD), plus the rules a schema
    cannot state; every name is checked against the children the operator creates."""

    model_config = ConfigDict(json_schema_extra=_cel(
        (f"!has(self.volumeMounts) || self.volumeMounts.all(m, {_MOUNTED})",
         # No messageExpression naming the item (template.volumeMounts[i].name): every form tried (transformList,
         # filter + indexOf) is estimated above the API server's CEL cost budget by more than 100x (issue 29, item 5;
         # Kubernetes 1.34). The operator's own check (PodTemplateSpec._names) names the item.
         "template.volumeMounts must name a volume of template.volumes", ".volumeMounts"),
    ))

    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(default_factory=dict, max_length=64, json_schema_extra=_cel(
        (f"self.all(k, k.matches('{QUALIFIED_NAME}') && size(k) <= 316)",
         "template.nodeSelector keys must be label keys (an optional DNS prefix/ and a name)", ""),
        (f"self.all(k, self[k].matches('{LABEL_VALUE}') && size(self[k]) <= 63)",
         "template.nodeSelector values must be label values (at most 63 of letters, digits, '-', '_', '.')", "")))
    """Node labels the workers must run on."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list, max_length=64, json_schema_extra={
        "items": _core("Toleration", *_TOLERATION_RULES, max_lengths={"key": 316, "value": 63})})
    """Tolerations of the worker pods (core/v1 Toleration)."""
    affinity: dict[str, Any] | None = Field(default=None, json_schema_extra=_core("Affinity"))
    """core/v1 Affinity of the worker pods."""
    priority_class_name: str | None = Field(default=None, max_length=253)
    """PriorityClass of the worker pods."""
    extra_env: list[dict[str, Any]] = Field(default_factory=list, max_length=128, json_schema_extra={
        "items": _core("EnvVar", *_ENV_RULES, max_lengths={"name": 256, "value": 32_768}),
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    """More environment variables for the worker container (core/v1 EnvVar; a ``valueFrom.secretKeyRef``
    is served only where the operator allows Secrets)."""
    volumes: list[dict[str, Any]] = Field(default_factory=list, max_length=64, json_schema_extra={
        "items": _core("Volume", *_VOLUME_RULES, message_expressions={
            "0": "'template.volumes: volume ' + self.name + ' is of a type that is not allowed; allowed: "
                 + ", ".join(ALLOWED_VOLUME_SOURCES) + "'"}, max_lengths={"name": 63}),
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    """core/v1 Volumes added to the worker pods: persistentVolumeClaim, configMap, emptyDir, image or csi
    (secret only where the operator allows it)."""
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list, max_length=64, json_schema_extra={
        "items": _core("VolumeMount", *_MOUNT_RULES, max_lengths={"name": 63, "mountPath": 4096}),
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["mountPath"]})
    """Mounts of those volumes in the worker container (core/v1 VolumeMount; read-only unless
    ``readOnly: false``)."""
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64, json_schema_extra=_cel(
        (f"self.all(k, k.matches('{QUALIFIED_NAME}') && size(k) <= 316)",
         "template.annotations keys must be qualified names (an optional DNS prefix/ and a name)", "")))
    """Annotations of the worker pods."""

    @model_validator(mode="after")
    def _names(self) -> PodTemplateSpec:
        env = [str(e.get("name", "")) for e in self.extra_env]
        bad = sorted(n for n in env if n.startswith(("MOEGUARD_", "UCX_")))
        if bad:
            raise ValueError(f"template.extraEnv must not set MOEGUARD_* or UCX_* (got {', '.join(bad)})")
        dups = sorted({n for n in env if env.count(n) > 1})
        if dups:
            raise ValueError(f"template.extraEnv names must be unique (repeated: {', '.join(dups)})")
        bad = [n for n in env if not re.fullmatch(ENV_VAR_NAME, n)]
        if bad:
            raise ValueError(f"template.extraEnv: {', '.join(bad)} is not a variable name ({ENV_NAME_WORDS})")
        volumes = {str(v.get("name")) for v in self.volumes} | set(MOUNTABLE_RESERVED_VOLUMES)
        missing = [f"template.volumeMounts[{i}].name: {m.get('name')}" for i, m in enumerate(self.volume_mounts)
                   if m.get("name") not in volumes]
        if missing:
            raise ValueError(f"{'; '.join(missing)} names no volume of template.volumes")
        return self


NAME_RULES = (
    ("self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 63",
     "metadata.name must be a DNS-1035 label (lower case letters, digits and '-', starting with a letter, at "
     "most 63): it names the worker Service and is the value of the children's app.kubernetes.io/instance label"),
)
"""CEL rules on the whole object: the name must fit every child's name and label rules (a name such as
``9-moe`` or ``x08.moe`` is a valid custom-resource name but not a valid Service name)."""


class PrefillSpec(_Model):
    """The prefill role of disaggregated prefill/decode (issue 33; KServe LLMInferenceService's
    ``spec.prefill``, llm-d's prefill pods): separate pods run the prompts and hand each prompt's KV cache over
    UCX (NIXL) to the service's own pods, which then run the decode role and stay what clients call (the
    service's Service). Each field left unset takes the service's own."""

    replicas: int = Field(default=1, ge=1, le=1024)
    """Prefill pods (the service's ``replicas`` and ``autoscaling`` count the decode pods)."""
    resources: ResourcesSpec | None = None
    """Each prefill pod's GPUs, CPU and memory limits (unset: the service's ``resources``)."""
    batching: BatchingSpec | None = None
    """The prefill pods' budgets (unset: the service's ``batching``); their decode budgets go unused."""
    ucx: UcxSpec | None = None
    """The prefill pods' UCX settings (unset: the service's ``ucx``)."""
    template: PodTemplateSpec | None = None
    """The prefill pods' template extras (unset: the service's ``template``)."""
    kv_transfer_timeout_seconds: float = Field(default=5.0, gt=0, le=600)
    """Seconds a decode pod waits for one prompt's KV read before it answers that request 503."""
    kv_lease_seconds: float = Field(default=30.0, gt=0, le=3600)
    """Seconds a prefill pod holds a prompt's KV that no decode pod read, and the bound of one prefill call."""


PREFILL_RULES = (
    ("!has(self.prefill) || !has(self.parallelism) || self.parallelism.podsPerReplica == 1",
     "prefill needs parallelism.podsPerReplica 1: a multi-node replica's KV is not handed off", ".prefill"),
)
"""CEL rules of ``prefill`` across the spec."""


PARALLELISM_RULES = (
    ("!has(self.parallelism) || !has(self.model) || !has(self.model.overrides) "
     "|| !has(self.model.overrides.numExperts) "
     "|| self.model.overrides.numExperts % self.parallelism.expertParallelSize == 0",
     "model.overrides.numExperts must be divisible by parallelism.expertParallelSize (each rank holds the "
     "same number of experts)", ".parallelism.expertParallelSize"),
    ("!has(self.parallelism) || self.parallelism.expertParallelSize == 1 || !has(self.resources) "
     "|| self.resources.gpus == 0 "
     "|| self.resources.gpus * self.parallelism.podsPerReplica == self.parallelism.expertParallelSize",
     "resources.gpus must equal parallelism.expertParallelSize / parallelism.podsPerReplica (one rank per GPU), "
     "or be 0 (CPU ranks), when parallelism.expertParallelSize is above 1", ".parallelism.expertParallelSize"),
)
"""CEL rules across ``parallelism``, ``model`` and ``resources`` (the API server applies defaults first, so an
unset ``resources.gpus`` is its default, 1)."""


class MoEInferenceServiceSpec(_Model):
    """Desired state of a MoEInferenceService."""

    model_config = ConfigDict(json_schema_extra=_cel(*PARALLELISM_RULES, *PREFILL_RULES))

    model: ModelSpec = Field(default_factory=ModelSpec)
    """Model to serve."""
    replicas: int = Field(default=1, ge=0, le=1024)
    """Number of replicas (the scale subresource: ``kubectl scale`` and HPAs work): worker pods, or with
    ``parallelism.podsPerReplica`` above 1, LeaderWorkerSet groups of that many pods. With ``autoscaling`` set,
    only the starting count (clamped to its bounds): the operator decides the count then
    (``status.autoscaling.desiredReplicas``)."""
    image: str = Field(default=DEFAULT_IMAGE, min_length=1, max_length=512, json_schema_extra=_cel(
        (f"self.matches(r'{IMAGE_REFERENCE}')", f"image must be {IMAGE_WORDS}", "",
         f"'image: ' + self + ' is not an image reference ({IMAGE_WORDS})'")))
    """Worker container image: a reference the container runtimes accept (``[registry[:port]/]path[:tag][@digest]``,
    checked at apply time)."""
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
    slo: SloSpec = Field(default_factory=SloSpec)
    """Latency objectives (TTFT, TPOT) per priority class, and their attainment targets."""
    ucx: UcxSpec = Field(default_factory=UcxSpec)
    """UCX environment of the worker."""
    template: PodTemplateSpec = Field(default_factory=PodTemplateSpec)
    """Pod template extras: node selector, tolerations, affinity, priority class, env, volumes."""
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    """Expert parallelism across ranks and pods (multi-node replicas on LeaderWorkerSet)."""
    autoscaling: AutoscalingSpec | None = None
    """Replica autoscaling from SLO attainment and queue depth (absent: ``replicas`` and the scale subresource
    decide, as without it)."""
    prefill: PrefillSpec | None = None
    """Disaggregated prefill/decode: prefill pods of their own (absent: every pod prefills and decodes, one
    role)."""

    @model_validator(mode="after")
    def _parallelism_fits(self) -> MoEInferenceServiceSpec:
        par, gpus = self.parallelism, self.resources.gpus
        experts = self.model.overrides.num_experts
        if experts is not None and experts % par.expert_parallel_size:
            raise ValueError(f"model.overrides.numExperts ({experts}) must be divisible by "
                             f"parallelism.expertParallelSize ({par.expert_parallel_size}) (each rank holds the "
                             "same number of experts)")
        if self.prefill is not None and par.multi_node:
            raise ValueError("prefill needs parallelism.podsPerReplica 1: a multi-node replica's KV is not handed off")
        if par.expert_parallel_size > 1 and gpus and gpus != par.ranks_per_pod:
            raise ValueError(f"resources.gpus ({gpus}) must equal parallelism.expertParallelSize / "
                             f"parallelism.podsPerReplica ({par.ranks_per_pod}) (one rank per GPU), or be 0 "
                             "(CPU ranks)")
        return self

    @field_validator("image")
    @classmethod
    def _reference(cls, v: str) -> str:
        if not re.fullmatch(IMAGE_REFERENCE, v):
            raise ValueError(f"image: {v} is not an image reference ({IMAGE_WORDS})")
        return v


# --- status ---------------------------------------------------------------------

class Condition(_Model):
    """A Kubernetes condition (metav1.Condition)."""

    type: str
    """Condition type: Ready, Reconciling, Stalled, MetricsAvailable, BudgetTightened, BudgetsApplied, ..."""
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


class SloAttainment(_Model):
    """One priority class's SLO attainment over the window: the share of its answered requests that met each
    objective (from the worker histograms, summed over the Running pods). A missing value is null, never 1."""

    priority: str
    """``interactive`` or ``batch``."""
    requests: float | None = None
    """Requests that got a first token in the window (the TTFT histogram's count; ``increase`` extrapolates)."""
    ttft_attainment: float | None = None
    """Share of them whose TTFT met ``spec.slo.<class>.ttftSeconds`` (null: none in the window)."""
    finished: float | None = None
    """Requests that finished with an answer in the window (the TPOT histogram's count)."""
    tpot_attainment: float | None = None
    """Share of them whose TPOT met ``spec.slo.<class>.tpotSeconds`` (null: none in the window)."""
    target: float
    """``spec.slo.<class>.attainment``."""
    met: bool | None = None
    """Both attainments at or above the target; null while either is unknown or a count is below
    ``spec.slo.minRequests``."""


class PodMemoryPrediction(_Model):
    """One pod's predicted memory peak at the budgets in effect (the memory model, ``moeguard_core.memory_model``,
    at the pod's observed skew and context mix), against the soft limit; bytes, rounded to whole MiB."""

    pod: str
    """The pod."""
    idle_footprint_bytes: int
    """Its idle footprint (``moeguard_memory_idle_footprint_bytes``), bytes: where its headroom is measured from."""
    predicted_peak_bytes: int
    """Idle footprint plus the predicted load (KV caches and the worst step), bytes."""
    headroom_bytes: int
    """``resources.softLimit`` minus the predicted peak, bytes (negative: it does not fit)."""


class Observed(_Model):
    """What the control loop last saw. A missing value is absent (null), never 0."""

    time: datetime | None = None
    """When the loop last saw these values change: a look that sees the same values keeps the earlier time, so
    an idle service's status is not rewritten every tick (see ``tick.stable``)."""
    skew_ratio: float | None = None
    """Highest expert skew ratio among the service's pods over the window."""
    memory_ratio: float | None = None
    """Highest memory in use / hardLimit among the pods (cgroup usage, or RSS where there is no cgroup)."""
    memory_percent: int | None = None
    """``memoryRatio`` in percent, for ``kubectl get``."""
    rss_slope_bytes_per_second: float | None = None
    """Highest RSS growth among the pods (PromQL ``deriv`` over the leak window), bytes/s."""
    leak_kinds: list[str] = Field(default_factory=list)
    """Leak kinds the pods themselves flag (``native``, ``python_heap``: ``moeguard_memory_leak_suspected``)."""
    seconds_to_hard_limit: float | None = None
    """Projected seconds until the fastest-growing pod reaches hardLimit at its current slope (null: no growth)."""
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
    crash_looping_pods: list[str] = Field(default_factory=list)
    """Worker pods in the kubelet's crash-loop back-off (``CrashLoopBackOff``, or restarted after one and
    not ready since); budgets do not loosen while any is."""
    slo: list[SloAttainment] = Field(default_factory=list)
    """SLO attainment per priority class over ``control.windowSeconds`` (empty while any reporting pod lacks a
    full window)."""
    predicted_memory: list[PodMemoryPrediction] = Field(default_factory=list)
    """Per pod, the predicted memory peak at the budgets in effect (``--policy predictive`` only)."""
    replacement_ready_seconds: float | None = None
    """Seconds the newest worker pod took from its ``creationTimestamp`` to its ``Ready`` condition's
    ``lastTransitionTime`` (measured from the service's own pods, not configured); the leak replacement's lead
    time is built on it (``--policy predictive``, ``leakAction: Restart``, Deployment workers only). Null: not
    measured yet (the replacement assumes 300 s)."""


class ControlStatus(_Model):
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


class LeakReplacementStatus(_Model):
    """The pod the leak replacement is replacing now (``--policy predictive``, ``leakAction: Restart``, Deployment
    workers), kept in status so an operator restart mid-way finishes or undoes it (one at a time per service)."""

    pod: str
    """The leaking pod being replaced."""
    action: Literal["Surge", "Drain"]
    """``Surge``: a pod is added first (Deployment replicas + 1 on top of ``spec.replicas``, or of
    ``status.autoscaling.desiredReplicas`` with ``spec.autoscaling``; the leaking pod marked with
    ``controller.kubernetes.io/pod-deletion-cost: -1000``), then replicas go back and the ReplicaSet removes the
    leaking pod; ``Drain``: the leaking pod is deleted at once (graceful), no surge possible or in time."""
    phase: Literal["Surging", "Draining"]
    """``Surging``: waiting for the surge pod to be Ready (the Deployment holds that count + 1);
    ``Draining``: waiting for the leaking pod to be gone."""
    started_at: datetime
    """When the replacement started."""
    hard_limit_at: datetime | None = None
    """When the leaking pod is projected to reach ``resources.hardLimit`` (its RSS slope, updated at each look
    that measures it)."""
    replacement_pod: str | None = None
    """The surge pod, once it exists."""
    reason: str = ""
    """Why this action (the projection and lead, or why no surge)."""


FindingKind = Literal["BurstOverlap", "RoutingSkew", "LongContextPileUp", "NativeMemoryLeak", "PythonHeapLeak",
                      "UCXRiskyConfig", "AllocatorFragmentation"]
FINDING_KINDS: tuple[str, ...] = ("BurstOverlap", "RoutingSkew", "LongContextPileUp", "NativeMemoryLeak",
                                  "PythonHeapLeak", "UCXRiskyConfig", "AllocatorFragmentation")
"""The incident kinds the diagnosis names (``docs/runbook.md`` has a section per kind)."""


class Evidence(_Model):
    """One signal value behind a finding."""

    signal: str
    """What was measured, in words the runbook uses (``prefill batches in flight``, ``top expert share``)."""
    value: float
    """Its value (units in ``unit``)."""
    unit: str = ""
    """``bytes``, ``bytes/s``, ``ratio``, ``requests``, ``batches`` ... (empty: a plain number)."""
    metric: str = ""
    """The worker metric or PromQL it comes from, for people who want to look it up."""
    pod: str | None = None
    """The pod it was seen on (None: the service as a whole)."""
    detail: str = ""
    """More context (the layer and expert, the UCX libraries and settings)."""


class Finding(_Model):
    """One active incident finding: what, since when, on which evidence, and what to do."""

    kind: FindingKind
    """The incident kind (see ``docs/runbook.md``)."""
    since: datetime
    """When the finding started (its rule first held)."""
    last_seen: datetime
    """The last look in which its rule held."""
    message: str
    """One sentence naming the cause, with the decisive values."""
    evidence: list[Evidence] = Field(default_factory=list)
    """The signal values behind it."""
    remedy: str
    """What to change, in words."""
    patch: str | None = None
    """The remedy as a JSON merge patch of the MoEInferenceService, where there is one (``kubectl patch moeis NAME
    --type merge -p '<patch>'``)."""
    pods: list[str] = Field(default_factory=list)
    """The affected pods."""


class DiagnosisStatus(_Model):
    """The diagnosis: active findings, and the signals it could not see. It never changes budgets."""

    time: datetime | None = None
    """The last look the diagnosis was made on."""
    findings: list[Finding] = Field(default_factory=list)
    """Active findings, one per kind at most."""
    missing_signals: list[str] = Field(default_factory=list)
    """Signals that were missing in the last look (Prometheus down, silent pods): no finding is made from them."""


class GroupStatus(_Model):
    """One replica of a multi-node service: a LeaderWorkerSet group."""

    index: int
    """The group's index (LeaderWorkerSet label ``leaderworkerset.sigs.k8s.io/group-index``)."""
    leader: str | None = None
    """Name of the group's leader pod (the one that serves HTTP); None while it does not exist."""
    ready_pods: int
    """Pods of the group whose Ready condition is True."""
    ready_ranks: int
    """Ranks on those pods (ready pods × ranks per pod)."""
    ranks: int
    """Ranks the group should have (``parallelism.expertParallelSize``)."""


class AutoscalingStatus(_Model):
    """The replica autoscaler's decision, signals and memory (``spec.autoscaling``), kept in status so an operator
    restart resumes it; the worker workload's replica count follows ``desiredReplicas``."""

    desired_replicas: int
    """Replicas the autoscaler decided (the workload's ``spec.replicas``; one more while a leak replacement's
    surge is ``Surging``)."""
    attainment: float | None = None
    """The interactive class's lower SLO attainment of TTFT and TPOT over ``control.windowSeconds`` (null: none
    in the window)."""
    requests: float | None = None
    """Interactive requests that got a first token in the window (attainment is judged from
    ``spec.slo.minRequests`` on)."""
    queue_requests_per_replica: float | None = None
    """Requests waiting per replica in the window (see ``spec.autoscaling.queueRequestsPerReplica``; null: not
    seen)."""
    recommendation: Literal["Up", "Down", "Hold"] = "Hold"
    """What the last look recommended."""
    reason: str = ""
    """Why the last look decided what it did (names the signal, its value and the target)."""
    scale_up_refused: str | None = None
    """Why a scale-up the signals ask for is refused (the memory model, a replica not yet ready), while it is."""
    last_scale_time: datetime | None = None
    """The last replica change by the autoscaler."""
    scale_up_since: datetime | None = None
    """Start of the current stretch of fully visible looks that all recommended a scale-up (null: none)."""
    scale_down_since: datetime | None = None
    """Start of the current stretch of fully visible looks that all recommended a scale-down (null: none)."""


class RoleStatus(_Model):
    """Observed state of one role's pods, written by the operator only: the service's own (its root status), or
    its prefill role's (``status.prefill``)."""

    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = None
    """metadata.generation of the spec last reconciled."""
    conditions: list[Condition] = Field(default_factory=list)
    """kstatus conditions (Ready, Reconciling, Stalled) and moeguard's own (MetricsAvailable,
    BudgetTightened, BudgetsApplied, Overloaded, MemoryLeakSuspected, and one per diagnosis finding typed by its
    kind)."""
    replicas: int | None = None
    """Replicas desired: worker pods, or LeaderWorkerSet groups (``parallelism.podsPerReplica`` above 1)."""
    ready_replicas: int | None = None
    """Replicas ready: worker pods, or groups whose every pod is ready."""
    groups: list[GroupStatus] | None = None
    """Per group of a multi-node service (``parallelism.podsPerReplica`` above 1), by index: its leader and
    its ranks ready. None for single-pod replicas."""
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
    control: ControlStatus | None = None
    """The control loop's bookkeeping."""
    autoscaling: AutoscalingStatus | None = None
    """The replica autoscaler (``spec.autoscaling``): its decision, signals and windows; null without it."""
    diagnosis: DiagnosisStatus | None = None
    """Incident findings (``moeguard diagnose`` reads them); written by the diagnosis, never read by the budget
    policy."""
    leak_replacement: LeakReplacementStatus | None = None
    """The leak replacement in progress (null: none)."""


class MoEInferenceServiceStatus(RoleStatus):
    """Observed state, written by the operator only. With ``spec.prefill`` the root fields are the decode pods'
    (what clients call) and ``prefill`` holds the prefill pods' own."""

    prefill: RoleStatus | None = None
    """The prefill role's status (``spec.prefill``): its pods' readiness, its budgets (its own budget
    ConfigMap), observations, leak judgement and leak replacement; the control loop runs the role as a service
    of its own (``<name>-prefill``). Null without ``spec.prefill``."""
