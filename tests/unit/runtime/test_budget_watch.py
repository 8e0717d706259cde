from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from moeguard_core.contract import BudgetDocument, Budgets
from moeguard_runtime.engine.budget_watch import (
    NO_GENERATION,
    BudgetWatcher,
    decide_update,
    load_kube_config,
)

pytestmark = pytest.mark.unit

B = Budgets(max_prefill_tokens=512, max_decode_tokens=64, max_batch_requests=8,
            max_concurrent_batches=1)


def data(generation: int, **change: Any) -> dict[str, str]:
    return BudgetDocument(generation=generation, budgets=B, reason="test", **change).to_configmap_data()


def test_newer_generation_is_applied() -> None:
    d = decide_update(data(0), NO_GENERATION)
    assert d.action == "apply" and d.document is not None and d.document.budgets == B
    assert decide_update(data(5), 4).action == "apply"


def test_same_or_older_generation_is_ignored() -> None:
    d = decide_update(data(4), 4)
    assert d.action == "ignore" and "not newer than 4" in d.reason
    assert decide_update(data(3), 4).action == "ignore"


@pytest.mark.parametrize(("payload", "needle"), [
    (None, "no 'budget.json' key"),
    ({"other": "{}"}, "no 'budget.json' key"),
    ({"budget.json": "{not json"}, "not valid JSON"),
    ({"budget.json": json.dumps({"generation": 1})}, "budgets"),
    ({"budget.json": json.dumps({"generation": 2, "budgets": {
        "maxPrefillTokens": 0, "maxDecodeTokens": 1, "maxBatchRequests": 1,
        "maxConcurrentBatches": 1}})}, "maxPrefillTokens"),
    ({"budget.json": json.dumps({"generation": -1, "budgets": B.model_dump(by_alias=True)})},
     "generation"),
    ({"budget.json": json.dumps({"generation": 3, "budgets": B.model_dump(by_alias=True),
                                 "overloadQueueTrigger": "sometimes"})},
     "overloadQueueTrigger: Input should be a valid boolean"),
    ({"budget.json": json.dumps({"generation": 3, "budgets": B.model_dump(by_alias=True),
                                 "overloadQueueTrigger": None})},
     "overloadQueueTrigger: Input should be a valid boolean"),
])
def test_invalid_documents_are_rejected_with_reason(payload: dict[str, str] | None,
                                                    needle: str) -> None:
    d = decide_update(payload, NO_GENERATION)
    assert d.action == "reject" and d.document is None
    assert needle in d.reason


def test_no_kube_config_without_env() -> None:
    assert load_kube_config({}) is None


class FakeApi:
    """A CoreV1Api stand-in: the GET returns generation 1, the watch stream is fed by the test."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def list_namespaced_config_map(self, namespace: str, **kw: Any) -> Any:
        """The list (the object's resourceVersion 7, the collection's 10); the watch is the fake's."""
        assert kw == {"field_selector": "metadata.name=svc-budget"}, kw
        obj = SimpleNamespace(data=data(1), metadata=SimpleNamespace(resource_version="7"))
        return SimpleNamespace(items=[obj], metadata=SimpleNamespace(resource_version="10"))


def test_watcher_gets_then_watches_one_object(monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApi()
    received: list[dict[str, str] | None] = []

    class FakeWatch:
        def stream(self, func: Any, namespace: str, **kw: Any) -> Any:
            api.calls.append({"namespace": namespace, **kw})
            obj = SimpleNamespace(data=data(2), metadata=SimpleNamespace(resource_version="11"))
            yield {"type": "MODIFIED", "object": obj}
            watcher.stop()
            yield {"type": "MODIFIED", "object": obj}

        def stop(self) -> None:
            pass

    monkeypatch.setattr("kubernetes.watch.Watch", FakeWatch)
    watcher = BudgetWatcher("svc-budget", "ns1", received.append, lambda *a, **k: None, api=api)
    watcher.run()  # on this thread: returns once the fake watch has stopped it
    assert [json.loads(d["budget.json"])["generation"] for d in received if d][:2] == [1, 2]
    call = api.calls[0]
    assert call["namespace"] == "ns1"
    assert call["field_selector"] == "metadata.name=svc-budget"
    assert call["resource_version"] == "10"


def test_a_watch_error_reads_again_after_a_back_off_not_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """410 Gone as a watch ERROR event (a restarted API server): the watcher lists again after its back-off
    (0.5 s, doubling), not in a tight loop."""
    api = FakeApi()
    waits: list[float] = []
    watches = 0

    class FakeWatch:
        def stream(self, func: Any, namespace: str, **kw: Any) -> Any:
            nonlocal watches
            watches += 1
            if watches == 3:
                watcher.stop()
            yield {"type": "ERROR", "object": SimpleNamespace(message="too old resource version: 10 (75)")}

        def stop(self) -> None:
            pass

    monkeypatch.setattr("kubernetes.watch.Watch", FakeWatch)
    watcher = BudgetWatcher("svc-budget", "ns1", lambda d: None, lambda *a, **k: None, api=api)
    monkeypatch.setattr(watcher._stop, "wait", lambda s: waits.append(s) or watcher._stop.is_set())
    watcher.run()
    assert watches == 3 and waits[:2] == [0.5, 1.0], waits


def test_a_number_written_as_a_string_is_refused() -> None:
    import json as _json

    from moeguard_core.contract import BudgetDocumentError, parse_budget_configmap_data

    doc = {"generation": 3, "budgets": {"maxPrefillTokens": "100", "maxDecodeTokens": 16, "maxBatchRequests": 4,
                                         "maxConcurrentBatches": 1}}
    with pytest.raises(BudgetDocumentError, match=r"budgets\.maxPrefillTokens: Input should be a valid integer"):
        parse_budget_configmap_data({"budget.json": _json.dumps(doc)})


def test_resource_version_of_typed_objects_and_of_bookmarks() -> None:
    """A BOOKMARK's object stays a dict in the kubernetes client; it must not break the watch."""
    from kubernetes.client import V1ConfigMap, V1ObjectMeta

    from moeguard_runtime.engine.budget_watch import event_resource_version

    assert event_resource_version(V1ConfigMap(metadata=V1ObjectMeta(resource_version="42"))) == "42"
    assert event_resource_version({"kind": "ConfigMap", "metadata": {"resourceVersion": "43"}}) == "43"
    assert event_resource_version({"metadata": {}}) is None
    assert event_resource_version({}) is None
