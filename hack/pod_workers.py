#!/usr/bin/env python3
"""Test/demo harness, not product: each worker pod's container runs here as a process, as a kubelet
would run it.

kwok runs no containers. This harness takes the pods its label selector matches (default: moeguard
worker pods) and acts as their kubelet for what moeguard depends on:

* **Which pods are the harness's.** On first sight it annotates a pod
  ``harness.moeguard.dev/instance=<instance>``. The kwok stages in ``hack/cluster/stages/`` split on that
  annotation: an annotated pod gets from kwok only what a node does before containers run (pod IP, start
  time, ``ContainerCreating``; ``pod-start-harness.yaml``) and its Ready condition only from this
  harness; every other pod (no harness running, e.g. the scale benchmark) is made Running and Ready by
  kwok itself (``pod-ready-unmanaged.yaml``, kwok's ``pod-ready`` with one more selector line). A pod
  that kwok already made Ready before the annotation landed (a lost race, logged) is taken over: its
  status is rewritten by the harness from then on.
* **The container** (:mod:`hack.pod_container`): ``python -m moeguard_runtime`` with the env of the
  pod's first container (values, downward API, resource limits), MOEGUARD_PORT = a free loopback port
  (kept across restarts), KUBECONFIG = a token of the pod's ServiceAccount (TokenRequest, bound to the
  pod: real RBAC), in its own memory cgroup (:mod:`hack.memcg`) whose limit is
  ``resources.limits.memory``: the kernel OOM-kills it where a node would. No writable memory cgroup:
  the harness refuses to start, saying why.
* **Test-only env**: the JSON object in the pod annotation ``harness.moeguard.dev/test-env`` is added to
  the process env (e.g. the worker's fault switches, ``MOEGUARD_TEST_FAULTS=1`` and a leak rate, which the
  CRD refuses in ``template.extraEnv``; set it through ``spec.template.annotations``).
* **Status** (:mod:`hack.kubelet_status`): ``state.running`` / ``lastState.terminated`` (``OOMKilled``,
  exit 137, when the cgroup counted a kill; else ``Error``), ``restartCount`` (every exit is restarted:
  worker pods come from Deployments, restartPolicy Always), ``CrashLoopBackOff`` during the kubelet's back-off (10 s doubling to 5 min; ``--backoff-initial-seconds`` /
  ``--backoff-max-seconds`` shorten it for tests), ``Ready`` from the container's HTTP readinessProbe
  (path, period, thresholds from the pod spec, sent to the local port).
* **Deletion** (``kubectl delete pod``, a rollout): SIGTERM, SIGKILL after the pod's grace period, then
  the pod object is removed (grace 0). Without a harness kwok removes an annotated pod when its grace
  period ends (``pod-delete-harness.yaml``). A pod deleted and created again under the same name (a
  StatefulSet's, e.g. a LeaderWorkerSet group being recreated) gets its new process once the old one
  is gone.
* **LeaderWorkerSet pods** (label ``leaderworkerset.sigs.k8s.io/name``) run like any other, with what a
  pod network would give them: ``LWS_LEADER_ADDRESS`` (the leader's DNS name, which does not resolve
  here) becomes ``127.0.0.1``, and ``MOEGUARD_EP_PORT`` is one free loopback port per group (the same
  for every pod of the group, kept while any pod of the group runs here; group: the label
  ``leaderworkerset.sigs.k8s.io/group-key``), where the group's ranks rendezvous. ``LWS_GROUP_SIZE`` and
  ``LWS_WORKER_INDEX`` are the pod's own (injected by LWS's pod webhook). A death is written to the
  pod status as for any pod (``restartCount``), which is what LWS's ``RecreateGroupOnPodRestart`` acts on.
  A pod that holds a whole group (expert parallelism in one pod, ``MOEGUARD_EP_PORT`` set without LWS)
  gets a free port of its own instead of the operator's 29500, which every such pod would share here.

* **Services a pod calls** (a decode pod's ``MOEGUARD_PREFILL_URL``, the prefill role's Service): the URL
  becomes that of a loopback stand-in (:class:`hack.service_proxy.ServiceProxy`) that forwards each connection
  to a running pod here whose labels the Service's selector matches, round robin, as kube-proxy would.

Each worker is a Prometheus file_sd target 127.0.0.1:<port>; <run dir>/workers.json maps
namespace/pod -> port, pid, url, moeis, uid, cgroup, restarts, and for LWS pods ``lws``: group,
leaderAddress (the pod's own value), epPort, groupSize, workerIndex; for one-pod groups ``epPort``.

    hack/pod_workers.py run | start | stop   # foreground | background (<run dir>/pids/pod-workers.pid)

More in docs/local-cluster.md (what is and is not done as a kubelet would).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config, watch
from kubernetes.utils import parse_quantity

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: `hack` importable
from hack.kubelet_status import KUBELET_BACKOFF_INITIAL_S, KUBELET_BACKOFF_MAX_S
from hack.memcg import MemcgUnavailable, MemoryCgroup, memory_hierarchy, remove_tree
from hack.pod_container import Options, PodContainer
from hack.service_proxy import ServiceProxy

ROOT = Path(__file__).resolve().parent.parent
SELECTOR = "app.kubernetes.io/managed-by=moeguard,app.kubernetes.io/component=worker"  # stand-ins: own tests
quantity: Callable[[str], Decimal] = parse_quantity


def log(msg: str) -> None:
    """One line on stderr, written at once (pod worker threads log concurrently)."""
    sys.stderr.write(f"[pod-workers {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    (tmp := path.with_name(f".{path.name}.tmp")).write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)


ANNOTATION = "harness.moeguard.dev/instance"
"""The pods a harness manages carry this annotation (value: its ``--instance``); kwok's stages key on it."""
TEST_ENV_ANNOTATION = "harness.moeguard.dev/test-env"
"""A JSON object of extra env for the pod's process (tests: the worker's fault switches)."""
PREFILL_URL_ENV = "MOEGUARD_PREFILL_URL"
"""A decode pod's prefill Service (``contract.ENV_PREFILL_URL``): reached through a :class:`ServiceProxy`."""
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX = "LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"
EP_PORT_ENV = "MOEGUARD_EP_PORT"
"""The loopback port of an LWS group's rendezvous (the worker's expert-parallel process group)."""


