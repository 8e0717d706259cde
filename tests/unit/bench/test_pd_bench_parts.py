"""The prefill/decode benchmark's pure parts: metrics parsing, histogram quantiles, per-run figures, output
comparison, aggregation and the report."""

from __future__ import annotations

from typing import Any

import pytest
from bench import pd_bench as pdb

pytestmark = pytest.mark.unit

L = 'moeis="standalone",namespace="default",pod="vm"'


def metrics_text(transfer: list[tuple[str, float]], count: float, total: float, nbytes: float,
                 ttft: dict[str, tuple[float, float]], steps: tuple[float, float] = (10.0, 2.5)) -> str:
    """A worker's exposition: the KV transfer histogram (``transfer``: (le, cumulative)), its byte counter, the TTFT
    histogram per priority (count, sum) and the step histogram."""
    lines = ["# HELP moeguard_kv_transfer_seconds x", "# TYPE moeguard_kv_transfer_seconds histogram"]
    lines += [f'moeguard_kv_transfer_seconds_bucket{{le="{le}",{L}}} {v}' for le, v in transfer]
    lines += [f"moeguard_kv_transfer_seconds_count{{{L}}} {count}", f"moeguard_kv_transfer_seconds_sum{{{L}}} {total}",
              "# HELP moeguard_kv_transfer_bytes_total x", "# TYPE moeguard_kv_transfer_bytes_total counter",
              f"moeguard_kv_transfer_bytes_total{{{L}}} {nbytes}",
              "# HELP moeguard_time_to_first_token_seconds x", "# TYPE moeguard_time_to_first_token_seconds histogram"]
    for prio, (n, sm) in ttft.items():
        lines += [f'moeguard_time_to_first_token_seconds_bucket{{le="1.0",{L},priority="{prio}"}} {n}',
                  f'moeguard_time_to_first_token_seconds_bucket{{le="+Inf",{L},priority="{prio}"}} {n}',
                  f'moeguard_time_to_first_token_seconds_count{{{L},priority="{prio}"}} {n}',
                  f'moeguard_time_to_first_token_seconds_sum{{{L},priority="{prio}"}} {sm}']
    lines += ["# HELP moeguard_step_duration_seconds x", "# TYPE moeguard_step_duration_seconds histogram",
              f'moeguard_step_duration_seconds_bucket{{le="+Inf",{L}}} {steps[0]}',
              f"moeguard_step_duration_seconds_count{{{L}}} {steps[0]}",
              f"moeguard_step_duration_seconds_sum{{{L}}} {steps[1]}"]
    return "\n".join(lines) + "\n"


BEFORE = metrics_text([("0.005", 1), ("0.01", 2), ("0.025", 2), ("+Inf", 2)], 2, 0.012, 2 * 1_000_000,
                      {"interactive": (2, 0.5), "batch": (0, 0.0)}, steps=(10, 2.5))
AFTER = metrics_text([("0.005", 1), ("0.01", 6), ("0.025", 11), ("+Inf", 12)], 12, 0.162, 12 * 1_000_000,
                     {"interactive": (8, 2.5), "batch": (4, 1.0)}, steps=(110, 32.5))


def test_worker_metrics_sums_label_sets_and_reads_buckets_by_bound() -> None:
    m = pdb.worker_metrics(AFTER)
    assert m["transfer"] == {"count": 12.0, "sum": 0.162,
                             "buckets": {0.005: 1.0, 0.01: 6.0, 0.025: 11.0, float("inf"): 12.0}}
    assert m["transfer_bytes"] == 12_000_000
    assert m["ttft"]["count"] == 12 and m["ttft"]["sum"] == pytest.approx(3.5)  # interactive + batch
    assert m["ttft"]["buckets"] == {1.0: 12.0, float("inf"): 12.0}
    assert (m["steps"]["count"], m["steps"]["sum"]) == (110, 32.5)


def test_a_worker_without_kv_reads_has_empty_transfer_figures() -> None:
    text = "# HELP moeguard_step_duration_seconds x\n# TYPE moeguard_step_duration_seconds histogram\n" \
           f"moeguard_step_duration_seconds_count{{{L}}} 3\nmoeguard_step_duration_seconds_sum{{{L}}} 1.5\n"
    m = pdb.worker_metrics(text)
    assert m["transfer"] == {"count": 0, "sum": 0, "buckets": {}} and m["transfer_bytes"] == 0
    d = pdb.metrics_delta(m, m)
    assert pdb.transfer_figures(d) == {"reads": 0, "mean_s": None, "p50_s": None, "p99_s": None, "bytes": 0,
                                       "bytes_per_read": None}


