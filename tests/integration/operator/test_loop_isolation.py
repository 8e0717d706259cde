"""The one control loop isolates services from each other's Prometheus, and holds no finalizer (issue 12 §3
and §6, issue 11 §4), against the local API server, the real Prometheus and a real HTTP server that trickles
one byte every 4 s:

* 10 services whose ``spec.control.prometheusUrl`` is the trickling server (allowed with
  ``--allowed-prometheus-url``) and 1 healthy service: the healthy one gets its Deployment within seconds,
  is Ready, and its looks keep ending while hung looks are in flight (the operator's own metrics count the looks);
  the hung ones report ``PrometheusTimeout``; deleting a hung one completes at once;
* a resource that carries the finalizer of earlier versions (``moeguard.dev/finalizer``) loses it;
* nothing is written while nothing changes: the healthy service's resourceVersion stays put over idle
  query intervals;
* services that come due while a slow (not late) look at their Prometheus is in flight join the next look,
  and never read "no answer within the look deadline".
"""

from __future__ import annotations

import json
import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from harness import stack
from tests.integration.conftest import Cluster
from tests.integration.e2e.helpers import PORT_OFFSET, get, moeis, operator_looks, wait, wait_cr
from tests.integration.fake_prometheus import FakePrometheusHandler, serve

from moeguard_operator.constants import FINALIZER

METRICS_PORT = 18085 + PORT_OFFSET
LIVENESS_PORT = 18086 + PORT_OFFSET
HUNG = 10
SPEC: dict[str, Any] = {
    "model": {"preset": "tiny"}, "replicas": 1,
    "resources": {"softLimit": "3Gi", "hardLimit": "4Gi"},
    "control": {"queryIntervalSeconds": 2, "windowSeconds": 10},
}


class Trickle:
    """``http://127.0.0.1:PORT/``: headers, then one byte every 4 s, until the client hangs up (the operator's
    query deadline); ``in_flight`` counts the queries being trickled, up to the moment each client hangs up,
    ``started`` every query it began."""

    def __init__(self) -> None:
        stopping = self.stopping = threading.Event()
        lock, self.in_flight, self.started = threading.Lock(), 0, 0
        outer = self

        class Handler(FakePrometheusHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "100000")
                self.end_headers()
                with lock:
                    outer.in_flight += 1
                    outer.started += 1
                try:
                    last = time.monotonic()
                    while not stopping.is_set():
                        # The request's body is read (do_POST): readable now means the client hung up.
                        readable, _, _ = select.select([self.connection], [], [], 0.05)
                        if readable and not self.connection.recv(1, socket.MSG_PEEK):
                            break
                        if time.monotonic() - last >= 4.0:
                            self.wfile.write(b" ")
                            self.wfile.flush()
                            last = time.monotonic()
                except OSError:
                    pass
                finally:
                    with lock:
                        outer.in_flight -= 1

        self.server = serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def trickle() -> Iterator[Trickle]:
    t = Trickle()
    yield t
    t.close()


def started(exit_code: int | None, port: int) -> bool:
    """The operator runs and answers on its liveness port (its startup handlers have run)."""
    assert exit_code is None, f"the operator exited with {exit_code}"
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def looks(namespace: str, name: str) -> float:
    """Looks at Prometheus the operator made for a service (its own metrics), or 0."""
    return operator_looks(namespace, name, port=METRICS_PORT)


