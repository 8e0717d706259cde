"""The UCX leak trial's pure parts (bench/ucx_leak.py): UCX's log read for the transports and a crash's
frame, the growth verdict, and the reading, which follows the figures rather than a fixed text."""

from __future__ import annotations

from typing import Any

import pytest
from bench import ucx_leak

pytestmark = pytest.mark.unit

# UCX 1.23.0's log lines (UCX_LOG_LEVEL=info, to stdout) from a run of the trial
LOG = """\
[1796668267.046399] [vm:15485:0]     ucp_context.c:2753 UCX  INFO  Version 1.23.0 (loaded from /c/nixl_cu12.libs/libucp-b39b3ed9.so.0.0.0, git branch <unknown>, revision 65e342a)
[1796668270.114554] [vm:15485:0]      ucp_worker.c:1997 UCX  INFO    prefill intra-node cfg#1 rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)
{"transfers": 1000}
[vm:14706:0:14706] Caught signal 11 (Segmentation fault: address not mapped to object at address 0x8)
==== backtrace (tid:  14706) ====
 0  /c/nixl_cu12.libs/libucs-426bcb86.so.0.0.0(ucs_handle_error+0x294) [0x7f8306b48bb4]
 3  /lib/x86_64-linux-gnu/libc.so.6(+0x3c050) [0x7f83c2a5a050]
 4  /c/nixl_cu12.libs/ucx/../libnl-route-3-3ad497a3.so.200.26.0(rtnl_tc_unregister+0xc) [0x7f8305a5de1c]
"""


def test_ucx_log_gives_version_transports_and_the_crash_frame() -> None:
    assert ucx_leak.VERSION.findall(LOG) == ["1.23.0"]
    found = [m.groups() for m in map(ucx_leak.TRANSPORTS.search, LOG.splitlines()) if m]
    assert found == [("prefill", "rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)")]
    assert ucx_leak.crash_frame(LOG) == "libnl-route-3-3ad497a3.so.200.26.0(rtnl_tc_unregister)"
    assert ucx_leak.crash_frame("no crash") is None


def test_pinning_free_only_when_every_transport_pins_nothing() -> None:
    assert ucx_leak.pinning_free(["prefill: rma_am(tcp/lo) am(tcp/lo cma/memory) ka(tcp/lo)"])
    assert ucx_leak.pinning_free(["x: am(sysv/memory posix/memory self/memory)"])
    assert not ucx_leak.pinning_free(["x: rma(rc_mlx5/mlx5_0:1) am(tcp/lo)"])
    assert not ucx_leak.pinning_free([])  # nothing logged: no claim


def run(prefill: float, decode: float = 0.0, heap: float = 100.0) -> dict[str, Any]:
    return {"prefill": {"slope_mib_per_min": prefill, "growth_mib": prefill / 2, "risky": True,
                        "heap_rss_end_mib": heap},
            "decode": {"slope_mib_per_min": decode, "growth_mib": decode / 2, "risky": True},
            "exit_code": 0, "crash_frame": None}


def build(settings: dict[str, list[dict[str, Any]]], transports: list[str] | None = None) -> dict[str, Any]:
    return {"name": "nixl-cu12==0.8.0", "ucx_version": "1.20.0", "note": "n",
            "transports": transports if transports is not None else ["p: am(tcp/lo cma/memory)"],
            "settings": settings}


def test_verdict_needs_every_repetition_at_the_bound() -> None:
    assert ucx_leak.verdict([run(10.0), run(400.0), run(12.0)], "prefill")
    assert not ucx_leak.verdict([run(400.0), run(9.9), run(400.0)], "prefill")
    assert ucx_leak.verdict([run(0.0, 50.0)] * 3, "decode")
    assert not ucx_leak.verdict([], "prefill")


