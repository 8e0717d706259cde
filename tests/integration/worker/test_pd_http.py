"""Disaggregated prefill/decode over HTTP (issue 33): three real worker processes of the ``tiny`` preset, a
single worker, a prefill worker (``MOEGUARD_ROLE=prefill``) and a decode worker (``MOEGUARD_ROLE=decode``,
``MOEGUARD_PREFILL_URL`` the prefill worker's). The KV moves over NIXL's UCX between the two processes.

* the decode worker's greedy completions equal the single worker's, text and token counts, streamed and not;
* its ``moeguard_kv_transfer_seconds`` counts one read per request; the prefill worker holds no KV after;
* the prefill worker killed: the decode worker answers 503 ``prefill_unavailable`` with ``Retry-After`` at once;
  a prefill worker started again on the same port: served again;
* a bad prefill call (a token outside the vocabulary) is a 400 from the prefill worker, with its reason.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness.metrics_text import samples_named
from harness.worker_process import free_port
from tests.integration.worker.conftest import WorkerProcess, start_worker_process

from moeguard_core import contract

pytestmark = pytest.mark.integration

PROMPTS = ["The quick brown fox", "MoE routers send tokens to", "a" * 90]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WorkerProcess, WorkerProcess, WorkerProcess, str]]:
    logs = tmp_path_factory.mktemp("pd")
    port = str(free_port())
    started: list[WorkerProcess] = []
    try:  # a worker that fails to start stops those started before it
        for env in ({}, {"MOEGUARD_ROLE": "prefill", "MOEGUARD_PORT": port},
                    {"MOEGUARD_ROLE": "decode", "MOEGUARD_PREFILL_URL": f"http://127.0.0.1:{port}",
                     "MOEGUARD_KV_TRANSFER_TIMEOUT_SECONDS": "5"}):
            started.append(start_worker_process(logs, {"MOEGUARD_SEED": "3", **env}))
        single, prefill, decode = started
        yield single, prefill, decode, port
    finally:
        for w in started:
            w.stop()


def _value(text: str, name: str) -> float:
    (_, value), = samples_named(text, name)
    return value


def _complete(base_url: str, prompt: str, stream: bool = False) -> tuple[int, dict[str, str], str, int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
        data = r.json()
        if r.status_code != 200:
            return r.status_code, dict(r.headers), data["error"]["code"], 0
        return 200, dict(r.headers), data["choices"][0]["text"], data["usage"]["completion_tokens"]
    text, n = [], 0
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text.append(chunk["choices"][0]["text"])
                n += 1
    return 200, {}, "".join(text), n


def test_decode_worker_answers_as_the_single_worker(pair: tuple[WorkerProcess, WorkerProcess, WorkerProcess, str]
                                                    ) -> None:
    single, prefill, decode, _ = pair
    for prompt in PROMPTS:
        want = _complete(single.base_url, prompt)
        got = _complete(decode.base_url, prompt)
        assert got[0] == 200 and (got[2], got[3]) == (want[2], want[3]), (prompt, got, want)
        assert want[3] == 12  # a real generation: 12 tokens each
    assert _complete(decode.base_url, PROMPTS[1], stream=True)[2] == _complete(single.base_url, PROMPTS[1])[2]
    metrics = httpx.get(f"{decode.base_url}/metrics").text
    reads = _value(metrics, f"{contract.METRIC_KV_TRANSFER_SECONDS}_count")
    assert reads == len(PROMPTS) + 1
    deadline = time.monotonic() + 10  # the prefill worker drops each KV once its read is notified
    while time.monotonic() < deadline:
        held = _value(httpx.get(f"{prefill.base_url}/metrics").text, contract.METRIC_KV_CACHE_BYTES)
        if held == 0:
            break
        time.sleep(0.2)
    assert held == 0


def test_a_bad_prefill_call_is_a_400_with_its_reason(pair: tuple[WorkerProcess, WorkerProcess, WorkerProcess, str]
                                                     ) -> None:
    _, prefill, _, _ = pair
    r = httpx.post(f"{prefill.base_url}{contract.PREFILL_PATH}",
                   json={"request_id": "x", "prompt_token_ids": [1, 10**9]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = httpx.post(f"{prefill.base_url}{contract.PREFILL_PATH}", json={"request_id": "x"}, timeout=30)
    assert r.status_code == 400 and "prompt_token_ids" in r.json()["error"]["message"]


def test_a_killed_prefill_worker_is_a_503_with_retry_after_then_recovery(
        pair: tuple[WorkerProcess, WorkerProcess, WorkerProcess, str], tmp_path: Path) -> None:
    _, prefill, decode, port = pair
    prefill.proc.kill()
    prefill.proc.wait(10)
    t0 = time.monotonic()
    status, headers, code, _ = _complete(decode.base_url, PROMPTS[0])
    assert (status, code) == (503, "prefill_unavailable") and int(headers["retry-after"]) >= 1
    assert time.monotonic() - t0 < 10
    again = start_worker_process(tmp_path, {"MOEGUARD_SEED": "3", "MOEGUARD_ROLE": "prefill", "MOEGUARD_PORT": port})
    try:
        status, _, text, n = _complete(decode.base_url, PROMPTS[0])
        assert status == 200 and n == 12, text
    finally:
        again.stop()