def test_hung_prometheus_stalls_no_other_service_and_no_deletion(
        cluster: Cluster, namespace: str, trickle: Trickle, no_pod_workers: None) -> None:
    ns = namespace
    stack.apply_crds(run_dir=cluster.run_dir)
    # A resource from an earlier version, with the finalizer its timer needed, before the operator starts.
    legacy = moeis("legacy", **(SPEC | {"replicas": 0}))
    legacy = legacy.replace('"metadata": {"name": "legacy"}', f'"metadata": {{"name": "legacy", "finalizers": ["{FINALIZER}"]}}')
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=legacy)
    log = cluster.run_dir / "logs" / "operator-loop-isolation.log"
    proc = stack.start_operator(log, run_dir=cluster.run_dir, args=(
        "-n", ns, "--standalone", "--metrics-port", str(METRICS_PORT),
        "--liveness", f"http://127.0.0.1:{LIVENESS_PORT}/healthz", "--allowed-prometheus-url", trickle.url,
        "--look-deadline-seconds", "6"))
    try:
        wait(lambda: started(proc.poll(), LIVENESS_PORT), 120, "the operator's liveness endpoint")
        # kopf removes the finalizer no handler needs any more.
        wait_cr(cluster, ns, "legacy", lambda o: FINALIZER not in (o["metadata"].get("finalizers") or []), 30,
                "the old finalizer removed")

        hung = [f"hung-{i}" for i in range(HUNG)]
        for name in hung:  # one CPU pod each (kwok makes it Ready; no worker): replicas 0 would never be looked at
            cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis(name, **(SPEC | {
                "replicas": 1, "resources": SPEC["resources"] | {"gpus": 0},
                "control": SPEC["control"] | {"prometheusUrl": trickle.url}})))
        for name in hung:
            wait_cr(cluster, ns, name, lambda o: "PrometheusTimeout" in ((stack.condition(o, "MetricsAvailable") or {})
                                                                          .get("message") or ""),
                    60, f"{name}: a look past its deadline reported")

        # While every hung look is in flight, a new service is reconciled and looked at as if alone.
        created = time.monotonic()
        cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis("healthy", **SPEC))
        wait(lambda: cluster.kubectl("-n", ns, "get", "deployment", "healthy-worker", check=False).returncode == 0,
             20, "the healthy service's Deployment")
        deployed = time.monotonic() - created
        wait_cr(cluster, ns, "healthy", lambda o: (stack.condition(o, "Ready") or {}).get("status") == "True",
                30, "healthy Ready=True")
        wait(lambda: looks(ns, "healthy") or None, 20, "a first look at the healthy service")
        # Its looks end while hung looks are in flight (each hangs until the 5 s query deadline, and the next
        # starts at once): not a count against the clock, which a loaded host (and its loaded Prometheus)
        # stretches, but looks a loop serialised behind the hung ones could not finish. A look counts when
        # one hung look spanned the whole gap between the samples that saw it end: queries in flight at both
        # ends, none begun between. (With the look pool cut to one thread the healthy looks end between
        # hung ones: this part failed, 0 of 2.)
        def hung() -> tuple[int, int]:
            return trickle.in_flight, trickle.started

        during, count, before = 0, looks(ns, "healthy"), hung()
        end = time.monotonic() + 20  # ten query intervals; it stops at the second
        while time.monotonic() < end and during < 2:
            time.sleep(0.2)
            now_count, after = looks(ns, "healthy"), hung()
            if now_count > count and before[0] and after[0] and before[1] == after[1]:
                during += 1
            count, before = now_count, after
        assert during >= 2, f"{during} of the healthy service's looks ended while a hung look was in flight, in 20 s"
        assert deployed < 10, f"the healthy service's Deployment took {deployed:.1f} s"

        # Deleting a hung service completes at once: no finalizer waits for its look.
        start = time.monotonic()
        cluster.kubectl("-n", ns, "delete", "moeis", "hung-0", "--wait=true", "--timeout=20s", timeout=30)
        assert time.monotonic() - start < 5

        # Idle: nothing changes, so nothing is written (no look time, no heartbeat in status).
        before = get(cluster, ns, "healthy")
        time.sleep(6)
        after = get(cluster, ns, "healthy")
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], (
            f"status rewritten while idle:\nbefore {json.dumps(before.get('status'), sort_keys=True)}\n"
            f"after  {json.dumps(after.get('status'), sort_keys=True)}")
        text = log.read_text()
        assert not re.search(r"Traceback", text), text[-3000:]
    finally:
        stack.stop_process(proc)
        # A failed run must not leave the old finalizer behind (nothing would remove it).
        cluster.kubectl("-n", ns, "patch", "moeis", "legacy", "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                        check=False)


class SlowPrometheus:
    """``http://127.0.0.1:PORT/``: every query answered after ``delay`` seconds, with no series (well within
    the look deadline); ``in_flight`` counts the queries being answered."""

    def __init__(self, delay: float) -> None:
        lock, self.in_flight = threading.Lock(), 0
        outer = self

        class Handler(FakePrometheusHandler):
            def do_GET(self) -> None:
                with lock:
                    outer.in_flight += 1
                try:
                    time.sleep(delay)
                    body = b'{"status":"success","data":{"resultType":"vector","result":[]}}'
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                finally:
                    with lock:
                        outer.in_flight -= 1

        self.server = serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_service_due_while_a_look_is_in_flight_joins_the_next_look(
        cluster: Cluster, namespace: str, no_pod_workers: None) -> None:
    """Services created while a slow (2.5 s, deadline 6 s) look at their Prometheus is in flight are looked at
    when it ends: none ever reads "no answer within the look deadline" (they did before, at once: at 1,000
    services that message flipped with the looked-at one, thousands of idle status writes)."""
    ns, slow = namespace, SlowPrometheus(2.5)
    stack.apply_crds(run_dir=cluster.run_dir)
    spec = SPEC | {"replicas": 1, "resources": SPEC["resources"] | {"gpus": 0},  # looked at: not scaled to zero
                   "control": SPEC["control"] | {"prometheusUrl": slow.url}}
    log = cluster.run_dir / "logs" / "operator-loop-in-flight.log"
    proc = stack.start_operator(log, run_dir=cluster.run_dir, args=(
        "-n", ns, "--standalone", "--metrics-port", str(METRICS_PORT),
        "--liveness", f"http://127.0.0.1:{LIVENESS_PORT}/healthz", "--allowed-prometheus-url", slow.url,
        "--look-deadline-seconds", "6"))
    names = ["first", *(f"late-{i}" for i in range(4))]
    seen: dict[str, set[str]] = {name: set() for name in names}

    def messages() -> None:
        for obj in cluster.kubectl_json("-n", ns, "get", "moeis")["items"]:
            message = (stack.condition(obj, "MetricsAvailable") or {}).get("message")
            if message:
                seen[obj["metadata"]["name"]].add(message)

    try:
        wait(lambda: started(proc.poll(), LIVENESS_PORT), 120, "the operator's liveness endpoint")
        cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis("first", **spec))
        for name in names[1:]:
            wait(lambda: slow.in_flight > 0, 30, "a look in flight")
            cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis(name, **spec))
            messages()
        deadline = time.monotonic() + 30
        while not all(seen.values()) and time.monotonic() < deadline:
            messages()
            time.sleep(0.3)
        assert all(seen.values()), f"services never looked at in 30 s: {[n for n, m in seen.items() if not m]}"
        deadline = time.monotonic() + 10  # and a few more looks of each
        while time.monotonic() < deadline:
            messages()
            time.sleep(0.3)
        # The claim is the look deadline's message (what a service that joined a look in flight read at
        # once); a query past its own 5 s deadline on a loaded host (CI saw one at 2.5 s + load) is the
        # deadline working, and names its queries instead.
        late = {name: sorted(m) for name, m in seen.items() if any("no answer within the look deadline" in x for x in m)}
        assert not late, f"reported past the look deadline though every answer took 2.5 s: {late}"
        assert all(any("no series matched" in m for m in ms) for ms in seen.values()), seen
        # and nothing else: every other message is a late query naming itself, never the whole look blind
        other = {m for ms in seen.values() for m in ms if "no series matched" not in m}
        assert all(re.search(r": PrometheusTimeout \((?:[a-z0-9_]+(?:, )?)+\); budgets held", m) for m in other), other
    finally:
        stack.stop_process(proc)
        slow.close()
