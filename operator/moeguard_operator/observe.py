"""Observation from Prometheus: PromQL over HTTP (httpx), each query under a hard total deadline.

Every query is an instant query over the service's series (labels ``namespace``
and ``moeis``, set by the worker itself). Prometheus is an untrusted, unreliable
dependency:

* a query that fails (unreachable, TLS, HTTP error, past its deadline, a malformed
  envelope) makes the whole look *blind* (``error`` set, values None);
* a malformed series (metric not an object, value not a ``[time, "number"]`` pair,
  a non-numeric value) is *no data* for that series, and the look says so;
* a non-finite value (``NaN``, ``±Inf``: Prometheus's way to say "nothing to divide") is no
  data for that series;
* what reaches ``error`` (and so status conditions and Events) is built from fixed text
  only: one of :data:`PROBLEMS`, an HTTP status code, the URL without credentials, and the
  operator's own query names. Never a byte of a remote answer.

An empty answer gives None for that value. Never 0 (KEDA #965, AIBrix #1032: missing values read as 0.0).

:func:`read_answer` and the ``parse_*`` functions are pure; :func:`fetch_all` is the I/O.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from moeguard_operator.models import MoEInferenceServiceSpec
from moeguard_operator.podstate import PodFacts
from moeguard_operator.policy import Observation
from moeguard_runtime.contract import (
    LABEL_NAMESPACE,
    LABEL_POD,
    LABEL_SERVICE,
    METRIC_E2E_LATENCY_SECONDS,
    METRIC_EXPERT_SKEW_RATIO,
    METRIC_MEMORY_GROWTH_BYTES_PER_SECOND,
    METRIC_MEMORY_LEAK_SUSPECTED,
    METRIC_MEMORY_USAGE_BYTES,
    METRIC_PROCESS_RSS_BYTES,
    METRIC_REJECTIONS_TOTAL,
)

QUERY_DEADLINE_SECONDS = 5.0
"""Hard total deadline of one query, seconds: connect, TLS, request, headers and the whole body.
The queries of one look run concurrently, so a look's Prometheus part ends within about this."""
MAX_ANSWER_BYTES = 8 * 2**20
"""Largest answer read, bytes (one service's series are a few KiB); a longer one is malformed."""

UNREACHABLE = "PrometheusUnreachable"
TLS_ERROR = "PrometheusTLSError"
TIMEOUT = "PrometheusTimeout"
BAD_REQUEST = "PrometheusBadRequest"
HTTP_ERROR = "PrometheusHTTPError"
MALFORMED = "PrometheusMalformedAnswer"
PROBLEMS = (UNREACHABLE, TLS_ERROR, TIMEOUT, BAD_REQUEST, HTTP_ERROR, MALFORMED)
"""The fixed reasons a query fails with (``PrometheusHTTPError`` is followed by the status code)."""


@dataclass(frozen=True)
class Answer:
    """One query's answer, as far as it can be trusted.

    Attributes:
        series: the well-formed series: ``(labels, value)``; value None when non-finite.
        problem: None, or a fixed reason (:data:`PROBLEMS`), with the HTTP status for ``PrometheusHTTPError``
            (``"PrometheusHTTPError 502"``). Never text from the answer.
        blind: the whole query failed (transport, HTTP, envelope); False when only some series were malformed.
    """

    series: tuple[tuple[Mapping[str, str], float | None], ...] = ()
    problem: str | None = None
    blind: bool = False


def failed(problem: str) -> Answer:
    """A query that failed as a whole with ``problem`` (a fixed reason)."""
    return Answer(problem=problem, blind=True)


