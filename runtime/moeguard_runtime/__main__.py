"""``python -m moeguard_runtime``: build the model, start the engine loop, the
budget watch and the HTTP server. All configuration from the environment
(:mod:`moeguard_runtime.config`)."""

from __future__ import annotations

import os
from collections.abc import Mapping

# Before torch loads libgomp: OpenMP threads that sleep at a barrier instead of
# spinning. On a shared or CPU-limited (CFS quota) machine, spinning threads steal
# the cores the work needs: 2-thread fp32 matmuls of 2 to 8 rows ran 30-40x slower
# with the default policy on the 2-core benchmark machine (bench/results/runtime.md).
# Set OMP_WAIT_POLICY=ACTIVE in the environment to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeguard_core.memory_model_info import ModelMemory
from moeguard_runtime.config import (
    ConfigError,
    Settings,
    load_settings,
    model_args,
)
from moeguard_runtime.model.checkpoint import CheckpointError
from moeguard_runtime.model.hf_checkpoint import read_checkpoint_info
from moeguard_runtime.model.hf_config import HFConfig, is_hf_folder
from moeguard_runtime.model.moe import DENSE_BACKENDS
from moeguard_runtime.telemetry.telemetry import (
    RateLimitedLog,
    Telemetry,
    configure_logging,
    worker_labels,
    write_termination_message,
)

if TYPE_CHECKING:
    from moeguard_core.memory_admission import MemoryAdmission, StepPredictor
    from moeguard_core.presets import ModelArgs
    from moeguard_runtime.api.server import WorkerSlot
    from moeguard_runtime.engine.service import Worker
    from moeguard_runtime.model.moe import MatmulBackend
    from moeguard_runtime.model.serving import ServingModel
    from moeguard_runtime.parallel.ep_config import EpSettings


def main(env: Mapping[str, str] | None = None) -> int:
    """Serve the worker configured by ``env`` (default ``os.environ``): the contract's variables as
    the operator sets them, and the worker's own knobs (:mod:`moeguard_runtime.config`).
    Returns the exit status: 0 after a clean shutdown, 2 for a configuration error, 3 when the
    model or tokenizer cannot be loaded."""
    env = os.environ if env is None else env
    configure_logging()
    log = RateLimitedLog()
    from moeguard_runtime.parallel.ep_config import load_ep_settings

    try:
        settings = load_settings(env)
        ep = load_ep_settings(env, settings.capacity_factor)
    except ConfigError as exc:
        _fail(log, "config_error", str(exc))
        return 2
    import torch
    import uvicorn

    from moeguard_runtime.api.server import WorkerSlot, create_app

    torch.set_num_threads(settings.torch_threads)
    try:
        args = model_args(settings)
    except KeyError as exc:
        _fail(log, "config_error", str(exc.args[0]))
        return 2
    except ConfigError as exc:
        _fail(log, "config_error", str(exc))
        return 2
    hf_info = None
    if settings.checkpoint is not None and is_hf_folder(settings.checkpoint):
        try:  # an HF folder: its config.json, not the preset, gives the model's shape
            hf_info = read_checkpoint_info(settings.checkpoint)
            vocab_size = HFConfig.read(Path(settings.checkpoint)).get_int("vocab_size")
        except CheckpointError as exc:
            _fail(log, "config_error", str(exc))
            return 2
    num_experts = hf_info.num_experts if hf_info else args.num_experts
    max_seq_len = hf_info.max_seq_len if hf_info else args.max_seq_len
    if ep is not None:
        try:
            ep.expert_range(num_experts)
        except ConfigError as exc:
            _fail(log, "config_error", str(exc))
            return 2
        from moeguard_runtime.parallel.ep_worker import run_follower, spawn_local_ranks

        if ep.local_rank == 0 and ep.ranks_per_pod > 1:  # the pod's other ranks, as child processes
            spawn_local_ranks(ep, env, settings.device, log)
        if not ep.is_leader:  # a follower rank: no API, no scheduler; HTTP only on the pod's main process
            return run_follower(settings, ep, args, env, RateLimitedLog(settings.log_interval_s),
                                serve_http=ep.local_rank == 0)
    from moeguard_runtime.api.checkpoint_tokenizer import TokenizerError, load_tokenizer

    try:  # before serving: a bad tokenizer or chat template stops the worker, naming the file
        tok, chat_template = load_tokenizer(settings.checkpoint,
                                            vocab_size if hf_info else args.vocab_size)
    except TokenizerError as exc:  # the pod's termination message, so the operator's Ready=False names it
        _fail(log, "tokenizer_error", str(exc)[:1000])
        return 2
    from moeguard_runtime.faults import load_library

    try:  # the test-only load-library fault (a UCX library mapped as NIXL would), before serving
        if load_library(settings.faults) is not None:
            log.event("fault_enabled", force=True, load_library=settings.faults.load_library)
    except OSError as exc:
        _fail(log, "config_error", f"MOEGUARD_FAULT_LOAD_LIBRARY: {exc}"[:1000])
        return 2
    log = RateLimitedLog(settings.log_interval_s)
    telemetry = Telemetry(worker_labels(env), num_experts)
    slot = WorkerSlot(telemetry, settings.served_model_name, max_seq_len, tokenizer=tok,
                      model_aliases=(settings.preset, f"moeguard-{settings.preset}"),
                      model_type=hf_info.model_type if hf_info else "mixtral",
                      chat_template=chat_template, role=settings.role, prefill_timeout_s=settings.kv_lease_s)
    if settings.prefill_url is not None:  # a decode worker
        from moeguard_runtime.api.pd_routes import PrefillClient

        slot.prefill_client = PrefillClient(settings.prefill_url, settings.kv_lease_s)
    failed = threading.Event()
    group_lost = threading.Event()
    loader = threading.Thread(target=_load, args=(settings, args, slot, log, failed, env, ep, group_lost),
                              name="model-loader", daemon=True)
    loader.start()  # /healthz answers and /readyz says "loading" meanwhile
    app = create_app(slot, settings.max_body_bytes)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=2)
    server = _draining_server(uvicorn, config, slot, settings.drain_s, log, settings.shutdown_delay_s)
    threading.Thread(target=_stop_on_failure, args=(failed, server), daemon=True).start()
    threading.Thread(target=_stop_on_failure, args=(group_lost, server, EP_EXIT_GRACE_S), daemon=True).start()
    server.run()
    if slot.worker is not None:
        slot.worker.stop()
        if slot.worker.ep_group is not None:
            slot.worker.ep_group.stop()
    if group_lost.is_set():
        from moeguard_core.contract import EXIT_EP_GROUP_LOST

        return EXIT_EP_GROUP_LOST
    return 3 if failed.is_set() else 0


