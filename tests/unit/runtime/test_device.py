"""MOEGUARD_DEVICE / MOEGUARD_DTYPE plumbing.

This machine has no GPU: the CPU tests check that the device and dtype reach
every tensor the engine creates (a torch function mode records any factory
call in a step that leaves ``device=`` to the default, i.e. the CPU), and that
bfloat16 serves end to end. ``test_cuda_end_to_end`` runs only where CUDA is
available (``bench/gpu.sh`` runs it).
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from moeguard_core import contract, presets
from moeguard_runtime.api import tokenizer
from moeguard_runtime.config import ConfigError, load_settings, resolve_device, resolve_dtype
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.model.model import build_model
from moeguard_runtime.model.moe import DEFAULT_EXPERT_CHUNK_TOKENS, MOEFeedForward

pytestmark = pytest.mark.unit
CUDA = torch.cuda.is_available()


def test_auto_resolves_by_cuda_availability() -> None:
    assert resolve_device(None, cuda_available=False) == "cpu"
    assert resolve_device("auto", cuda_available=True) == "cuda"
    assert resolve_device(" CPU ", cuda_available=True) == "cpu"
    assert resolve_dtype(None, "cpu") == "float32"
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("bf16", "cpu") == "bfloat16"
    assert resolve_dtype("fp16", "cpu") == "float16"
    assert resolve_dtype("float32", "cuda") == "float32"


def test_settings_default_here_and_errors_name_the_variable() -> None:
    s = load_settings({})
    assert (s.device, s.dtype) == (("cuda", "bfloat16") if CUDA else ("cpu", "float32"))
    s = load_settings({contract.ENV_DEVICE: "cpu", contract.ENV_DTYPE: "bfloat16"})
    assert (s.torch_device, s.torch_dtype) == (torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ConfigError, match=r"MOEGUARD_DEVICE='tpu' must be auto, cpu, cuda or cuda:N"):
        load_settings({contract.ENV_DEVICE: "tpu"})
    with pytest.raises(ConfigError, match=r"MOEGUARD_DTYPE='int8' must be auto or one of float32"):
        load_settings({contract.ENV_DTYPE: "int8"})
    with pytest.raises(ConfigError, match=r"MOEGUARD_DEVICE='cuda': torch.cuda.is_available\(\) "
                                          r"is False"):
        resolve_device("cuda", cuda_available=False)


class FactoryAudit(TorchFunctionMode):
    """Records every tensor factory call (``torch.tensor``, ``zeros``, ``arange`` ...,
    the functions ``torch.device(...)`` as a context manager would redirect) made
    without an explicit ``device=``: such a tensor lands on the CPU whatever
    ``MOEGUARD_DEVICE`` says."""

    def __init__(self) -> None:
        super().__init__()
        self.missing: list[str] = []
        self.constructors = _device_constructors()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self.constructors and kwargs.get("device") is None:
            frame = traceback.extract_stack(limit=2)[0]  # the caller
            self.missing.append(f"{func.__name__} at {frame.filename}:{frame.lineno}")
        return func(*args, **kwargs)


def _run(engine: Engine, prompts: dict[str, list[int]], n: int, **kw: Any) -> dict[str, list[int]]:
    for sid, p in prompts.items():
        engine.add(sid, p, n, **kw)
    engine.step([(sid, len(p)) for sid, p in prompts.items()], [])
    while live := [s for s in prompts if engine.sequences[s].finish_reason is None]:
        engine.step([], live)
    return {s: engine.sequences[s].generated for s in prompts}


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_every_tensor_the_engine_creates_names_its_device(capacity_factor: float) -> None:
    """No factory call in a step (model, MoE dispatch with and without capacity,
    KV caches, sampling) leaves its device to the default; the caches and the
    generators are on the engine's device, which is the weights'."""
    model = build_model(presets.get_preset("tiny"), seed=3, capacity_factor=capacity_factor)
    engine = Engine(model)
    prompts = {"a": tokenizer.encode("Hello there"), "b": tokenizer.encode("MoE")}
    reference = _run(Engine(model), prompts, 6, temperature=0.0)
    with FactoryAudit() as audit:
        got = _run(engine, prompts, 6, temperature=0.0)
        sampled = _run(engine, {"c": prompts["a"]}, 4, temperature=1.0, seed=9)
    assert audit.missing == []
    assert got == reference
    assert len(sampled["c"]) >= 1
    for seq in engine.sequences.values():
        assert seq.cache.k.device == seq.cache.v.device == engine.device == torch.device("cpu")
        assert seq.generator.device == engine.device


def test_a_forgotten_device_is_caught() -> None:
    """The audit has teeth: a tensor created without ``device=`` in the step is named."""
    model = build_model(presets.get_preset("tiny"), seed=3)
    engine = Engine(model)
    engine.add("a", [1, 2, 3], 2)
    real = engine.model.forward

    def forgetful(tokens: torch.Tensor, positions: torch.Tensor, segments: Any) -> Any:
        return real(torch.tensor(tokens.tolist()), positions, segments)

    engine.model.forward = forgetful  # type: ignore[method-assign]
    with FactoryAudit() as audit:
        engine.step([("a", 3)], [])
    assert len(audit.missing) == 1 and audit.missing[0].startswith("tensor at ")
    assert "test_device.py" in audit.missing[0]


def test_bfloat16_end_to_end_on_cpu() -> None:
    settings = load_settings({contract.ENV_DEVICE: "cpu", contract.ENV_DTYPE: "bfloat16"})
    args = presets.get_preset("tiny")
    model = build_model(args, seed=7, dtype=settings.torch_dtype, device=settings.torch_device)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.angles.dtype == torch.float32  # rotary angles never rounded to bf16
    router_dtypes: list[torch.dtype] = []

    def spy(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        from moeguard_runtime.model.moe import route

        router_dtypes.append(route(module.gate(inputs[0]), module.top_k)[0].dtype)  # type: ignore[operator, arg-type]

    ff = model.layers[0].feed_forward
    assert isinstance(ff, MOEFeedForward) and ff.expert_chunk_tokens == DEFAULT_EXPERT_CHUNK_TOKENS
    ff.register_forward_hook(spy)
    engine = Engine(model)
    assert (engine.dtype, engine.device) == (torch.bfloat16, torch.device("cpu"))
    out = _run(engine, {"a": tokenizer.encode("Hello, bf16")}, 8, temperature=0.0)
    assert 1 <= len(out["a"]) <= 8 and all(0 <= t < args.vocab_size for t in out["a"])
    assert engine.sequences["a"].cache.k.dtype == torch.bfloat16
    assert router_dtypes and set(router_dtypes) == {torch.float32}
    # bf16 follows the float32 model: the first greedy token agrees.
    fp32 = _run(Engine(build_model(args, seed=7)), {"a": tokenizer.encode("Hello, bf16")}, 1)
    assert fp32["a"][0] == out["a"][0]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (bench/gpu.sh runs this on a GPU)")
def test_cuda_end_to_end() -> None:  # pragma: no cover - no GPU in CI
    from moeguard_runtime.memory.procmem import read_device_memory

    settings = load_settings({})
    assert (settings.device, settings.dtype) == ("cuda", "bfloat16")
    model = build_model(presets.get_preset("tiny"), seed=7, dtype=settings.torch_dtype,
                        device=settings.torch_device)
    engine = Engine(model)
    before = read_device_memory(settings.device)
    assert before is not None and before.allocated > 0
    prompts = {"a": tokenizer.encode("Hello GPU"), "b": tokenizer.encode("MoE on CUDA")}
    with FactoryAudit() as audit:
        out = _run(engine, prompts, 8, temperature=0.0)
        _run(engine, {"c": prompts["a"]}, 4, temperature=0.8, seed=3)
    assert audit.missing == []
    assert all(1 <= len(v) <= 8 for v in out.values())
    for seq in engine.sequences.values():
        assert seq.cache.k.device.type == "cuda" and seq.cache.k.dtype == torch.bfloat16
        assert seq.generator.device.type == "cuda"
    assert model.angles.device.type == "cuda" and model.angles.dtype == torch.float32
    during = read_device_memory(settings.device)
    assert during is not None and during.allocated > before.allocated  # the KV caches
    assert during.used >= during.reserved >= during.allocated
    assert read_device_memory("cpu") is None


@pytest.mark.parametrize("port", ["0", "99999", "-1"])
def test_a_port_outside_tcp_range_is_a_config_error(port: str) -> None:
    with pytest.raises(ConfigError, match="MOEGUARD_PORT"):
        load_settings({contract.ENV_PORT: port})
