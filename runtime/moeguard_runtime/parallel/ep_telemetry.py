"""Per-rank metrics of an expert-parallel group (issue 15); names in :mod:`moeguard_core.contract`.

Every series carries the worker's identity labels and a ``rank`` label (the leader exports one series per
rank for the tokens and the RSS it gathers; a follower exports its own). The EP balancedness is vLLM
EPLB's and SGLang's ``mean / max`` of token-slots per rank, per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from moeguard_core import contract
from moeguard_runtime.parallel.expert_parallel import StepCounters, balancedness

COLLECTIVE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class EpMetrics:
    """The group's metrics in ``registry``; ``labels``: the worker's identity labels."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str], rank: int, ranks: int,
                 experts: tuple[int, int]) -> None:
        self.labels, self.rank, self.ranks = labels, rank, ranks
        base = list(labels)
        self.rank_tokens = Counter(contract.METRIC_EP_RANK_TOKENS_TOTAL.removesuffix("_total"),
                                   "Token-slots routed to each rank's experts.", [*base, "layer", "rank"],
                                   registry=registry)
        self.balancedness = Gauge(contract.METRIC_EP_BALANCEDNESS_RATIO,
                                  "Mean / max token-slots per rank, last step (EPLB balancedness).",
                                  [*base, "layer"], registry=registry)
        self.collective = Histogram(contract.METRIC_EP_COLLECTIVE_SECONDS,
                                    "Wall time of a step in the group's collectives.", [*base, "rank"],
                                    registry=registry, buckets=COLLECTIVE_BUCKETS)
        self.rss = Gauge(contract.METRIC_EP_RANK_RSS_BYTES, "Resident set size of each rank's process.",
                         [*base, "rank"], registry=registry)
        self.info = Gauge(contract.METRIC_EP_RANK_INFO, "This rank's place in its expert-parallel group.",
                          [*base, "rank", "ranks", "experts", "role"], registry=registry)
        self.up = Gauge(contract.METRIC_EP_GROUP_UP, "1 while this rank is in a working group.", base,
                        registry=registry)
        self.info.labels(**labels, rank=str(rank), ranks=str(ranks), experts=f"{experts[0]}-{experts[1]}",
                         role="leader" if rank == 0 else "follower").set(1)
        self.up.labels(**labels).set(0)

    def set_up(self, up: bool) -> None:
        self.up.labels(**self.labels).set(1 if up else 0)

    def observe_leader_step(self, counters: StepCounters) -> None:
        """One step of the leader: every layer's token-slots per rank and balancedness, its collective time."""
        for layer, per_rank in enumerate(counters.per_layer_ranks):
            for r, n in enumerate(per_rank):
                if n:
                    self.rank_tokens.labels(**self.labels, layer=str(layer), rank=str(r)).inc(n)
            self.balancedness.labels(**self.labels, layer=str(layer)).set(balancedness(per_rank))
        if counters.layers:
            self.collective.labels(**self.labels, rank=str(self.rank)).observe(counters.collective_s)

    def observe_follower_layer(self, layer: int, slots: int) -> None:
        if slots:
            self.rank_tokens.labels(**self.labels, layer=str(layer), rank=str(self.rank)).inc(slots)

    def observe_collective(self, seconds: float) -> None:
        self.collective.labels(**self.labels, rank=str(self.rank)).observe(seconds)

    def set_rss(self, per_rank: Sequence[int | None]) -> None:
        """RSS of each rank (bytes; None: unknown, the series is left as it was)."""
        for r, v in enumerate(per_rank):
            if v is not None:
                self.rss.labels(**self.labels, rank=str(r)).set(v)

    def set_own_rss(self, rss: int) -> None:
        self.rss.labels(**self.labels, rank=str(self.rank)).set(rss)