EP_EXIT_GRACE_S = 1.0
"""After the expert-parallel group broke and the requests in flight were answered with 503, how long the
leader keeps answering (503, ``/readyz`` 503) before it exits: the answers leave before the socket closes."""


def _load(settings: Settings, args: ModelArgs, slot: WorkerSlot, log: RateLimitedLog,
          failed: threading.Event, env: Mapping[str, str], ep: EpSettings | None = None,
          group_lost: threading.Event | None = None) -> None:
    """Build (or load) the model, start the engine loop and the budget watch."""
    from moeguard_core import presets
    from moeguard_runtime.engine.engine import Engine
    from moeguard_runtime.engine.service import Worker
    from moeguard_runtime.model.hf_checkpoint import load_hf_checkpoint
    from moeguard_runtime.model.hf_config import BuildOptions
    from moeguard_runtime.model.model import build_model

    t0 = time.monotonic()
    try:
        if settings.torch_device.type == "cuda" and settings.torch_device.index is not None:
            import torch

            torch.cuda.set_device(settings.torch_device)  # cuda:N: caches and streams there
        model: ServingModel
        block: tuple[int, int] | None = None
        if settings.checkpoint is not None and is_hf_folder(settings.checkpoint):
            if ep is not None:  # the leader's experts only are read (the followers read theirs)
                from moeguard_runtime.parallel.ep_worker import checkpoint_block

                block = checkpoint_block(settings, ep)
            loaded = load_hf_checkpoint(settings.checkpoint, settings.torch_dtype,
                                        settings.torch_device,
                                        BuildOptions(settings.expert_chunk_tokens,
                                                     settings.capacity_factor,
                                                     initial_kernel(settings),
                                                     settings.moe_dispatch, expert_block=block))
            model, model_type = loaded.model, loaded.model_type
            shape: ModelArgs | dict[str, Any] = loaded.config
            parameters = sum(p.numel() for p in model.parameters())
            eos_ids = frozenset(loaded.eos_token_ids) | slot.tokenizer.eos_ids
        else:
            model = build_model(args, seed=settings.seed,
                                expert_chunk_tokens=settings.expert_chunk_tokens,
                                capacity_factor=settings.capacity_factor,
                                checkpoint=settings.checkpoint,
                                dtype=settings.torch_dtype, device=settings.torch_device,
                                matmul_backend=initial_kernel(settings),
                                dispatch=settings.moe_dispatch)
            model_type, parameters = "preset", presets.parameter_count(args)
            eos_ids = slot.tokenizer.eos_ids
            shape = args
    except Exception as exc:  # a bad checkpoint: say why and exit
        _fail(log, "model_load_error", str(exc)[:1000])
        failed.set()
        return
    if ep is not None:
        from torch import nn

        from moeguard_runtime.parallel.ep_worker import num_experts_of
        from moeguard_runtime.parallel.expert_parallel import shard_experts

        assert isinstance(model, nn.Module)
        if block is not None:  # loaded sharded
            ep_experts = (block[1] - block[0]) * ep.size
        else:
            ep_experts = num_experts_of(model)
            shard_experts(model, 0, ep.size)  # the leader keeps its block; the others live on the followers
    kernel = choose_matmul_kernel(settings, model, slot.telemetry, log)
    weight_bytes = slot.telemetry.set_model_weights(model.parameters())
    admission, predictor = step_models(settings, shape, log)
    if predictor is not None:  # the operator predicts each pod's peak with the same model (issue 30)
        slot.telemetry.set_memory_model(ModelMemory(predictor.shape, predictor.dtype, predictor.expert_chunk_tokens,
                                                    predictor.capacity_factor))
    # generation ends on the checkpoint's generation_config EOS ids and the tokenizer's (as transformers' generate)
    handoff = None
    if settings.role != "single":  # disaggregated prefill/decode: the KV moves over NIXL's UCX (issue 33)
        from moeguard_runtime.disagg.nixl_kv import KVTransferError, NixlKV
        from moeguard_runtime.engine.kv_handoff import KVHandoff

        try:
            handoff = KVHandoff(NixlKV(settings.role), settings.kv_transfer_timeout_s, settings.kv_lease_s)
        except KVTransferError as exc:
            _fail(log, "kv_transport_error", str(exc)[:1000])
            failed.set()
            return
    worker = Worker(settings, Engine(model, eos_ids=eos_ids), slot.telemetry, log, admission=admission,
                    predictor=predictor, handoff=handoff)
    log.event("worker_start", force=True, preset=settings.preset, seed=settings.seed,
              checkpoint=settings.checkpoint, model_type=model_type, parameters=parameters, role=settings.role,
              device=settings.device, dtype=settings.dtype,
              matmul_backend=settings.matmul_backend, matmul_kernel=kernel, moe_dispatch=settings.moe_dispatch,
              model_overrides=dict(settings.model_overrides) or None,
              weight_bytes=weight_bytes,
              load_seconds=round(time.monotonic() - t0, 3), torch_threads=settings.torch_threads,
              omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
              port=settings.port, capacity_factor=settings.capacity_factor,
              overload_mode=settings.overload_mode,
              long_request_threshold_tokens=settings.limits.long_request_threshold_tokens,
              max_concurrent_requests=settings.limits.max_concurrent_requests,
              memory_admission=settings.memory_admission if admission is not None else "off",
              **settings.budgets.model_dump())
    if ep is not None:
        from moeguard_runtime.parallel.ep_worker import join_as_leader
        from moeguard_runtime.parallel.expert_parallel import GroupUnavailable

        if group_lost is not None:
            worker.on_group_lost = lambda _msg: group_lost.set()
        try:
            assert isinstance(model, nn.Module)
            first = next(model.parameters())
            worker.ep_group = join_as_leader(ep, model, worker, slot.telemetry.registry, slot.telemetry.labels,
                                             ep_experts, log, first.device, first.dtype)
        except GroupUnavailable as exc:
            _fail(log, "ep_join_failed", str(exc))
            failed.set()
            return
    worker.start()
    slot.worker = worker
    _start_budget_watch(settings, worker, log, env)


