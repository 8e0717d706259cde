"""``python -m moeguard_runtime``: build the model, start the engine loop, the
budget watch and the HTTP server. All configuration from the environment
(:mod:`moeguard_runtime.config`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from moeguard_runtime.config import ConfigError, Settings, load_settings
from moeguard_runtime.telemetry import RateLimitedLog, Telemetry, configure_logging, worker_labels

if TYPE_CHECKING:
    from moeguard_runtime.service import Worker


def main() -> int:
    configure_logging()
    log = RateLimitedLog()
    try:
        settings = load_settings()
    except ConfigError as exc:
        log.event("config_error", force=True, error=str(exc))
        return 2
    import torch
    import uvicorn

    from moeguard_runtime import presets
    from moeguard_runtime.engine import Engine
    from moeguard_runtime.model import build_model
    from moeguard_runtime.server import create_app
    from moeguard_runtime.service import Worker

    torch.set_num_threads(settings.torch_threads)
    try:
        args = presets.get_preset(settings.preset)
    except KeyError as exc:
        log.event("config_error", force=True, error=str(exc.args[0]))
        return 2
    log = RateLimitedLog(settings.log_interval_s)
    model = build_model(args, seed=settings.seed, expert_chunk_tokens=settings.expert_chunk_tokens)
    telemetry = Telemetry(worker_labels(), args.num_experts)
    worker = Worker(settings, Engine(model), telemetry, log)
    log.event("worker_start", force=True, preset=settings.preset, seed=settings.seed,
              parameters=presets.parameter_count(args), torch_threads=settings.torch_threads,
              port=settings.port, **settings.budgets.model_dump())
    worker.start()
    _start_budget_watch(settings, worker, log)
    app = create_app(worker, f"moeguard-{settings.preset}")
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning",
                access_log=False)
    worker.stop()
    return 0


def _start_budget_watch(settings: Settings, worker: Worker, log: RateLimitedLog) -> None:
    from moeguard_runtime.budget_watch import BudgetWatcher, load_kube_config

    if settings.budget_configmap is None:
        log.event("budget_watch_disabled", force=True, reason="MOEGUARD_BUDGET_CONFIGMAP unset")
        return
    try:
        source = load_kube_config()
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
