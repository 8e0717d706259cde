"""Worker settings, all from the environment.

Contract variables (``contract.ENV_*``, set by the operator; imported, never
redefined here) and the worker's own knobs (``MOEGUARD_*`` below, with
defaults). A malformed value stops the worker at start with a message naming
the variable.

* Initial budgets (later replaced by the budget ConfigMap): prefill, decode,
  batch requests, long requests per batch, concurrent batches, queue length
  and queue timeout (``contract.ENV_MAX_*``, ``ENV_QUEUE_TIMEOUT_SECONDS``).
* Static limits: ``ENV_MAX_CONCURRENT_REQUESTS`` (429 beyond it),
  ``ENV_LONG_REQUEST_THRESHOLD_TOKENS``, the host limits
  ``ENV_SOFT/HARD_LIMIT_BYTES`` (compared with cgroup ``memory.current`` or RSS),
  the GPU limits ``ENV_GPU_SOFT/HARD_FRACTION`` of device memory,
  ``ENV_OVERLOAD_MODE`` (Auto, On, Off), and the worker's ``MOEGUARD_SCHEDULING_POLICY``
  ``MOEGUARD_BATCH_TOKENS_WITH_INTERACTIVE`` and ``MOEGUARD_MAX_BATCH_STEP_TOKENS``
  (:class:`scheduler.PriorityPolicy`), and ``MOEGUARD_MEMORY_ADMISSION``
  (:mod:`moeguard_core.memory_admission`). Every default of a contract variable is the
  contract's (``contract.DEFAULT_*``, ``contract.BUDGET_FIELDS``): a worker started by hand
  runs with the values the operator would give it.
* Model: ``ENV_MODEL_PRESET``, ``ENV_MODEL_OVERRIDES``, ``ENV_CHECKPOINT_PATH``.
* Placement: ``ENV_DEVICE`` (``auto``: ``cuda`` when ``torch.cuda.is_available()``,
  else ``cpu``) and ``ENV_DTYPE`` (``auto``: bfloat16 on CUDA, float32 on CPU).
  ``Settings.device``/``Settings.dtype`` hold the resolved names, never ``auto``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from moeguard_core import contract
from moeguard_core.contract import Budgets
from moeguard_core.presets import ModelArgs
from moeguard_runtime.engine.scheduler import SCHEDULING_POLICIES, PriorityPolicy, QueueLimits
from moeguard_runtime.env_values import (
    ConfigError as ConfigError,  # re-exported: callers catch config.ConfigError
)
from moeguard_runtime.env_values import env_float as _float
from moeguard_runtime.env_values import env_int as _int
from moeguard_runtime.faults import Faults, load_faults
from moeguard_runtime.memory.allocation import DEFAULT_UNRECOVERED_S
from moeguard_runtime.model import stream_kernel
from moeguard_runtime.model.moe import (
    DEFAULT_EXPERT_CHUNK_TOKENS,
    MATMUL_BACKENDS,
    MOE_DISPATCHES,
    PACKED_BACKEND,
    MoeDispatch,
    can_pack,
)

ENV_SEED = "MOEGUARD_SEED"
ENV_TORCH_THREADS = "MOEGUARD_TORCH_THREADS"
ENV_HOST = "MOEGUARD_HOST"
ENV_EXPERT_CHUNK_TOKENS = "MOEGUARD_EXPERT_CHUNK_TOKENS"
ENV_CAPACITY_FACTOR = "MOEGUARD_CAPACITY_FACTOR"
"""0 or unset: dropless (default); > 0: DeepSpeed capacity, overflow slots dropped and counted."""
ENV_MATMUL_BACKEND = "MOEGUARD_MATMUL_BACKEND"
"""Kernel of the expert matmuls: ``auto`` (default: the fastest by measurement at start-up, per row
bucket, or ``onednn_packed`` in every bucket, the experts' weights then packed once into oneDNN's layout in
place of the dense ones: :mod:`moeguard_runtime.model.kernel_select`), ``onednn`` (oneDNN for CPU
float32/bfloat16), ``torch`` (``F.linear``), ``torch_t`` (the same product transposed, ``(w @ x.T).T``: the
BLAS's tall-skinny path at few rows; CPU), ``stream`` (moeguard's own few-row kernel, a C++ library built with
the machine's compiler: :mod:`moeguard_runtime.model.stream_kernel`; CPU float32/bfloat16 with AVX2, else a
ConfigError saying why not) or ``onednn_packed`` (packed weights without measuring; CPU
float32, or bfloat16 where oneDNN has it, and not ``MOEGUARD_MOE_DISPATCH=device``: else a ConfigError)."""
MatmulSetting = Literal["auto", "onednn", "torch", "torch_t", "stream", "onednn_packed"]
MATMUL_SETTINGS: tuple[MatmulSetting, ...] = ("auto", *MATMUL_BACKENDS)
ENV_MOE_DISPATCH = "MOEGUARD_MOE_DISPATCH"
"""How the MoE layers group their slots: ``auto`` (default), ``host`` or ``device`` (``moe.MoeDispatch``)."""
ENV_MAX_QUEUE_TOKENS = "MOEGUARD_MAX_QUEUE_TOKENS"
ENV_SOFT_SHRINK_FACTOR = "MOEGUARD_SOFT_LIMIT_SHRINK_FACTOR"
ENV_LOG_INTERVAL_S = "MOEGUARD_LOG_INTERVAL_SECONDS"
ENV_OVERLOAD_MAX_CONTEXT_TOKENS = "MOEGUARD_OVERLOAD_MAX_CONTEXT_TOKENS"
"""Context cap while overload is on, when the budget document sets none (default: half the model's)."""
ENV_MAX_BODY_BYTES = "MOEGUARD_MAX_BODY_BYTES"
"""Largest request body accepted (default 1 MiB); beyond it, HTTP 413."""
ENV_DRAIN_SECONDS = "MOEGUARD_DRAIN_SECONDS"
"""On SIGTERM, how long accepted requests may finish before the rest are cut with an error (default 25 s:
under Kubernetes' default terminationGracePeriodSeconds of 30, after which the kubelet sends SIGKILL)."""
DEFAULT_DRAIN_SECONDS = 25.0
ENV_SHUTDOWN_DELAY_SECONDS = "MOEGUARD_SHUTDOWN_DELAY_SECONDS"
"""On SIGTERM, how long the worker keeps answering (503 ``shutting_down`` with Retry-After, ``/readyz`` 503) even
with nothing in flight, before it closes its socket (default 5 s): Kubernetes removes a terminating pod from the
Service's endpoints while it sends SIGTERM, and proxies learn of it a moment later, so a worker that exits at once
is still sent requests, refused without Retry-After (found on the real node: 2 to 5 of ~1,000 requests in a
rollout; the gap a ``preStop`` sleep covers, Kubernetes docs "Termination of Pods")."""
DEFAULT_SHUTDOWN_DELAY_SECONDS = 5.0
ENV_UNRECOVERED_OOM_SECONDS = "MOEGUARD_UNRECOVERED_OOM_SECONDS"
"""Seconds of failed allocations with no engine step running after which ``/healthz`` answers 503
(default 60; :mod:`moeguard_runtime.memory.allocation`)."""
ENV_SCHEDULING_POLICY = "MOEGUARD_SCHEDULING_POLICY"
"""``priority`` (default: interactive first in every mode) or ``fcfs`` (arrival order), as vLLM's
``--scheduling-policy`` (:class:`scheduler.PriorityPolicy`)."""
ENV_BATCH_TOKENS_WITH_INTERACTIVE = "MOEGUARD_BATCH_TOKENS_WITH_INTERACTIVE"
"""Tokens of batch requests one step may carry while an interactive request is in the worker (default 0:
none; batch runs in the steps interactive work leaves)."""
ENV_MAX_BATCH_STEP_TOKENS = "MOEGUARD_MAX_BATCH_STEP_TOKENS"
"""Tokens of batch requests in one step at any time (0 or unset: no limit beyond the budgets): bounds how long an
interactive request arriving during a batch step waits for it."""
ENV_MEMORY_ADMISSION = "MOEGUARD_MEMORY_ADMISSION"
"""``predicted`` (default): with a hard limit on the CPU, steps are fitted under it by the memory model
(:mod:`moeguard_core.memory_admission`); ``off``: admission compares current use only."""
MEMORY_ADMISSIONS = ("predicted", "off")
ENV_SERVED_MODEL_NAME = "MOEGUARD_SERVED_MODEL_NAME"
"""The model name GET /v1/models reports and requests must name (default: the preset's name,
which stays accepted as an alias)."""

OVERLOAD_MODES = contract.OVERLOAD_MODES
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
"""Accepted ``MOEGUARD_DTYPE`` values (besides ``auto``); the short names are aliases."""

DEFAULT_BUDGETS = contract.DEFAULT_BUDGETS
"""The initial budgets when the variables are unset: the contract's, the same as the operator's spec defaults."""


@dataclass(frozen=True)
class Settings:
    """Everything the worker reads at start. Byte limits of 0/unset mean none."""

    host: str
    port: int
    preset: str
    seed: int
    torch_threads: int
    expert_chunk_tokens: int
    budgets: Budgets
    limits: QueueLimits
    soft_limit_bytes: int | None
    hard_limit_bytes: int | None
    soft_shrink_factor: float
    budget_configmap: str | None
    namespace: str
    log_interval_s: float
    overload_mode: str = contract.DEFAULT_OVERLOAD_MODE
    overload_max_context_tokens: int | None = None
    gpu_soft_fraction: float = contract.DEFAULT_GPU_SOFT_FRACTION
    gpu_hard_fraction: float = contract.DEFAULT_GPU_HARD_FRACTION
    capacity_factor: float = 0.0
    matmul_backend: MatmulSetting = "auto"
    moe_dispatch: MoeDispatch = "auto"
    checkpoint: str | None = None
    model_overrides: tuple[tuple[str, int | float], ...] = ()
    max_body_bytes: int = 1 << 20
    faults: Faults = field(default_factory=Faults)
    """Test-only fault injectors (:mod:`moeguard_runtime.faults`; off unless ``MOEGUARD_TEST_FAULTS=1``)."""
    device: str = "cpu"
    """Resolved torch device (``cpu``, ``cuda`` or ``cuda:N``)."""
    dtype: str = "float32"
    """Resolved dtype name (``float32``, ``bfloat16`` or ``float16``)."""
    served_model_name: str = ""
    """``ENV_SERVED_MODEL_NAME``, or the preset's name when unset."""
    drain_s: float = DEFAULT_DRAIN_SECONDS
    """``ENV_DRAIN_SECONDS``: seconds accepted requests may take to finish after SIGTERM."""
    shutdown_delay_s: float = DEFAULT_SHUTDOWN_DELAY_SECONDS
    """``ENV_SHUTDOWN_DELAY_SECONDS``: seconds the worker keeps answering after SIGTERM, at least."""
    unrecovered_oom_s: float = DEFAULT_UNRECOVERED_S
    """``ENV_UNRECOVERED_OOM_SECONDS``: seconds of allocation failures before liveness fails."""
    priority: PriorityPolicy = field(default_factory=PriorityPolicy)
    """``ENV_SCHEDULING_POLICY``, ``ENV_BATCH_TOKENS_WITH_INTERACTIVE`` and ``ENV_MAX_BATCH_STEP_TOKENS``."""
    memory_admission: str = "predicted"
    """``ENV_MEMORY_ADMISSION``."""
    role: str = "single"
    """``contract.ENV_ROLE``: ``single``, ``prefill`` or ``decode``."""
    prefill_url: str | None = None
    """``contract.ENV_PREFILL_URL`` (a decode worker's prefill Service), without a trailing slash."""
    kv_transfer_timeout_s: float = 5.0
    """``contract.ENV_KV_TRANSFER_TIMEOUT_SECONDS``: a KV read's deadline."""
    kv_lease_s: float = 30.0
    """``contract.ENV_KV_LEASE_SECONDS``."""

    @property
    def admits_by_prediction(self) -> bool:
        """Memory-aware admission is on: asked for, a hard limit set, and the CPU (the memory model's path)."""
        return (self.memory_admission == "predicted" and self.hard_limit_bytes is not None
                and self.device == "cpu")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def resolve_device(raw: str | None, cuda_available: bool | None = None) -> str:
    """``ENV_DEVICE``'s value resolved: ``auto`` (or unset) is ``cuda`` when CUDA is
    available, else ``cpu``. A CUDA device asked for without CUDA is a ConfigError."""
    name = contract.ENV_DEVICE
    value = (raw or "auto").strip().lower() or "auto"
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if value == "auto":
        return "cuda" if cuda_available else "cpu"
    if value == "cpu":
        return "cpu"
    if value == "cuda" or (value.startswith("cuda:") and value[5:].isdigit()):
        if not cuda_available:
            raise ConfigError(f"{name}={value!r}: torch.cuda.is_available() is False "
                              f"(torch {torch.__version__}); use cpu or auto")
        index = int(value[5:]) if ":" in value else 0
        count = torch.cuda.device_count()
        if count and index >= count:
            raise ConfigError(f"{name}={value!r}: only {count} CUDA device(s)")
        return value
    raise ConfigError(f"{name}={value!r} must be auto, cpu, cuda or cuda:N")


def resolve_dtype(raw: str | None, device: str) -> str:
    """``ENV_DTYPE``'s value resolved: ``auto`` (or unset) is bfloat16 on CUDA, float32 on CPU."""
    value = (raw or "auto").strip().lower() or "auto"
    if value == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if value not in DTYPES:
        raise ConfigError(f"{contract.ENV_DTYPE}={value!r} must be auto or one of "
                          f"{', '.join(DTYPES)}")
    return str(DTYPES[value]).removeprefix("torch.")


def _overrides(env: Mapping[str, str]) -> tuple[tuple[str, int | float], ...]:
    """``contract.ENV_MODEL_OVERRIDES``: a JSON object of ``ModelArgs`` fields."""
    import json

    from moeguard_core.presets import ModelArgs

    raw = env.get(contract.ENV_MODEL_OVERRIDES, "").strip()
    if not raw:
        return ()
    name = contract.ENV_MODEL_OVERRIDES
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must be a JSON object, given {type(data).__name__}")
    fields = ModelArgs.__dataclass_fields__
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"{name}: unknown field {key!r}; known: {', '.join(sorted(fields))}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{name}: {key} must be a positive number, given {value!r}")
    return tuple(sorted(data.items()))