def initial_kernel(settings: Settings) -> MatmulBackend:
    """The kernel the model is built with: the setting, or ``onednn`` until ``auto`` has measured (or
    until :func:`choose_matmul_kernel` packs the weights for ``onednn_packed``)."""
    backend = settings.matmul_backend
    return next((k for k in DENSE_BACKENDS if k == backend), "onednn")


def choose_matmul_kernel(settings: Settings, model: object, telemetry: Telemetry,
                         log: RateLimitedLog) -> str:
    """With ``MOEGUARD_MATMUL_BACKEND=auto``, measure the candidate kernels on the model's own
    expert shapes, at the row counts of decode and of a full prefill budget (or read the cached choice, :mod:`moeguard_runtime.model.kernel_select`) and give
    the plan to every MoE layer (a packed plan packs the experts' weights, replacing the dense ones:
    called after loading and sharding, before the weight bytes are counted); with ``onednn_packed``,
    pack without measuring (``config`` has checked that the weights can be packed); log
    ``event=matmul_kernel_selected`` (and
    ``event=kernel_cache_off`` when the cache cannot be written, ``event=kernel_candidate_skipped`` for a
    candidate left out: packing without room, the ``stream`` kernel where it cannot be built), set
    ``moeguard_matmul_kernel_info``. Returns the kernel's label."""
    from torch import nn

    from moeguard_runtime.model import kernel_select, stream_kernel

    cpu = kernel_select.cpu_model()
    kernel: str = settings.matmul_backend
    experts = kernel_select.first_experts(model) if isinstance(model, nn.Module) else None
    if settings.matmul_backend == "auto" and isinstance(model, nn.Module) and experts is not None:
        from moeguard_runtime.memory.memory import read_memory, start_headroom

        selection = kernel_select.select(
            *experts, threads=settings.torch_threads, cpu=cpu,
            headroom_bytes=start_headroom(read_memory(), settings.hard_limit_bytes),
            prefill_rows=kernel_select.model_prefill_rows(model, settings.budgets.max_prefill_tokens),
            expert_chunk_tokens=settings.expert_chunk_tokens)
        del experts  # a packed plan replaces the dense weights: no reference may keep them
        kernel_select.apply_plan(model, selection.plan)
        kernel = selection.plan.label
        if selection.packed_skipped is not None:
            log.event("kernel_candidate_skipped", force=True, kernel="onednn_packed",
                      reason=selection.packed_skipped)
        if settings.device == "cpu" and (no_stream := stream_kernel.unavailable()) is not None:
            log.event("kernel_candidate_skipped", force=True, kernel="stream", reason=no_stream)
        if selection.cache_error is not None:
            log.event("kernel_cache_off", force=True, directory=kernel_select.cache_dir(),
                      reason=selection.cache_error[:300])
        log.event("matmul_kernel_selected", force=True, kernel=kernel, cpu=cpu,
                  isa=",".join(kernel_select.isa_flags()), cached=selection.cached,
                  measure_seconds=round(selection.measure_s, 3), cache_file=selection.cache_file,
                  dtype=settings.dtype, device=settings.device,
                  **{f"us_{rows}_rows_{k}": round(s * 1e6, 1)
                     for rows, by_kernel in selection.seconds.items() for k, s in by_kernel.items()})
    elif settings.matmul_backend == "auto":
        kernel = "onednn"
    elif settings.matmul_backend == "onednn_packed" and isinstance(model, nn.Module):
        del experts  # packing frees the dense weights: no reference may keep them
        kernel_select.apply_plan(model, "onednn_packed")
    telemetry.set_matmul_kernel(kernel, cpu)
    return kernel


