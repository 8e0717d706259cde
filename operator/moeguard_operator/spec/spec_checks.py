"""Semantic checks of a spec, pure: what the API server's schema cannot check (it needs the model preset,
or a setting of the operator's).

:func:`parse_spec` validates with the same models that generated the CRD, then checks the
model shape, that the weights fit in ``hardLimit``, the overload context cap, and (unless the
operator allows them: ``OperatorConfig.allow_secrets``) that no Secret reaches the pods
(:func:`secret_uses`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from moeguard_core.memory_admission import MemoryAdmission
from moeguard_core.memory_model import DTYPE_BYTES
from moeguard_core.presets import ModelArgs, get_preset, parameter_count, shape_problems
from moeguard_operator.spec.models import MoEInferenceServiceSpec

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


SECRETS_SETTING = "chart value operator.allowSecrets"
"""Where an operator's administrator allows Secrets (the flag ``--allow-secrets``), as messages name it."""


def secret_uses(spec: MoEInferenceServiceSpec) -> list[str]:
    """Each place where ``spec`` would put a Secret into the worker pods, as a message naming the field.

    Secret volumes (``template.volumes[i].secret``) and ``template.extraEnv[i].valueFrom.secretKeyRef``;
    ``projected`` volumes (which may hold Secrets) never pass the CRD. Anyone who may create a
    MoEInferenceService could otherwise read any Secret of the namespace through an image they name.
    """
    uses = [f"spec.template.volumes[{i}] ({v.get('name')}): Secret volumes are not allowed by this operator "
            f"({SECRETS_SETTING})" for i, v in enumerate(spec.template.volumes) if "secret" in v]
    uses += [f"spec.template.extraEnv[{i}] ({e.get('name')}): valueFrom.secretKeyRef is not allowed by this "
             f"operator ({SECRETS_SETTING})" for i, e in enumerate(spec.template.extra_env)
             if isinstance(e.get("valueFrom"), Mapping) and "secretKeyRef" in e["valueFrom"]]
    return uses


