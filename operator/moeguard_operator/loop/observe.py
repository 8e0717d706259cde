"""Observation from Prometheus: PromQL over HTTP (httpx), each query under a hard total deadline.

One look asks the Prometheus at one URL about *every* service that names it
(:func:`observe_services`): one query per signal and per distinct pair of windows, whatever the
number of services, each grouped ``by (namespace, moeis, pod)`` (the labels the worker sets on
every series itself, ``contract.WORKER_LABELS``); each service gets its slice, and maxima over
pods, sums and the rest are computed here from the per-pod series. So the queries per tick do
not grow with the number of services.

Only the series of the pods that are Running now count (``Target.running_pods``, names from
the Kubernetes API): the series of a deleted service's pods, or of a rollout's old ReplicaSet,
never steer the pods that replaced them, even under the same service name.

A windowed signal needs a window's worth of history (:data:`MIN_WINDOW_SAMPLES`,
:func:`history_ok`): until a pod's series reach back to the window's start, its skew, rates,
quantiles and RSS slope are Unknown, never 0 or flat (Prometheus restarted with its data wiped,
a pod just born, a scrape gap).

Prometheus is an untrusted, unreliable dependency:

* a query that fails (unreachable, TLS, HTTP error, past its deadline, a malformed
  envelope) makes the whole look *blind* (``error`` set, values None);
* a malformed series (metric not an object, value not a ``[time, "number"]`` pair,
  a non-numeric value, or without the grouping labels) is *no data* for that series, and the look says so;
* a non-finite value (``NaN``, ``±Inf``: Prometheus's way to say "nothing to divide") is no
  data for that series;
* what reaches ``error`` (and so status conditions and Events) is built from fixed text
  only: one of :data:`PROBLEMS`, an HTTP status code, the URL without credentials, and the
  operator's own query names. Never a byte of a remote answer.

An empty answer gives None for that value. Never 0 (KEDA #965, AIBrix #1032: missing values read as 0.0).

:func:`read_answer`, the ``parse_*`` functions and :func:`slice_look` are pure; :func:`fetch_all` is the I/O.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
import ssl
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from moeguard_core.contract import (
    LABEL_NAMESPACE,
    LABEL_POD,
    LABEL_SERVICE,
    METRIC_BATCHES_IN_FLIGHT,
    METRIC_BUDGET_GENERATION,
    METRIC_E2E_LATENCY_SECONDS,
    METRIC_EP_RANK_TOKENS_TOTAL,
    METRIC_EXPERT_TOKENS_TOTAL,
    METRIC_EXPERT_TOP_SHARE_RATIO,
    METRIC_GPU_MEMORY_ALLOCATED_BYTES,
    METRIC_GPU_MEMORY_RESERVED_BYTES,
    METRIC_KV_CACHE_BYTES,
    METRIC_LONG_REQUESTS_ADMITTED_TOTAL,
    METRIC_LONG_REQUESTS_RUNNING,
    METRIC_MEMORY_CHUNK_SHRINKS_TOTAL,
    METRIC_MEMORY_GROWTH_BYTES_PER_SECOND,
    METRIC_MEMORY_IDLE_FOOTPRINT_BYTES,
    METRIC_MEMORY_LEAK_SUSPECTED,
    METRIC_MEMORY_LIMIT_STATE,
    METRIC_MEMORY_MODEL_INFO,
    METRIC_MEMORY_PEAK_BREAKDOWN_BYTES,
    METRIC_MEMORY_PREDICTION_CORRECTION_RATIO,
    METRIC_MEMORY_USAGE_BYTES,
    METRIC_OOM_ERRORS_TOTAL,
    METRIC_PROCESS_MEMORY_MAPPINGS_GROWTH,
    METRIC_PROCESS_RSS_ANONYMOUS_BYTES,
    METRIC_PROCESS_RSS_BYTES,
    METRIC_PYTHON_ALLOCATED_BLOCKS,
    METRIC_QUEUE_REQUESTS,
    METRIC_REJECTIONS_TOTAL,
    METRIC_REQUEST_CONTEXT_TOKENS,
    METRIC_STEP_EXPERT_SKEW_RATIO,
    METRIC_STEP_PREFILL_BATCHES,
    METRIC_STEP_QUEUE_REQUESTS,
    METRIC_TPOT_SECONDS,
    METRIC_TTFT_SECONDS,
    METRIC_UCX_INFO,
    METRIC_WORKER_START_TIME_SECONDS,
)
from moeguard_core.family_shape import ConfigError
from moeguard_core.memory_model_info import MEMORY_MODEL_LABELS, ModelMemory, from_info_labels
from moeguard_operator.loop.observation import ClassLatency, Observation, PodLoad, leak_window_start
from moeguard_operator.loop.podstate import PodFacts
from moeguard_operator.loop.signals import DiagnosisSignals, PodSignals, TopLayer, UcxInfo
from moeguard_operator.spec.models import MoEInferenceServiceSpec

QUERY_DEADLINE_SECONDS = 5.0
"""Hard total deadline of one query, seconds: connect, TLS, request, headers and the whole body.
The queries of one look run concurrently, so a look's Prometheus part ends within about this."""
MAX_ANSWER_BYTES = 8 * 2**20
"""Largest answer read, bytes (a few hundred bytes per pod and signal: 1,000 services of two pods fit); a
longer one is malformed."""
MIN_WINDOW_SAMPLES = 3
"""A pod's windowed signals count only when its RSS series holds at least this many samples in the window
*and* has a sample at or before the window's start (so windowSeconds must span three scrape intervals)."""
GROUP_LABELS = (LABEL_NAMESPACE, LABEL_SERVICE, LABEL_POD)
"""What every grouped query keeps: the worker's own identity labels (``contract.WORKER_LABELS``)."""

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


