"""What to do when the API server refuses a child at apply time, pure: retry, or stall naming the field.

A spec that passed the CRD may still give a child that Kubernetes refuses (a field the CRD leaves
free-form, a name rule of the child's kind). :func:`judge` sorts the refusal:

* **permanent** — retrying the same spec gives the same answer: every 4xx except 409 (conflict) and
  429 (too many requests), and a 500 whose body says that the server-side apply's typed conversion
  failed (the object does not fit the child's schema). Stalled at once.
* **transient** — no status (the connection), 409, 429 and other 5xx: retried every
  :data:`RETRY_DELAY_SECONDS`, at most :data:`MAX_RETRIES` times, then stalled too: never forever.

:func:`spec_field` maps a child's field path in the API server's message back to the spec field
it came from, so that the condition and the Event name what the user wrote.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_RETRIES = 5
"""Retries of a transient refusal before the resource is stalled (with the delay: about a minute)."""
RETRY_DELAY_SECONDS = 10.0
"""Seconds between two tries of a transient refusal."""
TYPED_CONVERSION_MARKERS = ("typed patch object", "typed live object", "typed value", "failed to convert",
                            "duplicate entries")
"""Phrases of the API server's server-side apply when the object does not convert to the kind's typed
schema: an HTTP 500 that retrying never changes."""
RETRIED_4XX = (409, 429)

# A child's field path (in the API server's message) → the spec field it comes from; first match wins.
_FIELD_MAP: tuple[tuple[str, str], ...] = (
    ("spec.template.spec.priorityClassName", "spec.template.priorityClassName"),
    ("spec.template.spec.affinity", "spec.template.affinity"),
    ("spec.template.spec.tolerations", "spec.template.tolerations"),
    ("spec.template.spec.nodeSelector", "spec.template.nodeSelector"),
    ("spec.template.spec.volumes", "spec.template.volumes"),
    ("spec.template.spec.containers[0].volumeMounts", "spec.template.volumeMounts"),
    ("spec.template.spec.containers[0].env", "spec.template.extraEnv (or a spec field given to the worker as env)"),
    ("spec.template.spec.containers[0].resources", "spec.resources"),
    ("spec.template.spec.containers[0].image", "spec.image"),
    ("spec.template.metadata.annotations", "spec.template.annotations"),
    ("spec.replicas", "spec.replicas"),
    ("metadata.name", "metadata.name"),
)
_LWS_TEMPLATE = "spec.leaderWorkerTemplate.workerTemplate"
_PATH = re.compile(r"\.?((?:metadata|spec)(?:\.[A-Za-z0-9_]+|\[[^\]]*\])*)")
_CONTAINER_KEY = re.compile(r'containers\[name="?worker"?\]')


class ChildRefused(Exception):
    """The API server refused to apply a child.

    Attributes:
        child: its kind and name (``Deployment x-worker``).
        status: the HTTP status (None: no answer).
        message: the API server's Status message (at most 800 characters).
        body: the raw answer, for :func:`permanent`.
    """

    def __init__(self, child: str, status: int | None, message: str, body: str) -> None:
        super().__init__(f"{child}: {status} {message}")
        self.child, self.status, self.message, self.body = child, status, message, body


@dataclass(frozen=True)
class Verdict:
    """What to do with one refusal.

    Attributes:
        retry: try again after :data:`RETRY_DELAY_SECONDS` (False: stall now).
        reason: CamelCase reason for the condition and the Event when stalling.
        message: the condition's and the Event's message, naming the child and the spec field.
    """

    retry: bool
    reason: str
    message: str


def permanent(status: int | None, body: str) -> bool:
    """Whether retrying the same apply cannot change the answer (see the module docstring)."""
    if status is None:
        return False
    if 400 <= status < 500:
        return status not in RETRIED_4XX
    return status == 500 and any(marker in body for marker in TYPED_CONVERSION_MARKERS)


def spec_field(message: str) -> str | None:
    """The spec field behind the first child field path in the API server's ``message``, or None."""
    for match in _PATH.finditer(message):
        path = _CONTAINER_KEY.sub("containers[0]", match.group(1))  # server-side apply's key form
        path = path.replace(_LWS_TEMPLATE, "spec.template", 1)  # a LeaderWorkerSet's pods: the same fields
        for child, field in _FIELD_MAP:
            if path == child or path.startswith((child + ".", child + "[")):
                return field
    return None


def judge(child: str, status: int | None, message: str, body: str, retries: int) -> Verdict:
    """The verdict on the API server's refusal of ``child`` (``Deployment x-worker``), given the HTTP
    ``status`` (None: no answer), the Status ``message`` (at most a few hundred characters), the raw
    ``body`` and the ``retries`` already made (kopf's ``retry``, 0 on the first try)."""
    field = spec_field(message)
    where = f" (spec field {field})" if field else ""
    text = f"the API server refused {child}: {status} {message}{where}"
    if permanent(status, body):
        return Verdict(False, "ApplyRefused", text)
    if retries >= MAX_RETRIES:
        return Verdict(False, "ApplyFailed", f"{text}; gave up after {retries + 1} tries")
    return Verdict(True, "ApplyFailed", f"{text}; retrying in {RETRY_DELAY_SECONDS:g}s ({retries + 1}/{MAX_RETRIES + 1})")