def free_port() -> int:
    """A free loopback port (the kernel's pick; free now, not reserved)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pod_ready(pod: Any) -> bool:
    """Whether the API's pod (a kubernetes client ``V1Pod``) has its ``Ready`` condition True."""
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def lws_group(namespace: str, labels: dict[str, str] | None) -> str | None:
    """``namespace/<group>`` of a LeaderWorkerSet pod (LWS's group-key label, set on the leader by its
    pod webhook and copied to the workers; else set name and group index), or None for any other pod."""
    labels = labels or {}
    if LWS_NAME_LABEL not in labels:
        return None
    group = labels.get(LWS_GROUP_KEY_LABEL) or f"{labels[LWS_NAME_LABEL]}-{labels.get(LWS_GROUP_INDEX_LABEL, '')}"
    return f"{namespace}/{group}"


def own_rendezvous_env(env: dict[str, str], port: Callable[[], int]) -> tuple[dict[str, str], dict[str, Any]]:
    """For a pod that is not in a LeaderWorkerSet group: when its ranks rendezvous among its own
    processes (``MOEGUARD_EP_PORT`` set: expert parallelism in one pod), a port of its own from
    ``port()`` (on a node each pod has its network namespace and the operator's port 29500; here
    every pod shares loopback, so two replicas would collide), and what workers.json records;
    else nothing."""
    if EP_PORT_ENV not in env:
        return {}, {}
    ep_port = port()
    return {EP_PORT_ENV: str(ep_port)}, {"epPort": ep_port}