def parse_spec(spec: Mapping[str, Any], *, allow_secrets: bool = False) -> MoEInferenceServiceSpec:
    """Validate ``spec`` with the same models that generated the CRD; ``allow_secrets``: the operator's
    setting (``OperatorConfig.allow_secrets``) that lets Secrets reach the pods.

    Raises:
        SpecError: reason ``InvalidSpec``, ``UnknownModelPreset`` or ``SecretsNotAllowed``, with a message
            naming the field.
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
    weights = weight_bytes(parsed, parameter_count(args))
    ep = parsed.parallelism.expert_parallel_size
    if weights is not None and weights[0] // ep >= parsed.resources.hard_limit_bytes:
        share = "" if ep == 1 else f" / {ep} ranks: every pod holds at least its share of them"
        issues.append(f"spec.resources.hardLimit ({parsed.resources.hard_limit}) is below the model's weights alone "
                      f"({weights[0] // ep / 2**30:.2f} GiB, {weights[1]}{share})")
    if ep > 1 and parsed.model.source is None and args.num_experts % ep:
        issues.append(f"spec.parallelism.expertParallelSize ({ep}) must divide the model's expert count "
                      f"({args.num_experts}, preset {parsed.model.preset}): each rank holds the same number of "
                      "experts")
    cap = parsed.overload.max_context_tokens
    if cap is not None and cap > args.max_seq_len and parsed.model.source is None:
        issues.append(f"spec.overload.maxContextTokens ({cap}) is above the model's context ({args.max_seq_len})")
    if issues:
        raise SpecError("InvalidSpec", "; ".join(issues))
    secrets = [] if allow_secrets else secret_uses(parsed)
    if secrets:
        raise SpecError("SecretsNotAllowed", "; ".join(secrets))
    return parsed


def memory_warnings(spec: MoEInferenceServiceSpec) -> list[str]:
    """What the worker's memory-aware admission (:mod:`moeguard_core.memory_admission`, the memory
    model ``moeguard plan`` uses) would refuse whatever the load, for a CPU worker (``resources.gpus``
    0) of a preset: a request at the model's full context whose smallest step (its KV cache and its last
    16-token chunk, float32, the CPU's dtype) does not fit in ``hardLimit`` above the weights. The
    process's own baseline (the torch runtime) is not counted, so a warning is certain; its absence is
    not a promise. Empty for GPU workers (the step's memory is on the device), checkpoint sources
    (the operator does not read their shape) and expert-parallel groups (the leader's share of the weights
    is not the model's)."""
    if spec.resources.gpus or spec.model.source is not None or spec.parallelism.expert_parallel_size > 1:
        return []
    try:
        args = dataclasses.replace(get_preset(spec.model.preset),
                                   **spec.model.overrides.model_dump(exclude_none=True))
    except KeyError:
        return []
    return full_context_warnings(args, spec.resources.hard_limit_bytes, spec.resources.hard_limit)


def full_context_warnings(args: ModelArgs, hard_limit_bytes: int, hard_limit: str) -> list[str]:
    """:func:`memory_warnings` for a shape and a hard limit (pure)."""
    dtype = "float32"
    admission = MemoryAdmission(args, dtype, hard_limit_bytes)
    weights = parameter_count(args) * DTYPE_BYTES[dtype]
    context = args.max_seq_len
    need = admission.predict(admission.smallest_step(context - 1, 1))
    if weights + need <= hard_limit_bytes:
        return []
    return [f"spec.resources.hardLimit ({hard_limit}) cannot hold a request at the model's full context "
            f"({context} tokens) on a CPU worker: the weights ({weights / 2**30:.2f} GiB, float32) plus its "
            f"smallest step ({need / 2**20:.1f} MiB: its KV cache and a 16-token prefill chunk, by the memory "
            f"model) exceed it, so the worker refuses such requests with 400 memory_predicted"]


def weight_bytes(spec: MoEInferenceServiceSpec, preset_parameters: int) -> tuple[int, str] | None:
    """The weights' size that ``hardLimit`` is checked against, bytes, and where it comes from.

    ``spec.model.weightBytes`` when set (the user's figure for a checkpoint); else, with a
    ``spec.model.source``, None: the operator reads nothing from the checkpoint, so its size is not known
    at apply time (the worker exports it as ``moeguard_model_weight_bytes`` once loaded); else the
    preset's ``preset_parameters`` × :data:`WEIGHT_BYTES`.
    """
    hint = spec.model.weight_bytes_hint
    if hint is not None:
        return hint, "spec.model.weightBytes"
    if spec.model.source is not None:
        return None
    return preset_parameters * WEIGHT_BYTES, f"the preset at {WEIGHT_BYTES} bytes per parameter"


def check_model_source(spec: MoEInferenceServiceSpec, allow_host_path: bool) -> None:
    """What the operator's own settings refuse in ``spec.model.source`` (a spec cannot grant itself them).

    Raises:
        SpecError: reason ``HostPathNotAllowed`` for a ``hostPath`` source when ``allow_host_path`` is false
            (the operator's ``--allow-host-path-models``).
    """
    source = spec.model.source
    if source is not None and source.host_path is not None and not allow_host_path:
        raise SpecError("HostPathNotAllowed",
                        f"spec.model.source.hostPath ({source.host_path.path}): this operator serves no node "
                        "directories (it runs without --allow-host-path-models); use a persistentVolumeClaim "
                        "or an image source")


PROMETHEUS_URLS_SETTING = "chart value operator.prometheus.allowedUrls, flag --allowed-prometheus-url"
"""Where an operator's administrator allows more Prometheus URLs, as messages name it."""


def check_prometheus_url(spec: MoEInferenceServiceSpec, allowed: tuple[str, ...]) -> None:
    """Refuse a ``spec.control.prometheusUrl`` that is not one of ``allowed`` (the operator's own
    ``--prometheus-url`` and its ``--allowed-prometheus-url`` list: ``OperatorConfig.prometheus_urls``).

    Exact match after dropping a trailing ``/``: the operator fetches this URL from inside the cluster, so
    a spec that could name any would let anyone who may create a MoEInferenceService probe the cluster's
    network (SSRF). An unset ``prometheusUrl`` (the operator's default) always passes.

    Raises:
        SpecError: reason ``PrometheusURLNotAllowed``, naming the field and the setting.
    """
    url = spec.control.prometheus_url
    if not url or url.rstrip("/") in {u.rstrip("/") for u in allowed}:
        return
    raise SpecError("PrometheusURLNotAllowed",
                    "spec.control.prometheusUrl: not a Prometheus URL this operator may query (it allows "
                    f"{len(allowed)} URL{'' if len(allowed) == 1 else 's'}: its own --prometheus-url and "
                    f"{PROMETHEUS_URLS_SETTING}); unset it to use the operator's Prometheus")
