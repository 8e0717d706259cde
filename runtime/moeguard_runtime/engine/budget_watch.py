"""Watch the budget ConfigMap through the Kubernetes API and apply new documents.

The pure part, :func:`decide_update`, turns a ConfigMap's ``data`` and the
generation last applied into apply / ignore / reject. :class:`BudgetWatcher` is
the I/O edge: an initial GET, then a watch on the one object
(``field_selector=metadata.name=<name>``, which a Role with ``resourceNames``
allows), in a daemon thread, reconnecting with exponential backoff (0.5 s
doubling to 30 s) and re-reading after ``410 Gone``. A watch event arrives well
under a second after the operator's write; the scheduler applies the budgets
from its next step, so the end to end delay stays far below the 5 s target.

An invalid document is refused (``event=budget_rejected reason=...``,
``moeguard_budget_updates_total{result="rejected"}``) and the last good budgets
stay in force; so they do when the ConfigMap is deleted.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from moeguard_core import contract
from moeguard_core.contract import BudgetDocument, BudgetDocumentError

NO_GENERATION = -1
"""Generation in force before any document: the env budgets."""


def event_resource_version(obj: Any) -> str | None:
    """The resourceVersion of a watch event's object.

    The kubernetes client deserializes ADDED/MODIFIED/DELETED objects into typed models
    (``obj.metadata.resource_version``) but leaves a BOOKMARK's object a plain dict
    (``{"metadata": {"resourceVersion": …}}``); reading it as a model raised AttributeError once
    a minute and restarted the watch.
    """
    if isinstance(obj, dict):
        meta = obj.get("metadata")
        value = meta.get("resourceVersion") if isinstance(meta, dict) else None
        return str(value) if value else None
    meta = getattr(obj, "metadata", None)
    value = getattr(meta, "resource_version", None)
    return str(value) if value else None


@dataclass(frozen=True)
class BudgetDecision:
    action: Literal["apply", "ignore", "reject"]
    document: BudgetDocument | None
    reason: str


def check_consistency(doc: BudgetDocument, max_seq_len: int | None = None) -> str | None:
    """Rules across fields that the schema alone does not check; the first broken
    one as a message naming both fields and their values, or None.

    * ``maxLongRequestsPerBatch`` is a cap inside ``maxBatchRequests`` and may not
      exceed it (a floor above its ceiling);
    * ``overloadMaxContextTokens`` may not exceed the model's context.
    """
    b = doc.budgets
    if b.max_long_requests_per_batch > b.max_batch_requests:
        return (f"budgets.maxLongRequestsPerBatch {b.max_long_requests_per_batch} is above "
                f"budgets.maxBatchRequests {b.max_batch_requests}")
    ctx = doc.overload_max_context_tokens
    if max_seq_len is not None and ctx is not None and ctx > max_seq_len:
        return f"overloadMaxContextTokens {ctx} is above the model's context {max_seq_len}"
    return None


def decide_update(data: Mapping[str, str] | None, applied_generation: int,
                  max_seq_len: int | None = None) -> BudgetDecision:
    """What to do with a ConfigMap's ``data`` (pure).

    * ``reject``: missing key, malformed JSON, an invalid field (the reason
      names it, from ``contract.parse_budget_configmap_data``), or fields that
      contradict each other (:func:`check_consistency`);
    * ``ignore``: valid but ``generation`` is not newer than the applied one;
    * ``apply``: valid and newer.
    """
    try:
        doc = contract.parse_budget_configmap_data(dict(data) if data is not None else None)
    except BudgetDocumentError as exc:
        return BudgetDecision("reject", None, str(exc))
    problem = check_consistency(doc, max_seq_len)
    if problem is not None:
        return BudgetDecision("reject", None, f"invalid {contract.BUDGET_KEY}: {problem}")
    if doc.generation <= applied_generation:
        return BudgetDecision("ignore", doc, f"generation {doc.generation} is not newer than "
                                             f"{applied_generation}")
    return BudgetDecision("apply", doc, doc.reason)


def load_kube_config(env: Mapping[str, str] | None = None) -> str | None:
    """Configure the kubernetes client: in-cluster when ``KUBERNETES_SERVICE_HOST``
    is set, else the ``KUBECONFIG`` file. Returns which, or None when neither."""
    from kubernetes import config

    env = os.environ if env is None else env
    if env.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()  # type: ignore[no-untyped-call]
        return "in-cluster"
    if env.get("KUBECONFIG"):
        config.load_kube_config(config_file=env["KUBECONFIG"])  # type: ignore[no-untyped-call]
        return f"kubeconfig {env['KUBECONFIG']}"
    return None


class BudgetWatcher:
    """Background thread delivering budget ConfigMap ``data`` to ``on_data``.

    ``on_data(data)`` is called with each version of the object's data (from the
    initial GET and from every ADDED/MODIFIED event); it does the deciding
    (:func:`decide_update`) and applying, so this class only does I/O.
    """

    def __init__(self, name: str, namespace: str, on_data: Callable[[dict[str, str] | None], None],
                 log: Callable[..., Any], api: Any = None) -> None:
        self.name, self.namespace = name, namespace
        self._on_data = on_data
        self._log = log
        self._api = api
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.run, name="budget-watch", daemon=True)

    def start(self) -> None:
        """Run :meth:`run` on a daemon thread."""
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _core(self) -> Any:
        if self._api is None:
            from kubernetes import client

            self._api = client.CoreV1Api()
        return self._api

    def run(self) -> None:
        """GET, then watch, reconnecting with back-off; returns once :meth:`stop` was
        called (checked after each event and each back-off)."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        resource_version: str | None = None
        while not self._stop.is_set():
            try:
                api = self._core()
                if resource_version is None:
                    # A list (of the one object) gives the collection's resourceVersion: the API server's now,
                    # which its watch cache holds. The object's own is older, and a restarted API server no
                    # longer holds it (410 at once, forever: the real node's fault, issue 17).
                    listed = api.list_namespaced_config_map(self.namespace,
                                                            field_selector=f"metadata.name={self.name}")
                    if listed.items:
                        self._on_data(listed.items[0].data)
                    else:
                        self._log("budget_configmap_missing", name=self.name, namespace=self.namespace)
                    resource_version = listed.metadata.resource_version
                w = watch.Watch()  # type: ignore[no-untyped-call]
                events = w.stream(  # type: ignore[no-untyped-call]
                    api.list_namespaced_config_map, self.namespace,
                    field_selector=f"metadata.name={self.name}",
                    resource_version=resource_version, timeout_seconds=300,
                    allow_watch_bookmarks=True)
                failed = False
                for event in events:
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        resource_version = None  # 410 Gone and friends: read again, after the back-off
                        failed = True
                        self._log("budget_watch_error", error=str(getattr(obj, "message", obj))[:300],
                                  retry_s=backoff)
                        break
                    backoff = 0.5
                    resource_version = event_resource_version(obj) or resource_version
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._on_data(obj.data)
                    elif event["type"] == "DELETED":
                        self._log("budget_configmap_deleted", name=self.name, kept="last good")
                    if self._stop.is_set():
                        w.stop()  # type: ignore[no-untyped-call]
                        return
            except ApiException as exc:
                if exc.status == 410:
                    resource_version = None
                    continue
                self._log("budget_watch_error", error=f"{exc.status} {exc.reason}", retry_s=backoff)
            except Exception as exc:  # the watch must survive anything
                self._log("budget_watch_error", error=repr(exc)[:300], retry_s=backoff)
            else:
                if not failed:
                    continue  # the server closed the watch normally: reconnect at once
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 30.0)
