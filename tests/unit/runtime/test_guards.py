"""Device memory decision, leak classification, settings from the environment."""

from __future__ import annotations

import pytest

from moeguard_core import contract
from moeguard_runtime.config import ConfigError, load_settings, model_args
from moeguard_runtime.faults import FaultLeaker, Faults, load_faults
from moeguard_runtime.memory.leak import Growth, GrowthTracker, classify, slope
from moeguard_runtime.memory.memory import MemoryState, decide_device
from moeguard_runtime.memory.procmem import ProcessMemory, read_process_memory

pytestmark = pytest.mark.unit
GIB = 1 << 30


def test_device_memory_against_fractions_with_hysteresis() -> None:
    total = 80 * GIB
    assert decide_device(MemoryState.NORMAL, 70 * GIB, total, 0.9, 0.97) == MemoryState.NORMAL
    assert decide_device(MemoryState.NORMAL, 73 * GIB, total, 0.9, 0.97) == MemoryState.SOFT
    assert decide_device(MemoryState.NORMAL, 78 * GIB, total, 0.9, 0.97) == MemoryState.HARD
    # 66 GiB is within 10 % under the 72 GiB soft figure: stays SOFT; 64 GiB leaves it
    assert decide_device(MemoryState.SOFT, 66 * GIB, total, 0.9, 0.97) == MemoryState.SOFT
    assert decide_device(MemoryState.SOFT, 64 * GIB, total, 0.9, 0.97) == MemoryState.NORMAL


def _g(anon: float, blocks: float, samples: int = 10) -> Growth:
    return Growth(anon, anon, 0, 0, 0, blocks, 10.0, samples)


def test_classify_tells_native_from_python_heap() -> None:
    assert classify(_g(5e6, 20)) == "native"  # 5 MB/s, 20 new objects/s
    assert classify(_g(5e6, 40_000)) == "python_heap"  # ~125 bytes per new block
    assert classify(_g(10_000, 0)) == "none"  # below the threshold
    assert classify(_g(5e6, 0, samples=3)) == "none"  # too few samples to say


def test_slope_and_tracker_window() -> None:
    assert slope([(0, 0), (1, 2), (2, 4)]) == pytest.approx(2)
    assert slope([(0, 5)]) == 0
    tr = GrowthTracker(window_s=5)
    for t in range(10):
        tr.add(float(t), ProcessMemory(t * 1000, t * 1000, 0, 10, 100, 0))
    g = tr.growth()
    assert g.samples == 6 and g.rss_anonymous_bytes == pytest.approx(1000)
    assert g.python_allocated_blocks == 0


def test_fault_leaker_grows_anonymous_memory_not_python_blocks() -> None:
    before = read_process_memory()
    leaker = FaultLeaker(anon_bps=40 << 20, python_bps=0)
    for _ in range(5):  # five ticks of 0.1 s, called here: no thread, no sleep
        leaker.tick()
    after = read_process_memory()
    assert before.rss_anonymous is not None and after.rss_anonymous is not None
    assert after.rss_anonymous - before.rss_anonymous > 8 << 20
    assert after.python_allocated_blocks - before.python_allocated_blocks < 2000


def test_settings_read_every_contract_variable() -> None:
    s = load_settings({
        contract.ENV_MAX_LONG_REQUESTS_PER_BATCH: "3", contract.ENV_MAX_QUEUE_REQUESTS: "7",
        contract.ENV_QUEUE_TIMEOUT_SECONDS: "2.5", contract.ENV_LONG_REQUEST_THRESHOLD_TOKENS: "300",
        contract.ENV_MAX_CONCURRENT_REQUESTS: "9", contract.ENV_GPU_SOFT_FRACTION: "0.8",
        contract.ENV_GPU_HARD_FRACTION: "0.9", contract.ENV_OVERLOAD_MODE: "On",
        contract.ENV_CHECKPOINT_PATH: "/models/x", contract.ENV_MODEL_OVERRIDES: '{"n_layer": 1}',
    })
    b = s.budgets
    assert (b.max_long_requests_per_batch, b.max_queue_requests, b.queue_timeout_seconds) == (3, 7, 2.5)
    assert s.limits.long_request_threshold_tokens == 300 and s.limits.max_concurrent_requests == 9
    assert (s.gpu_soft_fraction, s.gpu_hard_fraction, s.overload_mode) == (0.8, 0.9, "On")
    assert s.checkpoint == "/models/x" and model_args(s).n_layer == 1


