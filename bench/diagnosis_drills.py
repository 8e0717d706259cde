"""Incident drills for the diagnosis (issue 14): one per finding kind, injected into a running service with
traffic, on the local control plane (the operator, the kwok pod harness and Prometheus, as in
:mod:`bench.control_latency`).

Every drill runs the same way (:func:`run_drill`):

1. a fresh namespace and one MoEInferenceService of :data:`BASE_SPEC` (the ``tiny`` preset widened to
   D 256 and a 4,096-token context, see :data:`MODEL_OVERRIDES`), with the drill's test-fault env where
   it needs one; background traffic of real-text prompts (:data:`BACKGROUND_RPS`);
2. a warm-up long enough for every windowed signal to have a full window (:func:`warmup_seconds`);
3. sizing: ``control.rssSoftFraction`` is set just above the worker's measured steady memory
   (:data:`SOFT_MARGIN_BYTES`), as a service sized tightly for its model would be; a control field, so the
   pods do not roll. Without it a 2 GiB ``hardLimit`` on a ~0.9 GiB worker never shows a memory symptom;
4. the injection, whose time is the **onset**; then the CR's ``status.diagnosis`` is polled every
   :data:`POLL_S` until the right finding appears or :data:`DEADLINE_S` passes, and for
   :data:`GRACE_S` more; every finding kind seen from the start of the drill (warm-up included) and every
   finding Event is recorded: any kind but the drill's is a **wrong finding**.

The injections:

* ``BurstOverlap``: :data:`BURST_REQUESTS` concurrent real-text prompts of :data:`BURST_PROMPT_TOKENS`
  (below the long-request threshold), with up to 4 batches in flight allowed (``maxConcurrentBatches``).
* ``LongContextPileUp``: :data:`LONG_REQUESTS` concurrent prompts of :data:`LONG_PROMPT_TOKENS`
  (near the 4,096-token context; the threshold is 1,536).
* ``RoutingSkew``: the background traffic switches to repetitive prompts (one or two letters,
  :func:`harness.loadgen.repetitive_prompt`, seed :data:`SKEW_SEED`: 1,024 on this model against a threshold
  of 128; real text measures 2-48).
* ``NativeMemoryLeak`` / ``PythonHeapLeak``: the worker's leak faults (``MOEGUARD_TEST_FAULTS=1``), armed
  from the start, leaking only while a lock file exists (``MOEGUARD_FAULT_LEAK_LOCK_FILE``): the drill
  creates the file. Anonymous memory at :data:`NATIVE_LEAK_BPS`, Python objects at :data:`PYTHON_LEAK_BPS`.
* ``UCXRiskyConfig``: the worker loads Debian's real ``libucs.so.0`` (package ``libucx0``) from the start
  (the test fault ``MOEGUARD_FAULT_LOAD_LIBRARY``, as NIXL or a UCX-enabled build would): with moeguard's
  default UCX settings (``UCX_MEM_MMAP_HOOK_MODE=none``, a bounded rcache) that is no finding. The injection
  is the spec change a user makes to get UCX's own defaults back, ``ucx.mode: passthrough`` (mmap hooks on,
  rcache bound unset); the pods roll, so the time to the finding includes the new pod's start.

``AllocatorFragmentation`` has no drill: it needs a GPU's caching allocator (none here).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness import control_plane as cp
from harness import stack
from harness.loadgen import prompt_of_length
from harness.loadgen.client import burst
from harness.loadgen.stats import summarize

from bench.steady_traffic import SteadyTraffic
from moeguard_operator.loop.observation import LEAK_WARMUP_SECONDS

MODEL_OVERRIDES = {"dim": 256, "nHead": 4, "nKvHead": 4, "maxSeqLen": 4096}
"""The ``tiny`` preset (2 layers, 8 experts, top-2) widened so that a burst moves memory by ~140 MiB (the
preset's D 64 moves it by ~35 MiB, within the noise of a worker under traffic) and long prompts fit."""
HARD_LIMIT_BYTES = 2 << 30
BASE_SPEC: dict[str, Any] = {
    "model": {"preset": "tiny", "overrides": MODEL_OVERRIDES},
    "replicas": 1,
    "resources": {"gpus": 0, "cpu": "1", "softLimit": "1792Mi", "hardLimit": "2Gi"},
    "batching": {"maxPrefillTokens": 2048, "maxDecodeTokens": 64, "maxBatchRequests": 8, "maxConcurrentBatches": 4,
                 "longRequestThresholdTokens": 1536, "maxLongRequestsPerBatch": 2},
    "control": {"queryIntervalSeconds": 5, "windowSeconds": 15, "leakWindowSeconds": 60, "skewThreshold": 128,
                "cooldownSeconds": 10, "stabilizationWindowSeconds": 60},
}
"""One replica on the CPU. ``skewThreshold`` 128: real text on this random-weight router reaches window maxima
of 48 under the shared trace (the first full run, ``bench/results/diagnosis_run1.md``; 6-10 on the plain
``tiny`` preset, :mod:`bench.control_latency`), repetitive prompts 1,024. ``leakWindowSeconds`` 60: a leak is
found within two minutes of its onset (the default 600 s would take ten), and a leak of 2 MB/s adds more than
the 64 MiB a leak must add over its window (``moeguard_operator.diagnosis.diagnosis.LEAK_MIN_WINDOW_GROWTH_BYTES``)."""
SOFT_MARGIN_BYTES = 48 << 20
"""``rssSoftFraction`` is set to (steady memory + this) / hardLimit: a burst or a pile-up crosses it, the
background traffic does not."""
BACKGROUND_RPS = 1.0
BACKGROUND_PROMPT_TOKENS = 256
BURST_REQUESTS = 24
BURST_PROMPT_TOKENS = 900
LONG_REQUESTS = 6
LONG_PROMPT_TOKENS = 3500
SKEW_RPS = 2.0
SKEW_PROMPT_TOKENS = 600
SKEW_SEED = 1
NATIVE_LEAK_BPS = 2_000_000
PYTHON_LEAK_BPS = 2_000_000
DEADLINE_S = 120.0
"""The issue's bound: the right finding within 2 minutes of the onset."""
GRACE_S = 20.0
POLL_S = 1.0
KINDS = ("BurstOverlap", "RoutingSkew", "LongContextPileUp", "NativeMemoryLeak", "PythonHeapLeak", "UCXRiskyConfig")
"""The drilled kinds (every finding kind but AllocatorFragmentation)."""
FINDING_KINDS = (*KINDS, "AllocatorFragmentation")


def ucx_library() -> Path | None:
    """Debian's ``libucs.so.0`` (package ``libucx0``), or None when it is not installed."""
    for candidate in (Path("/usr/lib/x86_64-linux-gnu/libucs.so.0"), Path("/usr/lib/aarch64-linux-gnu/libucs.so.0"),
                      Path("/usr/lib/libucs.so.0")):
        if candidate.exists():
            return candidate
    return None


def warmup_seconds(spec: dict[str, Any], leak_warmup_s: float = LEAK_WARMUP_SECONDS) -> float:
    """Seconds of traffic before the onset: every pod's series must span the look window, and its leak window
    must start after the worker's warm-up (``leak_warmup_s``, the operator's ``--leak-warmup-seconds``, by
    default :data:`moeguard_operator.loop.observation.LEAK_WARMUP_SECONDS`: a younger worker's growth is never
    a leak), plus two looks."""
    c = spec["control"]
    return float(max(leak_warmup_s + c["leakWindowSeconds"], c["windowSeconds"]) + 2 * c["queryIntervalSeconds"])


def active_kinds(obj: dict[str, Any]) -> list[str]:
    """The kinds of the findings in a MoEInferenceService's ``status.diagnosis``."""
    findings = ((obj.get("status") or {}).get("diagnosis") or {}).get("findings") or []
    return sorted({str(f.get("kind")) for f in findings})


def status_summary(obj: dict[str, Any]) -> dict[str, Any]:
    """The parts of a MoEInferenceService's status that say why a finding is (not) there: the diagnosis's missing
    signals, MetricsAvailable, the observed values and the budgets in effect."""
    status = obj.get("status") or {}
    metrics = stack.condition(obj, "MetricsAvailable") or {}
    return {"missingSignals": (status.get("diagnosis") or {}).get("missingSignals"),
            "MetricsAvailable": {k: metrics.get(k) for k in ("status", "reason", "message")},
            "observed": status.get("observed"), "budgets": status.get("budgets")}


def finding_of(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    findings = ((obj.get("status") or {}).get("diagnosis") or {}).get("findings") or []
    return next((f for f in findings if f.get("kind") == kind), None)


@dataclass
class DrillResult:
    """One drill. Times in Unix seconds; ``seconds_to_finding`` None: not within the deadline."""

    kind: str
    namespace: str
    onset: float = 0.0
    seconds_to_finding: float | None = None
    wrong: list[str] = field(default_factory=list)
    """Finding kinds other than the drill's seen at any time (status or Events)."""
    seen: list[tuple[float, list[str]]] = field(default_factory=list)
    """Every change of the active kinds: (seconds from the onset, kinds)."""
    finding: dict[str, Any] | None = None
    """The right finding as status held it when it first appeared."""
    rss_soft_fraction: float | None = None
    traffic: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    last_status: dict[str, Any] = field(default_factory=dict)
    """What the service's status said at the end (:func:`status_summary`): why a finding did not appear."""

    @property
    def passed(self) -> bool:
        return self.error is None and self.seconds_to_finding is not None and not self.wrong

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


class Watch(threading.Thread):
    """Polls the CR every :data:`POLL_S` and records the active finding kinds."""

    def __init__(self, namespace: str, name: str) -> None:
        super().__init__(daemon=True)
        self.namespace, self.name = namespace, name
        self.changes: list[tuple[float, list[str]]] = []
        self.first: dict[str, tuple[float, dict[str, Any]]] = {}
        self.last: dict[str, Any] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        last: list[str] | None = None
        while not self._halt.is_set():
            try:
                obj = stack.get_moeis(self.namespace, self.name)
            except (subprocess.SubprocessError, ValueError):
                obj = None
            if obj is not None:
                self.last = status_summary(obj)
                now, kinds = time.time(), active_kinds(obj)
                if kinds != last:
                    self.changes.append((now, kinds))
                    last = kinds
                for kind in kinds:
                    if kind not in self.first:
                        self.first[kind] = (now, finding_of(obj, kind) or {})
            self._halt.wait(POLL_S)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def memory_usage(url: str) -> float | None:
    """The worker's ``moeguard_memory_usage_bytes`` (the figure the limits compare), bytes."""
    return cp.metric_values(url, ("moeguard_memory_usage_bytes",)).get("moeguard_memory_usage_bytes")


def size_tightly(namespace: str, name: str, url: str, samples: int = 5) -> float:
    """Set ``control.rssSoftFraction`` just above the worker's steady memory (:data:`SOFT_MARGIN_BYTES`);
    returns the fraction.

    Raises:
        RuntimeError: the worker does not report its memory.
    """
    readings = []
    for _ in range(samples):
        value = memory_usage(url)
        if value is not None:
            readings.append(value)
        time.sleep(0.5)
    if not readings:
        raise RuntimeError(f"{namespace}/{name}: the worker at {url} reports no moeguard_memory_usage_bytes")
    soft = round((max(readings) + SOFT_MARGIN_BYTES) / HARD_LIMIT_BYTES, 3)
    hard = round(min(0.99, soft + 0.2), 3)
    stack.kubectl("-n", namespace, "patch", "moeis", name, "--type", "merge", "-p",
                  json.dumps({"spec": {"control": {"rssSoftFraction": soft, "rssHardFraction": hard}}}))
    return soft


def fire(url: str, prompts: list[str], max_tokens: int = 8) -> Callable[[], dict[str, int]]:
    """Send ``prompts`` at once (:func:`harness.loadgen.burst`, in a thread); returns a function that waits for the
    answers and counts them by status (:func:`harness.loadgen.stats.status_key`)."""
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(lambda: asyncio.run(burst(url, prompts, max_tokens=max_tokens, progress=False,
                                                   request_timeout_s=300.0)))

    def done() -> dict[str, int]:
        run = future.result()
        pool.shutdown()
        return summarize(run).by_status

    return done


def drill_env(kind: str, lock_file: Path) -> dict[str, str] | None:
    """The test-fault env a drill's workers start with (armed, not leaking: the lock file does not exist)."""
    if kind == "NativeMemoryLeak":
        return {"MOEGUARD_TEST_FAULTS": "1", "MOEGUARD_FAULT_LEAK_ANON_BYTES_PER_SECOND": str(NATIVE_LEAK_BPS),
                "MOEGUARD_FAULT_LEAK_LOCK_FILE": str(lock_file)}
    if kind == "PythonHeapLeak":
        return {"MOEGUARD_TEST_FAULTS": "1", "MOEGUARD_FAULT_LEAK_PYTHON_BYTES_PER_SECOND": str(PYTHON_LEAK_BPS),
                "MOEGUARD_FAULT_LEAK_LOCK_FILE": str(lock_file)}
    if kind == "UCXRiskyConfig":
        library = ucx_library()
        if library is None:
            raise RuntimeError("libucx0 is not installed (hack/install-deps.sh installs it): no UCX library to load")
        return {"MOEGUARD_TEST_FAULTS": "1", "MOEGUARD_FAULT_LOAD_LIBRARY": str(library)}
    return None


def finding_events(namespace: str, name: str) -> list[tuple[str, str]]:
    """(reason, message) of the Warning Events whose reason is a finding kind."""
    return [(str(e.get("reason")), str(e.get("message"))) for e in stack.events(namespace, name)
            if e.get("type") == "Warning" and e.get("reason") in FINDING_KINDS]


def run_drill(kind: str, namespace: str, *, name: str = "drill", deadline_s: float = DEADLINE_S,
              grace_s: float = GRACE_S, log: Callable[[str], None] = print, scratch: Path = Path("/tmp"),
              leak_warmup_s: float = LEAK_WARMUP_SECONDS) -> DrillResult:
    """One drill of ``kind`` in a fresh ``namespace`` (created and deleted here); see the module docstring.
    ``leak_warmup_s`` must be the operator's ``--leak-warmup-seconds`` (:func:`warmup_seconds`).

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in KINDS:
        raise ValueError(f"no drill for {kind!r}; drills: {', '.join(KINDS)}")
    result = DrillResult(kind, namespace)
    lock_file = scratch / f"moeguard-drill-{namespace}.lock"
    lock_file.unlink(missing_ok=True)
    cp.create_namespace(namespace)
    traffic: SteadyTraffic | None = None
    watch: Watch | None = None
    try:
        urls = cp.start_service(namespace, name, BASE_SPEC, env=drill_env(kind, lock_file))
        (url,) = urls.values()
        log(f"{namespace}: {kind}: worker ready at {url}")
        watch = Watch(namespace, name)
        watch.start()
        traffic = SteadyTraffic(lambda: list(cp.workers(namespace, name).values()), BACKGROUND_RPS,
                                prompt_tokens=BACKGROUND_PROMPT_TOKENS, skew_seed=SKEW_SEED)
        traffic.start()
        time.sleep(warmup_seconds(BASE_SPEC, leak_warmup_s))
        result.rss_soft_fraction = size_tightly(namespace, name, url)
        time.sleep(2 * BASE_SPEC["control"]["queryIntervalSeconds"])
        answers = inject(kind, namespace, name, url, traffic, lock_file)
        result.onset = time.time()
        log(f"{namespace}: {kind}: injected (rssSoftFraction {result.rss_soft_fraction})")
        end = result.onset + deadline_s
        while time.time() < end and kind not in watch.first:
            time.sleep(POLL_S)
        if kind in watch.first:
            t, finding = watch.first[kind]
            result.seconds_to_finding = round(t - result.onset, 1)
            result.finding = finding
            log(f"{namespace}: {kind}: found after {result.seconds_to_finding} s: {finding.get('message')}")
        else:
            log(f"{namespace}: {kind}: NOT found within {deadline_s:.0f} s")
        time.sleep(grace_s)
        if answers is not None:
            result.traffic = answers()
    except Exception as exc:  # a drill that breaks is reported, the others go on
        result.error = f"{type(exc).__name__}: {exc}"
        log(f"{namespace}: {kind}: error: {result.error}")
    finally:
        lock_file.unlink(missing_ok=True)
        if traffic is not None:
            traffic.stop()
            for status, n in traffic.statuses.items():
                result.traffic[f"background {status}"] = n
        if watch is not None:
            watch.stop()
            result.last_status = watch.last
            result.seen = [(round(t - result.onset, 1) if result.onset else round(t, 1), k) for t, k in watch.changes]
            kinds = {k for _, ks in watch.changes for k in ks}
            with contextlib.suppress(subprocess.SubprocessError, ValueError):
                kinds |= {reason for reason, _ in finding_events(namespace, name)}
            result.wrong = sorted(kinds - {kind})
        cp.stop_service(namespace, name)
        cp.delete_namespace(namespace, wait=False)
    return result


def inject(kind: str, namespace: str, name: str, url: str, traffic: SteadyTraffic,
           lock_file: Path) -> Callable[[], dict[str, int]] | None:
    """Start ``kind``'s incident; returns the waiter of its own requests where it sends any."""
    if kind == "BurstOverlap":
        return fire(url, [prompt_of_length(BURST_PROMPT_TOKENS, offset=i * 7919) for i in range(BURST_REQUESTS)])
    if kind == "LongContextPileUp":
        return fire(url, [prompt_of_length(LONG_PROMPT_TOKENS, offset=i * 7919) for i in range(LONG_REQUESTS)])
    if kind == "RoutingSkew":
        traffic.prompt_tokens, traffic.rps, traffic.skewed = SKEW_PROMPT_TOKENS, SKEW_RPS, True
        return None
    if kind in ("NativeMemoryLeak", "PythonHeapLeak"):
        lock_file.write_text("")
        return None
    stack.kubectl("-n", namespace, "patch", "moeis", name, "--type", "merge", "-p",
                  json.dumps({"spec": {"ucx": {"mode": "passthrough"}}}))
    return None


def run_round(kinds: tuple[str, ...], prefix: str, **kwargs: Any) -> list[DrillResult]:
    """The drills of ``kinds`` at the same time, one namespace each (``<prefix>-<kind>``)."""
    with ThreadPoolExecutor(max_workers=len(kinds)) as pool:
        futures = [pool.submit(run_drill, kind, f"{prefix}-{kind.lower()}", **kwargs) for kind in kinds]
        return [f.result() for f in futures]