def step_models(settings: Settings, shape: ModelArgs | dict[str, Any],
                log: RateLimitedLog) -> tuple[MemoryAdmission | None, StepPredictor | None]:
    """The memory model of the worker's steps for a preset's ``ModelArgs`` or a checkpoint's ``config.json``:
    ``(admission, predictor)``. ``admission``: the memory-aware admission
    (:mod:`moeguard_core.memory_admission`), None when off (``Settings.admits_by_prediction``);
    ``predictor``: the model the step loop predicts every step with (``moeguard_memory_peak_breakdown_bytes``),
    the admission itself when on. Both None for a shape the memory model does not know (logged as
    ``event=memory_admission_off`` when admission was asked for)."""
    from moeguard_core.family_shape import ConfigError, from_hf_config
    from moeguard_core.memory_admission import MemoryAdmission, StepPredictor

    admits = settings.admits_by_prediction and settings.hard_limit_bytes is not None
    try:
        family = from_hf_config(shape) if isinstance(shape, dict) else shape
    except ConfigError as exc:
        if admits:
            log.event("memory_admission_off", force=True, reason=str(exc)[:300])
        return None, None
    if not admits or settings.hard_limit_bytes is None:
        return None, StepPredictor(family, settings.dtype, settings.expert_chunk_tokens, settings.capacity_factor)
    admission = MemoryAdmission(family, settings.dtype, settings.hard_limit_bytes, settings.expert_chunk_tokens,
                                settings.capacity_factor)
    return admission, admission


