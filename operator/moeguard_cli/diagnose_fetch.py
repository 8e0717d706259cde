"""``moeguard diagnose``'s I/O: the service and its Events from the API server (the kubernetes client, as
kubectl finds it: ``--kubeconfig``/``KUBECONFIG``/``~/.kube/config`` and ``--context``, or in-cluster), and
the timeline's range queries from Prometheus (httpx). The report itself is built by ``diagnose_report``.

What fails where:

* the API server unreachable, the kubeconfig unreadable, the service absent or not readable:
  :class:`DiagnoseError` (one line; the command exits 1);
* the Events not listable: the report says so (``events_problem``), the rest is shown;
* Prometheus unreachable or a query failing: that signal's answer carries a fixed problem (the reasons of
  ``moeguard_operator.loop.observe``, never the answer's text), the report names it as missing.
"""

from __future__ import annotations

import os
import re
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from moeguard_cli.diagnose_report import STEP_SECONDS, RangeAnswer, grid, range_queries
from moeguard_core.contract import API_GROUP, API_VERSION, KIND, PLURAL
from moeguard_operator.loop.observe import (
    BAD_REQUEST,
    HTTP_ERROR,
    MALFORMED,
    MAX_ANSWER_BYTES,
    QUERY_DEADLINE_SECONDS,
    TIMEOUT,
    UNREACHABLE,
    safe_url,
    transport_problem,
)

DEFAULT_PROMETHEUS_URL = "http://127.0.0.1:9090"
"""Where Prometheus is looked for when neither ``--prometheus-url``, ``spec.control.prometheusUrl`` nor
``MOEGUARD_PROMETHEUS_URL`` says."""
API_TIMEOUT = (3.0, 10.0)
"""(connect, read) timeout of each API server request, seconds."""


class DiagnoseError(Exception):
    """The report cannot be made: the message is one line for people (the API server unreachable, the
    kubeconfig unreadable, the service absent or forbidden)."""


@dataclass(frozen=True)
class Fetched:
    """What ``build_report`` needs: the service object, its Events (None with ``events_problem`` when they
    could not be listed), the range answers (signal key → answer), the Prometheus URL used (without
    credentials), and the time the grid ends at."""

    service: dict[str, Any]
    events: list[dict[str, Any]] | None
    answers: dict[str, RangeAnswer]
    prometheus_url: str
    now: datetime
    events_problem: str | None = None


def prometheus_url_for(service: dict[str, Any], flag: str | None, env: Mapping[str, str] | None = None) -> str:
    """The Prometheus to ask: ``--prometheus-url``, else the service's ``spec.control.prometheusUrl`` (the one
    the operator asks for it), else ``MOEGUARD_PROMETHEUS_URL`` (the operator's own setting), else
    :data:`DEFAULT_PROMETHEUS_URL`."""
    environ: Mapping[str, str] = os.environ if env is None else env
    spec_url = ((service.get("spec") or {}).get("control") or {}).get("prometheusUrl")
    return str(flag or spec_url or environ.get("MOEGUARD_PROMETHEUS_URL") or DEFAULT_PROMETHEUS_URL)


def api_client(kubeconfig: str | None, context: str | None) -> tuple[Any, str | None]:
    """An ApiClient as kubectl would build it, and the context's namespace (None: not set).

    Raises:
        DiagnoseError: no kubeconfig (and not in a pod), or it cannot be read, or the context is unknown.
    """
    from kubernetes import config
    from kubernetes.config.config_exception import ConfigException

    try:
        if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST") \
                and not os.environ.get("KUBECONFIG"):
            config.load_incluster_config()
            from kubernetes import client

            return client.ApiClient(), None
        api = config.new_client_from_config(config_file=kubeconfig, context=context)
        _, active = config.list_kube_config_contexts(config_file=kubeconfig)
        if context is not None:
            contexts, _ = config.list_kube_config_contexts(config_file=kubeconfig)
            active = next((c for c in contexts if c.get("name") == context), active)
        namespace = ((active or {}).get("context") or {}).get("namespace")
    except (ConfigException, OSError, ValueError, TypeError, KeyError) as exc:
        raise DiagnoseError(f"cannot load the Kubernetes configuration: {_one_line(exc)}") from None
    api.configuration.retries = 0  # one attempt: an unreachable API server is reported at once
    if not api.configuration.verify_ssl:  # the kubeconfig's insecure-skip-tls-verify: as kubectl, no warning
        import urllib3

        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    return api, namespace


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def transport_reason(exc: BaseException) -> str:
    """Why a request did not reach the API server, in a few words: the OS error (``[Errno 111] Connection
    refused``), a timeout, a TLS failure, else the exception's type."""
    cause: BaseException | None = getattr(exc, "reason", None) or exc
    text = str(cause)
    match = re.search(r"\[Errno -?\d+\] [A-Za-z ,'-]+", text)
    if match:
        return match.group(0).strip()
    if "timed out" in text.lower() or isinstance(cause, TimeoutError):
        return "timed out"
    if isinstance(cause, ssl.SSLError) or "SSL" in text or "certificate" in text.lower():
        return "TLS error"
    return type(cause).__name__


