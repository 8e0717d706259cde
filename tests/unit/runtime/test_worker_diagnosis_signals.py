"""The worker's diagnosis signals (issue 14): UCX detection, the peak-breakdown window, the scheduler's
batch and long-request counts, the load-library fault's gate, and their metrics."""

from __future__ import annotations

import pytest
from tests.unit.runtime.test_telemetry import samples

from moeguard_core import contract
from moeguard_core.contract import Budgets
from moeguard_core.memory_admission import MemoryAdmission, StepPredictor
from moeguard_core.memory_model import Step
from moeguard_core.presets import get_preset
from moeguard_core.ucx import UcxInfo, effective_settings, mapped_libraries, risky, ucx_info
from moeguard_runtime.engine.scheduler import PriorityPolicy, QueueLimits, Scheduler
from moeguard_runtime.faults import ENV_FAULT_LOAD_LIBRARY, Faults, load_faults, load_library
from moeguard_runtime.memory.peak_breakdown import Breakdown, PeakWindow, breakdown
from moeguard_runtime.telemetry.telemetry import Telemetry

pytestmark = pytest.mark.unit

LABELS = {"moeis": "svc", "namespace": "ns", "pod": "svc-0"}

# lines as a process that loaded Debian's libucx0 shows them (the loader maps the symlinks' targets)
MAPS = """\
55d0c8a00000-55d0c8a2a000 r--p 00000000 08:01 1835023                    /usr/bin/python3.11
7f3a1c000000-7f3a1c021000 rw-p 00000000 00:00 0
7f3a2d5b1000-7f3a2d5c8000 r--p 00000000 08:01 1856310                    /usr/lib/x86_64-linux-gnu/libucs.so.0.0.0
7f3a2d5c8000-7f3a2d60e000 r-xp 00017000 08:01 1856310                    /usr/lib/x86_64-linux-gnu/libucs.so.0.0.0
7f3a2d70e000-7f3a2d712000 r--p 00000000 08:01 1856301                    /usr/lib/x86_64-linux-gnu/libucm.so.0.0.0
7f3a2d800000-7f3a2d801000 r--p 00000000 08:01 1856400                    /opt/nixl/lib/libuct_ib.so.0 (deleted)
7f3a2d900000-7f3a2d905000 r--p 00000000 08:01 1856500                    /usr/lib/x86_64-linux-gnu/libucl.so.1.0.0
7f3a2da00000-7f3a2da05000 r--p 00000000 08:01 1856501                    /usr/lib/libucsomething.so
7f3a2db00000-7f3a2db05000 r--p 00000000 08:01 1856502                    /home/a user/libucp-tools/notes.txt
7ffd6b9f2000-7ffd6ba13000 rw-p 00000000 00:00 0                          [stack]
7ffd6bbd6000-7ffd6bbd8000 r-xp 00000000 00:00 0                          [vdso]
"""


def test_mapped_libraries_are_ucx_file_names_sorted_unique_deleted_included() -> None:
    assert mapped_libraries(MAPS) == ("libucm.so.0.0.0", "libucs.so.0.0.0", "libuct_ib.so.0")
    assert mapped_libraries("") == ()
    assert mapped_libraries("7f00-7f01 r--p 00000000 00:00 0\n[heap]\n") == ()


# lines as a process that loaded NIXL's pip wheel shows them (nixl-cu12 1.5.1, read from /proc/self/maps after
# creating an agent with the UCX backend): auditwheel renamed the core libraries, not the transport modules
NIXL_WHEEL_MAPS = """\
7fd8bdd3b000-7fd8bdd3f000 r--p 00000000 fe:00 9980503                    /venv/site-packages/nixl_cu12.libs/ucx/libuct_cma.so.0.0.0
7fd8bde1c000-7fd8bde21000 r--p 00000000 fe:00 9980459                    /venv/site-packages/nixl_cu12.libs/libucm-f6ca5dec.so.0.0.0
7fd8bde3d000-7fd8bde50000 r--p 00000000 fe:00 9980462                    /venv/site-packages/nixl_cu12.libs/libuct-1141f529.so.0.0.0
7fd8bde85000-7fd8bde9a000 r--p 00000000 fe:00 9980461                    /venv/site-packages/nixl_cu12.libs/libucs-14c218c5.so.0.0.0
7fd8bdf1a000-7fd8bdf3b000 r--p 00000000 fe:00 9980460                    /venv/site-packages/nixl_cu12.libs/libucp-b39b3ed9.so.0.0.0
7fd8bdf40000-7fd8bdf41000 r--p 00000000 fe:00 9980470                    /venv/site-packages/tools/libucp-toolbox.so
7fd8bdf50000-7fd8bdf51000 r--p 00000000 fe:00 9980471                    /venv/site-packages/x/libucs-14c218c5.txt
"""


def test_a_wheels_renamed_ucx_libraries_are_ucx() -> None:
    assert mapped_libraries(NIXL_WHEEL_MAPS) == (
        "libucm-f6ca5dec.so.0.0.0", "libucp-b39b3ed9.so.0.0.0", "libucs-14c218c5.so.0.0.0",
        "libuct-1141f529.so.0.0.0", "libuct_cma.so.0.0.0")


