"""The expert-parallel roles of a worker process (issue 15): the leader's group wiring and the follower's loop.

**Leader** (rank 0, :func:`join_as_leader`): serves HTTP, schedules and budgets as the single-process
worker does; its model holds attention, routers, shared experts and its own expert block, and every MoE
module dispatches through the group (:mod:`moeguard_runtime.parallel.expert_parallel`). A heartbeat thread pings
the group every ``min(1 s, timeout / 4)`` and gathers every rank's RSS. When the group breaks, the
worker answers every request in flight and every new one with 503 ``expert_parallel_group_unavailable``
(Retry-After), fails ``/readyz``, and ``__main__`` exits with ``contract.EXIT_EP_GROUP_LOST``.

**Follower** (rank > 0, :func:`run_follower`): builds the same model from the same checkpoint or preset
seed, keeps only its expert block, joins the group and follows the leader's headers until the leader
stops (exit 0) or the group breaks (exit ``contract.EXIT_EP_GROUP_LOST``). It serves a small HTTP
endpoint on ``MOEGUARD_PORT``: ``/healthz`` (200 while its loop runs), ``/readyz`` (200 only once it has
joined the group and while the group works), ``/metrics`` (its own per-rank series), and 503
``not_the_leader`` to anything else (completions go to the leader).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import torch
from prometheus_client import CollectorRegistry, generate_latest
from torch import nn

from moeguard_core import contract
from moeguard_runtime.memory.procmem import read_process_memory
from moeguard_runtime.model.moe import (
    ExpertWeights,
    MatmulChoice,
    PackedExperts,
    pack_experts,
    uses_packed,
)
from moeguard_runtime.parallel.ep_config import EpSettings, expert_range, local_rank_env
from moeguard_runtime.parallel.ep_telemetry import EpMetrics
from moeguard_runtime.parallel.expert_parallel import (
    HEARTBEAT_S,
    OP_STOP,
    ExpertParallelGroup,
    GroupUnavailable,
    attach,
    expert_weights,
    moe_modules,
    shard_experts,
    strip_to_experts,
)
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, worker_labels

if TYPE_CHECKING:
    from moeguard_core.presets import ModelArgs
    from moeguard_runtime.config import Settings
    from moeguard_runtime.engine.service import Worker


def heartbeat_period(timeout_s: float) -> float:
    """Seconds between the leader's pings: :data:`expert_parallel.HEARTBEAT_S`, at most a quarter of the
    timeout (a follower waits for the next header at most the timeout)."""
    return min(HEARTBEAT_S, timeout_s / 4)


def num_experts_of(model: nn.Module) -> int:
    """The routed experts per MoE layer of an unsharded ``model`` (0 when it has no MoE layer)."""
    mods = moe_modules(model)
    if not mods:
        return 0
    w13 = mods[0].w13
    assert isinstance(w13, (torch.Tensor, PackedExperts))
    return int(w13.shape[0])


def _rss() -> int:
    return read_process_memory().rss or 0


def log_group(log: RateLimitedLog, ep: EpSettings, num_experts: int, role: str, **extra: Any) -> None:
    """``event=ep_group_formed``: the group's shape and every rank's expert block."""
    ranges = ";".join(f"{r}:{lo}-{hi}" for r in range(ep.size)
                      for lo, hi in [expert_range(r, ep.size, num_experts)])
    log.event("ep_group_formed", force=True, role=role, rank=ep.rank, ranks=ep.size, pods=ep.group_size,
              leader=f"{ep.leader_address}:{ep.port}", timeout_seconds=ep.timeout_s,
              experts=num_experts, expert_ranges=ranges, **extra)


def join_as_leader(ep: EpSettings, model: nn.Module, worker: Worker, registry: CollectorRegistry,
                   labels: dict[str, str], num_experts: int, log: RateLimitedLog,
                   device: torch.device, dtype: torch.dtype) -> ExpertParallelGroup:
    """Join the group as rank 0 (the model already sharded), route the MoE modules through it, export the
    per-rank metrics and start the heartbeat.

    Raises:
        GroupUnavailable: the group did not form within ``ep.join_timeout_s``.
    """
    t0 = time.monotonic()
    dim = int(expert_weights(model)[0][0].shape[2])
    group = ExpertParallelGroup(ep, device, dtype, dim, on_lost=worker.group_lost)
    metrics = EpMetrics(registry, labels, 0, ep.size, expert_range(0, ep.size, num_experts))
    layers = attach(model, group)

    def before(_m: nn.Module, _a: Any) -> None:
        group.take_counters()

    def after(_m: nn.Module, _a: Any, _o: Any) -> None:
        metrics.observe_leader_step(group.take_counters())

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after)
    rss = group.ping(_rss())
    metrics.set_rss(rss)
    metrics.set_up(True)
    log_group(log, ep, num_experts, "leader", moe_layers=layers, join_seconds=round(time.monotonic() - t0, 3),
              rank_rss_bytes=",".join(str(v) for v in rss))
    threading.Thread(target=_heartbeat, args=(group, metrics, heartbeat_period(ep.timeout_s)),
                     name="ep-heartbeat", daemon=True).start()
    return group


def _heartbeat(group: ExpertParallelGroup, metrics: EpMetrics, period: float) -> None:
    while group.lost is None and torch.distributed.is_initialized():
        time.sleep(period)
        try:
            metrics.set_rss(group.ping(_rss()))
        except GroupUnavailable:
            metrics.set_up(False)
            return
        except Exception:  # the group was destroyed at shutdown
            return


# --- the follower ----------------------------------------------------------------------------------
class FollowerState:
    """What the follower's HTTP endpoint reports."""

    def __init__(self, registry: CollectorRegistry, metrics: EpMetrics | None = None) -> None:
        self.registry = registry
        self.metrics = metrics
        self.joined = False
        self.lost: str | None = None
        self.loading = True

    def not_ready_reason(self) -> str | None:
        if self.loading:
            return "model is loading"
        if self.lost is not None:
            return f"{contract.EP_GROUP_UNAVAILABLE}: {self.lost}"
        if not self.joined:
            return "waiting for the expert-parallel group to form"
        return None


