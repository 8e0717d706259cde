"""charts/moeguard against helm and the local control plane.

* ``helm lint --strict`` with defaults and with every option on;
* ``helm template | kubectl apply --dry-run=server`` (the API server validates every object, the CRD
  included); the prometheus-operator kinds are not known to this API server (their CRDs are not
  reachable here as files), so those templates are checked with ``promtool`` and YAML assertions;
* ``helm install`` into a namespace that enforces Pod Security "restricted" → the operator Deployment
  is Available (kwok marks the pod Running); then the operator, started on this machine from the
  chart's rendered command and args with the chart's ServiceAccount token (so with exactly the
  chart's RBAC), reconciles the sample; ``helm upgrade`` with changed values; ``helm uninstall``
  leaves the CRD (``crds.keep``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.stack import ROOT, tools_env, wait_for

from moeguard_operator.spec.crdgen import build_crd
from moeguard_operator.spec.models import FINDING_KINDS

CHART = ROOT / "charts" / "moeguard"
CRD_NAME = "moeinferenceservices.moeguard.dev"
ALL_OPTIONS = ("prometheusRule.enabled=true", "serviceMonitor.enabled=true", "grafanaDashboard.enabled=true",
               "operator.peering.enabled=true", "replicaCount=2", "operator.allowSecrets=true",
               "operator.prometheus.allowedUrls={https://prom.example}", "operator.prometheus.caBundle.configMap=ca")


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _operator_supports(flag: str) -> bool:
    env = {**os.environ, "PYTHONPATH": tools_env()["PYTHONPATH"]}
    out = subprocess.run([sys.executable, "-m", "moeguard_operator", "--help"], env=env, capture_output=True,
                         text=True, timeout=60).stdout
    return flag in out


def test_lint(helm_bin: Any) -> None:
    helm_bin("lint", str(CHART), "--strict", "--kube-version", "1.34.4")
    sets = ",".join(ALL_OPTIONS)
    helm_bin("lint", str(CHART), "--strict", "--kube-version", "1.34.4", "--set", sets)


def test_values_are_validated_by_the_schema(helm_bin: Any) -> None:
    res = helm_bin("template", "x", str(CHART), "--kube-version", "1.34.4", "--set", "operator.logLevel=LOUD",
                   check=False)
    assert res.returncode != 0 and "logLevel" in res.stderr
    res = helm_bin("template", "x", str(CHART), "--kube-version", "1.34.4", "--set", "replicaCount=2", check=False)
    assert res.returncode != 0 and "peering" in res.stderr
    res = helm_bin("template", "x", str(CHART), "--kube-version", "1.34.4", "--set", "operator.policy=aimd",
                   check=False)
    assert res.returncode != 0 and "policy" in res.stderr


def test_the_policy_value_reaches_the_operator(template: Any) -> None:
    from moeguard_operator.__main__ import parse_args

    for sets, policy in (((), "predictive"), (("operator.policy=threshold",), "threshold")):
        args = _by_kind(_docs(template(*sets)), "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--policy={policy}" in args
        assert parse_args(args)[1].policy == policy


def test_template_dry_run_server(cluster: Any, template: Any, namespace: str) -> None:
    for sets in ((), ("operator.peering.enabled=true", "replicaCount=2", f"operator.watchNamespaces={{{namespace}}}")):
        text = template(*sets, release="dry", namespace=namespace, extra=("--no-hooks",))
        res = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=text)
        applied = res.stdout
        for kind in ("customresourcedefinition", "clusterrole", "clusterrolebinding", "serviceaccount",
                     "deployment", "service"):
            assert kind in applied, applied


def test_chart_crd_equals_the_generated_crd(template: Any) -> None:
    crds = _by_kind(_docs(template()), "CustomResourceDefinition")
    assert [c["metadata"]["name"] for c in crds] == [CRD_NAME]
    assert crds[0]["spec"] == build_crd()["spec"]
    assert crds[0]["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    kept = _by_kind(_docs(template("crds.keep=false")), "CustomResourceDefinition")[0]
    assert "annotations" not in kept["metadata"]
    assert not _by_kind(_docs(template("crds.enabled=false")), "CustomResourceDefinition")


def test_rbac_is_explicit_and_split(template: Any) -> None:
    docs = _docs(template(*ALL_OPTIONS))
    roles = {d["metadata"]["name"]: d for d in _by_kind(docs, "ClusterRole")}
    assert set(roles) == {"mg-moeguard-framework", "mg-moeguard-application"}
    for role in roles.values():
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    framework = {r for rule in roles["mg-moeguard-framework"]["rules"] for r in rule["resources"]}
    assert framework == {"customresourcedefinitions", "namespaces", "events", "clusterkopfpeerings"}
    app = {r for rule in roles["mg-moeguard-application"]["rules"] for r in rule["resources"]}
    assert "moeinferenceservices/status" in app and "events" not in app
    standalone = _docs(template())
    fw = next(d for d in _by_kind(standalone, "ClusterRole") if d["metadata"]["name"].endswith("framework"))
    assert not any("kopf.dev" in rule["apiGroups"] for rule in fw["rules"]), "peering rules only with peering"


def test_names_are_truncated_to_63(template: Any) -> None:
    release = "r" * 53  # helm's longest release name; + "-moeguard-application" is 74 before truncation
    for d in _docs(template(release=release)):
        assert len(d["metadata"]["name"]) <= 63, d["metadata"]["name"]
        for value in d["metadata"].get("labels", {}).values():
            assert len(str(value)) <= 63


def test_pod_security_restricted_by_default(template: Any) -> None:
    dep = _by_kind(_docs(template()), "Deployment")[0]
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = pod["containers"][0]["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert dep["spec"]["strategy"] == {"type": "Recreate"}, "standalone kopf: never two operators at once"


def test_monitoring_templates(template: Any, tmp_path: Path) -> None:
    docs = _docs(template(*ALL_OPTIONS))
    sm = _by_kind(docs, "ServiceMonitor")[0]
    svc = _by_kind(docs, "Service")[0]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    rule = _by_kind(docs, "PrometheusRule")[0]
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    findings = {f"Moeguard{kind}" for kind in FINDING_KINDS}
    assert alerts == {"MoeguardBudgetAtFloor", "MoeguardMemoryNearHardLimit", "MoeguardMemoryLeakSuspected",
                      "MoeguardOperatorMetricsUnavailable", "MoeguardMetricsUnavailable", "MoeguardOOMKilled",
                      "MoeguardWorkerUCXUnbounded", *findings}
    by_name = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    for kind in FINDING_KINDS:
        alert = by_name[f"Moeguard{kind}"]
        assert alert["expr"] == f'max by (namespace, moeis) (moeguard_operator_diagnosis_finding{{kind="{kind}"}}) == 1'
        assert alert["labels"]["kind"] == kind
        assert alert["annotations"]["runbook_url"].endswith(f"docs/runbook.md#{kind.lower()}")
        assert alert["annotations"]["diagnose"] == "moeguard diagnose {{ $labels.moeis }} -n {{ $labels.namespace }}"
        assert f"### {kind}\n" in (ROOT / "docs" / "runbook.md").read_text()
    off = _by_kind(_docs(template("prometheusRule.enabled=true", "prometheusRule.disabled={MoeguardOOMKilled}")),
                   "PrometheusRule")[0]
    assert "MoeguardOOMKilled" not in {r["alert"] for g in off["spec"]["groups"] for r in g["rules"]}
    cm = next(d for d in _by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("dashboard"))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["moeguard.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "moeguard.json").read_text())
    peering = _by_kind(docs, "ClusterKopfPeering")[0]
    assert peering["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"


def test_alert_rules_with_promtool(template: Any, tmp_path: Path) -> None:
    """promtool parses every expression and the unit tests fire the alerts on synthetic series."""
    import shutil
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian package prometheus) is missing")
    rule = _by_kind(_docs(template("prometheusRule.enabled=true")), "PrometheusRule")[0]
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    res = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    # promtool compares annotations too; the unit tests assert labels and timing, so drop them there.
    bare = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
            for g in rule["spec"]["groups"]]
    rules_file.write_text(yaml.safe_dump({"groups": bare}))
    tests = Path(__file__).with_name("alerts_test.yaml").read_text()
    (tmp_path / "alerts_test.yaml").write_text(tests)
    res = subprocess.run([promtool, "test", "rules", "alerts_test.yaml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


# --- install, reconcile, upgrade, uninstall --------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sa_kubeconfig(cluster: Any, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount (a short-lived bound token)."""
    token = cluster.kubectl("-n", namespace, "create", "token", sa, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    server = admin["clusters"][0]["cluster"]["server"]
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "local", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "local", "user": sa, "namespace": namespace}}],
    }))
    return path


