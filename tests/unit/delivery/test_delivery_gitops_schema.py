"""examples/gitops/: the Flux and Argo CD objects against their schemas (gitops_schemas.py, hand-written:
no official JSON schema is reachable here), and the chart values they carry against values.schema.json.
The kinds the API server knows (Namespace, ConfigMap) are dry-run in tests/integration/delivery."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from gitops_schemas import SCHEMAS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
GITOPS = ROOT / "examples" / "gitops"
VALUES_SCHEMA = json.loads((ROOT / "charts" / "moeguard" / "values.schema.json").read_text())
KNOWN_BY_API_SERVER = {("v1", "Namespace"), ("v1", "ConfigMap")}


def _objects() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted(GITOPS.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def test_examples_exist() -> None:
    kinds = {d["kind"] for _, d in _objects()}
    assert {"HelmRelease", "Application", "Kustomization", "GitRepository"} <= kinds


@pytest.mark.parametrize("item", _objects(), ids=lambda i: f"{i[0]}:{i[1]['kind']}/{i[1]['metadata']['name']}")
def test_object_matches_schema(item: tuple[str, dict[str, Any]]) -> None:
    _, obj = item
    key = (obj["apiVersion"], obj["kind"])
    if key in KNOWN_BY_API_SERVER:
        return  # dry-run against the API server in the integration tests
    assert key in SCHEMAS, f"no schema for {key}"
    jsonschema_rs.validate(SCHEMAS[key], obj)


def test_schemas_catch_mistakes() -> None:
    hr = next(d for _, d in _objects() if d["kind"] == "HelmRelease")
    validator = jsonschema_rs.validator_for(SCHEMAS[("helm.toolkit.fluxcd.io/v2", "HelmRelease")])
    assert validator.is_valid(hr)
    assert not validator.is_valid({**hr, "spec": {**hr["spec"], "install": {"crds": "Replace"}}})
    assert not validator.is_valid({**hr, "spec": {**hr["spec"], "intreval": "1m"}})
    no_interval = {k: v for k, v in hr["spec"].items() if k != "interval"}
    assert not validator.is_valid({**hr, "spec": no_interval})


def chart_values() -> list[dict[str, Any]]:
    """The chart values carried by the HelmRelease and the Argo CD Application that installs the chart."""
    out = []
    for _, d in _objects():
        if d["kind"] == "HelmRelease":
            out.append(d["spec"]["values"])
        elif d["kind"] == "Application" and d["spec"]["source"].get("path") == "charts/moeguard":
            out.append(d["spec"]["source"]["helm"]["valuesObject"])
    return out


def test_chart_values_match_values_schema() -> None:
    values = chart_values()
    assert len(values) == 2
    for v in values:
        jsonschema_rs.validate(VALUES_SCHEMA, v)
