"""The pure parts of the prefill/decode handoff: which bytes of a cache move, the offer's wire form, the
UCX module default, and a prefilled sequence's registration in the engine."""

from __future__ import annotations

import pytest
import torch

from moeguard_core.presets import get_preset
from moeguard_runtime.config import ConfigError, load_settings
from moeguard_runtime.disagg.kv_layout import (
    Region,
    cache_tensors,
    prompt_regions,
    transfer_bytes,
)
from moeguard_runtime.disagg.nixl_kv import KVOffer, ucx_module_defaults
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.engine.generation import GenerationRequest, RemotePrefill
from moeguard_runtime.engine.kv_handoff import KVHandoff
from moeguard_runtime.model.families.deepseek_v3 import MLACache
from moeguard_runtime.model.families.gqa import GQACache
from moeguard_runtime.model.model import build_model

pytestmark = pytest.mark.unit


def _regions_of_slices(t: torch.Tensor, tokens: int) -> list[Region]:
    """The same runs read off the tensor's own slices (the reference)."""
    flat = t.reshape(-1, t.shape[-2], t.shape[-1])
    return [Region(flat[i, :tokens].data_ptr(), flat[i, :tokens].numel() * t.element_size())
            for i in range(flat.shape[0])]


@pytest.mark.parametrize("cache", [
    GQACache(3, 2, 16, 40, torch.float32, "cpu"),
    GQACache(2, 4, 8, 9, torch.bfloat16, "cpu"),
    MLACache(3, 32, 8, 40, torch.float32, "cpu"),
], ids=["gqa-fp32", "gqa-bf16", "mla"])
@pytest.mark.parametrize("tokens", [1, 7, 9])
def test_prompt_regions_are_the_first_positions_of_every_row(cache: GQACache, tokens: int) -> None:
    k, v = cache_tensors(cache)
    got = prompt_regions((k, v), tokens)
    assert got == _regions_of_slices(k, tokens) + _regions_of_slices(v, tokens)
    # the runs hold exactly the prompt's positions: marking them marks those positions only
    for t in (k, v):
        t.zero_()
    for r in got:
        n = r.nbytes // k.element_size()
        for t in (k, v):
            base = t.data_ptr()
            if base <= r.addr < base + t.numel() * t.element_size():
                t.view(-1)[(r.addr - base) // t.element_size():][:n].fill_(1)
    for t in (k, v):
        assert bool(t[..., :tokens, :].eq(1).all()) and bool(t[..., tokens:, :].eq(0).all())
    assert transfer_bytes(cache, tokens) == tokens * (k[..., 0, :].numel() + v[..., 0, :].numel()) * k.element_size()


def test_prompt_regions_refuse_positions_outside_the_cache() -> None:
    cache = GQACache(1, 1, 4, 8, torch.float32, "cpu")
    for tokens in (0, 9):
        with pytest.raises(ValueError, match="positions of a cache of 8"):
            prompt_regions(cache_tensors(cache), tokens)


def test_a_non_contiguous_cache_is_refused() -> None:
    cache = GQACache(2, 3, 4, 8, torch.float32, "cpu")
    cache.k = cache.k.transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        cache_tensors(cache)


def test_offer_round_trips_through_json_and_refuses_garbage() -> None:
    offer = KVOffer("r-1", "prefill-1-ab", b"\x00meta\xff", b"descs", 12, 4096, 7)
    assert KVOffer.from_json(offer.to_json()) == offer
    for bad in ({}, {**offer.to_json(), "metadata": "not base64!"}, {**offer.to_json(), "tokens": "x"}):
        with pytest.raises(ValueError, match="not a KV offer"):
            KVOffer.from_json(bad)


def test_ucx_modules_exclude_infiniband_only_where_there_is_none_and_unset() -> None:
    assert ucx_module_defaults({}, 0) == {"UCX_MODULES": "^ib"}
    assert ucx_module_defaults({}, 2) == {}
    assert ucx_module_defaults({"UCX_MODULES": "ib"}, 0) == {}


def test_a_prefilled_sequence_starts_decoding_from_the_offered_token() -> None:
    engine = Engine(build_model(get_preset("tiny"), seed=0))
    prompt = list(range(3, 20))
    seq = engine.add_prefilled("a", prompt, 4, first_token=42)
    assert (seq.num_computed, seq.generated, seq.finish_reason, seq.prefilled) == (17, [42], None, True)
    assert seq.cache.capacity == 21  # prompt + max_new_tokens, as a local prefill allocates
    assert engine.add_prefilled("b", prompt, 1, first_token=42).finish_reason == "length"
    eos = next(iter(engine.eos_ids))
    assert engine.add_prefilled("c", prompt, 4, first_token=eos).finish_reason == "stop"
    out = engine.step([], ["a"])  # decodes from position 17 with token 42
    assert list(out.new_tokens) == ["a"] and engine.sequences["a"].num_computed == 18


class _Port:
    """A transport that records what the handoff asks of it (pure bookkeeping under test)."""

    def __init__(self) -> None:
        self.read: list[str] = []
        self.released: list[str] = []
        self.fail_pull: Exception | None = None

    def offer_json(self, req_id: str, cache: object, tokens: int, first_token: int) -> dict[str, object]:
        return {"req_id": req_id, "tokens": tokens, "first_token": first_token}

    def completed(self) -> list[str]:
        out, self.read = self.read, []
        return out

    def release(self, req_id: str) -> bool:
        self.released.append(req_id)
        return True

    def pull(self, offer: object, cache: object, timeout_s: float) -> float:
        if self.fail_pull is not None:
            raise self.fail_pull
        return 0.002


def test_offered_sequences_are_held_until_read_or_their_lease_ends() -> None:
    engine = Engine(build_model(get_preset("tiny"), seed=0))
    port = _Port()
    handoff = KVHandoff(port, timeout_s=5.0, lease_s=30.0)
    for i, req_id in enumerate(("a", "b", "c")):
        engine.add(req_id, [5, 6, 7], 1)
        engine.step([(req_id, 3)], [])
        offer = handoff.offer(engine, req_id, now=100.0 + 10 * i)
        assert isinstance(offer, dict) and offer["tokens"] == 3 and offer["first_token"] == engine.sequences[
            req_id].generated[0]
    port.read = ["b"]
    assert handoff.settle(engine, now=125.0) == (["b"], [])
    assert handoff.settle(engine, now=131.0) == ([], ["a"])  # offered at 100, lease 30 s
    assert set(engine.sequences) == {"c"} and port.released == ["b", "a"]


def test_a_failed_read_releases_the_sequence_and_says_why() -> None:
    engine = Engine(build_model(get_preset("tiny"), seed=0))
    port = _Port()
    port.fail_pull = TimeoutError("took over 5 s")
    handoff = KVHandoff(port)
    req = GenerationRequest("r", [5, 6, 7], 4, remote_prefill=RemotePrefill(9, offer=object()))
    why = handoff.receive(engine, "r", req)
    assert why is not None and "took over 5 s" in why and engine.sequences == {}
    port.fail_pull = None
    assert handoff.receive(engine, "r", req) is None and engine.sequences["r"].generated == [9]
    assert handoff.take_transfers() == ([0.002], 2 * 2 * 2 * 3 * 16 * 4) and handoff.take_transfers() == ([], 0)


def test_the_role_settings_refuse_a_decode_worker_without_prefill_workers() -> None:
    assert load_settings({}).role == "single"
    s = load_settings({"MOEGUARD_ROLE": "decode", "MOEGUARD_PREFILL_URL": "http://demo-prefill:8000/",
                       "MOEGUARD_KV_TRANSFER_TIMEOUT_SECONDS": "2.5"})
    assert (s.role, s.prefill_url, s.kv_transfer_timeout_s, s.kv_lease_s) == (
        "decode", "http://demo-prefill:8000", 2.5, 30.0)
    with pytest.raises(ConfigError, match="MOEGUARD_ROLE=decode needs MOEGUARD_PREFILL_URL"):
        load_settings({"MOEGUARD_ROLE": "decode"})
    with pytest.raises(ConfigError, match="only a decode worker calls prefill workers"):
        load_settings({"MOEGUARD_ROLE": "prefill", "MOEGUARD_PREFILL_URL": "http://x:8000"})
    with pytest.raises(ConfigError, match="must be one of single, prefill, decode"):
        load_settings({"MOEGUARD_ROLE": "both"})
