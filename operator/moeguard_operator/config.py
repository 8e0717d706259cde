"""The operator's own configuration, set once from the command line and read from kopf's ``memo``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moeguard_operator.loop.observation import LEAK_WARMUP_SECONDS

TEST_PAUSE_POINTS = ("after-configmap", "after-status")
"""Where a decision's writes may be paused by a test (``MOEGUARD_TEST_PAUSE_AT``): after the budget ConfigMap,
after the status patch."""
TEST_PAUSE_ENV = "MOEGUARD_TEST_PAUSE_AT"
POLICIES = ("threshold", "predictive")
"""The outer loop's budget and overload policies (``--policy``): ``predictive``
(:mod:`moeguard_operator.loop.predictive`: budgets from the predicted memory, overload mode from SLO attainment; the
default, issue 30) and ``threshold`` (:mod:`moeguard_operator.loop.policy`: AIMD on skew, memory and refusal
thresholds, issue 11; it halves budgets on thresholds that need not threaten memory, bench/RESULTS.md)."""
MEMO_KEY = "config"
"""Key of the :class:`OperatorConfig` in kopf's operator-wide memo (each resource's memo copies it)."""


@dataclass(frozen=True)
class OperatorConfig:
    """How this operator process runs.

    Attributes:
        prometheus_url: Prometheus base URL for resources whose ``spec.control.prometheusUrl`` is
            unset; None: no default (those resources report MetricsAvailable=False).
        timer_interval_seconds: the control loop's tick: the longest it sleeps between two passes over the
            services, seconds (a watch event wakes it at once; Prometheus is asked only every
            ``control.queryIntervalSeconds``). Flag ``--timer-interval-seconds``.
        look_deadline_seconds: the deadline of one look at one Prometheus URL (all the services due there),
            seconds: past it, the look is blind for those services, and that URL gets no new look until the
            late one returns. Flag ``--look-deadline-seconds``.
        test_pause_at: test only: a point of a decision's writes (``after-configmap``, ``after-status``) where
            the write blocks, for a test to ``kill -9`` the operator there (environment variable
            ``MOEGUARD_TEST_PAUSE_AT``); None in production.
        peering_lifetime_seconds: seconds after which a standby replica takes over from an
            active one that stopped renewing its peering lease (kopf's default: 60).
        allow_secrets: whether a spec may put Secrets into the worker pods (``template.volumes[].secret``,
            ``template.extraEnv[].valueFrom.secretKeyRef``); False: such a spec is stalled
            (``SecretsNotAllowed``). Flag ``--allow-secrets``, chart value ``operator.allowSecrets``.
        allow_host_path_models: whether a ``spec.model.source.hostPath`` is served (single-node and
            development clusters); off: such a spec is Stalled with reason ``HostPathNotAllowed``.
        prometheus_ca_file: PEM bundle that Prometheus's TLS certificate is verified against (flag
            ``--prometheus-ca-file``, chart value ``operator.prometheus.caBundle``); None: the system trust
            store. Verification is never off.
        allowed_prometheus_urls: the URLs a ``spec.control.prometheusUrl`` may name besides ``prometheus_url``
            (flag ``--allowed-prometheus-url``, repeatable; chart value ``operator.prometheus.allowedUrls``),
            compared exactly after dropping a trailing ``/``; any other is stalled (``PrometheusURLNotAllowed``):
            the operator fetches that URL from inside the cluster (SSRF).
        leak_warmup_seconds: a worker's warm-up, seconds, before its leak window may start
            (:data:`moeguard_operator.loop.observation.LEAK_WARMUP_SECONDS` by default; flag ``--leak-warmup-seconds``).
            Only tests shorten it, so that a leak judgement does not wait a minute and a half.
        policy: the outer loop's policy, one of :data:`POLICIES` (flag ``--policy``, chart value
            ``operator.policy``; default ``predictive``: in the headline benchmark (bench/RESULTS.md) it served more
            SLO goodput than ``threshold`` side by side, with no OOM kill in any repetition).
    """

    prometheus_url: str | None = None
    timer_interval_seconds: float = 1.0
    look_deadline_seconds: float = 10.0
    peering_lifetime_seconds: int = 60
    allow_secrets: bool = False
    allow_host_path_models: bool = False
    prometheus_ca_file: str | None = None
    allowed_prometheus_urls: tuple[str, ...] = ()
    test_pause_at: str | None = None
    leak_warmup_seconds: float = LEAK_WARMUP_SECONDS
    policy: str = "predictive"

    @property
    def prometheus_urls(self) -> tuple[str, ...]:
        """Every Prometheus URL a spec may name: the operator's own and the allowed ones."""
        return tuple(u for u in (self.prometheus_url, *self.allowed_prometheus_urls) if u)

    def __post_init__(self) -> None:
        if self.timer_interval_seconds <= 0:
            raise ValueError(f"timer_interval_seconds must be above 0 (got {self.timer_interval_seconds})")
        if self.look_deadline_seconds <= 0:
            raise ValueError(f"look_deadline_seconds must be above 0 (got {self.look_deadline_seconds})")
        if self.test_pause_at not in (None, *TEST_PAUSE_POINTS):
            raise ValueError(f"test pause point must be one of {', '.join(TEST_PAUSE_POINTS)} "
                             f"(got {self.test_pause_at!r})")
        if self.leak_warmup_seconds < 0:
            raise ValueError(f"leak_warmup_seconds must be 0 or above (got {self.leak_warmup_seconds})")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)} (got {self.policy!r})")
        if self.peering_lifetime_seconds <= 0:
            raise ValueError(f"peering_lifetime_seconds must be above 0 (got {self.peering_lifetime_seconds})")


def from_memo(memo: Mapping[str, Any]) -> OperatorConfig:
    """The configuration stored in kopf's ``memo`` at startup.

    Raises:
        LookupError: no configuration was stored (the handlers were not registered with :func:`handlers.register`).
    """
    config = memo.get(MEMO_KEY)
    if not isinstance(config, OperatorConfig):
        raise LookupError("no OperatorConfig in kopf's memo: register the handlers with handlers.register()")
    return config
