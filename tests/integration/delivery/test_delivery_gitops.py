"""GitOps paths against the local API server.

* `crds/` and `examples/` applied twice with server-side apply: the second `kubectl diff --server-side`
  is empty (exit 0), so a GitOps tool that re-applies the same files sees no drift.
* examples/gitops/: the kinds this API server knows are dry-run on it; the chart values that the Flux
  HelmRelease and the Argo CD Application carry render a chart that the API server accepts.
  (The Flux/Argo kinds themselves are schema-checked in tests/unit/delivery.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.stack import ROOT

from moeguard_operator.children.builders import Owner, build_workload, workload_pod_spec
from moeguard_operator.spec.spec_checks import parse_spec

sys.path.insert(0, str(ROOT / "tests" / "unit" / "delivery"))
from test_delivery_gitops_schema import KNOWN_BY_API_SERVER, chart_values

MANAGER = "gitops-test"


def _examples() -> list[Path]:
    return sorted((ROOT / "examples").glob("*.yaml"))


def test_server_side_apply_twice_leaves_no_diff(cluster: Any, namespace: str) -> None:
    files = [ROOT / "crds", *_examples()]
    args = [a for f in files for a in ("-f", str(f))]
    for _ in range(2):
        cluster.kubectl("apply", "--server-side", f"--field-manager={MANAGER}", "-n", namespace, *args)
    diff = cluster.kubectl("diff", "--server-side", f"--field-manager={MANAGER}", "-n", namespace, *args,
                           check=False)
    assert diff.returncode == 0 and diff.stdout == "", f"drift after a second apply:\n{diff.stdout}{diff.stderr}"
    # The operator never writes the spec: whatever status it wrote, the spec fields are still ours alone.
    for example in _examples():
        for doc in yaml.safe_load_all(example.read_text()):
            if doc and doc["kind"] == "MoEInferenceService":
                live = cluster.kubectl_json("-n", namespace, "get", "moeis", doc["metadata"]["name"],
                                            "--show-managed-fields")
                spec_managers = {m["manager"] for m in live["metadata"]["managedFields"]
                                 if m.get("subresource") != "status" and "f:spec" in m.get("fieldsV1", {})}
                assert spec_managers == {MANAGER}, spec_managers


def test_gitops_examples_dry_run(cluster: Any, namespace: str) -> None:
    known = []
    for path in sorted((ROOT / "examples" / "gitops").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and (doc["apiVersion"], doc["kind"]) in KNOWN_BY_API_SERVER:
                known.append(doc)
    assert {d["kind"] for d in known} == {"Namespace", "ConfigMap"}
    for doc in known:
        if doc["kind"] == "ConfigMap":
            doc["metadata"]["namespace"] = namespace  # the argocd namespace does not exist here
    text = yaml.safe_dump_all(known)
    cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=text)


def test_gitops_chart_values_render_and_dry_run(cluster: Any, helm_bin: Any, namespace: str, tmp_path: Path) -> None:
    for i, values in enumerate(chart_values()):
        # The monitoring kinds need prometheus-operator's CRDs, which this API server lacks.
        values = {**values, "serviceMonitor": {"enabled": False}, "prometheusRule": {"enabled": False}}
        vf = tmp_path / f"values-{i}.yaml"
        vf.write_text(yaml.safe_dump(values))
        text = helm_bin("template", "moeguard", str(ROOT / "charts" / "moeguard"), "--namespace", namespace,
                        "--kube-version", "1.34.4", "-f", str(vf)).stdout
        cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=text)


REAL_CHECKPOINT_EXAMPLES = {"qwen3-30b-a3b-pvc.yaml": "persistentVolumeClaim", "qwen1.5-moe-image.yaml": "image",
                            "qwen3-235b-a22b-multinode.yaml": "persistentVolumeClaim"}
"""The examples that serve a real checkpoint, and their source's kind."""


@pytest.mark.parametrize("example", sorted(REAL_CHECKPOINT_EXAMPLES))
def test_real_checkpoint_examples_and_their_deployments_dry_run(cluster: Any, namespace: str, example: str) -> None:
    """Each example (the PVC too) is accepted by the API server as written, passes the operator's own checks,
    and the worker workload the operator would build from it (a Deployment, or for the multi-node example a
    LeaderWorkerSet, through LWS's own webhooks) is accepted as well."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    path = ROOT / "examples" / example
    cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(path))
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    service = next(d for d in docs if d["kind"] == "MoEInferenceService")
    parsed = parse_spec(service["spec"])
    source = parsed.model.source
    assert source is not None and parsed.model.served_model_name and parsed.model.weight_bytes_hint
    kind = REAL_CHECKPOINT_EXAMPLES[example]
    if kind == "persistentVolumeClaim":
        claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
        assert source.persistent_volume_claim is not None
        assert source.persistent_volume_claim.claim_name == claim["metadata"]["name"]
    else:
        assert source.image is not None
    workload = build_workload(Owner(service["metadata"]["name"], namespace, "uid-1"), parsed)
    assert workload["kind"] == ("LeaderWorkerSet" if parsed.parallelism.multi_node else "Deployment")
    res = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(workload))
    container = workload_pod_spec(json.loads(res.stdout))["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MOEGUARD_SERVED_MODEL_NAME"] == parsed.model.served_model_name
    assert env["MOEGUARD_CHECKPOINT_PATH"] == source.checkpoint_path
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(parsed.parallelism.ranks_per_pod)
