"""Every MoEInferenceService in examples/ is a spec the operator accepts without a memory warning (``parse_spec``:
the pydantic models the CRD is generated from; the API server's own schema and CEL rules are exercised by the
integration tests that apply examples)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moeguard_core import contract
from moeguard_operator.children.builders import Owner, build_children
from moeguard_operator.spec.spec_checks import memory_warnings, parse_spec

pytestmark = pytest.mark.unit

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.yaml"))


def _services(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == contract.KIND]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_each_example_service_parses_and_renders(path: Path) -> None:
    services = _services(path)
    assert services, f"{path.name} holds no {contract.KIND}"
    for doc in services:
        spec = parse_spec(doc.get("spec") or {})
        assert memory_warnings(spec) == []
        children = build_children(Owner(doc["metadata"]["name"], "default", "uid"), spec)
        kinds = {m["kind"] for m in children}
        assert {"Service", "ServiceAccount"} <= kinds


def test_the_disaggregated_example_has_both_roles() -> None:
    (doc,) = _services(Path(__file__).resolve().parents[3] / "examples" / "qwen3-30b-a3b-disaggregated.yaml")
    spec = parse_spec(doc["spec"])
    names = {m["metadata"]["name"] for m in build_children(Owner(doc["metadata"]["name"], "default", "uid"), spec)}
    assert {"qwen3-30b-a3b-pd-worker", "qwen3-30b-a3b-pd-prefill-worker", "qwen3-30b-a3b-pd-prefill"} <= names
