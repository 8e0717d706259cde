"""The KV handoff's transport: NIXL (https://github.com/ai-dynamo/nixl) over its UCX backend, as vLLM's
``NixlConnector`` moves KV between a prefill and a decode worker.

The prefill side *offers* a finished prompt's cache (:meth:`NixlKV.offer`): it registers the cache's ``k`` and
``v`` with NIXL and returns a :class:`KVOffer`: its agent's metadata (how to reach it: UCX worker address,
TCP listener) and the serialized descriptors of the prompt's runs (:func:`kv_layout.prompt_regions`). The
decode side *pulls* (:meth:`NixlKV.pull`): it registers its own cache, ``READ``s the runs into it and waits,
with a deadline; the read carries the request id as NIXL's notification, on which the prefill side drops its
registration and the sequence (:meth:`NixlKV.completed`). One-sided reads by the decode side are NIXL's and
vLLM's choice too: the decode worker, which owns the memory the KV lands in, decides when it has room.

On this 2-core CPU machine UCX moves the bytes over ``tcp`` and ``cma`` (``process_vm_readv``) with RMA
emulated over active messages (``UCX_LOG_LEVEL=info``: ``rma_am(tcp/lo)``); on a GPU node with RDMA NICs
the same calls use ``rc``/``cuda_ipc``.

Two things of the wheel are handled here:

* ``nixl``'s meta-package picks its CUDA flavour from torch's CUDA version and fails where that flavour is
  not installed; :func:`load_api` imports the installed flavour's ``_api`` directly.
* The wheel's UCX loads its InfiniBand modules, which pull in ``libnl-route``; on a machine without
  InfiniBand that library's destructor crashed the process at exit (SIGSEGV in ``rtnl_tc_unregister``,
  nixl-cu12 1.5.1, measured here). :func:`ucx_module_defaults` excludes the ``ib`` modules
  (``UCX_MODULES=^ib``) where ``/sys/class/infiniband`` lists no device and the variable is unset.
"""

from __future__ import annotations

import base64
import os
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeguard_runtime.disagg.kv_layout import Region, cache_tensors, prompt_regions
from moeguard_runtime.model.model import KVCache

API_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")
"""Where NIXL's Python API lives, per wheel flavour (``nixl-cu12``, ``nixl-cu13``, the ``nixl`` meta-package)."""
INFINIBAND_CLASS = Path("/sys/class/infiniband")
POLL_S = 0.0005
"""Seconds between two looks at a transfer's state (UCX progresses inside ``check_xfer_state``)."""
PROGRESS_S = 0.002
"""Seconds between two looks of :class:`NixlKV`'s progress thread at NIXL's notifications."""


class KVTransferError(RuntimeError):
    """A handoff that failed: the peer unreachable, a descriptor refused, the transfer in error. A worker
    answers the request with 503 and ``Retry-After`` (issue 33)."""


class KVTransferTimeout(KVTransferError):
    """A handoff that did not finish within its deadline."""


class KVTransportUnavailable(KVTransferError):
    """No NIXL build is installed (``nixl-cu12`` is in requirements.txt)."""