def _deployment_available(cluster: Any, namespace: str, name: str, replicas: int) -> bool:
    dep = cluster.kubectl_json("-n", namespace, "get", "deployment", name)
    conds = {c["type"]: c["status"] for c in dep.get("status", {}).get("conditions", [])}
    return conds.get("Available") == "True" and dep["status"].get("availableReplicas") == replicas \
        and dep["status"].get("updatedReplicas") == replicas


def _run_rendered_operator(container: dict[str, Any], kubeconfig: Path, log: Path) -> subprocess.Popen[bytes]:
    """Start the operator as the chart's container would run it: its command and args, with
    ``python`` → this interpreter and the ports moved to free ones (other operators may run here)."""
    command = list(container["command"])
    assert command[:3] == ["python", "-m", "moeguard_operator"], command
    command[0] = sys.executable
    args = []
    for arg in container["args"]:
        if arg.startswith("--liveness="):
            arg = f"--liveness=http://127.0.0.1:{_free_port()}/healthz"
        elif arg.startswith("--metrics-port="):
            arg = f"--metrics-port={_free_port()}"
        args.append(arg)
    env = {**tools_env(), "KUBECONFIG": str(kubeconfig), "POD_ID": "local-test"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
    return subprocess.Popen([*command, *args], env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def _adopt_existing_crds(cluster: Any, release: str, namespace: str, *, keep: bool = True,
                         peering: bool = True) -> None:
    """The chart's CRDs may already be in this shared cluster: applied from crds/ by other tests, or kept
    (crds.keep) by an earlier release. Helm adopts an existing object that carries its ownership
    metadata — the documented path from `kubectl apply -f crds/`, or from an uninstalled release, to a
    new release. Adoption does not remove an annotation the new manifest lacks, and `helm uninstall` obeys
    the live object's `helm.sh/resource-policy: keep`: a release installed with ``crds.keep=false`` over
    kept CRDs must drop it first (docs/gitops.md). kopf's peering CRDs are the release's only with
    ``peering``."""
    names = (CRD_NAME, "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev") if peering else (CRD_NAME,)
    for name in names:
        if cluster.kubectl("get", "crd", name, check=False).returncode != 0:
            continue
        cluster.kubectl("label", "--overwrite", "crd", name, "app.kubernetes.io/managed-by=Helm")
        cluster.kubectl("annotate", "--overwrite", "crd", name, f"meta.helm.sh/release-name={release}",
                        f"meta.helm.sh/release-namespace={namespace}")
        if not keep:
            cluster.kubectl("annotate", "crd", name, "helm.sh/resource-policy-")


def test_install_reconcile_upgrade_uninstall(cluster: Any, helm: Any, tmp_path: Path) -> None:
    release = f"mg-{uuid.uuid4().hex[:6]}"
    ns = f"{release}-system"
    watched = f"{release}-apps"
    for name in (ns, watched):
        cluster.kubectl("create", "namespace", name)
    # The API server's PodSecurity admission rejects any pod that is not "restricted".
    cluster.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted",
                    "pod-security.kubernetes.io/enforce-version=latest")
    metrics = "true" if _operator_supports("--metrics-port") else "false"
    base = ["--namespace", ns, "--set", f"operator.watchNamespaces={{{watched}}}",
            "--set", f"metrics.enabled={metrics}", "--wait", "--timeout", "120s"]
    fullname = f"{release}-moeguard"
    proc: subprocess.Popen[bytes] | None = None
    try:
        _adopt_existing_crds(cluster, release, ns)
        helm("install", release, str(CHART), *base, timeout=200)
        assert _deployment_available(cluster, ns, fullname, 1)
        assert cluster.kubectl("get", "crd", CRD_NAME).returncode == 0

        # The operator, from the chart's rendered command and args, with the chart's ServiceAccount.
        manifest = _docs(helm("get", "manifest", release, "--namespace", ns).stdout)
        dep = next(d for d in _by_kind(manifest, "Deployment"))
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert f"--namespace={watched}" in container["args"] and "--standalone" in container["args"]
        kubeconfig = _sa_kubeconfig(cluster, ns, dep["spec"]["template"]["spec"]["serviceAccountName"],
                                    tmp_path / "sa.kubeconfig")
        log = tmp_path / "operator.log"
        proc = _run_rendered_operator(container, kubeconfig, log)
        cluster.kubectl("apply", "-n", watched, "-f", str(ROOT / "examples" / "moeinferenceservice.yaml"))

        def reconciled() -> dict[str, Any] | None:
            assert proc is not None and proc.poll() is None, f"operator exited:\n{log.read_text()[-3000:]}"
            obj = cluster.kubectl_json("-n", watched, "get", "moeis", "mixtral-tiny")
            status = obj.get("status", {})
            return status if status.get("observedGeneration") == obj["metadata"]["generation"] \
                and status.get("budgets") else None

        status = wait_for(reconciled, 60, "the sample reconciled by the chart's operator")
        assert status["budgets"]["maxPrefillTokens"] == 2048
        for kind, name in (("deployment", "mixtral-tiny-worker"), ("service", "mixtral-tiny"),
                           ("configmap", "mixtral-tiny-budget"), ("role", "mixtral-tiny-worker"),
                           ("rolebinding", "mixtral-tiny-worker"), ("serviceaccount", "mixtral-tiny-worker")):
            cluster.kubectl("-n", watched, "get", kind, name)
        forbidden = [line for line in log.read_text().splitlines() if "403" in line or "forbidden" in line.lower()]
        assert not forbidden, "the chart's RBAC is missing a permission:\n" + "\n".join(forbidden[:5])
        cluster.kubectl("-n", watched, "delete", "moeis", "mixtral-tiny", "--wait=true", timeout=120)
        _stop(proc)

        # helm upgrade with changed values: DEBUG logs, two replicas under kopf peering.
        helm("upgrade", release, str(CHART), *base, "--set", "operator.logLevel=DEBUG", "--set",
             "operator.peering.enabled=true", "--set", "replicaCount=2", timeout=200)
        wait_for(lambda: _deployment_available(cluster, ns, fullname, 2), 60, "2 available operator replicas")
        args = cluster.kubectl_json("-n", ns, "get", "deployment", fullname)["spec"]["template"]["spec"][
            "containers"][0]["args"]
        assert "--log-level=DEBUG" in args and "--peering=moeguard" in args and "--standalone" not in args
        cluster.kubectl("-n", watched, "get", "kopfpeering", "moeguard")
        assert helm("history", release, "--namespace", ns, "-o", "json").stdout.count('"revision"') == 2

        # helm uninstall leaves the CRD (crds.keep=true, the default) and removes the rest.
        helm("uninstall", release, "--namespace", ns, "--wait", timeout=120)
        assert cluster.kubectl("get", "crd", CRD_NAME).returncode == 0
        crd = cluster.kubectl_json("get", "crd", CRD_NAME)
        assert crd["metadata"]["annotations"].get("helm.sh/resource-policy") == "keep"
        assert cluster.kubectl("get", "clusterrole", f"{fullname}-application", check=False).returncode != 0
        assert cluster.kubectl("-n", ns, "get", "deployment", fullname, check=False).returncode != 0
    finally:
        if proc is not None:
            _stop(proc)
        helm("uninstall", release, "--namespace", ns, check=False)
        for name in (ns, watched):
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_crd_install_paths_agree(template: Any) -> None:
    """`kubectl apply -f crds/` and the chart install the same CRD spec."""
    committed = yaml.safe_load((ROOT / "crds" / f"{CRD_NAME}.yaml").read_text())
    chart = _by_kind(_docs(template()), "CustomResourceDefinition")[0]
    assert committed["spec"] == chart["spec"]


RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


@pytest.mark.parametrize("mode", ["all-namespaces", "watched-namespaces"])
def test_rbac_scope_with_and_without_watch_namespaces(cluster: Any, template: Any, mode: str) -> None:
    """The chart's RBAC, applied to the API server and asked with ``kubectl auth can-i`` as the
    operator's ServiceAccount: with ``operator.watchNamespaces`` the operator may write only in those
    namespaces (issue: cluster-wide roles let it create Roles in kube-system); without, everywhere."""
    release = f"rb{uuid.uuid4().hex[:6]}"
    ns, watched, other = f"{release}-system", f"{release}-apps", f"{release}-other"
    sets = ["rbac.create=true", "operator.peering.enabled=true"]
    if mode == "watched-namespaces":
        sets.append(f"operator.watchNamespaces={{{watched}}}")
    docs = [d for d in _docs(template(*sets, release=release, namespace=ns)) if d["kind"] in RBAC_KINDS]
    # can-i resolves resource names through discovery: the CRD must be served
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    for name in (ns, watched, other):
        cluster.kubectl("create", "namespace", name)
    try:
        for doc in docs:  # helm template leaves namespaced objects of the release namespace without one
            if doc["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
                doc["metadata"].setdefault("namespace", ns)
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
        who = f"--as=system:serviceaccount:{ns}:{sa}"

        def can(*args: str) -> bool:
            res = cluster.kubectl("auth", "can-i", *args, who, check=False)
            return res.stdout.strip() == "yes"

        wide = mode == "all-namespaces"
        # where it works: always allowed
        assert can("create", "deployments.apps", "-n", watched)
        assert can("create", "roles.rbac.authorization.k8s.io", "-n", watched)
        assert can("list", "pods", "-n", watched)
        assert can("patch", "moeinferenceservices.moeguard.dev", "--subresource=status", "-n", watched)
        assert can("create", "events", "-n", watched)
        assert can("list", "customresourcedefinitions.apiextensions.k8s.io")
        # elsewhere: only when it watches all namespaces
        assert can("create", "deployments.apps", "-n", "kube-system") is wide
        assert can("create", "rolebindings.rbac.authorization.k8s.io", "-n", "kube-system") is wide
        assert can("list", "pods", "-n", other) is wide
        assert can("list", "pods", "--all-namespaces") is wide
        assert can("create", "events", "-n", other) is wide
        # never: what no mode grants
        assert not can("delete", "moeinferenceservices.moeguard.dev", "-n", watched)
        assert not can("get", "secrets", "-n", watched)
        assert not can("update", "moeinferenceservices.moeguard.dev", "-n", watched)
    finally:
        cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false",
                        input=yaml.safe_dump_all(docs), check=False)
        for name in (ns, watched, other):
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_prometheus_allowlist_and_ca_bundle_reach_the_operator_args(template: Any, helm_bin: Any) -> None:
    from moeguard_operator.__main__ import parse_args

    def container(*sets: str) -> tuple[dict[str, Any], dict[str, Any]]:
        dep = _by_kind(_docs(template(*sets)), "Deployment")[0]
        pod = dep["spec"]["template"]["spec"]
        return pod, pod["containers"][0]

    pod, c = container()
    assert not any(a.startswith(("--allowed-prometheus-url", "--prometheus-ca-file")) for a in c["args"])
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]

    pod, c = container("operator.prometheusUrl=http://prom:9090",
                       "operator.prometheus.allowedUrls={https://a.example:9090,https://b.example/prom}",
                       "operator.prometheus.caBundle.configMap=prom-ca")
    assert "--allowed-prometheus-url=https://a.example:9090" in c["args"]
    assert "--allowed-prometheus-url=https://b.example/prom" in c["args"]
    assert "--prometheus-ca-file=/etc/moeguard/prometheus-ca/ca.crt" in c["args"]
    assert {"name": "prometheus-ca", "mountPath": "/etc/moeguard/prometheus-ca", "readOnly": True} in c["volumeMounts"]
    assert {"name": "prometheus-ca", "configMap": {"name": "prom-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}} \
        in pod["volumes"]
    _, config = parse_args(c["args"])  # the operator accepts the rendered args
    assert config.prometheus_urls == ("http://prom:9090", "https://a.example:9090", "https://b.example/prom")
    assert config.prometheus_ca_file == "/etc/moeguard/prometheus-ca/ca.crt"

    pod, c = container("operator.prometheus.caBundle.secret=prom-tls", "operator.prometheus.caBundle.key=bundle.pem")
    assert "--prometheus-ca-file=/etc/moeguard/prometheus-ca/bundle.pem" in c["args"]
    assert {"name": "prometheus-ca", "secret": {"secretName": "prom-tls",
                                                "items": [{"key": "bundle.pem", "path": "bundle.pem"}]}} in pod["volumes"]

    both = helm_bin("template", "x", str(CHART), "--kube-version", "1.34.4", "--set",
                    "operator.prometheus.caBundle.configMap=a,operator.prometheus.caBundle.secret=b", check=False)
    assert both.returncode != 0 and "not both" in both.stderr
    bad = helm_bin("template", "x", str(CHART), "--kube-version", "1.34.4", "--set",
                   "operator.prometheus.allowedUrls={ftp://x}", check=False)
    assert bad.returncode != 0 and "allowedUrls" in bad.stderr
