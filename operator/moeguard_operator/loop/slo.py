"""SLO attainment from the worker's latency histograms, pure.

The attainment of an objective over a window is the share of the window's requests whose latency met it
(DistServe's per-request SLOs, Zhong et al., OSDI 2024: TTFT and TPOT; the goodput the headline measures in
``bench/slo.py``). From a classic Prometheus histogram it is the cumulative count at the objective over the
total count (the ``+Inf`` bucket). An objective between two bucket bounds is interpolated linearly within its
bucket, the assumption ``histogram_quantile`` makes (Prometheus documentation, "Histograms and summaries"): exact
when the objective is a bound (``contract.TTFT_BUCKETS`` and ``contract.TPOT_BUCKETS`` hold the defaults).

Refused requests (429, 503) got no first token and are in neither histogram: attainment is over the answered
requests. Refusals are the inner loop doing its job, and the refusal rate is reported on its own
(``status.observed.rejectionRatePerSecond``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from moeguard_operator.loop.observation import ClassLatency
from moeguard_operator.spec.models import SloAttainment, SloSpec

Buckets = Sequence[tuple[float, float]]


def count(buckets: Buckets) -> float | None:
    """The histogram's total count in the window (its ``+Inf`` bucket); None without one."""
    return next((n for le, n in buckets if math.isinf(le)), None)


def share_within(buckets: Buckets, target: float) -> float | None:
    """Share of the window's observations at or below ``target`` (seconds), from cumulative ``(le, count)``
    buckets (``le`` ascending, ``+Inf`` last), linearly interpolated within the bucket holding ``target`` (the
    first bucket's lower bound is 0); None when the window holds no observation (no data, never 1).

    Raises:
        ValueError: ``target`` is not above 0.
    """
    if target <= 0:
        raise ValueError(f"target must be above 0 (got {target})")
    total = count(buckets)
    if not total or total <= 0:
        return None
    below_le, below_n = 0.0, 0.0
    for le, n in buckets:
        if target <= le:
            if math.isinf(le):
                return min(1.0, below_n / total)  # above the last finite bound: only what is known below it
            within = below_n + (n - below_n) * (target - below_le) / (le - below_le) if le > below_le else n
            return max(0.0, min(1.0, within / total))
        below_le, below_n = le, n
    return min(1.0, below_n / total)


@dataclass(frozen=True)
class Attainment:
    """One class's attainment of its objectives over the window.

    Attributes:
        priority: the class.
        requests, finished: the TTFT and TPOT histograms' counts (None: no histogram).
        ttft, tpot: the shares that met each objective (None: no request in the window).
        target: the class's ``attainment`` target.
        judged: both counts reach ``spec.slo.minRequests`` and both shares are known.
    """

    priority: str
    requests: float | None
    finished: float | None
    ttft: float | None
    tpot: float | None
    target: float
    judged: bool

    @property
    def met(self) -> bool | None:
        """Both shares at or above the target; None unless :attr:`judged`."""
        if not self.judged or self.ttft is None or self.tpot is None:
            return None
        return self.ttft >= self.target and self.tpot >= self.target

    @property
    def tpot_met(self) -> bool | None:
        """The TPOT share at or above the target; None unless :attr:`judged`."""
        if not self.judged or self.tpot is None:
            return None
        return self.tpot >= self.target

    def status(self) -> SloAttainment:
        """As ``status.observed.slo`` shows it (shares and counts rounded to 3 and 1 digits)."""
        def r(v: float | None, digits: int) -> float | None:
            return None if v is None else round(v, digits)
        return SloAttainment(priority=self.priority, requests=r(self.requests, 1), ttft_attainment=r(self.ttft, 3),
                             finished=r(self.finished, 1), tpot_attainment=r(self.tpot, 3), target=self.target,
                             met=self.met)

    def message(self) -> str:
        """One sentence: the shares, the target and the counts."""
        def pct(v: float | None) -> str:
            return "unknown" if v is None else f"{v:.0%}"
        return (f"{self.priority} SLO attainment TTFT {pct(self.ttft)}, TPOT {pct(self.tpot)} (target "
                f"{self.target:.0%}; {self.requests or 0:.0f} first tokens, {self.finished or 0:.0f} answers)")


def attainments(latency: Sequence[ClassLatency], slo: SloSpec) -> tuple[Attainment, ...]:
    """Each known class's attainment (``interactive``, ``batch``; others ignored) of ``slo`` over the window's
    histograms, in that order; a class without histograms is left out."""
    by_class = {c.priority: c for c in latency}
    out: list[Attainment] = []
    for priority in ("interactive", "batch"):
        hist = by_class.get(priority)
        if hist is None:
            continue
        target = slo.target(priority)
        requests, finished = count(hist.ttft), count(hist.tpot)
        ttft, tpot = share_within(hist.ttft, target.ttft_seconds), share_within(hist.tpot, target.tpot_seconds)
        judged = (ttft is not None and tpot is not None and (requests or 0) >= slo.min_requests
                  and (finished or 0) >= slo.min_requests)
        out.append(Attainment(priority, requests, finished, ttft, tpot, target.attainment, judged))
    return tuple(out)
