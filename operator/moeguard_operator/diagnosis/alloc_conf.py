"""PyTorch's ``PYTORCH_CUDA_ALLOC_CONF``, pure: read it, and turn ``expandable_segments`` on without touching the
rest of it (issue 29, item 4; the failure: pytorch/torchtitan#3865, advice that replaced a whole allocator config).

The syntax is PyTorch's (docs, "CUDA semantics: optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF";
``c10/cuda/CUDAAllocatorConfig.cpp``): comma-separated ``option:value`` pairs, where a value may be a bracketed
list that holds commas and colons itself (``roundup_power2_divisions:[256:1,512:2,>:8]``), spaces are ignored, and
``expandable_segments`` takes exactly ``True`` or ``False``.

A deliberate ``expandable_segments:False`` is kept: expandable segments map memory through CUDA's virtual memory
API, and some expert-parallel communication stacks cannot register such memory (NCCL user-buffer and window
registration with PyTorch's expandable segments: pytorch/pytorch#165419; UCCL-EP's RDMA buffer registration fails
with "Bad address": uccl-project/uccl#839). Flipping it could trade an allocator OOM for a broken all-to-all, so
the diagnosis names the trade-off and offers no patch (:func:`expandable_segments_advice`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
"""The variable PyTorch's CUDA caching allocator reads its options from."""
OPTION = "expandable_segments"
"""The option that lets the allocator grow segments instead of keeping blocks it cannot reuse (PyTorch's remedy
for a fragmented cache)."""
ON = f"{OPTION}:True"
FALSE_SOURCES = "pytorch/pytorch#165419 (NCCL buffer registration), uccl-project/uccl#839 (UCCL-EP RDMA registration)"
"""Public reports of EP communication libraries that break with expandable segments on."""


def split_options(value: str) -> list[str]:
    """The ``option:value`` items of ``value``, split at the commas outside brackets, stripped; empty items
    dropped (PyTorch skips them too)."""
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for char in value:
        if char == "[":
            depth += 1
        elif char == "]":
            depth = max(0, depth - 1)
        if char == "," and depth == 0:
            items.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    items.append("".join(current).strip())
    return [item for item in items if item]


def _key(item: str) -> str:
    return item.split(":", 1)[0].replace(" ", "")


def expandable_segments(value: str) -> str | None:
    """The ``expandable_segments`` value written in ``value`` (``True``, ``False``, or what else is written there,
    spaces removed; the last one wins, as PyTorch parses left to right), or None when it is not set."""
    found = None
    for item in split_options(value):
        if _key(item) == OPTION:
            found = item.split(":", 1)[1].replace(" ", "") if ":" in item else ""
    return found


def turn_on(value: str) -> str:
    """``value`` with ``expandable_segments`` set to ``True``: an existing entry edited in place (every other
    option kept as written, in its order), else ``expandable_segments:True`` appended."""
    items = split_options(value)
    if not any(_key(item) == OPTION for item in items):
        return ",".join([*items, ON])
    return ",".join(ON if _key(item) == OPTION else item for item in items)


@dataclass(frozen=True)
class Advice:
    """What to say about ``expandable_segments`` for a fragmented allocator.

    Attributes:
        remedy: the sentence for the finding's remedy.
        env: the whole new ``template.extraEnv`` list (None: no patch; nothing would change, or the value is
            not the operator's to change).
    """

    remedy: str
    env: list[dict[str, Any]] | None


def expandable_segments_advice(extra_env: Sequence[Mapping[str, Any]], wasted_gib: float) -> Advice:
    """The advice for ``spec.template.extraEnv`` (core/v1 EnvVar items) when the allocator keeps ``wasted_gib``
    GiB of blocks it cannot reuse.

    * unset, or set without ``expandable_segments``: the variable with ``expandable_segments:True`` added, every
      other option kept;
    * ``expandable_segments:True`` already: no patch (it would change nothing); smaller prefill chunks or a
      restart are what is left;
    * ``expandable_segments:False``: no patch, the trade-off named (:data:`FALSE_SOURCES`);
    * set through ``valueFrom``: no patch (its value is not in the spec).
    """
    env = [dict(e) for e in extra_env]
    entry = next((e for e in env if e.get("name") == ALLOC_CONF), None)
    cause = f"instead of keeping {wasted_gib:.1f} GiB of unusable blocks"
    if entry is not None and "valueFrom" in entry:
        return Advice(f"{ALLOC_CONF} comes from valueFrom in spec.template.extraEnv: add {ON} to its source (the "
                      f"caching allocator then grows segments {cause})", None)
    current = str((entry or {}).get("value") or "")
    setting = expandable_segments(current)
    if setting == "True":
        return Advice(f"{ALLOC_CONF} already has {ON}: lower maxPrefillTokens so that block sizes vary less, or "
                      "restart the pod to clear the cache", None)
    if setting == "False":
        return Advice(f"{ALLOC_CONF} sets {OPTION}:False, kept as a deliberate choice: {ON} would let the caching "
                      f"allocator grow segments {cause}, but some expert-parallel communication libraries cannot "
                      f"register expandable-segment memory ({FALSE_SOURCES}); turn it on only where the "
                      "communication stack supports it, else lower maxPrefillTokens or restart the pod", None)
    new = {"name": ALLOC_CONF, "value": turn_on(current)}
    patched = [new if e is entry else e for e in env] if entry is not None else [*env, new]
    return Advice(f"set {ALLOC_CONF}={new['value']} in spec.template.extraEnv (the caching allocator then grows "
                  f"segments {cause})", patched)
