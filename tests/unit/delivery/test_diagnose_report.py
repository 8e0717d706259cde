"""`moeguard diagnose`'s core: the report from a service object, Events and range answers, its rendering
(findings, evidence, the patch command, missing signals, the timeline with gaps), JSON, and the plot."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from tests.unit.delivery.diagnose_inputs import (
    BURST,
    COUNT,
    END,
    EVENTS,
    NOW,
    PATCH,
    START,
    GiB,
    answers,
    service,
)

from moeguard_cli.diagnose_plot import PANELS, figure, plot
from moeguard_cli.diagnose_report import (
    RangeAnswer,
    build_report,
    build_timeline,
    grid,
    patch_command,
    range_queries,
    render,
)

pytestmark = pytest.mark.unit

def text_of(report: Any, width: int = 200) -> str:
    console = Console(record=True, width=width, force_terminal=False)
    render(report, console)
    return console.export_text()


def test_grid_ends_at_the_last_whole_step_and_spans_the_minutes() -> None:
    assert datetime(2026, 12, 1, 14, 0, 0, tzinfo=UTC).timestamp() == END
    assert START == END - 600 and COUNT == 21
    with pytest.raises(ValueError, match="minutes"):
        grid(NOW, 0)


def test_queries_select_the_service_and_escape_its_labels() -> None:
    q = range_queries("serving", 'we"ird')
    assert q["memory_bytes"] == 'max(moeguard_memory_usage_bytes{namespace="serving", moeis="we\\"ird"})'
    assert q["refusals_per_second"] == ('sum by (reason) (rate(moeguard_rejections_total{namespace="serving", '
                                        'moeis="we\\"ird"}[60s]))')
    assert q["hard_limit_bytes"].endswith('limit="hard"})')


def test_timeline_steps_gaps_are_missing_never_zero() -> None:
    tl = build_timeline(answers(), START, 30, COUNT)
    assert len(tl.times) == COUNT and tl.times[0].timestamp() == START
    mem = tl.values["memory_bytes"]
    assert mem[4] == pytest.approx(5.5 * GiB) and mem[5] is None and mem[6] is None
    assert tl.values["memory_percent"][20] == pytest.approx(100 * 7.5 / 8)
    assert tl.values["memory_percent"][5] is None
    assert tl.values["skew_ratio"][:3] == [None, None, None]  # NaN: no engine step in the window
    assert tl.values["skew_ratio"][3] == 2.5
    refusals = tl.values["refusals_per_second"]
    assert refusals[14] is None and refusals[15] == 0.5 and refusals[17] == 0.75
    assert tl.refusals_by_reason["queue_full"][16] is None
    assert tl.values["kv_cache_bytes"] == [None] * COUNT
    assert tl.missing == {"kv_cache_bytes": "no data"}


def test_timeline_without_prometheus_names_every_signal_missing() -> None:
    down = {key: RangeAnswer(problem="PrometheusUnreachable") for key in range_queries("a", "b")}
    tl = build_timeline(down, START, 30, COUNT, hard_limit_bytes=8 * GiB)
    assert set(tl.missing) == set(range_queries("a", "b"))
    assert set(tl.missing.values()) == {"PrometheusUnreachable"}
    assert all(v is None for values in tl.values.values() for v in values)
    malformed = build_timeline({"memory_bytes": RangeAnswer(body={"status": "error"})}, START, 30, COUNT)
    assert malformed.missing["memory_bytes"] == "PrometheusMalformedAnswer"
    assert malformed.missing["queue_requests"] == "not asked"


def test_memory_percent_falls_back_to_the_spec_hard_limit() -> None:
    a = answers()
    del a["hard_limit_bytes"]
    tl = build_timeline(a, START, 30, COUNT, hard_limit_bytes=10 * GiB)
    assert tl.values["memory_percent"][0] == pytest.approx(50.0)


def test_report_names_the_finding_its_evidence_and_the_patch_command() -> None:
    report = build_report(service(BURST), EVENTS, answers(), now=NOW, minutes=10,
                          prometheus_url="http://prom:9090")
    (f,) = report.findings
    assert f.kind == "BurstOverlap" and f.since == datetime(2026, 12, 1, 13, 55, tzinfo=UTC)
    assert f.patch_command == ("kubectl -n serving patch moeis mixtral --type merge -p "
                               "'{\"spec\":{\"batching\":{\"maxConcurrentBatches\":1}}}'")
    assert [e.reason for e in report.events] == ["BurstOverlap", "BudgetTightened", "RoutingSkewCleared"]
    assert report.events[2].count == 3 and report.events[2].time == datetime(2026, 12, 1, 13, 59, tzinfo=UTC)
    out = text_of(report)
    assert "BurstOverlap since 13:55:00 (5m ago), last seen 14:00:00" in out
    assert "3 prefill batches overlapped while memory reached 91% of the hard limit" in out
    assert "prefill batches in flight" in out and "3 batches" in out and "mixtral-0" in out
    assert "3.00 GiB" in out and "0.91" in out and "stage expert_buffers" in out
    assert "remedy: Let one prefill run at a time: lower maxConcurrentBatches to 1." in out
    assert f.patch_command in out
    assert "moeguard_memory_peak_breakdown_bytes on mixtral-1 (silent pod)" in out
    assert "KV cache (kv_cache_bytes): no data" in out
    assert "Warning" in out and "maxPrefillTokens 4096 -> 2048" in out and "old" not in out.split("Events")[-1]


def test_timeline_table_rows_and_gaps() -> None:
    out = text_of(build_report(service(BURST), EVENTS, answers(), now=NOW, minutes=10, prometheus_url="u"))
    rows = [line for line in out.splitlines() if line.startswith("│ 13:") or line.startswith("│ 14:")]
    assert len(rows) == COUNT
    first, gap, last = (r.split("│")[1:-1] for r in (rows[0], rows[5], rows[-1]))
    assert [c.strip() for c in first] == ["13:50:00", "4096", "2", "—", "62.50%", "—", "2", "0", "0", "—"]
    assert gap[4].strip() == "—"  # memory % where the memory sample is missing
    assert [c.strip() for c in last] == ["14:00:00", "2048", "2", "2.50", "93.75%", "0.75", "2", "20", "0", "—"]


def test_no_finding_says_so_and_still_prints_the_timeline() -> None:
    report = build_report(service({"time": "2026-12-01T14:00:00Z", "findings": [], "missingSignals": []}), [],
                          answers(), now=NOW, minutes=10, prometheus_url="u")
    out = text_of(report)
    assert report.findings == []
    assert "No finding: moeguard names no incident cause for this service (diagnosis at 14:00:00)." in out
    assert "timeline (every 30 s" in out and "14:00:00" in out
    assert "Events: none in the last 10 min." in out
    no_diagnosis = text_of(build_report(service(None), None, {}, now=NOW, minutes=10, prometheus_url="u",
                                        events_problem="HTTP 403 Forbidden"))
    assert "the operator has written no diagnosis yet" in no_diagnosis
    assert "Events: could not be listed (HTTP 403 Forbidden)" in no_diagnosis


def test_an_unreadable_diagnosis_is_named_not_raised() -> None:
    bad = {"findings": [{"kind": "Gremlins", "since": "yesterday"}]}
    report = build_report(service(bad), [], {}, now=NOW, minutes=10, prometheus_url="u")
    assert report.findings == []
    assert report.missing_signals[0].startswith("status.diagnosis (unreadable: ")


def test_patch_command_quotes_for_the_shell() -> None:
    assert patch_command("ns", "m", '{"a":"it\'s"}') == "kubectl -n ns patch moeis m --type merge -p '{\"a\":\"it'\"'\"'s\"}'"


def test_json_holds_the_whole_report() -> None:
    report = build_report(service(BURST), EVENTS, answers(), now=NOW, minutes=10, prometheus_url="u")
    doc = json.loads(report.model_dump_json())
    assert doc["findings"][0]["patch"] == PATCH
    assert doc["findings"][0]["evidence"][0]["value"] == 3
    assert doc["timeline"]["values"]["memory_bytes"][5] is None
    assert doc["timeline"]["refusals_by_reason"]["memory"][15] == 0.5
    assert doc["budgets"]["maxPrefillTokens"] == 2048
    assert doc["conditions"][1] == {"type": "BurstOverlap", "status": "True", "reason": "BurstOverlap",
                                    "message": "3 prefills overlap"}


def test_plot_has_a_panel_per_signal_group_and_a_line_per_onset(tmp_path: Path) -> None:
    report = build_report(service(BURST), EVENTS, answers(), now=NOW, minutes=10, prometheus_url="u")
    fig = figure(report)
    assert len(fig.axes) == PANELS == 5
    mem = fig.axes[0]
    assert [line.get_label() for line in mem.get_lines()[:3]] == ["memory in use", "soft limit", "hard limit"]
    onsets = [line for ax in fig.axes for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert len(onsets) == PANELS  # one finding: one vertical line per panel
    assert [line.get_label() for line in fig.axes[3].get_lines()[:2]] == ["memory", "queue_full"]
    path = tmp_path / "timeline.png"
    plot(report, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