def read_answer(status_code: int, body: bytes) -> Answer:
    """Judge one HTTP answer to an instant query (``/api/v1/query``), pure.

    * 2xx with ``{"status": "success", "data": {"resultType": "vector", "result": [...]}}``: the series;
      each malformed entry (metric not an object of strings, value not ``[time, "number"]``) is left out
      and the answer's ``problem`` is ``PrometheusMalformedAnswer``; a non-finite value is kept as None.
    * 400 and 422 (Prometheus refuses the query, or cannot run it): ``PrometheusBadRequest``;
    * any other non-2xx status: ``PrometheusHTTPError <code>``;
    * 2xx that is not JSON, or not that envelope (an ``error`` status, another result type,
      ``result`` not a list): ``PrometheusMalformedAnswer``.
    """
    if status_code in (400, 422):
        return failed(BAD_REQUEST)
    if not 200 <= status_code < 300:
        return failed(f"{HTTP_ERROR} {int(status_code)}")
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return failed(MALFORMED)
    data = doc.get("data") if isinstance(doc, dict) else None
    if (not isinstance(data, dict) or doc.get("status") != "success" or data.get("resultType") != "vector"
            or not isinstance(data.get("result"), list)):
        return failed(MALFORMED)
    series: list[tuple[Mapping[str, str], float | None]] = []
    malformed = False
    for entry in data["result"]:
        sample = read_sample(entry)
        if sample is None:
            malformed = True
        else:
            series.append(sample)
    return Answer(series=tuple(series), problem=MALFORMED if malformed else None)


def read_sample(entry: Any) -> tuple[Mapping[str, str], float | None] | None:
    """One series of a vector result: ``(labels, value)``, value None when non-finite; None when malformed."""
    if not isinstance(entry, dict):
        return None
    metric, value = entry.get("metric"), entry.get("value")
    if not isinstance(metric, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metric.items()):
        return None
    if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], str):
        return None
    if isinstance(value[0], bool) or not isinstance(value[0], int | float):
        return None
    try:
        number = float(value[1])
    except ValueError:
        return None
    return metric, number if math.isfinite(number) else None