def read_service(api: Any, namespace: str, name: str) -> dict[str, Any]:
    """The MoEInferenceService ``namespace/name`` as the API server stores it.

    Raises:
        DiagnoseError: not found, forbidden, or the API server unreachable (the message says which).
    """
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    host = safe_url(str(api.configuration.host))
    try:
        obj = client.CustomObjectsApi(api).get_namespaced_custom_object(
            API_GROUP, API_VERSION, namespace, PLURAL, name, _request_timeout=API_TIMEOUT)
    except ApiException as exc:
        if exc.status == 404:
            raise DiagnoseError(f"{KIND} {namespace}/{name} not found (or the {API_GROUP} CRD is not installed) "
                                f"at {host}") from None
        if exc.status in (401, 403):
            raise DiagnoseError(f"not allowed to read {KIND} {namespace}/{name} at {host} (HTTP {exc.status})") from None
        raise DiagnoseError(f"the API server at {host} refused to read {KIND} {namespace}/{name} "
                            f"(HTTP {exc.status} {exc.reason})") from None
    except Exception as exc:  # urllib3 and socket errors: the API server is not there
        raise DiagnoseError(f"cannot reach the API server at {host} ({transport_reason(exc)})") from None
    if not isinstance(obj, dict):
        raise DiagnoseError(f"the API server at {host} answered something other than an object for {KIND} "
                            f"{namespace}/{name}")
    return obj


def list_events(api: Any, namespace: str, name: str) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The core/v1 Events about the service (``involvedObject`` kind and name): ``(events, None)``, or
    ``(None, why)`` when they cannot be listed."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        items = client.CoreV1Api(api).list_namespaced_event(
            namespace, field_selector=f"involvedObject.kind={KIND},involvedObject.name={name}",
            _request_timeout=API_TIMEOUT).items
    except ApiException as exc:
        return None, f"HTTP {exc.status} {exc.reason}"
    except Exception as exc:
        return None, type(exc).__name__
    return [dict(api.sanitize_for_serialization(e)) for e in items], None


def read_range_answer(status_code: int, body: bytes) -> RangeAnswer:
    """Judge one HTTP answer to a range query: the decoded JSON body, or a fixed problem (400/422:
    ``PrometheusBadRequest``; other non-2xx: ``PrometheusHTTPError <code>``; not JSON:
    ``PrometheusMalformedAnswer``)."""
    import json

    if status_code in (400, 422):
        return RangeAnswer(problem=BAD_REQUEST)
    if not 200 <= status_code < 300:
        return RangeAnswer(problem=f"{HTTP_ERROR} {int(status_code)}")
    try:
        return RangeAnswer(body=json.loads(body))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return RangeAnswer(problem=MALFORMED)


def query_range(http: httpx.Client, base_url: str, query: str, start: float, end: float, step: int) -> RangeAnswer:
    """One ``/api/v1/query_range`` under :data:`QUERY_DEADLINE_SECONDS`, as a form-encoded POST like the
    operator's queries (a long selector stays clear of httpx's 64 KiB URL bound); never raises for what
    Prometheus or the network does."""
    deadline = time.monotonic() + QUERY_DEADLINE_SECONDS
    try:
        with http.stream("POST", base_url.rstrip("/") + "/api/v1/query_range",
                         data={"query": query, "start": f"{start:.0f}", "end": f"{end:.0f}", "step": f"{step}s"}) as r:
            body = bytearray()
            for chunk in r.iter_raw():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    return RangeAnswer(problem=MALFORMED)
                if time.monotonic() > deadline:
                    return RangeAnswer(problem=TIMEOUT)
            return read_range_answer(r.status_code, bytes(body))
    except (httpx.InvalidURL, httpx.UnsupportedProtocol, ValueError):
        return RangeAnswer(problem=UNREACHABLE)
    except (httpx.HTTPError, OSError) as exc:
        return RangeAnswer(problem=transport_problem(exc))


def fetch(name: str, namespace: str | None, *, prometheus_url: str | None, minutes: int,
          kubeconfig: str | None = None, context: str | None = None,
          progress: Callable[[str], None] = lambda _: None) -> Fetched:
    """Everything the report needs about ``namespace/name`` (None: the context's namespace, else
    ``default``) over the last ``minutes``; ``progress`` is told what is being asked.

    Raises:
        DiagnoseError: the API server cannot be reached, or the service cannot be read.
    """
    progress("loading the Kubernetes configuration")
    api, context_namespace = api_client(kubeconfig, context)
    namespace = namespace or context_namespace or "default"
    progress(f"reading {KIND} {namespace}/{name}")
    service = read_service(api, namespace, name)
    progress("listing its Events")
    events, events_problem = list_events(api, namespace, name)
    url = prometheus_url_for(service, prometheus_url)
    now = datetime.now(UTC)
    start, end, _ = grid(now, minutes, STEP_SECONDS)
    answers: dict[str, RangeAnswer] = {}
    down: str | None = None
    with httpx.Client(timeout=httpx.Timeout(QUERY_DEADLINE_SECONDS), follow_redirects=False,
                      headers={"Accept-Encoding": "identity"}) as http:
        for key, query in range_queries(namespace, name).items():
            if down is not None:  # Prometheus is not there: do not wait for it once per signal
                answers[key] = RangeAnswer(problem=down)
                continue
            progress(f"asking Prometheus at {safe_url(url)} for {key}")
            answers[key] = query_range(http, url, query, start, end, STEP_SECONDS)
            if answers[key].problem in (UNREACHABLE, TIMEOUT):
                down = answers[key].problem
    return Fetched(service=service, events=events, answers=answers, prometheus_url=safe_url(url), now=now,
                   events_problem=events_problem)
