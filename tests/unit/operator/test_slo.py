"""SLO attainment from the worker's latency histograms (issue 30)."""

from __future__ import annotations

import math
import re

import pytest

from moeguard_operator.loop.observation import ClassLatency
from moeguard_operator.loop.slo import attainments, count, share_within
from moeguard_operator.spec.models import MoEInferenceServiceSpec, SloSpec

pytestmark = pytest.mark.unit

INF = math.inf
# 100 first tokens: 50 within 1 s, 80 within 2.5 s, 90 within 3 s, 100 within 5 s
TTFT = ((1.0, 50.0), (2.5, 80.0), (3.0, 90.0), (5.0, 100.0), (INF, 100.0))
TPOT = ((0.1, 40.0), (0.25, 95.0), (0.5, 100.0), (INF, 100.0))


def test_the_share_at_a_bucket_bound_is_exact() -> None:
    assert share_within(TTFT, 3.0) == 0.9
    assert share_within(TTFT, 1.0) == 0.5
    assert share_within(TPOT, 0.25) == 0.95
    assert count(TTFT) == 100.0


def test_a_target_between_bounds_is_interpolated_within_its_bucket() -> None:
    assert share_within(TTFT, 4.0) == pytest.approx(0.95)  # halfway from 3 s (90) to 5 s (100)
    assert share_within(TTFT, 0.5) == pytest.approx(0.25)  # the first bucket starts at 0
    assert share_within(TTFT, 10.0) == 1.0  # beyond the last finite bound: all that is known below it


def test_an_empty_window_is_unknown_never_met() -> None:
    assert share_within(((1.0, 0.0), (INF, 0.0)), 3.0) is None
    assert share_within((), 3.0) is None
    with pytest.raises(ValueError):
        share_within(TTFT, 0.0)


def test_attainment_per_class_against_its_own_objectives() -> None:
    spec = MoEInferenceServiceSpec.model_validate({"slo": {"interactive": {"ttftSeconds": 3.0, "attainment": 0.9},
                                                           "batch": {"ttftSeconds": 5.0}}})
    interactive, batch = attainments((ClassLatency("batch", TTFT, TPOT), ClassLatency("interactive", TTFT, TPOT)),
                                     spec.slo)
    assert (interactive.priority, interactive.ttft, interactive.tpot, interactive.met) == ("interactive", 0.9, 0.95,
                                                                                           True)
    assert (batch.priority, batch.ttft, batch.tpot, batch.met) == ("batch", 1.0, 1.0, True)  # TPOT 1 s by default
    strict = attainments((ClassLatency("interactive", TTFT, TPOT),),
                         SloSpec.model_validate({"interactive": {"attainment": 0.95}}))
    assert strict[0].met is False  # TTFT 90 % < 95 %
    assert strict[0].tpot_met is True  # TPOT 95 % alone meets it
    tighter = attainments((ClassLatency("interactive", TTFT, TPOT),),
                          SloSpec.model_validate({"interactive": {"attainment": 0.96}}))
    assert tighter[0].tpot_met is False  # TPOT 95 % < 96 %
    status = strict[0].status()
    assert (status.ttft_attainment, status.tpot_attainment, status.requests, status.target, status.met) == (
        0.9, 0.95, 100.0, 0.95, False)


def test_too_few_requests_are_reported_but_not_judged() -> None:
    few = ((3.0, 1.0), (INF, 4.0))
    (a,) = attainments((ClassLatency("interactive", few, few),), SloSpec.model_validate({"minRequests": 10}))
    assert a.ttft == 0.25 and a.judged is False and a.met is None
    (b,) = attainments((ClassLatency("interactive", few, few),), SloSpec.model_validate({"minRequests": 4}))
    assert b.met is False


def test_batch_objectives_may_not_be_tighter_than_interactive() -> None:
    with pytest.raises(ValueError, match=re.escape("slo.batch.tpotSeconds must be >= slo.interactive.tpotSeconds")):
        SloSpec.model_validate({"interactive": {"tpotSeconds": 0.5}, "batch": {"tpotSeconds": 0.25}})
    defaults = SloSpec()
    assert (defaults.interactive.ttft_seconds, defaults.interactive.tpot_seconds, defaults.batch.ttft_seconds,
            defaults.batch.tpot_seconds, defaults.interactive.attainment, defaults.min_requests) == (
        3.0, 0.25, 30.0, 1.0, 0.9, 10)
