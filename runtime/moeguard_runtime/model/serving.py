"""What the engine needs from a model (:class:`ServingModel`), whatever its family.

The embedded model (:class:`moeguard_runtime.model.model.Transformer`) and every HF
family (:mod:`moeguard_runtime.model.families`) implement it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from moeguard_runtime.model.model import KVCache, Segment
from moeguard_runtime.model.moe import RoutingStats
from moeguard_runtime.model.moe_device import PendingRouting


class ServingArgs(Protocol):
    """The shape fields the worker reads (``presets.ModelArgs`` has them)."""

    @property
    def max_seq_len(self) -> int: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """The logits' width (the embedding rows; a checkpoint's may exceed its tokenizer's ids)."""
        ...


class ServingModel(Protocol):
    """A decoder the engine can drive.

    ``model(tokens, positions, segments)``: ``tokens``, ``positions`` [T] int64
    (packed, in segment order) → ``([S, V] float32 logits of each segment's last
    token, routing of each MoE layer: statistics, or pending on the device)``. ``new_cache(capacity, dtype,
    device)`` allocates one sequence's cache of ``capacity`` token positions (the
    family decides what it holds: K/V, or MLA's compressed latent).
    """

    @property
    def args(self) -> ServingArgs: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def new_cache(self, capacity: int, dtype: torch.dtype,
                  device: torch.device | str) -> KVCache: ...

    def setup_rope(self, device: torch.device | str | None = None) -> None: ...

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor,
                 segments: Sequence[Segment]
                 ) -> tuple[torch.Tensor, list[RoutingStats | PendingRouting]]: ...

    def to(self, *args: Any, **kwargs: Any) -> Any: ...

    def eval(self) -> Any: ...
