#!/usr/bin/env python3
"""Test/demo harness, not product: one local worker process per Running moeguard worker pod.

kwok runs no containers. For each worker pod kwok marks Running, this starts
``python -m moeguard_runtime`` here with the env of the pod's first container (values,
downward API, resource limits), MOEGUARD_PORT = a free loopback port, and KUBECONFIG =
a token of the pod's ServiceAccount (TokenRequest, bound to the pod: real RBAC). Each
worker is a Prometheus file_sd target 127.0.0.1:<port>; <run dir>/workers.json maps
namespace/pod -> port, pid, url, moeis. Pod gone or not Running: worker stopped.

    hack/pod_workers.py run | start | stop   # foreground | background (<run dir>/pids/pod-workers.pid)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config, watch
from kubernetes.utils import parse_quantity

ROOT = Path(__file__).resolve().parent.parent
SELECTOR = "app.kubernetes.io/managed-by=moeguard,app.kubernetes.io/component=worker"  # stand-ins: own tests
quantity: Callable[[str], Decimal] = parse_quantity


def log(msg: str) -> None:
    print(f"[pod-workers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    (tmp := path.with_name(f".{path.name}.tmp")).write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)  # loopback, self-signed
        self.run_dir = Path(args.run_dir)
        self.admin_kubeconfig = str(self.run_dir / "kubeconfig")
        config.load_kube_config(self.admin_kubeconfig)  # type: ignore[no-untyped-call]
        self.api = client.CoreV1Api()
        self.namespace: str | None = args.namespace
        self.selector: str = args.selector
        self.cmd = shlex.split(args.worker_cmd.replace("{python}", shlex.quote(sys.executable)))
        self.state_file = self.run_dir / f"workers{args.sfx}.json"
        self.targets, self.workers_dir = self.run_dir / "prometheus" / "targets", self.run_dir / "workers"
        self.procs: dict[str, tuple[subprocess.Popen[bytes], dict[str, Any]]] = {}
        self.targets.mkdir(parents=True, exist_ok=True)
        self.workers_dir.mkdir(parents=True, exist_ok=True)

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

    def start_worker(self, pod: Any, key: str) -> None:
        with socket.socket() as s:  # a free loopback port
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        ns, name = pod.metadata.namespace, pod.metadata.name
        pythonpath = os.pathsep.join(filter(None, [str(ROOT / "runtime"), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, **self.resolve_env(pod), "MOEGUARD_PORT": str(port), "PYTHONPATH": pythonpath,
               "KUBECONFIG": self.pod_kubeconfig(pod, key)}
        with open(self.workers_dir / f"{ns}_{name}.log", "ab") as logf:
            proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        moeis = (pod.metadata.labels or {}).get("app.kubernetes.io/instance", "")
        self.procs[key] = (proc, {"port": port, "pid": proc.pid, "url": f"http://127.0.0.1:{port}",
                                  "moeis": moeis, "uid": pod.metadata.uid})
        target = [{"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": ns, "pod": name, "moeis": moeis}}]
        write_atomic(self.targets / f"{ns}_{name}.json", json.dumps(target))
        self.save()
        log(f"{key}: worker pid {proc.pid} on 127.0.0.1:{port}")

    def stop_worker(self, key: str, why: str) -> None:
        proc, _ = self.procs.pop(key)
        for f in (self.targets / f"{key.replace('/', '_')}.json",
                  self.workers_dir / f"{key.replace('/', '_')}.kubeconfig"):
            f.unlink(missing_ok=True)
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.save()  # after the process is reaped: the state file never lists a worker that is gone
        log(f"{key}: worker pid {proc.pid} stopped ({why}, exit {proc.returncode})")

    def save(self) -> None:
        write_atomic(self.state_file, json.dumps({k: i for k, (_, i) in sorted(self.procs.items())}, indent=1))

    def reconcile(self, pod: Any, deleted: bool = False) -> None:
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        gone = deleted or pod.metadata.deletion_timestamp is not None
        running = not gone and pod.status.phase == "Running"
        if key in self.procs and (not running or self.procs[key][1]["uid"] != pod.metadata.uid):
            self.stop_worker(key, "pod deleted" if gone else f"pod {pod.status.phase}")
        if running and key not in self.procs:
            try:
                self.start_worker(pod, key)
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
                for key in [k for k in self.procs if k not in seen]:
                    self.stop_worker(key, "pod gone")
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
        for key in list(self.procs):
            self.stop_worker(key, "harness stopping")
        self.state_file.unlink(missing_ok=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["run", "start", "stop"])
    p.add_argument("--run-dir", default=os.environ.get("MOEGUARD_RUN_DIR", "/tmp/moeguard-run"))
    p.add_argument("--namespace", "-n", default=None, help="watch one namespace (default: all)")
    p.add_argument("--selector", default=f"{SELECTOR},!harness.moeguard.dev/stand-in", help="label selector")
    p.add_argument("--worker-cmd", default="{python} -m moeguard_runtime", help="{python}: this interpreter")
    p.add_argument("--instance", default="default", help="names this harness's pid, state and log files")
    args = p.parse_args()
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
                *(["--namespace", args.namespace] if args.namespace else []),
                "--run-dir", f"{run_dir}/"]  # the "/" lets cluster-down.sh see it is the run dir's
        with open(log_file, "ab") as logf:
            child = subprocess.Popen([sys.executable, __file__, "run", *argv], stdout=logf,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while not pid_file.exists():
            if child.poll() is not None or time.monotonic() > deadline:
                log(f"did not start (exit {child.poll()}); see {log_file}")
                return 1
            time.sleep(0.1)
        log(f"started (pid {child.pid}, log {log_file})")
        return 0

    if alive:
        log(f"already running (pid {pid})")
        return 1
    args.sfx = sfx
    harness = Harness(args)
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
