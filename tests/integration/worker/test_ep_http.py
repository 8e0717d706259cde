"""Expert-parallel worker processes through the real HTTP API (issue 15).

Groups of 2 and 4 ``python -m moeguard_runtime`` processes on the loopback, each with the env
LeaderWorkerSet and the operator give a pod (``LWS_LEADER_ADDRESS=127.0.0.1``, ``LWS_GROUP_SIZE``,
``LWS_WORKER_INDEX``, ``MOEGUARD_EXPERT_PARALLEL_SIZE``, ``MOEGUARD_EP_PORT``,
``MOEGUARD_EP_TIMEOUT_SECONDS``), the followers started first as LWS may start them:

* greedy completions through the leader equal a single-process worker's, token for token, with one rank per
  pod and with 2 ranks per pod (each pod's main process starting its second rank); after a SIGTERM
  drain the leader stops the group and every rank exits 0;
* a follower answers completions with 503 ``not_the_leader``, is ready once in the group, and exports its
  own per-rank series; the leader exports every rank's tokens, the balancedness and every rank's RSS;
* a follower killed (SIGKILL) while a streamed request is answering: the stream ends with an
  ``expert_parallel_group_unavailable`` error within the timeout, new requests get 503 with that reason and
  Retry-After, the leader exits 4, and the other followers exit 4;
* a follower stopped (SIGSTOP, a hung rank): the leader fails its requests with 503 within the timeout and
  exits 4. No request hangs: every HTTP call here has a client timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable

import httpx
import pytest
from harness.worker_process import WorkerProcess, free_port, start_worker_process, wait_ready

PROMPTS = ["Mixture of experts", "hello, world", "The quick brown fox jumps", "0123456789"]
TIMEOUT_S = 4.0
MARGIN_S = 8.0
EXIT_EP_GROUP_LOST = 4


def _complete(base_url: str, prompt: str, max_tokens: int = 24) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0}, timeout=30)


def _group(start: Callable[..., WorkerProcess], ranks: int, pods: int | None = None, **env: str) -> list[WorkerProcess]:
    """Start a group of ``pods`` pods (default one per rank): followers first (each waits until its model is
    loaded), then the leader, then wait until the leader is ready (the group formed). Returns the pods' main
    processes, [leader, followers...]; with several ranks per pod each starts its other ranks itself."""
    pods = ranks if pods is None else pods
    common = {"MOEGUARD_EXPERT_PARALLEL_SIZE": str(ranks), "LWS_GROUP_SIZE": str(pods),
              "LWS_LEADER_ADDRESS": "127.0.0.1", "MOEGUARD_EP_PORT": str(free_port()),
              "MOEGUARD_EP_TIMEOUT_SECONDS": str(TIMEOUT_S), **env}
    followers = [start(**common, LWS_WORKER_INDEX=str(i), MOEGUARD_POD_NAME=f"g-{i}") for i in range(1, pods)]
    leader = start(**common, LWS_WORKER_INDEX="0", MOEGUARD_POD_NAME="g-0")
    assert wait_ready(leader.base_url, leader.proc, 60) is None, leader.logs()
    for f in followers:
        assert wait_ready(f.base_url, f.proc, 30) is None, f.logs()
    return [leader, *followers]


def _exit_code(w: WorkerProcess, within_s: float) -> int | None:
    try:
        return w.proc.wait(within_s)
    except subprocess.TimeoutExpired:
        return None


@pytest.fixture(scope="module")
def single_texts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    w = start_worker_process(tmp_path_factory.mktemp("single"), {})
    try:
        assert wait_ready(w.base_url, w.proc, 30) is None
        return {p: _complete(w.base_url, p).json()["choices"][0]["text"] for p in PROMPTS}
    finally:
        w.stop()


@pytest.mark.parametrize(("ranks", "pods"), [(2, 2), (4, 4), (4, 2)])
def test_greedy_through_the_leader_equals_one_process(start_worker: Callable[..., WorkerProcess],
                                                      single_texts: dict[str, str], ranks: int, pods: int) -> None:
    leader, *followers = _group(start_worker, ranks, pods)
    for p in PROMPTS:
        r = _complete(leader.base_url, p)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == single_texts[p], p
    r = httpx.post(f"{followers[0].base_url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_the_leader"
    lm = httpx.get(f"{leader.base_url}/metrics", timeout=10).text
    for rank in range(ranks):
        assert f'moeguard_ep_rank_resident_memory_bytes{{moeis="standalone",namespace="default",pod="g-0",rank="{rank}"}}' in lm
    assert "moeguard_ep_balancedness_ratio{" in lm and 'moeguard_ep_rank_tokens_total{layer="0"' in lm
    assert 'moeguard_ep_rank_info{experts="0-' in lm
    fm = httpx.get(f"{followers[-1].base_url}/metrics", timeout=10).text
    assert f'rank="{(pods - 1) * (ranks // pods)}"' in fm and "moeguard_ep_rank_tokens_total" in fm
    assert "moeguard_ep_group_up" in fm
    assert "event=ep_group_formed" in leader.logs() and f"expert_ranges=0:0-{8 // ranks}" in leader.logs()
    leader.proc.send_signal(signal.SIGTERM)  # a drain: the leader stops its group, every rank exits 0
    assert _exit_code(leader, 30) == 0, leader.logs()[-2000:]
    for f in followers:
        assert _exit_code(f, 10) == 0, f.logs()[-2000:]
        assert f.logs().count("event=ep_leader_stopped") == ranks // pods  # the pod's every rank


def test_killed_follower_ends_requests_with_503_and_the_group_exits(
        start_worker: Callable[..., WorkerProcess]) -> None:
    leader, *followers = _group(start_worker, 4)
    victim, others = followers[1], [followers[0], followers[2]]
    with httpx.stream("POST", f"{leader.base_url}/v1/completions", timeout=TIMEOUT_S + MARGIN_S,
                      json={"model": "tiny", "prompt": "a long answer", "max_tokens": 900, "stream": True,
                            "temperature": 0}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert "choices" in first
        os.kill(victim.proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        tail = [line for line in lines if line.startswith("data:")]
    ended_s = time.monotonic() - t_kill
    errors = [json.loads(line[5:])["error"] for line in tail if '"error"' in line]
    assert errors and errors[-1]["code"] == "expert_parallel_group_unavailable", tail[-3:]
    assert ended_s <= TIMEOUT_S + MARGIN_S
    try:  # until it exits, the leader refuses with 503 and the reason
        r = _complete(leader.base_url, "after")
        assert r.status_code == 503 and r.json()["error"]["code"] == "expert_parallel_group_unavailable"
        assert "Retry-After" in r.headers
    except httpx.TransportError:
        pass  # already gone
    assert _exit_code(leader, TIMEOUT_S + MARGIN_S) == EXIT_EP_GROUP_LOST, leader.logs()[-2000:]
    leader_exit_s = time.monotonic() - t_kill
    for f in others:
        assert _exit_code(f, TIMEOUT_S + MARGIN_S) == EXIT_EP_GROUP_LOST, f.logs()[-2000:]
    print(f"SIGKILL of rank 2: stream ended {ended_s:.2f} s after, leader exited {leader_exit_s:.2f} s after, "
          f"followers exited {time.monotonic() - t_kill:.2f} s after")
    assert "event=ep_group_lost" in leader.logs()


def test_hung_follower_fails_the_leader_within_the_timeout(start_worker: Callable[..., WorkerProcess]) -> None:
    leader, follower = _group(start_worker, 2)
    os.kill(follower.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = _complete(leader.base_url, "are you there", max_tokens=8)
        answered_s = time.monotonic() - t0
        assert r.status_code == 503 and r.json()["error"]["code"] == "expert_parallel_group_unavailable", r.text
        assert answered_s <= TIMEOUT_S + MARGIN_S
        assert _exit_code(leader, TIMEOUT_S + MARGIN_S) == EXIT_EP_GROUP_LOST, leader.logs()[-2000:]
        print(f"SIGSTOP of rank 1 (timeout {TIMEOUT_S:g} s): 503 after {answered_s:.2f} s, leader exited "
              f"{time.monotonic() - t0:.2f} s after the request")
    finally:
        os.kill(follower.proc.pid, signal.SIGKILL)
