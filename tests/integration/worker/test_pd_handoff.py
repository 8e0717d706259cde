"""Disaggregated prefill and decode (issue 33 §2): a prefill engine in a process of its own
(:class:`harness.pd_peer.PrefillPeer`) runs each prompt and offers its KV; the decode engine, in this
process, reads it over NIXL's UCX backend (tcp and cma on this machine) and continues.

* on every HF family of the parity test (tiny random checkpoints, redrawn weights): the pair's greedy tokens
  equal the single worker's and ``transformers``' ``generate``, token for token, three prompts decoded
  together, the prompt prefilled in chunks of 8 tokens on the prefill side;
* the bytes moved are the prompt's runs of the cache only;
* the prefill side drops each sequence and its registration once the read is notified;
* a dead prefill worker is an error within the transfer's deadline, not a hang.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from harness.pd_peer import PrefillPeer
from tests.unit.runtime.test_hf_parity import FAMILIES, NEW_TOKENS, hf_reference

from moeguard_runtime.disagg.handoff import receive
from moeguard_runtime.disagg.kv_layout import transfer_bytes
from moeguard_runtime.disagg.nixl_kv import KVOffer, KVTransferError, NixlKV
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.model.hf_checkpoint import load_hf_checkpoint

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def kv() -> Iterator[NixlKV]:
    agent = NixlKV("decode")
    yield agent
    agent.close()  # its progress thread ends: later tests in this process (unit tests refuse waits) never see it


def _decode_all(engine: Engine, ids: list[str]) -> dict[str, list[int]]:
    for _ in range(NEW_TOKENS + 1):
        running = [i for i in ids if engine.sequences[i].finish_reason is None]
        if not running:
            break
        engine.step([], running)
    return {i: list(engine.sequences[i].generated) for i in ids}


def _single(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """The single worker: each prompt prefilled in one step, then decoded together."""
    ids = [f"single-{i}" for i in range(len(prompts))]
    for i, p in zip(ids, prompts, strict=True):
        engine.add(i, p, NEW_TOKENS)
        engine.step([(i, len(p))], [])
    out = _decode_all(engine, ids)
    for i in ids:
        engine.release(i)
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_pair_greedy_tokens_equal_the_single_worker(name: str, kv: NixlKV,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    reference = hf_reference(name, tmp_path_factory)
    loaded = load_hf_checkpoint(reference.folder)
    engine = Engine(loaded.model, eos_ids=frozenset())  # 32 tokens each, as generate's reference
    single = _single(engine, reference.prompts)
    hf = reference.greedy()
    assert [single[f"single-{i}"] for i in range(len(reference.prompts))] == [hf[str(i)] for i in range(3)]
    with PrefillPeer(str(reference.folder), chunk_tokens=8) as peer:
        ids = []
        for i, prompt in enumerate(reference.prompts):
            offer = peer.prefill(f"pd-{i}", prompt)
            seq, seconds = receive(engine, kv, offer, prompt, NEW_TOKENS, timeout_s=30.0)
            assert offer.nbytes == transfer_bytes(seq.cache, len(prompt))
            assert offer.nbytes < seq.cache.nbytes  # the prompt's runs, not the generation's room
            assert 0 < seconds < 30.0
            ids.append(seq.seq_id)
        pair = _decode_all(engine, ids)
        assert [pair[f"pd-{i}"] for i in range(3)] == [single[f"single-{i}"] for i in range(3)]
        peer.wait_released(set(ids))
        assert peer.stop() == {"offered": 0, "sequences": 0}


def test_a_dead_prefill_worker_is_an_error_within_the_deadline(kv: NixlKV) -> None:
    engine = _tiny_engine()
    peer = PrefillPeer("preset:tiny", chunk_tokens=16)
    try:
        offer = peer.prefill("dead-0", list(range(3, 40)))
    finally:
        peer.kill()
    t0 = time.monotonic()
    with pytest.raises(KVTransferError):
        receive(engine, kv, offer, list(range(3, 40)), 4, timeout_s=5.0)
    assert time.monotonic() - t0 < 15.0
    assert "dead-0" not in engine.sequences  # released, nothing half-filled left behind
    kv.forget_peer(offer.agent)


def test_an_offer_for_another_model_is_refused(kv: NixlKV) -> None:
    engine = _tiny_engine()
    peer = PrefillPeer("preset:tiny", chunk_tokens=16)
    try:
        offer = peer.prefill("other-0", list(range(3, 20)))
        wrong = KVOffer(**{**offer.__dict__, "nbytes": offer.nbytes * 2})
        with pytest.raises(ValueError, match="bytes"):
            receive(engine, kv, wrong, list(range(3, 20)), 4, timeout_s=5.0)
        with pytest.raises(ValueError, match="prompt tokens"):
            receive(engine, kv, offer, list(range(3, 21)), 4, timeout_s=5.0)
        assert engine.sequences == {}
    finally:
        peer.stop()
        peer.kill()


def _tiny_engine() -> Engine:
    from moeguard_core.presets import get_preset
    from moeguard_runtime.model.model import build_model

    torch.set_num_threads(1)
    return Engine(build_model(get_preset("tiny"), seed=0))
