"""The leader's worker when its expert-parallel group breaks (issue 15), driven by hand (no thread).

The MoE layers dispatch through a stand-in for :class:`expert_parallel.LayerDispatch` that fails as the real
group does: it reports the loss (``on_lost`` = :meth:`Worker.group_lost`) and raises
:class:`expert_parallel.GroupUnavailable`. Every request in flight ends with 503
``expert_parallel_group_unavailable``, new ones are refused the same way with Retry-After, readiness fails
naming the cause, and the exit callback runs once.
"""

from __future__ import annotations

import pytest
import torch

from moeguard_core import presets
from moeguard_core.contract import EP_GROUP_UNAVAILABLE
from moeguard_runtime.api import tokenizer
from moeguard_runtime.config import load_settings
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.engine.scheduler import Rejected
from moeguard_runtime.engine.service import Event, GenerationRequest, Worker
from moeguard_runtime.memory.memory import MemoryReading
from moeguard_runtime.model.model import build_model
from moeguard_runtime.parallel.expert_parallel import GroupUnavailable, moe_modules
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

pytestmark = pytest.mark.unit


class BrokenDispatch:
    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.calls = 0

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        message = "rank 0: layer 0 dispatch failed: RuntimeError('Connection reset by peer')"
        assert self.worker is not None
        self.worker.group_lost(message)
        raise GroupUnavailable(message)


def test_a_broken_group_ends_every_request_with_503_and_refuses_new_ones() -> None:
    model = build_model(presets.get_preset("tiny"), seed=1)
    broken = BrokenDispatch()
    for m in moe_modules(model):
        setattr(m, "expert_parallel", broken)  # noqa: B010
    worker = Worker(load_settings({}), Engine(model), Telemetry({"moeis": "s", "namespace": "n", "pod": "p"}, 8),
                    RateLimitedLog(0.0), clock=lambda: 0.0, memory_reader=lambda: MemoryReading(100, "rss"),
                    idle_wait_s=0.0)
    broken.worker = worker
    exits: list[str] = []
    worker.on_group_lost = exits.append
    events: dict[str, list[Event]] = {"a": [], "b": []}
    for rid in events:
        worker.submit(GenerationRequest(rid, tokenizer.encode("hello"), 8, 0.0), events[rid].append)
    assert worker.ep_lost is None
    worker._iteration()
    for rid, evs in events.items():
        assert evs[-1].kind == "error" and evs[-1].status == 503, rid
        assert evs[-1].reason == EP_GROUP_UNAVAILABLE and "Connection reset" in evs[-1].message
    assert len(exits) == 1 and broken.calls == 1
    assert worker.not_ready_reason is not None and worker.not_ready_reason.startswith(EP_GROUP_UNAVAILABLE)
    with pytest.raises(Rejected) as rej:
        worker.submit(GenerationRequest("c", tokenizer.encode("x"), 4, 0.0), lambda _e: None)
    assert (rej.value.reason, rej.value.status, rej.value.retry_after_s) == (EP_GROUP_UNAVAILABLE, 503, 5)
    with pytest.raises(Rejected):
        worker.refuse_early()
    worker._iteration()  # nothing left to run, nothing raised
    assert worker.engine.sequences == {} and broken.calls == 1
    worker.group_lost("again")  # reported once
    assert len(exits) == 1