def test_a_runs_delta_gives_reads_mean_quantiles_and_bytes_per_read() -> None:
    d = pdb.metrics_delta(pdb.worker_metrics(BEFORE), pdb.worker_metrics(AFTER))
    assert d["transfer"]["buckets"] == {0.005: 0.0, 0.01: 4.0, 0.025: 9.0, float("inf"): 10.0}
    assert d["ttft"]["count"] == 10 and d["ttft"]["sum"] == pytest.approx(3.0)
    f = pdb.transfer_figures(d)
    assert f["reads"] == 10 and f["mean_s"] == pytest.approx(0.015)
    # rank 5 of 10 falls in (0.01, 0.025], which holds the 5th to the 9th
    assert f["p50_s"] == pytest.approx(0.01 + 0.015 * (5 - 4) / 5)
    assert f["p99_s"] == pytest.approx(0.025)  # rank 9.9 falls in +Inf: the highest finite bound
    assert f["bytes"] == 10_000_000 and f["bytes_per_read"] == 1_000_000


def test_bucket_quantile_interpolates_from_zero_in_the_first_bucket() -> None:
    assert pdb.bucket_quantile({0.01: 4.0, 0.1: 4.0, float("inf"): 4.0}, 50) == pytest.approx(0.005)
    assert pdb.bucket_quantile({0.01: 0.0, 0.1: 10.0}, 90) == pytest.approx(0.01 + 0.09 * 0.9)
    assert pdb.bucket_quantile({0.01: 0.0, float("inf"): 0.0}, 50) is None
    assert pdb.bucket_quantile({}, 50) is None


def test_mean_of_an_empty_histogram_is_none() -> None:
    assert pdb.mean({"count": 0.0, "sum": 0.0, "buckets": {}}) is None
    assert pdb.mean({"count": 4.0, "sum": 1.0, "buckets": {}}) == 0.25


def test_cpu_seconds_reads_utime_and_stime_after_a_command_with_spaces() -> None:
    stat = "1234 (python -m x) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 5 0 100 4000000 300 18446744073709551615"
    assert pdb.cpu_seconds(stat, 100.0) == pytest.approx(3.25)


def rec(i: int, status: int | None = 200, first: float | None = 0.5, end: float = 2.0, tokens: int = 16,
        text: str | None = "abc", error: str | None = None, send: float = 0.0, code: str | None = None
        ) -> dict[str, Any]:
    return {"index": i, "status": status, "error": error, "code": code, "send_s": send, "first_byte_s": first,
            "end_s": end, "completion_tokens": tokens, "text": text, "scheduled_s": send}


def test_ttft_split_leaves_the_rest_outside_the_schedulers() -> None:
    assert pdb.ttft_split(1.0, {"prefill": 0.6, "decode": 0.1}) == pytest.approx(
        {"client": 1.0, "prefill": 0.6, "decode": 0.1, "rest": 0.3})
    assert pdb.ttft_split(1.0, {"prefill": None, "decode": 0.1})["rest"] is None
    assert pdb.ttft_split(None, {"single": 0.2})["rest"] is None


def test_client_ttft_mean_counts_only_requests_with_a_first_token() -> None:
    assert pdb.client_ttft_mean([rec(0, first=0.4), rec(1, first=0.8), rec(2, status=503, first=None)]) == \
        pytest.approx(0.6)
    assert pdb.client_ttft_mean([rec(0, status=None, first=None)]) is None