@dataclass(frozen=True)
class KVOffer:
    """What the prefill worker tells the decode worker about a prompt's KV: ``agent`` (the NIXL agent's
    name) and its ``metadata``, the serialized ``descs`` of the prompt's runs, the prompt's ``tokens``,
    the ``nbytes`` the runs hold, and ``first_token``, the token the prefill sampled."""

    req_id: str
    agent: str
    metadata: bytes
    descs: bytes
    tokens: int
    nbytes: int
    first_token: int

    def to_json(self) -> dict[str, Any]:
        """A JSON object (bytes as base64)."""
        return {"req_id": self.req_id, "agent": self.agent, "tokens": self.tokens, "nbytes": self.nbytes,
                "first_token": self.first_token, "metadata": base64.b64encode(self.metadata).decode(),
                "descs": base64.b64encode(self.descs).decode()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KVOffer:
        """The offer :meth:`to_json` wrote.

        Raises:
            ValueError: a field missing or of the wrong type.
        """
        try:
            return cls(req_id=str(data["req_id"]), agent=str(data["agent"]), tokens=int(data["tokens"]),
                       nbytes=int(data["nbytes"]), first_token=int(data["first_token"]),
                       metadata=base64.b64decode(data["metadata"], validate=True),
                       descs=base64.b64decode(data["descs"], validate=True))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a KV offer: {e}") from e


def ucx_module_defaults(environ: Mapping[str, str], infiniband_devices: int) -> dict[str, str]:
    """The UCX variables to add to ``environ`` before NIXL's UCX starts: ``UCX_MODULES=^ib`` where no
    InfiniBand device exists and the variable is unset (see the module docstring), else nothing."""
    if "UCX_MODULES" in environ or infiniband_devices > 0:
        return {}
    return {"UCX_MODULES": "^ib"}


def infiniband_devices(path: Path = INFINIBAND_CLASS) -> int:
    """How many InfiniBand devices the kernel lists (0 without the class directory)."""
    try:
        return sum(1 for _ in path.iterdir())
    except OSError:
        return 0


def load_api() -> Any:
    """NIXL's ``_api`` module of the installed wheel (:data:`API_MODULES`, first found).

    Raises:
        KVTransportUnavailable: none is installed.
    """
    import importlib

    errors = []
    for name in API_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:  # also the meta-package's own CUDA-flavour failure
            errors.append(f"{name}: {e}")
    raise KVTransportUnavailable("no NIXL build is importable (" + "; ".join(errors) + ")")


def _xfer_descs(regions: list[Region]) -> list[tuple[int, int, int]]:
    """NIXL's transfer descriptors of host memory: ``(address, bytes, device 0)``."""
    return [(r.addr, r.nbytes, 0) for r in regions]


class _Serialized:
    """Every method call of ``agent`` under ``lock``: the worker's engine thread and :class:`NixlKV`'s progress
    thread share one NIXL agent."""

    def __init__(self, agent: Any, lock: threading.Lock) -> None:
        self._agent, self._lock = agent, lock

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._agent, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return method(*args, **kwargs)
        return call


class NixlKV:
    """One worker's NIXL agent and the KV it has offered or is pulling. Driven by one thread (the worker's
    engine thread) beside its own progress thread.

    NIXL's own progress thread is off: it polls UCX with ``sched_yield`` and kept a core busy in an idle worker
    (0.97 CPU s per s, ``make bench-pd``). Instead a thread of this class makes UCX progress by reading NIXL's
    notifications every :data:`PROGRESS_S` (the prefill side must progress for a read of its memory over
    ``tcp``, where UCX emulates the read with active messages). Measured between two processes, 20 reads of
    3.2 MB each: over tcp only, median 7.2 ms and 0.15 CPU s per s on the prefill side, against 17.9 ms and 1.20
    with NIXL's thread; with tcp and cma, 1.3 ms and 0.07 against 4.1 ms and 1.16.

    ``name``: the agent's name, unique among the peers (default ``<role>-<pid>-<random>``)."""

    def __init__(self, role: str, name: str | None = None, api: Any = None) -> None:
        for key, value in ucx_module_defaults(os.environ, infiniband_devices()).items():
            os.environ[key] = value
        self.api = load_api() if api is None else api
        self.name = name or f"{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        raw = self.api.nixl_agent(self.name, self.api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.agent = _Serialized(raw, threading.Lock())
        self._notified: list[str] = []
        self._notified_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self._thread.start()
        self._offered: dict[str, tuple[KVCache, Any]] = {}
        self._peers: dict[str, str] = {}
        self._stuck: list[Any] = []
        """Registrations of pulls that timed out and could not be aborted: their memory stays pinned (a
        read may still land in it), never freed."""

    # --- the prefill side ----------------------------------------------------------------------------
    def offer(self, req_id: str, cache: KVCache, tokens: int, first_token: int) -> KVOffer:
        """Register ``cache`` and describe its first ``tokens`` positions for a decode worker to read.
        The cache is held (and stays registered) until :meth:`release`.

        Raises:
            ValueError: ``req_id`` already offered, or ``tokens`` outside the cache.
            KVTransferError: NIXL refused the registration.
        """
        if req_id in self._offered:
            raise ValueError(f"request {req_id} is already offered")
        tensors = cache_tensors(cache)
        regions = prompt_regions(tensors, tokens)
        reg = self._register(tensors)
        descs = self.agent.get_xfer_descs(_xfer_descs(regions), "DRAM")
        self._offered[req_id] = (cache, reg)
        return KVOffer(req_id, self.name, self.agent.get_agent_metadata(), self.agent.get_serialized_descs(descs),
                       tokens, sum(r.nbytes for r in regions), first_token)

    def offer_json(self, req_id: str, cache: KVCache, tokens: int, first_token: int) -> dict[str, Any]:
        """:meth:`offer` as JSON (:class:`moeguard_runtime.engine.kv_port.KVPort`)."""
        return self.offer(req_id, cache, tokens, first_token).to_json()

    def completed(self) -> list[str]:
        """Offered request ids whose KV a decode worker has read since the last call (their notifications, as
        the progress thread collected them); the caller :meth:`release`\\ s them."""
        with self._notified_lock:
            notified, self._notified = self._notified, []
        return [r for r in notified if r in self._offered]

    def _progress(self) -> None:
        """UCX's progress, and the notifications it brings, every :data:`PROGRESS_S` until :meth:`close`."""
        while not self._stop.wait(PROGRESS_S):
            try:
                notifs = self.agent.get_new_notifs()
            except Exception:  # a NIXL error in one look: the next one tries again
                continue
            messages = [m.decode(errors="replace") for ms in notifs.values() for m in ms]
            if messages:
                with self._notified_lock:
                    self._notified.extend(messages)

    def close(self) -> None:
        """Stop the progress thread and wait for it (the agent stays until the object goes)."""
        self._stop.set()
        self._thread.join(1.0)

    def release(self, req_id: str) -> bool:
        """Deregister and drop an offered cache (False: not offered)."""
        held = self._offered.pop(req_id, None)
        if held is None:
            return False
        self.agent.deregister_memory(held[1])
        return True

    @property
    def offered(self) -> int:
        return len(self._offered)

    # --- the decode side -----------------------------------------------------------------------------
    def pull(self, offer: KVOffer, cache: KVCache, timeout_s: float) -> float:
        """Read ``offer``'s runs into the first ``offer.tokens`` positions of ``cache`` (same layout, any
        capacity >= the prompt), within ``timeout_s`` seconds; returns the seconds it took.

        Raises:
            ValueError: the offer's byte count differs from what ``cache`` would receive (another model or
                dtype).
            KVTransferTimeout: not done within ``timeout_s``.
            KVTransferError: the peer unreachable or the transfer in error.
        """
        t0 = time.monotonic()
        tensors = cache_tensors(cache)
        regions = prompt_regions(tensors, offer.tokens)
        if sum(r.nbytes for r in regions) != offer.nbytes:
            raise ValueError(f"the offer holds {offer.nbytes} bytes, this cache takes "
                             f"{sum(r.nbytes for r in regions)} for {offer.tokens} tokens")
        peer = self._peer(offer)
        reg = self._register(tensors)
        handle = None
        try:
            remote = self.agent.deserialize_descs(offer.descs)
            local = self.agent.get_xfer_descs(_xfer_descs(regions), "DRAM")
            handle = self.agent.initialize_xfer("READ", local, remote, peer, offer.req_id.encode())
            state = self.agent.transfer(handle)
            while state != "DONE":
                if state == "ERR":
                    raise KVTransferError(f"reading the KV of {offer.req_id} from {offer.agent} failed")
                if time.monotonic() - t0 > timeout_s:
                    raise KVTransferTimeout(f"reading the KV of {offer.req_id} ({offer.nbytes} bytes) from "
                                            f"{offer.agent} took over {timeout_s:g} s")
                time.sleep(POLL_S)
                state = self.agent.check_xfer_state(handle)
        except KVTransferError:
            if handle is not None and not self._abort(handle):
                self._stuck.append((cache, reg))
                raise
            self.agent.deregister_memory(reg)
            raise
        except Exception as e:  # NIXL's own errors (nixlBind exceptions): the peer, the descriptors
            if handle is not None and not self._abort(handle):
                self._stuck.append((cache, reg))
            else:
                self.agent.deregister_memory(reg)
            raise KVTransferError(f"reading the KV of {offer.req_id} from {offer.agent}: {e}") from e
        self.agent.release_xfer_handle(handle)
        self.agent.deregister_memory(reg)
        return time.monotonic() - t0

    def forget_peer(self, agent: str) -> None:
        """Drop a peer's metadata (a prefill worker that went away); its next offer adds it again."""
        if self._peers.pop(agent, None) is not None:
            self.agent.remove_remote_agent(agent)

    # --- both ----------------------------------------------------------------------------------------
    def _register(self, tensors: tuple[Any, ...]) -> Any:
        try:
            return self.agent.register_memory(
                [(t.data_ptr(), t.numel() * t.element_size(), 0, "") for t in tensors], "DRAM")
        except Exception as e:
            raise KVTransferError(f"NIXL refused to register the KV cache: {e}") from e

    def _peer(self, offer: KVOffer) -> str:
        """Load ``offer``'s metadata (every offer's: it carries the registrations made since the last one,
        whose remote keys a read needs; NIXL merges it into what it holds of the agent)."""
        try:
            self._peers[offer.agent] = self.agent.add_remote_agent(offer.metadata)
        except Exception as e:
            raise KVTransferError(f"cannot load the metadata of {offer.agent}: {e}") from e
        return self._peers[offer.agent]

    def _abort(self, handle: Any) -> bool:
        """Release an unfinished transfer (UCX cancels it); False where NIXL refused."""
        try:
            self.agent.release_xfer_handle(handle)
            return True
        except Exception:
            return False
