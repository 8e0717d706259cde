"""model.materialise and model.embedding: a model built on the meta device gets CPU storage of every parameter's
shape and dtype without torch's Python references (which import dynamo and sympy at a worker's start; the
start itself is measured in tests/integration/worker/test_worker_start_imports.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moeguard_core.presets import PRESETS
from moeguard_runtime.model.model import (
    Transformer,
    build_model,
    embedding,
    init_weights,
    materialise,
)


def test_every_meta_tensor_gets_cpu_storage_of_its_shape_and_dtype() -> None:
    with torch.device("meta"):
        model = Transformer(PRESETS["tiny"])
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}
    materialise(model)
    after = model.state_dict()
    assert {n: (tuple(t.shape), t.dtype) for n, t in after.items()} == shapes
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in after.values())
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in model.parameters())


def test_a_non_contiguous_meta_tensor_is_refused() -> None:
    module = nn.Module()
    module.register_buffer("t", torch.empty(4, 6, device="meta").t())
    with pytest.raises(ValueError, match=r"non-contiguous meta tensor of shape \(6, 4\)"):
        materialise(module)


def test_a_cpu_tensor_is_left_as_it_is() -> None:
    lin = nn.Linear(3, 2)
    before = lin.weight.detach().clone()
    materialise(lin)
    assert torch.equal(lin.weight, before)


def test_the_embedding_is_built_without_drawing_its_weight() -> None:
    with torch.device("meta"):
        emb = embedding(10, 4)
    assert emb.weight.is_meta and tuple(emb.weight.shape) == (10, 4)


def test_off_the_meta_device_the_embedding_is_drawn_as_nn_embedding_draws_it() -> None:
    torch.manual_seed(3)
    ours = embedding(1000, 8).weight
    torch.manual_seed(3)
    assert torch.equal(ours, nn.Embedding(1000, 8).weight)


def test_seeded_weights_equal_those_of_torchs_own_to_empty() -> None:
    """The reference: the same meta model (with nn.Embedding's own init) through ``to_empty`` and init_weights."""
    with torch.device("meta"):
        reference = Transformer(PRESETS["tiny"])
        reference.tok_embeddings = nn.Embedding(PRESETS["tiny"].vocab_size, PRESETS["tiny"].dim)
    reference = reference.to_empty(device="cpu")
    init_weights(reference, 7)
    reference.setup_rope("cpu")
    built = build_model(PRESETS["tiny"], seed=7)
    ref, new = reference.state_dict(), built.state_dict()
    assert ref.keys() == new.keys()
    assert all(torch.equal(ref[k], new[k]) for k in ref), [k for k in ref if not torch.equal(ref[k], new[k])]