def test_run_figures_of_the_pair() -> None:
    records = [rec(0, first=0.5, end=2.0), rec(1, first=4.0, end=5.0, send=0.5), rec(2, status=503, first=None,
                                                                                     error="waited", code="queue_timeout")]
    deltas = pdb.metrics_delta(pdb.worker_metrics(BEFORE), pdb.worker_metrics(AFTER))
    f = pdb.run_figures("pd", 1, records, 10.0, {"prefill": deltas, "decode": deltas})
    assert f["arm"] == "pd" and f["rep"] == 1 and (f["ok"], f["n"]) == (2, 3)
    assert f["kinds"] == {"ok": 2, "refused": 1} and f["reasons"] == {"503 queue_timeout": 1}
    assert f["meets"] == 1 and f["slo_goodput"] == pytest.approx(0.1)  # the second's TTFT is 3.5 s
    assert f["workers"]["decode"] == {"steps": 100.0, "step_s": 30.0, "ttft_mean_s": pytest.approx(0.3)}
    assert f["split"]["client"] == pytest.approx(2.0) and f["split"]["rest"] == pytest.approx(1.4)
    assert f["transfer"]["reads"] == 10
    single = pdb.run_figures("single", 1, records, 10.0, {"single": deltas})
    assert "transfer" not in single and set(single["split"]) == {"client", "single", "rest"}


def test_same_outputs_compares_only_requests_both_answered() -> None:
    a = [rec(0, text="x"), rec(1, text="y"), rec(2, status=503, text=None), rec(3, text="z", tokens=3)]
    b = [rec(0, text="x"), rec(1, text="q"), rec(2, text="w"), rec(3, text="z", tokens=4)]
    assert pdb.same_outputs(a, b) == {"compared": 3, "identical": 1, "differ": [1, 3]}
    row = pdb.probe_row(32, a[0], b[0])
    assert row["identical"] and row["single_outcome"] == row["pd_outcome"] == "ok"
    assert row["single_ttft_s"] == 0.5
    failed = pdb.probe_row(32, a[0], rec(0, status=503, first=None, text=None, error="no"))
    assert not failed["identical"] and failed["pd_outcome"] == "refused" and failed["pd_ttft_s"] is None


def arm_run(goodput: float, ttft50: float, tpot50: float, pd: bool, kinds: dict[str, int] | None = None
            ) -> dict[str, Any]:
    roles = ("prefill", "decode") if pd else ("single",)
    out: dict[str, Any] = {
        "slo_goodput": goodput, "meets": 10, "ok": 12, "n": 12, "tok_s": 5.0, "ttft_p50": ttft50, "ttft_p99": ttft50 * 2,
        "tpot_p50": tpot50, "tpot_p99": tpot50 * 2, "lat_p50": 1.0, "lat_p99": 2.0, "kinds": kinds or {"ok": 12},
        "reasons": {"503 queue_timeout": (kinds or {}).get("refused", 0)} if (kinds or {}).get("refused") else {},
        "split": {"client": ttft50, **{r: ttft50 / 2 for r in roles}, "rest": 0.05}, "wall_s": 60.0,
        "cpu_s": {r: 40.0 for r in roles}, "workers": {r: {"step_s": 30.0} for r in roles}}
    if pd:
        out["transfer"] = {"reads": 12, "mean_s": 0.006, "p50_s": 0.005, "p99_s": 0.02, "bytes": 12 * 3e6,
                           "bytes_per_read": 3e6}
    return out


def reps() -> list[dict[str, Any]]:
    return [{"rep": i, "order": ["single", "pd"] if i % 2 == 0 else ["pd", "single"],
             "arms": {"single": arm_run(0.8, 0.3, 0.02, False), "pd": arm_run(g, 0.9, 0.06, True, k)},
             "outputs": {"compared": 10, "identical": 10 - i, "differ": list(range(i))}}
            for i, (g, k) in enumerate([(0.6, {"ok": 11, "refused": 1}), (0.4, {"ok": 12}), (0.8, {"refused": 2})])]


def test_aggregate_takes_medians_ratios_per_repetition_and_sums_outcomes() -> None:
    agg = pdb.aggregate(reps())
    assert agg["single"]["slo_goodput"] == pytest.approx(0.8) and agg["pd"]["slo_goodput"] == pytest.approx(0.6)
    assert agg["ratios"]["slo_goodput"] == pytest.approx([0.75, 0.5, 1.0])
    assert agg["ratio"]["slo_goodput"] == pytest.approx(0.75)
    assert agg["ratio"]["ttft_p50"] == pytest.approx(3.0) and agg["ratio"]["tpot_p99"] == pytest.approx(3.0)
    assert agg["pd"]["kinds"] == {"ok": 23, "refused": 3} and agg["pd"]["reasons"] == {"503 queue_timeout": 3}
    assert agg["pd"]["transfer"]["bytes_per_read"] == 3e6 and agg["pd"]["cpu_s"] == {"prefill": 40.0, "decode": 40.0}
    assert agg["trace_outputs"] == {"compared": 30, "identical": 27}


