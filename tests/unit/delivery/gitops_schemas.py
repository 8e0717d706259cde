"""Hand-written JSON schemas of the Flux and Argo CD kinds used in examples/gitops/.

No official JSON schema is reachable from this machine (the projects publish them as CRDs in their
release assets), so these encode, from the projects' API references, the required fields, the
enums and the field names of the parts the examples use — enough to catch a missing field, a typo
(``additionalProperties: false`` where the field set is known) or a wrong enum value. They are not a
complete copy of the upstream CRD schemas.

Sources: fluxcd.io/flux/components/source/gitrepositories, .../helm/helmreleases,
.../kustomize/kustomizations; argo-cd.readthedocs.io user-guide/application-specification.
"""

from __future__ import annotations

from typing import Any

DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"}
NAME = {"type": "string", "minLength": 1, "maxLength": 253}
META = {"type": "object", "required": ["name"], "properties": {"name": NAME, "namespace": NAME}}


def _kind(api_version: str, kind: str, spec: dict[str, Any], meta: dict[str, Any] = META) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": meta,
                       "spec": spec},
    }


def _obj(props: dict[str, Any], required: list[str] | None = None, closed: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    if closed:
        out["additionalProperties"] = False
    return out


CROSS_NS_REF = _obj({"kind": {"type": "string"}, "name": NAME, "namespace": NAME, "apiVersion": {"type": "string"}},
                    ["kind", "name"])
REMEDIATION = _obj({"retries": {"type": "integer"}, "ignoreTestFailures": {"type": "boolean"},
                    "remediateLastFailure": {"type": "boolean"}, "strategy": {"enum": ["rollback", "uninstall"]}})
CRDS_POLICY = {"enum": ["Skip", "Create", "CreateReplace"]}

GIT_REPOSITORY = _kind("source.toolkit.fluxcd.io/v1", "GitRepository", _obj({
    "interval": DURATION, "url": {"type": "string", "pattern": r"^(http|https|ssh)://"}, "timeout": DURATION,
    "ref": _obj({"branch": {"type": "string"}, "tag": {"type": "string"}, "semver": {"type": "string"},
                 "name": {"type": "string"}, "commit": {"type": "string"}}),
    "secretRef": _obj({"name": NAME}, ["name"]), "suspend": {"type": "boolean"},
    "ignore": {"type": "string"}, "recurseSubmodules": {"type": "boolean"}, "provider": {"type": "string"},
}, ["interval", "url"]))

HELM_RELEASE = _kind("helm.toolkit.fluxcd.io/v2", "HelmRelease", {
    **_obj({
        "interval": DURATION, "timeout": DURATION, "releaseName": {"type": "string", "maxLength": 53},
        "targetNamespace": NAME, "storageNamespace": NAME, "suspend": {"type": "boolean"},
        "serviceAccountName": NAME, "maxHistory": {"type": "integer"},
        "chart": _obj({"spec": _obj({
            "chart": {"type": "string", "minLength": 1}, "version": {"type": "string"},
            "sourceRef": {**CROSS_NS_REF, "properties": {**CROSS_NS_REF["properties"],
                                                         "kind": {"enum": ["HelmRepository", "GitRepository", "Bucket"]}}},
            "interval": DURATION, "reconcileStrategy": {"enum": ["ChartVersion", "Revision"]},
            "valuesFiles": {"type": "array", "items": {"type": "string"}},
        }, ["chart", "sourceRef"])}, ["spec"]),
        "chartRef": CROSS_NS_REF,
        "dependsOn": {"type": "array", "items": _obj({"name": NAME, "namespace": NAME}, ["name"])},
        "install": _obj({"crds": CRDS_POLICY, "remediation": REMEDIATION, "createNamespace": {"type": "boolean"},
                         "timeout": DURATION, "disableWait": {"type": "boolean"}}),
        "upgrade": _obj({"crds": CRDS_POLICY, "remediation": REMEDIATION, "timeout": DURATION,
                         "cleanupOnFail": {"type": "boolean"}, "force": {"type": "boolean"}}),
        "values": {"type": "object"},
        "valuesFrom": {"type": "array", "items": _obj({"kind": {"enum": ["Secret", "ConfigMap"]}, "name": NAME,
                                                         "valuesKey": {"type": "string"},
                                                         "targetPath": {"type": "string"},
                                                         "optional": {"type": "boolean"}}, ["kind", "name"])},
    }, ["interval"]),
    "oneOf": [{"required": ["chart"]}, {"required": ["chartRef"]}],
})

KUSTOMIZATION = _kind("kustomize.toolkit.fluxcd.io/v1", "Kustomization", _obj({
    "interval": DURATION, "retryInterval": DURATION, "timeout": DURATION, "path": {"type": "string"},
    "prune": {"type": "boolean"}, "wait": {"type": "boolean"}, "force": {"type": "boolean"},
    "targetNamespace": NAME, "suspend": {"type": "boolean"}, "serviceAccountName": NAME,
    "sourceRef": {**CROSS_NS_REF, "properties": {**CROSS_NS_REF["properties"],
                                                 "kind": {"enum": ["OCIRepository", "GitRepository", "Bucket"]}}},
    "dependsOn": {"type": "array", "items": _obj({"name": NAME, "namespace": NAME}, ["name"])},
    "healthChecks": {"type": "array", "items": _obj({"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                     "name": NAME, "namespace": NAME}, ["kind", "name"])},
}, ["interval", "prune", "sourceRef"]))

_SOURCE = _obj({
    "repoURL": {"type": "string", "minLength": 1}, "targetRevision": {"type": "string"},
    "path": {"type": "string"}, "chart": {"type": "string"}, "ref": {"type": "string"},
    "helm": _obj({"releaseName": {"type": "string"}, "valuesObject": {"type": "object"},
                  "values": {"type": "string"}, "valueFiles": {"type": "array", "items": {"type": "string"}},
                  "parameters": {"type": "array"}, "skipCrds": {"type": "boolean"}}),
}, ["repoURL"])

APPLICATION = _kind("argoproj.io/v1alpha1", "Application", _obj({
    "project": {"type": "string", "minLength": 1},
    "source": _SOURCE,
    "sources": {"type": "array", "items": _SOURCE},
    "destination": _obj({"server": {"type": "string"}, "name": {"type": "string"}, "namespace": NAME}),
    "syncPolicy": _obj({
        "automated": _obj({"prune": {"type": "boolean"}, "selfHeal": {"type": "boolean"},
                           "allowEmpty": {"type": "boolean"}}),
        "syncOptions": {"type": "array", "items": {"type": "string", "pattern": r"^[A-Za-z]+=[A-Za-z0-9]+$"}},
        "managedNamespaceMetadata": _obj({"labels": {"type": "object"}, "annotations": {"type": "object"}}),
        "retry": {"type": "object"},
    }),
    "ignoreDifferences": {"type": "array"},
    "revisionHistoryLimit": {"type": "integer"},
}, ["destination", "project"]))

SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("source.toolkit.fluxcd.io/v1", "GitRepository"): GIT_REPOSITORY,
    ("helm.toolkit.fluxcd.io/v2", "HelmRelease"): HELM_RELEASE,
    ("kustomize.toolkit.fluxcd.io/v1", "Kustomization"): KUSTOMIZATION,
    ("argoproj.io/v1alpha1", "Application"): APPLICATION,
}
"""(apiVersion, kind) → schema, for the kinds the local API server does not know."""
