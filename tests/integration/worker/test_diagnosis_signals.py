"""The diagnosis signals of issue 14 on a real worker: overlapping prefills, long requests, the KV cache
held, the predicted peak's breakdown, and UCX mapped into the process (Debian's real libucx0)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.worker.conftest import WorkerProcess
from tests.integration.worker.test_worker_http import metrics

from moeguard_core import contract
from moeguard_core.family_shape import from_model_args
from moeguard_core.memory_model import kv_bytes_per_token
from moeguard_core.memory_model_info import from_info_labels
from moeguard_core.presets import get_preset

pytestmark = pytest.mark.integration

LONG_THRESHOLD = 200
PROMPT = "a" * 400  # > LONG_THRESHOLD tokens with the byte-level tokenizer of the tiny preset
MAX_TOKENS = 8
REQUESTS = 4


def value(m: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return next(v for lab, v in m[name] if all(lab.get(k) == x for k, x in labels.items()))


def test_overlapping_prefills_long_requests_kv_and_the_peak_breakdown(
        start_worker: Callable[..., WorkerProcess]) -> None:
    w = start_worker(**{contract.ENV_MAX_CONCURRENT_BATCHES: "4", contract.ENV_MAX_BATCH_REQUESTS: "1",
                        contract.ENV_MAX_PREFILL_TOKENS: "64",
                        contract.ENV_LONG_REQUEST_THRESHOLD_TOKENS: str(LONG_THRESHOLD),
                        "MOEGUARD_TEST_FAULTS": "1", "MOEGUARD_FAULT_STEP_DELAY_SECONDS": "0.02"})
    answers: list[dict[str, Any]] = []

    def call() -> None:
        r = httpx.post(f"{w.base_url}/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        answers.append(r.json())

    threads = [threading.Thread(target=call) for _ in range(REQUESTS)]
    for t in threads:
        t.start()
    kv_seen: set[float] = set()
    batches_seen, long_seen = 0.0, 0.0
    while any(t.is_alive() for t in threads):
        m = metrics(w)
        kv_seen.add(value(m, "moeguard_kv_cache_bytes"))
        batches_seen = max(batches_seen, value(m, "moeguard_batches_in_flight"))
        long_seen = max(long_seen, value(m, "moeguard_long_requests_running"))
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert len(answers) == REQUESTS
    prompt_tokens = answers[0]["usage"]["prompt_tokens"]
    assert prompt_tokens >= LONG_THRESHOLD
    per_request = kv_bytes_per_token(get_preset("tiny"), 4) * (prompt_tokens + MAX_TOKENS)  # float32 caches
    # real tensor bytes of whole caches: while running, a whole number of requests' caches, at least one
    assert max(kv_seen) > 0 and all(v % per_request == 0 and v <= REQUESTS * per_request for v in kv_seen), kv_seen
    assert batches_seen >= 2 and long_seen >= 1

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = metrics(w)
        if value(m, "moeguard_kv_cache_bytes") == 0:
            break
        time.sleep(0.1)
    assert value(m, "moeguard_kv_cache_bytes") == 0
    assert value(m, "moeguard_batches_in_flight") == 0 and value(m, "moeguard_long_requests_running") == 0
    assert value(m, "moeguard_long_requests_admitted_total") == REQUESTS
    # overlapping prefills: some prefill step overlapped another batch's prefill (at most the 4 batches in flight)
    assert value(m, "moeguard_step_prefill_batches_bucket", le="1.0") < value(
        m, "moeguard_step_prefill_batches_count")
    assert value(m, "moeguard_step_prefill_batches_bucket", le="4.0") == value(
        m, "moeguard_step_prefill_batches_count")
    stages = {lab["stage"]: v for lab, v in m["moeguard_memory_peak_breakdown_bytes"]}
    assert set(stages) == set(contract.MEMORY_STAGES)
    assert stages["weights"] == value(m, "moeguard_model_weight_bytes") > 0
    assert per_request <= stages["kv_cache"] <= REQUESTS * per_request
    assert stages["attention"] > 0 and stages["expert_buffers"] > 0
    assert stages["dense_mlp"] == 0  # the tiny preset (Mixtral's shape) has no dense layer
    # the memory model the operator predicts this pod with (issue 30 §2): the tiny preset's shape, as served
    (model_labels, one), = m[contract.METRIC_MEMORY_MODEL_INFO]
    model = from_info_labels(model_labels)
    assert one == 1 and model.shape == from_model_args(get_preset("tiny")) and model.dtype == "float32", model
    shares = [v for _, v in m["moeguard_expert_top_share_ratio"]]
    assert len(shares) == 2 and all(1 / 8 <= s <= 1 / 2 for s in shares)
    logs = w.logs()
    assert "event=inference_batch_start" in logs and "long_requests=" in logs
    assert "event=moe_routing_stats" in logs and "top_share=" in logs


def test_a_queue_drained_between_scrapes_stays_in_the_step_histogram(
        start_worker: Callable[..., WorkerProcess]) -> None:
    """One batch of one request at a time: concurrent requests wait; once all are served the queue gauge reads 0
    again, and only ``moeguard_step_queue_requests`` still tells that requests waited (the BurstOverlap signal a
    2-s scrape missed in CI)."""
    w = start_worker(**{contract.ENV_MAX_CONCURRENT_BATCHES: "1", contract.ENV_MAX_BATCH_REQUESTS: "1",
                        "MOEGUARD_TEST_FAULTS": "1", "MOEGUARD_FAULT_STEP_DELAY_SECONDS": "0.02"})
    before = metrics(w)
    assert value(before, "moeguard_step_queue_requests_count") == 0

    def call() -> None:
        r = httpx.post(f"{w.base_url}/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": "hello world", "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m = metrics(w)
    steps = value(m, "moeguard_step_queue_requests_count")
    assert value(m, "moeguard_queue_requests") == 0
    assert steps >= 6  # one request at a time: at least its prefill step each
    # some step saw 3 or more waiting (6 arrived together, one served at a time), and never more than 5
    assert value(m, "moeguard_step_queue_requests_bucket", le="2.0") < steps
    assert value(m, "moeguard_step_queue_requests_bucket", le="8.0") == steps


UCX_DIR = Path("/usr/lib/x86_64-linux-gnu")


def ucx_labels(w: WorkerProcess) -> dict[str, str]:
    (labels,) = [lab for lab, v in metrics(w)["moeguard_ucx_info"] if v == 1]
    return {k: labels[k] for k in ("loaded", "libraries", "mmap_hook_mode", "rcache_max_unreleased")}


@pytest.mark.skipif(not (UCX_DIR / "libucs.so.0").exists(),
                    reason="Debian's libucx0 is not installed (hack/install-deps.sh installs it)")
def test_real_ucx_loaded_is_seen_with_its_settings(start_worker: Callable[..., WorkerProcess]) -> None:
    library = {"MOEGUARD_TEST_FAULTS": "1", "MOEGUARD_FAULT_LOAD_LIBRARY": str(UCX_DIR / "libucs.so.0")}
    plain = start_worker()
    hooked = start_worker(**library)
    safe = start_worker(**library, UCX_MEM_MMAP_HOOK_MODE="none", UCX_RCACHE_MAX_UNRELEASED="1024")
    r = httpx.post(f"{hooked.base_url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3,
                                                                "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert ucx_labels(plain) == {"loaded": "false", "libraries": "", "mmap_hook_mode": "default:bistro",
                                 "rcache_max_unreleased": "default:512M"}
    # the loader maps the symlinks' targets: libucs.so.0 -> libucs.so.0.0.0, and its dependency libucm
    libraries = "libucm.so.0.0.0,libucs.so.0.0.0"
    assert ucx_labels(hooked) == {"loaded": "true", "libraries": libraries, "mmap_hook_mode": "default:bistro",
                                  "rcache_max_unreleased": "default:512M"}
    assert ucx_labels(safe) == {"loaded": "true", "libraries": libraries, "mmap_hook_mode": "none",
                                "rcache_max_unreleased": "1024"}
    assert "event=ucx_info risky=true loaded=true" in hooked.logs()
    assert "event=ucx_info risky=false loaded=true" in safe.logs()