def doc() -> dict[str, Any]:
    rs = reps()
    split = {"single": {"client": 0.3, "single": 0.28, "rest": 0.02},
             "pd": {"client": 0.65, "prefill": 0.59, "decode": 0.043, "rest": 0.017}}
    probe = {"prompts": [{"prompt_tokens": 32, "single_ttft_s": 0.135, "pd_ttft_s": 0.241, "identical": True},
                         {"prompt_tokens": 512, "single_ttft_s": 0.592, "pd_ttft_s": None, "identical": False}],
             "split": split, "transfer": {"mean_s": 0.0029, "bytes": 11_452_416}, "prompt_tokens": 932,
             "bytes_per_prompt_token": 12_288.0}
    return {"command": "make bench-pd", "date": "2026-12-07T00:00:00Z", "machine": "AMD EPYC, 2 cores",
            "elapsed_s": 480.0, "idle_cpu_per_s": {"single": 0.01, "prefill": 0.89, "decode": 0.99},
            "agent_idle_cpu_per_s": {"prog_thread": 1.0, "no_prog_thread": 0.0},
            "config": {"preset": "small", "single_threads": 2, "pair_threads": 1, "env": {"MOEGUARD_X": "1"},
                       "kv_bytes_per_token": 12_288, "kv_shape": "6 layers x 4 KV heads x 64",
                       "traffic": {"window_s": 480.0, "thin": 48, "time_compression": 8.0, "length_scale": 0.25,
                                   "max_new_tokens_cap": 32, "max_context": 2047},
                       "duration_s": 60.0, "requests": 47, "reps": 3, "slo": {"ttft_s": 3.0, "tpot_s": 0.25},
                       "request_timeout_s": 15.0, "drain_s": 15.0, "probe_lengths": [32, 512], "probe_max_tokens": 16,
                       "warmup_requests": 3},
            "probe": probe, "reps": rs, "aggregate": pdb.aggregate(rs)}


def test_render_states_the_caveat_and_quotes_the_figures() -> None:
    md = pdb.render(doc())
    assert "**On this machine disaggregation cannot win on speed.**" in md
    assert "- **Speed: the pair is behind** at 0.60 vs 0.80 req/s of SLO goodput (0.75×)" in md
    assert "| single | 0.80 | 10 / 12 / 12 | 0.30 s / 0.60 s | 20 ms / 40 ms | 1.00 s / 2.00 s | ok 36 |" in md
    assert "| ok 23, refused 3 (503 queue_timeout 3) |" in md
    assert "| **pd / single** | **0.75×** | | 3.00× / 3.00× | 3.00× / 3.00× | | |" in md
    assert "| 12 | 6.0 ms | 5.0 ms / 20.0 ms | 2.86 MiB | 450 ms | 50 ms (single: 50 ms) |" in md
    assert "12,288 bytes per prompt token: k and v of 6 layers x 4 KV heads x 64" in md
    assert "the prefill call's HTTP round trip adds -3 ms unloaded, +0 ms under the trace's load" in md
    assert "identical in 1 of 2; trace requests answered by both arms: 27 of 30 identical" in md
    assert "| 512 | 592 ms | — | — | **no** |" in md
    assert "| pd | decode | 60.0 | 40.0 | 30.0 | 0.99 |" in md
    assert "| 1 | pd, single | 0.80, 0.30 s, 20 ms | 0.40, 0.90 s, 60 ms | 0.50× | 12, 6.0 ms |" in md
    assert "every 48th request (47 requests in 60 s, 0.78 req/s)" in md
    assert "Whole run: 8.0 min." in md


def test_a_ratio_near_one_reads_level() -> None:
    from bench.pd_bench import _more_or_less

    assert _more_or_less(0.998, "ahead", "behind") == "level with the single worker"
    assert _more_or_less(1.05, "ahead", "behind") == "ahead"
    assert _more_or_less(0.81, "ahead", "behind") == "behind"
    assert _more_or_less(None, "ahead", "behind") == "—"
