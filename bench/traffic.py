"""The headline experiment's traffic: trace replay, a burst, a skew mix and a ramp, as one schedule.

``harness.loadgen`` sends a list of :class:`~harness.loadgen.client.RequestSpec` (prompt,
max_tokens, send time) and records what happened; this module only builds that list, the same
for every policy (everything is seeded), and labels each request with its phase.

* **trace**: the first ``trace_limit`` requests of the Azure conversation trace, arrival times
  divided by ``time_compression`` and lengths multiplied by ``length_scale``
  (:func:`harness.loadgen.load_schedule`); prompts are real text (the Python docs).
* **burst**: ``burst_n`` requests at one instant, a mix of short and long prompts.
* **skew**: a steady rate for ``skew_s`` seconds where a share of the prompts are repetitive
  (:func:`harness.loadgen.repetitive_prompt`: one or two letters, which send most token-slots to
  a few experts), the rest real text.
* **ramp**: an open-loop arrival rate climbing linearly from ``ramp_from_rps`` to
  ``ramp_to_rps``: in-flight requests climb until the worker refuses (the loadgen has no
  closed-loop mode; the concurrency reached is recorded per request by its send/end times).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

from harness.loadgen import RequestSpec, load_schedule, prompt_of_length, repetitive_prompt

PROMPT_STRIDE = 7919


@dataclass(frozen=True)
class TrafficConfig:
    """Every knob of the traffic; stored with each result."""

    max_context: int = 4095
    max_new_tokens_cap: int = 32
    time_compression: float = 1.0
    length_scale: float = 0.5
    trace_limit: int = 110
    burst_at_s: float = 24.0
    burst_n: int = 40
    burst_long_share: float = 0.3
    burst_short: tuple[int, int] = (64, 384)
    burst_long: tuple[int, int] = (1500, 3500)
    skew_at_s: float = 36.0
    skew_s: float = 14.0
    skew_rps: float = 2.5
    skew_share: float = 0.6
    skew_len: tuple[int, int] = (256, 1536)
    ramp_at_s: float = 56.0
    ramp_s: float = 16.0
    ramp_from_rps: float = 0.5
    ramp_to_rps: float = 9.0
    ramp_len: tuple[int, int] = (128, 1024)
    seed: int = 6

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Labeled:
    """A request to send and the phase it belongs to."""

    spec: RequestSpec
    phase: str
    skewed: bool = False


def ramp_arrivals(start_s: float, duration_s: float, from_rps: float, to_rps: float) -> list[float]:
    """Arrival times whose rate climbs linearly from ``from_rps`` to ``to_rps`` over
    ``duration_s``: the i-th arrival is where the cumulative rate integral reaches i."""
    if duration_s <= 0 or from_rps < 0 or to_rps < 0:
        raise ValueError("duration must be > 0 and rates >= 0")
    slope = (to_rps - from_rps) / duration_s
    total = (from_rps + to_rps) / 2 * duration_s
    times = []
    for i in range(int(total)):
        # solve from_rps * t + slope/2 * t^2 = i + 0.5
        target = i + 0.5
        if abs(slope) < 1e-12:
            t = target / from_rps
        else:
            t = (-from_rps + math.sqrt(from_rps ** 2 + 2 * slope * target)) / slope
        times.append(start_s + t)
    return times


def skew_mix(start_s: float, duration_s: float, rps: float, share: float, lengths: tuple[int, int],
             max_tokens: int, seed: int) -> list[Labeled]:
    """Requests at a steady ``rps``; a ``share`` of them repetitive (skewed), the rest real text."""
    rng = random.Random(seed)
    out = []
    for i in range(int(duration_s * rps)):
        n = rng.randint(*lengths)
        skewed = rng.random() < share
        prompt = repetitive_prompt(n, seed=seed + i) if skewed else prompt_of_length(
            n, offset=(seed + i) * PROMPT_STRIDE)
        out.append(Labeled(RequestSpec(prompt, max_tokens, start_s + i / rps), "skew", skewed))
    return out


def build(cfg: TrafficConfig) -> list[Labeled]:
    """The whole schedule, sorted by send time."""
    rng = random.Random(cfg.seed)
    out: list[Labeled] = []
    sched = load_schedule(time_compression=cfg.time_compression, length_scale=cfg.length_scale,
                          max_context=cfg.max_context, max_new_tokens_cap=cfg.max_new_tokens_cap,
                          limit=cfg.trace_limit)
    for r in sched.requests:
        out.append(Labeled(RequestSpec(prompt_of_length(r.prompt_tokens, offset=r.index * PROMPT_STRIDE),
                                       r.max_tokens, r.arrival_s), "trace"))
    for i in range(cfg.burst_n):
        lo, hi = cfg.burst_long if rng.random() < cfg.burst_long_share else cfg.burst_short
        n = rng.randint(lo, hi)
        out.append(Labeled(RequestSpec(prompt_of_length(n, offset=(10_000 + i) * PROMPT_STRIDE),
                                       cfg.max_new_tokens_cap, cfg.burst_at_s), "burst"))
    out += skew_mix(cfg.skew_at_s, cfg.skew_s, cfg.skew_rps, cfg.skew_share, cfg.skew_len,
                    cfg.max_new_tokens_cap, cfg.seed + 20_000)
    for i, t in enumerate(ramp_arrivals(cfg.ramp_at_s, cfg.ramp_s, cfg.ramp_from_rps, cfg.ramp_to_rps)):
        n = rng.randint(*cfg.ramp_len)
        out.append(Labeled(RequestSpec(prompt_of_length(n, offset=(30_000 + i) * PROMPT_STRIDE),
                                       cfg.max_new_tokens_cap, t), "ramp"))
    out.sort(key=lambda x: x.spec.at_s)
    return out


def describe(items: list[Labeled]) -> dict[str, Any]:
    """Counts and token totals per phase."""
    phases: dict[str, dict[str, Any]] = {}
    for it in items:
        p = phases.setdefault(it.phase, {"requests": 0, "prompt_tokens": 0, "max_tokens": 0, "skewed": 0,
                                         "first_s": it.spec.at_s, "last_s": it.spec.at_s})
        p["requests"] += 1
        p["prompt_tokens"] += len(it.spec.prompt)
        p["max_tokens"] += it.spec.max_tokens
        p["skewed"] += int(it.skewed)
        p["last_s"] = max(p["last_s"], it.spec.at_s)
    return phases