def _handler(state: FollowerState, rank: int) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return

        def _send(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8",
                  headers: Mapping[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path in ("/healthz", "/health"):
                self._send(200, b"ok")
            elif path == "/readyz":
                why = state.not_ready_reason()
                self._send(200 if why is None else 503, (why or "ok").encode())
            elif path == "/metrics":
                if state.metrics is not None:
                    state.metrics.set_own_rss(_rss())
                self._send(200, generate_latest(state.registry), "text/plain; version=0.0.4; charset=utf-8")
            else:
                self._not_leader()

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            if 0 < length <= 1 << 20:
                self.rfile.read(length)
            self._not_leader()

        def _not_leader(self) -> None:
            body = {"error": {"message": f"this pod is rank {rank} of an expert-parallel group, not its leader: "
                                         "send requests to the leader (the service selects leaders only)",
                              "type": "service_unavailable_error", "param": None,
                              "code": contract.EP_NOT_LEADER}}
            self._send(503, json.dumps(body).encode(), "application/json")

    return Handler


def report_ucx(registry: CollectorRegistry, labels: dict[str, str], log: RateLimitedLog) -> None:
    """A follower's UCX state, as the leader reports its own (:mod:`moeguard_core.ucx`): the settings come
    from the pod's env (the operator sets them on every pod of the group), the libraries from this process's
    maps (gloo/NCCL may map UCX); ``moeguard_ucx_info`` and ``event=ucx_info``, once after joining."""
    from prometheus_client import Gauge

    from moeguard_core.ucx import risky
    from moeguard_runtime.memory.ucx_scan import current_info
    from moeguard_runtime.telemetry.telemetry import UCX_LABELS

    info = current_info()
    Gauge(contract.METRIC_UCX_INFO, "1 for the UCX state of the process.", [*labels, *UCX_LABELS],
          registry=registry).labels(**labels, **info.labels()).set(1)
    log.event("ucx_info", force=True, risky="true" if risky(info) else "false", **info.labels())


def checkpoint_block(settings: Settings, ep: EpSettings) -> tuple[int, int] | None:
    """This rank's experts ``[lo, hi)`` when the model is an HF checkpoint folder (then it is loaded sharded:
    :attr:`hf_config.BuildOptions.expert_block`), else None (a preset is built whole, from its seed, and
    sharded after).

    Raises:
        CheckpointError: the folder's ``config.json`` is unreadable; ConfigError: the EP size does not divide
            its expert count.
    """
    from moeguard_runtime.model.hf_checkpoint import read_checkpoint_info
    from moeguard_runtime.model.hf_config import is_hf_folder

    if settings.checkpoint is None or not is_hf_folder(settings.checkpoint):
        return None
    return ep.expert_range(read_checkpoint_info(settings.checkpoint).num_experts)


def build_follower_model(settings: Settings, args: ModelArgs, block: tuple[int, int] | None = None) -> nn.Module:
    """The same model the leader builds (checkpoint, or preset and seed): a checkpoint with only the experts
    ``block`` read (:func:`checkpoint_block`), a preset whole, before sharding."""
    from moeguard_runtime.model.hf_checkpoint import load_hf_checkpoint
    from moeguard_runtime.model.hf_config import BuildOptions, is_hf_folder
    from moeguard_runtime.model.model import build_model

    if settings.checkpoint is not None and is_hf_folder(settings.checkpoint):
        loaded = load_hf_checkpoint(settings.checkpoint, settings.torch_dtype, settings.torch_device,
                                    BuildOptions(settings.expert_chunk_tokens, 0.0, "onednn", "host",
                                                 expert_block=block))
        model = loaded.model
        assert isinstance(model, nn.Module)
        return model
    return build_model(args, seed=settings.seed, expert_chunk_tokens=settings.expert_chunk_tokens,
                       checkpoint=settings.checkpoint, dtype=settings.torch_dtype, device=settings.torch_device,
                       matmul_backend="onednn", dispatch="host")


def follower_kernel(settings: Settings, experts: tuple[ExpertWeights, ExpertWeights],
                    routing: tuple[int, int] | None = None) -> MatmulChoice:
    """The expert-matmul kernel of a follower, chosen as the leader chooses its own
    (``MOEGUARD_MATMUL_BACKEND``; ``auto``: measured on the expert shapes, or the cached choice for this CPU,
    :mod:`moeguard_runtime.model.kernel_select`), so that equal hardware runs equal kernels on every rank.
    ``experts``: the dense weights of the first layer (a plan may want them packed: :func:`pack_follower`);
    ``routing``: ``(top_k, num_experts)`` of the whole model, whose full prefill budget's rows per expert
    (:func:`kernel_select.prefill_rows`) are timed as the leader times them."""
    from moeguard_runtime.model import kernel_select

    if settings.matmul_backend != "auto":
        return settings.matmul_backend
    from moeguard_runtime.memory.memory import read_memory, start_headroom

    w13, w2 = experts
    assert isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
    return kernel_select.select(w13, w2, threads=settings.torch_threads, cpu=kernel_select.cpu_model(),
                                headroom_bytes=start_headroom(read_memory(), settings.hard_limit_bytes),
                                prefill_rows=None if routing is None else kernel_select.prefill_rows(
                                    settings.budgets.max_prefill_tokens, *routing),
                                expert_chunk_tokens=settings.expert_chunk_tokens).plan


def pack_follower(model: nn.Module, weights: list[tuple[ExpertWeights, ExpertWeights]],
                  ) -> list[tuple[ExpertWeights, ExpertWeights]]:
    """The follower's experts packed (:func:`moe.pack_experts`) and its new lookup table; ``weights`` (the
    old table) is emptied first so that the dense tensors are freed as they are packed."""
    weights.clear()
    pack_experts(model)
    return expert_weights(model)


def run_follower(settings: Settings, ep: EpSettings, args: ModelArgs, env: Mapping[str, str],
                 log: RateLimitedLog, build: Callable[[], nn.Module] | None = None,
                 serve_http: bool = True) -> int:
    """Serve as follower rank ``ep.rank`` until the leader stops (0) or the group breaks
    (``contract.EXIT_EP_GROUP_LOST``); 3 when the model cannot be loaded. ``serve_http``: the small
    endpoint on ``MOEGUARD_PORT`` (the pod's main process; a child rank has none)."""
    registry = CollectorRegistry(auto_describe=True)
    labels = worker_labels(env)
    state = FollowerState(registry)
    if not serve_http:
        return _follow(settings, ep, args, labels, log, state, build)
    server = ThreadingHTTPServer((settings.host, settings.port), _handler(state, ep.rank))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="follower-http", daemon=True).start()
    try:
        return _follow(settings, ep, args, labels, log, state, build)
    finally:
        server.shutdown()
        server.server_close()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)``: a child rank never outlives the pod's main process."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def spawn_local_ranks(ep: EpSettings, env: Mapping[str, str], device: str,
                      log: RateLimitedLog) -> list[subprocess.Popen[bytes]]:
    """Start the pod's ranks ``1 .. ranks_per_pod - 1`` as child processes of the same command (followers
    without HTTP; on CUDA each on ``cuda:<local rank>``). They die with this process (``PR_SET_PDEATHSIG``)
    and are stopped when it exits; their output goes to this process's (the container's log)."""
    children = []
    for local in range(1, ep.ranks_per_pod):
        children.append(subprocess.Popen([sys.executable, "-m", "moeguard_runtime"],
                                         env=local_rank_env(env, ep, local, device), preexec_fn=_die_with_parent))
    log.event("ep_local_ranks_started", force=True, pod_rank=ep.rank, ranks_per_pod=ep.ranks_per_pod,
              child_pids=",".join(str(c.pid) for c in children))

    def stop() -> None:
        for c in children:
            if c.poll() is None:
                c.terminate()
        for c in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.wait(5)
            if c.poll() is None:
                c.kill()

    atexit.register(stop)
    return children


