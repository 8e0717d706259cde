"""What the operator does with a child the API server refuses: retry (bounded) or stall naming the field."""

from __future__ import annotations

import pytest

from moeguard_operator.children.apply_errors import MAX_RETRIES, judge, permanent, spec_field

pytestmark = pytest.mark.unit

TYPED = ('failed to create typed patch object (apps/v1, Kind=Deployment): .spec.template.spec.affinity.nodeAffinity: '
         'expected map, got &{everywhere [] false}')


@pytest.mark.parametrize(("status", "body", "expected"), [
    (422, "Deployment.apps is invalid", True),
    (400, "bad request", True),
    (403, "forbidden", True),
    (404, "namespace not found", True),
    (409, "conflict", False),
    (429, "too many requests", False),
    (500, TYPED, True),
    (500, 'duplicate entries for key [name="A"]', True),
    (500, "etcdserver: request timed out", False),
    (503, "unavailable", False),
    (None, "", False),
])
def test_only_refusals_that_retrying_cannot_change_are_permanent(status: int | None, body: str, expected: bool) -> None:
    assert permanent(status, body) is expected


@pytest.mark.parametrize(("message", "field"), [
    ('Deployment.apps "x-worker" is invalid: spec.template.spec.priorityClassName: Invalid value: "Bad_Name"',
     "spec.template.priorityClassName"),
    (TYPED, "spec.template.affinity"),
    ('Deployment.apps "x" is invalid: spec.template.spec.containers[0].resources.requests: Invalid value',
     "spec.resources"),
    ('.spec.template.spec.containers[name="worker"].volumeMounts: duplicate entries', "spec.template.volumeMounts"),
    ('Service "9-moe" is invalid: metadata.name: Invalid value: "9-moe"', "metadata.name"),
    ("something else entirely", None),
])
def test_the_child_field_in_the_message_is_mapped_to_the_spec_field(message: str, field: str | None) -> None:
    assert spec_field(message) == field


def test_a_permanent_refusal_stalls_at_once_naming_child_and_field() -> None:
    msg = 'Deployment.apps "x-worker" is invalid: spec.template.spec.priorityClassName: Invalid value: "Bad_Name"'
    verdict = judge("Deployment x-worker", 422, msg, msg, retries=0)
    assert not verdict.retry and verdict.reason == "ApplyRefused"
    assert "Deployment x-worker" in verdict.message and "spec field spec.template.priorityClassName" in verdict.message


def test_a_transient_refusal_is_retried_a_bounded_number_of_times() -> None:
    verdicts = [judge("Deployment x-worker", 503, "unavailable", "", retries=n) for n in range(MAX_RETRIES + 3)]
    assert [v.retry for v in verdicts] == [True] * MAX_RETRIES + [False] * 3
    assert verdicts[MAX_RETRIES].reason == "ApplyFailed" and "gave up after" in verdicts[MAX_RETRIES].message
