"""Expert-parallel settings from the environment (issue 15): pure, no torch.

LeaderWorkerSet sets ``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE`` and ``LWS_WORKER_INDEX`` on every pod of
a group; the operator sets ``MOEGUARD_EXPERT_PARALLEL_SIZE`` (ranks per replica), ``MOEGUARD_EP_PORT``
(default 29500) and ``MOEGUARD_EP_TIMEOUT_SECONDS`` (default 30). The global rank of a pod's process is
``worker_index * ranks_per_pod + local_rank`` with ``ranks_per_pod = ep_size / group_size``. Rank ``r``
owns the contiguous expert block ``[r * E / ep_size, (r + 1) * E / ep_size)`` (vLLM's and SGLang's
default, linear placement without EPLB's rebalancing).

One rank per process. With ``ranks_per_pod`` above 1 the pod's main process (local rank 0: the leader on
the leader pod, else a follower) starts the pod's other ranks as child processes of the same command,
telling each its local rank in :data:`ENV_EP_LOCAL_RANK` (:func:`local_rank_env`); they are followers
without an HTTP endpoint. Refused (:class:`ConfigError`): a capacity factor (the drop decision needs every
rank's counts first) and an EP size that does not divide the expert count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from moeguard_core import contract
from moeguard_runtime.env_values import ConfigError, env_float, env_int

ENV_EP_LOCAL_RANK = "MOEGUARD_EP_LOCAL_RANK"
"""Internal: the local rank of a child rank process, set by the pod's main process (absent: 0)."""


@dataclass(frozen=True)
class EpSettings:
    """One rank's place in its group.

    Attributes:
        size: ranks in the group (``MOEGUARD_EXPERT_PARALLEL_SIZE``).
        rank: this process's global rank (0: the leader, which serves HTTP).
        leader_address: host of the rendezvous (``LWS_LEADER_ADDRESS``).
        port: TCP port of the rendezvous on the leader.
        timeout_s: timeout of every collective, seconds.
        join_timeout_s: how long to wait for the whole group at start-up, seconds.
        group_size: pods in the group (``LWS_GROUP_SIZE``).
        ranks_per_pod: ``size / group_size``.
        local_rank: this process's rank within its pod (0: the pod's main process, which serves HTTP).
    """

    size: int
    rank: int
    leader_address: str
    port: int
    timeout_s: float
    join_timeout_s: float
    group_size: int
    ranks_per_pod: int = 1
    local_rank: int = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """This rank's experts, ``[lo, hi)``."""
        return expert_range(self.rank, self.size, num_experts)


def expert_range(rank: int, size: int, num_experts: int) -> tuple[int, int]:
    """The contiguous block ``[rank * E / size, (rank + 1) * E / size)`` of rank ``rank``.

    Raises:
        ConfigError: ``size`` does not divide ``num_experts``.
    """
    if num_experts % size:
        raise ConfigError(f"{contract.ENV_EXPERT_PARALLEL_SIZE}={size} must divide the model's "
                          f"{num_experts} experts (each rank holds E / size experts)")
    per = num_experts // size
    return rank * per, (rank + 1) * per


def _int(env: Mapping[str, str], name: str, default: int | None, minimum: int) -> int:
    value = env_int(env, name, default, minimum)
    if value is None:
        raise ConfigError(f"{name} is required with {contract.ENV_EXPERT_PARALLEL_SIZE} > 1 "
                          f"(LeaderWorkerSet sets it on every pod of a group)")
    return value


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    value = env_float(env, name, default)
    if not math.isfinite(value) or not 0 < value <= 3600:
        raise ConfigError(f"{name}={value:g} must be in (0, 3600] seconds")
    return value


def load_ep_settings(env: Mapping[str, str], capacity_factor: float = 0.0) -> EpSettings | None:
    """The group this process belongs to, or None for the single-process worker
    (``MOEGUARD_EXPERT_PARALLEL_SIZE`` unset or 1: today's behaviour, the LWS variables ignored).

    Raises:
        ConfigError: a malformed variable, a missing LWS variable, ``ep_size`` not a multiple of
            ``LWS_GROUP_SIZE``, more than one rank per pod, a worker index outside the group, or a
            capacity factor (not supported with expert parallelism).
    """
    size = _int(env, contract.ENV_EXPERT_PARALLEL_SIZE, 1, 1)
    if size == 1:
        return None
    group_size = _int(env, contract.ENV_LWS_GROUP_SIZE, None, 1)
    index = _int(env, contract.ENV_LWS_WORKER_INDEX, None, 0)
    address = (env.get(contract.ENV_LWS_LEADER_ADDRESS) or "").strip()
    if not address:
        raise ConfigError(f"{contract.ENV_LWS_LEADER_ADDRESS} is required with "
                          f"{contract.ENV_EXPERT_PARALLEL_SIZE} > 1 (LeaderWorkerSet sets it)")
    if size % group_size:
        raise ConfigError(f"{contract.ENV_EXPERT_PARALLEL_SIZE}={size} must be a multiple of "
                          f"{contract.ENV_LWS_GROUP_SIZE}={group_size} (ranks per pod = size / pods)")
    if index >= group_size:
        raise ConfigError(f"{contract.ENV_LWS_WORKER_INDEX}={index} must be < "
                          f"{contract.ENV_LWS_GROUP_SIZE}={group_size}")
    per_pod = size // group_size
    local = _int(env, ENV_EP_LOCAL_RANK, 0, 0)
    if local >= per_pod:
        raise ConfigError(f"{ENV_EP_LOCAL_RANK}={local} must be < {per_pod} ranks per pod")
    port = _int(env, contract.ENV_EP_PORT, contract.DEFAULT_EP_PORT, 1)
    if port > 65535:
        raise ConfigError(f"{contract.ENV_EP_PORT}={port} must be a TCP port, 1-65535")
    if capacity_factor > 0:
        raise ConfigError(f"MOEGUARD_CAPACITY_FACTOR={capacity_factor:g} is not supported with "
                          f"{contract.ENV_EXPERT_PARALLEL_SIZE} > 1 (expert parallelism is dropless)")
    return EpSettings(size=size, rank=index * per_pod + local, leader_address=address, port=port,
                      timeout_s=_seconds(env, contract.ENV_EP_TIMEOUT_SECONDS, contract.DEFAULT_EP_TIMEOUT_SECONDS),
                      join_timeout_s=_seconds(env, contract.ENV_EP_JOIN_TIMEOUT_SECONDS,
                                              contract.DEFAULT_EP_JOIN_TIMEOUT_SECONDS),
                      group_size=group_size, ranks_per_pod=per_pod, local_rank=local)


def local_rank_env(env: Mapping[str, str], ep: EpSettings, local_rank: int, device: str) -> dict[str, str]:
    """The environment of the pod's child rank ``local_rank``: the pod's, with its local rank and, on CUDA,
    its own device (``cuda:<local_rank>``: one GPU per rank)."""
    out = {**env, ENV_EP_LOCAL_RANK: str(local_rank)}
    if device.startswith("cuda"):
        out[contract.ENV_DEVICE] = f"cuda:{local_rank}"
    return out
