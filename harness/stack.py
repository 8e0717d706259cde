"""The local stack, driven from Python: shared by ``hack/demo.py`` and the end-to-end tests.

Test and demo tooling, not product. It wraps the project's own scripts
(``hack/cluster-up.sh``, ``hack/pod_workers.py``), the pinned kubectl, the
operator process (``python -m moeguard_operator``), and reads of the CR, the
workers' ``/metrics`` and Prometheus. Everything talks to 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from harness import kube_get, worker_process
from harness.metrics_text import samples_named
from moeguard_operator.loop.conditions import get_condition

ROOT = Path(__file__).resolve().parent.parent
RUN_DIR = Path(os.environ.get("MOEGUARD_RUN_DIR", "/tmp/moeguard-run"))
PROMETHEUS_URL = f"http://127.0.0.1:{19090 + int(os.environ.get('MOEGUARD_PORT_OFFSET', '0'))}"
"""Prometheus of the local stack (hack/cluster-up.sh; ports shift by MOEGUARD_PORT_OFFSET)."""
CRD_NAME = "moeinferenceservices.moeguard.dev"
T = TypeVar("T")


def _versions() -> dict[str, str]:
    out = {}
    for line in (ROOT / "hack" / "versions.env").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def bin_dir(component: str) -> Path:
    """The cache folder of a pinned component (``kubernetes``, ``helm``, ``etcd``, ``kwok``, ``lws``), as
    ``bin_dir`` in hack/lib.sh."""
    version = _versions()[f"{component.upper()}_VERSION"]
    cache = Path(os.environ.get("MOEGUARD_CACHE", Path.home() / ".cache" / "moeguard")) / "bin"
    return cache / f"{component}-{version}"


def tools_env(run_dir: Path = RUN_DIR) -> dict[str, str]:
    """Environment with the pinned binaries first on PATH and the cluster's kubeconfig."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(bin_dir("kubernetes")), str(bin_dir("helm")), env.get("PATH", "")])
    env["KUBECONFIG"] = str(run_dir / "kubeconfig")
    env["MOEGUARD_RUN_DIR"] = str(run_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "operator"), str(ROOT / "runtime"), str(ROOT / "core"), str(ROOT)])
    return env


class ToolError(RuntimeError):
    """A pinned tool (kubectl, helm) failed; the message names the command, its exit status and
    the end of its stderr."""