def safe_url(url: str) -> str:
    """``url`` as messages show it: without user:password, query or fragment."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            netloc += f":{parts.port}"
    except ValueError:
        return "(an invalid URL)"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@functools.lru_cache(maxsize=8)
def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """The TLS verification used for Prometheus: the system trust store, or only ``ca_file`` (a PEM bundle).
    Certificates and host names are always verified.

    Raises:
        OSError, ssl.SSLError: ``ca_file`` cannot be read or holds no certificate.
    """
    return ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()


def transport_problem(exc: BaseException) -> str:
    """The fixed reason for an exception raised while asking (never its text)."""
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return TIMEOUT
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLError | ssl.CertificateError):
            return TLS_ERROR
        cause = cause.__cause__ or cause.__context__
    return UNREACHABLE


async def _fetch(client: httpx.AsyncClient, url: str, query: str, deadline_seconds: float) -> Answer:
    async def ask() -> Answer:
        async with client.stream("GET", url, params={"query": query}) as response:
            body = bytearray()
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    return failed(MALFORMED)
            return read_answer(response.status_code, bytes(body))

    try:
        async with asyncio.timeout(deadline_seconds):  # total: connect, headers and every byte of the body
            return await ask()
    except (TimeoutError, httpx.HTTPError, OSError, ssl.SSLError) as exc:
        return failed(transport_problem(exc))


async def _fetch_all(base_url: str, queries: Mapping[str, str], deadline_seconds: float,
                     verify: ssl.SSLContext) -> dict[str, Answer]:
    url = base_url.rstrip("/") + "/api/v1/query"
    # httpx's own timeouts are per operation (a trickling server resets the read timeout with every
    # byte): the deadline that counts is asyncio.timeout around each whole request.
    async with httpx.AsyncClient(verify=verify, timeout=httpx.Timeout(deadline_seconds), follow_redirects=False,
                                 trust_env=False, headers={"Accept-Encoding": "identity"}) as client:
        answers = await asyncio.gather(*(_fetch(client, url, q, deadline_seconds) for q in queries.values()))
    return dict(zip(queries, answers, strict=True))


def fetch_all(base_url: str, queries: Mapping[str, str], *, deadline_seconds: float = QUERY_DEADLINE_SECONDS,
              ca_file: str | None = None) -> dict[str, Answer]:
    """Run ``queries`` (name → PromQL) as instant queries against the Prometheus at ``base_url``, concurrently,
    each under a hard total deadline of ``deadline_seconds`` (seconds); returns name → :class:`Answer`.

    Never raises for what Prometheus (or the network) does: every failure is an :class:`Answer` with a
    fixed ``problem``. TLS is verified against the system trust store, or ``ca_file`` (PEM) when set; a CA
    file that cannot be loaded fails every query with ``PrometheusTLSError``. Call it from a thread with no
    running event loop (kopf runs sync handlers in worker threads).
    """
    try:
        verify = tls_context(ca_file)
    except (OSError, ssl.SSLError):
        return {name: failed(TLS_ERROR) for name in queries}
    # Not asyncio.run: it waits for the loop's executor threads, and a DNS lookup still running there
    # (getaddrinfo cannot be cancelled) would hold the look past its deadline. close() does not wait.
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_fetch_all(base_url, queries, deadline_seconds, verify))
    except (httpx.InvalidURL, httpx.UnsupportedProtocol, ValueError):
        return {name: failed(UNREACHABLE) for name in queries}
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


@dataclass(frozen=True)
class Queries:
    """The PromQL the loop runs for one MoEInferenceService."""

    skew: str
    memory: str
    rss_slope: str
    leak_kinds: str
    growth: str
    rejection_rate: str
    p99_latency: str
    reporting_pods: str


def queries(namespace: str, name: str, window_seconds: int, leak_window_seconds: int) -> Queries:
    """PromQL for ``name`` in ``namespace`` over the given windows (seconds)."""
    sel = f'{LABEL_NAMESPACE}="{namespace}",{LABEL_SERVICE}="{name}"'
    w, lw = f"{window_seconds}s", f"{leak_window_seconds}s"
    return Queries(
        skew=f"max(max_over_time({METRIC_EXPERT_SKEW_RATIO}{{{sel}}}[{w}]))",
        memory=f"max(max_over_time({METRIC_MEMORY_USAGE_BYTES}{{{sel}}}[{w}]))",
        rss_slope=f"max by ({LABEL_POD}) (deriv({METRIC_PROCESS_RSS_BYTES}{{{sel}}}[{lw}]))",
        leak_kinds=f"max by ({LABEL_POD}, kind) ({METRIC_MEMORY_LEAK_SUSPECTED}{{{sel}}})",
        growth=f"max by ({LABEL_POD}, part) ({METRIC_MEMORY_GROWTH_BYTES_PER_SECOND}{{{sel}}})",
        rejection_rate=f"sum(rate({METRIC_REJECTIONS_TOTAL}{{{sel}}}[{w}]))",
        p99_latency=f"histogram_quantile(0.99, sum by (le) (rate({METRIC_E2E_LATENCY_SECONDS}_bucket{{{sel}}}[{w}])))",
        reporting_pods=f"count by ({LABEL_POD}) ({METRIC_PROCESS_RSS_BYTES}{{{sel}}})",
    )


def skew_query(namespace: str, name: str, window_seconds: int) -> str:
    """PromQL: the highest expert skew ratio among ``name``'s pods over the window."""
    return queries(namespace, name, window_seconds, window_seconds).skew


def parse_scalar(answer: Answer) -> tuple[float | None, str | None]:
    """The one number of an answer: ``(value, None)``, or ``(None, why)`` — ``no series matched``,
    ``non-finite value`` or the answer's fixed problem."""
    if answer.blind:
        return None, answer.problem
    if not answer.series:
        return None, answer.problem or "no series matched"
    value = answer.series[0][1]
    if value is None:
        return None, "non-finite value"
    return value, None


