"""Every generated delivery file is current (hack/generate.py), and the chart's values are documented."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema_rs
import pytest
import yaml
from hack import generate

from moeguard_operator.spec.crdgen import build_crd

pytestmark = pytest.mark.unit

CHART = generate.CHART


@pytest.mark.parametrize("path", list(generate.GENERATED), ids=lambda p: str(p.relative_to(generate.ROOT)))
def test_generated_file_is_current(path: Any) -> None:
    assert path.exists() and path.read_text() == generate.GENERATED[path](), \
        f"{path.relative_to(generate.ROOT)} is stale: run `make generate`"


def test_chart_crd_template_is_the_generated_crd() -> None:
    text = generate.CHART_CRD.read_text()
    plain = "\n".join(line for line in text.splitlines() if "{{" not in line)
    parsed = yaml.safe_load(plain)
    assert parsed["spec"] == build_crd()["spec"]
    assert parsed["metadata"]["name"] == build_crd()["metadata"]["name"]


def _leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [p for k, v in node.items() for p in _leaf_paths(v, f"{prefix}.{k}" if prefix else k)]
    return [prefix]


def test_every_value_has_a_comment() -> None:
    """Each key in values.yaml whose value is a scalar, list or empty map has a `# --` line right above it
    (helm-docs style), or is nested inside a documented map (e.g. securityContext)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    documented: list[tuple[int, str]] = []
    stack: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z_][\w.-]*):", line)
        if not m or line.lstrip().startswith("#") or line.lstrip().startswith("-"):
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([s[1] for s in stack] + [m.group(2)])
        stack.append((indent, m.group(2)))
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1
        if j >= 0 and lines[j].strip().startswith("# --"):
            documented.append((indent, path))
    doc_paths = {p for _, p in documented}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [p for p in _leaf_paths(values)
               if not any(p == d or p.startswith(d + ".") for d in doc_paths)]
    assert not missing, f"values without a `# --` comment: {missing}"


def test_values_match_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema_rs.validate(schema, values)

    def keys(schema_node: dict[str, Any], value: Any, prefix: str) -> None:
        props = schema_node.get("properties")
        if props is None or not isinstance(value, dict):
            return
        assert set(value) <= set(props), f"{prefix}: values not in the schema: {set(value) - set(props)}"
        undocumented = set(props) - set(value) - {"global"}
        assert not undocumented, f"{prefix}: schema keys missing from values.yaml: {undocumented}"
        for k, v in value.items():
            keys(props[k], v, f"{prefix}.{k}")

    keys(schema, values, "values")
    bad = {**values, "operator": {**values["operator"], "logLevel": "LOUD"}}
    assert not jsonschema_rs.validator_for(schema).is_valid(bad)


OPERATOR_METRICS = {"moeguard_operator_budget_at_floor", "moeguard_operator_metrics_available",
                    "moeguard_operator_diagnosis_finding"}
"""Operator metrics the chart's alerts read (the operator's --metrics-port endpoint, issue 4; the diagnosis
findings, issue 14)."""
KUBE_METRICS = {"kube_pod_container_resource_limits", "kube_pod_container_status_restarts_total",
                "kube_pod_container_status_last_terminated_reason", "up"}
"""kube-state-metrics and Prometheus' own series."""


def _exposed_worker_metrics() -> set[str]:
    return {name for f in generate.worker_metric_families() for name in f["exposed"]}


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:moeguard|kube)_[a-z0-9_]+)", expr))


def test_dashboard_reads_only_existing_metrics() -> None:
    exposed = _exposed_worker_metrics() | KUBE_METRICS
    dashboard = generate.build_dashboard()
    used = {n for p in dashboard["panels"] for t in p["targets"] for n in _metric_names(t["expr"])}
    used |= {n for v in dashboard["templating"]["list"] for n in _metric_names(str(v.get("query", "")))}
    assert used and used <= exposed, f"unknown metrics: {used - exposed}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("skew", "memory", "budgets", "rejections", "latency"):
        assert topic in titles


def test_alerts_read_only_known_metrics() -> None:
    text = (CHART / "templates" / "prometheusrule.yaml").read_text()
    exprs = " ".join(re.findall(r"expr: (.*(?:\n\s{12}.*)*)", text))
    used = _metric_names(exprs)
    known = _exposed_worker_metrics() | KUBE_METRICS | OPERATOR_METRICS
    assert used and used <= known, f"unknown metrics: {used - known}"


def test_metrics_doc_lists_every_worker_metric() -> None:
    text = generate.render_metrics_doc()
    for f in generate.worker_metric_families():
        assert f"`{f['exposed'][0]}`" in text


def test_crd_reference_documents_every_spec_field() -> None:
    text = generate.render_crd_reference()
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

    def walk(node: dict[str, Any], prefix: str) -> None:
        for name, sub in node.get("properties", {}).items():
            assert f"`{prefix}.{name}`" in text
            walk(sub, f"{prefix}.{name}")

    walk(spec, ".spec")