async def _fetch(client: httpx.AsyncClient, url: str, query: str, deadline_seconds: float,
                 at: datetime | None = None) -> Answer:
    form = {"query": query} if at is None else {"query": query, "time": f"{at.timestamp():.3f}"}

    async def ask() -> Answer:
        # POST, form-encoded (Prometheus HTTP API: for queries that may breach URL length limits): a grouped
        # query names every service, and at ~200 services the diagnosis query passed httpx's 64 KiB URL bound.
        async with client.stream("POST", url, data=form) as response:
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
                     verify: ssl.SSLContext, at: datetime | None = None) -> dict[str, Answer]:
    url = base_url.rstrip("/") + "/api/v1/query"
    # httpx's own timeouts are per operation (a trickling server resets the read timeout with every
    # byte): the deadline that counts is asyncio.timeout around each whole request.
    async with httpx.AsyncClient(verify=verify, timeout=httpx.Timeout(deadline_seconds), follow_redirects=False,
                                 trust_env=False, headers={"Accept-Encoding": "identity"}) as client:
        answers = await asyncio.gather(*(_fetch(client, url, q, deadline_seconds, at) for q in queries.values()))
    return dict(zip(queries, answers, strict=True))


def fetch_all(base_url: str, queries: Mapping[str, str], *, deadline_seconds: float = QUERY_DEADLINE_SECONDS,
              ca_file: str | None = None, at: datetime | None = None) -> dict[str, Answer]:
    """Run ``queries`` (name → PromQL) as instant queries against the Prometheus at ``base_url``, concurrently,
    each under a hard total deadline of ``deadline_seconds`` (seconds); returns name → :class:`Answer`.

    ``at``: the evaluation time of every query (the API's ``time`` parameter), so that the answers are one
    snapshot; None: each query at its own arrival (Prometheus's default). Without it, concurrent queries that
    a loaded Prometheus answers seconds apart can disagree: a CI run saw a look whose history query found a full
    leak window while its slope query, evaluated earlier, found too few samples for ``deriv``.

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
        return loop.run_until_complete(_fetch_all(base_url, queries, deadline_seconds, verify, at))
    except (httpx.InvalidURL, httpx.UnsupportedProtocol, ValueError):
        return {name: failed(UNREACHABLE) for name in queries}
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


@dataclass(frozen=True)
class Queries:
    """The PromQL of one look for a group of services sharing their windows; every answer is per pod
    (``by (namespace, moeis, pod)``)."""

    skew: str
    skew_steps: str
    skew_all: str
    skew_steps_all: str
    worker_age: str
    memory: str
    rss_slope: str
    history: str
    leak_history: str
    leak_kinds: str
    growth: str
    rejection_rate: str
    p99_latency: str
    reporting_pods: str
    pod_load: str = ""
    """The memory prediction's per-pod inputs, one series per pod and signal (label ``signal``:
    :data:`LOAD_SIGNALS`)."""
    latency: str = ""
    """The TTFT and TPOT histograms' bucket counts in the window (label ``histogram``: ``ttft``, ``tpot``), by pod,
    priority and ``le`` (SLO attainment)."""
    diag: str = ""
    """The diagnosis's per-pod numbers, one series per pod and signal (label ``signal``: :data:`DIAG_SIGNALS`)."""
    breakdown: str = ""
    top_share: str = ""
    hot_experts: str = ""
    ucx_info: str = ""
    memory_model: str = ""
    """Each pod's ``moeguard_memory_model_info`` (the model its worker predicts steps with, as labels)."""
    budget_generation: str = ""
    """Each pod's ``moeguard_budget_generation``: the budget document its worker runs (-1: none yet, the
    environment's budgets)."""


LOAD_SIGNALS = ("idle_footprint_bytes", "correction", "context_max_tokens", "context_mean_tokens")
"""The ``signal`` label values of the ``pod_load`` query: :class:`observation.PodLoad` field names."""
DIAG_FIELDS = ("diag", "breakdown", "top_share", "hot_experts", "ucx_info")
"""The diagnosis's queries (issue 14): their failure makes the diagnosis signals missing, never the budget
policy's look blind."""
INFO_FIELDS = ("memory_model", "budget_generation")
"""Queries whose failure or absence leaves what they say unknown (the predictive policy falls back to the spec's
preset), never the budget policy's look blind."""
MEMORY_REFUSALS = ("memory_predicted", "memory_hard_limit")
"""The worker's refusal reasons that are memory failures (``step_loop.MEMORY_REASON``,
``memory_guard.MemoryGuard``'s 503 above the hard limit)."""
DIAG_SIGNALS = ("prefill_batches", "queue_requests", "batches_in_flight", "long_running", "long_admitted",
                "kv_cache_bytes", "memory_failures", "limit_state", "gpu_reserved_bytes", "gpu_allocated_bytes",
                "steady_growth_bytes_per_second", "mappings_growth_per_second", "anonymous_growth_bytes_per_second",
                "python_blocks_growth_per_second")