def model_args(settings: Settings) -> ModelArgs:
    """The preset named in ``settings`` with the overrides applied.

    Raises:
        KeyError: unknown preset; ConfigError: overrides that make no valid shape.
    """
    import dataclasses

    from moeguard_core.presets import get_preset, shape_problems

    overrides: dict[str, Any] = dict(settings.model_overrides)
    args = dataclasses.replace(get_preset(settings.preset), **overrides)
    problems = shape_problems(args)
    if problems:
        raise ConfigError(f"{contract.ENV_MODEL_OVERRIDES}: {'; '.join(problems)} (given {args})")
    return args


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read :class:`Settings` from ``env`` (default ``os.environ``).

    A limit of 0 or unset means no limit.
    """
    env = os.environ if env is None else env

    def req(name: str, default: int, minimum: int = 1) -> int:
        value = _int(env, name, default, minimum)
        assert value is not None
        return value

    try:
        budgets = Budgets.model_validate({
            f.name: (_float(env, f.env, float(f.default)) if isinstance(f.default, float)
                     else req(f.env, int(f.default)))
            for f in contract.BUDGET_FIELDS
        })
    except ValueError as exc:
        raise ConfigError(f"invalid initial budgets: {exc}") from None
    limits = QueueLimits(
        max_concurrent_requests=req(contract.ENV_MAX_CONCURRENT_REQUESTS,
                                    contract.DEFAULT_MAX_CONCURRENT_REQUESTS),
        max_queue_tokens=req(ENV_MAX_QUEUE_TOKENS, 65_536),
        long_request_threshold_tokens=req(contract.ENV_LONG_REQUEST_THRESHOLD_TOKENS,
                                          contract.DEFAULT_LONG_REQUEST_THRESHOLD_TOKENS),
    )
    soft = _int(env, contract.ENV_SOFT_LIMIT_BYTES, None)
    hard = _int(env, contract.ENV_HARD_LIMIT_BYTES, None)
    shrink = _float(env, ENV_SOFT_SHRINK_FACTOR, 0.5)
    if not 0 < shrink <= 1:
        raise ConfigError(f"{ENV_SOFT_SHRINK_FACTOR}={shrink} must be in (0, 1]")
    overload = (env.get(contract.ENV_OVERLOAD_MODE) or contract.DEFAULT_OVERLOAD_MODE).strip()
    if overload not in OVERLOAD_MODES:
        raise ConfigError(f"{contract.ENV_OVERLOAD_MODE}={overload!r} must be one of "
                          f"{', '.join(OVERLOAD_MODES)}")
    gpu_soft = _float(env, contract.ENV_GPU_SOFT_FRACTION, contract.DEFAULT_GPU_SOFT_FRACTION)
    gpu_hard = _float(env, contract.ENV_GPU_HARD_FRACTION, contract.DEFAULT_GPU_HARD_FRACTION)
    for name, value in ((contract.ENV_GPU_SOFT_FRACTION, gpu_soft),
                        (contract.ENV_GPU_HARD_FRACTION, gpu_hard)):
        if not 0 < value <= 1:
            raise ConfigError(f"{name}={value} must be in (0, 1]")
    if gpu_soft > gpu_hard:
        raise ConfigError(f"{contract.ENV_GPU_SOFT_FRACTION}={gpu_soft} must be <= "
                          f"{contract.ENV_GPU_HARD_FRACTION}={gpu_hard}")
    if soft and hard and soft > hard:
        raise ConfigError(f"{contract.ENV_SOFT_LIMIT_BYTES}={soft} must be <= "
                          f"{contract.ENV_HARD_LIMIT_BYTES}={hard}")
    device = resolve_device(env.get(contract.ENV_DEVICE))
    dtype = resolve_dtype(env.get(contract.ENV_DTYPE), device)
    port = req(contract.ENV_PORT, contract.WORKER_PORT)
    if not 0 < port < 65536:
        raise ConfigError(f"{contract.ENV_PORT}={port} must be a TCP port, 1-65535")
    capacity = _float(env, ENV_CAPACITY_FACTOR, 0.0)
    if capacity < 0:
        raise ConfigError(f"{ENV_CAPACITY_FACTOR}={capacity} must be >= 0 (0: dropless)")
    try:
        faults = load_faults(env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    backend = (env.get(ENV_MATMUL_BACKEND) or "auto").strip()
    if backend not in MATMUL_SETTINGS:
        raise ConfigError(f"{ENV_MATMUL_BACKEND}={backend!r} must be one of "
                          f"{', '.join(MATMUL_SETTINGS)}")
    dispatch = (env.get(ENV_MOE_DISPATCH) or "auto").strip()
    if dispatch not in MOE_DISPATCHES:
        raise ConfigError(f"{ENV_MOE_DISPATCH}={dispatch!r} must be one of {', '.join(MOE_DISPATCHES)}")
    if backend == PACKED_BACKEND and (dispatch == "device" or not (
            device == "cpu" and can_pack(torch.empty(1, 1, dtype=DTYPES[dtype])))):
        raise ConfigError(f"{ENV_MATMUL_BACKEND}={PACKED_BACKEND} packs the experts for oneDNN on the CPU "
                          f"(float32, or bfloat16 where this torch's oneDNN has it) with host dispatch; "
                          f"this worker has device {device}, dtype {dtype}, {ENV_MOE_DISPATCH}={dispatch}")
    if backend == "stream" and not stream_kernel.runs(DTYPES[dtype], device):
        raise ConfigError(f"{ENV_MATMUL_BACKEND}=stream runs on the CPU in float32 or bfloat16 with the stream "
                          f"kernel built; this worker has device {device}, dtype {dtype}: "
                          f"{stream_kernel.unavailable() or 'not its device or dtype'}")
    preset = env.get(contract.ENV_MODEL_PRESET, "tiny") or "tiny"
    role, prefill_url = _role(env)
    return Settings(
        host=env.get(ENV_HOST, "0.0.0.0"),
        port=port,
        preset=preset,
        seed=req(ENV_SEED, 0, minimum=0),
        torch_threads=req(ENV_TORCH_THREADS, 1),
        expert_chunk_tokens=req(ENV_EXPERT_CHUNK_TOKENS, DEFAULT_EXPERT_CHUNK_TOKENS),
        budgets=budgets,
        limits=limits,
        soft_limit_bytes=soft or None,
        hard_limit_bytes=hard or None,
        soft_shrink_factor=shrink,
        budget_configmap=env.get(contract.ENV_BUDGET_CONFIGMAP) or None,
        namespace=env.get(contract.ENV_NAMESPACE) or "default",
        log_interval_s=_float(env, ENV_LOG_INTERVAL_S, 1.0),
        overload_mode=overload,
        overload_max_context_tokens=_int(env, ENV_OVERLOAD_MAX_CONTEXT_TOKENS, None, 1),
        gpu_soft_fraction=gpu_soft,
        gpu_hard_fraction=gpu_hard,
        capacity_factor=capacity,
        matmul_backend=next(m for m in MATMUL_SETTINGS if m == backend),
        moe_dispatch="host" if dispatch == "host" else "device" if dispatch == "device" else "auto",
        checkpoint=env.get(contract.ENV_CHECKPOINT_PATH) or None,
        model_overrides=_overrides(env),
        max_body_bytes=req(ENV_MAX_BODY_BYTES, 1 << 20),
        faults=faults,
        device=device,
        dtype=dtype,
        served_model_name=(env.get(ENV_SERVED_MODEL_NAME) or "").strip() or preset,
        drain_s=_drain_seconds(env),
        shutdown_delay_s=_seconds(env, ENV_SHUTDOWN_DELAY_SECONDS, DEFAULT_SHUTDOWN_DELAY_SECONDS),
        unrecovered_oom_s=_unrecovered_oom_seconds(env),
        priority=_priority(env),
        memory_admission=_choice(env, ENV_MEMORY_ADMISSION, MEMORY_ADMISSIONS),
        role=role,
        prefill_url=prefill_url,
        kv_transfer_timeout_s=_seconds(env, contract.ENV_KV_TRANSFER_TIMEOUT_SECONDS, 5.0),
        kv_lease_s=_seconds(env, contract.ENV_KV_LEASE_SECONDS, 30.0),
    )


def _role(env: Mapping[str, str]) -> tuple[str, str | None]:
    """``(role, prefill URL)``; a decode worker needs an ``http(s)://`` prefill URL, the others none."""
    role = _choice(env, contract.ENV_ROLE, contract.ROLES)
    url = (env.get(contract.ENV_PREFILL_URL) or "").strip().rstrip("/") or None
    if role == "decode" and (url is None or not url.startswith(("http://", "https://"))):
        raise ConfigError(f"{contract.ENV_ROLE}=decode needs {contract.ENV_PREFILL_URL}, the prefill workers' "
                          f"http(s):// base URL; given {url!r}")
    if role != "decode" and url is not None:
        raise ConfigError(f"{contract.ENV_PREFILL_URL} is set but {contract.ENV_ROLE}={role}: only a decode "
                          f"worker calls prefill workers")
    return role, url


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    """``name``'s value, one of ``choices`` (the first when unset)."""
    value = (env.get(name) or choices[0]).strip()
    if value not in choices:
        raise ConfigError(f"{name}={value!r} must be one of {', '.join(choices)}")
    return value


