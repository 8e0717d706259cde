"""What a Hugging Face checkpoint folder holds, read strictly: ``config.json`` (:class:`HFConfig`),
the safetensors shards by tensor name (:class:`TensorSource`) and how a family builds its model
(:class:`BuildOptions`). Both :mod:`moeguard_runtime.model.hf_checkpoint` (the loader) and the
families (:mod:`moeguard_runtime.model.families`) import it; it imports neither.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from moeguard_runtime.model.checkpoint import CheckpointError
from moeguard_runtime.model.moe import DEFAULT_EXPERT_CHUNK_TOKENS, MatmulChoice, MoeDispatch

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"


def is_hf_folder(path: str | Path) -> bool:
    """True when ``path`` is a directory holding ``config.json``."""
    p = Path(path)
    return p.is_dir() and (p / CONFIG_FILE).is_file()


class HFConfig:
    """``config.json`` read strictly: a missing or mistyped key is a CheckpointError naming it."""

    def __init__(self, data: dict[str, Any], path: Path) -> None:
        self.data = data
        self.path = path

    @classmethod
    def read(cls, folder: Path) -> HFConfig:
        path = folder / CONFIG_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read ({exc})") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: must hold a JSON object")
        return cls(data, path)

    def error(self, key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {key} {why}")

    def get_int(self, *keys: str, default: int | None = None) -> int:
        """The first of ``keys`` present (aliases, e.g. ``num_experts``/``num_local_experts``)."""
        for key in keys:
            value = self.data.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise self.error(key, f"must be a non-negative integer, given {value!r}")
                return value
        if default is None:
            raise self.error(" or ".join(keys), "is missing")
        return default

    def get_float(self, key: str, default: float) -> float:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"must be a number, given {value!r}")
        return float(value)

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, given {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.data.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
            raise self.error(key, f"must be a list of integers, given {value!r}")
        return list(value)

    def max_seq_len(self) -> int:
        """``max_position_embeddings``, capped at a sliding window when one applies: with the
        context no longer than the window, full causal attention is exact."""
        n = self.get_int("max_position_embeddings")
        window = self.data.get("sliding_window")
        uses_window = self.data.get("use_sliding_window", True)
        if isinstance(window, int) and not isinstance(window, bool) and window > 0 and uses_window:
            n = min(n, window)
        return n


class TensorSource:
    """The checkpoint's tensors by name, each taken at most once.

    Use as a context manager (the shards stay open, memory-mapped, inside it).
    :meth:`take` checks the shape before reading; :meth:`check_all_used` names a
    tensor no module took.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.expert_block: tuple[int, int] | None = None
        """The routed experts ``[lo, hi)`` to read (:attr:`BuildOptions.expert_block`); None: all."""
        self._stack = ExitStack()
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        self._used: set[str] = set()

    def __enter__(self) -> TensorSource:
        try:
            self._open()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stack.close()

    def _open(self) -> None:
        index = self.folder / INDEX_FILE
        listed: dict[str, str] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                listed = {str(k): str(v) for k, v in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index}: cannot read its weight_map ({exc!r})") from None
            files = sorted({self.folder / f for f in listed.values()})
            for f in files:
                if not f.is_file():
                    first = next(k for k, v in listed.items() if self.folder / v == f)
                    raise CheckpointError(f"{index}: shard {f.name} is missing "
                                          f"(it holds {first!r} among others)")
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.folder}: no *.safetensors file and no {INDEX_FILE}")
        for f in files:
            try:
                handle = self._stack.enter_context(safe_open(str(f), framework="pt"))
                names = list(handle.keys())
            except Exception as exc:  # SafetensorError on a truncated or corrupt file, OSError
                raise CheckpointError(f"{f}: not a readable safetensors file ({exc})") from None
            self._handles[f] = handle
            for name in names:
                if name in self._where:
                    raise CheckpointError(f"{f}: tensor {name!r} is also in {self._where[name].name}")
                self._where[name] = f
        for name, shard in listed.items():
            if self._where.get(name) != self.folder / shard:
                raise CheckpointError(f"{self.folder / shard}: tensor {name!r} is listed in "
                                      f"{INDEX_FILE} but not in that shard")

    def has(self, name: str) -> bool:
        return name in self._where

    def take(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """The tensor ``name`` (read now, in its stored dtype), which must have ``shape``.

        Raises:
            CheckpointError: the tensor is missing, or its shape differs (the message
                names the file, the tensor and both shapes).
        """
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing (no shard holds it)")
        handle = self._handles[f]
        stored = tuple(handle.get_slice(name).get_shape())
        if stored != tuple(shape):
            raise CheckpointError(f"{f}: tensor {name!r} has shape {stored}, "
                                  f"{CONFIG_FILE} implies {tuple(shape)}")
        self._used.add(name)
        tensor: torch.Tensor = handle.get_tensor(name)
        return tensor

    def skip(self, name: str, shape: Sequence[int]) -> None:
        """Check the tensor ``name`` as :meth:`take` does (present, ``shape``) and count it used, without
        reading it (another rank's expert).

        Raises:
            CheckpointError: as :meth:`take`.
        """
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing (no shard holds it)")
        stored = tuple(self._handles[f].get_slice(name).get_shape())
        if stored != tuple(shape):
            raise CheckpointError(f"{f}: tensor {name!r} has shape {stored}, "
                                  f"{CONFIG_FILE} implies {tuple(shape)}")
        self._used.add(name)

    def check_all_used(self, ignore: Sequence[str] = ()) -> None:
        """Raises CheckpointError naming a tensor no module took (names starting with one of
        ``ignore`` are skipped)."""
        extra = sorted(n for n in self._where
                       if n not in self._used and not n.startswith(tuple(ignore)))
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise CheckpointError(f"{self._where[extra[0]]}: unexpected tensor {extra[0]!r}{more}; "
                                  f"no module of this model_type uses it")


@dataclass(frozen=True)
class BuildOptions:
    """How a family builds its model: the MoE guardrails and kernels (:mod:`moeguard_runtime.model.moe`,
    as for the embedded model)."""

    expert_chunk_tokens: int = DEFAULT_EXPERT_CHUNK_TOKENS
    capacity_factor: float = 0.0
    matmul_backend: MatmulChoice = "onednn"
    dispatch: MoeDispatch = "auto"
    expert_block: tuple[int, int] | None = None
    """Expert parallelism: the routed experts ``[lo, hi)`` this process keeps. Only their tensors are read;
    the others are checked (present, right shape) and skipped, so a rank's host and device memory hold its
    block, never the whole stack. None: every expert."""
