"""The operator's one control loop: every MoEInferenceService, from what the watches hold, in one asyncio task.

kopf's ``on.event`` handlers (:mod:`handlers`) feed :class:`Views`: the services, their worker pods,
their budget ConfigMaps and Deployments, as the watches deliver them; the loop never GETs or LISTs
them. :meth:`ControlLoop.run` wakes on every watch event (at most every ``tick_seconds`` otherwise)
and, for each service that changed or is due:

* **readiness** from the pods at once (:func:`tick.readiness_step`), written when it changed;
* **a look** at Prometheus every ``control.queryIntervalSeconds`` (at once on an OOM kill): the
  services due are grouped by Prometheus URL, one :func:`observe.observe_services` call per URL in a
  thread of its own, under a deadline (``look_deadline_seconds``): a look past it is blind for its
  services, and that URL gets no new call until the old one returns. A service that comes due while a
  look at its URL is in flight (and not yet late) waits for that look's end and joins the next one. A
  slow Prometheus delays no other URL's looks, no write, no reconcile and no deletion (there is no
  finalizer);
* **writes** of one service (ConfigMap first, then a Deployment restart, the status, a leak replacement's pod
  and replica writes, its Events) run
  in a thread pool, one job per service at a time, each request under :data:`kube.REQUEST_TIMEOUT`.
  A failed write is retried at the next pass (the view it came from is unchanged), not after kopf's
  back-off. The status patch carries the ``resourceVersion`` it was computed from.

Nothing is written when nothing changed (:func:`tick.stable`). Blindness is remembered per service
(:class:`Memory.blind_floor`): the process's start, every look that was not fully visible, a gap
between two looks longer than twice the query interval, and every moment the API server did not
answer (a ``GET /version`` every :data:`API_PROBE_SECONDS`: the pods' view may be stale then).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from moeguard_core.contract import API_GROUP, API_VERSION
from moeguard_operator import constants as c
from moeguard_operator.children import children, kube
from moeguard_operator.children.builders import (
    Owner,
    build_workload,
    prefill_role_spec,
    restart_patch,
    template_hash,
    worker_name,
)
from moeguard_operator.config import OperatorConfig
from moeguard_operator.constants import FIELD_MANAGER
from moeguard_operator.diagnosis.diagnosis import DiagnosisMemory
from moeguard_operator.loop import (
    autoscale,
    budget_document,
    leak_replacement,
    metrics,
    report,
    roles,
    tick,
)
from moeguard_operator.loop.observation import Observation, leak_window_start
from moeguard_operator.loop.observe import (
    QUERY_DEADLINE_SECONDS,
    TIMEOUT,
    Target,
    observe_services,
    safe_url,
)
from moeguard_operator.loop.podstate import pod_facts
from moeguard_operator.loop.policy import floors
from moeguard_operator.spec.models import MoEInferenceServiceSpec, MoEInferenceServiceStatus
from moeguard_operator.spec.spec_checks import (
    SpecError,
    check_model_source,
    check_prometheus_url,
    parse_spec,
)

Key = tuple[str, str]
"""(namespace, name) of a MoEInferenceService."""
API_PROBE_SECONDS = 2.0
"""Seconds between two ``GET /version`` of the API server (one for the whole operator)."""
log = logging.getLogger(__name__)


def _rv(obj: dict[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


KEPT_METADATA = ("name", "namespace", "uid", "resourceVersion", "generation", "deletionTimestamp", "labels",
                 "creationTimestamp")
"""What the views keep of an object's metadata (not managedFields, nor kopf's annotations: memory at scale)."""
KEPT_POD_ANNOTATIONS = (leak_replacement.DELETION_COST_ANNOTATION,)
"""The only pod annotations the views keep (the leak replacement's mark)."""


def slim(obj: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``obj`` with only :data:`KEPT_METADATA` of its metadata and the top-level ``keys``."""
    meta = obj.get("metadata") or {}
    return {"metadata": {k: meta[k] for k in KEPT_METADATA if k in meta}, **{k: obj[k] for k in keys if k in obj}}


def slim_pod(obj: dict[str, Any]) -> dict[str, Any]:
    """A worker pod as the views keep it: :func:`slim` with its status, :data:`KEPT_POD_ANNOTATIONS` and its
    ``spec.terminationGracePeriodSeconds`` (the leak replacement's lead)."""
    kept = slim(obj, "status")
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    if any(a in annotations for a in KEPT_POD_ANNOTATIONS):
        kept["metadata"]["annotations"] = {a: annotations[a] for a in KEPT_POD_ANNOTATIONS if a in annotations}
    grace = (obj.get("spec") or {}).get("terminationGracePeriodSeconds")
    if grace is not None:
        kept["spec"] = {"terminationGracePeriodSeconds": grace}
    return kept


def slim_deployment(obj: dict[str, Any]) -> dict[str, Any]:
    """A worker Deployment as the views keep it: :func:`slim` with only what the leak replacement reads
    (``spec.replicas``, ``spec.strategy``, ``status.conditions``), not its pod template."""
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    return {**slim(obj), "spec": {k: spec[k] for k in ("replicas", "strategy") if k in spec},
            "status": {"conditions": status.get("conditions") or []}}


def _owner(svc: dict[str, Any]) -> Owner:
    """The children's owner of service ``svc``; of a role view (:mod:`roles`), the role's (its name, its service)."""
    meta = svc.get("metadata") or {}
    return Owner(name=meta.get("name", ""), namespace=meta.get("namespace", ""), uid=meta.get("uid", ""),
                 parent=roles.role_of(svc))


def _owner_key(obj: dict[str, Any]) -> Key | None:
    meta = obj.get("metadata") or {}
    instance = (meta.get("labels") or {}).get(c.LABEL_INSTANCE)
    return None if not instance or not meta.get("namespace") else (meta["namespace"], instance)


@dataclass
class Views:
    """What the watches delivered, by service (kept current by the ``on_*`` methods)."""

    services: dict[Key, dict[str, Any]] = field(default_factory=dict)
    pods: dict[Key, dict[str, dict[str, Any]]] = field(default_factory=dict)
    configmaps: dict[Key, dict[str, str]] = field(default_factory=dict)
    hand_edited: set[Key] = field(default_factory=set)
    """Budget ConfigMaps whose document is not the operator's (edited by hand)."""
    deployments: set[Key] = field(default_factory=set)
    workloads: dict[Key, dict[str, Any]] = field(default_factory=dict)
    """The worker Deployments (:func:`slim_deployment`), read by the leak replacement."""
    workload_replicas: dict[Key, int] = field(default_factory=dict)
    """The worker workloads' ``spec.replicas`` as last seen (the autoscaler sets it again where it differs)."""
    missing: dict[Key, set[str]] = field(default_factory=dict)
    """Children seen deleted while their service lives: applied again."""


@dataclass
class Memory:
    """The loop's memory of one service (never in status)."""

    blind_floor: datetime
    last_look: datetime | None = None
    looking: bool = False
    writing: bool = False
    pending: Observation | None = None
    spec_key: tuple[str, int | None] | None = None
    spec: MoEInferenceServiceSpec | SpecError | None = None
    template_hash: str | None = None
    """The pod-template hash of ``spec`` (:func:`builders.template_hash`), computed with it once per generation."""
    status_rv: str | None = None
    retry_at: float = 0.0
    """Monotonic time before which a failed write is not retried (one tick after the failure)."""
    failing: bool = False
    status: MoEInferenceServiceStatus | None = None
    diagnosis: DiagnosisMemory | None = None
    """The diagnosis's memory (the kinds that held in the previous look, a few times): a few hundred bytes."""

    def status_of(self, svc: dict[str, Any]) -> MoEInferenceServiceStatus:
        """The typed status of ``svc`` (parsed once per resourceVersion).

        Raises:
            pydantic.ValidationError: the stored status does not fit the model.
        """
        rv = (svc.get("metadata") or {}).get("resourceVersion")
        if self.status is None or rv is None or rv != self.status_rv:
            self.status, self.status_rv = report.read_status(svc.get("status")), rv
        return self.status


@dataclass
class _Look:
    url: str
    future: Future[dict[Key, Observation]]
    keys: list[Key]
    started: float
    now: datetime
    running: dict[Key, tuple[str, ...]] = field(default_factory=dict)
    answered: bool = False


class ControlLoop:
    """The control loop of every service this operator watches (see the module docstring)."""

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.views = Views()
        self.memory: dict[Key, Memory] = {}
        self.dirty: set[Key] = set()
        self.started = datetime.now(UTC)
        self.api_up = True
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._looks: dict[str, _Look] = {}
        self._writes: dict[Key, Future[dict[str, Any] | None]] = {}
        self._look_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="moeguard-look")
        self._write_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="moeguard-write")
        self._paused = threading.Event()
        self.task: asyncio.Task[None] | None = None
        """The running loop (set by the startup handler)."""

    # --- the watches' feed -------------------------------------------------------------------------
    def _touch(self, key: Key) -> None:
        self.dirty.add(key)
        if self._wake is not None:
            self._wake.set()

    def on_service(self, event_type: str | None, obj: dict[str, Any]) -> None:
        """A MoEInferenceService event (kopf's ``type``: None for the initial listing, ADDED, MODIFIED, DELETED)."""
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        view = roles.role_view(obj) if event_type != "DELETED" else None
        if view is None and (rkey := roles.role_key(*key)) in self.views.services:
            self._forget(rkey)  # the prefill role left the spec (or the service is gone)
        if event_type == "DELETED":
            self._forget(key)
            return
        known = self.views.services.get(key)
        same_object = known is not None and (known.get("metadata") or {}).get("uid") == meta.get("uid")
        if same_object and known is not None and _rv(known) > _rv(obj):
            return  # an older event than the object a write of ours returned
        if not same_object:
            self.memory.pop(key, None)
        self.views.services[key] = slim(obj, "apiVersion", "kind", "spec", "status")
        self._touch(key)
        if view is not None:  # the prefill role, a service of its own for the loop (roles.py)
            rkey = roles.role_key(*key)
            if not same_object:
                self.memory.pop(rkey, None)
            self.views.services[rkey] = view
            self._touch(rkey)

    def _forget(self, key: Key) -> None:
        self.views.services.pop(key, None)
        self.memory.pop(key, None)
        self.views.missing.pop(key, None)
        metrics.forget_service(*key)  # no series outlives its service (issue 29, item 2)

    def on_pod(self, event_type: str | None, obj: dict[str, Any]) -> None:
        """A worker pod event."""
        key = _owner_key(obj)
        if key is None:
            return
        name = obj["metadata"]["name"]
        pods = self.views.pods.setdefault(key, {})
        if event_type == "DELETED":
            pods.pop(name, None)
        else:
            pods[name] = slim_pod(obj)
        self._touch(key)

    def on_configmap(self, event_type: str | None, obj: dict[str, Any]) -> None:
        """A ConfigMap event: only the services' budget ConfigMaps (``<name>-budget``) are kept."""
        key = _owner_key(obj)
        if key is None or obj["metadata"]["name"] != f"{key[1]}-budget":
            return
        if event_type == "DELETED":
            self.views.configmaps.pop(key, None)
            self.views.hand_edited.discard(key)
            self._child_gone(key, "budget ConfigMap")
        else:
            self.views.configmaps[key] = dict(obj.get("data") or {})
            if budget_document.written_by(obj["metadata"].get("managedFields"), FIELD_MANAGER):
                self.views.hand_edited.discard(key)
            else:
                self.views.hand_edited.add(key)
        self._touch(key)

    def on_workload(self, event_type: str | None, obj: dict[str, Any]) -> None:
        """A Deployment or LeaderWorkerSet event: only the services' worker workloads (``<name>-worker``). A
        deleted one is missing only when it is of the kind the service's spec uses (the operator itself deletes
        the other kind after ``parallelism.podsPerReplica`` changes across 1)."""
        key = _owner_key(obj)
        if key is None or obj["metadata"]["name"] != f"{key[1]}-worker":
            return
        if event_type == "DELETED":
            self.views.deployments.discard(key)
            if obj.get("kind", "Deployment") == "Deployment":
                self.views.workloads.pop(key, None)
            self.views.workload_replicas.pop(key, None)
            svc = self.views.services.get(key) or {}
            pods_per_replica = (((svc.get("spec") or {}).get("parallelism") or {}).get("podsPerReplica") or 1)
            if (obj.get("kind") == c.LWS_KIND) == (int(pods_per_replica) > 1):
                self._child_gone(key, str(obj.get("kind") or "Deployment"))
        else:
            self.views.deployments.add(key)
            if obj.get("kind", "Deployment") == "Deployment":
                self.views.workloads[key] = slim_deployment(obj)
            replicas = (obj.get("spec") or {}).get("replicas")
            if isinstance(replicas, int):
                self.views.workload_replicas[key] = replicas
        self._touch(key)

    def _child_gone(self, key: Key, what: str) -> None:
        svc = self.views.services.get(key)
        if svc is not None and not (svc.get("metadata") or {}).get("deletionTimestamp"):
            self.views.missing.setdefault(key, set()).add(what)

    def _wake_from_thread(self, _: object = None) -> None:
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    # --- the loop ------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Pass over the services until cancelled (the operator's cleanup)."""
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        probe = asyncio.create_task(self._probe_api())
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.config.timer_interval_seconds)
                self._wake.clear()
                try:
                    self.step(datetime.now(UTC), time.monotonic())
                except Exception:  # one bad pass must not end the loop; the next one retries
                    log.exception("control loop pass failed")
                await asyncio.sleep(0.05)  # let watch events batch up a little
        finally:
            probe.cancel()

    def shutdown(self) -> None:
        """Drop queued work; running threads end at their own deadlines."""
        self._look_pool.shutdown(wait=False, cancel_futures=True)
        self._write_pool.shutdown(wait=False, cancel_futures=True)

    async def _probe_api(self) -> None:
        await asyncio.sleep(API_PROBE_SECONDS)  # after kopf's login and the configure handler
        while True:
            up = await asyncio.get_running_loop().run_in_executor(None, kube.api_reachable)
            now = datetime.now(UTC)
            if not up or not self.api_up:
                # Down, or just back: the pods' view may be stale, so every service is blind until now.
                for mem in self.memory.values():
                    mem.blind_floor = max(mem.blind_floor, now)
            if up != self.api_up:
                (log.info if up else log.warning)("Kubernetes API server %s", "reachable again" if up else "unreachable")
                self.api_up = up
                for key in self.views.services:
                    self._touch(key)
            await asyncio.sleep(API_PROBE_SECONDS)

    def step(self, now: datetime, mono: float) -> None:
        """One pass: finish the writes and looks that ended, then act on the services that changed or are due."""
        self._collect_writes(mono)
        self._collect_looks(now, mono)
        due_by_url: dict[str, list[tuple[Key, Target]]] = {}
        blind_now: list[tuple[Key, Observation]] = []
        busy_urls = set(self._looks)
        for key, svc in list(self.views.services.items()):
            mem = self.memory.get(key)
            if mem is None:
                mem = self.memory[key] = Memory(blind_floor=self.started)
            if mem.writing:
                continue
            spec = self._spec(svc, mem)
            if spec is None:
                self.dirty.discard(key)
                continue
            if mem.pending is not None and not mem.looking:
                obs, mem.pending = mem.pending, None
                self._after_look(key, svc, spec, mem, obs, now)
                continue
            changed = key in self.dirty or key in self.views.missing
            url = spec.control.prometheus_url or self.config.prometheus_url
            interval = spec.control.query_interval_seconds
            since = None if mem.last_look is None else (now - mem.last_look).total_seconds()
            joining = url in due_by_url and since is not None and since >= interval / 2
            if not changed and not (since is None or since >= interval or joining):
                continue
            pods = list(self.views.pods.get(key, {}).values())
            new_ooms = self._new_ooms(mem, pods) if changed else 0
            # replicas 0: no pods to see, so no look at all (issue 29, item 3): readiness reports ScaledToZero
            due = spec.replicas > 0 and not mem.looking and (
                since is None or since >= interval or new_ooms > 0 or joining)
            self.dirty.discard(key)
            if due and url in busy_urls and not self._looks[url].answered:
                # A look at that URL is in flight and not yet late: it ends within the look deadline, and its
                # end wakes the loop; this service joins the next look then. (Reported blind at once, it read
                # "no answer within the look deadline" for a look it was not in, and at 1,000 services that
                # message flipped with the looked-at one: thousands of idle status writes.)
                due = False
                if new_ooms:
                    self.dirty.add(key)  # counted again at the next pass
            if due:
                if since is not None and since > 2 * interval:
                    mem.blind_floor = max(mem.blind_floor, now)  # a gap between looks is blind time
                mem.last_look = now
                facts = pod_facts(pods)
                target = Target(key[0], key[1], spec, facts.running,
                                facts.running_since(leak_window_start(now, spec.control.leak_window_seconds,
                                                                     self.config.leak_warmup_seconds)),
                                new_ooms)
                if not url:
                    blind_now.append((key, Observation(time=now, expected_pods=facts.running, error=(
                        "no Prometheus URL configured (spec.control.prometheusUrl or --prometheus-url)"))))
                elif url in busy_urls:
                    blind_now.append((key, self._timed_out(url, now, facts.running)))
                else:
                    mem.looking = True
                    due_by_url.setdefault(url, []).append((key, target))
            elif changed and mono < mem.retry_at:
                self.dirty.add(key)  # the last write failed: retried at the next tick, not at once
            elif changed:
                self._readiness(key, svc, spec, pods, now)
        for key, obs in blind_now:
            mem = self.memory[key]
            self._after_look(key, self.views.services[key], self._spec_of(mem), mem, obs, now)
        for url, group in due_by_url.items():
            targets = [t for _, t in group]
            future = self._look_pool.submit(observe_services, url, targets, now, ca_file=self.config.prometheus_ca_file,
                                            deadline_seconds=min(QUERY_DEADLINE_SECONDS, self.config.look_deadline_seconds))
            self._looks[url] = _Look(url, future, [k for k, _ in group], mono, now,
                                     {k: t.running_pods for k, t in group})
            future.add_done_callback(self._wake_from_thread)

    # --- one service -----------------------------------------------------------------------------------
    def _spec(self, svc: dict[str, Any], mem: Memory) -> MoEInferenceServiceSpec | None:
        """The parsed spec of a service the loop controls now, or None (invalid, stalled, not yet reconciled,
        being deleted: reconcile reports those)."""
        meta = svc.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return None
        generation = meta.get("generation")
        if mem.spec_key != (meta.get("uid", ""), generation):
            mem.spec_key = (meta.get("uid", ""), generation)
            try:
                parsed = parse_spec(svc.get("spec") or {}, allow_secrets=self.config.allow_secrets)
                check_model_source(parsed, self.config.allow_host_path_models)
                check_prometheus_url(parsed, self.config.prometheus_urls)
                if roles.role_of(svc) is not None:
                    parsed = prefill_role_spec(parsed)
                mem.spec = parsed
                mem.template_hash = template_hash(_owner(svc), parsed)
            except SpecError as exc:
                mem.spec = exc
            except ValueError as exc:  # pydantic: the API server's schema should have refused it
                mem.spec = SpecError("InvalidSpec", str(exc))
        if not isinstance(mem.spec, MoEInferenceServiceSpec):
            return None
        try:
            prior = mem.status_of(svc)
        except ValueError:
            return None
        if prior.budgets is None or prior.observed_generation != generation or report.is_stalled(prior, generation):
            return None
        return autoscale.serving_spec(mem.spec, prior)

    @staticmethod
    def _spec_of(mem: Memory) -> MoEInferenceServiceSpec:
        assert isinstance(mem.spec, MoEInferenceServiceSpec)
        return mem.spec

    @staticmethod
    def _new_ooms(mem: Memory, pods: list[dict[str, Any]]) -> int:
        prior = mem.status
        if prior is None:
            return 0
        since = (prior.control.oom_checked_time if prior.control else None)
        return 0 if since is None else pod_facts(pods).oom_kills_after(since)

    def _readiness(self, key: Key, svc: dict[str, Any], spec: MoEInferenceServiceSpec, pods: list[dict[str, Any]],
                   now: datetime) -> None:
        prior = self.memory[key].status_of(svc)
        writes = tick.readiness_step(prior, spec, pods, self.views.configmaps.get(key), now,
                                     (svc.get("metadata") or {}).get("generation"), key not in self.views.hand_edited,
                                     self.memory[key].template_hash)
        if spec.replicas == 0:
            metrics.record_scaled_to_zero(*key)
        missing = self.views.missing.get(key, set())
        if missing or writes.events or report.status_patch(prior, writes.status):
            self._submit(key, svc, spec, prior, writes, missing)

    def _after_look(self, key: Key, svc: dict[str, Any], spec: MoEInferenceServiceSpec, mem: Memory, obs: Observation,
                    now: datetime) -> None:
        mem.looking = False
        if mem.writing:
            mem.pending = obs
            return
        prior = mem.status_of(svc)
        pods = list(self.views.pods.get(key, {}).values())
        writes = tick.look_step(prior, spec, pods, self.views.configmaps.get(key), obs, mem.blind_floor, now,
                                (svc.get("metadata") or {}).get("generation"), key not in self.views.hand_edited,
                                mem.diagnosis or DiagnosisMemory(blind_at=self.started),
                                leak_warmup_seconds=self.config.leak_warmup_seconds, template_hash=mem.template_hash,
                                policy=self.config.policy, workload=self.views.workloads.get(key),
                                workload_replicas=self.views.workload_replicas.get(key))
        if not obs.fully_visible:
            mem.blind_floor = max(mem.blind_floor, now)
        decision, found = writes.decision, writes.diagnosis
        assert decision is not None and found is not None
        mem.diagnosis = found.memory
        metrics.record_look(key[0], key[1], obs, decision, floors(spec.batching), scaled_to_zero=spec.replicas == 0)
        metrics.record_diagnosis(key[0], key[1], found)
        for kind in found.started:
            log.warning("%s/%s: diagnosis: %s started", key[0], key[1], kind)
        if decision.changed:
            log.info("%s/%s: budget %s: %s", key[0], key[1], decision.direction, decision.reason)
        if writes.autoscale is not None and writes.autoscale.changed:
            log.info("%s/%s: replicas %s: %s", key[0], key[1], writes.autoscale.direction, writes.autoscale.reason)
        missing = self.views.missing.get(key, set())
        if (missing or writes.events or writes.document or writes.restart or writes.scale is not None
                or writes.replacement
                or report.status_patch(prior, writes.status)):
            self._submit(key, svc, spec, prior, writes, missing)

    def _submit(self, key: Key, svc: dict[str, Any], spec: MoEInferenceServiceSpec, prior: MoEInferenceServiceStatus,
                writes: tick.Writes, missing: set[str]) -> None:
        mem = self.memory[key]
        mem.writing = True
        self.views.missing.pop(key, None)
        self._writes[key] = self._write_pool.submit(
            self._write, svc, spec, prior, writes, frozenset(missing), self.views.configmaps.get(key))
        self._writes[key].add_done_callback(self._wake_from_thread)

    def _collect_writes(self, mono: float) -> None:
        for key, future in list(self._writes.items()):
            if not future.done():
                continue
            del self._writes[key]
            mem = self.memory.get(key)
            if mem is None:
                continue
            mem.writing = False
            try:
                stored = future.result()
            except Exception as exc:
                self.dirty.add(key)
                if isinstance(exc, ApiException) and exc.status in (404, 409):
                    continue  # gone, or changed since: the watch brings the news
                mem.retry_at = mono + self.config.timer_interval_seconds
                (log.debug if mem.failing else log.warning)(
                    "%s/%s: write failed (%s); retried every %gs", *key,
                    f"{exc.status} {exc.reason}" if isinstance(exc, ApiException) else type(exc).__name__,
                    self.config.timer_interval_seconds)
                mem.failing = True
                continue
            if mem.failing:
                log.info("%s/%s: written again", *key)
            mem.failing = False
            if stored:
                self.on_service("MODIFIED", stored)

    def _collect_looks(self, now: datetime, mono: float) -> None:
        for url, look in list(self._looks.items()):
            if look.future.done():
                del self._looks[url]
                if look.answered:
                    continue  # already reported blind at its deadline
                try:
                    results = look.future.result()
                except Exception:
                    log.exception("look at %s failed", safe_url(url))
                    results = {}
                for key in look.keys:
                    obs = results.get(key) or self._timed_out(url, look.now, look.running.get(key, ()))
                    self._look_done(key, obs, now)
            elif not look.answered and mono - look.started > self.config.look_deadline_seconds:
                look.answered = True  # blind now; the URL stays busy until the call returns
                for key in look.keys:
                    self._look_done(key, self._timed_out(url, look.now, look.running.get(key, ())), now)

    def _look_done(self, key: Key, obs: Observation, now: datetime) -> None:
        svc, mem = self.views.services.get(key), self.memory.get(key)
        if svc is None or mem is None:
            return
        spec = self._spec(svc, mem)
        mem.looking = False
        if spec is None:
            return
        self._after_look(key, svc, spec, mem, obs, now)

    def _timed_out(self, url: str, now: datetime, running: tuple[str, ...]) -> Observation:
        """A blind look: the look at ``url`` did not answer within the deadline (one fixed message, whether the
        call is past its deadline, still running, or failed: status does not flap between them)."""
        return Observation(time=now, expected_pods=running, error=(
            f"Prometheus at {safe_url(url)}: {TIMEOUT} (no answer within the look deadline of "
            f"{self.config.look_deadline_seconds:g}s)"))

    # --- the writes (in a thread) ----------------------------------------------------------------------
    def _write(self, svc: dict[str, Any], spec: MoEInferenceServiceSpec, prior: MoEInferenceServiceStatus,
               writes: tick.Writes, missing: frozenset[str], data: dict[str, str] | None) -> dict[str, Any] | None:
        """ConfigMap (where a decision becomes durable), a restart, the status, the autoscaler's replica count on
        the workload, a leak replacement's writes (once the status holds the replacement; the autoscaler writes no
        count while one is in progress: :mod:`autoscale`), then its Events; returns the service as stored after the
        status patch (None when the status did not change).

        Raises:
            kubernetes.client.exceptions.ApiException, urllib3 errors: a request failed (retried by the loop).
        """
        meta = svc["metadata"]
        owner = _owner(svc)
        now = datetime.now(UTC)
        if missing:
            children.apply_children(owner, spec, leak_replacement.surge_replicas(spec, writes.status))
            if "budget ConfigMap" in missing:
                document = budget_document.in_effect(spec, writes.status, "recreated: the ConfigMap was deleted", now,
                                                     policy=self.config.policy)
                if document is not None:
                    data = None
                    children.apply_budget_document(owner, None, document)
            self._event(svc, report.Event("Warning", "ChildRecreated",
                                          f"{' and '.join(sorted(missing))} missing; applied again"), now)
        status = writes.status
        if writes.document is not None:
            written = children.apply_budget_document(owner, data, writes.document)
            if written.generation != writes.document.generation:
                status = status.model_copy(update={"budget_generation": written.generation})
            self._pause("after-configmap")
        if writes.restart:
            self._patch_workload(owner, spec, restart_patch(spec, now.isoformat()))
        stored = None
        patch = report.status_patch(prior, status)
        if patch:
            stored = kube.patch_status(owner.namespace, *roles.status_patch_of(svc, patch), meta.get("resourceVersion"))
        if writes.scale is not None:  # after the status: the decision is durable before the workload follows it
            self._patch_workload(owner, spec, {"spec": {"replicas": writes.scale}})
        if writes.document is not None:
            self._pause("after-status")
        self._replace(owner, spec, writes.replacement)
        for event in writes.events:
            self._event(svc, event, now)
        return stored

    @staticmethod
    def _replace(owner: Owner, spec: MoEInferenceServiceSpec, actions: leak_replacement.Actions) -> None:
        """A leak replacement's writes (:class:`leak_replacement.Actions`), in their order, after the status that
        holds the replacement."""
        if actions.mark_pod is not None:
            kube.annotate_pod(owner.namespace, actions.mark_pod,
                              {leak_replacement.DELETION_COST_ANNOTATION: leak_replacement.LEAKING_POD_COST})
        if actions.delete_pod is not None:
            kube.delete_pod(owner.namespace, actions.delete_pod)
        if actions.replicas is not None:
            ControlLoop._patch_workload(owner, spec, {"spec": {"replicas": actions.replicas}})

    @staticmethod
    def _patch_workload(owner: Owner, spec: MoEInferenceServiceSpec, body: dict[str, Any]) -> None:
        """Merge-patch the worker workload of the kind ``spec`` uses: the rolling restart's annotation, the
        autoscaler's or a leak replacement's ``spec.replicas``."""
        workload = build_workload(owner, spec)
        kube.patch_workload(workload["apiVersion"], workload["kind"], owner.namespace, worker_name(owner), body)

    @staticmethod
    def _event(svc: dict[str, Any], event: report.Event, now: datetime) -> None:
        """Post ``event`` on the service (a role view's on its service, the message saying the role)."""
        meta, parent = svc["metadata"], roles.role_of(svc)
        message = event.message if parent is None else f"prefill role: {event.message}"
        involved = {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "MoEInferenceService",
                    "metadata": meta if parent is None else {**meta, "name": parent}}
        try:
            kube.post_event(involved, event.type, event.reason, message, now)
        except ApiException as exc:  # an Event is best effort, as kopf's are
            log.warning("%s/%s: Event %s not posted (%s)", svc["metadata"]["namespace"], svc["metadata"]["name"],
                        event.reason, exc.status)

    def _pause(self, point: str) -> None:
        """Test only (``MOEGUARD_TEST_PAUSE_AT``): block this decision's writes here, for a test to ``kill -9``
        the operator (only writes that carry a budget document pause)."""
        if self.config.test_pause_at == point:
            log.warning("MOEGUARD_TEST_PAUSE_AT=%s: paused here until killed", point)
            self._paused.wait()
