"""Worker settings, all from the environment.

Contract variables (``contract.ENV_*``, set by the operator) and the worker's
own knobs (``MOEGUARD_*`` below, with defaults). A malformed value stops the
worker at start with a message naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from moeguard_runtime import contract
from moeguard_runtime.contract import Budgets
from moeguard_runtime.moe import DEFAULT_EXPERT_CHUNK_TOKENS
from moeguard_runtime.scheduler import QueueLimits

ENV_SEED = "MOEGUARD_SEED"
ENV_TORCH_THREADS = "MOEGUARD_TORCH_THREADS"
ENV_HOST = "MOEGUARD_HOST"
ENV_EXPERT_CHUNK_TOKENS = "MOEGUARD_EXPERT_CHUNK_TOKENS"
ENV_MAX_CONCURRENT_REQUESTS = "MOEGUARD_MAX_CONCURRENT_REQUESTS"
ENV_MAX_QUEUE_REQUESTS = "MOEGUARD_MAX_QUEUE_REQUESTS"
ENV_MAX_QUEUE_TOKENS = "MOEGUARD_MAX_QUEUE_TOKENS"
ENV_QUEUE_TIMEOUT_S = "MOEGUARD_QUEUE_TIMEOUT_SECONDS"
ENV_SOFT_SHRINK_FACTOR = "MOEGUARD_SOFT_LIMIT_SHRINK_FACTOR"
ENV_LOG_INTERVAL_S = "MOEGUARD_LOG_INTERVAL_SECONDS"

DEFAULT_BUDGETS = Budgets.model_validate({"max_prefill_tokens": 2048, "max_decode_tokens": 256,
                                          "max_batch_requests": 32, "max_concurrent_batches": 2})


class ConfigError(ValueError):
    """A malformed environment variable; the message names it."""


@dataclass(frozen=True)
class Settings:
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


def _int(env: Mapping[str, str], name: str, default: int | None, minimum: int = 0) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read :class:`Settings` from ``env`` (default ``os.environ``).

    A limit of 0 or unset means no limit.
    """
    env = os.environ if env is None else env

    def req(name: str, default: int, minimum: int = 1) -> int:
        value = _int(env, name, default, minimum)
        assert value is not None
        return value

    d = DEFAULT_BUDGETS
    try:
        budgets = Budgets.model_validate({
            "max_prefill_tokens": req(contract.ENV_MAX_PREFILL_TOKENS, d.max_prefill_tokens),
            "max_decode_tokens": req(contract.ENV_MAX_DECODE_TOKENS, d.max_decode_tokens),
            "max_batch_requests": req(contract.ENV_MAX_BATCH_REQUESTS, d.max_batch_requests),
            "max_concurrent_batches": req(contract.ENV_MAX_CONCURRENT_BATCHES,
                                          d.max_concurrent_batches),
        })
    except ValueError as exc:
        raise ConfigError(f"invalid initial budgets: {exc}") from None
    limits = QueueLimits(
        max_concurrent_requests=req(ENV_MAX_CONCURRENT_REQUESTS, 128),
        max_queue_requests=req(ENV_MAX_QUEUE_REQUESTS, 64),
        max_queue_tokens=req(ENV_MAX_QUEUE_TOKENS, 65_536),
        queue_timeout_s=_float(env, ENV_QUEUE_TIMEOUT_S, 30.0),
    )
    soft = _int(env, contract.ENV_SOFT_LIMIT_BYTES, None)
    hard = _int(env, contract.ENV_HARD_LIMIT_BYTES, None)
    shrink = _float(env, ENV_SOFT_SHRINK_FACTOR, 0.5)
    if not 0 < shrink <= 1:
        raise ConfigError(f"{ENV_SOFT_SHRINK_FACTOR}={shrink} must be in (0, 1]")
    return Settings(
        host=env.get(ENV_HOST, "0.0.0.0"),
        port=req(contract.ENV_PORT, contract.WORKER_PORT),
        preset=env.get(contract.ENV_MODEL_PRESET, "tiny") or "tiny",
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
    )