def test_reading_follows_the_figures() -> None:
    flat = [run(0.4, 0.3)] * 3
    grows = [run(380.0, 0.5)] * 3
    cured = build({"UCX defaults": grows, "UCX_MEM_MMAP_HOOK_MODE=none": flat, "UCX_RCACHE_MAX_UNRELEASED=1024": flat})
    assert "the leak reproduced and moeguard's settings cure it" in ucx_leak.reading([cured])
    assert "not a cure measured here" not in ucx_leak.reading([cured])
    uncured = build({"UCX defaults": grows, "UCX_RCACHE_MAX_UNRELEASED=1024": grows})
    assert "grew even with a cure set" in ucx_leak.reading([uncured])
    none = ucx_leak.reading([build({"UCX defaults": flat, "UCX_RCACHE_MAX_UNRELEASED=1024": flat})])
    assert "not reproduced; every transport UCX chose registers without pinning pages" in none
    assert "not a cure measured here" in none
    pinning = ucx_leak.reading([build({"UCX defaults": flat}, transports=["p: rma(rc_mlx5/mlx5_0:1)"])])
    assert "UCX chose a transport that can pin memory, and it still did not grow" in pinning


def test_render_reports_medians_per_run_and_the_exit() -> None:
    runs = [run(1.0, 0.2), run(3.0, 0.4, heap=120.0), run(2.0, 0.3)]
    runs[1] = runs[1] | {"exit_code": -11, "crash_frame": "libnl-route-3.so.200(rtnl_tc_unregister)"}
    text = ucx_leak.render({"cpu": "AMD EPYC", "date": "2026-12-07", "transfers": 1000, "block_mib": 4.0, "reps": 3,
                            "builds": [build({"UCX defaults": runs})]})
    assert "| UCX defaults | 2.0 (1.0 / 3.0 / 2.0) | 1.0 | 100 / 120 / 100 | 0.3 (0.2 / 0.4 / 0.3) | 0.1 | yes | 0 of 3 |" in text
    assert "Exit codes of the runs: -11, 0" in text
    assert "UCX's handler put it in libnl-route-3.so.200(rtnl_tc_unregister)" in text
    assert "## nixl-cu12==0.8.0: UCX 1.20.0" in text


def test_reading_names_runs_that_grew_when_others_of_their_setting_did_not() -> None:
    flat = run(0.0, 0.2, heap=110.0)
    some = build({"UCX defaults": [flat] * 3,
                  "UCX_MEM_MMAP_HOOK_MODE=none": [run(9580.0, 0.2, heap=4100.0), flat, flat]})
    text = ucx_leak.reading([some])
    assert "the leak is not reproduced" in text  # no setting grew in every run
    assert ("UCX_MEM_MMAP_HOOK_MODE=none: 1 of 3 (prefill +4790 MiB; its `[heap]` ended at 4100 MiB against "
            "110 MiB in the runs that stayed flat)") in text
    assert "The growth sat in the `[heap]`" in text
    assert "every run that grew had a cure set (1 of 3 runs with one, 0 of 3 without)" in text
    elsewhere = build({"UCX defaults": [run(9580.0, heap=110.0), flat, flat]})
    assert "The growth was not in the `[heap]`" in ucx_leak.reading([elsewhere])


def test_heap_rss_is_the_heap_mappings_resident_size() -> None:
    from bench.ucx_leak_trial import heap_rss_mib

    smaps = """\
55ad2579a000-55ad5e6e6000 rw-p 00000000 00:00 0                          [heap]
Size:             932144 kB
Rss:              931840 kB
Pss:              931840 kB
7f77071c8000-7f770cbe0000 rw-p 00000000 00:00 0
Size:              92256 kB
Rss:               89088 kB
"""
    assert heap_rss_mib(smaps) == 910.0
    assert heap_rss_mib(smaps.replace("[heap]", "")) == 0.0


def test_reading_names_the_side_that_grew() -> None:
    flat = run(0.0, 0.2)
    decode_only = run(0.0, 600.0)
    decode_only["decode"]["heap_rss_end_mib"] = 100.0
    flat["decode"]["heap_rss_end_mib"] = 100.0
    text = ucx_leak.reading([build({"UCX defaults": [decode_only, flat, flat]})])
    assert "UCX defaults: 1 of 3 (decode +300 MiB; its `[heap]` ended at 100 MiB against 100 MiB" in text
    assert "The growth was not in the `[heap]`" in text
