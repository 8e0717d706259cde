"""Semantic checks of a spec, pure: what the API server's schema cannot check (it needs the model preset).

:func:`parse_spec` validates with the same models that generated the CRD, then checks the
model shape, that the weights fit in ``hardLimit``, and the overload context cap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from moeguard_operator.models import MoEInferenceServiceSpec
from moeguard_runtime.presets import get_preset, parameter_count, shape_problems

WEIGHT_BYTES = 2
"""Bytes per parameter assumed when checking that the weights fit in hardLimit (bf16, the GPU default;
float32 on the CPU needs twice as much, so this check only catches shapes that can never fit)."""


class SpecError(Exception):
    """A spec that passed the API server's schema but cannot be served (e.g. unknown preset).

    Attributes:
        reason: CamelCase reason for the condition and the Event (``InvalidSpec``, ``UnknownModelPreset``).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def parse_spec(spec: Mapping[str, Any]) -> MoEInferenceServiceSpec:
    """Validate ``spec`` with the same models that generated the CRD.

    Raises:
        SpecError: reason ``InvalidSpec`` or ``UnknownModelPreset``, with a message naming the field.
    """
    try:
        parsed = MoEInferenceServiceSpec.model_validate(dict(spec))
    except ValidationError as exc:
        problems = "; ".join(f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise SpecError("InvalidSpec", problems) from None
    try:
        preset = get_preset(parsed.model.preset)
    except KeyError as exc:
        raise SpecError("UnknownModelPreset", f"spec.model.preset: {exc.args[0]}") from None
    args = dataclasses.replace(preset, **parsed.model.overrides.model_dump(exclude_none=True))
    issues = [f"spec.model.overrides: {p}" for p in shape_problems(args)]
    weights = parameter_count(args) * WEIGHT_BYTES
    if weights >= parsed.resources.hard_limit_bytes:
        issues.append(f"spec.resources.hardLimit ({parsed.resources.hard_limit}) is below the model's weights alone "
                      f"({weights / 2**30:.2f} GiB at {WEIGHT_BYTES} bytes per parameter)")
    cap = parsed.overload.max_context_tokens
    if cap is not None and cap > args.max_seq_len:
        issues.append(f"spec.overload.maxContextTokens ({cap}) is above the model's context ({args.max_seq_len})")
    if issues:
        raise SpecError("InvalidSpec", "; ".join(issues))
    return parsed
