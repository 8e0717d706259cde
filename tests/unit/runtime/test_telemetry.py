from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moeguard_core.contract import Budgets
from moeguard_runtime.model.moe import routing_stats
from moeguard_runtime.telemetry.telemetry import (
    RateLimitedLog,
    Telemetry,
    worker_labels,
    write_termination_message,
)

pytestmark = pytest.mark.unit

LABELS = {"moeis": "svc", "namespace": "ns", "pod": "svc-0"}


def samples(t: Telemetry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(t.registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_labels_from_env_with_defaults() -> None:
    env = {"MOEGUARD_SERVICE_NAME": "svc", "MOEGUARD_NAMESPACE": "ns", "MOEGUARD_POD_NAME": "p"}
    assert worker_labels(env) == {"moeis": "svc", "namespace": "ns", "pod": "p"}
    d = worker_labels({})
    assert d["moeis"] == "standalone" and d["namespace"] == "default" and d["pod"]


def test_every_series_carries_worker_labels_and_skew_needs_enough_slots() -> None:
    t = Telemetry(LABELS, num_experts=8)
    t.set_budgets(Budgets(max_prefill_tokens=10, max_decode_tokens=2, max_batch_requests=3,
                          max_concurrent_batches=1))
    small = routing_stats(torch.tensor([2, 2, 0, 0, 0, 0, 0, 0]))  # 4 slots < 32
    t.observe_step(0, 2, [small], 0.001)
    big = routing_stats(torch.tensor([30, 2, 0, 0, 0, 0, 0, 0]))  # 32 slots
    t.observe_step(16, 0, [big, small], 0.001)
    got = samples(t)
    for (name, labels) in got:
        d = dict(labels)
        assert {k: d.get(k) for k in LABELS} == LABELS, name
    key = lambda **kw: tuple(sorted({**LABELS, **kw}.items()))  # noqa: E731
    assert got[("moeguard_expert_skew_ratio", key(layer="0"))] == 30.0
    assert ("moeguard_expert_skew_ratio", key(layer="1")) not in got
    assert got[("moeguard_expert_balancedness", key(layer="0"))] == pytest.approx(4 / 30)
    assert got[("moeguard_expert_tokens_total", key(layer="0", expert="0"))] == 32
    assert got[("moeguard_batch_tokens_count", key(phase="prefill"))] == 1
    assert got[("moeguard_batch_tokens_sum", key(phase="decode"))] == 2
    assert got[("moeguard_budget_max_batch_requests", key())] == 3
    assert got[("moeguard_budget_generation", key())] == -1
    assert got[("moeguard_process_resident_memory_bytes", key())] > 1e6


def test_rate_limited_log_counts_suppressed() -> None:
    now = [0.0]
    lines: list[tuple[str, dict[str, object]]] = []

    class Logger:
        def info(self, event: str, **kw: object) -> None:
            lines.append((event, kw))

    log = RateLimitedLog(1.0, clock=lambda: now[0], logger=Logger())
    assert log.event("inference_batch_start", step=1)
    assert not log.event("inference_batch_start", step=2)
    assert not log.event("inference_batch_start", step=3)
    assert log.event("budget_applied", force=True)
    now[0] = 1.5
    assert log.event("inference_batch_start", step=4)
    assert lines == [("inference_batch_start", {"step": 1}), ("budget_applied", {}),
                     ("inference_batch_start", {"step": 4, "suppressed": 2})]


def test_model_weight_bytes_is_the_parameters_bytes_in_their_dtype() -> None:
    t = Telemetry(LABELS, num_experts=8)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    assert t.set_model_weights(model.parameters()) == (16 * 8 + 8 * 4 + 4) * 2
    assert samples(t)[("moeguard_model_weight_bytes", tuple(sorted(LABELS.items())))] == 328.0


def test_termination_message_written_only_where_the_kubelet_made_the_file(tmp_path: Path) -> None:
    path = tmp_path / "termination-log"
    assert not write_termination_message("model_load_error: x", str(path))
    assert not path.exists()  # never created: outside Kubernetes there is no such file
    path.write_text("an older message, longer than the new one")
    assert write_termination_message("model_load_error: missing shard model-00002-of-00002.safetensors",
                                     str(path))
    assert path.read_text() == "model_load_error: missing shard model-00002-of-00002.safetensors"
    assert write_termination_message("é" * 3000, str(path))  # 6000 bytes: cut at 4096, never half a character
    assert path.read_text() == "é" * 2048


def test_each_step_with_enough_slots_is_one_skew_observation_at_its_worst_layer() -> None:
    """The operator's skew signal: ``_count`` moves only with steps that carry skew data, so a window
    without such steps has none (issue 18 §3); the observation is the step's highest layer skew."""
    t = Telemetry(LABELS, num_experts=8)
    key = lambda **kw: tuple(sorted({**LABELS, **kw}.items()))  # noqa: E731
    got = samples(t)
    assert got[("moeguard_step_expert_skew_ratio_count", key())] == 0  # declared from the start: idle, not absent
    assert got[("moeguard_worker_start_time_seconds", key())] > 1.7e9
    small = routing_stats(torch.tensor([2, 2, 0, 0, 0, 0, 0, 0]))  # 4 slots < 32: no skew data
    t.observe_step(0, 2, [small, small], 0.001)
    assert samples(t)[("moeguard_step_expert_skew_ratio_count", key())] == 0
    even = routing_stats(torch.tensor([4] * 8))  # skew 1
    hot = routing_stats(torch.tensor([30, 2, 0, 0, 0, 0, 0, 0]))  # skew 30
    t.observe_step(16, 0, [even, hot, small], 0.001)
    t.observe_step(16, 0, [even], 0.001)
    got = samples(t)
    assert got[("moeguard_step_expert_skew_ratio_count", key())] == 2
    assert got[("moeguard_step_expert_skew_ratio_sum", key())] == 31.0
    assert got[("moeguard_step_expert_skew_ratio_bucket", key(le="28.0"))] == 1
    assert got[("moeguard_step_expert_skew_ratio_bucket", key(le="32.0"))] == 2
