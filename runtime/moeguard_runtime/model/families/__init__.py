"""HF model families the worker serves, by ``config.json`` ``model_type``.

Each module has ``build(config, source, options) -> model`` (a
:class:`moeguard_runtime.model.serving.ServingModel` on the meta device, filled from the
checkpoint); :func:`moeguard_runtime.model.hf_checkpoint.load_hf_checkpoint` picks one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moeguard_runtime.model.hf_config import BuildOptions, HFConfig, TensorSource

SUPPORTED = ("deepseek_v3", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
"""``model_type`` values with an implementation (the module of the same name)."""

Builder = Callable[["HFConfig", "TensorSource", "BuildOptions"], Any]


def get(model_type: object) -> Builder | None:
    """The ``build`` function of ``model_type``, or None when it has no implementation."""
    if not isinstance(model_type, str) or model_type not in SUPPORTED:
        return None
    module = importlib.import_module(f"moeguard_runtime.model.families.{model_type}")
    build: Builder = module.build
    return build
