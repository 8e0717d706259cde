"""``moeguard diagnose``'s core: a report a person can act on, from plain inputs. Pure: no I/O.

Inputs (``diagnose_fetch`` gets them): the MoEInferenceService as the API server returns it (its
``status.diagnosis``, conditions, budgets, observed), its core/v1 Events, and Prometheus's answers to
the range queries of :func:`range_queries` over the grid of :func:`grid`. Output: a :class:`Report`,
rendered for people by :func:`render` (rich) or for scripts by ``Report.model_dump_json``.

A missing value is None and is shown as ``—``, never 0: a step without a sample, a query that failed,
a series that is not there. The report says which signals it could not see and why.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from rich.console import Console
from rich.table import Table
from rich.text import Text

from moeguard_core.contract import (
    LABEL_NAMESPACE,
    LABEL_SERVICE,
    METRIC_BATCHES_IN_FLIGHT,
    METRIC_KV_CACHE_BYTES,
    METRIC_LONG_REQUESTS_RUNNING,
    METRIC_MEMORY_USAGE_BYTES,
    METRIC_QUEUE_REQUESTS,
    METRIC_REJECTIONS_TOTAL,
    METRIC_STEP_EXPERT_SKEW_RATIO,
)
from moeguard_operator.loop.observe import MALFORMED
from moeguard_operator.spec.models import DiagnosisStatus, Evidence

STEP_SECONDS = 30
"""Seconds between two rows of the timeline (the range queries' ``step``)."""
RATE_WINDOW_SECONDS = 60
"""Window of ``rate``/``increase`` in the timeline's queries, seconds (two steps: a step's rate never misses
a sample between two steps)."""
MEMORY_LIMIT_METRIC = "moeguard_memory_limit_bytes"
GiB = 2**30


@dataclass(frozen=True)
class Signal:
    """One timeline signal: its report key, its column heading, its unit, and its PromQL (``SEL`` stands for
    the service's label matchers, ``WIN`` for the rate window). ``by`` names the label that splits it into
    series."""

    key: str
    heading: str
    unit: str
    promql: str
    by: str | None = None


SIGNALS: tuple[Signal, ...] = (
    Signal("max_prefill_tokens", "prefill budget", "tokens", "max(moeguard_budget_max_prefill_tokens{SEL})"),
    Signal("max_decode_tokens", "decode budget", "tokens", "max(moeguard_budget_max_decode_tokens{SEL})"),
    Signal("max_batch_requests", "batch budget", "requests", "max(moeguard_budget_max_batch_requests{SEL})"),
    Signal("max_concurrent_batches", "conc. batches", "batches", "max(moeguard_budget_max_concurrent_batches{SEL})"),
    Signal("skew_ratio", "skew", "ratio",
           f"histogram_quantile(1, sum by (le) (increase({METRIC_STEP_EXPERT_SKEW_RATIO}_bucket{{SEL}}[WIN])))"),
    Signal("memory_bytes", "memory", "bytes", f"max({METRIC_MEMORY_USAGE_BYTES}{{SEL}})"),
    Signal("soft_limit_bytes", "soft limit", "bytes", f'max({MEMORY_LIMIT_METRIC}{{SEL, limit="soft"}})'),
    Signal("hard_limit_bytes", "hard limit", "bytes", f'max({MEMORY_LIMIT_METRIC}{{SEL, limit="hard"}})'),
    Signal("refusals_per_second", "refusals/s", "requests/s",
           f"sum by (reason) (rate({METRIC_REJECTIONS_TOTAL}{{SEL}}[WIN]))", by="reason"),
    Signal("batches_in_flight", "batches", "batches", f"max({METRIC_BATCHES_IN_FLIGHT}{{SEL}})"),
    Signal("queue_requests", "queue", "requests", f"sum({METRIC_QUEUE_REQUESTS}{{SEL}})"),
    Signal("long_requests_running", "long", "requests", f"sum({METRIC_LONG_REQUESTS_RUNNING}{{SEL}})"),
    Signal("kv_cache_bytes", "KV cache", "bytes", f"max({METRIC_KV_CACHE_BYTES}{{SEL}})"),
)
"""What the timeline shows. Budgets, memory, batches in flight and KV are the highest pod's (the budgets and
limits are per worker); queue, long requests and refusals are summed over the pods."""
SIGNAL_BY_KEY = {s.key: s for s in SIGNALS}


def _promql_string(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def range_queries(namespace: str, name: str, window_seconds: int = RATE_WINDOW_SECONDS) -> dict[str, str]:
    """The PromQL of every timeline signal (key → query) for the service ``name`` in ``namespace``; every
    worker series carries both labels (``contract.WORKER_LABELS``)."""
    sel = f'{LABEL_NAMESPACE}="{_promql_string(namespace)}", {LABEL_SERVICE}="{_promql_string(name)}"'
    return {s.key: s.promql.replace("SEL", sel).replace("WIN", f"{window_seconds}s") for s in SIGNALS}


def grid(now: datetime, minutes: int, step_seconds: int = STEP_SECONDS) -> tuple[float, float, int]:
    """The timeline's steps: ``(start, end, count)``, Unix seconds, ``end`` the last whole step at or before
    ``now`` and ``start`` ``minutes`` before it (both included: ``count`` = minutes × 60 / step + 1).

    Raises:
        ValueError: ``minutes`` or ``step_seconds`` below 1.
    """
    if minutes < 1 or step_seconds < 1:
        raise ValueError(f"minutes ({minutes}) and step_seconds ({step_seconds}) must be at least 1")
    end = math.floor(now.timestamp() / step_seconds) * step_seconds
    count = minutes * 60 // step_seconds + 1
    return float(end - (count - 1) * step_seconds), float(end), count


# --- range answers -----------------------------------------------------------------

@dataclass(frozen=True)
class RangeAnswer:
    """Prometheus's answer to one range query (``/api/v1/query_range``): the decoded JSON body, or ``problem``
    (why there is none: a fixed reason such as ``PrometheusUnreachable``, never the answer's text)."""

    body: Any = None
    problem: str | None = None


def read_range(answer: RangeAnswer) -> tuple[list[tuple[dict[str, str], dict[float, float | None]]], str | None]:
    """The series of a range answer: ``([(labels, {time: value})], None)``, a non-finite value as None; or
    ``([], why)`` when the query failed or the envelope is not a success matrix. A malformed series (labels not
    strings, a sample not ``[time, "number"]``) is left out."""
    if answer.problem is not None:
        return [], answer.problem
    body = answer.body
    data = body.get("data") if isinstance(body, dict) else None
    if (not isinstance(data, dict) or body.get("status") != "success" or data.get("resultType") != "matrix"
            or not isinstance(data.get("result"), list)):
        return [], MALFORMED
    out = []
    for entry in data["result"]:
        metric = entry.get("metric") if isinstance(entry, dict) else None
        values = entry.get("values") if isinstance(entry, dict) else None
        if not isinstance(metric, dict) or not isinstance(values, list):
            continue
        points: dict[float, float | None] = {}
        for sample in values:
            if (isinstance(sample, list) and len(sample) == 2 and isinstance(sample[0], int | float)
                    and not isinstance(sample[0], bool) and isinstance(sample[1], str)):
                try:
                    number = float(sample[1])
                except ValueError:
                    continue
                points[float(sample[0])] = number if math.isfinite(number) else None
        out.append(({str(k): str(v) for k, v in metric.items()}, points))
    return out, None


# --- the report --------------------------------------------------------------------

class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class FindingView(_Out):
    """One finding of ``status.diagnosis``, with the remedy as a command where it has a patch."""

    kind: str
    since: datetime
    last_seen: datetime
    message: str
    evidence: list[Evidence]
    remedy: str
    patch: str | None
    patch_command: str | None
    """``kubectl -n NS patch moeis NAME --type merge -p '<patch>'`` (shell-quoted), or None."""
    pods: list[str]


class ConditionView(_Out):
    type: str
    status: str
    reason: str = ""
    message: str = ""


class EventView(_Out):
    time: datetime | None
    type: str
    reason: str
    message: str
    count: int


class Timeline(_Out):
    """The timeline: one value per step per signal (None: no sample at that step). ``values`` holds every
    signal of :data:`SIGNALS` with one series (``refusals_per_second`` summed over the reasons) plus
    ``memory_percent`` (memory / hard limit, percent); ``refusals_by_reason`` the refusals split."""

    step_seconds: int
    times: list[datetime]
    values: dict[str, list[float | None]]
    refusals_by_reason: dict[str, list[float | None]]
    missing: dict[str, str]
    """Signals without a single value in the window, and why: the query's problem, or ``no data``."""


class Report(_Out):
    namespace: str
    name: str
    generated: datetime
    prometheus_url: str
    minutes: int
    conditions: list[ConditionView]
    budgets: dict[str, Any] | None
    observed: dict[str, Any] | None
    diagnosis_time: datetime | None
    findings: list[FindingView]
    missing_signals: list[str]
    """The operator's: signals its last diagnosis could not see (``status.diagnosis.missingSignals``), plus
    ``status.diagnosis`` itself when it cannot be read."""
    timeline: Timeline
    events: list[EventView]
    events_problem: str | None = None


def patch_command(namespace: str, name: str, patch: str) -> str:
    """The shell command that applies ``patch`` (a JSON merge patch) to the service."""
    return f"kubectl -n {shlex.quote(namespace)} patch moeis {shlex.quote(name)} --type merge -p {shlex.quote(patch)}"


def _parse_time(text: Any) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def event_view(event: Mapping[str, Any]) -> EventView:
    """An Event as the API server returns it (camelCase JSON, core/v1) in the report's terms; its time is the
    latest of ``lastTimestamp``, ``eventTime`` (``series.lastObservedTime``) and ``firstTimestamp``."""
    series = event.get("series") if isinstance(event.get("series"), dict) else {}
    times = [t for t in (_parse_time(event.get("lastTimestamp")), _parse_time((series or {}).get("lastObservedTime")),
                         _parse_time(event.get("eventTime")), _parse_time(event.get("firstTimestamp"))) if t]
    count = event.get("count") or (series or {}).get("count") or 1
    return EventView(time=max(times) if times else None, type=str(event.get("type") or ""),
                     reason=str(event.get("reason") or ""), message=str(event.get("message") or ""),
                     count=int(count) if isinstance(count, int) else 1)


def build_timeline(answers: Mapping[str, RangeAnswer], start: float, step_seconds: int, count: int,
                   hard_limit_bytes: int | None = None) -> Timeline:
    """The timeline from the range answers (key of :data:`SIGNALS` → answer) over the grid ``start`` +
    i × ``step_seconds``, i < ``count`` (Unix seconds). A step without a sample is None; a signal whose query
    is absent, failed or matched nothing is in ``missing``. Memory percent uses the workers' own hard limit
    where they export it, else ``hard_limit_bytes`` (the spec's)."""
    times = [start + i * step_seconds for i in range(count)]
    values: dict[str, list[float | None]] = {}
    by_reason: dict[str, list[float | None]] = {}
    missing: dict[str, str] = {}
    for signal in SIGNALS:
        series, problem = read_range(answers.get(signal.key, RangeAnswer(problem="not asked")))
        if problem is not None:
            missing[signal.key] = problem
        if signal.by is None:
            points = series[0][1] if series else {}
            values[signal.key] = [points.get(t) for t in times]
        else:
            for labels, points in series:
                by_reason[labels.get(signal.by, "")] = [points.get(t) for t in times]
            columns = list(by_reason.values())
            values[signal.key] = [None if all(c[i] is None for c in columns) else
                                  sum(c[i] or 0.0 for c in columns) for i in range(count)]
        if problem is None and all(v is None for v in values[signal.key]):
            missing[signal.key] = "no data"
    hard = values["hard_limit_bytes"]
    values["memory_percent"] = [
        None if m is None or not (h or hard_limit_bytes) else 100.0 * m / float(h or hard_limit_bytes or 1)
        for m, h in zip(values["memory_bytes"], hard, strict=True)]
    return Timeline(step_seconds=step_seconds, times=[datetime.fromtimestamp(t, UTC) for t in times],
                    values=values, refusals_by_reason=dict(sorted(by_reason.items())), missing=missing)


def _hard_limit(service: Mapping[str, Any]) -> int | None:
    from kubernetes.utils.quantity import parse_quantity

    text = ((service.get("spec") or {}).get("resources") or {}).get("hardLimit")
    try:
        return int(parse_quantity(text)) if text else None
    except (ValueError, ArithmeticError):
        return None


def build_report(service: Mapping[str, Any], events: Sequence[Mapping[str, Any]] | None,
                 answers: Mapping[str, RangeAnswer], *, now: datetime, minutes: int, prometheus_url: str,
                 step_seconds: int = STEP_SECONDS, events_problem: str | None = None) -> Report:
    """The report of the service object ``service`` (as the API server returns it), its ``events`` (None:
    they could not be listed, ``events_problem`` says why) and the range ``answers`` over the grid of
    :func:`grid` (``now``, ``minutes``). Events older than ``minutes`` are left out; the rest are oldest first."""
    meta, status = service.get("metadata") or {}, service.get("status") or {}
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    missing: list[str] = []
    diagnosis = DiagnosisStatus()
    if status.get("diagnosis") is not None:
        try:
            diagnosis = DiagnosisStatus.model_validate(status["diagnosis"])
        except ValidationError as exc:
            missing.append(f"status.diagnosis (unreadable: {exc.error_count()} invalid fields)")
    missing = [*diagnosis.missing_signals, *missing]
    findings = [FindingView(
        kind=f.kind, since=f.since, last_seen=f.last_seen, message=f.message,
        evidence=list(f.evidence), remedy=f.remedy, patch=f.patch,
        patch_command=patch_command(namespace, name, f.patch) if f.patch else None, pods=list(f.pods))
        for f in sorted(diagnosis.findings, key=lambda f: f.since)]
    conditions = [ConditionView(type=str(c.get("type", "")), status=str(c.get("status", "")),
                                reason=str(c.get("reason") or ""), message=str(c.get("message") or ""))
                  for c in status.get("conditions") or [] if isinstance(c, dict)]
    start, _, count = grid(now, minutes, step_seconds)
    oldest = now.timestamp() - minutes * 60
    views = sorted((event_view(e) for e in events or []), key=lambda e: e.time or datetime.min.replace(tzinfo=UTC))
    return Report(
        namespace=namespace, name=name, generated=now, prometheus_url=prometheus_url, minutes=minutes,
        conditions=conditions, budgets=status.get("budgets"), observed=status.get("observed"),
        diagnosis_time=diagnosis.time, findings=findings, missing_signals=missing,
        timeline=build_timeline(answers, start, step_seconds, count, _hard_limit(service)),
        events=[e for e in views if e.time is None or e.time.timestamp() >= oldest],
        events_problem=events_problem if events is None else None)


# --- rendering ---------------------------------------------------------------------

def fmt(value: float | None, unit: str = "") -> str:
    """A value for people: ``—`` when missing; bytes in GiB or MiB; ratios with two decimals."""
    if value is None:
        return "—"
    if unit == "bytes":
        return f"{value / GiB:.2f} GiB" if abs(value) >= GiB else f"{value / 2**20:.1f} MiB"
    if unit == "bytes/s":
        return f"{value / 2**20:.2f} MiB/s"
    if unit in ("ratio", "requests/s", "%"):
        return f"{value:.2f}{'%' if unit == '%' else ''}"
    return f"{value:g}"


def _ago(t: datetime, now: datetime) -> str:
    seconds = int((now - t).total_seconds())
    if seconds < 120:
        return f"{seconds}s ago"
    return f"{seconds // 60}m ago" if seconds < 7200 else f"{seconds // 3600}h{seconds % 3600 // 60:02d}m ago"


TIMELINE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("max_prefill_tokens", "prefill budget", ""), ("max_concurrent_batches", "conc. batches", ""),
    ("skew_ratio", "skew", "ratio"), ("memory_percent", "memory %", "%"),
    ("refusals_per_second", "refusals/s", "requests/s"), ("batches_in_flight", "batches", ""),
    ("queue_requests", "queue", ""), ("long_requests_running", "long", ""), ("kv_cache_bytes", "KV cache", "bytes"),
)
"""The compact timeline table: (value key, heading, unit)."""


def render(report: Report, console: Console) -> None:
    """Print ``report`` for people: the findings with their evidence, remedy and patch command; the signals
    missing; the conditions; the timeline table; the Events."""
    now = report.generated
    console.print(Text.assemble((f"moeguard diagnose {report.namespace}/{report.name}", "bold"),
                                f" ({now:%Y-%m-%d %H:%M:%S} UTC, last {report.minutes} min, "
                                f"Prometheus {report.prometheus_url})"))
    if report.budgets:
        console.print("budgets in effect: " + ", ".join(f"{k}={v}" for k, v in report.budgets.items()), markup=False)
    if not report.findings:
        seen = f" (diagnosis at {report.diagnosis_time:%H:%M:%S})" if report.diagnosis_time else \
            " (the operator has written no diagnosis yet)"
        console.print(Text(f"No finding: moeguard names no incident cause for this service{seen}.", style="green"))
    for f in report.findings:
        console.print()
        console.print(Text.assemble((f.kind, "bold red"), f" since {f.since:%H:%M:%S} ({_ago(f.since, now)}), "
                                    f"last seen {f.last_seen:%H:%M:%S}"))
        console.print(f"  {f.message}", markup=False)
        if f.pods:
            console.print(f"  pods: {', '.join(f.pods)}", markup=False)
        if f.evidence:
            table = Table(box=None, padding=(0, 2), show_edge=False)
            for col in ("signal", "value", "pod", "metric", "detail"):
                table.add_column(col, overflow="fold")
            for e in f.evidence:
                table.add_row(e.signal, f"{fmt(e.value, e.unit)} {'' if e.unit in ('bytes', 'bytes/s', 'ratio') else e.unit}"
                              .strip(), e.pod or "(service)", e.metric, e.detail)
            console.print(table)
        console.print(f"  remedy: {f.remedy}", markup=False)
        if f.patch_command:
            console.print(f"  {f.patch_command}", markup=False, soft_wrap=True)
    missing = [*report.missing_signals,
               *(f"{SIGNAL_BY_KEY[k].heading} ({k}): {why}" for k, why in report.timeline.missing.items())]
    if missing:
        console.print()
        console.print(Text("Missing signals:", style="yellow"))
        for line in missing:
            console.print(f"  - {line}", markup=False)
    if report.conditions:
        console.print()
        table = Table(title="conditions", title_justify="left", box=None, padding=(0, 2))
        for col in ("type", "status", "reason", "message"):
            table.add_column(col, overflow="fold")
        for c in report.conditions:
            table.add_row(c.type, c.status, c.reason, c.message)
        console.print(table)
    console.print()
    tl = report.timeline
    table = Table(title=f"timeline (every {tl.step_seconds} s; — = no sample)", title_justify="left")
    table.add_column("time (UTC)")
    for _, heading, _ in TIMELINE_COLUMNS:
        table.add_column(heading, justify="right")
    for i, t in enumerate(tl.times):
        table.add_row(f"{t:%H:%M:%S}", *(fmt(tl.values[key][i], unit) for key, _, unit in TIMELINE_COLUMNS))
    console.print(table)
    if tl.refusals_by_reason:
        totals = {r: sum(v or 0.0 for v in vs) * tl.step_seconds for r, vs in tl.refusals_by_reason.items()}
        console.print("refusals by reason (about, in the window): "
                      + ", ".join(f"{r or '(none)'} {n:.0f}" for r, n in totals.items()), markup=False)
    console.print()
    if report.events_problem:
        console.print(f"Events: could not be listed ({report.events_problem})", markup=False)
    elif not report.events:
        console.print(f"Events: none in the last {report.minutes} min.")
    else:
        table = Table(title=f"Events (last {report.minutes} min)", title_justify="left", box=None, padding=(0, 2))
        for col in ("time", "type", "reason", "count", "message"):
            table.add_column(col, overflow="fold")
        for ev in report.events:
            table.add_row(f"{ev.time:%H:%M:%S}" if ev.time else "—", ev.type, ev.reason, str(ev.count), ev.message)
        console.print(table)
