"""`moeguard diagnose` as a user runs it, against the real local control plane and the stack's Prometheus: a
MoEInferenceService whose status.diagnosis holds a finding (written through the status subresource as the
operator writes it: a merge patch), a Warning Event about it, and no workers (so Prometheus answers, with no
series: every timeline signal is named as "no data"); then Prometheus unreachable, an absent service and an
unreachable API server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from harness import stack
from harness.stack import ROOT
from tests.integration.conftest import Cluster

PATCH = '{"spec":{"batching":{"maxConcurrentBatches":1}}}'


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    stack.wait_established("moeinferenceservices.moeguard.dev", run_dir=cluster.run_dir)


def diagnose(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": stack.tools_env(cluster.run_dir)["PYTHONPATH"], "COLUMNS": "200"}
    env.pop("MOEGUARD_PROMETHEUS_URL", None)
    return subprocess.run([sys.executable, "-m", "moeguard_cli", "diagnose", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def _iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _service_with_finding(cluster: Cluster, namespace: str) -> None:
    obj = {"apiVersion": "moeguard.dev/v1alpha1", "kind": "MoEInferenceService",
           "metadata": {"name": "burst", "namespace": namespace},
           "spec": {"replicas": 0, "resources": {"gpus": 0, "softLimit": "1Gi", "hardLimit": "2Gi"}}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    now = datetime.now(UTC).replace(microsecond=0)
    since = now - timedelta(minutes=3)
    status = {"status": {"diagnosis": {
        "time": _iso(now),
        "findings": [{
            "kind": "BurstOverlap", "since": _iso(since), "lastSeen": _iso(now),
            "message": "3 prefill batches overlapped while memory reached 91% of the hard limit",
            "evidence": [{"signal": "prefill batches in flight", "value": 3, "unit": "batches",
                          "metric": "moeguard_step_prefill_batches", "pod": "burst-0"}],
            "remedy": "Let one prefill run at a time: lower maxConcurrentBatches to 1.",
            "patch": PATCH, "pods": ["burst-0"]}],
        "missingSignals": []}}}
    cluster.kubectl("-n", namespace, "patch", "moeis", "burst", "--subresource=status", "--type", "merge",
                    "-p", json.dumps(status))
    uid = cluster.kubectl_json("-n", namespace, "get", "moeis", "burst")["metadata"]["uid"]
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": "burst.", "namespace": namespace},
             "involvedObject": {"apiVersion": "moeguard.dev/v1alpha1", "kind": "MoEInferenceService",
                                "name": "burst", "namespace": namespace, "uid": uid},
             "type": "Warning", "reason": "BurstOverlap", "message": "3 prefill batches overlapped",
             "firstTimestamp": _iso(since), "lastTimestamp": _iso(since), "count": 1,
             "source": {"component": "moeguard"}}
    cluster.kubectl("create", "-f", "-", input=json.dumps(event))


def test_diagnose_names_the_finding_the_patch_and_the_empty_timeline(cluster: Cluster, crd: None, namespace: str,
                                                                     tmp_path: Path) -> None:
    _service_with_finding(cluster, namespace)
    kc = str(cluster.kubeconfig)
    res = diagnose(cluster, "burst", "-n", namespace, "--kubeconfig", kc, "--prometheus-url",
                   cluster.prometheus_url, "-o", "json", "--minutes", "5")
    assert res.returncode == 0, res.stderr
    doc: dict[str, Any] = json.loads(res.stdout)
    (finding,) = doc["findings"]
    assert finding["kind"] == "BurstOverlap" and finding["pods"] == ["burst-0"]
    assert finding["patch_command"] == f"kubectl -n {namespace} patch moeis burst --type merge -p '{PATCH}'"
    # an operator running on the shared cluster may add its own (Reconciled): ours must be there
    assert ("Warning", "BurstOverlap", "3 prefill batches overlapped") in [
        (e["type"], e["reason"], e["message"]) for e in doc["events"]]
    assert len(doc["timeline"]["times"]) == 11
    # Prometheus answered, but no worker ever exported a series: every signal is missing, never 0.
    assert set(doc["timeline"]["missing"].values()) == {"no data"}
    assert {"memory_bytes", "skew_ratio", "refusals_per_second", "batches_in_flight", "queue_requests",
            "kv_cache_bytes"} <= set(doc["timeline"]["missing"])
    assert all(v is None for vs in doc["timeline"]["values"].values() for v in vs)
    assert res.stderr == ""  # no progress when stderr is not a terminal

    png = tmp_path / "t.png"
    text = diagnose(cluster, "burst", "-n", namespace, "--kubeconfig", kc, "--prometheus-url", cluster.prometheus_url,
                    "--plot", str(png))
    assert text.returncode == 0, text.stderr
    assert "BurstOverlap since" in text.stdout and "3 prefill batches overlapped while memory" in text.stdout
    assert f"kubectl -n {namespace} patch moeis burst --type merge -p '{PATCH}'" in text.stdout
    assert "memory (memory_bytes): no data" in text.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_diagnose_without_prometheus_still_reports_the_finding(cluster: Cluster, crd: None, namespace: str) -> None:
    _service_with_finding(cluster, namespace)
    res = diagnose(cluster, "burst", "-n", namespace, "--kubeconfig", str(cluster.kubeconfig), "--prometheus-url",
                   "http://127.0.0.1:1", "-o", "json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["findings"][0]["kind"] == "BurstOverlap"
    assert set(doc["timeline"]["missing"].values()) == {"PrometheusUnreachable"}
    assert len(doc["timeline"]["missing"]) == 13


def test_absent_service_and_unreachable_api_server_are_one_line(cluster: Cluster, crd: None, namespace: str,
                                                                 tmp_path: Path) -> None:
    res = diagnose(cluster, "nope", "-n", namespace, "--kubeconfig", str(cluster.kubeconfig))
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.startswith(f"error: MoEInferenceService {namespace}/nope not found")
    assert len(res.stderr.strip().splitlines()) == 1
    kc = tmp_path / "kubeconfig"
    kc.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "x", "cluster": {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "x", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "x", "user": "x", "namespace": namespace}}]}))
    res = diagnose(cluster, "burst", "--kubeconfig", str(kc))
    assert res.returncode == 1
    assert res.stderr.strip() == "error: cannot reach the API server at https://127.0.0.1:1 ([Errno 111] Connection refused)"
