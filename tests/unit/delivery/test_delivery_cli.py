"""The `moeguard` CLI: plan's arithmetic, and that every subcommand reaches the code it wraps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moeguard_cli import __main__ as cli
from moeguard_cli.plan import MiB, PlanInput, estimate
from moeguard_core.presets import ModelArgs, parameter_count

pytestmark = pytest.mark.unit
runner = CliRunner(env={"COLUMNS": "400"})  # no wrapping inside long tmp paths (pytest-xdist makes them longer)

SHAPE = ModelArgs(n_layer=2, dim=64, n_head=4, n_kv_head=2, intermediate_size=128, num_experts=8, top_k=2,
                  max_seq_len=1024)


def test_plan_arithmetic_by_hand() -> None:
    from moeguard_core.memory_model import (
        kv_bytes_per_token,
        top_share_from_skew_ratio,
        worst_case_peak,
    )

    p = estimate(PlanInput(args=SHAPE, memory_bytes=2048 * MiB, dtype="bfloat16", skew=2.0, headroom=0.1,
                           overhead_bytes=512 * MiB, prefill_fraction=0.3, concurrent_batches=2))
    assert p.weights_bytes == parameter_count(SHAPE) * 2
    assert p.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # K,V x layers x kv heads x head_dim x bytes = 256
    assert p.top_share == pytest.approx(2 / 9)  # skew / (skew + E - 1)
    available = 2048 * MiB - p.weights_bytes - 512 * MiB - int(2048 * MiB * 0.1)
    assert p.available_bytes == available
    assert p.max_prefill_tokens % 16 == 0
    shape = SHAPE
    share = top_share_from_skew_ratio(2.0, 8, 2)
    provisional = int(available * 0.7 / (256 * 1024)) // 2
    peak = worst_case_peak(shape, p.max_prefill_tokens, provisional, 0, share, "bfloat16")[0]
    assert peak == p.step_peak_bytes <= available * 0.3
    # the tiny shape's budget is bound by max_seq_len, not by memory
    assert p.max_prefill_tokens == 1024
    running = (available - peak) // kv_bytes_per_token(shape, 2) // 1024
    assert p.max_batch_requests == running // 2 == p.max_decode_tokens
    assert p.floor_prefill_tokens == p.max_prefill_tokens // 8 // 16 * 16
    assert p.fits


SMALL = ModelArgs(n_layer=6, dim=512, n_head=8, n_kv_head=4, intermediate_size=1280, num_experts=8, top_k=2,
                  max_seq_len=4096)


def test_plan_prefill_is_the_largest_that_fits() -> None:
    from moeguard_core.memory_model import top_share_from_skew_ratio, worst_case_peak

    p = estimate(PlanInput(args=SMALL, memory_bytes=1344 * MiB, dtype="float32", skew=4.0, headroom=0.0,
                           overhead_bytes=560 * MiB, context_tokens=1536))
    share = top_share_from_skew_ratio(4.0, 8, 2)
    provisional = int(p.available_bytes * 0.7 / (12288 * 1536)) // 2
    budget = p.available_bytes * 0.3
    assert 16 <= p.max_prefill_tokens < 4096
    assert worst_case_peak(SMALL, p.max_prefill_tokens, provisional, 0, share, "float32")[0] <= budget
    assert worst_case_peak(SMALL, p.max_prefill_tokens + 16, provisional, 0, share, "float32")[0] > budget


def test_plan_skew_and_concurrency_shrink_budgets() -> None:
    # a short context and wide experts: the MoE phase, where skew acts, sets the step's peak
    wide = ModelArgs(n_layer=2, dim=256, n_head=4, n_kv_head=4, intermediate_size=4096, num_experts=8, top_k=2,
                     max_seq_len=512)
    base = PlanInput(args=wide, memory_bytes=1024 * MiB, dtype="float32", headroom=0.0, overhead_bytes=560 * MiB,
                     prefill_fraction=0.05, expert_chunk_tokens=1_000_000)
    calm = estimate(PlanInput(**{**base.__dict__, "skew": 1.0}))
    skewed = estimate(PlanInput(**{**base.__dict__, "skew": 50.0}))
    single = estimate(PlanInput(**{**base.__dict__, "concurrent_batches": 1}))
    assert skewed.top_share > calm.top_share
    assert skewed.max_prefill_tokens < calm.max_prefill_tokens
    assert single.max_batch_requests >= 2 * estimate(base).max_batch_requests


def test_plan_does_not_fit() -> None:
    p = estimate(PlanInput(args=SHAPE, memory_bytes=256 * MiB))
    assert not p.fits and p.max_prefill_tokens == 0


def test_cli_plan_context_tokens() -> None:
    full = runner.invoke(cli.app, ["plan", "--memory", "2Gi", "--preset", "tiny"])
    short = runner.invoke(cli.app, ["plan", "--memory", "2Gi", "--preset", "tiny", "--context-tokens", "256"])
    assert full.exit_code == 0 and short.exit_code == 0, short.output

    def requests(out: str) -> int:
        return int(out.split("maxBatchRequests:")[1].split()[0])

    assert requests(short.output) > 3 * requests(full.output)  # KV sized at 256 tokens, not max_seq_len 1024
    res = runner.invoke(cli.app, ["plan", "--memory", "2Gi", "--context-tokens", "0"])
    assert res.exit_code != 0


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


def test_cli_worker_serve_passes_its_options_as_settings_not_through_os_environ(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import moeguard_runtime.__main__ as rt_main
    from moeguard_core import contract
    seen: dict[str, str | None] = {}

    def fake(env: dict[str, str]) -> int:
        seen.update(preset=env.get(contract.ENV_MODEL_PRESET), port=env.get(contract.ENV_PORT),
                    home=env.get("HOME"))
        return 0
    monkeypatch.setattr(rt_main, "main", fake)
    monkeypatch.delenv(contract.ENV_MODEL_PRESET, raising=False)
    monkeypatch.delenv(contract.ENV_PORT, raising=False)
    res = runner.invoke(cli.app, ["worker", "serve", "--preset", "tiny", "--port", "18123"])
    assert res.exit_code == 0, res.output
    assert seen == {"preset": "tiny", "port": "18123", "home": os.environ.get("HOME")}
    assert contract.ENV_MODEL_PRESET not in os.environ and contract.ENV_PORT not in os.environ


def test_cli_bench_runs_the_loadgen_from_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 0)
    res = runner.invoke(cli.app, ["bench", "burst", "--url", "http://127.0.0.1:1", "-n", "2"])
    assert res.exit_code == 0, res.output
    cmd, env = calls[0]
    assert cmd[1:] == ["-m", "harness.loadgen", "burst", "--url", "http://127.0.0.1:1", "-n", "2"]
    assert str(cli.ROOT) in env["PYTHONPATH"].split(os.pathsep)


def test_cli_demo_runs_the_script(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, env: calls.append(cmd) or 0)
    res = runner.invoke(cli.app, ["demo", "--keep"])
    assert res.exit_code == 0, res.output
    assert calls[0][1].endswith("hack/demo.py") and calls[0][2:] == ["--keep"]


def test_cli_checkout_commands_refuse_without_a_checkout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli, "ROOT", tmp_path)
    for command in ("bench", "demo"):
        res = runner.invoke(cli.app, [command, "--help"])
        assert res.exit_code == 2 and "needs a source checkout" in res.output, res.output


def test_installed_cli_imports_nothing_from_the_checkout() -> None:
    """The installed `moeguard` command holds only the product packages: no bench, hack or tests."""
    import ast

    for path in Path(cli.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in {"bench", "hack", "tests"}, f"{path.name} imports {name}"


def test_cli_help_lists_every_command() -> None:
    res = runner.invoke(cli.app, ["--help"])
    for name in ("operator", "worker", "demo", "bench", "plan"):
        assert name in res.output


@pytest.mark.parametrize(("args", "needle"), [
    (["--memory", "1e400"], "memory must be above 0 and below 1Ei"),
    (["--memory", "-1Gi"], "memory must be above 0 and below 1Ei"),
    (["--memory", "8Gi", "--concurrent-batches", "0"], "--concurrent-batches"),
    (["--memory", "8Gi", "--headroom", "-1"], "--headroom"),
    (["--memory", "8Gi", "--skew", "0"], "--skew"),
    (["--memory", "8Gi", "--shape", "dim=66"], "dim (66) must be a multiple of nHead (4)"),
    (["--memory", "8Gi", "--shape", "top_k=99"], "topK (99) must be <= numExperts (8)"),
])
def test_cli_plan_refuses_bad_input_with_a_usage_error(args: list[str], needle: str) -> None:
    result = runner.invoke(cli.app, ["plan", *args])
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.output.split()) or needle in result.output


def test_cli_plan_reads_an_hf_config(tmp_path: Path) -> None:
    """``plan --config``: a DeepSeek-V3-style config.json (MLA, shared expert, dense first layer)."""
    import json

    cfg = {"model_type": "deepseek_v3", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
           "intermediate_size": 1024, "moe_intermediate_size": 128, "n_routed_experts": 16,
           "num_experts_per_tok": 4, "n_shared_experts": 2, "first_k_dense_replace": 1, "kv_lora_rank": 64,
           "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
           "max_position_embeddings": 2048, "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for where in (tmp_path / "config.json", tmp_path):  # the file or its folder
        res = runner.invoke(cli.app, ["plan", "--memory", "4Gi", "--config", str(where), "--dtype", "bfloat16"])
        assert res.exit_code == 0, res.output
        text = " ".join(res.output.split())
        # KV per token: 4 layers x (64 + 16) x 2 B = 640 B, the MLA latent
        assert "640 B" in text and "MLA" in text
        assert "deepseek_v3" in text and "maxPrefillTokens:" in res.output
        assert "shared expert" in text and "dense MLP layer" in text


@pytest.mark.parametrize(("cfg", "needle"), [
    ({"model_type": "llama", "hidden_size": 64}, "model_type 'llama' is not supported"),
    ({"model_type": "mixtral", "hidden_size": 64}, "missing key"),
    ([1, 2], "not a JSON object"),
])
def test_cli_plan_config_errors_name_the_file_and_key(tmp_path: Path, cfg: object, needle: str) -> None:
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    res = runner.invoke(cli.app, ["plan", "--memory", "4Gi", "--config", str(path)])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert needle in text and "config.json" in text
    missing = runner.invoke(cli.app, ["plan", "--memory", "4Gi", "--config", str(tmp_path / "nope.json")])
    assert missing.exit_code == 2 and "cannot read" in " ".join(missing.output.split())
