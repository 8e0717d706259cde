"""The `moeguard` CLI: plan's arithmetic, and that every subcommand reaches the code it wraps."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moeguard_cli import __main__ as cli
from moeguard_cli.plan import MiB, PlanInput, estimate
from moeguard_runtime.presets import ModelArgs, parameter_count

pytestmark = pytest.mark.unit
runner = CliRunner()

SHAPE = ModelArgs(n_layer=2, dim=64, n_head=4, n_kv_head=2, intermediate_size=128, num_experts=8, top_k=2,
                  max_seq_len=1024)


def test_plan_arithmetic_by_hand() -> None:
    p = estimate(PlanInput(args=SHAPE, memory_bytes=2048 * MiB, dtype="bfloat16", skew=2.0, headroom=0.1,
                           overhead_bytes=512 * MiB, prefill_fraction=0.3, concurrent_batches=2))
    assert p.weights_bytes == parameter_count(SHAPE) * 2
    assert p.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # K,V x layers x kv heads x head_dim x bytes = 256
    # top share = min(2 x 2 / 8, 1) = 0.5; elements = 128 + (64 + 64) + 256 + 0.5 x 384 = 704
    assert p.activation_bytes_per_prefill_token == 704 * 2 + 8 * 4
    available = 2048 * MiB - p.weights_bytes - 512 * MiB - int(2048 * MiB * 0.1)
    assert p.available_bytes == available
    assert p.max_prefill_tokens == int(available * 0.3 / 2 / 1440) // 16 * 16
    assert p.max_prefill_tokens % 16 == 0
    assert p.max_decode_tokens == int(available * 0.7 / 256 // 1024)
    assert p.floor_prefill_tokens == p.max_prefill_tokens // 8 // 16 * 16
    assert p.fits


def test_plan_skew_and_concurrency_shrink_prefill() -> None:
    base = PlanInput(args=SHAPE, memory_bytes=2048 * MiB)
    calm = estimate(PlanInput(**{**base.__dict__, "skew": 1.0}))
    skewed = estimate(PlanInput(**{**base.__dict__, "skew": 4.0}))
    single = estimate(PlanInput(**{**base.__dict__, "concurrent_batches": 1}))
    assert skewed.activation_bytes_per_prefill_token > calm.activation_bytes_per_prefill_token
    assert skewed.max_prefill_tokens < calm.max_prefill_tokens
    assert single.max_prefill_tokens >= 2 * estimate(base).max_prefill_tokens - 16


def test_plan_does_not_fit() -> None:
    p = estimate(PlanInput(args=SHAPE, memory_bytes=256 * MiB))
    assert not p.fits and p.max_prefill_tokens == 0


def test_cli_plan_prints_budgets_and_arithmetic() -> None:
    res = runner.invoke(cli.app, ["plan", "--memory", "2Gi", "--preset", "tiny"])
    assert res.exit_code == 0, res.output
    assert "maxPrefillTokens:" in res.output and "KV cache per token" in res.output
    res = runner.invoke(cli.app, ["plan", "--memory", "100Mi"])
    assert res.exit_code == 1 and "does not fit" in res.output
    res = runner.invoke(cli.app, ["plan", "--memory", "2Gi", "--preset", "nope"])
    assert res.exit_code == 2 and "unknown model preset" in res.output
    res = runner.invoke(cli.app, ["plan", "--memory", "2Gi", "--shape", "dim=128,n_layer=4"])
    assert res.exit_code == 0, res.output


def test_cli_operator_run_passes_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    import moeguard_operator.__main__ as op_main
    monkeypatch.setattr(op_main, "main", lambda argv: seen.append(argv))
    res = runner.invoke(cli.app, ["operator", "run", "-A", "--standalone", "--log-level", "DEBUG"])
    assert res.exit_code == 0, res.output
    assert seen == [["-A", "--standalone", "--log-level", "DEBUG"]]


def test_cli_worker_serve_sets_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import moeguard_runtime.__main__ as rt_main
    from moeguard_runtime import contract
    env: dict[str, str | None] = {}

    def fake() -> int:
        import os
        env.update(preset=os.environ.get(contract.ENV_MODEL_PRESET), port=os.environ.get(contract.ENV_PORT))
        return 0
    monkeypatch.setattr(rt_main, "main", fake)
    monkeypatch.delenv(contract.ENV_MODEL_PRESET, raising=False)
    monkeypatch.delenv(contract.ENV_PORT, raising=False)
    res = runner.invoke(cli.app, ["worker", "serve", "--preset", "tiny", "--port", "18123"])
    assert res.exit_code == 0, res.output
    assert env == {"preset": "tiny", "port": "18123"}


def test_cli_bench_passes_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.loadgen.__main__ as lg
    seen: list[list[str]] = []
    monkeypatch.setattr(lg, "main", lambda argv: seen.append(argv) or 0)
    res = runner.invoke(cli.app, ["bench", "burst", "--url", "http://127.0.0.1:1", "-n", "2"])
    assert res.exit_code == 0, res.output
    assert seen == [["burst", "--url", "http://127.0.0.1:1", "-n", "2"]]


def test_cli_demo_runs_the_script(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    res = runner.invoke(cli.app, ["demo", "--keep"])
    assert res.exit_code == 0, res.output
    assert calls[0][1].endswith("hack/demo.py") and calls[0][2:] == ["--keep"]


def test_cli_help_lists_every_command() -> None:
    res = runner.invoke(cli.app, ["--help"])
    for name in ("operator", "worker", "demo", "bench", "plan"):
        assert name in res.output