def test_settings_default_or_override() -> None:
    assert effective_settings({}) == ("default:bistro", "default:512M")
    assert effective_settings({"UCX_MEM_MMAP_HOOK_MODE": "none", "UCX_RCACHE_MAX_UNRELEASED": "1024"}) == \
        ("none", "1024")
    assert effective_settings({"UCX_MEM_MMAP_HOOK_MODE": " "}) == ("default:bistro", "default:512M")


def test_info_labels_and_risky() -> None:
    info = ucx_info(MAPS, {})
    assert info.labels() == {"loaded": "true", "libraries": "libucm.so.0.0.0,libucs.so.0.0.0,libuct_ib.so.0",
                             "mmap_hook_mode": "default:bistro", "rcache_max_unreleased": "default:512M"}
    assert risky(info)  # hooks on, rcache unset (unbounded after NIXL #1210)
    assert risky(ucx_info(MAPS, {"UCX_RCACHE_MAX_UNRELEASED": "inf"}))
    assert not risky(ucx_info(MAPS, {"UCX_MEM_MMAP_HOOK_MODE": "none"}))
    assert not risky(ucx_info(MAPS, {"UCX_RCACHE_MAX_UNRELEASED": "1024"}))
    assert risky(ucx_info(MAPS, {"UCX_MEM_MMAP_HOOK_MODE": "reloc"}))
    absent = ucx_info("", {})
    assert not absent.loaded and not risky(absent) and absent.labels()["loaded"] == "false"


def test_ucx_gauge_keeps_one_label_set() -> None:
    t = Telemetry(LABELS, num_experts=8)
    assert t.set_ucx(UcxInfo((), "default:bistro", "default:512M").labels())
    assert not t.set_ucx(UcxInfo((), "default:bistro", "default:512M").labels())  # unchanged
    assert t.set_ucx(ucx_info(MAPS, {"UCX_MEM_MMAP_HOOK_MODE": "none"}).labels())
    ucx = {k: v for k, v in samples(t).items() if k[0] == contract.METRIC_UCX_INFO}
    assert list(ucx.values()) == [1.0]
    (labels,) = [dict(k[1]) for k in ucx]
    assert labels["loaded"] == "true" and labels["mmap_hook_mode"] == "none"


def _b(kv: int, attention: int = 0, weights: int = 100) -> Breakdown:
    return Breakdown(kv, attention, 0, 0, weights)


def test_peak_window_keeps_the_largest_until_it_expires() -> None:
    w = PeakWindow(30.0)
    assert w.largest(0.0) is None
    w.add(0.0, _b(50))
    w.add(5.0, _b(10, attention=20))   # peak 130 < 150
    w.add(10.0, _b(30))                 # peak 130: replaces the equal earlier one
    assert w.largest(10.0) == _b(50)
    assert w.largest(29.9) == _b(50)
    assert w.largest(30.0) == _b(30)    # the 150 step is 30 s old: expired
    assert w.largest(39.9) == _b(30)
    assert w.largest(40.0) is None
    with pytest.raises(ValueError):
        PeakWindow(0)


def test_breakdown_of_an_estimate() -> None:
    shape = get_preset("tiny")
    est = StepPredictor(shape, "float32").estimate(Step(prefill=((0, 64),), new_kv_tokens=80))
    b = breakdown(est, kv_held_bytes=1000, weight_bytes=7)
    assert b.kv_cache == 1000 + est.kv_bytes and est.kv_bytes == 80 * StepPredictor(shape, "float32").kv_bytes_per_token
    assert (b.attention, b.expert_buffers, b.dense_mlp, b.weights) == (est.attention_bytes, est.moe_bytes,
                                                                        est.dense_bytes, 7)
    assert b.peak_bytes == 7 + 1000 + est.total_bytes
    assert list(b.stages()) == list(contract.MEMORY_STAGES)
    # the admission predicts through the same model
    adm = MemoryAdmission(shape, "float32", 1 << 40)
    assert adm.raw(Step(prefill=((0, 64),), new_kv_tokens=80)) == est.total_bytes


def _budgets(**kw: int) -> Budgets:
    return Budgets.model_validate({"max_prefill_tokens": 50, "max_decode_tokens": 4, "max_batch_requests": 1,
                                   "max_concurrent_batches": 4, **kw})


def test_plans_count_prefilling_batches_and_long_admissions() -> None:
    s = Scheduler(_budgets(), QueueLimits(long_request_threshold_tokens=100), lambda: 0.0)
    s.submit("long0", 200, 2)   # 4 chunks of 50
    s.submit("long1", 150, 2)
    s.submit("short", 10, 2)
    p0 = s.schedule().plan
    assert p0 is not None and p0.admitted == ("long0",) and p0.prefill_batches == 1 and p0.long_admitted == 1
    p1 = s.schedule().plan  # a second batch (prefill cap ceil(4/2) = 2): both prefilling now
    assert p1 is not None and p1.admitted == ("long1",) and p1.prefill_batches == 2 and p1.long_admitted == 1
    assert s.batches_in_flight == 2 and s.long_requests_running == 2
    p2 = s.schedule().plan  # a third prefilling batch is not opened: batch 0 goes on
    assert p2 is not None and p2.admitted == () and p2.prefill_batches == 2 and p2.long_admitted == 0
    s.finish("long0")
    assert s.long_requests_running == 1 and s.batches_in_flight == 1