def test_env(annotations: dict[str, str] | None, key: str) -> dict[str, str]:
    """The env in :data:`TEST_ENV_ANNOTATION`.

    Raises:
        ValueError: not a JSON object of strings (names the pod).
    """
    raw = (annotations or {}).get(TEST_ENV_ANNOTATION)
    if raw is None:
        return {}
    try:
        env = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{key}: annotation {TEST_ENV_ANNOTATION} is not JSON: {exc}") from None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"{key}: annotation {TEST_ENV_ANNOTATION} must be a JSON object of strings, given {raw!r}")
    return env


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)  # loopback, self-signed
        self.run_dir = Path(args.run_dir)
        self.admin_kubeconfig = str(self.run_dir / "kubeconfig")
        config.load_kube_config(self.admin_kubeconfig)  # type: ignore[no-untyped-call]
        self.api = client.CoreV1Api()
        self.namespace: str | None = args.namespace
        self.selector: str = args.selector
        self.instance: str = args.instance
        self.state_file = self.run_dir / f"workers{args.sfx}.json"
        self.targets, self.workers_dir = self.run_dir / "prometheus" / "targets", self.run_dir / "workers"
        self.pods: dict[str, PodContainer] = {}
        self.group_ports: dict[str, int] = {}  # LWS group -> MOEGUARD_EP_PORT, while a pod of it runs here
        self.services: dict[str, ServiceProxy] = {}  # namespace/service -> its loopback stand-in
        self.waiting: set[str] = set()  # pods whose predecessor of the same name is still stopping
        self.lock = threading.Lock()
        self.reconciling = threading.RLock()  # the watch and the pod threads (a successor's start) reconcile
        self.targets.mkdir(parents=True, exist_ok=True)
        self.workers_dir.mkdir(parents=True, exist_ok=True)
        hierarchy = memory_hierarchy()  # raises MemcgUnavailable, naming what it tried
        run_id = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:8]
        self.cgroup_parent = f"moeguard-pods-{run_id}-{self.instance}"
        remove_tree(hierarchy.mount / self.cgroup_parent)  # left by a harness that was killed
        try:  # the whole path works (v2: the memory controller delegated down; a limit accepted), or say so now
            MemoryCgroup.create(f"{self.cgroup_parent}/probe", 1 << 30, hierarchy).remove()
        except OSError as exc:
            raise MemcgUnavailable(f"cannot make a limited memory cgroup under {hierarchy.mount}/"
                                   f"{self.cgroup_parent}: {exc}") from exc
        self.options = Options(
            cmd=shlex.split(args.worker_cmd.replace("{python}", shlex.quote(sys.executable))),
            hierarchy=hierarchy, cgroup_parent=self.cgroup_parent, backoff_initial_s=args.backoff_initial_seconds,
            backoff_max_s=args.backoff_max_seconds, cwd=ROOT)
        log(f"memory cgroups: v{hierarchy.version} at {hierarchy.mount}/{self.cgroup_parent}; "
            f"back-off {args.backoff_initial_seconds:g} s doubling to {args.backoff_max_seconds:g} s")

    def resolve_env(self, pod: Any) -> dict[str, str]:
        ctr, env = pod.spec.containers[0], {}
        fields = {"metadata.name": pod.metadata.name, "metadata.namespace": pod.metadata.namespace,
                  "metadata.uid": pod.metadata.uid, "status.podIP": pod.status.pod_ip,
                  "spec.nodeName": pod.spec.node_name, "spec.serviceAccountName": pod.spec.service_account_name}
        for e in ctr.env or []:
            src = e.value_from
            if src is None:
                env[e.name] = e.value or ""
            elif src.field_ref is not None:
                env[e.name] = str(fields.get(src.field_ref.field_path) or "")
            elif src.resource_field_ref is not None:  # e.g. limits.memory -> bytes
                kind, _, name = src.resource_field_ref.resource.partition(".")  # limits / requests
                q = (getattr(ctr.resources, kind, None) or {}).get(name)
                div = quantity(src.resource_field_ref.divisor or "1") or 1  # the API's default "0" means 1
                env[e.name] = str(int(-(-quantity(q) // div))) if q is not None else ""
            else:
                log(f"{pod.metadata.namespace}/{pod.metadata.name}: env {e.name}: unsupported source, left out")
        return env

    def pod_kubeconfig(self, pod: Any, key: str) -> str:
        ns, name, sa = pod.metadata.namespace, pod.metadata.name, pod.spec.service_account_name or "default"
        try:
            req = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
                audiences=[], expiration_seconds=86400, bound_object_ref=client.V1BoundObjectReference(
                    api_version="v1", kind="Pod", name=name, uid=pod.metadata.uid)))
            token = self.api.create_namespaced_service_account_token(sa, ns, req).status.token  # type: ignore[union-attr]
        except client.ApiException as exc:
            log(f"{key}: no token for ServiceAccount {ns}/{sa} ({exc.status} {exc.reason}); FALLING BACK to admin")
            return self.admin_kubeconfig
        user, server = f"system:serviceaccount:{ns}:{sa}", client.Configuration.get_default_copy().host
        path = self.workers_dir / f"{ns}_{name}.kubeconfig"
        write_atomic(path, json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "pod",
            "clusters": [{"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "pod", "context": {"cluster": "c", "namespace": ns, "user": user}}]}), 0o600)
        return str(path)

    def lws_env(self, pod: Any, key: str, env: dict[str, str]) -> tuple[dict[str, str], dict[str, Any]]:
        """For a LeaderWorkerSet pod: the env a pod network would make work here (the leader's address
        on loopback, the group's rendezvous port) and what workers.json records; else nothing. Call with
        ``self.lock`` held, and add the pod to ``self.pods`` in the same hold (the group's port lives as
        long as a pod of the group is there)."""
        group = lws_group(pod.metadata.namespace, pod.metadata.labels)
        if group is None:
            return own_rendezvous_env(env, free_port)
        if group not in self.group_ports:
            self.group_ports[group] = free_port()
            log(f"LWS group {group}: {EP_PORT_ENV}={self.group_ports[group]}")
        ep_port = self.group_ports[group]
        missing = [n for n in (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX) if n not in env]
        if missing:  # LWS's pod webhook did not run (not registered, or the pod was made without LWS)
            log(f"{key}: LeaderWorkerSet pod without {', '.join(missing)} (LWS's pod webhook did not inject them)")
        info = {"group": group, "leaderAddress": env.get(LWS_LEADER_ADDRESS), "epPort": ep_port,
                "groupSize": env.get(LWS_GROUP_SIZE), "workerIndex": env.get(LWS_WORKER_INDEX)}
        return {LWS_LEADER_ADDRESS: "127.0.0.1", EP_PORT_ENV: str(ep_port)}, {"lws": info}

    def service_env(self, namespace: str, env: dict[str, str], key: str) -> dict[str, str]:
        """A decode pod's ``MOEGUARD_PREFILL_URL`` (``http://<service>:<port>``, the prefill role's Service) made
        to reach the Service's pods here: the address of its :class:`ServiceProxy`."""
        url = env.get(PREFILL_URL_ENV)
        if not url:
            return {}
        host = urllib.parse.urlsplit(url).hostname or ""
        service = host.split(".")[0]
        skey = f"{namespace}/{service}"
        if skey not in self.services:
            try:
                selector = dict(self.api.read_namespaced_service(service, namespace).spec.selector or {})
            except client.ApiException as exc:
                log(f"{key}: {PREFILL_URL_ENV} names Service {skey}, which cannot be read ({exc.status}); left as is")
                return {}

            def backends(ns: str = namespace, sel: dict[str, str] = selector) -> list[int]:
                with self.lock:
                    return [pc.port for pc in self.pods.values()
                            if pc.namespace == ns and pc.proc is not None and pc.proc.poll() is None
                            and sel.items() <= (pc.pod["metadata"].get("labels") or {}).items()]

            self.services[skey] = ServiceProxy(skey, backends, log)
            log(f"Service {skey}: loopback stand-in on 127.0.0.1:{self.services[skey].port} (selector {selector})")
        return {PREFILL_URL_ENV: f"http://127.0.0.1:{self.services[skey].port}"}

    def start_pod(self, pod: Any, key: str) -> None:
        port = free_port()
        ns, name = pod.metadata.namespace, pod.metadata.name
        pythonpath = os.pathsep.join(filter(None, [str(ROOT / "runtime"), str(ROOT / "core"), os.environ.get("PYTHONPATH")]))
        pod_env = self.resolve_env(pod)
        last = {**test_env(pod.metadata.annotations, key), "MOEGUARD_PORT": str(port), "PYTHONPATH": pythonpath,
                "KUBECONFIG": self.pod_kubeconfig(pod, key), **self.service_env(ns, pod_env, key)}
        as_json = client.ApiClient().sanitize_for_serialization(pod)  # type: ignore[no-untyped-call]
        with self.lock:
            pc = PodContainer(key, as_json, {**os.environ, **pod_env, **last}, port,
                              self.workers_dir / f"{ns}_{name}.log", self.options, client.CoreV1Api(),
                              self.changed, log)
            pc.limit_bytes()  # no memory limit: refused here, before anything runs
            lws_env, pc.info = self.lws_env(pod, key, pod_env)
            pc.env = {**os.environ, **pod_env, **lws_env, **last}
            self.pods[key] = pc
        moeis = (pod.metadata.labels or {}).get("app.kubernetes.io/instance", "")
        target = [{"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": ns, "pod": name, "moeis": moeis}}]
        write_atomic(self.targets / f"{ns}_{name}.json", json.dumps(target))
        pc.start()

    def changed(self, pc: PodContainer) -> None:
        """A pod worker started a process or ended (called from its thread)."""
        successor = False
        with self.lock:
            if not pc.alive and self.pods.get(pc.key) is pc:
                del self.pods[pc.key]
                for f in (self.targets / f"{pc.key.replace('/', '_')}.json",
                          self.workers_dir / f"{pc.key.replace('/', '_')}.kubeconfig"):
                    f.unlink(missing_ok=True)
                successor = pc.key in self.waiting
                self.waiting.discard(pc.key)
                group = (pc.info.get("lws") or {}).get("group")
                if group in self.group_ports and not any(
                        (other.info.get("lws") or {}).get("group") == group for other in self.pods.values()):
                    log(f"LWS group {group}: no pod left here; {EP_PORT_ENV} {self.group_ports.pop(group)} released")
            self.save()
        if successor:  # a new pod of the same name waited for this one to stop: start it now
            self.start_successor(pc.key)

    def start_successor(self, key: str) -> None:
        """Reconcile the current pod ``key`` if the selector still takes it (read afresh: the event that
        announced it is old)."""
        ns, name = key.split("/", 1)
        try:
            pods = self.api.list_namespaced_pod(ns, label_selector=self.selector, field_selector=f"metadata.name={name}")
        except (client.ApiException, urllib3.exceptions.HTTPError) as exc:
            log(f"{key}: cannot read the new pod ({exc!r}); it starts on its next event")
            return
        for pod in pods.items:
            self.reconcile(pod)

    def save(self) -> None:
        state = {}
        for key, pc in sorted(self.pods.items()):
            if pc.proc is None:
                continue
            moeis = (pc.pod["metadata"].get("labels") or {}).get("app.kubernetes.io/instance", "")
            state[key] = {"port": pc.port, "pid": pc.proc.pid, "url": f"http://127.0.0.1:{pc.port}", "moeis": moeis,
                          "uid": pc.pod["metadata"]["uid"], "restarts": pc.restarts,
                          "cgroup": str(pc.cgroup.path) if pc.cgroup else None, **pc.info}
        write_atomic(self.state_file, json.dumps(state, indent=1))

    def reconcile(self, pod: Any, deleted: bool = False) -> None:
        with self.reconciling:
            self._reconcile(pod, deleted)

    def _reconcile(self, pod: Any, deleted: bool) -> None:
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        owner = (pod.metadata.annotations or {}).get(ANNOTATION)
        gone = deleted or pod.metadata.deletion_timestamp is not None
        with self.lock:
            current = self.pods.get(key)
        if current is not None and (gone or current.pod["metadata"]["uid"] != pod.metadata.uid):
            grace = pod.metadata.deletion_grace_period_seconds
            if grace is None:
                grace = pod.spec.termination_grace_period_seconds if pod.spec.termination_grace_period_seconds \
                    is not None else 30
            same = current.pod["metadata"]["uid"] == pod.metadata.uid
            with self.lock:
                if not gone and not same:  # a new pod of this name: started once the old process is gone
                    self.waiting.add(key)
                elif same:
                    self.waiting.discard(key)
            current.terminate(float(grace), delete_pod=same)
            return
        if current is not None and not gone:
            current.resync(pod_ready(pod))
            return
        if gone:
            return
        if owner is None:  # take it: from now on kwok leaves its containers and readiness to us
            if pod_ready(pod):
                log(f"{key}: kwok made the pod Ready before the harness took it; the harness takes over")
            try:
                self.api.patch_namespaced_pod(pod.metadata.name, pod.metadata.namespace,
                                              {"metadata": {"annotations": {ANNOTATION: self.instance}}})
            except client.ApiException as exc:
                log(f"{key}: cannot annotate ({exc.status} {exc.reason})")
            return
        if owner != self.instance or not pod.status.pod_ip:
            return  # another harness's, or kwok has not "started" the pod yet
        try:
            self.start_pod(pod, key)
        except Exception as exc:  # one bad pod must not stop the harness
            log(f"{key}: cannot start a worker: {exc!r}")

    def run(self, ready_file: Path) -> None:
        # watch.stream reads the return type from the docstring of the API's own list function
        fn: Any = self.api.list_namespaced_pod if self.namespace else self.api.list_pod_for_all_namespaces
        fn_args = [self.namespace] if self.namespace else []
        while True:
            try:
                pods = fn(*fn_args, label_selector=self.selector)
                seen = {f"{p.metadata.namespace}/{p.metadata.name}" for p in pods.items}
                with self.lock:
                    vanished = [pc for k, pc in self.pods.items() if k not in seen]
                for pc in vanished:
                    pc.terminate(0, delete_pod=False)
                for p in pods.items:
                    self.reconcile(p)
                if not ready_file.exists():  # `start` waits for this file
                    write_atomic(ready_file, str(os.getpid()))
                for ev in watch.Watch().stream(  # type: ignore[no-untyped-call]
                        fn, *fn_args, label_selector=self.selector, resource_version=pods.metadata.resource_version,
                        timeout_seconds=60, _request_timeout=90):
                    if ev["type"] == "ERROR":  # e.g. 410 Gone: relist
                        log(f"watch error: {ev['raw_object'].get('message')}; relisting")
                        break
                    self.reconcile(ev["object"], deleted=ev["type"] == "DELETED")
            except (client.ApiException, urllib3.exceptions.HTTPError) as exc:  # API server away: retry
                log(f"list/watch failed: {exc!r}; retrying in 1 s")
                time.sleep(1)

    def stop_all(self) -> None:
        """Stop every worker (SIGTERM, up to 10 s); the pods stay (the harness, not the pods, goes)."""
        with self.lock:
            pods = list(self.pods.values())
        for pc in pods:
            pc.terminate(10.0, delete_pod=False)
        for pc in pods:
            pc.join(30)
        remove_tree(self.options.hierarchy.mount / self.cgroup_parent)
        self.state_file.unlink(missing_ok=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["run", "start", "stop"])
    p.add_argument("--run-dir", default=os.environ.get("MOEGUARD_RUN_DIR", "/tmp/moeguard-run"))
    p.add_argument("--namespace", "-n", default=None, help="watch one namespace (default: all)")
    p.add_argument("--selector", default=f"{SELECTOR},!harness.moeguard.dev/stand-in", help="label selector")
    p.add_argument("--worker-cmd", default="{python} -m moeguard_runtime", help="{python}: this interpreter")
    p.add_argument("--instance", default="default", help="names this harness's pid, state and log files, "
                   f"and is the value of the {ANNOTATION} annotation on the pods it takes")
    p.add_argument("--backoff-initial-seconds", type=float, default=KUBELET_BACKOFF_INITIAL_S,
                   help="the crash-loop back-off's first wait (kubelet: 10)")
    p.add_argument("--backoff-max-seconds", type=float, default=KUBELET_BACKOFF_MAX_S,
                   help="the crash-loop back-off's cap (kubelet: 300); it resets after 2x this running")
    args = p.parse_args()
    if not 0 < args.backoff_initial_seconds <= args.backoff_max_seconds:
        p.error("need 0 < --backoff-initial-seconds <= --backoff-max-seconds")
    run_dir, sfx = Path(args.run_dir), ("" if args.instance == "default" else f"-{args.instance}")
    pid_file, log_file = run_dir / "pids" / f"pod-workers{sfx}.pid", run_dir / "logs" / f"pod-workers{sfx}.log"
    pid = pid_file.read_text().strip() if pid_file.exists() else ""

    alive = bool(pid) and Path(f"/proc/{pid}").exists()
    if args.action == "stop":
        if alive:
            os.kill(int(pid), signal.SIGTERM)
            deadline = time.monotonic() + 60  # it stops its workers first (up to 10 s each)
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        if alive and Path(f"/proc/{pid}").exists():
            log(f"pid {pid} still running after 60 s")
            return 1
        pid_file.unlink(missing_ok=True)
        return 0
    if args.action == "start":
        if alive:
            log(f"already running (pid {pid})")
            return 0
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        pid_file.unlink(missing_ok=True)
        argv = ["--selector", args.selector, "--worker-cmd", args.worker_cmd, "--instance", args.instance,
                "--backoff-initial-seconds", str(args.backoff_initial_seconds),
                "--backoff-max-seconds", str(args.backoff_max_seconds),
                *(["--namespace", args.namespace] if args.namespace else []),
                "--run-dir", f"{run_dir}/"]  # the "/" lets cluster-down.sh see it is the run dir's
        with open(log_file, "ab") as logf:
            child = subprocess.Popen([sys.executable, __file__, "run", *argv], stdout=logf,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while not pid_file.exists():
            if child.poll() is not None or time.monotonic() > deadline:
                tail = log_file.read_text(errors="replace").strip().splitlines()[-5:]
                log(f"did not start (exit {child.poll()}); see {log_file}:\n" + "\n".join(tail))
                return 1
            time.sleep(0.1)
        log(f"started (pid {child.pid}, log {log_file})")
        return 0

    if alive:
        log(f"already running (pid {pid})")
        return 1
    args.sfx = sfx
    try:
        harness = Harness(args)
    except MemcgUnavailable as exc:
        log(f"ERROR: {exc}: the harness confines each worker like a container and cannot run without it")
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    try:
        harness.run(pid_file)
    finally:
        harness.stop_all()
        if pid_file.exists() and pid_file.read_text().strip() == str(os.getpid()):
            pid_file.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
