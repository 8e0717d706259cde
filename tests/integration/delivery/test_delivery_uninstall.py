"""``helm uninstall`` with ``crds.keep=false`` leaves nothing of moeguard (issue 12 §6), against the local API
server: the chart installed, its operator run from the chart's rendered command with the chart's
ServiceAccount, a service reconciled, then uninstalled while the operator still runs. No resource carries a
finalizer (the control loop is one operator-level task, not a kopf timer), so the CRD, every resource and,
through their owner references, every child go, with the chart's RBAC, within 60 s.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from harness.stack import ROOT, wait_for
from tests.integration.delivery.conftest import CHART
from tests.integration.delivery.test_delivery_chart import (
    CRD_NAME,
    _adopt_existing_crds,
    _by_kind,
    _docs,
    _run_rendered_operator,
    _sa_kubeconfig,
    _stop,
)

from moeguard_operator.constants import FINALIZER

CHILD_KINDS = "deployments,services,configmaps,serviceaccounts,roles,rolebindings,poddisruptionbudgets"


def _left(cluster: Any, release: str, ns: str, watched: str) -> list[str]:
    """What is left of the release: the CRDs, moeguard's children, the chart's objects."""
    left = []
    if cluster.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0:
        left.append(f"crd/{CRD_NAME}")
    # Any other CRD the release installed (kopf's peering CRDs with operator.peering.enabled); those kept by
    # an earlier release with peering on are not this release's.
    left += cluster.kubectl("get", "crd", "-o", "name", "-l", f"app.kubernetes.io/instance={release}").stdout.split()
    children = cluster.kubectl("-n", watched, "get", CHILD_KINDS, "-l", "app.kubernetes.io/managed-by=moeguard",
                               "-o", "name", check=False).stdout.split()
    left += children
    for kind in ("clusterroles", "clusterrolebindings"):
        names = cluster.kubectl("get", kind, "-o", "name").stdout.split()
        left += [n for n in names if release in n]
    left += cluster.kubectl("-n", ns, "get", "deployments,serviceaccounts,services", "-o", "name",
                            "-l", f"app.kubernetes.io/instance={release}", check=False).stdout.split()
    return left


def test_uninstall_with_crds_keep_false_leaves_nothing(cluster: Any, helm: Any, tmp_path: Path) -> None:
    release = f"mgu-{uuid.uuid4().hex[:6]}"
    ns, watched = f"{release}-system", f"{release}-apps"
    for name in (ns, watched):
        cluster.kubectl("create", "namespace", name)
    proc = None
    try:
        _adopt_existing_crds(cluster, release, ns, keep=False, peering=False)
        helm("install", release, str(CHART), "--namespace", ns, "--set", "crds.keep=false",
             "--set", f"operator.watchNamespaces={{{watched}}}", "--set", "metrics.enabled=false",
             "--wait", "--timeout", "120s", timeout=200)
        manifest = _docs(helm("get", "manifest", release, "--namespace", ns).stdout)
        dep = next(d for d in _by_kind(manifest, "Deployment"))
        container = dep["spec"]["template"]["spec"]["containers"][0]
        kubeconfig = _sa_kubeconfig(cluster, ns, dep["spec"]["template"]["spec"]["serviceAccountName"],
                                    tmp_path / "sa.kubeconfig")
        log = tmp_path / "operator.log"
        proc = _run_rendered_operator(container, kubeconfig, log)
        cluster.kubectl("apply", "-n", watched, "-f", str(ROOT / "examples" / "moeinferenceservice.yaml"))

        def reconciled() -> dict[str, Any] | None:
            assert proc is not None and proc.poll() is None, f"operator exited:\n{log.read_text()[-3000:]}"
            obj = cluster.kubectl_json("-n", watched, "get", "moeis", "mixtral-tiny")
            return obj if obj.get("status", {}).get("budgets") else None

        obj = wait_for(reconciled, 60, "the sample reconciled by the chart's operator")
        assert FINALIZER not in (obj["metadata"].get("finalizers") or [])
        cluster.kubectl("-n", watched, "get", "deployment", "mixtral-tiny-worker")

        # Once uninstall starts, helm deletes the chart's RBAC while this operator process still runs (a real
        # one is deleted with it): a 403 after that point is the uninstall, not a missing permission.
        before_uninstall = log.read_text()
        start = time.monotonic()
        helm("uninstall", release, "--namespace", ns, "--wait", "--timeout", "60s", timeout=90)
        wait_for(lambda: not _left(cluster, release, ns, watched), 60,
                 f"nothing of release {release} left (left: {_left(cluster, release, ns, watched)})")
        assert time.monotonic() - start < 60
        forbidden = [line for line in before_uninstall.splitlines() if " 403" in line or "forbidden" in line.lower()]
        assert not forbidden, "the chart's RBAC is missing a permission:\n" + "\n".join(forbidden[:5])
    finally:
        if proc is not None:
            _stop(proc)
        helm("uninstall", release, "--namespace", ns, check=False)
        for name in (ns, watched):
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
