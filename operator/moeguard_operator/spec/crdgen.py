"""Generate the MoEInferenceService CRD from the pydantic models.

``python -m moeguard_operator.spec.crdgen`` writes ``crds/moeinferenceservices.moeguard.dev.yaml``;
``--check`` exits 1 when the committed file differs. pydantic's JSON Schema is
turned into a Kubernetes *structural* schema (apiextensions.k8s.io/v1):

* ``$ref``/``$defs`` are inlined; ``title`` and ``additionalProperties: false`` are dropped;
* ``anyOf [X, null]`` becomes ``X`` with ``nullable: true``;
* draft-2020 numeric ``exclusiveMinimum: N`` becomes OpenAPI v3's ``minimum: N, exclusiveMinimum: true``;
* an optional object field without a default gets its fully defaulted value as ``default``, so
  the API server fills every default and GitOps tools see no drift;
* ``x-kubernetes-validations`` (CEL) written on the models are kept where they stand;
* a field marked with ``core_schemas.MARKER`` gets the API server's own core/v1 schema
  (:mod:`moeguard_operator.spec.core_schemas`), as kubebuilder embeds ``k8s.io/api`` types.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from moeguard_core.contract import API_GROUP, API_VERSION, KIND, PLURAL
from moeguard_operator.spec import core_schemas
from moeguard_operator.spec.models import (
    NAME_RULES,
    MoEInferenceServiceSpec,
    MoEInferenceServiceStatus,
)

CRD_PATH = Path(__file__).resolve().parents[3] / "crds" / f"{PLURAL}.{API_GROUP}.yaml"

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Prefill", "type": "integer", "jsonPath": ".status.budgets.maxPrefillTokens",
     "description": "maxPrefillTokens in effect"},
    {"name": "Skew", "type": "number", "jsonPath": ".status.observed.skewRatio",
     "description": "highest expert skew ratio seen"},
    {"name": "RSS %", "type": "integer", "jsonPath": ".status.observed.memoryPercent",
     "description": "highest memory in use / hardLimit among the pods"},
    {"name": "Overload", "type": "string", "jsonPath": ".status.overloadMode"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.preset", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Return ``node`` (a pydantic JSON Schema fragment) as a structural schema fragment."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if core_schemas.MARKER in node:
        return _core_type(node)
    node = dict(node)
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        non_null = [s for s in any_of if s.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"cannot express anyOf {any_of!r} structurally")
        base = _structural(non_null[0], defs)
        if len(non_null) < len(any_of):
            base["nullable"] = True
        node.pop("default", None) if node.get("default") is None else None
        node = {**base, **{k: v for k, v in node.items()}}
    node.pop("title", None)
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    if node.get("type") == "object" and "properties" not in node and node.get("additionalProperties") in (True, {}, None):
        # free-form objects (affinity, volumes): kept as written, not pruned
        node.pop("additionalProperties", None)
        node["x-kubernetes-preserve-unknown-fields"] = True
    if "const" in node:
        node["enum"] = [node.pop("const")]
        node.setdefault("type", "string")
    for key, bound, step in (("exclusiveMinimum", "minimum", 1), ("exclusiveMaximum", "maximum", -1)):
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            del node[key]
            if node.get("type") == "integer":
                node[bound] = int(value) + step
            else:
                node[bound] = value
                node[key] = True
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            props = {name: _structural(s, defs) for name, s in value.items()}
            required = set(node.get("required", []))
            for name, s in props.items():
                if (s.get("type") == "object" and "properties" in s and name not in required
                        and not s.get("required") and not s.get("nullable")):
                    s.setdefault("default", _object_default(s))
            out[key] = props
        elif key in ("items", "additionalProperties"):
            out[key] = _structural(value, defs)
        elif key == "description":
            out[key] = " ".join(str(value).replace("``", "`").split())
        else:
            out[key] = value
    if "properties" in out:
        out.setdefault("type", "object")
    if out.get("default") is None:
        out.pop("default", None)
    return out


def _core_type(node: dict[str, Any]) -> dict[str, Any]:
    """The API server's own schema of the core/v1 type a model field asks for (``core_schemas.MARKER``),
    with the field's CEL rules and description; taken as it is (no defaults are added inside it)."""
    out = core_schemas.schema(node[core_schemas.MARKER])
    for name, length in node.get(core_schemas.MAX_LENGTHS, {}).items():
        out["properties"][name]["maxLength"] = length
    if "description" in node:
        out["description"] = " ".join(str(node["description"]).replace("``", "`").split())
    if "x-kubernetes-validations" in node:
        out["x-kubernetes-validations"] = node["x-kubernetes-validations"]
    if any(s.get("type") == "null" for s in node.get("anyOf", [])):
        out["nullable"] = True
    return out


def _object_default(schema: dict[str, Any]) -> dict[str, Any]:
    """The fully defaulted value of an object schema whose properties carry defaults.

    Written out in full (not ``{}``) because the API server checks a default
    against the CEL rules before nested defaults apply.
    """
    return {name: p["default"] for name, p in schema.get("properties", {}).items() if "default" in p}


def structural_schema(model: type[Any]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a pydantic model class."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition manifest for MoEInferenceService."""
    spec = structural_schema(MoEInferenceServiceSpec)
    spec["default"] = _object_default(spec)
    status = structural_schema(MoEInferenceServiceStatus)
    conditions = status["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    conditions.pop("default", None)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{API_GROUP}",
            "labels": {"app.kubernetes.io/name": "moeguard", "app.kubernetes.io/part-of": "moeguard"},
        },
        "spec": {
            "group": API_GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["moeis"],
                "categories": ["moeguard"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-validations": [
                                {"rule": rule, "message": message} for rule, message in NAME_RULES],
                            "description": "A Mixture-of-Experts inference service whose workers run under "
                            "memory-safe token budgets.",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


class _NoAliasDumper(yaml.SafeDumper):
    """A YAML dumper that writes repeated nodes out instead of using anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render() -> str:
    """The CRD as the YAML text committed under ``crds/``."""
    header = ("# Generated by `python -m moeguard_operator.spec.crdgen` from moeguard_operator/spec/models.py. "
              "Do not edit.\n")
    return header + yaml.dump(build_crd(), Dumper=_NoAliasDumper, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed CRD is stale")
    parser.add_argument("--out", type=Path, default=CRD_PATH)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run `make manifests`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
