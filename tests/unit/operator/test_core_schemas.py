"""core/v1 OpenAPI → structural schema (pure)."""

from __future__ import annotations

import pytest

from moeguard_operator.spec.core_schemas import TYPES, embedded, schema, structural_from_openapi

pytestmark = pytest.mark.unit

DOC = {"components": {"schemas": {
    "io.k8s.api.core.v1.Thing": {
        "description": "dropped", "type": "object", "required": ["name"],
        "properties": {
            "name": {"type": "string", "default": ""},
            "port": {"allOf": [{"$ref": "#/components/schemas/io.k8s.apimachinery.pkg.util.intstr.IntOrString"}]},
            "size": {"$ref": "#/components/schemas/io.k8s.apimachinery.pkg.api.resource.Quantity"},
            "items": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["k"],
                      "items": {"$ref": "#/components/schemas/io.k8s.api.core.v1.Inner"}},
            "labels": {"type": "object", "additionalProperties": {"type": "string", "default": ""}},
        },
    },
    "io.k8s.api.core.v1.Inner": {"properties": {"k": {"type": "string", "enum": ["a", "b"]}}},
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString": {"format": "int-or-string",
                                                         "oneOf": [{"type": "integer"}, {"type": "string"}]},
    "io.k8s.apimachinery.pkg.api.resource.Quantity": {"oneOf": [{"type": "string"}, {"type": "number"}]},
    "io.k8s.api.core.v1.Loop": {"properties": {"self": {"$ref": "#/components/schemas/io.k8s.api.core.v1.Loop"}}},
}}}


def test_refs_inlined_int_or_string_and_descriptions_and_defaults_dropped() -> None:
    assert structural_from_openapi(DOC, "Thing") == {
        "type": "object", "required": ["name"],
        "properties": {
            "name": {"type": "string"},
            "port": {"x-kubernetes-int-or-string": True},
            "size": {"x-kubernetes-int-or-string": True},
            "items": {"type": "array", "x-kubernetes-list-type": "atomic",
                      "items": {"type": "object", "properties": {"k": {"type": "string", "enum": ["a", "b"]}}}},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }


def test_recursive_schemas_are_refused() -> None:
    with pytest.raises(ValueError, match="recursive"):
        structural_from_openapi(DOC, "Loop")


def test_the_committed_file_holds_every_type_structurally() -> None:
    assert set(embedded()) == set(TYPES)
    volume = schema("Volume")
    assert volume["required"] == ["name"] and "hostPath" in volume["properties"]
    schema("Volume")["properties"].clear()  # a copy: the cache is untouched
    assert "hostPath" in schema("Volume")["properties"]

    def walk(node: object) -> None:
        if isinstance(node, dict):
            assert "$ref" not in node and "description" not in node and "oneOf" not in node
            if "properties" in node:
                assert node["type"] == "object"
            for value in node.values():
                walk(value)
    walk(embedded())
