#!/usr/bin/env python3
"""Render LWS's webhook configurations for the local control plane (used by hack/cluster-up.sh).

The LeaderWorkerSet module ships ``config/webhook/manifests.yaml`` (generated from its kubebuilder
markers) and two kustomize patches that narrow the pod webhooks to LWS's own pods (an
``objectSelector`` on ``leaderworkerset.sigs.k8s.io/name``; the mutating one also on UPDATE).
hack/build-binaries.sh copies all three next to the manager binary. In a cluster, kustomize points
``clientConfig.service`` at the manager's Service in ``lws-system``; here the manager runs as a
process on loopback, so each webhook gets ``clientConfig.url: https://127.0.0.1:<port><path>`` and the
``caBundle`` of the CA that signed its serving certificate. Names get kustomize's ``lws-`` prefix.

    hack/lws_webhooks.py WEBHOOK_DIR PORT CA_FILE   # prints a JSON List for `kubectl apply -f -`
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any

import yaml


def apply_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """The JSON-patch ops kustomize applies here: ``replace`` of ``/webhooks/<i>``.

    Raises:
        ValueError: any other op or path (a new LWS version changed its patches: look again).
    """
    for op in ops:
        parts = str(op.get("path", "")).strip("/").split("/")
        if op.get("op") != "replace" or len(parts) != 2 or parts[0] != "webhooks" or not parts[1].isdigit():
            raise ValueError(f"unsupported patch op {op!r}")
        doc["webhooks"][int(parts[1])] = op["value"]


def render(webhook_dir: Path, port: int, ca_pem: bytes) -> dict[str, Any]:
    """The Mutating- and ValidatingWebhookConfiguration, pointed at ``https://127.0.0.1:<port>``."""
    docs = [d for d in yaml.safe_load_all((webhook_dir / "manifests.yaml").read_text()) if d]
    patches = {"MutatingWebhookConfiguration": webhook_dir / "mutating-patch.yaml",
               "ValidatingWebhookConfiguration": webhook_dir / "validating-patch.yaml"}
    ca = base64.b64encode(ca_pem).decode()
    for doc in docs:
        apply_patch(doc, yaml.safe_load(patches[doc["kind"]].read_text()))
        doc["metadata"] = {"name": f"lws-{doc['metadata']['name']}",
                           "labels": {"app.kubernetes.io/part-of": "lws", "app.kubernetes.io/managed-by": "moeguard-hack"}}
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}
    return {"apiVersion": "v1", "kind": "List", "items": docs}


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    webhook_dir, port, ca_file = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    json.dump(render(webhook_dir, port, ca_file.read_bytes()), sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
