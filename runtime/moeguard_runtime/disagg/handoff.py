"""The two halves of a prefill/decode handoff at the engine's level (no HTTP, no scheduler):

* :func:`prefill_and_offer` (the prefill worker): runs a prompt in chunks, samples its first token and
  offers the prompt's KV (:meth:`NixlKV.offer`); the sequence stays in the engine, its cache registered,
  until the decode worker's read is notified (:func:`release_completed`);
* :func:`receive` (the decode worker): allocates the sequence as the single worker would, counted prefilled
  (:meth:`Engine.add_prefilled`), and reads the KV into it (:meth:`NixlKV.pull`); the engine's next decode
  steps continue the generation as if it had run the prompt itself.

Greedy decoding of a pair equals the single worker's token for token (tests/integration/worker/
test_pd_handoff.py, on every HF family): the KV bytes are the prefill's own, and the decode steps attend
over them exactly as over a local prefill's.
"""

from __future__ import annotations

from moeguard_runtime.disagg.nixl_kv import KVOffer, NixlKV
from moeguard_runtime.engine.engine import Engine, SequenceState
from moeguard_runtime.engine.sampling import GREEDY, SamplingParams


def prefill_and_offer(engine: Engine, kv: NixlKV, req_id: str, prompt: list[int], chunk_tokens: int,
                      temperature: float = 0.0, seed: int | None = None,
                      params: SamplingParams = GREEDY) -> KVOffer:
    """Prefill ``prompt`` in chunks of at most ``chunk_tokens`` tokens and offer its KV.

    Raises:
        ValueError: ``chunk_tokens < 1``, or as :meth:`Engine.add` (empty prompt, over the context).
        KVTransferError: NIXL refused to register the cache (the sequence is released).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, given {chunk_tokens}")
    seq = engine.add(req_id, prompt, 1, temperature, seed, params)
    try:
        while not seq.prefilled:
            engine.step([(req_id, min(chunk_tokens, len(prompt) - seq.num_computed))], [])
        return kv.offer(req_id, seq.cache, len(prompt), seq.generated[0])
    except BaseException:
        engine.release(req_id)
        raise


def release_completed(engine: Engine, kv: NixlKV) -> list[str]:
    """Drop the offered sequences whose KV a decode worker has read; returns their ids."""
    done = kv.completed()
    for req_id in done:
        kv.release(req_id)
        engine.release(req_id)
    return done


def receive(engine: Engine, kv: NixlKV, offer: KVOffer, prompt: list[int], max_new_tokens: int,
            timeout_s: float, temperature: float = 0.0, seed: int | None = None,
            params: SamplingParams = GREEDY) -> tuple[SequenceState, float]:
    """Register ``offer``'s sequence in ``engine`` as prefilled and read its KV; returns the sequence and the
    transfer's seconds.

    Raises:
        ValueError: the offer's prompt length differs from ``prompt``'s, or as :meth:`Engine.add`.
        KVTransferError, KVTransferTimeout: the read failed or ran out of time (the sequence is released).
    """
    if offer.tokens != len(prompt):
        raise ValueError(f"the offer holds {offer.tokens} prompt tokens, the request has {len(prompt)}")
    seq = engine.add_prefilled(offer.req_id, prompt, max_new_tokens, offer.first_token, temperature, seed,
                               params)
    try:
        return seq, kv.pull(offer, seq.cache, timeout_s)
    except BaseException:
        engine.release(offer.req_id)
        raise

