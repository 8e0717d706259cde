"""The core/v1 schemas embedded in the CRD are the running API server's own (pinned Kubernetes version)."""

from __future__ import annotations

import json

from tests.integration.conftest import Cluster

from moeguard_operator.spec.core_schemas import build_file, embedded


def test_embedded_core_schemas_equal_the_api_servers(cluster: Cluster) -> None:
    document = json.loads(cluster.kubectl("get", "--raw", "/openapi/v3/api/v1").stdout)
    live = build_file(document)
    stale = sorted(name for name in live if live[name] != embedded().get(name))
    assert not stale, f"core_v1.json differs from the API server for {stale}: run hack/core_schemas.py"
