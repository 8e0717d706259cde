"""Asyncio + httpx load runner for moeguard workers (``POST /v1/completions``).

* :func:`replay` sends each request of a :class:`~harness.loadgen.trace.Schedule`
  at its arrival time; :func:`burst` sends a list of prompts all at once.
* Several worker URLs may be given: request ``i`` goes to ``urls[i % len(urls)]``.
* Always bounded: a global deadline (``timeout_s``) cancels whatever is left,
  a per-request timeout stops a stuck request, and at most ``max_in_flight``
  requests are open at once (later ones wait, and their ``send_s`` lags their
  ``scheduled_s``). Nothing is retried: refusals are what is measured.
* Only loopback URLs (127.0.0.0/8, ``localhost``, ``::1``) are accepted.

All times in the records are seconds on the event loop's monotonic clock,
counted from the start of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import platform
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from harness.loadgen.records import RequestResult, RunResult
from harness.loadgen.text import corpus_fingerprint, prompt_of_length
from harness.loadgen.trace import Schedule, ScheduledRequest

COMPLETIONS_PATH = "/v1/completions"
PROMPT_STRIDE = 7919
"""Bytes between the corpus offsets of consecutive default replay prompts."""
DEADLINE_MARGIN_S = 5.0
"""Default deadline slack, seconds, added after the last arrival plus one request timeout."""
_LOOPBACK_V4 = ipaddress.ip_network("127.0.0.0/8")
_ERROR_TEXT_MAX = 500


def _host_is_loopback(host: str | None) -> bool:
    if not host:
        return False
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv4Address):
        return ip in _LOOPBACK_V4
    return ip == ipaddress.IPv6Address("::1")


def check_loopback_url(url: str) -> str:
    """Return ``url`` without a trailing slash if its host is loopback.

    Accepted hosts: ``localhost``, any address in 127.0.0.0/8 and ``::1``;
    schemes ``http`` and ``https``. The host is checked as both
    :mod:`urllib.parse` and httpx read it, so a URL the two parse differently
    (``http://127.0.0.1\\@example.com``) is refused too.

    Raises:
        ValueError: any other host or scheme, or an unparsable URL.
    """
    try:
        parsed = urllib.parse.urlsplit(url)
        hx = httpx.URL(url)
        _ = parsed.port  # raises ValueError on a bad port
    except (ValueError, httpx.InvalidURL) as exc:
        raise ValueError(f"invalid URL {url!r}: {exc}") from None
    if parsed.scheme not in ("http", "https") or hx.scheme not in ("http", "https"):
        raise ValueError(f"refusing {url!r}: scheme must be http or https")
    if not (_host_is_loopback(parsed.hostname) and _host_is_loopback(hx.host)):
        raise ValueError(
            f"refusing {url!r}: only loopback hosts (127.0.0.0/8, localhost, ::1) are allowed")
    return url.rstrip("/")


def check_urls(urls: str | Sequence[str]) -> list[str]:
    """Validate one URL or several with :func:`check_loopback_url`; at least one.

    Raises:
        ValueError: no URL, or a URL that is not loopback.
    """
    items = [urls] if isinstance(urls, str) else list(urls)
    if not items:
        raise ValueError("at least one worker URL is needed")
    return [check_loopback_url(u) for u in items]


@dataclass(frozen=True)
class RequestSpec:
    """One request for :func:`run_requests`.

    Attributes:
        prompt: the prompt text (ASCII: bytes = tokens).
        max_tokens: the request's ``max_tokens``.
        at_s: when to send it, seconds after the run starts.
        priority: the body's ``priority`` (``interactive``, ``batch``, ...), none when None.
    """

    prompt: str
    max_tokens: int
    at_s: float = 0.0
    priority: str | None = None


def default_prompt(req: ScheduledRequest) -> str:
    """Real text of ``req.prompt_tokens`` bytes, at corpus offset ``index * PROMPT_STRIDE``."""
    return prompt_of_length(req.prompt_tokens, offset=req.index * PROMPT_STRIDE)


def _error_code(raw: bytes) -> str | None:
    """The OpenAI ``error.code`` of a refusal body or an SSE error event, None when there is none."""
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return None
    code = err.get("code") if isinstance(err, dict) else None
    return str(code) if code is not None else None


def _error_message(raw: bytes) -> str:
    """The OpenAI ``error.message`` of a refusal body, else FastAPI ``detail``, else the text."""
    text = raw.decode("utf-8", "replace")
    try:
        doc = json.loads(text)
    except ValueError:
        return text[:_ERROR_TEXT_MAX]
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:_ERROR_TEXT_MAX]
        if isinstance(err, str):
            return err[:_ERROR_TEXT_MAX]
        if "detail" in doc:
            return str(doc["detail"])[:_ERROR_TEXT_MAX]
    return text[:_ERROR_TEXT_MAX]


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _apply_completion(res: RequestResult, raw: bytes) -> None:
    """Fill text and usage from a successful non-streaming response body."""
    try:
        doc = json.loads(raw)
        res.text = str(doc["choices"][0]["text"])
        usage = doc.get("usage") or {}
        res.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
        res.completion_tokens = _int_or_none(usage.get("completion_tokens"))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        res.error = f"malformed completion response: {type(exc).__name__}: {exc}"


async def _read_sse(resp: httpx.Response, res: RequestResult, now: Callable[[], float]) -> None:
    """Read an OpenAI-style SSE completion stream into ``res``."""
    pieces: list[str] = []
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        try:
            doc = json.loads(payload)
        except ValueError:
            res.error = f"malformed stream chunk: {payload[:100]!r}"
            continue
        if not isinstance(doc, dict):
            continue
        if "error" in doc:
            res.error = _error_message(payload.encode())
            res.code = _error_code(payload.encode())
            continue
        for choice in doc.get("choices") or []:
            piece = (choice.get("text") or "") if isinstance(choice, dict) else ""
            if piece:
                if res.first_byte_s is None:
                    res.first_byte_s = now()
                pieces.append(piece)
        usage = doc.get("usage")
        if isinstance(usage, dict):
            res.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
            res.completion_tokens = _int_or_none(usage.get("completion_tokens"))
    res.text = "".join(pieces)
    if res.completion_tokens is None:
        res.completion_tokens = len(res.text.encode("utf-8"))  # estimate: 1 byte = 1 token


async def _send(client: httpx.AsyncClient, res: RequestResult, body: dict[str, Any],
                stream: bool, now: Callable[[], float]) -> None:
    """Send one request and record its times, status and usage into ``res``."""
    res.send_s = now()
    try:
        async with client.stream("POST", res.url + COMPLETIONS_PATH, json=body) as resp:
            res.status = resp.status_code
            res.retry_after = resp.headers.get("retry-after")
            if stream and resp.is_success:
                await _read_sse(resp, res, now)
                res.end_s = now()
                return
            res.first_byte_s = now()
            raw = await resp.aread()
            res.end_s = now()
            if resp.is_success:
                _apply_completion(res, raw)
            else:
                res.error = _error_message(raw)
                res.code = _error_code(raw)
    except Exception as exc:  # any transport/protocol failure is a recorded outcome
        res.end_s = now()
        res.status = None
        res.error = f"{type(exc).__name__}: {exc}".rstrip(": ")


class _NoProgress:
    def advance(self) -> None:
        pass


class _RichProgress:
    def __init__(self, progress: Any, task_id: Any) -> None:
        self._progress = progress
        self._task_id = task_id

    def advance(self) -> None:
        self._progress.advance(self._task_id)


@contextlib.contextmanager
def _progress_bar(enabled: bool, total: int, label: str) -> Iterator[_NoProgress | _RichProgress]:
    """A rich progress bar on stderr when ``enabled`` and stderr is a TTY, else a no-op."""
    if not (enabled and sys.stderr.isatty()):
        yield _NoProgress()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        yield _RichProgress(bar, bar.add_task(label, total=total))


async def run_requests(
    urls: str | Sequence[str],
    specs: Sequence[RequestSpec],
    *,
    model: str = "tiny",
    temperature: float = 0.0,
    seed: int = 0,
    timeout_s: float | None = None,
    request_timeout_s: float = 60.0,
    max_in_flight: int = 64,
    stream: bool = False,
    progress: bool = True,
    meta: dict[str, Any] | None = None,
    route: Callable[[int], str] | None = None,
) -> RunResult:
    """Send ``specs`` (each at its ``at_s``) and record what happened.

    Args:
        urls: worker base URL(s), loopback only; round-robin by request index.
        specs: the requests; ``results[i]`` describes ``specs[i]``.
        model: the ``model`` field of every request.
        temperature: the ``temperature`` field.
        seed: request ``i`` carries ``seed + i``.
        timeout_s: global deadline, seconds after the start; requests still
            waiting or open then are cancelled (``error`` says so). Default:
            last ``at_s`` + ``request_timeout_s`` + 5 s.
        request_timeout_s: httpx timeout for connect/read/write/pool, seconds.
        max_in_flight: most requests open at once (>= 1).
        stream: ask for SSE (``"stream": true`` with ``stream_options.include_usage``);
            ``first_byte_s`` is then the first token chunk.
        progress: show a rich progress bar on stderr (only if it is a TTY).
        meta: extra entries for ``RunResult.meta``.
        route: when given, request ``i`` goes to ``route(i)``, asked at its send time (a
            load balancer over the endpoints ready then), instead of round-robin over ``urls``.

    Raises:
        ValueError: a non-loopback URL, or ``max_in_flight < 1``.
    """
    url_list = check_urls(urls)
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    if timeout_s is None:
        last = max((s.at_s for s in specs), default=0.0)
        timeout_s = last + request_timeout_s + DEADLINE_MARGIN_S
    results = [
        RequestResult(index=i, url=url_list[i % len(url_list)], scheduled_s=spec.at_s,
                      prompt_bytes=len(spec.prompt.encode("utf-8")), max_tokens=spec.max_tokens)
        for i, spec in enumerate(specs)
    ]
    run_meta: dict[str, Any] = {
        "urls": url_list, "model": model, "temperature": temperature, "seed": seed,
        "timeout_s": timeout_s, "request_timeout_s": request_timeout_s,
        "max_in_flight": max_in_flight, "stream": stream, "n_requests": len(specs),
        "python": platform.python_version(),
    }
    run_meta.update(meta or {})

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    started_unix = time.time()

    def now() -> float:
        return loop.time() - t0

    sem = asyncio.Semaphore(max_in_flight)
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    timeout = httpx.Timeout(request_timeout_s)
    timed_out = False
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        with _progress_bar(progress, len(specs), str(run_meta.get("mode", "requests"))) as bar:

            async def one(i: int) -> None:
                spec = specs[i]
                delay = spec.at_s - now()
                if delay > 0:
                    await asyncio.sleep(delay)
                body: dict[str, Any] = {"model": model, "prompt": spec.prompt,
                                        "max_tokens": spec.max_tokens,
                                        "temperature": temperature, "seed": seed + i}
                if stream:
                    body["stream"] = True
                    body["stream_options"] = {"include_usage": True}
                if spec.priority is not None:
                    body["priority"] = spec.priority
                async with sem:
                    if route is not None:
                        results[i].url = check_loopback_url(route(i))
                    await _send(client, results[i], body, stream, now)
                bar.advance()

            tasks = [asyncio.create_task(one(i)) for i in range(len(specs))]
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=max(0.0, timeout_s))
                if pending:
                    timed_out = True
                    for task in pending:
                        task.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
            wall_s = now()

    for res in results:
        if res.end_s is None:
            res.error = ("not sent: run deadline reached" if res.send_s is None
                         else "cancelled: run deadline reached")
    return RunResult(results=results, wall_s=wall_s, started_unix_s=started_unix,
                     timed_out=timed_out, meta=run_meta)


async def replay(
    urls: str | Sequence[str],
    schedule: Schedule | Sequence[ScheduledRequest],
    *,
    prompt_fn: Callable[[ScheduledRequest], str] | None = None,
    model: str = "tiny",
    temperature: float = 0.0,
    seed: int = 0,
    timeout_s: float | None = None,
    request_timeout_s: float = 60.0,
    max_in_flight: int = 64,
    stream: bool = False,
    progress: bool = True,
) -> RunResult:
    """Send each scheduled request at its ``arrival_s`` (seconds after the start).

    Args:
        urls: worker base URL(s) such as ``"http://127.0.0.1:8000"``; loopback only.
        schedule: from :func:`harness.loadgen.trace.scale` / ``load_schedule``, or a
            list of :class:`ScheduledRequest`.
        prompt_fn: builds each prompt; default :func:`default_prompt` (real
            text of exactly ``prompt_tokens`` bytes). Pass e.g.
            ``lambda r: repetitive_prompt(r.prompt_tokens, r.index)`` for skew.
        Other arguments: see :func:`run_requests`.

    Returns:
        A :class:`RunResult` whose ``meta`` holds the run settings, ``mode =
        "replay"`` and the schedule's factors under ``"schedule"``.
    """
    requests = schedule.requests if isinstance(schedule, Schedule) else list(schedule)
    build = prompt_fn or default_prompt
    specs = [RequestSpec(prompt=build(r), max_tokens=r.max_tokens, at_s=r.arrival_s)
             for r in requests]
    meta: dict[str, Any] = {"mode": "replay", "prompts": "custom" if prompt_fn else "pydoc"}
    if prompt_fn is None:
        meta["corpus_sha256_16"] = corpus_fingerprint()
    if isinstance(schedule, Schedule) and schedule.meta is not None:
        meta["schedule"] = schedule.meta.to_dict()
    return await run_requests(urls, specs, model=model, temperature=temperature, seed=seed,
                              timeout_s=timeout_s, request_timeout_s=request_timeout_s,
                              max_in_flight=max_in_flight, stream=stream, progress=progress,
                              meta=meta)


async def burst(
    urls: str | Sequence[str],
    prompts: Sequence[str],
    *,
    max_tokens: int | Sequence[int] = 16,
    model: str = "tiny",
    temperature: float = 0.0,
    seed: int = 0,
    timeout_s: float | None = None,
    request_timeout_s: float = 60.0,
    max_in_flight: int | None = None,
    stream: bool = False,
    progress: bool = True,
) -> RunResult:
    """Send all ``prompts`` at once (at time 0).

    Args:
        urls: worker base URL(s); loopback only; round-robin.
        prompts: one request per prompt.
        max_tokens: one value for all, or one per prompt.
        max_in_flight: default ``len(prompts)`` (all open together).
        Other arguments: see :func:`run_requests`.

    Raises:
        ValueError: a per-prompt ``max_tokens`` list of the wrong length, or a
            non-loopback URL.
    """
    if isinstance(max_tokens, int):
        limits = [max_tokens] * len(prompts)
    else:
        limits = list(max_tokens)
        if len(limits) != len(prompts):
            raise ValueError(f"{len(limits)} max_tokens values for {len(prompts)} prompts")
    specs = [RequestSpec(prompt=p, max_tokens=m, at_s=0.0) for p, m in zip(prompts, limits, strict=True)]
    return await run_requests(urls, specs, model=model, temperature=temperature, seed=seed,
                              timeout_s=timeout_s, request_timeout_s=request_timeout_s,
                              max_in_flight=max_in_flight or max(1, len(prompts)),
                              stream=stream, progress=progress, meta={"mode": "burst"})