def _follow(settings: Settings, ep: EpSettings, args: ModelArgs, labels: dict[str, str], log: RateLimitedLog,
            state: FollowerState, build: Callable[[], nn.Module] | None) -> int:
    t0 = time.monotonic()
    try:
        block = None if build is not None else checkpoint_block(settings, ep)
        model = build() if build is not None else build_follower_model(settings, args, block)
        if block is not None:  # loaded sharded
            (lo, hi), num_experts = block, (block[1] - block[0]) * ep.size
        else:
            num_experts = num_experts_of(model)
            lo, hi = shard_experts(model, ep.rank, ep.size)
        freed = strip_to_experts(model)
        weights = expert_weights(model)
        dim = int(weights[0][0].shape[2])
    except Exception as exc:  # a bad checkpoint (or shape): say why and exit, as the leader does
        log.event("model_load_error", force=True, error=repr(exc)[:1000])
        return 3
    state.metrics = EpMetrics(state.registry, labels, ep.rank, ep.size, (lo, hi))
    state.loading = False
    log.event("ep_follower_loaded", force=True, rank=ep.rank, experts=f"{lo}-{hi}", moe_layers=len(weights),
              freed_bytes=freed, expert_bytes=sum(a.nbytes + b.nbytes for a, b in weights),
              load_seconds=round(time.monotonic() - t0, 3), port=settings.port)
    try:
        group = ExpertParallelGroup(ep, settings.torch_device, settings.torch_dtype, dim)
    except GroupUnavailable as exc:
        state.lost = str(exc)
        log.event("ep_join_failed", force=True, rank=ep.rank, error=str(exc))
        return contract.EXIT_EP_GROUP_LOST
    state.joined = True
    state.metrics.set_up(True)
    log_group(log, ep, num_experts, "follower", own_experts=f"{lo}-{hi}")
    report_ucx(state.registry, labels, log)
    backend = follower_kernel(settings, weights[0], (args.top_k, num_experts))
    if uses_packed(backend):
        weights = pack_follower(model, weights)
    try:
        while True:
            served = group.follow_once(lambda layer: weights[layer], backend, _rss)
            if served.op == OP_STOP:
                log.event("ep_leader_stopped", force=True, rank=ep.rank)
                group.close()
                return 0
            if served.comm_s:
                state.metrics.observe_collective(served.comm_s)
            state.metrics.observe_follower_layer(served.layer, served.slots)
    except GroupUnavailable as exc:
        state.lost = str(exc)
        state.metrics.set_up(False)
        log.event("ep_group_lost", force=True, rank=ep.rank, reason=str(exc))
        return contract.EXIT_EP_GROUP_LOST

