"""``moeguard_memory_model_info`` (issue 30: the memory model the operator predicts with is the worker's own):
the labels a worker writes read back to the same model, for every family's shape; bad labels are named."""

from __future__ import annotations

import dataclasses

import pytest
from tests.unit.bench.test_memory_model_families import (
    DEEPSEEK_V3,
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    QWEN15_MOE_A27B,
)

from moeguard_core import family_shape as fs
from moeguard_core.family_shape import ConfigError
from moeguard_core.memory_model_info import (
    MEMORY_MODEL_LABELS,
    ModelMemory,
    from_info_labels,
    info_labels,
)
from moeguard_core.presets import get_preset

pytestmark = pytest.mark.unit

SHAPES = [fs.from_model_args(get_preset("small")), *(fs.from_hf_config(c) for c in (
    DEEPSEEK_V3, QWEN3_30B_A3B, QWEN15_MOE_A27B, MIXTRAL_8X7B))]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.model_type)
def test_the_labels_read_back_to_the_same_model(shape: fs.FamilyShape) -> None:
    model = ModelMemory(shape, "bfloat16", 256, 1.25)
    labels = info_labels(model)
    assert tuple(labels) == MEMORY_MODEL_LABELS and all(isinstance(v, str) for v in labels.values())
    assert from_info_labels({**labels, "pod": "w-0", "namespace": "ns"}) == model


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.model_type)
def test_labels_prometheus_dropped_for_being_empty_read_back_as_empty(shape: fs.FamilyShape) -> None:
    """Prometheus stores no empty label (its data model): a family without ``qk_norm`` comes back without it."""
    model = ModelMemory(shape, "float32", 512, 0.0)
    stored = {k: v for k, v in info_labels(model).items() if v != ""}
    assert from_info_labels(stored) == model


def test_the_labels_are_plain_text_prometheus_keeps_as_written() -> None:
    labels = info_labels(ModelMemory(fs.from_hf_config(DEEPSEEK_V3)))
    assert (labels["model_type"], labels["kv_lora_rank"], labels["moe_layers"], labels["tie_embeddings"]) == (
        "deepseek_v3", "512", "58", "false")
    assert (labels["dtype"], labels["expert_chunk_tokens"], labels["capacity_factor"]) == ("float32", "2048", "0.0")


@pytest.mark.parametrize(("change", "named"), [
    ({"dim": None}, "has no label dim"),
    ({"n_layer": "2.5"}, "label n_layer='2.5' does not parse as int"),
    ({"qkv_bias": "yes"}, "label qkv_bias='yes' does not parse as bool"),
    ({"dtype": "int4"}, "label dtype='int4': not one of"),
    ({"capacity_factor": "x"}, "could not convert string to float"),
])
def test_a_label_that_does_not_parse_is_named(change: dict[str, str | None], named: str) -> None:
    labels = info_labels(ModelMemory(SHAPES[0]))
    for key, value in change.items():
        if value is None:
            del labels[key]
        else:
            labels[key] = value
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        from_info_labels(labels)


def test_every_shape_field_is_a_label() -> None:
    assert {f.name for f in dataclasses.fields(fs.FamilyShape)} | {"dtype", "expert_chunk_tokens",
                                                                   "capacity_factor"} == set(MEMORY_MODEL_LABELS)
