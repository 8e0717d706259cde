"""``python -m moeguard_operator``: run the operator (kopf) with moeguard's handlers.

Flags mirror ``kopf run``: ``--namespace`` (repeatable) or ``--all-namespaces``,
``--standalone`` (no peering) or ``--peering NAME`` with ``--priority N`` (active/standby
replicas: the highest live priority works), ``--liveness URL``, ``--metrics-port``, and
``--prometheus-url`` (the default for resources whose spec names none), ``--allowed-prometheus-url``
(repeatable: other URLs a spec may name), ``--prometheus-ca-file`` (verify Prometheus's TLS against this
bundle), ``--allow-secrets`` (let specs put Secrets into the worker pods), ``--timer-interval-seconds`` (the control
loop's tick), ``--look-deadline-seconds`` (one look at one Prometheus). Test only: the environment variable
``MOEGUARD_TEST_PAUSE_AT`` (``after-configmap``, ``after-status``) blocks a decision's writes there. Every option of
moeguard's own reaches the handlers in one :class:`~moeguard_operator.config.OperatorConfig`.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import ssl

import kopf
import prometheus_client

from moeguard_operator import handlers
from moeguard_operator.config import POLICIES, TEST_PAUSE_ENV, OperatorConfig
from moeguard_operator.constants import PROMETHEUS_URL_ENV
from moeguard_operator.loop import observe


class _QuietRoutine(logging.Filter):
    """Drop kopf's INFO line for every watch event handed to the control loop (one per pod, ConfigMap,
    Deployment and service change)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO
                    and record.getMessage().startswith(f"Handler '{handlers.WATCH_PREFIX}")
                    and record.getMessage().endswith(" succeeded."))


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, OperatorConfig]:
    """The command line, and the :class:`OperatorConfig` it sets.

    Raises:
        SystemExit: the command line is invalid (argparse prints why), or ``--help``.
    """
    parser = argparse.ArgumentParser(prog="moeguard-operator", description=__doc__.splitlines()[0])
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="namespace to watch (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--prometheus-url", default=os.environ.get(PROMETHEUS_URL_ENV),
                        help=f"default Prometheus URL (env {PROMETHEUS_URL_ENV})")
    parser.add_argument("--allowed-prometheus-url", action="append", default=[], metavar="URL",
                        help="a Prometheus URL that spec.control.prometheusUrl may name (repeatable; exact match, "
                             "a trailing / ignored); default: only --prometheus-url. Any other is stalled: the "
                             "operator would fetch it from inside the cluster")
    parser.add_argument("--prometheus-ca-file", default=None, metavar="PEM",
                        help="CA bundle that Prometheus's TLS certificate is verified against (default: the "
                             "system trust store; verification is always on)")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--standalone", action="store_true", help="no peering (one operator replica)")
    peering.add_argument("--peering", default=None, help="kopf peering object name (several replicas)")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority; the highest live one works, the others stand by "
                             "(default with --peering: random, so that replicas differ)")
    parser.add_argument("--liveness", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve the operator's Prometheus metrics on this port (0.0.0.0)")
    parser.add_argument("--peering-lifetime-seconds", type=int, default=OperatorConfig.peering_lifetime_seconds,
                        help="seconds after which a standby replica takes over from a silent active one "
                             "(default: %(default)s)")
    parser.add_argument("--timer-interval-seconds", type=float, default=OperatorConfig.timer_interval_seconds,
                        help="the control loop's tick: the longest it sleeps between two passes, seconds "
                             "(default: %(default)s; a watch event wakes it at once)")
    parser.add_argument("--look-deadline-seconds", type=float, default=OperatorConfig.look_deadline_seconds,
                        help="deadline of one look at one Prometheus URL, seconds (default: %(default)s); past it "
                             "the look is blind for the services due there")
    parser.add_argument("--leak-warmup-seconds", type=float, default=OperatorConfig.leak_warmup_seconds,
                        help="a worker's warm-up before its RSS slope may count as a leak, seconds "
                             "(default: %(default)s; shorter only in tests)")
    parser.add_argument("--policy", choices=POLICIES, default=OperatorConfig.policy,
                        help="the outer loop's policy: predictive (budgets from each pod's predicted memory, overload "
                             "mode from SLO attainment) or threshold (AIMD on skew, memory and refusal thresholds, "
                             "the policy before issue 30); default: %(default)s")
    parser.add_argument("--allow-secrets", action="store_true",
                        help="serve specs that mount Secrets or read them into env (template.volumes[].secret, "
                             "template.extraEnv[].valueFrom.secretKeyRef); default: refuse them")
    parser.add_argument("--allow-host-path-models", action="store_true",
                        help="serve spec.model.source.hostPath (a node directory; for single-node and "
                             "development clusters: it gives whoever may create a MoEInferenceService read "
                             "access to that directory of the node)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    try:
        config = OperatorConfig(prometheus_url=args.prometheus_url or None,
                                timer_interval_seconds=args.timer_interval_seconds,
                                peering_lifetime_seconds=args.peering_lifetime_seconds,
                                allow_secrets=args.allow_secrets,
                                allow_host_path_models=args.allow_host_path_models,
                                prometheus_ca_file=args.prometheus_ca_file or None,
                                allowed_prometheus_urls=tuple(args.allowed_prometheus_url),
                                look_deadline_seconds=args.look_deadline_seconds,
                                leak_warmup_seconds=args.leak_warmup_seconds,
                                policy=args.policy,
                                test_pause_at=os.environ.get(TEST_PAUSE_ENV) or None)
    except ValueError as exc:
        parser.error(str(exc))
    return args, config


def check_ca_file(path: str | None) -> str | None:
    """Why ``--prometheus-ca-file`` cannot serve (unreadable, or no certificate in it), or None.

    Checked at start-up so that a broken bundle stops the operator with that reason (a crash loop
    that names the file) instead of making every look blind with ``PrometheusTLSError``.
    """
    if path is None:
        return None
    try:
        observe.tls_context(path)
    except (OSError, ssl.SSLError) as exc:
        return f"--prometheus-ca-file {path}: {exc}"
    return None


def main(argv: list[str] | None = None) -> None:
    args, config = parse_args(argv)
    problem = check_ca_file(config.prometheus_ca_file)
    if problem is not None:
        raise SystemExit(f"moeguard operator: {problem}")
    registry = kopf.OperatorRegistry()
    handlers.register(config, registry)
    if args.metrics_port is not None:
        prometheus_client.start_http_server(args.metrics_port, addr="0.0.0.0")
    kopf.configure(verbose=args.log_level == "DEBUG", quiet=args.log_level in ("WARNING", "ERROR"))
    if args.log_level != "DEBUG":
        for handler in logging.getLogger().handlers:
            handler.addFilter(_QuietRoutine())
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per Prometheus query otherwise
    priority = args.priority
    if args.peering and priority is None:
        # kopf pauses *every* operator when two peers share a priority; replicas of one
        # Deployment get the same flags, so each draws its own.
        priority = secrets.randbelow(2**31 - 1) + 1
    kopf.run(
        registry=registry,
        clusterwide=args.all_namespaces or not args.namespace,
        namespaces=args.namespace,
        standalone=args.standalone or None,
        peering_name=args.peering,
        priority=priority,
        liveness_endpoint=args.liveness,
    )


if __name__ == "__main__":
    main()