def _priority(env: Mapping[str, str]) -> PriorityPolicy:
    scheduling = (env.get(ENV_SCHEDULING_POLICY) or "priority").strip()
    if scheduling not in SCHEDULING_POLICIES:
        raise ConfigError(f"{ENV_SCHEDULING_POLICY}={scheduling!r} must be one of {', '.join(SCHEDULING_POLICIES)}")
    tokens = _int(env, ENV_BATCH_TOKENS_WITH_INTERACTIVE, 0)
    assert tokens is not None
    return PriorityPolicy(scheduling, tokens, _int(env, ENV_MAX_BATCH_STEP_TOKENS, None) or None)


def _unrecovered_oom_seconds(env: Mapping[str, str]) -> float:
    value = _float(env, ENV_UNRECOVERED_OOM_SECONDS, DEFAULT_UNRECOVERED_S)
    if not 0 < value <= 3600:
        raise ConfigError(f"{ENV_UNRECOVERED_OOM_SECONDS}={value:g} must be in (0, 3600] seconds")
    return value


def _drain_seconds(env: Mapping[str, str]) -> float:
    return _seconds(env, ENV_DRAIN_SECONDS, DEFAULT_DRAIN_SECONDS)


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    value = _float(env, name, default)
    if not 0 <= value <= 3600:
        raise ConfigError(f"{name}={value:g} must be between 0 and 3600 seconds")
    return value
