"""Load a Hugging Face checkpoint folder: ``config.json`` plus safetensors shards.

The folder holds ``config.json`` (its ``model_type`` picks the implementation in
:mod:`moeguard_runtime.model.families`), optionally ``generation_config.json`` (EOS
ids), and the weights: one ``*.safetensors`` file, or shards listed by
``model.safetensors.index.json`` (HF ``PreTrainedModel.save_pretrained``
layout). Every problem is a :class:`~moeguard_runtime.model.checkpoint.CheckpointError`
raised while loading, before the worker serves anything, whose message names the
file and, where there is one, the tensor or config key: an unknown
``model_type`` (the message lists the supported ones), a missing or unreadable
shard (a truncated file fails safetensors' header check), a missing tensor, a
shape that disagrees with ``config.json``, or a tensor no module uses.

Tensors are opened with ``safetensors.safe_open`` (memory-mapped; a tensor is
read when it is taken). ``transformers`` is never imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeguard_runtime.model.checkpoint import CheckpointError
from moeguard_runtime.model.hf_config import (
    GENERATION_CONFIG_FILE,
    BuildOptions,
    HFConfig,
    TensorSource,
)
from moeguard_runtime.model.serving import ServingModel


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A model built from an HF folder, ready for :class:`~moeguard_runtime.engine.engine.Engine`.

    Attributes:
        model: the decoder (``forward(tokens, positions, segments)``, ``new_cache``).
        config: ``config.json`` as read.
        model_type: ``config.json``'s ``model_type``.
        eos_token_ids: from ``generation_config.json``'s ``eos_token_id``, else
            ``config.json``'s (empty when neither sets one).
        max_seq_len: context length in tokens (``max_position_embeddings``).
        path: the folder.
    """

    model: ServingModel
    config: dict[str, Any]
    model_type: str
    eos_token_ids: tuple[int, ...]
    max_seq_len: int
    path: Path


def eos_token_ids(folder: Path, config: HFConfig) -> tuple[int, ...]:
    """EOS ids: ``generation_config.json`` first (what ``generate`` stops on), then ``config.json``."""
    value: Any = None
    gen = folder / GENERATION_CONFIG_FILE
    if gen.is_file():
        try:
            value = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{gen}: cannot read ({exc!r})") from None
    if value is None:
        value = config.data.get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CheckpointError(f"{folder}: eos_token_id must be an integer or a list of them, "
                              f"given {value!r}")
    return tuple(values)


@dataclass(frozen=True)
class CheckpointInfo:
    """What the worker needs before the weights are read: from ``config.json`` and
    ``generation_config.json`` only (:func:`read_checkpoint_info`)."""

    model_type: str
    max_seq_len: int
    num_experts: int
    eos_token_ids: tuple[int, ...]


def read_checkpoint_info(path: str | Path) -> CheckpointInfo:
    """Read and check the folder's configuration without touching the weights.

    Raises:
        CheckpointError: unreadable ``config.json``, an unsupported ``model_type`` (the
            message lists the supported ones), or a missing key.
    """
    from moeguard_runtime.model import families

    folder = Path(path)
    config = HFConfig.read(folder)
    model_type = config.data.get("model_type")
    if families.get(model_type) is None:
        raise CheckpointError(f"{config.path}: model_type {model_type!r} is not supported; "
                              f"supported: {', '.join(families.SUPPORTED)}")
    quant = config.data.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise config.error("quantization_config", f"({method!r}) is not supported: serve an "
                                                  f"unquantized (bf16/fp32) checkpoint")
    return CheckpointInfo(str(model_type), config.max_seq_len(),
                          config.get_int("n_routed_experts", "num_local_experts", "num_experts"),
                          eos_token_ids(folder, config))


def load_hf_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu",
                       options: BuildOptions | None = None) -> LoadedCheckpoint:
    """Build the model of the HF folder ``path`` (its family from ``model_type``).

    The model is built on the meta device, the checkpoint's tensors are assigned
    (no second copy), then it is cast to ``dtype`` and moved to ``device``.

    Raises:
        CheckpointError: see the module docstring.
    """
    from moeguard_runtime.model import families

    folder = Path(path)
    info = read_checkpoint_info(folder)
    config = HFConfig.read(folder)
    family = families.get(info.model_type)
    assert family is not None
    options = options or BuildOptions()
    with TensorSource(folder) as source:
        source.expert_block = options.expert_block
        model: ServingModel = family(config, source, options)
    if options.expert_block is not None:  # before the cast and the move: only the block is ever copied
        from torch import nn

        from moeguard_runtime.parallel.expert_parallel import keep_experts

        assert isinstance(model, nn.Module)
        keep_experts(model, *options.expert_block)
    from moeguard_runtime.model.families.decoder import HFDecoder

    if isinstance(model, HFDecoder):
        model.cast(dtype)  # routers that HF keeps in float32 stay float32
    else:
        model.to(dtype=dtype)
    model.to(device)
    model.setup_rope(device)
    model.eval()
    return LoadedCheckpoint(model, dict(config.data), info.model_type, info.eos_token_ids,
                            info.max_seq_len, folder)