def run_tool(tool: str, *args: str, check: bool = True, stdin: str | None = None, timeout: float = 120,
             run_dir: Path = RUN_DIR) -> subprocess.CompletedProcess[str]:
    """Run the pinned ``tool`` against the local cluster of ``run_dir``; returns the completed process.

    Raises:
        ToolError: when ``check`` and the tool fails.
    """
    proc = subprocess.run([tool, *args], env=tools_env(run_dir), input=stdin, text=True,
                          capture_output=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ToolError(f"{tool} {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-3000:]}")
    return proc


def kubectl(*args: str, check: bool = True, stdin: str | None = None, timeout: float = 120,
            run_dir: Path = RUN_DIR) -> subprocess.CompletedProcess[str]:
    """The pinned kubectl against the local cluster (:func:`run_tool`)."""
    return run_tool("kubectl", *args, check=check, stdin=stdin, timeout=timeout, run_dir=run_dir)


def kubectl_json(*args: str, run_dir: Path = RUN_DIR) -> Any:
    """``kubectl ARGS -o json``, parsed. The plain reads (``[-n NS] get RESOURCE [NAME] [-l ...]``) are answered
    by a kept-alive API client with kubectl's output shape, the rest by kubectl (:mod:`harness.kube_get`: a
    kubectl process costs ~0.09 s of CPU, and the tests poll).

    Raises:
        ToolError: kubectl failed, or the API server refused or did not answer the read.
    """
    get = kube_get.parse(args)
    if get is None:
        return json.loads(kubectl(*args, "-o", "json", run_dir=run_dir).stdout)
    try:
        return kube_get.get_json(get, run_dir / "kubeconfig")
    except (kube_get.KubeGetError, OSError) as exc:
        raise ToolError(f"kubectl {' '.join(args)} -o json failed (1): {exc}") from None


def wait_for(probe: Callable[[], T | None], timeout: float, what: str, interval: float = 0.5) -> T:
    """Call ``probe`` until it returns a truthy value; that value is returned.

    Raises:
        TimeoutError: naming ``what`` and the last value seen.
    """
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def script(name: str, *args: str, run_dir: Path = RUN_DIR) -> None:
    """Run ``hack/<name>`` (e.g. ``cluster-up.sh``) with the stack's environment.

    Raises:
        subprocess.CalledProcessError: the script failed (its output went to the terminal).
    """
    subprocess.run([str(ROOT / "hack" / name), *args], env=tools_env(run_dir), check=True, timeout=900)


def apply_crds(run_dir: Path = RUN_DIR) -> None:
    """Server-side apply ``crds/`` and wait until the CRD is Established."""
    kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=moeguard-install", "-f", str(ROOT / "crds"), run_dir=run_dir)
    wait_established(CRD_NAME, run_dir=run_dir)


def wait_established(crd: str, timeout: float = 60, run_dir: Path = RUN_DIR) -> None:
    """Poll until CustomResourceDefinition ``crd`` is Established (served).

    ``kubectl wait --for=condition=Established`` fails at once, instead of waiting, while a new
    CRD has no ``status.conditions`` yet (".status.conditions accessor error: <nil>"), which
    happened right after the cluster came up.

    Raises:
        TimeoutError: not Established within ``timeout`` seconds.
    """
    jsonpath = '{.status.conditions[?(@.type=="Established")].status}'

    def established() -> bool:
        res = kubectl("get", f"crd/{crd}", "-o", f"jsonpath={jsonpath}", check=False, run_dir=run_dir)
        return res.returncode == 0 and res.stdout.strip() == "True"

    wait_for(established, timeout, f"CRD {crd} Established")


def start_operator(log_path: Path, run_dir: Path = RUN_DIR, extra_env: dict[str, str] | None = None,
                   args: tuple[str, ...] = ("-A", "--standalone")) -> subprocess.Popen[bytes]:
    """Start ``python -m moeguard_operator`` against the local cluster, logging to ``log_path``."""
    env = tools_env(run_dir) | (extra_env or {})
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "moeguard_operator", "--timer-interval-seconds", "2", *args, "--prometheus-url", PROMETHEUS_URL],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds."""
    worker_process.stop_process(proc, timeout)


def pod_workers(action: str, run_dir: Path = RUN_DIR) -> None:
    """``hack/pod_workers.py start|stop`` (the harness that backs kwok pods with local workers)."""
    subprocess.run([sys.executable, str(ROOT / "hack" / "pod_workers.py"), action], env=tools_env(run_dir),
                   check=True, timeout=120)


def get_moeis(namespace: str, name: str, run_dir: Path = RUN_DIR) -> dict[str, Any]:
    """The MoEInferenceService as JSON."""
    return dict(kubectl_json("get", "moeis", name, "-n", namespace, run_dir=run_dir))


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    """The condition ``type_`` of a MoEInferenceService object, or None."""
    return get_condition(obj.get("status", {}).get("conditions"), type_)


def worker_urls(namespace: str, moeis: str, run_dir: Path = RUN_DIR) -> list[str]:
    """Base URLs of the local workers behind ``moeis``'s pods, from the harness's state file."""
    path = run_dir / "workers.json"
    if not path.exists():
        return []
    state = json.loads(path.read_text())
    return sorted(w["url"] for key, w in state.items()
                  if key.startswith(f"{namespace}/") and w.get("moeis") == moeis)


def healthy(url: str) -> bool:
    """The worker is ready to serve (``/readyz`` is 200: model loaded, below the hard limit)."""
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def scrape(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Samples of metric family ``name`` (exact sample name) on a worker's ``/metrics``."""
    return samples_named(httpx.get(f"{url}/metrics", timeout=5).text, name)


def scrape_one(url: str, name: str) -> float | None:
    """The first sample of ``name`` on a worker, or None."""
    try:
        samples = scrape(url, name)
    except httpx.HTTPError:
        return None
    return samples[0][1] if samples else None


def prom_results(query: str, url: str = PROMETHEUS_URL) -> list[dict[str, Any]]:
    """The result vector of a Prometheus instant query.

    Raises:
        httpx.HTTPError: Prometheus is unreachable or refused the query.
    """
    r = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=5)
    r.raise_for_status()
    return list(r.json()["data"]["result"])


def prom_query(query: str, url: str = PROMETHEUS_URL) -> float | None:
    """One number from a Prometheus instant query, or None (no series, or unreachable)."""
    try:
        result = prom_results(query, url)
        return float(result[0]["value"][1]) if result else None
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


def events(namespace: str, name: str, run_dir: Path = RUN_DIR) -> list[dict[str, Any]]:
    """Events whose involved object is ``name`` in ``namespace``, oldest first."""
    items: list[dict[str, Any]] = kubectl_json("get", "events", "-n", namespace, "--field-selector",
                                               f"involvedObject.name={name}", run_dir=run_dir)["items"]
    return sorted(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
