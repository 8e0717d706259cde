"""One worker pod's container run as a local process, the way a kubelet runs it (test/demo tooling).

:class:`PodContainer` owns one pod (a thread, like the kubelet's pod worker):

* the process runs in its own memory cgroup (:mod:`hack.memcg`) whose limit is the container's
  ``resources.limits.memory``: the kernel OOM-kills it where a node would;
* when it ends, the pod's status says so as the kubelet writes it (:mod:`hack.kubelet_status`):
  ``lastState.terminated`` (``OOMKilled`` / ``Error`` / ``Completed``, exit code, times),
  ``restartCount``, ``state.waiting.reason: CrashLoopBackOff`` during the back-off, then
  ``state.running`` again (restartPolicy Always: every exit is restarted);
* its ``readinessProbe`` (HTTP, on the worker's local port) decides ``ready`` and the pod's ``Ready`` /
  ``ContainersReady`` conditions;
* :meth:`PodContainer.terminate` (pod deleted) sends SIGTERM, then SIGKILL after the grace period,
  and removes the pod object (grace 0) once the process is gone, as the kubelet does.

Not run: liveness and startup probes (a test stops a worker with SIGSTOP to make it silent; a kubelet
would restart it), init containers, containers after the first (reported running and ready).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from hack import kubelet_status as ks
from hack.memcg import Hierarchy, MemoryCgroup
from kubernetes import client

TICK_S = 0.2
"""How often the process is checked for exit (the kubelet's PLEG relists every second)."""


def now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Options:
    """What every pod's container shares: the command, the cgroup parent, the back-off (seconds)."""

    cmd: list[str]
    hierarchy: Hierarchy
    cgroup_parent: str
    backoff_initial_s: float = ks.KUBELET_BACKOFF_INITIAL_S
    backoff_max_s: float = ks.KUBELET_BACKOFF_MAX_S
    cwd: Path = Path(".")


@dataclass
class PodContainer:
    """The container of pod ``key`` (``namespace/name``); ``env`` is the process environment,
    ``port`` its local port; ``on_change`` is called (from this thread) when pid or state changed."""

    key: str
    pod: dict[str, Any]
    env: dict[str, str]
    port: int
    log_path: Path
    options: Options
    api: client.CoreV1Api
    on_change: Callable[[PodContainer], None]
    log: Callable[[str], None]
    info: dict[str, Any] = field(default_factory=dict)
    """What the harness records about this pod beside its process (workers.json), e.g. its LWS group."""
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    last_state: dict[str, Any] = field(default_factory=dict)
    cgroup: MemoryCgroup | None = None
    _grace_s: float | None = None
    _oom_before: int = 0
    _delete_pod: bool = True
    _finished: bool = False
    _log_offset: int = 0
    _wake: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _written: tuple[dict[str, Any], bool, datetime | None] | None = None
    """The last status written (state, ready, started): :meth:`resync` writes it again."""

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    @property
    def container(self) -> dict[str, Any]:
        return dict(self.pod["spec"]["containers"][0])

    def limit_bytes(self) -> int:
        """``resources.limits.memory`` in bytes.

        Raises:
            ValueError: the container has no memory limit (a node would not confine it either; the
                harness refuses rather than run it unconfined).
        """
        from kubernetes.utils import parse_quantity

        limit = ((self.container.get("resources") or {}).get("limits") or {}).get("memory")
        if limit is None:
            raise ValueError(f"{self.key}: container {self.container.get('name')} has no resources.limits.memory")
        return int(parse_quantity(limit))  # type: ignore[no-untyped-call]

    def start(self) -> None:
        uid = str(self.pod["metadata"]["uid"])[:8]
        self.cgroup = MemoryCgroup.create(f"{self.options.cgroup_parent}/{self.namespace}_{self.name}_{uid}",
                                          self.limit_bytes(), self.options.hierarchy)
        self._thread = threading.Thread(target=self._run, name=f"pod {self.key}", daemon=True)
        self._thread.start()

    def terminate(self, grace_s: float, delete_pod: bool = True) -> None:
        """Stop the container (SIGTERM, SIGKILL after ``grace_s`` seconds) and then, when ``delete_pod``,
        remove the pod object (grace 0); returns at once."""
        if self._grace_s is None:
            self._delete_pod = delete_pod
            self._grace_s = grace_s
            self._wake.set()

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        """The pod worker still runs (False once it has cleaned up, also inside ``on_change``)."""
        return self._thread is not None and self._thread.is_alive() and not self._finished

    # --- the pod worker thread ---------------------------------------------------------------
    def _run(self) -> None:
        backoff = ks.BackOff(self.options.backoff_initial_s, self.options.backoff_max_s)
        try:
            while self._grace_s is None:
                started = self._launch()
                term, finished = self._supervise(started)
                if term is None:  # terminated by the harness (pod deleted)
                    break
                self.last_state = ks.terminated_state(term, started, finished, self._termination_message(term))
                self.log(f"{self.key}: container exited {term.exit_code} ({term.reason}), restart #{self.restarts + 1}")
                wait = backoff.wait_s(finished, now())
                if wait > 0:
                    waiting = {"waiting": {"reason": "CrashLoopBackOff", "message": (
                        f"back-off {backoff.current_s(finished):g}s restarting failed container="
                        f"{self.container['name']} pod={self.name}_{self.namespace}({self.pod['metadata']['uid']})")}}
                    self._write_status(waiting, ready=False)
                    self._wake.wait(wait)
                    if self._grace_s is not None:
                        break
                backoff = backoff.restarted(finished, now())
                self.restarts += 1
        except Exception as exc:  # never leave a pod without saying why
            self.log(f"{self.key}: pod worker failed: {exc!r}")
        finally:
            self._cleanup()

    def _launch(self) -> datetime:
        assert self.cgroup is not None
        self._oom_before = self.cgroup.oom_kills()
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(self.cgroup.wrap(self.options.cmd), cwd=self.options.cwd, env=self.env,
                                         stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        started = now()
        self.log(f"{self.key}: worker pid {self.proc.pid} on 127.0.0.1:{self.port} in {self.cgroup.path}")
        self._write_status({"running": {"startedAt": ks.rfc3339(started)}}, ready=False, started=started)
        self.on_change(self)
        return started

    def _supervise(self, started: datetime) -> tuple[ks.Termination | None, datetime]:
        """Probe until the process ends (its termination) or the harness stops it (None)."""
        assert self.proc is not None and self.cgroup is not None
        probe = ks.Probe.from_container(self.container)
        counter = ks.ProbeCounter(probe) if probe is not None else None
        ready = counter is None
        if ready:
            self._write_status({"running": {"startedAt": ks.rfc3339(started)}}, ready=True, started=started)
        next_probe = time.monotonic() + (probe.initial_delay_s if probe else 0)
        while True:
            if self._grace_s is not None:
                self._stop_process(self._grace_s)
                return None, now()
            if self.proc.poll() is not None:
                finished = now()
                return ks.termination(self.proc.returncode, self._oom_before, self.cgroup.oom_kills()), finished
            if counter is not None and probe is not None and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + probe.period_s
                counter = counter.observe(self._probe(probe))
                if counter.ready != ready:
                    ready = counter.ready
                    self.log(f"{self.key}: readiness probe: {'ready' if ready else 'not ready'}")
                    self._write_status({"running": {"startedAt": ks.rfc3339(started)}}, ready=ready, started=started)
            self._wake.wait(TICK_S)

    def _probe(self, probe: ks.Probe) -> bool:
        try:
            r = httpx.get(f"http://127.0.0.1:{self.port}{probe.path}", timeout=probe.timeout_s)
            return 200 <= r.status_code < 400
        except httpx.HTTPError:
            return False

    def _stop_process(self, grace_s: float) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.log(f"{self.key}: SIGTERM to pid {self.proc.pid}, grace {grace_s:g} s")
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                self.log(f"{self.key}: grace period over: SIGKILL")
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log(f"{self.key}: worker pid {self.proc.pid} stopped (exit {self.proc.returncode})")

    def _termination_message(self, term: ks.Termination) -> str:
        """``terminationMessagePolicy: FallbackToLogsOnError``: the tail of this run's log (the kubelet's
        last 80 lines, at most 2048 bytes) when it exited with an error; the file-based message of
        ``terminationMessagePath`` does not exist outside a container."""
        if self.container.get("terminationMessagePolicy") != "FallbackToLogsOnError" or term.exit_code == 0:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                tail = f.read()[-2048:]
        except OSError:
            return ""
        return b"\n".join(tail.splitlines()[-80:]).decode("utf-8", "replace").strip()

    def _cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._stop_process(0)
        if self.cgroup is not None:
            try:
                self.cgroup.remove()
            except OSError as exc:
                self.log(f"{self.key}: cgroup {self.cgroup.path} not removed: {exc!r}")
        if self._grace_s is not None and self._delete_pod:  # the kubelet removes the pod once its containers are gone
            try:
                self.api.delete_namespaced_pod(self.name, self.namespace, grace_period_seconds=0,
                                               body=client.V1DeleteOptions(preconditions=client.V1Preconditions(
                                                   uid=self.pod["metadata"]["uid"])))
                self.log(f"{self.key}: pod removed")
            except client.ApiException as exc:
                if exc.status not in (404, 409):
                    self.log(f"{self.key}: final delete failed: {exc.status} {exc.reason}")
        self._finished = True
        self.on_change(self)

    def resync(self, pod_ready: bool) -> None:
        """Write the last status again when the API's ``Ready`` (``pod_ready``) is not what this harness wrote, as
        the kubelet's status manager reconciles a pod status changed by someone else: after an API server outage
        the node controller marks the pods of a node whose lease expired NotReady, and nothing else would
        set them Ready again while their containers' readiness does not change (stop 39's clean-clone run)."""
        written = self._written
        if written is None or written[1] == pod_ready or self._grace_s is not None or self._finished:
            return
        self.log(f"{self.key}: the API's Ready is {pod_ready}, the container's is {written[1]}: status written again")
        self._write_status(*written)

    def _write_status(self, state: dict[str, Any], ready: bool, started: datetime | None = None) -> None:
        """Patch the pod's status (the status subresource) with this container's state and readiness."""
        if self._grace_s is not None:
            return
        self._written = (state, ready, started)
        ctr = self.container
        statuses = [ks.container_status(ctr["name"], ctr.get("image", ""), self.restarts, state,
                                        self.last_state, ready)]
        for other in self.pod["spec"]["containers"][1:]:  # not run here: reported running and ready
            statuses.append(ks.container_status(other["name"], other.get("image", ""), 0,
                                                {"running": {"startedAt": ks.rfc3339(started or now())}}, None, True))
        try:
            current: Any = self.api.read_namespaced_pod_status(self.name, self.namespace)
            conditions = client.ApiClient().sanitize_for_serialization(  # type: ignore[no-untyped-call]
                current.status.conditions or [])
        except client.ApiException as exc:
            self.log(f"{self.key}: cannot read pod status: {exc.status} {exc.reason}")
            return
        body = {"status": {"phase": "Running", "containerStatuses": statuses,
                           "conditions": ks.ready_conditions(conditions, ready, [] if ready else [ctr["name"]], now())}}
        try:
            self.api.patch_namespaced_pod_status(self.name, self.namespace, body,
                                                 _content_type="application/merge-patch+json")
        except client.ApiException as exc:
            if exc.status != 404:
                self.log(f"{self.key}: status patch failed: {exc.status} {exc.reason}: {json.dumps(body)[:300]}")
