from __future__ import annotations

from typing import Any

import pytest
import yaml

from moeguard_operator.spec import crdgen

pytestmark = pytest.mark.unit


def test_committed_crd_matches_models() -> None:
    committed = crdgen.CRD_PATH.read_text()
    assert committed == crdgen.render(), "crds/ is stale: run `make manifests`"


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    if isinstance(node, dict):
        if "type" in node or "properties" in node or "items" in node:
            out.append((path, node))
        for key in ("properties",):
            for name, child in node.get(key, {}).items():
                out += _walk(child, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            out += _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_schema_is_structural() -> None:
    schema = yaml.safe_load(crdgen.render())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    nodes = _walk(schema)
    assert len(nodes) > 30
    for path, node in nodes:
        assert "type" in node, f"{path} has no type"
        for banned in ("$ref", "anyOf", "title", "const", "$defs"):
            assert banned not in node, f"{path} has {banned}"
        if "properties" in node:
            assert node.get("additionalProperties") is not False, path
        if isinstance(node.get("exclusiveMinimum"), bool):
            assert "minimum" in node, path


def test_crd_carries_cel_rules_defaults_and_columns() -> None:
    crd = crdgen.build_crd()
    version = crd["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = spec["properties"]["resources"]["x-kubernetes-validations"]
    assert rules[0]["rule"] == "quantity(self.softLimit).isLessThan(quantity(self.hardLimit))"
    assert spec["properties"]["batching"]["properties"]["maxPrefillTokens"]["minimum"] == 1
    assert spec["properties"]["batching"]["properties"]["maxPrefillTokens"]["default"] == 4096
    assert "default" not in spec["properties"]["ucx"]["properties"]["mode"]  # unset: none, or rcache on AMD
    assert spec["properties"]["ucx"]["properties"]["rcacheMaxUnreleased"]["default"] == 1024
    assert spec["properties"]["control"]["properties"]["decreaseFactor"]["exclusiveMaximum"] is True
    rules = {r["rule"] for r in spec["properties"]["batching"]["x-kubernetes-validations"]}
    assert "self.floors.queueTimeoutSeconds <= self.queueTimeoutSeconds" in rules
    assert "!has(self.ceilings.maxPrefillTokens) || self.maxPrefillTokens <= self.ceilings.maxPrefillTokens" in rules
    template = spec["properties"]["template"]["properties"]
    # the API server's own core/v1 schemas, not free-form objects
    assert "x-kubernetes-preserve-unknown-fields" not in template["affinity"]
    assert set(template["affinity"]["properties"]) == {"nodeAffinity", "podAffinity", "podAntiAffinity"}
    assert {"persistentVolumeClaim", "hostPath", "image"} <= set(template["volumes"]["items"]["properties"])
    assert template["volumes"]["items"]["required"] == ["name"]
    assert template["tolerations"]["items"]["properties"]["key"]["maxLength"] == 316
    assert spec["properties"]["resources"]["default"]["softLimit"] == "6Gi"
    assert crd["spec"]["names"]["shortNames"] == ["moeis"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Ready", "Replicas", "Prefill", "Skew", "RSS %", "Overload", "Model", "Age"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
