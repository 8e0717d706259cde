"""Where a rollout stands, pure: the worker pods split by template, from their
:data:`constants.TEMPLATE_HASH_LABEL` (issue 29, item 1; the kind of ai-dynamo/dynamo#3567: an old pod still Ready
while the new template crash-loops read as ``Ready=True 1/1``).

The pods of the *current* template carry the hash of the template the operator applied for the spec's generation
(:func:`children.builders.template_hash`); every other pod not being deleted is of an earlier template (pods from
an operator version without the label count as earlier: their template differs by that label, and the workload
rolls them). The same label is on Deployment and LeaderWorkerSet pods, so multi-node groups are read alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from moeguard_operator import constants as c
from moeguard_operator.loop.podstate import cannot_start, is_ready

Pod = Mapping[str, Any]


@dataclass(frozen=True)
class Rollout:
    """The worker pods by template.

    Attributes:
        current: the pods of the current template (all pods when the template hash is not known).
        earlier: names of the pods of earlier templates that are not being deleted.
        earlier_ready: how many of those are ready (they still serve: the Service selects them too).
        stuck: (pod, reason, message) of the first current pod that cannot start (:func:`podstate.cannot_start`),
            or None.
    """

    current: tuple[Pod, ...]
    earlier: tuple[str, ...] = ()
    earlier_ready: int = 0
    stuck: tuple[str, str, str] | None = None


def _name(pod: Pod) -> str:
    return str((pod.get("metadata") or {}).get("name") or "")


def split(pods: Iterable[Pod], template_hash: str | None) -> Rollout:
    """The :class:`Rollout` of ``pods`` for the current ``template_hash`` (None: unknown, every pod current)."""
    current, earlier, earlier_ready = [], [], 0
    for pod in sorted(pods, key=_name):
        meta = pod.get("metadata") or {}
        if template_hash is None or (meta.get("labels") or {}).get(c.TEMPLATE_HASH_LABEL) == template_hash:
            current.append(pod)
        elif not meta.get("deletionTimestamp"):
            earlier.append(_name(pod))
            earlier_ready += is_ready(pod)
    stuck = next(((_name(p), *why) for p in current if (why := cannot_start(dict(p))) is not None), None)
    return Rollout(tuple(current), tuple(earlier), earlier_ready, stuck)
