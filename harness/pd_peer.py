"""A prefill worker's engine in a process of its own, driven over a pipe, for the handoff's tests and
benchmarks: the decode side runs in the caller's process, so the KV crosses a process boundary over UCX
(NIXL) as it crosses pods.

``PrefillPeer(folder)`` spawns the process (it loads the HF checkpoint in ``folder``, or the embedded
preset ``folder`` names with ``preset:<name>``); :meth:`PrefillPeer.prefill` sends one prompt and returns
the :class:`KVOffer`; the process drops each sequence when the decode side's read is notified.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

from moeguard_runtime.disagg.nixl_kv import KVOffer


def _load(source: str) -> Any:
    """An :class:`Engine` on ``source``: an HF checkpoint folder, or ``preset:<name>``."""
    from moeguard_runtime.engine.engine import Engine

    if source.startswith("preset:"):
        from moeguard_core.presets import get_preset
        from moeguard_runtime.model.model import build_model

        return Engine(build_model(get_preset(source.removeprefix("preset:")), seed=0))
    from moeguard_runtime.model.hf_checkpoint import load_hf_checkpoint

    loaded = load_hf_checkpoint(source)
    return Engine(loaded.model, eos_ids=frozenset(loaded.eos_token_ids))


def _serve(conn: Connection, source: str, chunk_tokens: int) -> None:
    import torch

    from moeguard_runtime.disagg.handoff import prefill_and_offer, release_completed
    from moeguard_runtime.disagg.nixl_kv import NixlKV

    torch.set_num_threads(1)
    engine = _load(source)
    kv = NixlKV("prefill")
    conn.send(("ready", kv.name))
    while True:
        if conn.poll(0.005):
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, req_id, prompt = msg
            try:
                conn.send(("offer", prefill_and_offer(engine, kv, req_id, prompt, chunk_tokens).to_json()))
            except Exception as e:  # reported to the caller, who fails the test with it
                conn.send(("error", f"{type(e).__name__}: {e}"))
        for req_id in release_completed(engine, kv):
            conn.send(("released", req_id))
    conn.send(("stopped", {"offered": kv.offered, "sequences": len(engine.sequences)}))


class PrefillPeer:
    """The spawned prefill process (see the module docstring); a context manager that stops it."""

    def __init__(self, source: str, chunk_tokens: int = 8, start_timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(theirs, source, chunk_tokens), daemon=True)
        self.process.start()
        self.released: list[str] = []
        self.name = str(self._expect("ready", start_timeout_s))

    def _expect(self, kind: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._conn.poll(min(0.5, max(0.0, deadline - time.monotonic()))):
                if not self.process.is_alive():
                    raise RuntimeError(f"the prefill process exited ({self.process.exitcode})")
                continue
            got, value = self._conn.recv()
            if got == "released":
                self.released.append(value)
            elif got == "error":
                raise RuntimeError(f"prefill failed: {value}")
            elif got == kind:
                return value
        raise TimeoutError(f"no {kind!r} from the prefill process within {timeout_s:g} s")

    def prefill(self, req_id: str, prompt: list[int], timeout_s: float = 60.0) -> KVOffer:
        self._conn.send(("prefill", req_id, prompt))
        return KVOffer.from_json(self._expect("offer", timeout_s))

    def wait_released(self, req_ids: set[str], timeout_s: float = 10.0) -> None:
        """Until the process has dropped every one of ``req_ids`` (their reads notified)."""
        deadline = time.monotonic() + timeout_s
        while not req_ids <= set(self.released):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not released within {timeout_s:g} s: {sorted(req_ids - set(self.released))}")
            if self._conn.poll(0.05):
                got, value = self._conn.recv()
                if got == "released":
                    self.released.append(value)

    def stop(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Stop the process; returns what it still held (``offered`` registrations, engine ``sequences``)."""
        if not self.process.is_alive():
            return {}
        self._conn.send(("stop",))
        held: dict[str, int] = self._expect("stopped", timeout_s)
        self.process.join(timeout_s)
        return held

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def __enter__(self) -> PrefillPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.kill()
