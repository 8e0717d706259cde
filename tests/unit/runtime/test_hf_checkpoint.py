"""HF checkpoint folders: sharded loading, start-up errors that name the file and the tensor."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moeguard_runtime.model.checkpoint import CheckpointError
from moeguard_runtime.model.hf_checkpoint import (
    LoadedCheckpoint,
    load_hf_checkpoint,
    read_checkpoint_info,
)
from moeguard_runtime.model.hf_config import is_hf_folder
from moeguard_runtime.model.model import Segment

pytestmark = pytest.mark.unit

CONFIG = {"model_type": "mixtral", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
          "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 128,
          "rope_theta": 1e6, "rms_norm_eps": 1e-5, "eos_token_id": 2}


def mixtral_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under HF ``MixtralForCausalLM`` names, shaped by :data:`CONFIG`."""
    gen = torch.Generator().manual_seed(seed)
    d, v, inter, hd = 32, 300, 48, 8
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d),
                                          "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (4 * hd, d), p + "self_attn.k_proj.weight": (2 * hd, d),
                   p + "self_attn.v_proj.weight": (2 * hd, d), p + "self_attn.o_proj.weight": (d, 4 * hd),
                   p + "block_sparse_moe.gate.weight": (4, d), p + "input_layernorm.weight": (d,),
                   p + "post_attention_layernorm.weight": (d,)}
        for e in range(4):
            q = f"{p}block_sparse_moe.experts.{e}."
            shapes |= {q + "w1.weight": (inter, d), q + "w2.weight": (d, inter), q + "w3.weight": (inter, d)}
    return {n: torch.randn(s, generator=gen) / s[-1] ** 0.5 for n, s in shapes.items()}


def write_folder(folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, object] | None = None,
                 shards: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(folder / file))
        weight_map |= dict.fromkeys(part, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def last_logits(loaded: LoadedCheckpoint, tokens: list[int]) -> torch.Tensor:
    cache = loaded.model.new_cache(len(tokens), torch.float32, "cpu")
    with torch.inference_mode():
        out, _ = loaded.model(torch.tensor(tokens), torch.arange(len(tokens)),
                              [Segment(cache, 0, len(tokens))])
    return out


def test_sharded_folder_loads_the_same_model(tmp_path: Path) -> None:
    tensors = mixtral_tensors()
    single = load_hf_checkpoint(write_folder(tmp_path / "one", tensors))
    sharded = load_hf_checkpoint(write_folder(tmp_path / "three", tensors, shards=3))
    assert is_hf_folder(tmp_path / "three") and not is_hf_folder(tmp_path / "none")
    torch.testing.assert_close(last_logits(single, [1, 5, 299]), last_logits(sharded, [1, 5, 299]),
                               rtol=0, atol=0)
    assert sharded.model_type == "mixtral" and sharded.max_seq_len == 128
    assert sharded.eos_token_ids == (2,)
    assert sharded.model.args.vocab_size == 300  # type: ignore[attr-defined]


def test_eos_ids_prefer_generation_config(tmp_path: Path) -> None:
    folder = write_folder(tmp_path, mixtral_tensors())
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert read_checkpoint_info(folder).eos_token_ids == (2, 7)


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def f(t: dict[str, torch.Tensor]) -> None:
        del t[name]
    return f


def _reshape(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def f(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.zeros(3, 32)
    return f


def _extra(t: dict[str, torch.Tensor]) -> None:
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)


@pytest.mark.parametrize(("mutate", "message"), [
    (_drop("model.layers.1.block_sparse_moe.experts.3.w2.weight"),
     r"tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight' is missing"),
    (_reshape("model.layers.0.block_sparse_moe.gate.weight"),
     r"model\.safetensors: tensor 'model\.layers\.0\.block_sparse_moe\.gate\.weight' has shape "
     r"\(3, 32\), config\.json implies \(4, 32\)"),
    (_extra, r"model\.safetensors: unexpected tensor 'model\.layers\.0\.self_attn\.rotary_emb\.inv_freq'"),
], ids=["missing", "shape", "extra"])
def test_tensor_errors_name_file_and_tensor(tmp_path: Path, mutate: Callable[[dict[str, torch.Tensor]], None],
                                            message: str) -> None:
    tensors = mixtral_tensors()
    mutate(tensors)
    with pytest.raises(CheckpointError, match=message):
        load_hf_checkpoint(write_folder(tmp_path, tensors))


def test_file_errors(tmp_path: Path) -> None:
    sharded = write_folder(tmp_path / "sharded", mixtral_tensors(), shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"index\.json: shard model-00002-of-00002\.safetensors "
                                              r"is missing \(it holds 'model\."):
        load_hf_checkpoint(sharded)

    truncated = write_folder(tmp_path / "truncated", mixtral_tensors())
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated/model\.safetensors: not a readable safetensors"):
        load_hf_checkpoint(truncated)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors file"):
        load_hf_checkpoint(empty)


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "llama"}, r"config\.json: model_type 'llama' is not supported; supported: "
                              r"deepseek_v3, mixtral, olmoe, qwen2_moe, qwen3_moe"),
    ({"num_hidden_layers": None}, r"config\.json: num_hidden_layers is missing"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"config\.json: rope_scaling rope_type 'yarn' is not supported"),
    ({"head_dim": 16}, r"config\.json: head_dim 16 must be hidden_size / num_attention_heads"),
    ({"hidden_act": "gelu"}, r"config\.json: hidden_act 'gelu' is not supported"),
    ({"quantization_config": {"quant_method": "fp8"}},
     r"config\.json: quantization_config \('fp8'\) is not supported"),
])
def test_config_errors_name_the_key(tmp_path: Path, change: dict[str, object], message: str) -> None:
    config = {k: v for k, v in {**CONFIG, **change}.items() if v is not None}
    with pytest.raises(CheckpointError, match=message):
        load_hf_checkpoint(write_folder(tmp_path, mixtral_tensors(), config))


