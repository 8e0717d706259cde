"""Expert chunking is exported: how many chunks a layer's expert work ran in, per step, as a
metric (split steps, chunks per step) and a log field."""

from __future__ import annotations

import pytest
import torch
from tests.unit.runtime.test_service import LABELS, Lines

from moeguard_core import presets
from moeguard_runtime.api import tokenizer
from moeguard_runtime.config import load_settings
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.engine.service import Event, GenerationRequest, Worker
from moeguard_runtime.memory.memory import MemoryReading
from moeguard_runtime.model.model import build_model
from moeguard_runtime.model.moe import ONEDNN_CHUNK_TOKENS, device_expert_chunks, host_expert_chunks
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("counts", "chunk", "capacity", "backend", "chunks"), [
    ([600, 10, 0, 0], 2048, None, "onednn", 3),  # the oneDNN path's 256-slot chunks: 256+256+88
    ([600, 10, 0, 0], 2048, None, "torch", 1),
    ([600, 10, 0, 0], 100, None, "torch", 6),
    ([600, 10, 0, 0], 100, 150, "torch", 2),  # only the kept slots run
    ([256, 256], 2048, None, "onednn", 1),
    ([0, 0, 0], 8, None, "torch", 0),
])
def test_host_chunks_are_the_busiest_experts(counts: list[int], chunk: int, capacity: int | None,
                                             backend: str, chunks: int) -> None:
    x = torch.zeros(4, 8)  # float32 on the CPU: oneDNN's path when asked for
    assert host_expert_chunks(x, counts, chunk, capacity, backend) == chunks  # type: ignore[arg-type]
    assert ONEDNN_CHUNK_TOKENS == 256


def test_device_chunks_cover_all_slots() -> None:
    assert [device_expert_chunks(s, 2048) for s in (0, 1, 2048, 2049, 8192)] == [0, 1, 1, 2, 4]




def test_a_split_step_is_counted_and_logged() -> None:
    settings = load_settings({"MOEGUARD_EXPERT_CHUNK_TOKENS": "8", "MOEGUARD_MAX_PREFILL_TOKENS": "64"})
    lines = Lines()
    model = build_model(presets.get_preset("tiny"), seed=1, expert_chunk_tokens=8)
    worker = Worker(settings, Engine(model), Telemetry(LABELS, 8), RateLimitedLog(0.0, logger=lines),
                    clock=lambda: 0.0, memory_reader=lambda: MemoryReading(100, "rss"), idle_wait_s=0.0)
    events: list[Event] = []
    worker.submit(GenerationRequest("r", tokenizer.encode("x" * 59), 1), events.append)  # 60 tokens
    worker._iteration()
    assert events[-1].kind == "finish"
    routing = next(kw for ev, kw in lines.lines if ev == "moe_routing_stats")
    top = [int(t) for t in str(routing["top_expert_tokens"]).split(",")]
    chunks = [int(c) for c in str(routing["expert_chunks"]).split(",")]
    assert chunks == [-(-t // 8) for t in top] and max(chunks) > 1  # 120 slots over 8 experts
    reg = worker.telemetry.registry
    assert reg.get_sample_value("moeguard_expert_split_steps_total", LABELS) == 1
    assert reg.get_sample_value("moeguard_step_expert_chunks_count", LABELS) == 1
    assert reg.get_sample_value("moeguard_step_expert_chunks_sum", LABELS) == max(chunks)