def test_a_burst_admitted_into_several_batches_in_one_round_overlaps_though_no_prompt_is_chunked() -> None:
    # 4 batches of one request each, every prompt prefilled whole in its batch's first step
    s = Scheduler(_budgets(), QueueLimits(long_request_threshold_tokens=1000), lambda: 0.0)
    for i in range(4):
        s.submit(f"r{i}", 40, 3)
    overlaps = []
    for _ in range(4):
        plan = s.schedule().plan
        assert plan is not None and len(plan.prefill) == 1 and plan.prefill[0][2] == 40  # whole, not chunked
        overlaps.append(plan.prefill_batches)
    assert overlaps == [1, 2, 3, 4] and s.batches_in_flight == 4
    plan = s.schedule().plan  # batch 0 decodes: no prefill, and it no longer counts as prefilling
    assert plan is not None and plan.prefill == () and plan.prefill_batches == 0
    s.submit("late", 40, 3)
    plan = s.schedule().plan  # batch 1 decodes too (its turn), the late one waits for a room
    assert plan is not None and plan.prefill_batches == 0


def test_a_decode_only_step_has_no_prefill_batches_and_preempted_long_requests_count() -> None:
    s = Scheduler(_budgets(max_concurrent_batches=1), QueueLimits(long_request_threshold_tokens=100),
                  lambda: 0.0, priority=PriorityPolicy("priority"))
    s.submit("long", 120, 5, "batch")
    for _ in range(3):
        plan = s.schedule().plan
    assert plan is not None and plan.decode == () and plan.prefill_batches == 1
    plan = s.schedule().plan
    assert plan is not None and plan.decode == ("long",) and plan.prefill_batches == 0
    s.submit("inter", 10, 2, "interactive")
    result = s.schedule()  # the batch request is preempted (KV kept): still counted
    assert result.preempted == ["long"] and s.long_requests_running == 1 and s.batches_in_flight == 1


def test_load_library_is_a_fault_behind_the_switch() -> None:
    with pytest.raises(ValueError, match=ENV_FAULT_LOAD_LIBRARY):
        load_faults({ENV_FAULT_LOAD_LIBRARY: "/usr/lib/x86_64-linux-gnu/libucs.so.0"})
    faults = load_faults({"MOEGUARD_TEST_FAULTS": "1", ENV_FAULT_LOAD_LIBRARY: " /x/libucs.so.0 "})
    assert faults.load_library == "/x/libucs.so.0"
    assert load_library(Faults()) is None
    with pytest.raises(OSError, match=r"libucs\.so\.0"):
        load_library(faults)


def test_series_exist_from_the_start_and_move() -> None:
    import torch

    from moeguard_runtime.model.moe import routing_stats

    t = Telemetry(LABELS, num_experts=8)
    key = lambda **kw: tuple(sorted({**LABELS, **kw}.items()))  # noqa: E731
    got = samples(t)
    assert got[("moeguard_step_prefill_batches_count", key())] == 0
    assert got[("moeguard_long_requests_admitted_total", key())] == 0
    assert got[("moeguard_kv_cache_bytes", key())] == 0 and got[("moeguard_batches_in_flight", key())] == 0
    assert all(got[("moeguard_memory_peak_breakdown_bytes", key(stage=s))] == 0 for s in contract.MEMORY_STAGES)
    assert got[("moeguard_step_queue_requests_count", key())] == 0
    t.observe_plan(prefill_batches=3, long_admitted=2, queue_requests=16)
    t.observe_plan(prefill_batches=0, long_admitted=0, queue_requests=0)  # decode only: no prefill observation
    t.set_batches(batches=3, long_running=2)
    t.observe_step(16, 0, [routing_stats(torch.tensor([30, 2, 0, 0, 0, 0, 0, 0]))], 0.001)
    got = samples(t)
    assert got[("moeguard_step_prefill_batches_count", key())] == 1
    assert got[("moeguard_step_prefill_batches_bucket", key(le="2.0"))] == 0
    assert got[("moeguard_step_prefill_batches_bucket", key(le="3.0"))] == 1
    # the queue is observed at every step: one empty, one of 16 waiting (bucket le=16, not le=8)
    assert got[("moeguard_step_queue_requests_count", key())] == 2
    assert got[("moeguard_step_queue_requests_bucket", key(le="0.0"))] == 1
    assert got[("moeguard_step_queue_requests_bucket", key(le="8.0"))] == 1
    assert got[("moeguard_step_queue_requests_bucket", key(le="16.0"))] == 2
    assert got[("moeguard_long_requests_admitted_total", key())] == 2
    assert got[("moeguard_batches_in_flight", key())] == 3 and got[("moeguard_long_requests_running", key())] == 2
    assert got[("moeguard_expert_top_share_ratio", key(layer="0"))] == pytest.approx(30 / 32)