def test_sliding_window_caps_the_context(tmp_path: Path) -> None:
    folder = write_folder(tmp_path, mixtral_tensors(), {**CONFIG, "sliding_window": 64})
    assert read_checkpoint_info(folder).max_seq_len == 64


def test_runtime_never_imports_transformers() -> None:
    """``transformers`` is the tests' reference only: no worker module imports it."""
    import moeguard_runtime

    root = Path(moeguard_runtime.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "transformers" for n in names), path


DEEPSEEK = {"model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 48,
            "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_group": 4, "topk_group": 2, "kv_lora_rank": 16, "q_lora_rank": None,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
            "max_position_embeddings": 128}


@pytest.mark.parametrize(("change", "message"), [
    ({"n_group": 3}, r"config\.json: n_group 3 must split n_routed_experts \(8\) into groups"),
    ({"topk_group": 5}, r"config\.json: topk_group 5 must be in 1\.\.n_group \(4\)"),
    ({"num_experts_per_tok": 9}, r"config\.json: num_experts_per_tok 9 must be in 1\.\.8"),
    ({"qk_rope_head_dim": 7}, r"config\.json: head_dim 7 must be even"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "num_key_value_heads": 3},
     r"config\.json: num_key_value_heads 3 must divide num_attention_heads \(4\)"),
])
def test_family_config_errors(tmp_path: Path, change: dict[str, object], message: str) -> None:
    folder = write_folder(tmp_path, {"model.norm.weight": torch.ones(32)}, {**DEEPSEEK, **change})
    with pytest.raises(CheckpointError, match=message):
        load_hf_checkpoint(folder)


def test_worker_start_up_fails_naming_the_file(tmp_path: Path) -> None:
    """``__main__._load`` with a truncated HF folder: a model_load_error naming the file, the
    failure flag set (the process exits 3), no worker started."""
    import threading

    from moeguard_runtime.__main__ import _load
    from moeguard_runtime.api.server import WorkerSlot
    from moeguard_runtime.config import load_settings, model_args
    from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

    folder = write_folder(tmp_path, mixtral_tensors())
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:100])
    settings = load_settings({"MOEGUARD_CHECKPOINT_PATH": str(folder)})
    lines: list[tuple[str, dict[str, object]]] = []

    class Logger:
        def info(self, event: str, **kw: object) -> None:
            lines.append((event, kw))

    slot = WorkerSlot(Telemetry({"moeis": "s", "namespace": "n", "pod": "p"}, 4), "m", 128)
    failed = threading.Event()
    _load(settings, model_args(settings), slot, RateLimitedLog(0.0, logger=Logger()), failed, {})
    assert failed.is_set() and slot.worker is None
    event, fields = lines[-1]
    assert event == "model_load_error"
    assert "model.safetensors: not a readable safetensors file" in str(fields["error"])
