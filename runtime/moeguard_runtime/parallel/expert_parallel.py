"""Expert parallelism across processes: the group, the expert shards, and the MoE dispatch (issue 15).

Shapes: ``T`` tokens of the step (packed), ``D`` hidden size, ``k`` experts per token, ``E`` routed
experts, ``P`` ranks, ``E_r = E / P`` experts per rank; a *slot* is one (token, chosen expert) pair.

**Placement.** Rank ``r`` holds the experts ``[r * E_r, (r + 1) * E_r)`` of every MoE layer (a contiguous
block, vLLM's and SGLang's linear placement), cut from the same checkpoint or preset seed as the
single-process model, so the weights are equal. Attention, the routers, the shared experts, the dense
layers, the embeddings and the LM head run on the leader (rank 0) only; followers keep the routed experts
and free the rest (:func:`strip_to_experts`).

**Dispatch.** At each MoE layer the leader routes (router in float32, as today), then runs
:meth:`ExpertParallelGroup.dispatch`: the token-slots are split by the rank that owns their expert
(:func:`plan_dispatch`); each follower receives only the tokens routed to it, once per token however
many of its experts the token chose (``[u_r, D]`` hidden states plus ``n_r`` slots of (row, local
expert, weight)), runs its experts (:func:`expert_block_forward`, the same grouped SwiGLU and kernels
as :func:`moe.dispatch_experts`) and sends back ``[u_r, D]`` weighted sums, which the leader adds into
the layer's output in rank order (:func:`combine`). The leader's own block runs while the followers
work. Point-to-point ``isend``/``irecv`` carry the variable-sized parts; a fixed-size header, broadcast
first, tells every follower what comes (and that the leader is alive).

Why this and not broadcast + reduce (``mode="broadcast"``: every rank receives all ``[T, D]`` hidden
states, the router's ``[T, k]`` choices and weights, and a ``[T, D]`` sum-reduce brings the partial
outputs back): with ``k`` of ``E`` experts per token, a rank is chosen by a token with probability
``1 - C(E - E_r, k) / C(E, k)`` (0.46 for E=8, k=2, P=4; 0.11 for DeepSeek-V3's E=256, k=8, P=64 per
node), so routed dispatch moves that fraction of the bytes, and a decode step whose few tokens miss a
rank sends it nothing but the header. It is the scheme of DeepEP's dispatch/combine kernels (tokens
sent to the ranks of their top-k experts, combined back weighted). Measured on the 2-core machine
(``bench/results/expert_parallel.md``, ``small`` preset, E=8, k=2), routed dispatch moved 0.78x the bytes
of broadcast + reduce with 2 ranks and 0.46x with 4, and its steps were faster with 2 ranks (prefill
297 against 350 ms, decode 62 against 80 ms) and at decode with 4 (94 against 105 ms; prefill even,
4 ranks on 2 cores).

**Failures.** The process group has a timeout (``MOEGUARD_EP_TIMEOUT_SECONDS``) on every collective and
every point-to-point wait; an idle leader sends a header (``OP_PING``, with a gather of every rank's RSS)
every :data:`HEARTBEAT_S` seconds at most, so a follower hears from a live leader well within it, and the
leader learns of a dead follower while idle. Any failure (a peer's socket closed, a timeout) is turned
into :class:`GroupUnavailable` once, calls ``on_lost`` once, and leaves the group broken for good:
the process is meant to exit (``contract.EXIT_EP_GROUP_LOST``) and be recreated with its group
(LeaderWorkerSet ``RecreateGroupOnPodRestart``).

Backend: gloo on the CPU, NCCL when the worker runs on CUDA (tensors then travel on the device). Only
the gloo path is tested here (the development machine has no GPUs for a multi-rank NCCL group).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from moeguard_runtime.model.moe import ExpertWeights, MatmulChoice, PackedExperts, swiglu_expert
from moeguard_runtime.parallel.ep_config import EpSettings, expert_range

DispatchMode = Literal["routed", "broadcast"]
"""``routed``: each follower receives only its tokens (the worker's choice); ``broadcast``: all tokens to
every rank, partial outputs sum-reduced (kept for the benchmark's comparison)."""

OP_PING, OP_MOE, OP_STOP = 1, 2, 3
"""Header opcodes: heartbeat with an RSS gather; one MoE layer's dispatch; the leader is stopping."""
HEADER_FIXED = 4
"""Header fields before the per-rank pairs: ``op, layer, T, k``; then ``(u_r, n_r)`` for each rank."""
HEARTBEAT_S = 1.0
"""Longest the leader stays silent (the heartbeat's period is ``min(HEARTBEAT_S, timeout / 4)``)."""


class GroupUnavailable(RuntimeError):
    """The group is broken: a rank died, hung past the timeout, or the leader left (the message says which
    operation failed and how)."""


# --- pure parts ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankBatch:
    """What one rank computes in one MoE layer.

    Attributes:
        tokens: ``[u]`` int64, the step's token indices routed to this rank (ascending, unique).
        rows: ``[n]`` int64, for each slot its row in ``tokens``.
        local_expert: ``[n]`` int64, the slot's expert, numbered within the rank's block.
        weight: ``[n]`` float32, the slot's router weight.
    """

    tokens: torch.Tensor
    rows: torch.Tensor
    local_expert: torch.Tensor
    weight: torch.Tensor

    @property
    def slots(self) -> int:
        return int(self.rows.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def plan_dispatch(weights: torch.Tensor, experts: torch.Tensor, num_experts: int,
                  ranks: int) -> list[RankBatch]:
    """Split a layer's slots by owning rank.

    Args:
        weights: ``[T, k]`` float32 router weights; experts: ``[T, k]`` int64 expert ids.
        num_experts: ``E`` (divisible by ``ranks``); ranks: ``P``.

    Returns:
        ``P`` :class:`RankBatch` (empty ones included), rank order.
    """
    per = num_experts // ranks
    k = experts.shape[1]
    flat = experts.reshape(-1)  # [T*k]
    flat_w = weights.reshape(-1).float()  # [T*k]
    slot_token = torch.arange(flat.shape[0], device=flat.device) // k  # [T*k]
    owner = flat // per  # [T*k]
    out = []
    for r in range(ranks):
        mask = owner == r
        tok = slot_token[mask]  # [n] ascending
        uniq, rows = torch.unique(tok, sorted=True, return_inverse=True)  # [u], [n]
        out.append(RankBatch(uniq, rows, flat[mask] - r * per, flat_w[mask]))
    return out


def expert_block_forward(x: torch.Tensor, batch_rows: torch.Tensor, local_expert: torch.Tensor,
                         weight: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights,
                         backend: MatmulChoice = "onednn") -> torch.Tensor:
    """A rank's experts over its tokens: ``out[i] = sum over slots s of row i: weight[s] * expert(x[i])``.

    Args:
        x: ``[u, D]`` the rank's tokens; batch_rows: ``[n]`` int64 row of each slot;
        local_expert: ``[n]`` int64 in ``0..E_r-1``; weight: ``[n]`` float32.
        w13: ``[E_r, 2I, D]``, w2: ``[E_r, D, I]`` the rank's fused experts
            (:func:`moe.swiglu_expert`, the single-process kernels).

    Returns:
        ``[u, D]`` in ``x.dtype``. Slots are taken expert by expert, rows ascending within an expert (the
        order of :func:`moe.dispatch_experts`), so a token's sum adds its experts in expert order.
    """
    out = torch.zeros_like(x)  # [u, D]
    if batch_rows.numel() == 0:
        return out
    order = torch.argsort(local_expert, stable=True)  # [n]
    counts: list[int] = torch.bincount(local_expert, minlength=w13.shape[0]).tolist()
    at = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        idx = order[at:at + c]
        rows = batch_rows[idx]  # [c]
        y = swiglu_expert(x.index_select(0, rows), w13[e], w2[e], backend)  # [c, D]
        y.mul_(weight[idx, None].to(y.dtype))
        out.index_add_(0, rows, y)
        at += c
    return out


def combine(num_tokens: int, dim: int, batches: Sequence[RankBatch], partials: Sequence[torch.Tensor],
            like: torch.Tensor) -> torch.Tensor:
    """The layer's ``[T, D]`` output: each rank's ``[u_r, D]`` partial added at its tokens, rank order."""
    out = like.new_zeros(num_tokens, dim)
    for b, y in zip(batches, partials, strict=True):
        if b.num_tokens:
            out.index_add_(0, b.tokens, y)
    return out


def tokens_per_rank(counts: Sequence[int], ranks: int) -> list[int]:
    """Token-slots per rank from the layer's ``E`` per-expert counts (contiguous blocks)."""
    per = len(counts) // ranks
    return [sum(counts[r * per:(r + 1) * per]) for r in range(ranks)]


def balancedness(per_rank: Sequence[int]) -> float:
    """Mean / max of the token-slots per rank (vLLM EPLB, SGLang ``eplb_balancedness``); 1.0 when empty."""
    top = max(per_rank, default=0)
    return (sum(per_rank) / len(per_rank)) / top if top > 0 else 1.0


def moe_modules(model: nn.Module) -> list[nn.Module]:
    """The model's routed-expert modules in layer order (anything with ``w13``, ``w2`` and a ``gate``:
    ``moe.MOEFeedForward``, ``families.decoder.SparseMoE``); their index is the ``layer`` of the routing
    statistics."""
    return [m for m in model.modules() if isinstance(getattr(m, "w13", None), (torch.Tensor, PackedExperts))
            and hasattr(m, "gate") and hasattr(m, "w2")]


def shard_experts(model: nn.Module, rank: int, ranks: int) -> tuple[int, int]:
    """Keep only this rank's block of every MoE layer's ``w13``/``w2`` (copied out, so the full stack is
    freed); returns the block ``[lo, hi)``.

    Raises:
        ConfigError: ``ranks`` does not divide the expert count.
    """
    lo = hi = 0
    for m in moe_modules(model):
        w13 = m.w13
        assert isinstance(w13, torch.Tensor)
        lo, hi = expert_range(rank, ranks, w13.shape[0])
    keep_experts(model, lo, hi)
    return lo, hi


def keep_experts(model: nn.Module, lo: int, hi: int) -> None:
    """Keep only the experts ``[lo, hi)`` of every MoE layer's ``w13``/``w2`` (copied out, so the full stack is
    freed)."""
    for m in moe_modules(model):
        w13, w2 = m.w13, m.w2
        assert isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
        m.w13 = nn.Parameter(w13.data[lo:hi].clone(), requires_grad=False)
        m.w2 = nn.Parameter(w2.data[lo:hi].clone(), requires_grad=False)


def strip_to_experts(model: nn.Module) -> int:
    """Free every parameter but the routed experts' (a follower's attention, routers, embeddings, shared
    experts: the leader runs them); returns the bytes freed."""
    keep = {id(p) for m in moe_modules(model) for w in (m.w13, m.w2)
            for p in (w if isinstance(w, PackedExperts) else [w])}
    freed = 0
    for p in model.parameters():
        if id(p) not in keep:
            freed += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return freed


# --- the group -----------------------------------------------------------------------------------
@dataclass
class StepCounters:
    """What one step moved and waited for (the leader's, summed over its MoE layers)."""

    collective_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    layers: int = 0
    per_layer_ranks: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class Served:
    """What a follower served for one header: ``op`` and ``layer`` from it, the token-slots its experts ran,
    seconds receiving and sending (``comm_s``) and running its experts (``compute_s``)."""

    op: int
    layer: int
    slots: int
    comm_s: float
    compute_s: float


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ExpertParallelGroup:
    """This process's membership in the group: a ``torch.distributed`` process group plus the protocol.

    Thread-safe on the leader: the engine thread's :meth:`dispatch` and the heartbeat thread's :meth:`ping`
    serialise on one lock, so each header is followed by its own payload on every rank.
    """

    def __init__(self, ep: EpSettings, device: torch.device, dtype: torch.dtype, dim: int,
                 on_lost: Callable[[str], None] | None = None, mode: DispatchMode = "routed",
                 store: Any = None) -> None:
        """Join the group (blocks until every rank has joined, at most ``ep.join_timeout_s``).

        Raises:
            GroupUnavailable: the rendezvous failed or timed out.
        """
        self.ep, self.device, self.dtype, self.dim, self.mode = ep, device, dtype, dim, mode
        self.on_lost = on_lost
        self.timeout = timedelta(seconds=ep.timeout_s)
        self.lost: str | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._last_exchange = time.monotonic()
        self.counters = StepCounters()
        self.rss: list[int | None] = [None] * ep.size
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            if store is None:
                store = dist.TCPStore(  # type: ignore[attr-defined]
                    ep.leader_address, ep.port, ep.size, ep.is_leader,
                    timedelta(seconds=ep.join_timeout_s), wait_for_workers=True)
            # The default group waits as long as the join may take (ranks finish loading at different
            # times, and gloo's connect waits with the group's timeout); the group every exchange uses is
            # made once all are in, with the collective timeout.
            dist.init_process_group(backend, store=store, rank=ep.rank, world_size=ep.size,
                                    timeout=timedelta(seconds=ep.join_timeout_s))
            pg = dist.new_group(list(range(ep.size)), timeout=self.timeout, backend=backend)
            assert isinstance(pg, dist.ProcessGroup)  # every rank is a member
            self.pg: dist.ProcessGroup = pg
            self._barrier_join()
        except Exception as exc:
            raise GroupUnavailable(f"joining the group of {ep.size} ranks at {ep.leader_address}:{ep.port} "
                                   f"failed: {exc!r}"[:500]) from exc
        self.header_len = HEADER_FIXED + 2 * ep.size

    def _barrier_join(self) -> None:
        t = torch.zeros(1, device=self.device)
        dist.all_reduce(t, group=self.pg)  # every rank's transport is up

    # -- plumbing --
    def _fail(self, what: str, exc: BaseException) -> GroupUnavailable:
        first = self.lost is None
        if first:
            self.lost = f"rank {self.ep.rank}: {what} failed: {exc!r}"[:500]
        err = GroupUnavailable(self.lost or "")
        if first and self.on_lost is not None:
            self.on_lost(self.lost or "")
        return err

    def _wait(self, works: Sequence[Any]) -> None:
        for w in works:
            w.wait(self.timeout)

    def _check(self) -> None:
        if self.lost is not None:
            raise GroupUnavailable(self.lost)
        if self._stopped:
            raise GroupUnavailable("the leader stopped the group")

    def _header(self, op: int, layer: int = 0, t: int = 0, k: int = 0,
                pairs: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
        h = torch.zeros(self.header_len, dtype=torch.int64)
        h[:HEADER_FIXED] = torch.tensor([op, layer, t, k])
        for r, (u, n) in enumerate(pairs):
            h[HEADER_FIXED + 2 * r], h[HEADER_FIXED + 2 * r + 1] = u, n
        return h.to(self.device)

    # -- leader --
    def dispatch(self, layer: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 num_experts: int, w13: ExpertWeights, w2: ExpertWeights,
                 backend: MatmulChoice = "onednn") -> torch.Tensor:
        """One MoE layer across the group (leader only): ``x`` [T, D], ``weights``/``experts`` [T, k] →
        ``[T, D]`` routed experts' output; ``w13``/``w2`` the leader's own block.

        Raises:
            GroupUnavailable: a rank died or timed out (the group is then broken for good).
        """
        with self._lock:
            self._check()  # under the lock: a heartbeat that found the group broken held it
            t0 = time.perf_counter()
            try:
                if self.mode == "broadcast":
                    out, own_s = self._dispatch_broadcast(layer, x, weights, experts, num_experts, w13, w2, backend)
                else:
                    out, own_s = self._dispatch_routed(layer, x, weights, experts, num_experts, w13, w2, backend)
            except GroupUnavailable:
                raise
            except Exception as exc:
                raise self._fail(f"layer {layer} dispatch", exc) from None
            self.counters.collective_s += time.perf_counter() - t0 - own_s
            self.counters.layers += 1
            self._last_exchange = time.monotonic()
        return out

    def _dispatch_routed(self, layer: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                         num_experts: int, w13: ExpertWeights, w2: ExpertWeights,
                         backend: MatmulChoice) -> tuple[torch.Tensor, float]:
        batches = plan_dispatch(weights, experts, num_experts, self.ep.size)
        self.counters.per_layer_ranks.append([b.slots for b in batches])
        header = self._header(OP_MOE, layer, x.shape[0], experts.shape[1],
                              [(b.num_tokens, b.slots) for b in batches])
        dist.broadcast(header, 0, group=self.pg)
        sends, recvs, partials = [], [], [torch.empty(0)] * self.ep.size
        for r, b in enumerate(batches[1:], start=1):
            if not b.slots:
                continue
            xr = x.index_select(0, b.tokens)  # [u_r, D]
            meta = torch.stack([b.rows, b.local_expert])  # [2, n_r]
            for t in (xr, meta, b.weight):
                sends.append((dist.isend(t, r, group=self.pg), t))
                self.counters.bytes_sent += _nbytes(t)
            partials[r] = x.new_empty(b.num_tokens, x.shape[1])
            recvs.append(dist.irecv(partials[r], r, group=self.pg))
            self.counters.bytes_received += _nbytes(partials[r])
        self.counters.bytes_sent += _nbytes(header) * (self.ep.size - 1)
        t_own = time.perf_counter()
        b0 = batches[0]
        partials[0] = expert_block_forward(x.index_select(0, b0.tokens), b0.rows, b0.local_expert,
                                           b0.weight, w13, w2, backend)
        own_s = time.perf_counter() - t_own
        self._wait([w for w, _ in sends])
        self._wait(recvs)
        return combine(x.shape[0], x.shape[1], batches, partials, x), own_s

    def _dispatch_broadcast(self, layer: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                            num_experts: int, w13: ExpertWeights, w2: ExpertWeights,
                            backend: MatmulChoice) -> tuple[torch.Tensor, float]:
        per_rank = plan_dispatch(weights, experts, num_experts, self.ep.size)
        self.counters.per_layer_ranks.append([b.slots for b in per_rank])
        header = self._header(OP_MOE, layer, x.shape[0], experts.shape[1])
        dist.broadcast(header, 0, group=self.pg)
        routing = torch.cat([experts.to(torch.float32), weights.float()], dim=1).contiguous()  # [T, 2k]
        xc = x.contiguous()
        dist.broadcast(xc, 0, group=self.pg)
        dist.broadcast(routing, 0, group=self.pg)
        t_own = time.perf_counter()
        b0 = per_rank[0]
        part = expert_block_forward(x.index_select(0, b0.tokens), b0.rows, b0.local_expert, b0.weight,
                                    w13, w2, backend)
        out = combine(x.shape[0], x.shape[1], [b0], [part], x)
        own_s = time.perf_counter() - t_own
        dist.reduce(out, 0, group=self.pg)
        n = self.ep.size - 1
        self.counters.bytes_sent += n * (_nbytes(header) + _nbytes(xc) + _nbytes(routing))
        self.counters.bytes_received += n * _nbytes(out)
        return out, own_s

    def ping(self, rss: int) -> list[int]:
        """Heartbeat (leader): a header and a gather of every rank's RSS (bytes), which it returns.

        Raises:
            GroupUnavailable: a rank died or timed out.
        """
        with self._lock:
            self._check()
            try:
                dist.broadcast(self._header(OP_PING), 0, group=self.pg)
                mine = torch.tensor([rss], dtype=torch.int64, device=self.device)
                gathered = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.ep.size)]
                dist.gather(mine, gathered, dst=0, group=self.pg)
            except Exception as exc:
                raise self._fail("heartbeat", exc) from None
            self._last_exchange = time.monotonic()
        values = [int(g.item()) for g in gathered]
        self.rss = list(values)
        return values

    def idle_for(self) -> float:
        """Seconds since the last exchange (the heartbeat sends when this reaches its period)."""
        return time.monotonic() - self._last_exchange

    def stop(self) -> None:
        """Tell the followers the leader is stopping (best effort), then leave the group."""
        if self.lost is None and self.ep.is_leader:
            with self._lock:
                if not self._stopped:
                    with contextlib.suppress(Exception):  # leaving anyway
                        dist.broadcast(self._header(OP_STOP), 0, group=self.pg)
                self._stopped = True  # a heartbeat after this is no loss
        self.close()

    def close(self) -> None:
        """Leave the group (not after it broke: a broken gloo group may block in its teardown, and the
        process exits next anyway)."""
        self._stopped = True
        if self.lost is None and dist.is_initialized():
            with contextlib.suppress(Exception):  # a broken group may refuse; the process exits next
                dist.destroy_process_group()

    def take_counters(self) -> StepCounters:
        """The counters since the last call (the leader calls it once per step)."""
        c, self.counters = self.counters, StepCounters()
        return c

    # -- follower --
    def follow_once(self, w13_of: Callable[[int], tuple[ExpertWeights, ExpertWeights]],
                    backend: MatmulChoice, rss: Callable[[], int]) -> Served:
        """Wait for the leader's next header and serve it (follower). ``w13_of(layer)``: this rank's
        ``(w13, w2)`` of MoE layer ``layer``; ``rss()``: this process's RSS for a heartbeat.

        Returns:
            What was served (:class:`Served`; the wait for the header itself is in neither time).

        Raises:
            GroupUnavailable: the leader left or went silent past the timeout.
        """
        header = torch.zeros(self.header_len, dtype=torch.int64, device=self.device)
        try:
            dist.broadcast(header, 0, group=self.pg)
            h = header.tolist()
            op, layer = int(h[0]), int(h[1])
            t_wait = time.perf_counter()
            if op == OP_PING:
                mine = torch.tensor([rss()], dtype=torch.int64, device=self.device)
                dist.gather(mine, None, dst=0, group=self.pg)
                return Served(op, layer, 0, time.perf_counter() - t_wait, 0.0)
            if op != OP_MOE:
                return Served(op, layer, 0, 0.0, 0.0)
            w13, w2 = w13_of(layer)
            if self.mode == "broadcast":
                return self._follow_broadcast(h, layer, w13, w2, backend)
            u, n = h[HEADER_FIXED + 2 * self.ep.rank], h[HEADER_FIXED + 2 * self.ep.rank + 1]
            if n == 0:
                return Served(op, layer, 0, 0.0, 0.0)
            t1 = time.perf_counter()
            x = torch.empty(u, self.dim, dtype=self.dtype, device=self.device)
            meta = torch.empty(2, n, dtype=torch.int64, device=self.device)
            w = torch.empty(n, dtype=torch.float32, device=self.device)
            self._wait([dist.irecv(t, 0, group=self.pg) for t in (x, meta, w)])
            t2 = time.perf_counter()
            y = expert_block_forward(x, meta[0], meta[1], w, w13, w2, backend)
            t3 = time.perf_counter()
            self._wait([dist.isend(y, 0, group=self.pg)])
            return Served(op, layer, n, (t2 - t1) + (time.perf_counter() - t3), t3 - t2)
        except Exception as exc:
            raise self._fail("following the leader", exc) from None

    def _follow_broadcast(self, h: list[int], layer: int, w13: ExpertWeights, w2: ExpertWeights,
                          backend: MatmulChoice) -> Served:
        t, k = int(h[2]), int(h[3])
        t1 = time.perf_counter()
        x = torch.empty(t, self.dim, dtype=self.dtype, device=self.device)
        routing = torch.empty(t, 2 * k, dtype=torch.float32, device=self.device)
        dist.broadcast(x, 0, group=self.pg)
        dist.broadcast(routing, 0, group=self.pg)
        t2 = time.perf_counter()
        experts, weights = routing[:, :k].to(torch.int64), routing[:, k:]
        mine = plan_dispatch(weights, experts, w13.shape[0] * self.ep.size, self.ep.size)[self.ep.rank]
        part = expert_block_forward(x.index_select(0, mine.tokens), mine.rows, mine.local_expert,
                                    mine.weight, w13, w2, backend)
        out = combine(t, self.dim, [mine], [part], x)
        t3 = time.perf_counter()
        dist.reduce(out, 0, group=self.pg)
        return Served(OP_MOE, layer, mine.slots, (t2 - t1) + (time.perf_counter() - t3), t3 - t2)


class LayerDispatch:
    """The leader's :class:`moe.ExpertDispatch` of one MoE module: its routed experts across the group."""

    def __init__(self, group: ExpertParallelGroup, layer: int, module: nn.Module) -> None:
        self.group, self.layer, self.module = group, layer, module

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        m = self.module
        w13, w2 = m.w13, m.w2
        assert isinstance(w13, (torch.Tensor, PackedExperts)) and isinstance(w2, (torch.Tensor, PackedExperts))
        return self.group.dispatch(self.layer, x, weights, experts, int(w13.shape[0]) * self.group.ep.size,
                                   w13, w2, getattr(m, "matmul_backend", "onednn"))


def attach(model: nn.Module, group: ExpertParallelGroup) -> int:
    """Route every MoE module of the (sharded) leader's ``model`` through ``group``; returns how many."""
    mods = moe_modules(model)
    for layer, m in enumerate(mods):
        setattr(m, "expert_parallel", LayerDispatch(group, layer, m))  # noqa: B010 - nn.Module types attributes as tensors
    return len(mods)


def expert_weights(model: nn.Module) -> list[tuple[ExpertWeights, ExpertWeights]]:
    """``(w13, w2)`` of every MoE module, layer order (a follower's lookup table; dense or packed)."""
    out = []
    for m in moe_modules(model):
        w13, w2 = m.w13, m.w2
        assert isinstance(w13, (torch.Tensor, PackedExperts)) and isinstance(w2, (torch.Tensor, PackedExperts))
        out.append((w13, w2))
    return out
