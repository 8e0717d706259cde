"""The Kubernetes API server's own core/v1 schemas, embedded in the CRD (as kubebuilder embeds them).

The pod-template fields a MoEInferenceService passes through to its worker pods (tolerations,
affinity, volumes, volume mounts, env) are validated at ``kubectl apply`` by the same schemas the
API server uses for a Pod, so that a spec the API server accepts is one whose Deployment it will
accept too (issue: ``affinity: {nodeAffinity: everywhere}`` was accepted, then every server-side
apply of the Deployment failed).

``core_v1.json`` beside this module holds the structural schemas, made by
:func:`structural_from_openapi` from the API server's ``/openapi/v3/api/v1`` document
(``hack/core_schemas.py`` writes it; an integration test checks it against the running API
server of the pinned Kubernetes version).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).with_name("core_v1.json")
CORE_PREFIX = "io.k8s.api.core.v1."
TYPES = ("Toleration", "Affinity", "Volume", "VolumeMount", "EnvVar")
"""The core/v1 types embedded in the CRD."""
MARKER = "x-moeguard-core-v1"
"""Key a model's JSON Schema uses to ask crdgen for a core/v1 type in its place (e.g. ``{MARKER: "Volume"}``)."""

MAX_LENGTHS = "x-moeguard-max-lengths"
"""Key beside :data:`MARKER`: ``maxLength`` per top-level string property of the embedded type."""

_KEEP = {"type", "properties", "items", "additionalProperties", "required", "enum", "format",
         "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-list-type",
         "x-kubernetes-map-type"}
"""Keys kept from the OpenAPI document. Descriptions are dropped (as kubebuilder's ``maxDescLen=0``):
the Volume schema alone would otherwise pass the 256 KiB limit of the annotation that
client-side ``kubectl apply`` writes on a CRD. Defaults are dropped: a Pod's defaults are the API
server's to fill in the Deployment, not the CRD's."""


def structural_from_openapi(document: dict[str, Any], name: str) -> dict[str, Any]:
    """The structural schema of core/v1 type ``name`` from an OpenAPI v3 document.

    ``$ref`` (also under ``allOf``) is inlined; ``IntOrString`` and ``Quantity``
    (``oneOf [integer|number, string]``) become ``x-kubernetes-int-or-string``; a list-type ``map``
    becomes ``atomic`` (its keys may rely on defaults that are dropped here).

    Raises:
        KeyError: ``name`` (or a type it refers to) is not in the document.
    """
    schemas = document["components"]["schemas"]

    def walk(node: Any, seen: tuple[str, ...]) -> Any:
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref") or next((a["$ref"] for a in node.get("allOf", []) if "$ref" in a), None)
        if ref is not None:
            target = ref.rsplit("/", 1)[-1]
            if target in seen:
                raise ValueError(f"recursive core/v1 schema {' -> '.join((*seen, target))}")
            return walk(schemas[target], (*seen, target))
        if "oneOf" in node:
            kinds = {s.get("type") for s in node["oneOf"]}
            if kinds in ({"integer", "string"}, {"number", "string"}):
                return {"x-kubernetes-int-or-string": True}
            raise ValueError(f"cannot express oneOf {node['oneOf']!r} structurally")
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key not in _KEEP:
                continue
            if key == "properties":
                out[key] = {k: walk(v, seen) for k, v in value.items()}
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                out[key] = walk(value, seen)
            elif key == "x-kubernetes-list-type" and value == "map":
                out[key] = "atomic"
            else:
                out[key] = value
        if "properties" in out or "additionalProperties" in out:
            out.setdefault("type", "object")
        return out

    full = CORE_PREFIX + name
    return dict(walk(schemas[full], (full,)))


def build_file(document: dict[str, Any]) -> dict[str, Any]:
    """The content of ``core_v1.json``: every type in :data:`TYPES`, from ``document``."""
    return {name: structural_from_openapi(document, name) for name in TYPES}


@cache
def embedded() -> dict[str, dict[str, Any]]:
    """The committed structural schemas, by type name."""
    return dict(json.loads(SCHEMA_FILE.read_text()))


def schema(name: str) -> dict[str, Any]:
    """A deep copy of the committed structural schema of core/v1 type ``name``.

    Raises:
        KeyError: ``name`` is not one of :data:`TYPES`.
    """
    return dict(json.loads(json.dumps(embedded()[name])))