"""The ``signal`` label values of the ``diag`` query: :class:`signals.PodSignals` field names."""
REQUIRED_SIGNALS = ("prefill_batches", "queue_requests", "long_running", "long_admitted", "memory_failures")
"""The ``diag`` signals every current worker exports (the GPU figures exist only with a GPU, the mapping
slope only once the worker's window filled, the steady growth only for pods older than the leak window)."""


def _matcher(label: str, values: str | Iterable[str]) -> str:
    """``label="v"`` for one value, else ``label=~"v1|v2"`` with every value a literal (RE2-escaped)."""
    vals = sorted({values} if isinstance(values, str) else set(values))
    if not vals:
        raise ValueError(f"no value for {label}")
    if len(vals) == 1:
        return f'{label}="{_promql_string(vals[0])}"'
    return f'{label}=~"{_promql_string("|".join(re.escape(v) for v in vals))}"'


def _promql_string(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def queries(namespaces: str | Iterable[str], names: str | Iterable[str], window_seconds: int,
            leak_window_seconds: int) -> Queries:
    """PromQL for the services ``names`` in ``namespaces`` (one of each, or several: the selector is their
    product, and :func:`slice_look` keeps each service's own series) over the windows (seconds).

    Raises:
        ValueError: no namespace or no name.
    """
    sel = f"{_matcher(LABEL_NAMESPACE, namespaces)},{_matcher(LABEL_SERVICE, names)}"
    w, lw = f"{window_seconds}s", f"{leak_window_seconds}s"
    by = f"by ({', '.join(GROUP_LABELS)})"
    buckets, steps = f"{METRIC_STEP_EXPERT_SKEW_RATIO}_bucket{{{sel}}}", f"{METRIC_STEP_EXPERT_SKEW_RATIO}_count{{{sel}}}"
    rss = f"{METRIC_PROCESS_RSS_BYTES}{{{sel}}}"
    g = ", ".join(GROUP_LABELS)
    ranks = f"{METRIC_EP_RANK_TOKENS_TOTAL}{{{sel}}}"
    in_window = f"({ranks} - {ranks} offset {w})"

    def with_rank_imbalance(expert_skew: str, tokens: str) -> str:
        # Expert parallelism: the rank imbalance (max / mean token-slots per rank of a layer, 1 / EPLB's
        # balancedness) is skew too, for the pod (the group's leader) that counts every rank's tokens.
        imbalance = f"max by ({g}, layer) ({tokens}) / avg by ({g}, layer) ({tokens})"
        return f"max by ({g}) (({expert_skew}) or ({imbalance}))"

    return Queries(
        # The steps in the window, exactly: counter now minus counter at the window's start (no extrapolation);
        # absent for a pod without a sample that old, or whose counter reset within the window.
        skew=with_rank_imbalance(
            f"histogram_quantile(1, sum by ({g}, le) ({buckets} - {buckets} offset {w}))", in_window),
        skew_steps=f"sum {by} ({steps} - {steps} offset {w}) unless on ({', '.join(GROUP_LABELS)}) "
                   f"(resets({steps}[{w}]) > 0)",
        # A worker younger than the window: all its counts are in it (a new pod, a restarted container).
        skew_all=with_rank_imbalance(f"histogram_quantile(1, sum by ({g}, le) ({buckets}))", ranks),
        skew_steps_all=f"sum {by} ({steps})",
        worker_age=f"max {by} (time() - {METRIC_WORKER_START_TIME_SECONDS}{{{sel}}})",
        memory=f"max {by} (max_over_time({METRIC_MEMORY_USAGE_BYTES}{{{sel}}}[{w}]))",
        rss_slope=f"max {by} (deriv({rss}[{lw}]))",
        history=f"max {by} (count_over_time({rss}[{w}]) and {rss} offset {w})",
        leak_history=f"max {by} (count_over_time({rss}[{lw}]) and {rss} offset {lw})",
        leak_kinds=f"max by ({', '.join(GROUP_LABELS)}, kind) ({METRIC_MEMORY_LEAK_SUSPECTED}{{{sel}}})",
        growth=f"max by ({', '.join(GROUP_LABELS)}, part) ({METRIC_MEMORY_GROWTH_BYTES_PER_SECOND}{{{sel}}})",
        rejection_rate=f"sum {by} (rate({METRIC_REJECTIONS_TOTAL}{{{sel}}}[{w}]))",
        p99_latency=f"histogram_quantile(0.99, sum by ({', '.join(GROUP_LABELS)}, le) "
                    f"(rate({METRIC_E2E_LATENCY_SECONDS}_bucket{{{sel}}}[{w}])))",
        reporting_pods=f"count {by} ({rss})",
        pod_load=pod_load_query(sel, window_seconds),
        memory_model=f"max by ({g}, {', '.join(MEMORY_MODEL_LABELS)}) ({METRIC_MEMORY_MODEL_INFO}{{{sel}}})",
        budget_generation=f"max {by} ({METRIC_BUDGET_GENERATION}{{{sel}}})",
        latency=" or ".join(
            f'label_replace(sum by ({g}, priority, le) (increase({metric}_bucket{{{sel}}}[{w}])), "histogram", '
            f'"{name}", "", "")' for name, metric in (("ttft", METRIC_TTFT_SECONDS), ("tpot", METRIC_TPOT_SECONDS))),
        **diagnosis_queries(sel, window_seconds, leak_window_seconds),
    )


def pod_load_query(sel: str, window_seconds: int) -> str:
    """The memory prediction's per-pod inputs (:data:`LOAD_SIGNALS`) for the selector ``sel`` over the window
    (seconds), one query with a ``signal`` label, pure."""
    g, w = ", ".join(GROUP_LABELS), f"{window_seconds}s"
    ctx = METRIC_REQUEST_CONTEXT_TOKENS
    parts = {
        "idle_footprint_bytes": f"max by ({g}) ({METRIC_MEMORY_IDLE_FOOTPRINT_BYTES}{{{sel}}})",
        "correction": f"max by ({g}) ({METRIC_MEMORY_PREDICTION_CORRECTION_RATIO}{{{sel}}})",
        # The longest request's bucket bound (NaN, left out, without a request in the window) and the exact mean
        # (0 / 0, left out, likewise).
        "context_max_tokens": f"(histogram_quantile(1, sum by ({g}, le) (increase({ctx}_bucket{{{sel}}}[{w}]))) >= 0)",
        "context_mean_tokens": f"(sum by ({g}) (increase({ctx}_sum{{{sel}}}[{w}])) "
                               f"/ sum by ({g}) (increase({ctx}_count{{{sel}}}[{w}])) >= 0)",
    }
    return " or ".join(f'label_replace({expr}, "signal", "{name}", "", "")' for name, expr in parts.items())


def steady_growth_steps(window_seconds: int, leak_window_seconds: int) -> tuple[int, int, int]:
    """The steady-growth subquery's ``(sub-window, range, step)``, seconds: each RSS slope over a sub-window of
    ``max(windowSeconds, leakWindowSeconds / 4)`` (windowSeconds spans at least 3 scrapes:
    :data:`MIN_WINDOW_SAMPLES`), evaluated every half sub-window over the rest of the leak window (at least
    one sub-window), so that the sub-windows stay within the leak window."""
    sub = max(window_seconds, leak_window_seconds // 4)
    step = max(1, sub // 2)
    return sub, max(leak_window_seconds - sub, sub), step


def diagnosis_queries(sel: str, window_seconds: int, leak_window_seconds: int) -> dict[str, str]:
    """The diagnosis's PromQL (:data:`DIAG_FIELDS`) for the selector ``sel`` over the windows (seconds), pure."""
    g = ", ".join(GROUP_LABELS)
    w = f"{window_seconds}s"
    sub, span, step = steady_growth_steps(window_seconds, leak_window_seconds)
    rss = f"{METRIC_PROCESS_RSS_BYTES}{{{sel}}}"

    def window_max(metric: str) -> str:
        return f"max by ({g}) (max_over_time({metric}{{{sel}}}[{w}]))"

    def steps_max(histogram: str) -> str:
        """The top bucket bound observed in the window (NaN, left out, when nothing was observed in it)."""
        return f"(histogram_quantile(1, sum by ({g}, le) (increase({histogram}_bucket{{{sel}}}[{w}]))) >= 0)"

    pb = METRIC_STEP_PREFILL_BATCHES
    refusals = "|".join(MEMORY_REFUSALS)
    parts = {
        # No prefill step in the window: the pod reads 0.
        "prefill_batches": f"{steps_max(pb)} or (0 * sum by ({g}) ({pb}_count{{{sel}}}))",
        # The gauge's window max, or the steps' (a burst drained between two scrapes leaves the gauge at 0).
        "queue_requests": f"max by ({g}) ((max_over_time({METRIC_QUEUE_REQUESTS}{{{sel}}}[{w}])) or label_replace("
                          f"{steps_max(METRIC_STEP_QUEUE_REQUESTS)}, \"signal\", \"steps\", \"\", \"\"))",
        "batches_in_flight": window_max(METRIC_BATCHES_IN_FLIGHT),
        "long_running": window_max(METRIC_LONG_REQUESTS_RUNNING),
        # Exact (a count people read in the finding), where increase() would extrapolate to the window's edges.
        "long_admitted": f"sum by ({g}) (max_over_time({METRIC_LONG_REQUESTS_ADMITTED_TOTAL}{{{sel}}}[{w}]) "
                         f"- min_over_time({METRIC_LONG_REQUESTS_ADMITTED_TOTAL}{{{sel}}}[{w}]))",
        "kv_cache_bytes": window_max(METRIC_KV_CACHE_BYTES),
        # Labelled counters appear with their first increment: a reporting pod without any has had none.
        "memory_failures": f"(sum by ({g}) (increase({METRIC_OOM_ERRORS_TOTAL}{{{sel}}}[{w}]) "
                           f"or increase({METRIC_REJECTIONS_TOTAL}{{{sel},reason=~\"{refusals}\"}}[{w}]) "
                           f"or increase({METRIC_MEMORY_CHUNK_SHRINKS_TOTAL}{{{sel}}}[{w}]))) "
                           f"or (0 * count by ({g}) ({rss}))",
        "limit_state": window_max(METRIC_MEMORY_LIMIT_STATE),
        "gpu_reserved_bytes": window_max(METRIC_GPU_MEMORY_RESERVED_BYTES),
        "gpu_allocated_bytes": window_max(METRIC_GPU_MEMORY_ALLOCATED_BYTES),
        "steady_growth_bytes_per_second": f"max by ({g}) (min_over_time(deriv({rss}[{sub}s])[{span}s:{step}s]))",
        "mappings_growth_per_second": f"max by ({g}) ({METRIC_PROCESS_MEMORY_MAPPINGS_GROWTH}{{{sel}}})",
        # The leak's kind, judged over the leak window itself (the worker's own flag looks at its last 60 s).
        "anonymous_growth_bytes_per_second":
            f"max by ({g}) (deriv({METRIC_PROCESS_RSS_ANONYMOUS_BYTES}{{{sel}}}[{leak_window_seconds}s]))",
        "python_blocks_growth_per_second":
            f"max by ({g}) (deriv({METRIC_PYTHON_ALLOCATED_BLOCKS}{{{sel}}}[{leak_window_seconds}s]))",
    }
    share = f"max by ({g}, layer) (max_over_time({METRIC_EXPERT_TOP_SHARE_RATIO}{{{sel}}}[{w}]))"
    top3 = f"topk by ({g}) (3, {share})"
    return {
        "diag": " or ".join(f'label_replace({expr}, "signal", "{name}", "", "")' for name, expr in parts.items()),
        "breakdown": f"max by ({g}, stage) (max_over_time({METRIC_MEMORY_PEAK_BREAKDOWN_BYTES}{{{sel}}}[{w}]))",
        "top_share": top3,
        "hot_experts": f"topk by ({g}, layer) (1, sum by ({g}, layer, expert) "
                       f"(increase({METRIC_EXPERT_TOKENS_TOTAL}{{{sel}}}[{w}]))) and on ({g}, layer) {top3}",
        "ucx_info": f"max by ({g}, loaded, libraries, mmap_hook_mode, rcache_max_unreleased) "
                    f"({METRIC_UCX_INFO}{{{sel}}})",
    }


def skew_query(namespace: str, name: str, window_seconds: int) -> str:
    """PromQL for people (the demo, dashboards): the upper bound of the skew bucket holding the highest step among
    ``name``'s pods in the window (no value when no pod ran a step in it; pods younger than the window are not
    counted: the operator reads those from :attr:`Queries.skew_all`)."""
    return f"max({queries(namespace, name, window_seconds, window_seconds).skew})"


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


def diagnosis_signals(answers: Mapping[str, Answer], reporting: Sequence[str], memory: Mapping[str, float],
                      counts: Callable[[str], bool],
                      ages: Mapping[str, float] | None = None) -> tuple[DiagnosisSignals | None, str | None]:
    """The diagnosis signals of the ``reporting`` pods from one service's sliced answers (:data:`DIAG_FIELDS`,
    plus ``leak_kinds`` and ``growth``), pure; ``memory``: each pod's window max memory in use, bytes;
    ``counts``: whether a pod's leak window counts (older than it); ``ages``: each pod's worker age
    (``worker_age``: since its telemetry started, so a restarted container is young again), seconds.

    Returns ``(signals, None)``, or ``(None, why)`` when a diagnosis query failed or had malformed series (the
    fixed problem text, never a byte of the answer): missing, never 0.
    """
    bad = sorted(f"{name}: {answers[name].problem}" for name in DIAG_FIELDS if answers[name].problem is not None)
    if bad:
        return None, "diagnosis queries failed (" + "; ".join(bad) + ")"
    numbers = parse_by_labels(answers["diag"], (LABEL_POD, "signal"))
    stages = parse_by_labels(answers["breakdown"], (LABEL_POD, "stage"))
    shares = parse_by_labels(answers["top_share"], (LABEL_POD, "layer"))
    hot = {(m[LABEL_POD], m["layer"]): (m["expert"], v) for m, v in answers["hot_experts"].series
           if all(k in m for k in (LABEL_POD, "layer", "expert"))}
    ucx = {m[LABEL_POD]: UcxInfo(m.get("loaded") == "true", m.get("libraries", ""), m.get("mmap_hook_mode", ""),
                                 m.get("rcache_max_unreleased", ""))
           for m, _ in answers["ucx_info"].series if LABEL_POD in m}
    kinds = parse_by_labels(answers["leak_kinds"], (LABEL_POD, "kind"))
    growth = parse_by_labels(answers["growth"], (LABEL_POD, "part"))
    pods: list[PodSignals] = []
    lacking: dict[str, list[str]] = {}
    for pod in reporting:
        values: dict[str, float | None] = {name: numbers.get((pod, name)) for name in DIAG_SIGNALS}
        if not counts(pod):  # start-up growth is never a leak
            for name in ("steady_growth_bytes_per_second", "anonymous_growth_bytes_per_second",
                         "python_blocks_growth_per_second"):
                values[name] = None
        layers = sorted(((layer, v) for (p, layer), v in shares.items() if p == pod), key=lambda lv: (-lv[1], lv[0]))
        pods.append(PodSignals(
            pod=pod, memory_bytes=memory.get(pod), age_seconds=(ages or {}).get(pod), **values,
            breakdown=tuple(sorted((st, v) for (p, st), v in stages.items() if p == pod)),
            top_layers=tuple(TopLayer(layer, v, *hot.get((pod, layer), (None, None))) for layer, v in layers[:3]),
            ucx=ucx.get(pod),
            leak_kinds=tuple(sorted(k for (p, k), v in kinds.items() if p == pod and v >= 1)),
            growth=tuple(sorted((part, v) for (p, part), v in growth.items() if p == pod))))
        for name in (*REQUIRED_SIGNALS, "breakdown", "ucx_info"):
            have = (values.get(name) is not None if name in values
                    else bool(pods[-1].breakdown) if name == "breakdown" else pod in ucx)
            if not have:
                lacking.setdefault(name.replace("_", " "), []).append(pod)
    missing = tuple(f"{name}: {', '.join(p)}" for name, p in sorted(lacking.items()))
    return DiagnosisSignals(pods=tuple(pods), missing=missing), None


# --- one look for many services: the pure slicing ---------------------------------------------------------

def group_answer(answer: Answer) -> Answer:
    """``answer`` with every series that lacks one of :data:`GROUP_LABELS` left out, and then
    ``PrometheusMalformedAnswer`` (a grouped query's series always carry them: one that does not belongs
    to no service)."""
    kept = tuple((m, v) for m, v in answer.series if all(label in m for label in GROUP_LABELS))
    if len(kept) == len(answer.series):
        return answer
    return Answer(series=kept, problem=answer.problem or MALFORMED, blind=answer.blind)


def service_slice(answer: Answer, namespace: str, name: str, pods: Iterable[str]) -> Answer:
    """The series of ``answer`` that belong to service ``name`` in ``namespace`` and to one of ``pods`` (the
    Running ones): every other pod's series, a deleted predecessor's included, is left out."""
    keep = set(pods)
    return Answer(series=tuple((m, v) for m, v in answer.series
                               if m.get(LABEL_NAMESPACE) == namespace and m.get(LABEL_SERVICE) == name
                               and m.get(LABEL_POD) in keep), problem=answer.problem, blind=answer.blind)


def history_ok(samples: float | None) -> bool:
    """A pod's window counts: its RSS series reaches back to the window's start (``samples`` not None: the
    history query keeps only such pods) and holds at least :data:`MIN_WINDOW_SAMPLES` samples in it."""
    return samples is not None and samples >= MIN_WINDOW_SAMPLES


def _short(pods: Iterable[str], history: Mapping[str, float], window_seconds: int) -> str:
    def one(pod: str) -> str:
        n = history.get(pod)
        return f"{pod} ({'no sample before the window' if n is None else f'{n:.0f} samples'})"
    return (f"history shorter than {window_seconds}s in Prometheus for {', '.join(one(p) for p in sorted(pods))} "
            f"(needs a sample before the window and at least {MIN_WINDOW_SAMPLES} in it)")


@dataclass(frozen=True)
class Look:
    """One service's share of a look: its inputs besides the answers (see :class:`Target`)."""

    namespace: str
    name: str
    hard_limit_bytes: int
    window_seconds: int
    leak_window_seconds: int
    running_pods: tuple[str, ...]
    slope_pods: tuple[str, ...] | None
    new_oom_kills: int = 0


def slice_look(url: str, answers: Mapping[str, Answer], look: Look, now: datetime) -> Observation:
    """One service's :class:`Observation` from the grouped ``answers`` (query name of :class:`Queries` →
    :class:`Answer`), pure: only the series of ``look.running_pods`` count.

    * skew: per pod with a full window (:func:`history_ok`), the steps in it (``skew_steps``); per pod
      whose worker is younger than the window (``worker_age``), all its steps (its counters started from 0
      inside the window). 0 is an idle pod (no skew pressure, and seen), more gives its highest step's
      bucket bound; any other pod (a short history, a counter reset) leaves skew Unknown.
    * memory: the highest over the pods (a single sample is a reading); rejections: summed over the pods;
      p99 latency: the highest per-pod p99; both None unless every reporting pod has a full window.
    * RSS slope: the highest among the Running ``slope_pods`` with a full leak window (each of them in
      ``pod_rss_slopes``); those without one (silent ones included) are named in ``slope_unknown``.
    * diagnosis signals (:func:`diagnosis_signals`): per reporting pod; a failed or malformed diagnosis query
      leaves them None with ``signals_missing`` saying why, and never makes the budget policy's look blind.
    Any failed query, or any malformed series, of the policy's sets ``error`` (blind: budgets hold).
    """
    pods = tuple(look.running_pods)
    grouped = {key: group_answer(a) for key, a in answers.items()}
    policy_answers = {key: a for key, a in grouped.items() if key not in (*DIAG_FIELDS, *INFO_FIELDS)}
    trouble = problems(url, policy_answers)
    if any(a.blind for a in policy_answers.values()):
        return Observation(time=now, expected_pods=pods, new_oom_kills=look.new_oom_kills, error=trouble)
    mine = {key: service_slice(a, look.namespace, look.name, pods) for key, a in grouped.items()}
    for key in (*DIAG_FIELDS, *INFO_FIELDS):
        mine.setdefault(key, Answer())

    def per_pod(key: str) -> dict[str, float]:
        return parse_by_label(mine[key], LABEL_POD)

    reporting = parse_label_values(mine["reporting_pods"], LABEL_POD)
    history = per_pod("history")
    full = [p for p in reporting if history_ok(history.get(p))]
    short = tuple(sorted(set(reporting) - set(full)))

    ages = per_pod("worker_age")
    young = {p for p in reporting if p in ages and ages[p] < look.window_seconds}
    window_steps, window_skews = per_pod("skew_steps"), per_pod("skew")
    all_steps, all_skews = per_pod("skew_steps_all"), per_pod("skew_all")
    skew_unknown, skew_values, known_steps = [], [], []
    for pod in reporting:
        steps, skews = (all_steps, all_skews) if pod in young else (window_steps, window_skews)
        n = steps.get(pod)
        if (pod in short and pod not in young) or n is None or n < 0 or (n > 0 and pod not in skews):
            skew_unknown.append(pod)
            continue
        known_steps.append(n)
        if n > 0:
            skew_values.append(skews[pod])
    memory_values = list(per_pod("memory").values())
    memory = max(memory_values) if memory_values else None
    memory_err = None if memory is not None else parse_scalar(mine["memory"])[1]

    def counts(pod: str) -> bool:
        return look.slope_pods is None or pod in look.slope_pods

    leak_history = per_pod("leak_history")
    slope_candidates = [p for p in pods if counts(p)]  # a silent one's leak window is not judged either
    slope_short = [p for p in slope_candidates if not history_ok(leak_history.get(p))]
    slopes = per_pod("rss_slope")
    pod_slopes = tuple((p, slopes[p]) for p in slope_candidates if p not in slope_short and p in slopes)
    counted = [slope for _, slope in pod_slopes]
    leak_kinds, growth = leak_signals(mine["leak_kinds"], mine["growth"], counts)
    rejections = per_pod("rejection_rate")
    p99s = per_pod("p99_latency")
    all_full = not short and bool(reporting)
    signals, signals_missing = diagnosis_signals(mine, reporting, per_pod("memory"), counts, ages)
    pod_skews = {pod: all_skews.get(pod) if pod in young else window_skews.get(pod) for pod in reporting}
    loads = pod_loads(reporting, per_pod("memory"), pod_skews, mine["pod_load"])
    latency = class_latency(mine["latency"], full) if all_full else ()
    missing = [trouble] if trouble else []
    if memory_err and memory_err != MALFORMED:
        missing.append(f"memory: {memory_err}")
    return Observation(
        time=now,
        skew_ratio=max(skew_values) if skew_values else None,
        skew_steps=sum(known_steps) if known_steps else None,
        skew_unknown_pods=tuple(skew_unknown),
        memory_ratio=None if memory is None else memory / look.hard_limit_bytes,
        rss_slope_bytes_per_second=max(counted) if counted else None,
        pod_rss_slopes=pod_slopes,
        slope_unknown=_short(slope_short, leak_history, look.leak_window_seconds) if slope_short else None,
        leak_kinds=leak_kinds,
        growth_bytes_per_second=growth,
        rejection_rate_per_second=sum(rejections[p] for p in full if p in rejections) if all_full else None,
        p99_latency_seconds=max((p99s[p] for p in full if p in p99s), default=None) if all_full else None,
        expected_pods=pods,
        reporting_pods=reporting,
        short_history_pods=short,
        short_history=_short(short, history, look.window_seconds) if short else None,
        new_oom_kills=look.new_oom_kills,
        error="; ".join(missing) or None,
        signals=signals,
        signals_missing=signals_missing,
        pod_loads=loads,
        latency=latency,
        memory_models=memory_models(mine["memory_model"], reporting),
        memory_models_error=mine["memory_model"].problem if mine["memory_model"].blind else None,
        budget_generations=tuple((p, g) for p, g in sorted(per_pod("budget_generation").items()) if p in reporting),
    )


def memory_models(answer: Answer, reporting: Sequence[str]) -> tuple[tuple[str, ModelMemory], ...]:
    """Per reporting pod, the :class:`ModelMemory` its ``moeguard_memory_model_info`` labels say, pure; a pod
    whose labels do not parse (:func:`memory_model_info.from_info_labels`), or that reports two, is left out."""
    found: dict[str, list[ModelMemory | None]] = {}
    keep = set(reporting)
    for metric, _ in answer.series:
        pod = metric.get(LABEL_POD)
        if pod is not None and pod in keep:
            try:
                model: ModelMemory | None = from_info_labels(metric)
            except ConfigError:
                model = None
            found.setdefault(pod, []).append(model)
    return tuple((pod, models[0]) for pod, models in sorted(found.items())
                 if len(models) == 1 and models[0] is not None)


def pod_loads(reporting: Sequence[str], memory: Mapping[str, float], skews: Mapping[str, float | None],
              load: Answer) -> tuple[PodLoad, ...]:
    """The memory prediction's inputs per reporting pod (:class:`observation.PodLoad`) from the window max memory
    (bytes), the skew and the ``pod_load`` answer (:data:`LOAD_SIGNALS`), pure: None where a pod has no value (no
    data, never 0)."""
    values = parse_by_labels(load, (LABEL_POD, "signal"))
    return tuple(PodLoad(pod=pod, memory_bytes=memory.get(pod), skew_ratio=skews.get(pod),
                         **{name: values.get((pod, name)) for name in LOAD_SIGNALS})
                 for pod in reporting)


def class_latency(latency: Answer, pods: Iterable[str]) -> tuple[ClassLatency, ...]:
    """Per priority class, the TTFT and TPOT bucket counts (the ``latency`` answer, label ``histogram``) summed over
    ``pods``, pure: ``(le, count)`` ascending, ``+Inf`` last (a series without a numeric ``le`` is left out).
    Classes sorted by name."""
    keep = set(pods)
    sums: dict[str, dict[str, dict[float, float]]] = {"ttft": {}, "tpot": {}}
    for (pod, histogram, priority, le), value in parse_by_labels(
            latency, (LABEL_POD, "histogram", "priority", "le")).items():
        try:
            bound = float(le)
        except ValueError:
            continue
        if pod in keep and histogram in sums and not math.isnan(bound):
            per = sums[histogram].setdefault(priority, {})
            per[bound] = per.get(bound, 0.0) + value
    first, per_token = sums["ttft"], sums["tpot"]
    return tuple(ClassLatency(priority, tuple(sorted(first.get(priority, {}).items())),
                              tuple(sorted(per_token.get(priority, {}).items())))
                 for priority in sorted(set(first) | set(per_token)))


def observe_looks(url: str, looks: Sequence[Look], now: datetime, *, ca_file: str | None = None,
                  deadline_seconds: float = QUERY_DEADLINE_SECONDS) -> dict[tuple[str, str], Observation]:
    """One look at the Prometheus at ``url`` for every one of ``looks``: one query per signal and per distinct
    ``(windowSeconds, leakWindowSeconds)``, all concurrent, each under ``deadline_seconds``; returns
    ``(namespace, name)`` → :class:`Observation`. Every query is evaluated at ``now`` (:func:`fetch_all`'s
    ``at``): one consistent snapshot. Blocking (call it from a thread)."""
    groups = _groups(looks)
    plan = query_plan(looks)
    answers = fetch_all(url, plan, deadline_seconds=deadline_seconds, ca_file=ca_file, at=now) if plan else {}
    out: dict[tuple[str, str], Observation] = {}
    for (w, lw), members in groups.items():
        mine = {field: answers[_query_key(field, w, lw, len(groups))] for field in Queries.__dataclass_fields__}
        for look in members:
            out[(look.namespace, look.name)] = slice_look(url, mine, look, now)
    return out


def _groups(looks: Sequence[Look]) -> dict[tuple[int, int], list[Look]]:
    groups: dict[tuple[int, int], list[Look]] = {}
    for look in looks:
        groups.setdefault((look.window_seconds, look.leak_window_seconds), []).append(look)
    return groups


def query_plan(looks: Sequence[Look]) -> dict[str, str]:
    """The queries of one look for ``looks`` (name → PromQL), pure: one per :class:`Queries` field and per
    distinct ``(windowSeconds, leakWindowSeconds)``, whatever the number of services; names carry the
    windows (``skew[30s/600s]``) when there is more than one pair."""
    groups = _groups(looks)
    plan: dict[str, str] = {}
    for (w, lw), members in groups.items():
        q = queries({m.namespace for m in members}, {m.name for m in members}, w, lw)
        plan.update({_query_key(field, w, lw, len(groups)): getattr(q, field) for field in q.__dataclass_fields__})
    return plan


def _query_key(field: str, w: int, lw: int, groups: int) -> str:
    return field if groups == 1 else f"{field}[{w}s/{lw}s]"


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
    """One look at Prometheus for ``name`` alone (:func:`observe_looks` with one service); Kubernetes facts
    (Running pods: ``expected_pods``, OOM kills) are passed in.

    ``slope_pods``: the pods whose RSS slope counts — those whose worker has run for at
    least the leak window, so that start-up growth (model load, first batches) is never
    read as a leak. None: every pod. ``ca_file``: PEM bundle to verify Prometheus's certificate
    with (None: the system trust store). ``deadline_seconds``: each query's total deadline.
    Any failed query, or any malformed series, sets ``error`` (the look is blind; budgets hold).
    """
    look = Look(namespace, name, hard_limit_bytes, window_seconds, leak_window_seconds, tuple(expected_pods),
                slope_pods, new_oom_kills)
    return observe_looks(prometheus_url, [look], now, ca_file=ca_file, deadline_seconds=deadline_seconds)[
        (namespace, name)]


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

    def look(self) -> Look:
        control = self.spec.control
        return Look(self.namespace, self.name, self.spec.resources.hard_limit_bytes, control.window_seconds,
                    control.leak_window_seconds, tuple(self.running_pods), tuple(self.slope_pods), self.new_oom_kills)


def observe_services(url: str, targets: Sequence[Target], now: datetime, *, ca_file: str | None = None,
                     deadline_seconds: float = QUERY_DEADLINE_SECONDS) -> dict[tuple[str, str], Observation]:
    """One look at the Prometheus at ``url`` for every target: ``(namespace, name)`` → :class:`Observation`.

    One query per signal and per distinct window pair for all targets (so the queries per look do not grow
    with the number of services), each under the hard total deadline ``deadline_seconds`` (seconds), all
    concurrent; each target gets the series of its Running pods only. Never raises for what Prometheus
    does. Blocking (runs its own event loop: call it from a thread).
    """
    return observe_looks(url, [t.look() for t in targets], now, ca_file=ca_file, deadline_seconds=deadline_seconds)


def observe_service(default_url: str | None, namespace: str, name: str, spec: MoEInferenceServiceSpec,
                    facts: PodFacts, new_oom_kills: int, now: datetime, ca_file: str | None = None) -> Observation:
    """One look for a service: at ``spec.control.prometheusUrl`` (checked against the operator's allowlist at
    reconcile: :func:`spec_checks.check_prometheus_url`), else ``default_url`` (the operator's); with neither,
    a blind observation that says so. Kubernetes facts (pods, OOM kills) are passed in; ``ca_file``: the
    operator's ``--prometheus-ca-file``. The same code as a tick's :func:`observe_services`, with one target."""
    url = spec.control.prometheus_url or default_url
    if not url:
        return Observation(time=now, expected_pods=facts.running, new_oom_kills=new_oom_kills,
                           error="no Prometheus URL configured (spec.control.prometheusUrl or --prometheus-url)")
    target = Target(namespace, name, spec, facts.running,
                    facts.running_since(leak_window_start(now, spec.control.leak_window_seconds)), new_oom_kills)
    return observe_services(url, [target], now, ca_file=ca_file)[(namespace, name)]
