"""Samples from a worker's Prometheus text (prometheus_client's parser) and the soak's row."""

from __future__ import annotations

import pytest
from bench.soak import sample_row
from harness.metrics_text import samples, samples_named

pytestmark = pytest.mark.unit

TEXT = "\n".join([
    "# HELP moeguard_process_resident_memory_bytes RSS",
    "# TYPE moeguard_process_resident_memory_bytes gauge",
    'moeguard_process_resident_memory_bytes{moeis="s",pod="p"} 1.5e+08',
    'moeguard_python_allocated_blocks{moeis="s"} 1000.0',
    'moeguard_python_allocated_blocks_growth_per_second{moeis="s"} 3.0',
    'moeguard_memory_leak_suspected{kind="python"} 1.0',
    'moeguard_memory_leak_suspected{kind="native"} 0.0',
    "",
])


def test_samples_keep_names_labels_and_values() -> None:
    got = list(samples(TEXT))
    assert got[0] == ("moeguard_process_resident_memory_bytes", {"moeis": "s", "pod": "p"}, 1.5e8)
    assert samples_named(TEXT, "moeguard_memory_leak_suspected") == [({"kind": "python"}, 1.0),
                                                                     ({"kind": "native"}, 0.0)]
    assert samples_named(TEXT, "moeguard_nope") == []


def test_soak_row_takes_exact_names_and_the_native_verdict() -> None:
    row = sample_row(TEXT, 2.0)
    assert row == {"t": 2.0, "rss": 1.5e8, "python_blocks": 1000.0, "leak_native": 0.0}