def _fail(log: RateLimitedLog, event: str, error: str) -> None:
    """Log a start-up failure and leave it in the container's termination message (the pod's
    ``lastState.terminated.message``, which the operator puts in its Ready condition)."""
    log.event(event, force=True, error=error)
    write_termination_message(f"{event}: {error}")


DRAIN_POLL_S = 0.1


def _draining_server(uvicorn: Any, config: Any, slot: WorkerSlot, drain_s: float, log: RateLimitedLog,
                     shutdown_delay_s: float = 0.0) -> Any:
    """A uvicorn server whose first SIGTERM drains (Kubernetes stops a pod with SIGTERM, then SIGKILL
    after ``terminationGracePeriodSeconds``): the worker stops admitting (new requests get 503
    ``shutting_down`` with Retry-After, ``/readyz`` 503) while it keeps serving; the requests it accepted
    finish, or after ``drain_s`` seconds are ended with a 503 error (an SSE error event for a stream
    already answering): none is lost silently. It keeps answering so for ``shutdown_delay_s`` seconds at
    least (``config.ENV_SHUTDOWN_DELAY_SECONDS``: while Services stop routing to it). Then the server stops
    and the process exits 0. A second SIGTERM, or SIGINT, stops at once (uvicorn's own handling)."""

    class DrainingServer(uvicorn.Server):  # type: ignore[misc]
        draining = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig == signal.SIGTERM and not self.draining:
                self.draining = True
                threading.Thread(target=self._drain, name="drain", daemon=True).start()
                return
            super().handle_exit(sig, frame)

        def _drain(self) -> None:
            worker, t0 = slot.worker, time.monotonic()
            if worker is not None:
                worker.drain()
                while worker.in_flight() and time.monotonic() - t0 < drain_s:
                    time.sleep(DRAIN_POLL_S)
                if worker.in_flight():
                    worker.cut(f"the worker is shutting down (SIGTERM) and the request did not finish within "
                               f"the drain period of {drain_s:g} s; retry on another replica")
            time.sleep(max(0.0, shutdown_delay_s - (time.monotonic() - t0)))
            log.event("drain_done", force=True, seconds=round(time.monotonic() - t0, 3))
            self.should_exit = True

    return DrainingServer(config)


def _stop_on_failure(failed: threading.Event, server: Any, grace_s: float = 0.0) -> None:
    failed.wait()
    time.sleep(grace_s)
    server.should_exit = True


def _start_budget_watch(settings: Settings, worker: Worker, log: RateLimitedLog, env: Mapping[str, str]) -> None:
    from moeguard_runtime.engine.budget_watch import BudgetWatcher, load_kube_config

    if settings.budget_configmap is None:
        log.event("budget_watch_disabled", force=True, reason="MOEGUARD_BUDGET_CONFIGMAP unset")
        return
    try:
        source = load_kube_config(env)
    except Exception as exc:
        log.event("budget_watch_disabled", force=True, reason=f"kube config: {exc!r}"[:300])
        return
    if source is None:
        log.event("budget_watch_disabled", force=True,
                  reason="neither KUBERNETES_SERVICE_HOST nor KUBECONFIG is set")
        return
    log.event("budget_watch_start", force=True, configmap=settings.budget_configmap,
              namespace=settings.namespace, config=source)
    watcher = BudgetWatcher(settings.budget_configmap, settings.namespace, worker.on_budget_data,
                            lambda event, **f: log.event(event, **f))
    watcher.start()


if __name__ == "__main__":
    sys.exit(main())
