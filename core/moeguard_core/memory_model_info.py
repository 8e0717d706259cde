"""The memory model a worker predicts its steps with, as the labels of ``moeguard_memory_model_info``, and back.

The worker knows its model's shape (a ``model.source`` checkpoint's ``config.json`` is read only by the worker),
its dtype and its MoE settings; the operator's predictive policy (issue 30: "export what the operator needs from
the worker as metrics in the contract") predicts each pod's peak with the same :class:`ModelMemory` the worker's
admission uses. An info metric carries it (value 1, the labels are the values: the OpenMetrics ``info`` idiom,
as ``moeguard_ucx_info``): :func:`info_labels` writes the labels, :func:`from_info_labels` reads them back. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from moeguard_core.family_shape import ConfigError, FamilyShape
from moeguard_core.memory_admission import DEFAULT_EXPERT_CHUNK_TOKENS
from moeguard_core.memory_model import DTYPE_BYTES

SHAPE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(FamilyShape))
"""The :class:`FamilyShape` fields, each a label of its own."""
MEMORY_MODEL_LABELS: tuple[str, ...] = (*SHAPE_FIELDS, "dtype", "expert_chunk_tokens", "capacity_factor")
"""The labels of ``moeguard_memory_model_info`` (besides the worker's own): the shape, then the settings."""


@dataclass(frozen=True)
class ModelMemory:
    """What a step-peak prediction needs of the served model: its shape and the worker's dtype and MoE settings.

    Attributes:
        shape: the decoder's shape (:class:`FamilyShape`).
        dtype: the weights' and activations' dtype (a key of :data:`memory_model.DTYPE_BYTES`).
        expert_chunk_tokens: the worker's per-expert chunk (tokens; bounds the per-expert buffers).
        capacity_factor: the worker's expert capacity factor (0: none).
    """

    shape: FamilyShape
    dtype: str = "float32"
    expert_chunk_tokens: int = DEFAULT_EXPERT_CHUNK_TOKENS
    capacity_factor: float = 0.0


def info_labels(model: ModelMemory) -> dict[str, str]:
    """``model`` as the labels of ``moeguard_memory_model_info`` (:data:`MEMORY_MODEL_LABELS`; booleans as
    ``true``/``false``, numbers in decimal)."""
    def text(value: object) -> str:
        return ("true" if value else "false") if isinstance(value, bool) else str(value)
    labels = {name: text(getattr(model.shape, name)) for name in SHAPE_FIELDS}
    labels.update(dtype=model.dtype, expert_chunk_tokens=str(model.expert_chunk_tokens),
                  capacity_factor=repr(float(model.capacity_factor)))
    return labels


def from_info_labels(labels: Mapping[str, str]) -> ModelMemory:
    """The :class:`ModelMemory` that :func:`info_labels` wrote (other labels, e.g. ``pod``, are ignored; a text
    field's absent label is its empty value, as Prometheus drops empty labels).

    Raises:
        ConfigError: a label is missing or does not parse (the message names it), or ``dtype`` is not one the
            memory model knows.
    """
    def get(name: str) -> str:
        value = labels.get(name)
        if value is None:
            raise ConfigError(f"moeguard_memory_model_info has no label {name}")
        return value

    values: dict[str, object] = {}
    for f in dataclasses.fields(FamilyShape):
        # Prometheus keeps no label whose value is empty ("a label with an empty label value is considered
        # equivalent to a label that does not exist", prometheus.io/docs/concepts/data_model): a text field
        # written as "" (e.g. qk_norm of a family without one) comes back absent.
        raw = labels.get(f.name, "") if f.type in (str, "str") else get(f.name)
        try:
            if f.type in (int, "int"):
                values[f.name] = int(raw)
            elif f.type in (bool, "bool"):
                if raw not in ("true", "false"):
                    raise ValueError(raw)
                values[f.name] = raw == "true"
            else:
                values[f.name] = raw
        except ValueError:
            raise ConfigError(f"moeguard_memory_model_info label {f.name}={raw!r} does not parse as {f.type}") from None
    dtype = get("dtype")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"moeguard_memory_model_info label dtype={dtype!r}: not one of {sorted(DTYPE_BYTES)}")
    try:
        chunk, factor = int(get("expert_chunk_tokens")), float(get("capacity_factor"))
    except ValueError as exc:
        raise ConfigError(f"moeguard_memory_model_info: {exc}") from None
    return ModelMemory(FamilyShape(**values), dtype, chunk, factor)  # type: ignore[arg-type]