@pytest.mark.parametrize(("env", "needle"), [
    ({contract.ENV_OVERLOAD_MODE: "sometimes"}, "MOEGUARD_OVERLOAD_MODE='sometimes' must be one of"),
    ({contract.ENV_GPU_SOFT_FRACTION: "0.99", contract.ENV_GPU_HARD_FRACTION: "0.9"},
     "MOEGUARD_GPU_SOFT_FRACTION=0.99 must be <= MOEGUARD_GPU_HARD_FRACTION=0.9"),
    ({contract.ENV_SOFT_LIMIT_BYTES: "200", contract.ENV_HARD_LIMIT_BYTES: "100"},
     "MOEGUARD_SOFT_LIMIT_BYTES=200 must be <= MOEGUARD_HARD_LIMIT_BYTES=100"),
    ({contract.ENV_MAX_QUEUE_REQUESTS: "ten"}, "MOEGUARD_MAX_QUEUE_REQUESTS='ten' is not an integer"),
    ({contract.ENV_MODEL_OVERRIDES: '{"depth": 3}'}, "unknown field 'depth'"),
    ({"MOEGUARD_FAULT_STEP_DELAY_SECONDS": "0.1"},
     "MOEGUARD_FAULT_STEP_DELAY_SECONDS set without MOEGUARD_TEST_FAULTS=1"),
    ({"MOEGUARD_TEST_FAULTS": "1", "MOEGUARD_FAULT_LEAK_ANON_BYTES_PER_SECOND": "-1"},
     "MOEGUARD_FAULT_LEAK_ANON_BYTES_PER_SECOND=-1 must be >= 0"),
    ({"MOEGUARD_MATMUL_BACKEND": "cublas"}, "MOEGUARD_MATMUL_BACKEND='cublas' must be one of"),
    ({"MOEGUARD_MOE_DISPATCH": "gpu"}, "MOEGUARD_MOE_DISPATCH='gpu' must be one of auto, host, device"),
    ({"MOEGUARD_MATMUL_BACKEND": "onednn_packed", "MOEGUARD_MOE_DISPATCH": "device"},
     "MOEGUARD_MATMUL_BACKEND=onednn_packed packs the experts for oneDNN on the CPU (float32, or bfloat16 where "
     "this torch's oneDNN has it) with host dispatch; this worker has device cpu, dtype float32, "
     "MOEGUARD_MOE_DISPATCH=device"),
    ({"MOEGUARD_MATMUL_BACKEND": "onednn_packed", contract.ENV_DTYPE: "float16"},
     "with host dispatch; this worker has device cpu, dtype float16, MOEGUARD_MOE_DISPATCH=auto"),
    ({"MOEGUARD_SHUTDOWN_DELAY_SECONDS": "soon"}, "MOEGUARD_SHUTDOWN_DELAY_SECONDS='soon' is not a number"),
    ({"MOEGUARD_SHUTDOWN_DELAY_SECONDS": "-1"}, "MOEGUARD_SHUTDOWN_DELAY_SECONDS=-1 must be between 0 and 3600"),
    ({"MOEGUARD_SHUTDOWN_DELAY_SECONDS": "nan"}, "MOEGUARD_SHUTDOWN_DELAY_SECONDS=nan must be between 0 and 3600"),
])
def test_bad_environment_names_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(env)
    assert needle in str(exc.value)


def test_shutdown_delay_is_read_in_seconds() -> None:
    assert load_settings({}).shutdown_delay_s == 5.0
    assert load_settings({"MOEGUARD_SHUTDOWN_DELAY_SECONDS": "0"}).shutdown_delay_s == 0.0
    assert load_settings({"MOEGUARD_SHUTDOWN_DELAY_SECONDS": " 12.5 "}).shutdown_delay_s == 12.5


def test_faults_are_read_only_behind_the_test_switch() -> None:
    assert load_settings({}).faults == Faults() and not Faults().leaks
    on = load_settings({"MOEGUARD_TEST_FAULTS": "1", "MOEGUARD_FAULT_STEP_DELAY_SECONDS": "0.02",
                        "MOEGUARD_FAULT_LEAK_PYTHON_BYTES_PER_SECOND": "1000"})
    assert on.faults == Faults(leak_anon_bps=0, leak_python_bps=1000, step_delay_s=0.02)
    assert load_faults({"MOEGUARD_TEST_FAULTS": "1"}) == Faults()
