"""PYTORCH_CUDA_ALLOC_CONF read and edited as PyTorch parses it (issue 29, item 4: :mod:`diagnosis.alloc_conf`)."""

from __future__ import annotations

import pytest

from moeguard_operator.diagnosis.alloc_conf import expandable_segments, split_options, turn_on

pytestmark = pytest.mark.unit


def test_split_keeps_bracketed_lists_whole_and_drops_empty_items() -> None:
    assert split_options("roundup_power2_divisions:[256:1,512:2,>:8], max_split_size_mb:64,,") == [
        "roundup_power2_divisions:[256:1,512:2,>:8]", "max_split_size_mb:64"]
    assert split_options("") == []


@pytest.mark.parametrize(("value", "setting"), [
    ("", None), ("max_split_size_mb:128", None), ("expandable_segments:True", "True"),
    (" expandable_segments : False ,max_split_size_mb:128", "False"),
    ("expandable_segments:False,expandable_segments:True", "True"),  # the last one wins
])
def test_expandable_segments_reads_the_option(value: str, setting: str | None) -> None:
    assert expandable_segments(value) == setting


@pytest.mark.parametrize(("value", "new"), [
    ("", "expandable_segments:True"),
    ("max_split_size_mb:128,garbage_collection_threshold:0.6",
     "max_split_size_mb:128,garbage_collection_threshold:0.6,expandable_segments:True"),
    ("garbage_collection_threshold:0.6,expandable_segments:False,max_split_size_mb:128",
     "garbage_collection_threshold:0.6,expandable_segments:True,max_split_size_mb:128"),
    ("expandable_segments:true", "expandable_segments:True"),  # PyTorch accepts only True/False
])
def test_turn_on_edits_only_expandable_segments(value: str, new: str) -> None:
    assert turn_on(value) == new