def parse_by_labels(answer: Answer, labels: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    """``{(value of each of labels): number}`` from an answer; series without one of the labels, or with a
    non-finite value, are left out."""
    return {tuple(metric[label] for label in labels): value for metric, value in answer.series
            if value is not None and all(label in metric for label in labels)}


def parse_by_label(answer: Answer, label: str) -> dict[str, float]:
    """``{label value: number}`` from an answer; series without the label or non-finite are left out."""
    return {key[0]: value for key, value in parse_by_labels(answer, (label,)).items()}


def leak_signals(kinds: Answer, growth: Answer,
                 counted: Callable[[str], bool]) -> tuple[tuple[str, ...], tuple[tuple[str, float], ...]]:
    """The leak kinds the counted pods flag (``moeguard_memory_leak_suspected{kind} == 1``), sorted, and the
    highest growth per memory part among them (``moeguard_memory_growth_bytes_per_second{part}``, bytes/s)."""
    flagged = sorted({kind for (pod, kind), v in parse_by_labels(kinds, (LABEL_POD, "kind")).items()
                      if counted(pod) and v >= 1})
    parts: dict[str, float] = {}
    for (pod, part), v in parse_by_labels(growth, (LABEL_POD, "part")).items():
        if counted(pod):
            parts[part] = max(v, parts.get(part, -math.inf))
    return tuple(flagged), tuple(sorted(parts.items()))


def parse_label_values(answer: Answer, label: str) -> tuple[str, ...]:
    """The values of ``label`` across the series of an answer, sorted."""
    return tuple(sorted({metric[label] for metric, _ in answer.series if label in metric}))


def problems(url: str, answers: Mapping[str, Answer]) -> str | None:
    """Why a look cannot be trusted, from fixed text only: ``Prometheus at URL: PrometheusTimeout``, naming
    the queries when only some failed or had malformed series; None when every answer was well formed."""
    by_problem: dict[str, list[str]] = {}
    for name, answer in answers.items():
        if answer.problem is not None:
            by_problem.setdefault(answer.problem, []).append(name)
    if not by_problem:
        return None
    parts = [problem if len(names) == len(answers) else f"{problem} ({', '.join(names)})"
             for problem, names in sorted(by_problem.items())]
    return f"Prometheus at {safe_url(url)}: {'; '.join(parts)}"


def observe(
    prometheus_url: str,
    namespace: str,
    name: str,
    *,
    hard_limit_bytes: int,
    window_seconds: int,
    leak_window_seconds: int,
    expected_pods: tuple[str, ...],
    new_oom_kills: int,
    now: datetime,
    slope_pods: tuple[str, ...] | None = None,
    ca_file: str | None = None,
    deadline_seconds: float = QUERY_DEADLINE_SECONDS,
) -> Observation:
    """One look at Prometheus for ``name``; Kubernetes facts (pods, OOM kills) are passed in.

    ``slope_pods``: the pods whose RSS slope counts — those whose worker has run for at
    least the leak window, so that start-up growth (model load, first batches) is never
    read as a leak. None: every pod. ``ca_file``: PEM bundle to verify Prometheus's certificate
    with (None: the system trust store). ``deadline_seconds``: each query's total deadline.
    Any failed query, or any malformed series, sets ``error`` (the look is blind; budgets hold).
    """
    q = queries(namespace, name, window_seconds, leak_window_seconds)
    answers = fetch_all(prometheus_url, {field: getattr(q, field) for field in q.__dataclass_fields__},
                        deadline_seconds=deadline_seconds, ca_file=ca_file)
    trouble = problems(prometheus_url, answers)
    if any(a.blind for a in answers.values()):
        return Observation(time=now, expected_pods=expected_pods, new_oom_kills=new_oom_kills, error=trouble)
    skew, _ = parse_scalar(answers["skew"])
    memory, memory_err = parse_scalar(answers["memory"])

    def counts(pod: str) -> bool:
        return slope_pods is None or pod in slope_pods

    slopes = parse_by_label(answers["rss_slope"], LABEL_POD)
    counted = [v for pod, v in slopes.items() if counts(pod)]
    slope = max(counted) if counted else None
    leak_kinds, growth = leak_signals(answers["leak_kinds"], answers["growth"], counts)
    rejections, _ = parse_scalar(answers["rejection_rate"])
    p99, _ = parse_scalar(answers["p99_latency"])
    missing = [trouble] if trouble else []
    if memory_err and memory_err != MALFORMED:
        missing.append(f"memory: {memory_err}")  # skew appears only after large batches
    return Observation(
        time=now,
        skew_ratio=skew,
        memory_ratio=None if memory is None else memory / hard_limit_bytes,
        rss_slope_bytes_per_second=slope,
        leak_kinds=leak_kinds,
        growth_bytes_per_second=growth,
        rejection_rate_per_second=rejections,
        p99_latency_seconds=p99,
        expected_pods=expected_pods,
        reporting_pods=parse_label_values(answers["reporting_pods"], LABEL_POD),
        new_oom_kills=new_oom_kills,
        error="; ".join(missing) or None,
    )


def observe_service(default_url: str | None, namespace: str, name: str, spec: MoEInferenceServiceSpec,
                    facts: PodFacts, new_oom_kills: int, now: datetime, ca_file: str | None = None) -> Observation:
    """One look for a service: at ``spec.control.prometheusUrl`` (checked against the operator's allowlist at
    reconcile: :func:`spec_checks.check_prometheus_url`), else ``default_url`` (the operator's); with neither,
    a blind observation that says so. Kubernetes facts (pods, OOM kills) are passed in; ``ca_file``: the
    operator's ``--prometheus-ca-file``."""
    url = spec.control.prometheus_url or default_url
    if not url:
        return Observation(time=now, expected_pods=facts.running, new_oom_kills=new_oom_kills,
                           error="no Prometheus URL configured (spec.control.prometheusUrl or --prometheus-url)")
    control = spec.control
    return observe(url, namespace, name, hard_limit_bytes=spec.resources.hard_limit_bytes,
                   window_seconds=control.window_seconds, leak_window_seconds=control.leak_window_seconds,
                   expected_pods=facts.running, new_oom_kills=new_oom_kills, now=now,
                   slope_pods=facts.running_since(now - timedelta(seconds=control.leak_window_seconds)),
                   ca_file=ca_file)


@dataclass(frozen=True)
class Target:
    """One MoEInferenceService to look at in a tick, with what the Kubernetes API says of its pods.

    Attributes:
        namespace, name: the service.
        spec: its parsed spec (windows, hard limit).
        running_pods: names of its worker pods that are Running now (only their series count).
        slope_pods: those running for at least ``control.leakWindowSeconds`` (their RSS slope counts).
        new_oom_kills: OOMKilled terminations since the previous look.
    """

    namespace: str
    name: str
    spec: MoEInferenceServiceSpec
    running_pods: tuple[str, ...]
    slope_pods: tuple[str, ...]
    new_oom_kills: int = 0


def observe_services(url: str, targets: Sequence[Target], now: datetime, *, ca_file: str | None = None,
                     deadline_seconds: float = QUERY_DEADLINE_SECONDS) -> dict[tuple[str, str], Observation]:
    """One look at the Prometheus at ``url`` for every target: ``(namespace, name)`` → :class:`Observation`.

    Blocking (runs its own event loop: call it from a thread). Interim implementation: one :func:`observe`
    per target, in turn; to be replaced by one grouped query per signal for all targets.
    """
    return {(t.namespace, t.name): observe(
        url, t.namespace, t.name, hard_limit_bytes=t.spec.resources.hard_limit_bytes,
        window_seconds=t.spec.control.window_seconds, leak_window_seconds=t.spec.control.leak_window_seconds,
        expected_pods=t.running_pods, new_oom_kills=t.new_oom_kills, now=now, slope_pods=t.slope_pods,
        ca_file=ca_file, deadline_seconds=deadline_seconds) for t in targets}
