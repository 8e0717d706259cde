"""The prefill role of a service as a service of its own for the control loop (issue 33 §4), pure.

A MoEInferenceService with ``spec.prefill`` has two sets of worker pods. The loop keys everything it watches by the
``app.kubernetes.io/instance`` label, and the prefill role's children carry ``<name>-prefill`` there
(:func:`moeguard_operator.children.builders.prefill_owner`): its pods, budget ConfigMap and Deployment, and its
workers' metrics (``moeis="<name>-prefill"``). So the loop runs the role as one more service, keyed
``(namespace, <name>-prefill)``, from a *view* of the MoEInferenceService (:func:`role_view`): the service's
metadata under the role's name, with :data:`ROLE_OF` naming the service, the service's spec (the loop derives
the role's with :func:`~moeguard_operator.children.builders.prefill_role_spec`), and ``status.prefill`` as its
status. Its budgets, leak judgement, restarts and leak replacements are its own: a write of the role patches
``status.prefill`` and the prefill Deployment only, so a prefill pod's leak never restarts a decode pod.
"""

from __future__ import annotations

from typing import Any

from moeguard_operator.children.builders import PREFILL_SUFFIX

ROLE_OF = "moeguard.dev/roleOf"
"""Key in a role view's ``metadata``: the name of the MoEInferenceService whose role it is (never stored)."""
Key = tuple[str, str]


def role_key(namespace: str, name: str) -> Key:
    """The loop's key of service ``name``'s prefill role."""
    return namespace, name + PREFILL_SUFFIX


def role_view(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The prefill role's view of a MoEInferenceService ``obj`` (see the module docstring); None without
    ``spec.prefill``."""
    spec = obj.get("spec") or {}
    if not spec.get("prefill"):
        return None
    meta = obj.get("metadata") or {}
    view_meta = {k: meta[k] for k in ("namespace", "uid", "generation", "resourceVersion", "deletionTimestamp")
                 if k in meta}
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
            "metadata": {**view_meta, "name": meta.get("name", "") + PREFILL_SUFFIX, ROLE_OF: meta.get("name", "")},
            "spec": spec, "status": dict((obj.get("status") or {}).get("prefill") or {})}


def role_of(svc: dict[str, Any]) -> str | None:
    """The service whose role view ``svc`` is, None for a service itself."""
    value = (svc.get("metadata") or {}).get(ROLE_OF)
    return None if value is None else str(value)


def status_patch_of(svc: dict[str, Any], patch: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(object name, merge patch)`` of a status patch of ``svc``: a role view's goes under ``status.prefill`` of
    its service."""
    parent = role_of(svc)
    meta = svc.get("metadata") or {}
    return (str(meta.get("name", "")), patch) if parent is None else (parent, {"prefill": patch})
